-- Migration number: 0001 — the control database: organizations, credentials, Access bindings, usage, and where
-- each organization's own database lives. One per deployment (the embedded control.sqlite3, or the D1 database
-- CLOUDFLARE_D1_DATABASE_ID names). Plain SQLite that D1 accepts: no BEGIN/COMMIT, no PRAGMA.
--
-- The schema is the control half of migrations/legacy/0001..0010 (the single-database layout before one
-- database per organization), as those files left it; services/storage/convert.py moves a legacy database
-- into this layout.

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

CREATE TABLE memberships (
  organization_id TEXT NOT NULL REFERENCES organizations(id) ON DELETE CASCADE,
  email           TEXT NOT NULL,               -- lower-cased
  role            TEXT NOT NULL,               -- owner / admin / member / viewer
  created_at      INTEGER NOT NULL,
  PRIMARY KEY (organization_id, email)
);

CREATE INDEX memberships_by_email ON memberships(email, organization_id);

CREATE TABLE llm_usage (
  organization_id TEXT NOT NULL,
  day             TEXT NOT NULL,
  calls           INTEGER NOT NULL DEFAULT 0,
  tokens          INTEGER NOT NULL DEFAULT 0,
  refused         INTEGER NOT NULL DEFAULT 0,
  PRIMARY KEY (organization_id, day)
);

CREATE TABLE service_tokens (
  organization_id TEXT NOT NULL REFERENCES organizations(id) ON DELETE CASCADE,
  common_name     TEXT NOT NULL,               -- the Access service token's client id; unique per organization
  name            TEXT NOT NULL,
  scopes          TEXT NOT NULL,
  created_at      INTEGER NOT NULL,
  PRIMARY KEY (organization_id, common_name)
);

CREATE INDEX service_tokens_by_common_name ON service_tokens(common_name, organization_id);

CREATE TABLE key_revocations (
  generation      INTEGER PRIMARY KEY AUTOINCREMENT,
  organization_id TEXT NOT NULL,
  key_id          TEXT,
  created_at      INTEGER NOT NULL
);

CREATE TRIGGER api_keys_revocation AFTER UPDATE ON api_keys
WHEN old.revoked_at IS NOT new.revoked_at OR old.scopes IS NOT new.scopes OR old.expires_at IS NOT new.expires_at
  OR old.key_hash IS NOT new.key_hash OR old.organization_id IS NOT new.organization_id BEGIN
  DELETE FROM key_revocations WHERE created_at < CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER) - 86400000;
  INSERT INTO key_revocations (organization_id, key_id, created_at)
  VALUES (old.organization_id, old.id, CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER));
END;

CREATE TRIGGER api_keys_deleted AFTER DELETE ON api_keys BEGIN
  INSERT INTO key_revocations (organization_id, key_id, created_at)
  VALUES (old.organization_id, old.id, CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER));
END;

CREATE TRIGGER organizations_revocation AFTER UPDATE OF status ON organizations
WHEN old.status IS NOT new.status BEGIN
  INSERT INTO key_revocations (organization_id, key_id, created_at)
  VALUES (old.id, NULL, CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER));
END;

CREATE TRIGGER organizations_deleted AFTER DELETE ON organizations BEGIN
  INSERT INTO key_revocations (organization_id, key_id, created_at)
  VALUES (old.id, NULL, CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER));
END;

-- Where each organization's data lives: the routing table. backend is 'sqlite' (location: a directory under the
-- data directory) or 'd1' (location: the D1 database's uuid, account: the Cloudflare account that holds it);
-- vector_index names the index holding its vectors (namespace = the organization id). An operator past one
-- account's limits adds accounts and indexes: new organizations are routed to the current ones, old rows
-- keep theirs. schema_version is the last organization migration applied (informational: each database records
-- its own migrations in its d1_migrations table).
CREATE TABLE org_databases (
  organization_id TEXT PRIMARY KEY,
  backend         TEXT NOT NULL,
  location        TEXT NOT NULL,
  account         TEXT,
  vector_index    TEXT,
  schema_version  TEXT,
  created_at      INTEGER NOT NULL
);
