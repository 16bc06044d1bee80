-- Migration number: 0003 — asynchronous vector writes (Vectorize): a chunk's vector is written (indexed_at)
-- but counts as searchable only once the index has applied its mutation (vector_mutation back to NULL).
-- Until then keyword search covers it. The local index applies writes at once and never sets it.
ALTER TABLE chunks ADD COLUMN vector_mutation TEXT;
-- A system index for the worker, which confirms mutations across organizations.
CREATE INDEX chunks_unconfirmed ON chunks(vector_mutation) WHERE vector_mutation IS NOT NULL;
