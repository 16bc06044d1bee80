"""Text shared by the domains, with no storage and no model: chunking a text to an embedder's token limit
(``chunking``) and the times callers give and queries name (``temporal``)."""
