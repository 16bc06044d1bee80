-- Migration number: 0005 — the conversation chunks written or deleted, in order (0004's log, for chunks).
-- The embedded service keeps a tantivy index of its large organizations' conversation chunks beside their database
-- (services/adapters/keyword_index.py, ChunkKeywordIndex): conversation search's keyword side, answered by
-- chunks_fts when the index has not applied this log's last entry. Chunks are never edited (their text is what was
-- embedded), so inserts and deletes are all there is to log. Only a conversation's windows and single turns are
-- logged (the kinds the index holds). The log keeps its last 100,000 entries (an index further behind is rebuilt
-- from chunks): on D1, which ranks with FTS5 alone, it stays bounded. seq has no AUTOINCREMENT: only the oldest rows
-- are ever deleted, so max(seq) + 1 is always new.
CREATE TABLE chunk_keyword_changes (
  seq             INTEGER PRIMARY KEY,
  organization_id TEXT NOT NULL,
  chunk_pk        INTEGER NOT NULL
);

CREATE TRIGGER chunk_keyword_changes_bound AFTER INSERT ON chunk_keyword_changes BEGIN
  DELETE FROM chunk_keyword_changes WHERE seq <= new.seq - 100000;
END;

CREATE TRIGGER chunk_keyword_changes_insert AFTER INSERT ON chunks WHEN new.kind IN ('conversation', 'turn') BEGIN
  INSERT INTO chunk_keyword_changes (organization_id, chunk_pk) VALUES (new.organization_id, new.pk);
END;

CREATE TRIGGER chunk_keyword_changes_delete AFTER DELETE ON chunks WHEN old.kind IN ('conversation', 'turn') BEGIN
  INSERT INTO chunk_keyword_changes (organization_id, chunk_pk) VALUES (old.organization_id, old.pk);
END;
