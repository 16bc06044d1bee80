-- Migration number: 0006 — a keyword index over whole thoughts (BM25 per document, not per chunk).
-- Plain SQLite that D1 accepts: no BEGIN/COMMIT, no PRAGMA. organization_id leads every key and index.
--
-- Thought search scores the keyword side on the whole document (BEIR SciFact test nDCG@10 73.56 -> 74.3,
-- bench/README.md); conversations keep chunk-level keyword search over chunks_fts.

-- The FTS rows need a stable integer key: documents' implicit rowid may be renumbered by VACUUM (the table has
-- a composite primary key), so a small key table hands one out per (organization, document) and lets the
-- delete trigger remove the FTS row by rowid instead of scanning the FTS table.
CREATE TABLE documents_fts_keys (
  pk              INTEGER PRIMARY KEY,         -- the documents_fts rowid
  organization_id TEXT NOT NULL,
  document_id     TEXT NOT NULL,
  UNIQUE (organization_id, document_id)
);

CREATE VIRTUAL TABLE documents_fts USING fts5(
  content, organization_id UNINDEXED, document_id UNINDEXED, tokenize = 'porter unicode61'
);

-- Kept in step with documents by triggers (capture, merge / replace, delete all write documents rows).
CREATE TRIGGER documents_fts_insert AFTER INSERT ON documents BEGIN
  INSERT INTO documents_fts_keys (organization_id, document_id) VALUES (new.organization_id, new.id);
  INSERT INTO documents_fts (rowid, content, organization_id, document_id)
    SELECT pk, new.content, new.organization_id, new.id FROM documents_fts_keys
    WHERE organization_id = new.organization_id AND document_id = new.id;
END;
CREATE TRIGGER documents_fts_delete AFTER DELETE ON documents BEGIN
  DELETE FROM documents_fts WHERE rowid IN (
    SELECT pk FROM documents_fts_keys WHERE organization_id = old.organization_id AND document_id = old.id
  );
  DELETE FROM documents_fts_keys WHERE organization_id = old.organization_id AND document_id = old.id;
END;
CREATE TRIGGER documents_fts_update AFTER UPDATE OF content ON documents BEGIN
  DELETE FROM documents_fts WHERE rowid IN (
    SELECT pk FROM documents_fts_keys WHERE organization_id = old.organization_id AND document_id = old.id
  );
  INSERT INTO documents_fts (rowid, content, organization_id, document_id)
    SELECT pk, new.content, new.organization_id, new.id FROM documents_fts_keys
    WHERE organization_id = new.organization_id AND document_id = new.id;
END;

-- Existing thoughts.
INSERT INTO documents_fts_keys (organization_id, document_id) SELECT organization_id, id FROM documents;
INSERT INTO documents_fts (rowid, content, organization_id, document_id)
  SELECT k.pk, d.content, d.organization_id, d.id
  FROM documents_fts_keys k JOIN documents d ON d.organization_id = k.organization_id AND d.id = k.document_id;
