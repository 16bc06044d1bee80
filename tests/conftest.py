"""Shared fixtures: the real app served by uvicorn on loopback, and organizations signed up through it."""

from __future__ import annotations

import itertools
import logging
import sqlite3
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from api.app import create_app
from api.settings import Settings
from api.wiring import Memex
from tests.live import serve

logging.getLogger("mcp").setLevel(logging.WARNING)
logging.getLogger("httpx").setLevel(logging.WARNING)

_slugs = itertools.count(1)


@dataclass
class Live:
    base_url: str
    memex: Memex
    data_dir: Path

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, timeout=60, **kw)

    def sql(self, query: str, params=()) -> list[tuple]:
        """Read the SQLite file directly (an independent look at what the service stored)."""
        with sqlite3.connect(self.data_dir / "memex.sqlite3") as conn:
            return conn.execute(query, params).fetchall()

    def vector_ids(self, prefix: str = "") -> list[str]:
        """Vector ids in the local index file (read directly, not through the service)."""
        path = self.data_dir / "vectors.sqlite3"
        with sqlite3.connect(path) as conn:
            tables = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")]
            table = "vectors" if "vectors" in tables else tables[0]
            return [r[0] for r in conn.execute(f"SELECT id FROM {table} WHERE id LIKE ?", (prefix + "%",))]

    def wait_indexed(self, headers: dict, thought_id: str, timeout: float = 30.0) -> dict:
        with self.client() as c:
            deadline = time.monotonic() + timeout
            while True:
                body = c.get(f"/v1/thoughts/{thought_id}", headers=headers).json()
                if body["indexing"]["state"] == "indexed" or time.monotonic() > deadline:
                    return body
                time.sleep(0.05)


@dataclass
class Org:
    id: str
    slug: str
    key: str
    key_id: str
    mcp_url: str

    @property
    def headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.key}"}


def start_live(tmp: Path, **overrides):
    settings = Settings(
        data_dir=tmp,
        embedder=overrides.pop("embedder", "local"),
        signup_rate_per_hour=overrides.pop("signup_rate_per_hour", 100_000),
        auth_failures_per_minute=overrides.pop("auth_failures_per_minute", 100_000),
        key_rate_per_minute=overrides.pop("key_rate_per_minute", 1_000_000),
        worker_poll_seconds=0.2,
        **overrides,
    )
    memex = Memex(settings)
    ctx = serve(create_app(memex=memex))
    base = ctx.__enter__()
    return Live(base, memex, tmp), ctx


@pytest.fixture(scope="session")
def live():
    """The embedded default (SQLite, local vectors, the real MiniLM model) on a loopback port."""
    with tempfile.TemporaryDirectory() as tmp:
        server, ctx = start_live(Path(tmp))
        try:
            yield server
        finally:
            ctx.__exit__(None, None, None)


def signup(live: Live, prefix: str = "org") -> Org:
    slug = f"{prefix}-{next(_slugs)}-{int(time.time() * 1000) % 100000}"
    with live.client() as c:
        r = c.post("/v1/signup", json={"name": f"{prefix} inc", "slug": slug})
        assert r.status_code == 201, r.text
        body = r.json()
    return Org(body["organization"]["id"], slug, body["api_key"]["key"], body["api_key"]["id"], body["mcp_url"])


@pytest.fixture
def org(live) -> Org:
    return signup(live, "alpha")


@pytest.fixture
def other_org(live) -> Org:
    return signup(live, "beta")


@pytest.fixture
def client(live):
    with live.client() as c:
        yield c


def assert_error(response: httpx.Response, status: int, code: str | None = None) -> dict:
    assert response.status_code == status, (response.status_code, response.text)
    body = response.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"code", "message", "details"}, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    if code:
        assert body["error"]["code"] == code, body
    return body["error"]
