-- Migration number: 0001 — the foundation: organizations, credentials, thoughts, the job table.
-- Plain SQLite that D1 accepts: no BEGIN/COMMIT, no PRAGMA. organization_id leads every tenant key and index.

CREATE TABLE organizations (
  id          TEXT PRIMARY KEY,
  slug        TEXT NOT NULL UNIQUE,
  name        TEXT NOT NULL,
  status      TEXT NOT NULL DEFAULT 'active',
  created_at  INTEGER NOT NULL
);

CREATE TABLE api_keys (
  id              TEXT PRIMARY KEY,            -- the public key id, embedded in the raw key
  organization_id TEXT NOT NULL REFERENCES organizations(id) ON DELETE CASCADE,
  name            TEXT NOT NULL,
  prefix          TEXT NOT NULL,               -- what a dashboard shows: "mx_<id>_…"
  key_hash        TEXT NOT NULL,               -- argon2id PHC string; the raw key is never stored
  scopes          TEXT NOT NULL,               -- JSON array of read / write / admin
  created_at      INTEGER NOT NULL,
  expires_at      INTEGER,
  revoked_at      INTEGER,
  last_used_at    INTEGER
);
CREATE INDEX api_keys_by_org ON api_keys(organization_id, created_at);

-- Cloudflare Access: a user's email maps to a membership with a role ...
CREATE TABLE memberships (
  organization_id TEXT NOT NULL REFERENCES organizations(id) ON DELETE CASCADE,
  email           TEXT NOT NULL,               -- lower-cased
  role            TEXT NOT NULL,               -- owner / admin / member / viewer
  created_at      INTEGER NOT NULL,
  PRIMARY KEY (organization_id, email)
);
CREATE INDEX memberships_by_email ON memberships(email, organization_id);

-- ... and a service token's common_name maps to one organization with scopes.
CREATE TABLE service_tokens (
  organization_id TEXT NOT NULL REFERENCES organizations(id) ON DELETE CASCADE,
  common_name     TEXT NOT NULL UNIQUE,
  name            TEXT NOT NULL,
  scopes          TEXT NOT NULL,
  created_at      INTEGER NOT NULL,
  PRIMARY KEY (organization_id, common_name)
);

CREATE TABLE documents (
  organization_id TEXT NOT NULL REFERENCES organizations(id) ON DELETE CASCADE,
  id              TEXT NOT NULL,
  content         TEXT NOT NULL,
  content_hash    TEXT NOT NULL,               -- SHA-256 hex of content: capture is idempotent on it
  source          TEXT,
  metadata        TEXT NOT NULL DEFAULT '{}',
  summary         TEXT,
  tags            TEXT,                        -- JSON array of kebab-case tags
  created_at      INTEGER NOT NULL,            -- epoch ms
  updated_at      INTEGER NOT NULL,
  PRIMARY KEY (organization_id, id),
  UNIQUE (organization_id, content_hash)
);
CREATE INDEX documents_recent ON documents(organization_id, created_at DESC, id DESC);

-- Chunks of every kind of memory (thoughts now; conversation windows later) share one table, one keyword
-- index, one embedding queue and one search. parent_id is the thought (document) or conversation id.
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
  indexed_at      INTEGER,                     -- NULL until its vector is in the index
  UNIQUE (organization_id, id)
);
CREATE INDEX chunks_by_parent ON chunks(organization_id, kind, parent_id, ordinal);
CREATE INDEX chunks_pending ON chunks(organization_id, parent_id) WHERE indexed_at IS NULL;

-- Deleting a thought deletes its chunks (and, through the trigger below, their keyword rows).
CREATE TRIGGER documents_delete_chunks AFTER DELETE ON documents BEGIN
  DELETE FROM chunks WHERE organization_id = old.organization_id AND kind = 'thought' AND parent_id = old.id;
END;

-- Keyword index over chunks (BM25), kept in step with chunks by triggers, so no path can leave a keyword
-- row behind.
CREATE VIRTUAL TABLE chunks_fts USING fts5(
  content, organization_id UNINDEXED, kind UNINDEXED, tokenize = 'porter unicode61'
);

CREATE TRIGGER chunks_fts_insert AFTER INSERT ON chunks BEGIN
  INSERT INTO chunks_fts(rowid, content, organization_id, kind) VALUES (new.pk, new.content, new.organization_id, new.kind);
END;
CREATE TRIGGER chunks_fts_delete AFTER DELETE ON chunks BEGIN
  DELETE FROM chunks_fts WHERE rowid = old.pk;
END;

-- Durable background work (embedding, enrichment): drained by the service itself, across restarts.
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
