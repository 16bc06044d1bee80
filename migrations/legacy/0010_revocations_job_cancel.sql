-- Revocation that every running server sees within a second, and deletes that cancel their queued jobs.

-- One row per change that can end a cached key's life: a key revoked, re-scoped, re-dated or deleted (key_id
-- set), an organization suspended or deleted (key_id NULL: all its keys). Written by triggers, so every path
-- counts: the REST API, `memex key revoke` from the shell, another instance, an operator's SQL. Each server
-- reads the rows past the last generation it saw (at most every half second, on the request path) and
-- evicts those keys from its verification cache. Rows older than a day are pruned as new ones come.
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

-- Deleting a thought or a conversation cancels every job queued for it, whatever its kind (embed, enrich,
-- ...) and whatever path deletes it. A worker already running such a job finds the rows gone and writes no
-- vector that outlives them (services.worker.drop_vanished).
CREATE TRIGGER documents_delete_jobs AFTER DELETE ON documents BEGIN
  DELETE FROM jobs WHERE organization_id = old.organization_id AND target_id = old.id;
END;

CREATE TRIGGER conversations_delete_jobs AFTER DELETE ON conversations BEGIN
  DELETE FROM jobs WHERE organization_id = old.organization_id AND target_id = old.id;
END;
