"""Enrichment: a summary, tags and an importance on every thought (``enrichment``), the backfill of the rows
without (``backfill``), the deterministic extractors it falls back on (``tagging``), and each organization's daily
language-model budget (``llm_budget``)."""
