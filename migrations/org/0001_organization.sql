-- Migration number: 0001 — one organization's database: thoughts, chunks and their keyword indexes, jobs,
-- conversations, history, links, tags and enrichment state. Every organization has its own (an embedded
-- orgs/<id>/memex.sqlite3, or a D1 database per organization), so keyword statistics (BM25's document
-- frequencies and lengths), sizes and timings are the organization's alone. Rows keep organization_id, as
-- defence in depth. Plain SQLite that D1 accepts: no BEGIN/COMMIT, no PRAGMA.
--
-- The schema is the organization half of migrations/legacy/0001..0010 as those files left it, without the
-- foreign keys to organizations (that table lives in the control database).

CREATE TABLE documents (
  organization_id TEXT NOT NULL,
  id              TEXT NOT NULL,
  content         TEXT NOT NULL,
  content_hash    TEXT NOT NULL,               -- SHA-256 hex of content: capture is idempotent on it
  source          TEXT,
  metadata        TEXT NOT NULL DEFAULT '{}',
  summary         TEXT,
  tags            TEXT,                        -- JSON array of kebab-case tags
  created_at      INTEGER NOT NULL,            -- epoch ms
  updated_at      INTEGER NOT NULL, importance INTEGER, enrichment_state TEXT, enriched_at INTEGER, recall_count INTEGER NOT NULL DEFAULT 0, use_weight REAL NOT NULL DEFAULT 0, use_count INTEGER NOT NULL DEFAULT 0, last_used_at INTEGER,
  PRIMARY KEY (organization_id, id),
  UNIQUE (organization_id, content_hash)
);

CREATE INDEX documents_recent ON documents(organization_id, created_at DESC, id DESC);

CREATE TABLE chunks (
  pk              INTEGER PRIMARY KEY,         -- stable rowid shared with chunks_fts
  organization_id TEXT NOT NULL,
  id              TEXT NOT NULL,               -- the vector id (prefixed with the org id in the index)
  kind            TEXT NOT NULL,               -- 'thought' | 'conversation'
  parent_id       TEXT NOT NULL,
  ordinal         INTEGER NOT NULL,
  content         TEXT NOT NULL,               -- exactly what was embedded
  token_count     INTEGER NOT NULL,
  start_sequence  INTEGER,                     -- conversation windows: the message range
  end_sequence    INTEGER,
  indexed_at      INTEGER, vector_mutation TEXT,                     -- NULL until its vector is in the index
  UNIQUE (organization_id, id)
);

CREATE INDEX chunks_by_parent ON chunks(organization_id, kind, parent_id, ordinal);

CREATE INDEX chunks_pending ON chunks(organization_id, parent_id) WHERE indexed_at IS NULL;

CREATE TRIGGER documents_delete_chunks AFTER DELETE ON documents BEGIN
  DELETE FROM chunks WHERE organization_id = old.organization_id AND kind = 'thought' AND parent_id = old.id;
END;

CREATE VIRTUAL TABLE chunks_fts USING fts5(
  content, organization_id UNINDEXED, kind UNINDEXED, tokenize = 'porter unicode61'
);

CREATE TRIGGER chunks_fts_insert AFTER INSERT ON chunks BEGIN
  INSERT INTO chunks_fts(rowid, content, organization_id, kind) VALUES (new.pk, new.content, new.organization_id, new.kind);
END;

CREATE TRIGGER chunks_fts_delete AFTER DELETE ON chunks BEGIN
  DELETE FROM chunks_fts WHERE rowid = old.pk;
END;

CREATE TABLE jobs (
  id              INTEGER PRIMARY KEY AUTOINCREMENT,
  organization_id TEXT NOT NULL,
  kind            TEXT NOT NULL,
  target_id       TEXT NOT NULL,
  state           TEXT NOT NULL DEFAULT 'pending',   -- pending / done / failed
  attempts        INTEGER NOT NULL DEFAULT 0,
  run_after       INTEGER NOT NULL,
  locked_until    INTEGER,
  last_error      TEXT,
  created_at      INTEGER NOT NULL
);

CREATE INDEX jobs_ready ON jobs(state, run_after);

CREATE INDEX jobs_by_target ON jobs(organization_id, kind, target_id);

CREATE TABLE conversations (
  organization_id TEXT NOT NULL,
  id              TEXT NOT NULL,
  title           TEXT,
  metadata        TEXT NOT NULL DEFAULT '{}',
  message_count   INTEGER NOT NULL DEFAULT 0,
  -- The append claim: one UPDATE ... SET last_sequence = last_sequence + n WHERE last_sequence = expected
  -- opens every append batch; its append_token (fresh per attempt) gates every other statement of the
  -- batch, so a lost claim changes nothing. Sequences are contiguous from 1 and never collide.
  last_sequence   INTEGER NOT NULL DEFAULT 0,
  append_token    TEXT,
  created_at      INTEGER NOT NULL,            -- epoch ms
  updated_at      INTEGER NOT NULL,            -- epoch ms; moves on every append (recent-first listing)
  PRIMARY KEY (organization_id, id)
);

CREATE INDEX conversations_recent ON conversations(organization_id, updated_at DESC, id DESC);

