"""Whole-organization bundles: one organization's data as versioned JSON Lines (docs/export-bundle.md). The
records (``records``), the export (``export``), the import (``importer``) and what each record becomes in the
organization's database (``rows``)."""
