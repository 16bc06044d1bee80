"""The Worker client and adapters against a protocol peer: a small loopback HTTP server written here from
docs/worker-protocol.md (version 1) that checks every request's signature, timestamp window and nonce as the Worker
must, and runs SQL ops on real SQLite files (one per ``db``), vector ops on an in-memory index and ``ai.embed`` on a
deterministic model. It is a second reading of the protocol, not a mock of our code; the real Worker is exercised in
tests/test_worker_live.py."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import sqlite3
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from api.composition.backend import build_backend
from api.settings import Settings, SettingsError
from services.adapters.cloudflare.worker_ai import WorkerEmbedder, worker_chat
from services.adapters.cloudflare.worker_client import (
    WorkerAuthError,
    WorkerClient,
    WorkerError,
    WorkerProtocolError,
    decode_value,
    encode_value,
    sign,
)
from services.adapters.cloudflare.worker_sql import WorkerSqlDatabase
from services.adapters.cloudflare.worker_vectors import WorkerVectorIndex
from services.errors import BackendError, InvalidInput, answer_status
from services.ports import Statement, Vector
from services.storage.migrate import ORG_DIR, discover
from services.storage.worker_stores import WorkerOrgStores

SECRET = "memex-test-secret-0123456789abcdef"


# -- the protocol peer ---------------------------------------------------------------------------------------------


class Peer:
    """What a Worker of protocol 1 does with a request, on loopback."""

    def __init__(self, root: Path, secret: str = SECRET) -> None:
        self.root = root
        self.secret = secret.encode()
        self.nonces: set[str] = set()
        self.requests: list[dict[str, Any]] = []  # every authenticated request body
        self.refused: Counter[str] = Counter()
        self.faults: list[dict[str, Any]] = []  # {"status", "after": bool, "drop": bool, "retry_after", "body"}
        self.vectors: dict[str, dict[str, Any]] = {}
        self.mutations = 0
        self.lock = threading.Lock()
        self.dims = 8
        self.schema: str | None = None  # the org migrations the "Worker" bundles (None: this checkout's)
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> "Peer":
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.shutdown()
        self.server.server_close()

    # -- authentication, as the protocol states it ------------------------------------------------------------

    def check(self, headers: Any, body: bytes) -> tuple[int, str] | None:
        if headers.get("X-Memex-Protocol") != "1":
            return 400, "unsupported_protocol"
        ts, nonce, sig = headers.get("X-Memex-Timestamp"), headers.get("X-Memex-Nonce"), headers.get("X-Memex-Signature")
        if not (ts and ts.isdigit() and nonce and sig):
            return 401, "unauthenticated"
        if not (16 <= len(nonce) <= 64 and all(c.isalnum() or c in "_-" for c in nonce)):
            return 401, "unauthenticated"
        if abs(time.time() - int(ts)) > 300:
            return 401, "stale"
        want = "v1=" + hmac.new(self.secret, f"{ts}.{nonce}.".encode() + body, hashlib.sha256).hexdigest()
        if not hmac.compare_digest(want, sig):
            return 401, "bad_signature"
        with self.lock:
            if nonce in self.nonces:
                return 401, "replayed"
            self.nonces.add(nonce)
        return None

    # -- the ops ----------------------------------------------------------------------------------------------

    def _db(self, name: str) -> sqlite3.Connection:
        path = self.root / (name.replace(":", "_") + ".sqlite3")
        fresh = not path.exists()
        conn = sqlite3.connect(path, isolation_level=None)
        if fresh and name.startswith("org:"):  # a Durable Object migrates itself on first use
            conn.execute("CREATE TABLE d1_migrations(id INTEGER PRIMARY KEY AUTOINCREMENT, name TEXT UNIQUE, "
                         "applied_at TIMESTAMP DEFAULT CURRENT_TIMESTAMP NOT NULL)")
            for m in discover(ORG_DIR):
                conn.executescript(m.sql())
                conn.execute("INSERT INTO d1_migrations (name) VALUES (?)", (m.name,))
        return conn

    @staticmethod
    def _param(v: Any) -> Any:
        if isinstance(v, dict) and set(v) == {"$b64"}:
            return base64.b64decode(v["$b64"])
        return v

    @staticmethod
    def _cell(v: Any) -> Any:
        return {"$b64": base64.b64encode(v).decode()} if isinstance(v, bytes) else v

    def run(self, op: dict[str, Any]) -> dict[str, Any]:
        kind = op["op"]
        try:
            if kind == "sql.batch":
                conn = self._db(op["db"])
                out = []
                try:
                    conn.execute("BEGIN")
                    for st in op["statements"]:
                        cur = conn.execute(st["sql"], [self._param(p) for p in st.get("params", [])])
                        rows = cur.fetchall()
                        cols = [d[0] for d in cur.description or []]
                        out.append({"columns": cols, "rows": [[self._cell(c) for c in r] for r in rows],
                                    "changes": conn.total_changes, "last_row_id": cur.lastrowid or 0})
                    conn.execute("COMMIT")
                except sqlite3.Error:
                    conn.execute("ROLLBACK")
                    raise
                finally:
                    conn.close()
                return {"ok": True, "results": out}
            if kind == "sql.script":
                conn = self._db(op["db"])
                try:
                    conn.executescript("BEGIN;" + op["sql"] + ";COMMIT;")
                finally:
                    conn.close()
                return {"ok": True}
            if kind == "vec.upsert":
                with self.lock:
                    for v in op["vectors"]:
                        self.vectors[v["id"]] = v
                    self.mutations += 1
                    return {"ok": True, "mutation_id": f"m{self.mutations:08d}"}
            if kind == "vec.delete":
                with self.lock:
                    for i in op["ids"]:
                        self.vectors.pop(i, None)
                    self.mutations += 1
                    return {"ok": True, "mutation_id": f"m{self.mutations:08d}"}
            if kind == "vec.info":
                return {"ok": True, "dimensions": self.dims, "vector_count": len(self.vectors),
                        **({"processed_up_to_mutation": f"m{self.mutations:08d}"} if self.mutations else {})}
            if kind == "vec.query":
                q = np.asarray(op["vector"])
                hits = []
                for v in self.vectors.values():
                    if v.get("namespace") != op.get("namespace"):
                        continue
                    if any(v.get("metadata", {}).get(k) != f["$eq"] for k, f in (op.get("filter") or {}).items()):
                        continue
                    hits.append({"id": v["id"], "score": float(np.dot(q, v["values"])), "namespace": v["namespace"],
                                 **({"metadata": v["metadata"]} if op.get("return_metadata") != "none" else {})})
                hits.sort(key=lambda h: -h["score"])
                return {"ok": True, "matches": hits[:op["top_k"]]}
            if kind == "vec.get":
                return {"ok": True, "vectors": [self.vectors[i] for i in op["ids"] if i in self.vectors]}
            if kind == "ai.embed":
                data = [[float(len(t)), 1.0] + [0.0] * (self.dims - 2) for t in op["texts"]]
                return {"ok": True, "shape": [len(data), self.dims], "data": data}
            if kind == "ai.run":
                return {"ok": True, "result": {"response": {"echo": op["input"]["messages"][-1]["content"]},
                                               "usage": {"prompt_tokens": 3, "completion_tokens": 2}}}
            if kind == "ping":
                return {"ok": True, "protocol": 1, "worker_version": "peer",
                        "org_schema_version": self.schema or discover(ORG_DIR)[-1].name}
            return {"ok": False, "error": {"code": "unknown_op", "message": kind}}
        except sqlite3.Error as exc:
            return {"ok": False, "error": {"code": "sql_error", "message": f"{exc}: SQLITE_ERROR"}}

    def _handler(self):
        peer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a: Any) -> None:
                pass

            def _answer(self, status: int, body: Any, headers: dict[str, str] | None = None) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                if self.path != "/v1/rpc":
                    return self._answer(404, {"error": {"code": "not_found", "message": self.path}})
                denied = peer.check(self.headers, body)
                if denied is not None:
                    peer.refused[denied[1]] += 1
                    return self._answer(denied[0], {"error": {"code": denied[1], "message": "refused"}})
                req = json.loads(body)
                if req.get("v") != 1:
                    return self._answer(400, {"error": {"code": "unsupported_protocol", "message": "v"}})
                peer.requests.append(req)
                fault = peer.faults.pop(0) if peer.faults else None
                if fault and not fault.get("after"):
                    return self._fault(fault)
                results = [peer.run(op) for op in req["ops"]]
                if fault:
                    return self._fault(fault)
                self._answer(200, {"v": 1, "results": results})

            def _fault(self, fault: dict[str, Any]) -> None:
                if fault.get("drop"):
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                headers = {"Retry-After": str(fault["retry_after"])} if "retry_after" in fault else None
                self._answer(fault.get("status", 503), fault.get("body") or {"error": {"code": "unavailable",
                                                                                      "message": "injected"}}, headers)

        return Handler


@pytest.fixture
def peer(tmp_path):
    with Peer(tmp_path) as p:
        yield p


def client_for(peer: Peer, http: httpx.AsyncClient, **kw: Any) -> WorkerClient:
    async def no_sleep(_: float) -> None:
        return None

    return WorkerClient(http, url=peer.url, secret=SECRET, sleep=no_sleep, **kw)


def run(coro):
    return asyncio.run(coro)


# -- the wire ---------------------------------------------------------------------------------------------------------


def test_the_signature_matches_an_independent_hmac_implementation():
    # computed with Node's crypto (createHmac("sha256", secret).update("1700000000.nonce_0123456789AB." + body))
    body = b'{"v":1,"ops":[{"op":"ping"}]}'
    assert sign(SECRET.encode(), 1700000000, "nonce_0123456789AB", body) == (
        "v1=2e87eecfd7de224ef82b49357c7b2b4777b89b522a06413c2bcc0db6891ea0e2")


def test_blobs_travel_as_b64_both_ways():
    assert encode_value(b"\x00\xffab") == {"$b64": "AP9hYg=="}
    assert decode_value({"$b64": "AP9hYg=="}) == b"\x00\xffab"
    assert encode_value("text") == "text" and decode_value({"$b64": "x", "other": 1}) == {"$b64": "x", "other": 1}
    with pytest.raises(BackendError):
        decode_value({"$b64": "not base64!"})


def test_sql_round_trip_blobs_and_one_request_per_call(peer):
    async def go():
        async with httpx.AsyncClient() as http:
            client = client_for(peer, http)
            db = WorkerSqlDatabase(client, "control")
            await db.executescript("CREATE TABLE t (id INTEGER PRIMARY KEY, b BLOB, s TEXT)")
            results = await db.batch([Statement("INSERT INTO t (b, s) VALUES (?, ?)", (b"\x00\x01\xfe", "one")),
                                      Statement("INSERT INTO t (b, s) VALUES (?, ?)", (None, "two"))])
            assert [r.last_row_id for r in results] == [1, 2]
            rows = (await db.execute("SELECT id, b, s FROM t ORDER BY id")).rows
            return client, rows

    client, rows = run(go())
    assert rows == [{"id": 1, "b": b"\x00\x01\xfe", "s": "one"}, {"id": 2, "b": None, "s": "two"}]
    assert client.requests == 3 and len(peer.requests) == 3  # script, batch, execute: one request each
    assert [len(r["ops"]) for r in peer.requests] == [1, 1, 1]
    assert peer.requests[1]["ops"][0]["op"] == "sql.batch" and len(peer.requests[1]["ops"][0]["statements"]) == 2
    assert peer.requests[1]["ops"][0]["statements"][0]["params"][0] == {"$b64": "AAH+"}
    assert len(peer.nonces) == 3  # a fresh nonce per request


def test_sql_errors_map_like_the_d1_adapter(peer):
    async def go():
        async with httpx.AsyncClient() as http:
            db = WorkerSqlDatabase(client_for(peer, http), "control")
            await db.executescript("CREATE TABLE u (k TEXT PRIMARY KEY)")
            await db.execute("INSERT INTO u (k) VALUES (?)", ("a",))
            with pytest.raises(sqlite3.IntegrityError):
                await db.execute("INSERT INTO u (k) VALUES (?)", ("a",))
            with pytest.raises(sqlite3.OperationalError):
                await db.execute("SELECT nope FROM u")
            # a batch is one transaction: the failing second statement takes the first one with it
            with pytest.raises(sqlite3.IntegrityError):
                await db.batch([Statement("INSERT INTO u (k) VALUES (?)", ("b",)),
                                Statement("INSERT INTO u (k) VALUES (?)", ("a",))])
            assert (await db.execute("SELECT COUNT(*) AS n FROM u")).rows == [{"n": 1}]
            before = len(peer.requests)
            for bad in ("BEGIN", "SELECT 1; SELECT 2"):
                with pytest.raises(InvalidInput):
                    await db.execute(bad)
            with pytest.raises(InvalidInput):
                await db.execute("SELECT " + ",".join("?" * 101), tuple(range(101)))
            assert len(peer.requests) == before  # refused before sending

    run(go())


def test_a_storage_failure_is_a_503_not_a_sql_error(peer):
    peer.faults.append({"status": 200, "body": {"v": 1, "results": [
        {"ok": False, "error": {"code": "storage_unavailable", "message": "org:x: Durable Object is overloaded"}}]}})

    async def go():
        async with httpx.AsyncClient() as http:
            client = client_for(peer, http, max_attempts=1)
            with pytest.raises(WorkerError) as err:
                await WorkerSqlDatabase(client, "control").execute("SELECT 1 AS one")
            assert not isinstance(err.value, sqlite3.Error) and answer_status(err.value) == 503

    run(go())


def test_a_wrong_secret_is_refused_and_says_which_setting(peer):
    async def go():
        async with httpx.AsyncClient() as http:
            client = WorkerClient(http, url=peer.url, secret="another-secret-of-at-least-32-bytes!!")
            with pytest.raises(WorkerAuthError) as err:
                await client.ping()
            return err.value

    err = run(go())
    assert "MEMEX_WORKER_SECRET" in err.message and answer_status(err) == 503 and peer.refused["bad_signature"] == 1
    assert not peer.requests


def test_a_clock_outside_the_window_is_refused(peer):
    async def go():
        async with httpx.AsyncClient() as http:
            client = WorkerClient(http, url=peer.url, secret=SECRET, clock=lambda: time.time() - 400)
            with pytest.raises(WorkerAuthError):
                await client.ping()

    run(go())
    assert peer.refused["stale"] == 1


def test_another_protocol_version_is_named(peer):
    peer.faults.append({"status": 400, "body": {"error": {"code": "unsupported_protocol", "message": "speaks 2"}}})

    async def go():
        async with httpx.AsyncClient() as http:
            with pytest.raises(WorkerProtocolError, match="protocol 1"):
                await client_for(peer, http).ping()

    run(go())


def test_idempotent_work_is_retried_with_fresh_nonces_and_a_plain_insert_is_not(peer):
    async def go():
        async with httpx.AsyncClient() as http:
            client = client_for(peer, http)
            db = WorkerSqlDatabase(client, "control")
            await db.executescript("CREATE TABLE c (id INTEGER PRIMARY KEY AUTOINCREMENT, v TEXT)")
            peer.faults += [{"status": 503}, {"status": 429, "retry_after": 0}]
            assert (await db.execute("SELECT COUNT(*) AS n FROM c")).rows == [{"n": 0}]
            assert client.retries == 2
            # the response is lost after the insert ran: sending it again would insert twice
            peer.faults.append({"status": 502, "after": True})
            with pytest.raises(WorkerError):
                await db.execute("INSERT INTO c (v) VALUES (?)", ("once",))
            assert (await db.execute("SELECT COUNT(*) AS n FROM c")).rows == [{"n": 1}]
            # a dropped connection on an idempotent statement is retried
            peer.faults.append({"drop": True, "after": True})
            await db.execute("INSERT OR IGNORE INTO c (id, v) VALUES (?, ?)", (7, "seven"))
            return client

    client = run(go())
    assert peer.refused == Counter()  # no retry reused a nonce
    assert client.snapshot()["retries"] == 3 and client.snapshot()["ops"]["sql.batch"] >= 5


# -- vectors, embeddings, models --------------------------------------------------------------------------------------


def test_vectors_through_the_worker(peer):
    async def go():
        async with httpx.AsyncClient() as http:
            idx = WorkerVectorIndex(client_for(peer, http), "memex-bge-768", dimensions=8, model="m")
            a, b = np.eye(8, dtype=np.float32)[0], np.eye(8, dtype=np.float32)[1]
            m1 = await idx.upsert([Vector("o:1", a * 3, "o", {"organization_id": "o"}),
                                   Vector("o:2", b, "o", {"organization_id": "o"}),
                                   Vector("p:1", a, "p", {"organization_id": "p"})])
            assert m1 and await idx.searchable(m1)
            hits = await idx.query(a, top_k=5, namespace="o", filter={"organization_id": {"$eq": "o"}},
                                   return_metadata=True)
            assert [h.id for h in hits] == ["o:1", "o:2"] and hits[0].metadata == {"organization_id": "o"}
            got = await idx.get_by_ids(["o:1", "missing"])
            assert [g.id for g in got] == ["o:1"] and np.allclose(got[0].values, a)  # stored as a unit vector
            await idx.delete_by_ids(["o:1"])
            assert (await idx.info()).vector_count == 2
            wrong = WorkerVectorIndex(idx.client, "memex-bge-768", dimensions=768, model="m")
            with pytest.raises(BackendError, match="768"):
                await wrong.upsert([Vector("o:3", np.ones(768), "o", {})])

    run(go())


def test_embeddings_go_in_batches_of_100_in_one_request(peer):
    async def go():
        async with httpx.AsyncClient() as http:
            client = client_for(peer, http)
            emb = WorkerEmbedder(client, dimensions=8)
            vecs = await emb.embed([f"text {i}" for i in range(250)])
            assert vecs.shape == (250, 8) and np.allclose(np.linalg.norm(vecs, axis=1), 1.0)
            chat = worker_chat(client)
            answer = await chat.complete_json([{"role": "user", "content": "hello"}], {"type": "object"})
            return client, answer

    client, answer = run(go())
    assert client.requests == 2 and [len(op["texts"]) for op in peer.requests[0]["ops"]] == [100, 100, 50]
    assert answer == {"echo": "hello"} and peer.requests[1]["ops"][0]["op"] == "ai.run"


# -- organizations' stores --------------------------------------------------------------------------------------------


def test_org_stores_provision_nothing_and_drop_empties_the_durable_object(peer):
    async def go():
        async with httpx.AsyncClient() as http:
            client = client_for(peer, http)
            control = WorkerSqlDatabase(client, "control")
            for m in discover(ORG_DIR.parent / "control"):
                await control.executescript(m.sql())
            stores = WorkerOrgStores(control, open_database=lambda loc: WorkerSqlDatabase(client, loc),
                                     open_index=lambda name: WorkerVectorIndex(client, name, dimensions=8, model="m"),
                                     index_name="memex-bge-768")
            before = client.requests
            route = await stores.provision("org_0123456789abcdef")
            assert client.requests == before  # no request: the Durable Object comes into being on first use
            await control.execute(route.sql, route.params)
            store = await stores.open("org_0123456789abcdef")
            assert store.db.db == "org:org_0123456789abcdef"
            org = "org_0123456789abcdef"
            await store.db.batch([
                Statement("INSERT INTO documents (id, organization_id, content, content_hash, created_at, updated_at) "
                          "VALUES (?, ?, 'hello world', 'h', 1, 1)", ("t1", org)),
                Statement("INSERT INTO chunks (id, organization_id, kind, parent_id, ordinal, content, token_count) "
                          "VALUES ('c1', ?, 'thought', 't1', 0, 'hello world', 2)", (org,))])
            n = (await store.db.execute("SELECT COUNT(*) AS n FROM chunks_fts WHERE chunks_fts MATCH 'hello'")).rows
            await store.vectors.upsert([("c1", np.eye(8)[0], {"kind": "thought"})])
            assert peer.vectors
            await stores.drop(org)
            left = (await WorkerSqlDatabase(client, f"org:{org}").execute(
                "SELECT (SELECT COUNT(*) FROM documents) + (SELECT COUNT(*) FROM chunks) + "
                "(SELECT COUNT(*) FROM chunks_fts) + (SELECT COUNT(*) FROM documents_fts) AS n")).rows
            routed = (await control.execute("SELECT COUNT(*) AS n FROM org_databases")).rows
            return n, left, routed

    n, left, routed = run(go())
    assert left == [{"n": 0}] and routed == [{"n": 0}]
    assert not peer.vectors  # the organization's vector went with it
    assert n == [{"n": 1}]


# -- settings -----------------------------------------------------------------------------------------------------------


def test_settings_choose_and_check_the_worker_backend():
    s = Settings(backend="worker", worker_url="https://memex.example.workers.dev", worker_secret="s" * 32)
    assert (s.sql, s.vectors) == ("worker", "worker") and "s" * 32 not in repr(s)
    assert Settings(backend="worker", worker_url="http://127.0.0.1:8787", worker_secret="s" * 32).worker_url
    with pytest.raises(SettingsError, match="MEMEX_WORKER_SECRET must be at least 32 bytes"):
        Settings(backend="worker", worker_url="https://w.example", worker_secret="short")
    with pytest.raises(SettingsError, match="MEMEX_WORKER_URL must use https"):
        Settings(backend="worker", worker_url="http://w.example", worker_secret="s" * 32)
    with pytest.raises(SettingsError, match="MEMEX_WORKER_URL"):
        Settings(worker_url="ftp://w.example")
    with pytest.raises(SettingsError, match="unset MEMEX_SQL and MEMEX_VECTORS"):
        Settings(backend="worker", sql="d1", vectors="vectorize")
    with pytest.raises(SettingsError, match="MEMEX_WORKER_URL and MEMEX_WORKER_SECRET"):
        build_backend(Settings(backend="worker", embedder="hash"))


def test_from_env_reads_the_worker_settings(monkeypatch):
    monkeypatch.setenv("MEMEX_BACKEND", "worker")
    monkeypatch.setenv("MEMEX_WORKER_URL", "https://memex.example.workers.dev")
    monkeypatch.setenv("MEMEX_WORKER_SECRET", "x" * 40)
    s = Settings.from_env()
    assert (s.backend, s.sql, s.worker_url, s.worker_secret) == ("worker", "worker", "https://memex.example.workers.dev",
                                                                  "x" * 40)
    backend = build_backend(s.with_(embedder="workers-ai", llm="workers-ai", reranker="workers-ai"))
    try:
        assert backend.worker is not None and backend.async_index
        assert backend.cloudflare_stats() == {"worker": backend.worker.snapshot()}
        assert type(backend.embedder).__name__ == "WorkerEmbedder"
    finally:
        asyncio.run(backend.close())


# -- memex cloudflare dev -------------------------------------------------------------------------------------------


def test_cloudflare_dev_names_what_is_missing(tmp_path, monkeypatch):
    from api.cloudflare_dev_cli import DevSetupError, find_root, preflight

    (tmp_path / "worker").mkdir()
    (tmp_path / "worker" / "package.json").write_text("{}")
    (tmp_path / "wrangler.toml").write_text("name = 'x'\n")
    assert find_root(tmp_path / "worker") == tmp_path
    with pytest.raises(DevSetupError, match=r"npm ci --prefix .*worker"):
        preflight(tmp_path)
    monkeypatch.setenv("PATH", str(tmp_path))  # no node, no npm
    with pytest.raises(DevSetupError, match="Node.js"):
        preflight(tmp_path)


def test_cloudflare_dev_creates_the_metadata_indexes_the_adapters_filter_on():
    from api.cloudflare_dev_cli import DEFAULT_INDEX as DEV_INDEX
    from api.cloudflare_dev_cli import INDEXED_PROPERTIES as DEV_PROPERTIES
    from api.composition.worker import DEFAULT_INDEX
    from services.adapters.cloudflare.vectorize import INDEXED_PROPERTIES

    assert DEV_PROPERTIES == INDEXED_PROPERTIES and DEV_INDEX == DEFAULT_INDEX


def test_coalesced_ops_share_a_request_and_keep_their_own_results(peer):
    async def go():
        async with httpx.AsyncClient() as http:
            client = client_for(peer, http, coalesce=True)
            db = WorkerSqlDatabase(client, "control")
            await db.executescript("CREATE TABLE k (id TEXT PRIMARY KEY)")
            await db.execute("INSERT INTO k (id) VALUES ('taken')")
            before = len(peer.requests)
            outcomes = await asyncio.gather(
                *(db.execute("INSERT INTO k (id) VALUES (?)", (f"id{i}",)) for i in range(5)),
                db.execute("INSERT INTO k (id) VALUES ('taken')"),
                db.execute("SELECT COUNT(*) AS n FROM k"),
                return_exceptions=True)
            assert len(peer.requests) == before + 1 and len(peer.requests[-1]["ops"]) == 7
            assert all(r.changes == 1 for r in outcomes[:5])
            assert isinstance(outcomes[5], sqlite3.IntegrityError)  # only its caller sees the failure
            assert outcomes[6].rows[0]["n"] in range(1, 7)
            # a request that fails as a whole fails every caller in it, and nobody waits forever
            peer.faults.append({"status": 400, "body": {"error": {"code": "invalid_request", "message": "no"}}})
            failed = await asyncio.gather(*(db.execute("SELECT 1 AS one") for _ in range(3)), return_exceptions=True)
            assert all(isinstance(f, WorkerError) for f in failed)
            return client

    client = run(go())
    assert client.snapshot()["coalesced_ops"] == 10


def test_background_work_coalesces_and_the_request_path_does_not(peer):
    """The job worker's rounds (``services.background``) share requests between concurrent ops, vector ops included,
    on a client that does not coalesce the request path's."""
    from services.background import background

    async def go():
        async with httpx.AsyncClient() as http:
            client = client_for(peer, http)  # coalesce off: the request path's setting
            db = WorkerSqlDatabase(client, "control")
            await db.executescript("CREATE TABLE k (id TEXT PRIMARY KEY)")
            before = len(peer.requests)
            await asyncio.gather(*(db.execute("INSERT INTO k (id) VALUES (?)", (f"a{i}",)) for i in range(3)))
            assert len(peer.requests) == before + 3  # one request each
            before = len(peer.requests)
            with background():
                rows = await asyncio.gather(*(db.execute("INSERT INTO k (id) VALUES (?)", (f"b{i}",)) for i in range(3)),
                                            db.execute("SELECT COUNT(*) AS n FROM k"))
            assert len(peer.requests) == before + 1 and len(peer.requests[-1]["ops"]) == 4
            assert all(r.changes == 1 for r in rows[:3]) and rows[3].rows[0]["n"] in range(3, 7)
            before = len(peer.requests)
            await asyncio.gather(*(db.execute("SELECT 1 AS one") for _ in range(2)))  # outside again: its own requests
            assert len(peer.requests) == before + 2
            return client

    assert run(go()).snapshot()["coalesced_ops"] == 4


def test_a_worker_with_older_org_migrations_is_refused_before_an_organization_opens(peer):
    from api.composition import worker
    from services.adapters.hash_embedder import HashEmbedder

    peer.schema = "0001_organization.sql"

    async def go():
        async with httpx.AsyncClient() as http:
            client = client_for(peer, http)
            stores = worker.stores(Settings(embedder="hash"), client, WorkerSqlDatabase(client, "control"),
                                   HashEmbedder())
            with pytest.raises(BackendError, match="deploy the Worker"):
                await stores.open("org_0123456789abcdef")
            assert [op["op"] for r in peer.requests for op in r["ops"]] == ["ping"]  # refused before any SQL
            peer.schema = None
            assert (await worker.check_org_schema(client))["protocol"] == 1

    run(go())
