-- Migration number: 0004 — enrichment (second-brain-design §4.1, §7.1, §7.2): importance and the enrichment
-- state on documents, the organization's tag vocabulary (kept exact by triggers, whoever writes tags), the
-- per-organization daily LLM budget, and the two-pass backfill checkpoint. Plain SQLite that D1 accepts.

-- 1-5 from enrichment (NULL = unknown: not enriched yet, or enrichment failed / was skipped).
ALTER TABLE documents ADD COLUMN importance INTEGER;
-- NULL: not enriched yet (job pending, or a pre-enrichment row); 'llm' | 'extractive': enriched by the model
-- or by the deterministic extractor; 'failed': the model failed (empty fields); 'skipped_budget': the
-- organization's daily LLM budget was spent (empty fields). The backfill picks up NULL, failed and skipped.
ALTER TABLE documents ADD COLUMN enrichment_state TEXT;
ALTER TABLE documents ADD COLUMN enriched_at INTEGER;
CREATE INDEX documents_unenriched ON documents(organization_id, id)
  WHERE enrichment_state IS NULL OR enrichment_state IN ('failed', 'skipped_budget');

-- How many of an organization's documents carry each tag: the vocabulary offered to the model for reuse.
CREATE TABLE tag_counts (
  organization_id TEXT NOT NULL,
  tag             TEXT NOT NULL,
  uses            INTEGER NOT NULL DEFAULT 0,
  PRIMARY KEY (organization_id, tag)
);
CREATE INDEX tag_counts_top ON tag_counts(organization_id, uses DESC, tag);

INSERT INTO tag_counts (organization_id, tag, uses)
  SELECT d.organization_id, j.value, COUNT(*)
  FROM documents d, json_each(CASE WHEN json_valid(d.tags) THEN d.tags ELSE '[]' END) j
  WHERE j.type = 'text'
  GROUP BY d.organization_id, j.value;

CREATE TRIGGER documents_tags_insert AFTER INSERT ON documents WHEN new.tags IS NOT NULL BEGIN
  INSERT INTO tag_counts (organization_id, tag, uses)
    SELECT DISTINCT new.organization_id, value, 1
    FROM json_each(CASE WHEN json_valid(new.tags) THEN new.tags ELSE '[]' END) WHERE type = 'text'
    ON CONFLICT(organization_id, tag) DO UPDATE SET uses = uses + 1;
END;

CREATE TRIGGER documents_tags_update AFTER UPDATE OF tags ON documents BEGIN
  UPDATE tag_counts SET uses = uses - 1
    WHERE organization_id = old.organization_id
      AND tag IN (SELECT value FROM json_each(CASE WHEN json_valid(old.tags) THEN old.tags ELSE '[]' END) WHERE type = 'text');
  INSERT INTO tag_counts (organization_id, tag, uses)
    SELECT DISTINCT new.organization_id, value, 1
    FROM json_each(CASE WHEN json_valid(new.tags) THEN new.tags ELSE '[]' END) WHERE type = 'text'
    ON CONFLICT(organization_id, tag) DO UPDATE SET uses = uses + 1;
  DELETE FROM tag_counts WHERE organization_id = old.organization_id AND uses <= 0;
END;

CREATE TRIGGER documents_tags_delete AFTER DELETE ON documents WHEN old.tags IS NOT NULL BEGIN
  UPDATE tag_counts SET uses = uses - 1
    WHERE organization_id = old.organization_id
      AND tag IN (SELECT value FROM json_each(CASE WHEN json_valid(old.tags) THEN old.tags ELSE '[]' END) WHERE type = 'text');
  DELETE FROM tag_counts WHERE organization_id = old.organization_id AND uses <= 0;
END;

-- LLM calls and tokens per organization per UTC day ('YYYY-MM-DD'). A call reserves itself with one
-- UPSERT ... RETURNING that succeeds only under the limits; `refused` counts the calls the budget stopped.
CREATE TABLE llm_usage (
  organization_id TEXT NOT NULL,
  day             TEXT NOT NULL,
  calls           INTEGER NOT NULL DEFAULT 0,
  tokens          INTEGER NOT NULL DEFAULT 0,
  refused         INTEGER NOT NULL DEFAULT 0,
  PRIMARY KEY (organization_id, day)
);

-- The two-pass enrichment backfill of one organization: where it is (resumable), and pass 1's tags (the
-- vocabulary seed pass 2 offers to the model).
CREATE TABLE enrichment_backfill (
  organization_id TEXT PRIMARY KEY,
  pass            INTEGER NOT NULL,            -- 1: seeding the vocabulary, 2: persisting, 3: done
  cursor          TEXT NOT NULL DEFAULT '',    -- the last document id handled in this pass
  seed            TEXT NOT NULL DEFAULT '{}',  -- pass 1's tags: {"tag": count}
  processed       INTEGER NOT NULL DEFAULT 0,  -- documents handled by this run, both passes
  started_at      INTEGER NOT NULL,
  updated_at      INTEGER NOT NULL
);
