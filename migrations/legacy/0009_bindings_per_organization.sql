-- Migration number: 0009 — Access bindings belong to the organization that made them: a service token's
-- common_name may be bound by several organizations (each with its own name and scopes), as a member's email
-- already may. 0001 declared common_name UNIQUE across the deployment, so the first organization to bind a
-- token took it from every other; SQLite cannot drop a constraint, so the table is rebuilt without it.
-- Plain SQLite that D1 accepts (no BEGIN/COMMIT, no PRAGMA); nothing references service_tokens.

CREATE TABLE service_tokens_0009 (
  organization_id TEXT NOT NULL REFERENCES organizations(id) ON DELETE CASCADE,
  common_name     TEXT NOT NULL,               -- the Access service token's client id; unique per organization
  name            TEXT NOT NULL,
  scopes          TEXT NOT NULL,
  created_at      INTEGER NOT NULL,
  PRIMARY KEY (organization_id, common_name)
);
INSERT INTO service_tokens_0009 (organization_id, common_name, name, scopes, created_at)
  SELECT organization_id, common_name, name, scopes, created_at FROM service_tokens;
DROP TABLE service_tokens;
ALTER TABLE service_tokens_0009 RENAME TO service_tokens;
-- Authentication looks a token up by common_name first (then picks the organization the request names).
CREATE INDEX service_tokens_by_common_name ON service_tokens(common_name, organization_id);
