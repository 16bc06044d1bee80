-- Migration number: 0002 — conversations (engram-architecture): verbatim messages in order, compressed at
-- rest, chunked into sliding windows that live in the shared chunks table (kind = 'conversation',
-- parent_id = the conversation id). Plain SQLite that D1 accepts; organization_id leads every key and index.

CREATE TABLE conversations (
  organization_id TEXT NOT NULL REFERENCES organizations(id) ON DELETE CASCADE,
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
  created_at       INTEGER NOT NULL,
  PRIMARY KEY (organization_id, id),
  UNIQUE (organization_id, conversation_id, sequence),
  UNIQUE (organization_id, conversation_id, client_id)
);
-- What the compression backfill still has to do.
CREATE INDEX messages_uncompressed ON messages(organization_id, id) WHERE content_encoding IS NULL;

-- Idempotency-Key of an append: the original response, replayed for a retry of the same request.
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

-- Deleting a conversation deletes its messages, its chunks (and, through chunks' own trigger, their keyword
-- rows), its idempotency records and its queued jobs. Vectors are deleted by the service, before the row.
CREATE TRIGGER conversations_delete_children AFTER DELETE ON conversations BEGIN
  DELETE FROM messages WHERE organization_id = old.organization_id AND conversation_id = old.id;
  DELETE FROM chunks WHERE organization_id = old.organization_id AND kind = 'conversation' AND parent_id = old.id;
  DELETE FROM conversation_idempotency WHERE organization_id = old.organization_id AND conversation_id = old.id;
  DELETE FROM jobs WHERE organization_id = old.organization_id AND kind = 'embed' AND target_id = old.id;
END;
