-- Migration number: 0002 — knowledge bases (the knowledge-server seed): git-synced markdown vaults with an
-- ontology, in the organization's own database. An entry's text is chunked into `chunks` (kind 'knowledge',
-- parent_id = the entry's uid), so it is keyword-indexed at once (chunks_fts), embedded by the job worker and
-- reconciled like every other chunk. Plain SQLite that D1 accepts: no BEGIN/COMMIT, no PRAGMA.

CREATE TABLE knowledge_bases (
  organization_id TEXT NOT NULL,
  id              TEXT NOT NULL,                 -- kb_<hex>
  slug            TEXT NOT NULL,                 -- unique in the organization
  name            TEXT NOT NULL,
  visibility      TEXT NOT NULL CHECK (visibility IN ('private', 'open', 'public', 'members')),
  document_tier   TEXT NOT NULL DEFAULT 'members' CHECK (document_tier IN ('open', 'public', 'members')),
  source          TEXT NOT NULL,                 -- JSON: {"type": "git", url, branch, include, exclude} | {"type": "upload"}
  source_token    TEXT,                          -- write-only: never returned, never logged
  ontology        TEXT NOT NULL DEFAULT '{}',    -- JSON: path_types, type_aliases, require_publish, skip_drafts
  webhook_secret  TEXT NOT NULL,                 -- GitHub's X-Hub-Signature-256 key (shown once, rotatable)
  last_commit     TEXT,                          -- the commit the entries reflect (git sources)
  synced_fingerprint TEXT,                       -- ontology + globs of the last finished sync: a change means a full sync
  last_sync_id    TEXT,
  last_synced_at  INTEGER,
  created_at      INTEGER NOT NULL,
  updated_at      INTEGER NOT NULL,
  PRIMARY KEY (organization_id, id),
  UNIQUE (organization_id, slug)
);

CREATE TABLE knowledge_entries (
  organization_id TEXT NOT NULL,
  kb_id           TEXT NOT NULL,
  uid             TEXT NOT NULL,                 -- the chunks' parent_id (unique in the organization)
  id              TEXT NOT NULL,                 -- from the file name (<= 64 bytes), unique in the knowledge base
  path            TEXT NOT NULL,
  content_type    TEXT NOT NULL,
  title           TEXT NOT NULL,
  description     TEXT,
  group_name      TEXT,
  release         TEXT,
  status          TEXT,
  tags            TEXT NOT NULL DEFAULT '[]',    -- JSON array
  date            INTEGER,                       -- epoch ms
  metadata        TEXT NOT NULL DEFAULT '{}',    -- the frontmatter fields that validated (and unknown extras)
  body            TEXT NOT NULL,
  raw             TEXT NOT NULL,                 -- the original markdown
  content_hash    TEXT NOT NULL,                 -- SHA-256 of everything stored from the file: equal means unchanged
  index_hash      TEXT NOT NULL,                 -- SHA-256 of what was chunked and its filterable fields: equal means no
                                                 -- re-embedding (a change to a field that is not indexed keeps the vectors)
  issues          TEXT NOT NULL DEFAULT '[]',    -- JSON [[field, reason]]: fields dropped by validation
  commit_sha      TEXT,
  synced_at       INTEGER NOT NULL,
  PRIMARY KEY (organization_id, uid),
  UNIQUE (organization_id, kb_id, id),
  UNIQUE (organization_id, kb_id, path)
);

CREATE INDEX knowledge_entries_browse ON knowledge_entries(organization_id, kb_id, content_type, id);

-- Links resolve case-insensitively to an entry's id (its file name, Obsidian's rule) or, failing that, its title
-- ([[Cell Governance]] finds the entry titled so in cell-governance.md), through these indexes.
CREATE INDEX knowledge_entries_id_nocase ON knowledge_entries(organization_id, kb_id, id COLLATE NOCASE);

CREATE INDEX knowledge_entries_title_nocase ON knowledge_entries(organization_id, kb_id, title COLLATE NOCASE);

CREATE TABLE knowledge_links (
  organization_id TEXT NOT NULL,
  kb_id           TEXT NOT NULL,
  source_uid      TEXT NOT NULL,
  target          TEXT NOT NULL COLLATE NOCASE,  -- as written: resolved, when read, to the entry with that id or title
  label           TEXT,
  ordinal         INTEGER NOT NULL,
  PRIMARY KEY (organization_id, source_uid, ordinal)
);

CREATE INDEX knowledge_links_incoming ON knowledge_links(organization_id, kb_id, target);

