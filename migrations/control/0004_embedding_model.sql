-- Migration number: 0004 — the embedding model each organization's vectors were made with. Vectors of two models
-- in one index mean nothing to each other's queries; on the Worker backend the index's own description cannot be
-- read, so the routing row records the model: set when the organization is provisioned (or, for a row from
-- before this migration, by the first instance that opens it), and by `memex reindex` when it has re-embedded
-- every chunk. An instance with another model refuses the organization (embedding_model_mismatch) and its job
-- worker leaves the organization's jobs to the instances of its model. Plain SQLite that D1 accepts.
ALTER TABLE org_databases ADD COLUMN embedding_model TEXT;
