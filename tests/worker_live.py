"""The service on the Worker backend for the shared integration suites: ``memex cloudflare dev``'s stack
(``wrangler dev --local``: D1 and a SQLite Durable Object per organization, the Cloudflare emulator standing in for
Vectorize) and a ``Live`` whose store reads go through the Worker's own protocol (``sql.batch`` on the control
database or an organization's Durable Object; Vectorize's REST API on the emulator): an independent look at what
the service stored, with no file to open. Import only after checking that Node and worker/node_modules are there
(see tests/test_worker_suites.py)."""

from __future__ import annotations

import hashlib
import json
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from api.cloudflare_dev_cli import _provision_index, start_dev
from services.adapters.cloudflare.worker_client import WorkerClient, decode_value
from tests.conftest import _CONTROL_TABLES, Live, combine_org_results, start_live

ROOT = Path(__file__).resolve().parents[1]
#: One Vectorize index per embedder (both 384 dimensions), so each run's vectors have an index of their own.
INDEXES = {"local": "memex-minilm-384", "hash": "memex-hash-384"}


class WorkerLive(Live):
    """``Live`` whose ``sql`` and ``vectors`` read through the Worker (synchronously: async tests call them too)."""

    stack: Any = None
    index: str = INDEXES["local"]

    def _ops(self, db: str, statements: list[tuple[str, Any]]) -> list[dict]:
        stack = self.stack
        body = json.dumps({"v": 1, "ops": [{"op": "sql.batch", "db": db, "statements": [
            {"sql": q, "params": list(p)} for q, p in statements]}]}).encode()
        signer = WorkerClient(None, url=stack.url, secret=stack.secret)  # type: ignore[arg-type]  # headers only
        r = httpx.post(f"{stack.url}/v1/rpc", content=body, headers=signer.signed_headers(body), timeout=30)
        assert r.status_code == 200, r.text
        res = r.json()["results"][0]
        assert res["ok"], res
        return res["results"]

    def _query(self, db: str, query: str, params=()) -> list[tuple]:
        out = self._ops(db, [(query, params)])[0]
        return [tuple(decode_value(v) for v in row) for row in out["rows"]]

    def routes(self) -> dict[str, str]:
        """Organization id -> its Durable Object's name (``org:<id>``), as the control database routes it."""
        return dict(self._query("control", "SELECT organization_id, location FROM org_databases ORDER BY created_at"))

    def org_location(self, org_id: str) -> str:
        return self.routes()[org_id]

    def org_db_paths(self) -> dict[str, Path]:
        raise NotImplementedError("on the Worker backend an organization's database is a Durable Object, not a file")

    def sql(self, query: str, params=(), *, org: str | None = None) -> list[tuple]:
        """As ``Live.sql``; ``org`` names the Durable Object directly (routed or not: a deleted organization's too)."""
        if _CONTROL_TABLES.search(query):
            return self._query("control", query, params)
        if org is not None:
            return self._query(f"org:{org}", query, params)
        routes = self.routes()
        named = [p for p in params if isinstance(p, str) and p in routes]
        return combine_org_results(query, [self._query(routes[o], query, params) for o in (named[:1] or list(routes))])

    def write(self, org: str, statements: list[tuple[str, Any]]) -> None:
        """Run ``statements`` in the organization's Durable Object, in one transaction (what a test seeds by hand)."""
        self._ops(f"org:{org}", statements)

    def content_digest(self, org: str) -> str:
        """A digest of every row of every table in the organization's Durable Object (its schema included): what
        stands for the file's bytes where there is no file."""
        h = hashlib.sha256()
        tables = self._query(f"org:{org}", "SELECT name, sql FROM sqlite_master WHERE type = 'table' ORDER BY name")
        for name, ddl in tables:
            h.update(f"{name}\0{ddl}\0".encode())
            if name.startswith("_cf_") or name.startswith("sqlite_"):
                continue
            for row in sorted(self._query(f"org:{org}", f'SELECT * FROM "{name}"'), key=repr):
                h.update(repr(row).encode())
        return h.hexdigest()

    def vector_records(self, prefix: str = "") -> list[dict]:
        """Every vector (id, values, namespace, metadata) whose id starts with ``prefix``, from the emulator's
        Vectorize (pending writes applied first)."""
        stack = self.stack
        httpx.post(f"{stack.admin_url}/vectorize/flush", timeout=30)
        base = f"{stack.emulator_url}/accounts/test-account/vectorize/v2/indexes/{self.index}"
        ids: list[str] = []
        cursor, out = None, []
        with httpx.Client(headers={"Authorization": "Bearer test-token"}, timeout=30) as c:
            while True:
                page = c.get(f"{base}/list", params={"count": 1000, **({"cursor": cursor} if cursor else {})}).json()
                ids += [v["id"] for v in page["result"]["vectors"] if v["id"].startswith(prefix)]
                if not page["result"].get("isTruncated"):
                    break
                cursor = page["result"]["nextCursor"]
            for i in range(0, len(ids), 100):
                out += c.post(f"{base}/get_by_ids", json={"ids": ids[i:i + 100]}).json()["result"]
        return out

    def vectors(self, prefix: str = "") -> list[tuple[str, str, dict]]:
        return [(v["id"], v.get("namespace"), v.get("metadata") or {}) for v in self.vector_records(prefix)]


@contextmanager
def worker_stack():
    """``memex cloudflare dev``'s stack on free ports, its state in a temporary directory (~10 s to start)."""
    with tempfile.TemporaryDirectory() as tmp:
        with start_dev(ROOT, port=0, state_dir=Path(tmp) / "dev", vector_lag_ms=50, say=lambda _: None) as dev:
            yield dev


@contextmanager
def worker_live(stack, tmp: Path, *, embedder: str = "local", **overrides):
    """The service (``MEMEX_BACKEND=worker``) on a loopback port over ``stack``, with ``embedder`` ("local": MiniLM;
    "hash": plumbing without the model's cost) and its own 384-dimensional index."""
    index = INDEXES[embedder]
    _provision_index(stack.emulator_url, index, 384)
    server, ctx = start_live(tmp, embedder=embedder, backend="worker", worker_url=stack.url,
                             worker_secret=stack.secret, cloudflare_vectorize_index=index, **overrides)
    live = WorkerLive(server.base_url, server.memex, server.data_dir, backend="worker")
    live.stack, live.index = stack, index
    try:
        yield live
    finally:
        ctx.__exit__(None, None, None)
