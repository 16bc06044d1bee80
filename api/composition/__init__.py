"""The composition root: the one place that reads the settings to choose adapters and build them.

``backend`` builds every backend a process runs on (``build_backend``: the control database, where
organizations' databases and vectors live, the embedder, the language model, the reranker) and the openers of
the single-database conversion; ``cloudflare`` builds the Cloudflare adapters from the settings (one request
budget per HTTP client); ``check`` is ``memex cloudflare check``, which builds them to probe a configuration.

Nothing else imports ``services.adapters`` (tests/test_architecture.py): services see ports, ``api.wiring``
hands them organization-bound handles over what this package built.
"""
