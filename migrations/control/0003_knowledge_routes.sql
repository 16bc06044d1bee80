-- Migration number: 0003 — which organization holds a knowledge base: GitHub's webhook URL names only the
-- knowledge base (/hooks/github/{kb_id}), whose rows live in its organization's own database.
CREATE TABLE knowledge_base_routes (
  id              TEXT PRIMARY KEY,
  organization_id TEXT NOT NULL,
  created_at      INTEGER NOT NULL
);

CREATE INDEX knowledge_base_routes_by_org ON knowledge_base_routes(organization_id);
