-- Migration number: 0002 — work hints: when a process queues jobs in an organization's database that another
-- process's worker should run (a CLI import while the service runs, several instances on D1), it records the
-- time here; each worker reads the hints newer than the last it saw (one control query per poll) instead of
-- polling every organization's job table. Plain SQLite that D1 accepts.
ALTER TABLE org_databases ADD COLUMN work_at INTEGER NOT NULL DEFAULT 0;
