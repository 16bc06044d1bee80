"""Shared fixtures: the real app served by uvicorn on loopback, and organizations signed up through it."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import re
import sqlite3
import subprocess
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from api.app import create_app
from api.settings import Settings
from api.wiring import Memex
from services.adapters.cloudflare.vectorize import INDEXED_PROPERTIES
from tests.live import serve

logging.getLogger("mcp").setLevel(logging.WARNING)
logging.getLogger("httpx").setLevel(logging.WARNING)

_slugs = itertools.count(1)
_CONTROL_TABLES = re.compile(
    r"\b(organizations|api_keys|memberships|service_tokens|key_revocations|llm_usage|org_databases|knowledge_base_routes)\b")


def combine_org_results(query: str, results: list[list[tuple]]) -> list[tuple]:
    """One answer from a statement run in several organizations' databases: the one result as is; COUNT/SUM results
    added up and MAX taken (one row each); otherwise the rows concatenated."""
    if len(results) == 1:
        return results[0]
    head = query.lstrip().upper()
    if results and all(len(r) == 1 for r in results) and head.startswith(("SELECT COUNT(", "SELECT SUM(",
                                                                          "SELECT COALESCE(MAX(", "SELECT MAX(")):
        pick = max if "MAX(" in head.split("FROM")[0] else sum
        return [tuple(pick(r[0][i] or 0 for r in results) for i in range(len(results[0][0])))]
    return [row for r in results for row in r]


@dataclass
class Live:
    base_url: str
    memex: Memex
    data_dir: Path
    #: "embedded", or "cloudflare" (D1 + Vectorize served by tests/cloudflare_emulator)
    backend: str = "embedded"
    emulator: object | None = None
    #: The event loop the app serves on (``run``).
    loop: asyncio.AbstractEventLoop | None = None

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, timeout=60, **kw)

    def run(self, coro, timeout: float = 120.0):
        """Run ``coro`` on the app's own event loop (e.g. ``memex.worker.drain()`` of a service started without
        its worker) and return its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def _control_path(self) -> Path:
        if self.backend == "cloudflare":
            return self.emulator.data_dir / "d1" / self.emulator.account / f"{EMU_DB}.sqlite3"
        return self.data_dir / "control.sqlite3"

    def org_db_paths(self) -> dict[str, Path]:
        """Each organization's database file, as the control database routes it (the embedded file, or the
        emulator's file behind the organization's D1 database)."""
        with sqlite3.connect(self._control_path()) as conn:
            routes = conn.execute("SELECT organization_id, location FROM org_databases").fetchall()
        if self.backend == "cloudflare":
            base = self.emulator.data_dir / "d1" / self.emulator.account
            return {org: base / f"{loc}.sqlite3" for org, loc in routes}
        return {org: self.data_dir / "orgs" / loc / "memex.sqlite3" for org, loc in routes}

    def org_location(self, org_id: str) -> str:
        """Where the organization's database is: its folder name, or its D1 database's uuid."""
        with sqlite3.connect(self._control_path()) as conn:
            return conn.execute("SELECT location FROM org_databases WHERE organization_id = ?", (org_id,)).fetchone()[0]

    def sql(self, query: str, params=(), *, org: str | None = None) -> list[tuple]:
        """Read the stores' files directly (an independent look at what the service stored). A statement on a
        control table (organizations, keys, bindings, usage, routing) runs in the control database; any other
        in the database of ``org``, or of the organization whose id is among the parameters, or else in every
        organization's database (COUNT/SUM results added up, MAX taken, rows concatenated)."""
        if _CONTROL_TABLES.search(query):
            with sqlite3.connect(self._control_path()) as conn:
                return conn.execute(query, params).fetchall()
        paths = self.org_db_paths()
        named = [paths[p] for p in (org, *params) if isinstance(p, str) and p in paths]
        results = []
        for path in named[:1] or paths.values():
            with sqlite3.connect(path) as conn:
                results.append(conn.execute(query, params).fetchall())
        return combine_org_results(query, results)

    def vectors(self, prefix: str = "") -> list[tuple[str, str, dict]]:
        """(id, namespace, metadata) of every vector whose id starts with ``prefix``, read from the index
        itself: each organization's local vector file, or the emulator's Vectorize API (pending writes applied
        first)."""
        if self.backend == "cloudflare":
            self.emulator.flush_vectors()
            ids, cursor = [], None
            with httpx.Client(headers=self.emulator.headers, timeout=30) as c:
                base = f"{self.emulator.account_url}/vectorize/v2/indexes/{EMU_INDEX}"
                while True:
                    params = {"count": 1000, **({"cursor": cursor} if cursor else {})}
                    page = c.get(f"{base}/list", params=params).json()["result"]
                    ids += [v["id"] for v in page["vectors"] if v["id"].startswith(prefix)]
                    if not page.get("isTruncated"):
                        break
                    cursor = page["nextCursor"]
                out = []
                for i in range(0, len(ids), 100):
                    got = c.post(f"{base}/get_by_ids", json={"ids": ids[i:i + 100]}).json()["result"]
                    out += [(v["id"], v.get("namespace"), v.get("metadata") or {}) for v in got]
                return out
        rows = []
        for path in sorted((self.data_dir / "orgs").glob("*/vectors.sqlite3")):
            with sqlite3.connect(path) as conn:
                rows += conn.execute("SELECT id, namespace, metadata FROM vectors WHERE id LIKE ?", (prefix + "%",)).fetchall()
        return [(i, ns, json.loads(md)) for i, ns, md in rows]

    def vector_ids(self, prefix: str = "") -> list[str]:
        return [v[0] for v in self.vectors(prefix)]

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


