-- Migration number: 0004 — the documents whose keyword text changed (captured, content edited, deleted), in order.
-- The embedded service keeps a tantivy index of its large organizations' thoughts beside their database
-- (services/adapters/keyword_index.py); it answers a search only once it has applied this log's last entry, and
-- FTS5 (documents_fts) answers otherwise, so a capture is keyword-searchable as soon as it is acknowledged.
-- The log keeps its last 100,000 entries (an index further behind is rebuilt from documents): on D1, which ranks
-- with FTS5 alone, it stays bounded. seq has no AUTOINCREMENT: only the oldest rows are ever deleted, so
-- max(seq) + 1 is always new.
CREATE TABLE keyword_changes (
  seq             INTEGER PRIMARY KEY,
  organization_id TEXT NOT NULL,
  document_id     TEXT NOT NULL
);

CREATE TRIGGER keyword_changes_bound AFTER INSERT ON keyword_changes BEGIN
  DELETE FROM keyword_changes WHERE seq <= new.seq - 100000;
END;

CREATE TRIGGER keyword_changes_insert AFTER INSERT ON documents BEGIN
  INSERT INTO keyword_changes (organization_id, document_id) VALUES (new.organization_id, new.id);
END;

CREATE TRIGGER keyword_changes_update AFTER UPDATE OF content ON documents BEGIN
  INSERT INTO keyword_changes (organization_id, document_id) VALUES (new.organization_id, new.id);
END;

CREATE TRIGGER keyword_changes_delete AFTER DELETE ON documents BEGIN
  INSERT INTO keyword_changes (organization_id, document_id) VALUES (old.organization_id, old.id);
END;
