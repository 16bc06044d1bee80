"""Whole-organization bundles: one organization's data as versioned JSON Lines, exported and imported
(docs/export-bundle.md)."""
