-- Migration number: 0007 — deliberate use of thoughts replaces recall counts in ranking.
-- Plain SQLite that D1 accepts: no BEGIN/COMMIT, no PRAGMA.
--
-- A search no longer counts as a use of what it returned (that fed on itself: SciFact nDCG@10 74 -> 51.6).
-- Uses are a thought fetched by id or marked used. use_weight is the sum over uses of
-- 2 ^ ((t_use - 2026-01-01) / 30 days), so the decayed count at any time is one multiplication away and a new
-- use is one additive UPDATE (services/ranking.py). recall_count stays (no longer written or read).
ALTER TABLE documents ADD COLUMN use_weight REAL NOT NULL DEFAULT 0;
ALTER TABLE documents ADD COLUMN use_count INTEGER NOT NULL DEFAULT 0;
ALTER TABLE documents ADD COLUMN last_used_at INTEGER;
