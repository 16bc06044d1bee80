"""The job queue's claim and settle statements read only the jobs they take, however deep the queue: SQLite's own
query plan on a migrated organization database, holding a deep queue (a bulk import's). A plan that sorts the ready
jobs, or walks every job of the organization, made each round of a 45,000-note import cost ~80 ms of SQL before any
work (bench/README.md, bench_search_scale.py)."""

from __future__ import annotations

import json
import sqlite3

from services.adapters.sqlite import SqliteDatabase
from services.jobs.worker import CLAIM_SQL, SETTLE_DONE_SQL
from services.storage.migrate import apply_pending


def _plan(conn: sqlite3.Connection, sql: str, params: tuple) -> list[str]:
    return [row[3] for row in conn.execute("EXPLAIN QUERY PLAN " + sql, params)]


async def test_claim_and_settle_read_only_the_jobs_they_take(tmp_path):
    db = SqliteDatabase(tmp_path / "org.sqlite3")
    await apply_pending(db)
    await db.close()
    conn = sqlite3.connect(tmp_path / "org.sqlite3")
    conn.executemany(
        "INSERT INTO jobs (organization_id, kind, target_id, state, run_after, created_at) "
        "VALUES ('org_a', ?, ?, 'pending', ?, 1)",
        [("embed" if i % 2 else "enrich", f"th_{i}", 1_000 + i // 1000) for i in range(20_000)])
    conn.commit()

    claim = _plan(conn, CLAIM_SQL, ("org_a", 10**13, 10**12, 32))
    assert not [step for step in claim if "TEMP B-TREE" in step], claim  # no sort of the ready jobs
    assert any("INTEGER PRIMARY KEY" in step for step in claim), claim  # the chosen ids updated by rowid
    assert any("jobs_ready" in step for step in claim), claim  # found through the due index

    settle = _plan(conn, SETTLE_DONE_SQL, ("org_a", json.dumps([1, 2, 3])))
    assert any("INTEGER PRIMARY KEY" in step for step in settle) and not [s for s in settle if "jobs_by_target" in s], settle

    # and the claim takes the due jobs first, a batch of them
    taken = conn.execute(CLAIM_SQL, ("org_a", 10**13, 10**12, 32)).fetchall()
    conn.commit()
    assert sorted(r[0] for r in taken) == list(range(1, 33))
