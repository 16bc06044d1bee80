"""Storage: the control database, one database per organization (``stores``, ``d1_stores``), the bounded pool of
open handles (``pool``), the handles bound to one organization that services get (``scoped``), the schema
migrations (``migrate``), and the conversion of a single-database data directory (``convert``)."""
