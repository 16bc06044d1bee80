-- Migration number: 0005 — write-time decisions and ranking (memory-layer-lessons).
-- Plain SQLite that D1 accepts: no BEGIN/COMMIT, no PRAGMA. organization_id leads every key and index.

-- Ranking: how often search has returned a thought (frequency multiplier 1 + log1p(recall_count)).
ALTER TABLE documents ADD COLUMN recall_count INTEGER NOT NULL DEFAULT 0;

-- Originals superseded by a merge or a replace: nothing is silently lost. An entry stays (restorable) until an
-- explicit purge, also after its canonical thought is deleted.
CREATE TABLE thought_history (
  organization_id     TEXT NOT NULL REFERENCES organizations(id) ON DELETE CASCADE,
  id                  TEXT NOT NULL,
  thought_id          TEXT NOT NULL,           -- the canonical thought that superseded this original
  original_id         TEXT,                    -- the original thought's id (NULL: a merge's incoming content)
  action              TEXT NOT NULL CHECK (action IN ('merged', 'replaced')),
  reason              TEXT,
  content             TEXT NOT NULL,
  content_hash        TEXT NOT NULL,
  source              TEXT,
  metadata            TEXT NOT NULL DEFAULT '{}',
  summary             TEXT,
  tags                TEXT,
  original_created_at INTEGER NOT NULL,        -- epoch ms
  original_updated_at INTEGER NOT NULL,
  created_at          INTEGER NOT NULL,        -- when it moved here
  PRIMARY KEY (organization_id, id)
);
CREATE INDEX thought_history_by_thought ON thought_history(organization_id, thought_id, created_at);
-- A repeated capture of content that was merged or replaced answers with the canonical thought.
CREATE INDEX thought_history_by_hash ON thought_history(organization_id, content_hash);

-- Relations found at write time ('contradicts': the new thought conflicts with an existing one), shown on both.
CREATE TABLE thought_links (
  organization_id TEXT NOT NULL REFERENCES organizations(id) ON DELETE CASCADE,
  from_id         TEXT NOT NULL,
  to_id           TEXT NOT NULL,
  kind            TEXT NOT NULL CHECK (kind IN ('contradicts')),
  reason          TEXT,
  created_at      INTEGER NOT NULL,
  PRIMARY KEY (organization_id, from_id, to_id, kind)
);
CREATE INDEX thought_links_to ON thought_links(organization_id, to_id);

-- Deleting a thought (by any path: delete, replace, merge) removes its links.
CREATE TRIGGER documents_delete_links AFTER DELETE ON documents BEGIN
  DELETE FROM thought_links WHERE organization_id = old.organization_id AND (from_id = old.id OR to_id = old.id);
END;