CREATE TABLE messages (
  organization_id  TEXT NOT NULL,
  id               TEXT NOT NULL,
  conversation_id  TEXT NOT NULL,
  sequence         INTEGER NOT NULL,           -- server-assigned, contiguous from 1 per conversation
  role             TEXT NOT NULL CHECK (role IN ('user', 'assistant', 'system', 'tool')),
  content          TEXT NOT NULL,              -- as content_encoding says
  -- NULL: legacy, stored as given; 'raw': checked, under 128 bytes, stored as given;
  -- 'gzip+base64': base64 of the gzip of the UTF-8 bytes.
  content_encoding TEXT CHECK (content_encoding IS NULL OR content_encoding IN ('raw', 'gzip+base64')),
  metadata         TEXT NOT NULL DEFAULT '{}',
  client_id        TEXT,                       -- the caller's message id: a retried append is a no-op
  created_at       INTEGER NOT NULL, session TEXT,
  PRIMARY KEY (organization_id, id),
  UNIQUE (organization_id, conversation_id, sequence),
  UNIQUE (organization_id, conversation_id, client_id)
);

CREATE INDEX messages_uncompressed ON messages(organization_id, id) WHERE content_encoding IS NULL;

CREATE TABLE conversation_idempotency (
  organization_id TEXT NOT NULL,
  key             TEXT NOT NULL,
  conversation_id TEXT NOT NULL,
  request_hash    TEXT NOT NULL,               -- SHA-256 of the request: the same key with another body is 409
  response        TEXT NOT NULL,               -- JSON of the original result
  created_at      INTEGER NOT NULL,
  PRIMARY KEY (organization_id, key)
);

CREATE INDEX conversation_idempotency_by_conversation ON conversation_idempotency(organization_id, conversation_id);

CREATE INDEX conversation_idempotency_by_age ON conversation_idempotency(organization_id, created_at);

CREATE TRIGGER conversations_delete_children AFTER DELETE ON conversations BEGIN
  DELETE FROM messages WHERE organization_id = old.organization_id AND conversation_id = old.id;
  DELETE FROM chunks WHERE organization_id = old.organization_id AND kind = 'conversation' AND parent_id = old.id;
  DELETE FROM conversation_idempotency WHERE organization_id = old.organization_id AND conversation_id = old.id;
  DELETE FROM jobs WHERE organization_id = old.organization_id AND kind = 'embed' AND target_id = old.id;
END;

CREATE INDEX chunks_unconfirmed ON chunks(vector_mutation) WHERE vector_mutation IS NOT NULL;

CREATE INDEX documents_unenriched ON documents(organization_id, id)
  WHERE enrichment_state IS NULL OR enrichment_state IN ('failed', 'skipped_budget');

CREATE TABLE tag_counts (
  organization_id TEXT NOT NULL,
  tag             TEXT NOT NULL,
  uses            INTEGER NOT NULL DEFAULT 0,
  PRIMARY KEY (organization_id, tag)
);

CREATE INDEX tag_counts_top ON tag_counts(organization_id, uses DESC, tag);

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

CREATE TABLE enrichment_backfill (
  organization_id TEXT PRIMARY KEY,
  pass            INTEGER NOT NULL,            -- 1: seeding the vocabulary, 2: persisting, 3: done
  cursor          TEXT NOT NULL DEFAULT '',    -- the last document id handled in this pass
  seed            TEXT NOT NULL DEFAULT '{}',  -- pass 1's tags: {"tag": count}
  processed       INTEGER NOT NULL DEFAULT 0,  -- documents handled by this run, both passes
  started_at      INTEGER NOT NULL,
  updated_at      INTEGER NOT NULL
);

CREATE TABLE thought_history (
  organization_id     TEXT NOT NULL,
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

CREATE INDEX thought_history_by_hash ON thought_history(organization_id, content_hash);

CREATE TABLE thought_links (
  organization_id TEXT NOT NULL,
  from_id         TEXT NOT NULL,
  to_id           TEXT NOT NULL,
  kind            TEXT NOT NULL CHECK (kind IN ('contradicts')),
  reason          TEXT,
  created_at      INTEGER NOT NULL,
  PRIMARY KEY (organization_id, from_id, to_id, kind)
);

CREATE INDEX thought_links_to ON thought_links(organization_id, to_id);

CREATE TRIGGER documents_delete_links AFTER DELETE ON documents BEGIN
  DELETE FROM thought_links WHERE organization_id = old.organization_id AND (from_id = old.id OR to_id = old.id);
END;

CREATE TABLE documents_fts_keys (
  pk              INTEGER PRIMARY KEY,         -- the documents_fts rowid
  organization_id TEXT NOT NULL,
  document_id     TEXT NOT NULL,
  UNIQUE (organization_id, document_id)
);

CREATE VIRTUAL TABLE documents_fts USING fts5(
  content, organization_id UNINDEXED, document_id UNINDEXED, tokenize = 'porter unicode61'
);

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

CREATE INDEX messages_by_time ON messages(organization_id, created_at);

CREATE TRIGGER conversations_delete_turns AFTER DELETE ON conversations BEGIN
  DELETE FROM chunks WHERE organization_id = old.organization_id AND kind = 'turn' AND parent_id = old.id;
END;

CREATE TRIGGER documents_delete_jobs AFTER DELETE ON documents BEGIN
  DELETE FROM jobs WHERE organization_id = old.organization_id AND target_id = old.id;
END;

CREATE TRIGGER conversations_delete_jobs AFTER DELETE ON conversations BEGIN
  DELETE FROM jobs WHERE organization_id = old.organization_id AND target_id = old.id;
END;
