-- Migration number: 0008 — turn-level conversation retrieval: each message's own time and session, and one
-- keyword and vector row per message (chunks of kind 'turn', beside the 5-message windows).
-- Plain SQLite that D1 accepts: no BEGIN/COMMIT, no PRAGMA. organization_id leads every key and index.
--
-- messages.created_at (0002) now holds the time the caller gives (created_at / ts on append, epoch ms), else the
-- time of the append. session: the caller's label of the session the message belongs to (e.g. "2023-05-08" or
-- "session 4"); NULL when not given.
ALTER TABLE messages ADD COLUMN session TEXT;
-- from / to filters of conversation search (per conversation and organization-wide).
CREATE INDEX messages_by_time ON messages(organization_id, created_at);

-- A turn chunk: one message, start_sequence = end_sequence = ordinal = its sequence, content = "[role]: text"
-- (uncompressed, like the windows). Written in the append batch with the message; never rewritten (messages
-- are immutable). Conversations appended before this migration have no turn rows: their turns are ranked from
-- their windows alone. Deleting a conversation deletes its turns (and, through chunks' trigger, their keyword rows).
CREATE TRIGGER conversations_delete_turns AFTER DELETE ON conversations BEGIN
  DELETE FROM chunks WHERE organization_id = old.organization_id AND kind = 'turn' AND parent_id = old.id;
END;
