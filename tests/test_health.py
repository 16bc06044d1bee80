"""``GET /health`` after a restart: the jobs left queued by the previous run are counted from the first call.

``pending_jobs`` counts the organizations the job worker knows to have work. A fresh process knew none until the
worker's start-up scan ran, so for a moment after a restart (or for good, with the worker off) /health said 0
while jobs were queued, and a deploy script or a benchmark waiting for "0 pending" went on too early."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from tests.conftest import signup, start_live


def test_health_counts_the_jobs_queued_before_a_restart():
    with tempfile.TemporaryDirectory() as tmp:
        # the worker off: what the captures queue stays queued
        live, ctx = start_live(Path(tmp), embedder="hash", run_worker=False)
        try:
            org = signup(live, "health")
            with live.client(headers=org.headers) as c:
                for i in range(3):
                    assert c.post("/v1/thoughts", json={"content": f"queued note {i} about the boiler"}).status_code == 201
            queued = live.sql("SELECT COUNT(*) FROM jobs WHERE organization_id = ? AND state = 'pending'", (org.id,))[0][0]
            assert queued >= 3
        finally:
            ctx.__exit__(None, None, None)
        live, ctx = start_live(Path(tmp), embedder="hash", run_worker=False)
        try:
            with live.client() as c:
                assert c.get("/health").json()["pending_jobs"] == queued
        finally:
            ctx.__exit__(None, None, None)
        # and with the worker on, they are done: /health goes to 0
        live, ctx = start_live(Path(tmp), embedder="hash")
        try:
            with live.client() as c:
                deadline = time.monotonic() + 30
                while c.get("/health").json()["pending_jobs"] and time.monotonic() < deadline:
                    time.sleep(0.1)
                assert c.get("/health").json()["pending_jobs"] == 0
            assert live.sql("SELECT COUNT(*) FROM jobs WHERE organization_id = ?", (org.id,))[0][0] == 0
        finally:
            ctx.__exit__(None, None, None)