EMU_DB = "memex-test-db"
EMU_INDEX = "memex-test-index"


def provision_emulator(emu, *, dimensions: int, model: str) -> dict:
    """What the README's wrangler steps do on a new account: the index, then its metadata indexes, before any
    vector is written. Returns the Settings fields that point the service at the emulator."""
    with httpx.Client(headers=emu.headers, timeout=30) as c:
        base = f"{emu.account_url}/vectorize/v2/indexes"
        r = c.post(base, json={"name": EMU_INDEX, "description": f"memex:model={model} dims={dimensions}",
                                "config": {"dimensions": dimensions, "metric": "cosine"}})
        assert r.status_code in (200, 201), r.text
        for prop, kind in INDEXED_PROPERTIES.items():
            r = c.post(f"{base}/{EMU_INDEX}/metadata_index/create", json={"propertyName": prop, "indexType": kind})
            assert r.status_code in (200, 201), r.text
    emu.flush_vectors()
    return dict(
        sql="d1", vectors="vectorize", cloudflare_account_id=emu.account, cloudflare_api_token=emu.token,
        cloudflare_d1_database_id=EMU_DB, cloudflare_vectorize_index=EMU_INDEX,
        cloudflare_api_base_url=emu.base_url, cloudflare_budget_limit=1_000_000,
    )


def start_live(tmp: Path, **overrides):
    settings = Settings(
        data_dir=tmp,
        embedder=overrides.pop("embedder", "local"),
        signup_rate_per_hour=overrides.pop("signup_rate_per_hour", 100_000),
        auth_failures_per_minute=overrides.pop("auth_failures_per_minute", 100_000),
        key_rate_per_minute=overrides.pop("key_rate_per_minute", 1_000_000),
        org_rate_per_minute=overrides.pop("org_rate_per_minute", 1_000_000),
        auth_address_failures_per_minute=overrides.pop("auth_address_failures_per_minute", 100_000),
        worker_poll_seconds=0.2,
        **overrides,
    )
    memex = Memex(settings)
    loops: list = []
    ctx = serve(create_app(memex=memex), on_loop=loops.append)
    base = ctx.__enter__()
    return Live(base, memex, tmp, loop=loops[0]), ctx


@pytest.fixture(scope="session", params=["embedded", "cloudflare"])
def live(request):
    """The service on a loopback port, once per backend: the embedded default (SQLite, local vectors, the
    real MiniLM model), then D1 + Vectorize on the Cloudflare emulator (with the same local model, so the
    same semantic assertions hold; Workers AI embeddings are covered in test_cloudflare_adapters)."""
    with tempfile.TemporaryDirectory() as tmp, backend_live(request.param, Path(tmp), embedder="local") as server:
        yield server


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


def stop(proc: subprocess.Popen) -> None:
    """Stop a service a test started (SIGTERM: its clean shutdown; killed after 30 s)."""
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


def assert_error(response: httpx.Response, status: int, code: str | None = None) -> dict:
    assert response.status_code == status, (response.status_code, response.text)
    body = response.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"code", "message", "details", "request_id"}, body
    assert body["error"]["request_id"] == response.headers["x-request-id"], (body, response.headers)
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    if code:
        assert body["error"]["code"] == code, body
    return body["error"]


def error_body(response: httpx.Response) -> dict:
    """An error body without its request id (which names the request): what two answers must share to say the same."""
    body = response.json()
    return {**body, "error": {k: v for k, v in body["error"].items() if k != "request_id"}}


@contextmanager
def backend_live(backend: str, tmp: Path, *, embedder: str = "hash", **overrides):
    """The service on a loopback port on ``backend``: "embedded" (SQLite + local vectors) or "cloudflare" (D1 +
    Vectorize on the Cloudflare emulator), with ``embedder`` ("hash": plumbing without the model's cost) and any
    other Settings ``overrides``."""
    if backend == "embedded":
        server, ctx = start_live(tmp, embedder=embedder, **overrides)
        try:
            yield server
        finally:
            ctx.__exit__(None, None, None)
        return
    from services.adapters.hash_embedder import HashEmbedder
    from tests.cloudflare_emulator import running_emulator

    if embedder == "hash":
        emb = HashEmbedder()
    else:
        from services.adapters.onnx_embedder import OnnxMiniLMEmbedder

        emb = OnnxMiniLMEmbedder()
    with running_emulator(data_dir=tmp / "emulator", vector_lag_ms=50, rate_limit=1_000_000) as emu:
        server, ctx = start_live(tmp / "service", embedder=embedder,
                                 **provision_emulator(emu, dimensions=emb.dimensions, model=emb.model_id), **overrides)
        server.backend, server.emulator = "cloudflare", emu
        try:
            yield server
        finally:
            ctx.__exit__(None, None, None)


@pytest.fixture(scope="module", params=["embedded", "cloudflare"])
def hlive(request):
    """The service with the hash embedder (plumbing without the model's cost), once per backend: SQLite +
    local vectors, then D1 + Vectorize on the Cloudflare emulator."""
    with tempfile.TemporaryDirectory() as tmp, backend_live(request.param, Path(tmp)) as server:
        yield server