CREATE TRIGGER knowledge_entries_delete AFTER DELETE ON knowledge_entries BEGIN
  DELETE FROM chunks WHERE organization_id = old.organization_id AND kind = 'knowledge' AND parent_id = old.uid;
  DELETE FROM knowledge_links WHERE organization_id = old.organization_id AND source_uid = old.uid;
END;

-- What the last sync made of each file of the source (its blob, its outcome): the full comparison by content
-- after a force-push, and releases (folders holding index.base).
CREATE TABLE knowledge_files (
  organization_id TEXT NOT NULL,
  kb_id           TEXT NOT NULL,
  path            TEXT NOT NULL,
  blob            TEXT NOT NULL,                 -- git blob sha (or SHA-256 of an uploaded file)
  outcome         TEXT NOT NULL,                 -- entry | skipped | failed | marker (index.base)
  reason          TEXT,
  PRIMARY KEY (organization_id, kb_id, path)
);

CREATE TABLE knowledge_syncs (
  organization_id TEXT NOT NULL,
  id              TEXT NOT NULL,
  kb_id           TEXT NOT NULL,
  state           TEXT NOT NULL DEFAULT 'queued' CHECK (state IN ('queued', 'running', 'succeeded', 'failed')),
  trigger         TEXT NOT NULL,                 -- api | webhook | import | cli
  full            INTEGER NOT NULL DEFAULT 0,    -- 1: compare every file (asked for); else incremental when it can be
  mode            TEXT,                          -- incremental | full (decided when it runs)
  base_commit     TEXT,
  commit_sha      TEXT,
  delivery_id     TEXT,
  files_total     INTEGER,
  unchanged       INTEGER NOT NULL DEFAULT 0,
  unresolved_links TEXT NOT NULL DEFAULT '[]',   -- JSON [{path, target}] (at most 1000)
  error           TEXT,                          -- why the whole sync failed (the source unreachable...)
  created_at      INTEGER NOT NULL,
  started_at      INTEGER,
  finished_at     INTEGER,
  PRIMARY KEY (organization_id, id)
);

CREATE INDEX knowledge_syncs_by_kb ON knowledge_syncs(organization_id, kb_id, created_at DESC);

-- Each file a sync handled, once: its counts, its per-file errors and where a resumed sync goes on from.
CREATE TABLE knowledge_sync_files (
  organization_id TEXT NOT NULL,
  sync_id         TEXT NOT NULL,
  path            TEXT NOT NULL,
  outcome         TEXT NOT NULL,                 -- added | updated | deleted | unchanged | skipped | failed
  reason          TEXT,
  warnings        TEXT,                          -- JSON [[field, reason]] for kept entries
  PRIMARY KEY (organization_id, sync_id, path)
);

-- The files of an uploaded archive, until the import's sync has applied them.
CREATE TABLE knowledge_uploads (
  organization_id TEXT NOT NULL,
  sync_id         TEXT NOT NULL,
  path            TEXT NOT NULL,
  content         TEXT,                          -- base64 of the file's bytes (NULL: larger than a file may be)
  size            INTEGER NOT NULL,
  sha256          TEXT NOT NULL,
  PRIMARY KEY (organization_id, sync_id, path)
);

-- GitHub webhook deliveries already seen (X-GitHub-Delivery): a redelivery queues nothing.
CREATE TABLE knowledge_deliveries (
  organization_id TEXT NOT NULL,
  kb_id           TEXT NOT NULL,
  delivery_id     TEXT NOT NULL,
  sync_id         TEXT,
  created_at      INTEGER NOT NULL,
  PRIMARY KEY (organization_id, kb_id, delivery_id)
);

-- Vectors whose rows are gone, to delete from the index: a knowledge chunk's deletion records its id here, in the
-- same transaction (the trigger below: an entry changed or removed by a sync, a knowledge base deleted), and the id
-- leaves once the index has deleted the vector. A crash in between leaves the id here for the next sync (or the
-- deletion's retry): no orphan vector outlives its rows.
CREATE TABLE vector_gc (
  organization_id TEXT NOT NULL,
  chunk_id        TEXT NOT NULL,
  created_at      INTEGER NOT NULL,
  PRIMARY KEY (organization_id, chunk_id)
);

CREATE TRIGGER chunks_knowledge_gc AFTER DELETE ON chunks WHEN old.kind = 'knowledge' BEGIN
  INSERT INTO vector_gc (organization_id, chunk_id, created_at)
  VALUES (old.organization_id, old.id, CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER))
  ON CONFLICT DO NOTHING;
END;
