"""Verifying API keys under concurrency: requests presenting the same uncached key share one argon2 run, and
at most one run per core is in flight (each holds 19 MiB: four clients starting an import together used to add
80 MB to the server's peak memory). The sharing is by the exact key presented: a wrong secret never rides on a
right one's verification."""

from __future__ import annotations

import asyncio
import threading

import pytest

import tenancy.keys as keys_module
from tenancy.keys import KeyManager


class _Runs:
    """Counts the argon2 runs of the real verifier (and the most in flight at once), delegating to it."""

    def __init__(self, real):
        self.real, self.count, self.now, self.most = real, 0, 0, 0
        self.lock = threading.Lock()

    def __call__(self, key_hash, raw):
        with self.lock:
            self.count += 1
            self.now += 1
            self.most = max(self.most, self.now)
        try:
            return self.real(key_hash, raw)
        finally:
            with self.lock:
                self.now -= 1


@pytest.fixture
def runs(monkeypatch):
    spy = _Runs(keys_module._verify_hash)
    monkeypatch.setattr(keys_module, "_verify_hash", spy)
    return spy


async def _manager_with_key(tmp_path):
    from services.adapters.sqlite import SqliteDatabase
    from services.storage.migrate import CONTROL_DIR, apply_pending

    db = SqliteDatabase(tmp_path / "control.sqlite3")
    await apply_pending(db, CONTROL_DIR)
    await db.execute("INSERT INTO organizations (id, name, slug, status, created_at) VALUES ('org_a', 'A', 'a', 'active', 0)", ())
    km = KeyManager(db)
    issued, stmt = await km.prepare("org_a", name="k", scopes=["read", "write"])
    await db.execute(stmt.sql, stmt.params)
    return db, km, issued.raw


async def test_concurrent_requests_with_one_uncached_key_share_one_verification(tmp_path, runs):
    db, km, raw = await _manager_with_key(tmp_path)
    try:
        got = await asyncio.gather(*[km.verify(raw) for _ in range(8)])
        assert all(vk is not None and vk.organization_id == "org_a" for vk in got)
        assert runs.count == 1
        # cached now: no further run
        assert (await km.verify(raw)).organization_id == "org_a"
        assert runs.count == 1
    finally:
        await km.drain()
        await db.close()


async def test_a_wrong_secret_does_not_share_the_right_keys_verification(tmp_path, runs):
    db, km, raw = await _manager_with_key(tmp_path)
    wrong = raw[:-4] + ("AAAA" if not raw.endswith("AAAA") else "BBBB")
    try:
        results = await asyncio.gather(km.verify(raw), km.verify(wrong), km.verify(raw), km.verify(wrong))
        assert [r is not None for r in results] == [True, False, True, False]
        assert runs.count == 2  # one per distinct key presented
        assert await km.verify(wrong) is None  # a failure is not cached: verified again
        assert runs.count == 3
    finally:
        await km.drain()
        await db.close()


async def test_distinct_keys_run_at_most_one_argon2_verification_per_core(tmp_path, runs, monkeypatch):
    monkeypatch.setattr(keys_module.os, "cpu_count", lambda: 2)
    db, km, raw = await _manager_with_key(tmp_path)
    guesses = [f"{raw[:-6]}{i:06d}" for i in range(6)]
    try:
        results = await asyncio.gather(*[km.verify(g) for g in guesses], km.verify(raw))
        assert results[:-1] == [None] * 6 and results[-1].organization_id == "org_a"
        assert runs.count == 7
        assert runs.most <= 2
    finally:
        await km.drain()
        await db.close()


async def test_a_caller_that_goes_away_does_not_cancel_the_shared_verification(tmp_path, runs):
    db, km, raw = await _manager_with_key(tmp_path)
    try:
        first = asyncio.ensure_future(km.verify(raw))
        second = asyncio.ensure_future(km.verify(raw))
        await asyncio.sleep(0)
        first.cancel()
        assert (await second).organization_id == "org_a"
        assert runs.count == 1
        with pytest.raises(asyncio.CancelledError):
            await first
    finally:
        await km.drain()
        await db.close()
