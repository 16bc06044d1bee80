"""Storage: the control database, one database per organization (``stores``), the bounded pool of open
handles (``pool``), and the conversion of a single-database data directory (``convert``)."""
