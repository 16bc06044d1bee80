-- Migration number: 0003 — a thought's write-time decision, kept on the thought. A capture is acknowledged once it is
-- durable and keyword-searchable; its decision (duplicate, flagged, contradiction, replace, merge) is then made by the
-- job worker when it embeds the thought, and recorded here ({"action": "pending"} until then). A capture that asked
-- to wait for its decision has it recorded at once. NULL: captured before this migration, or with decisions off.
ALTER TABLE documents ADD COLUMN decision TEXT;
