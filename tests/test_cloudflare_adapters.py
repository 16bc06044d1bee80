"""Cloudflare adapters (D1, Vectorize v2, Workers AI, the shared client and budget).

Part 1: unit tests over ``httpx.MockTransport`` — envelopes, error mapping, batching splits, topK plans,
retries, the budget and the limits — with a fake clock, so nothing sleeps.
Part 2: port-contract tests against the local emulator (tests/cloudflare_emulator): the behaviours the
embedded adapters show (atomic batch and script, migrations, FTS5, constraint errors, vector write ->
lagged query -> get -> delete, namespace + filter isolation), retries and the budget against real HTTP,
``memex cloudflare check`` and ``reindex``.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
import uuid

import httpx
import numpy as np
import pytest

from api.composition.cloudflare import cloudflare_stats, d1_database, shared_client, vectorize_index, workers_ai_embedder
from services.adapters.cloudflare import (
    BudgetExhausted,
    CloudflareApi,
    CloudflareAuthError,
    CloudflareNotFound,
    CloudflareRateLimited,
    D1Database,
    D1IntegrityError,
    RequestBudget,
    VectorizeIndex,
    WorkersAIChat,
    WorkersAIEmbedder,
    WorkersAIReranker,
)
from services.adapters.cloudflare.d1_sql import is_idempotent, split_statements
from services.adapters.cloudflare.vectorize import INDEXED_PROPERTIES, model_description
from services.adapters.cloudflare.workers_ai import conservative_token_count
from services.adapters.onnx_embedder import WordPieceCount
from services.errors import BackendError, EmbeddingModelMismatch, InvalidInput, PayloadTooLarge
from services.ports import Embedder, SqlDatabase, Statement, Vector, VectorIndex

ACCOUNT = "acc"
BASE = "https://cf.test/client/v4"


# ==========================================================================================================
# Helpers
# ==========================================================================================================


class FakeTime:
    """A clock that only moves when someone sleeps."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += max(0.0, seconds)


def envelope(result=None, *, status=200, success=True, errors=None, headers=None) -> httpx.Response:
    body = {"success": success, "errors": errors or [], "messages": [], "result": result}
    return httpx.Response(status, json=body, headers=headers)


def error(status: int, message: str, code: int = 7500, headers=None) -> httpx.Response:
    return envelope(None, status=status, success=False, errors=[{"code": code, "message": message}], headers=headers)


def d1_item(columns=(), rows=(), changes=0, last_row_id=0) -> dict:
    return {
        "success": True,
        "results": {"columns": list(columns), "rows": [list(r) for r in rows]},
        "meta": {"changes": changes, "last_row_id": last_row_id, "duration": 0.1},
    }


class Recorder:
    """MockTransport handler: a list of canned responses (or a callable) and every request seen."""

    def __init__(self, *responses) -> None:
        self.responses = list(responses)
        self.requests: list[httpx.Request] = []
        self.route = None

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        if self.route is not None:
            return self.route(request)
        item = self.responses.pop(0) if len(self.responses) > 1 else self.responses[0]
        if isinstance(item, Exception):
            raise item
        return item

    def bodies(self) -> list:
        return [json.loads(r.content) if r.content else None for r in self.requests]


def make_api(recorder: Recorder, *, limit=1100, window=300.0, max_wait=30.0, t: FakeTime | None = None, **kw):
    t = t or FakeTime()
    http = httpx.AsyncClient(transport=httpx.MockTransport(recorder))
    budget = RequestBudget(limit, window, max_wait=max_wait, clock=t.clock, wall=lambda: 1_700_000_000.0, sleep=t.sleep)
    api = CloudflareApi(http, account_id=ACCOUNT, api_token="tok", base_url=BASE, budget=budget, sleep=t.sleep, **kw)
    return api, t


# ==========================================================================================================
# D1
# ==========================================================================================================


async def test_d1_execute_sends_raw_statement_and_maps_rows():
    rec = Recorder(envelope([d1_item(["id", "n"], [["a", 1], ["b", 2]])]))
    api, _ = make_api(rec)
    db = D1Database(api, "db1")
    assert isinstance(db, SqlDatabase)
    res = await db.execute("SELECT id, n FROM t WHERE x = ? AND y = ? AND z IS ? AND f = ? AND b = ?", ["s", 7, None, 1.5, True])
    assert res.rows == [{"id": "a", "n": 1}, {"id": "b", "n": 2}]
    assert res.changes == 0 and res.last_row_id == 0
    req = rec.requests[0]
    assert req.method == "POST"
    assert str(req.url) == f"{BASE}/accounts/{ACCOUNT}/d1/database/db1/raw"
    assert req.headers["authorization"] == "Bearer tok"
    body = json.loads(req.content)
    # numbers travel as JSON numbers (not the spec's strings), bools as 1/0, None as null
    assert body == {"sql": body["sql"], "params": ["s", 7, None, 1.5, 1]}


async def test_d1_query_endpoint_rows_and_write_meta():
    rec = Recorder(envelope([{"success": True, "results": [{"id": "x"}], "meta": {"changes": 1, "last_row_id": 42}}]))
    api, _ = make_api(rec)
    db = D1Database(api, "db1", endpoint="query")
    res = await db.execute("INSERT INTO t (id) VALUES (?) RETURNING id", ["x"])
    assert res.rows == [{"id": "x"}] and res.changes == 1 and res.last_row_id == 42
    assert rec.requests[0].url.path.endswith("/d1/database/db1/query")


async def test_d1_batch_is_one_request_with_batch_body():
    rec = Recorder(envelope([d1_item(changes=1, last_row_id=5), d1_item(["n"], [[3]])]))
    api, _ = make_api(rec)
    db = D1Database(api, "db1")
    out = await db.batch([Statement("INSERT INTO t (a) VALUES (?)", (1,)), Statement("SELECT count(*) AS n FROM t")])
    assert [r.changes for r in out] == [1, 0] and out[1].rows == [{"n": 3}] and out[0].last_row_id == 5
    assert len(rec.requests) == 1
    assert rec.bodies()[0] == {"batch": [{"sql": "INSERT INTO t (a) VALUES (?)", "params": [1]},
                                         {"sql": "SELECT count(*) AS n FROM t", "params": []}]}
    assert await db.batch([]) == [] and len(rec.requests) == 1


async def test_d1_batch_result_count_mismatch_is_backend_error():
    rec = Recorder(envelope([d1_item()]))
    api, _ = make_api(rec)
    with pytest.raises(BackendError):
        await D1Database(api, "db1").batch([Statement("SELECT 1"), Statement("SELECT 2")])


async def test_d1_executescript_sends_whole_script_once():
    rec = Recorder(envelope([d1_item(), d1_item(), d1_item()]))
    api, _ = make_api(rec)
    script = (
        "CREATE TABLE a (x TEXT); -- comment; with a semicolon\n"
        "CREATE TRIGGER tr AFTER INSERT ON a BEGIN INSERT INTO a VALUES ('y;'); END;\n"
        "INSERT INTO d1_migrations (name) values ('0001_x.sql');\n"
    )
    await D1Database(api, "db1").executescript(script)
    assert rec.bodies() == [{"sql": script}]
    assert len(split_statements(script)) == 3


@pytest.mark.parametrize("sql", ["BEGIN", "  commit;", "SAVEPOINT s1", "ROLLBACK", "-- hi\nBEGIN TRANSACTION"])
async def test_d1_transactions_refused_before_sending(sql):
    rec = Recorder(envelope([d1_item()]))
    api, _ = make_api(rec)
    db = D1Database(api, "db1")
    with pytest.raises(InvalidInput):
        await db.execute(sql)
    with pytest.raises(InvalidInput):
        await db.batch([Statement(sql)])
    with pytest.raises(InvalidInput):
        await db.executescript(f"CREATE TABLE z (a);\n{sql};\n")
    assert rec.requests == []


async def test_d1_limits_fail_fast_without_a_request():
    rec = Recorder(envelope([d1_item()]))
    api, _ = make_api(rec)
    db = D1Database(api, "db1")
    marks = ",".join("?" * 101)
    with pytest.raises(InvalidInput, match="100"):
        await db.execute(f"SELECT * FROM t WHERE id IN ({marks})", list(range(101)))
    with pytest.raises(InvalidInput, match="100"):
        await db.execute("SELECT ?101", [1])
    with pytest.raises(InvalidInput, match="100000|100,000"):
        await db.execute("SELECT '" + "x" * 100_001 + "'")
    with pytest.raises(InvalidInput, match="batch statement 2"):
        await db.batch([Statement("SELECT 1"), Statement(f"SELECT {marks}", tuple(range(101)))])
    with pytest.raises(InvalidInput, match="2\\^53"):
        await db.execute("SELECT ?", [2**53 + 1])
    with pytest.raises(InvalidInput, match="BLOB"):
        await db.execute("SELECT ?", [b"\x00\x01"])
    with pytest.raises(InvalidInput):
        await db.execute("SELECT ?", [float("nan")])
    with pytest.raises(PayloadTooLarge):
        await db.execute("SELECT ?", ["x" * 2_000_001])
    with pytest.raises(InvalidInput, match="one statement"):
        await db.execute("SELECT 1; SELECT 2")
    assert rec.requests == []
    # the limits themselves are fine: 100 params, a '?' inside a string literal, 2^53
    marks100 = ",".join("?" * 100)
    await db.execute(f"SELECT * FROM t WHERE id IN ({marks100}) AND s = '?101'", list(range(100)))
    await db.execute("SELECT ?", [2**53])
    assert len(rec.requests) == 2


@pytest.mark.parametrize(
    "message, cls",
    [
        ("D1_ERROR: UNIQUE constraint failed: t.id: SQLITE_CONSTRAINT", sqlite3.IntegrityError),
        ("D1_ERROR: FOREIGN KEY constraint failed: SQLITE_CONSTRAINT", sqlite3.IntegrityError),
        ("D1_ERROR: no such table: nope: SQLITE_ERROR", sqlite3.OperationalError),
        ("D1_ERROR: Wrong number of parameter bindings for SQL query.", sqlite3.ProgrammingError),
        ("D1_TYPE_ERROR: Type 'object' not supported for value '{}'", sqlite3.ProgrammingError),
    ],
)
async def test_d1_sql_errors_surface_like_sqlite3(message, cls):
    rec = Recorder(error(400, message))
    api, _ = make_api(rec)
    with pytest.raises(cls) as info:
        await D1Database(api, "db1").execute("INSERT INTO t (id) VALUES (?)", ["a"])
    assert message in str(info.value)
    assert not isinstance(info.value, BackendError)
    assert len(rec.requests) == 1  # SQL errors are never retried


async def test_d1_server_side_limit_errors_are_invalid_input():
    rec = Recorder(error(400, "D1_ERROR: Statement too long: SQLITE_TOOBIG"))
    api, _ = make_api(rec)
    with pytest.raises(InvalidInput):
        await D1Database(api, "db1").execute("SELECT 1")


async def test_auth_and_not_found_are_backend_errors():
    rec = Recorder(error(403, "Authentication error", code=10000))
    api, _ = make_api(rec)
    with pytest.raises(CloudflareAuthError) as info:
        await D1Database(api, "db1").execute("SELECT 1")
    assert isinstance(info.value, BackendError) and info.value.status == 403
    rec = Recorder(error(404, "The database db1 could not be found", code=7404))
    api, _ = make_api(rec)
    with pytest.raises(CloudflareNotFound):
        await D1Database(api, "db1").execute("SELECT 1")
    assert len(rec.requests) == 1


@pytest.mark.parametrize(
    "sql, expected",
    [
        ("SELECT * FROM t", True),
        ("WITH x AS (SELECT 1) SELECT * FROM x", True),
        ("PRAGMA table_info(t)", True),
        ("CREATE TABLE IF NOT EXISTS t (a)", True),
        ("CREATE TABLE t (a)", False),
        ("DROP TABLE IF EXISTS t", True),
        ("DELETE FROM t WHERE id = ?", True),
        ("DELETE FROM t WHERE id = ? RETURNING id", False),
        ("INSERT OR IGNORE INTO t VALUES (1)", True),
        ("INSERT INTO t VALUES (1) ON CONFLICT(id) DO NOTHING", True),
        ("INSERT OR REPLACE INTO t VALUES (1)", True),
        ("INSERT INTO t VALUES (1)", False),
        ("INSERT INTO t VALUES (1) ON CONFLICT(id) DO UPDATE SET n = n + 1", False),
        ("UPDATE t SET n = n + 1", False),
        ("WITH x AS (SELECT 1) INSERT INTO t SELECT * FROM x", False),
        ("SELECT 'INSERT INTO t' AS s", True),
        ("CREATE TABLE IF NOT EXISTS a (x); INSERT INTO b VALUES (1);", False),
    ],
)
def test_d1_idempotency_classification(sql, expected):
    assert is_idempotent(sql) is expected


# -- retries -----------------------------------------------------------------------------------------------


async def test_429_with_retry_after_is_honoured_then_succeeds():
    rec = Recorder(error(429, "Please wait", code=971, headers={"retry-after": "3"}), envelope([d1_item(["n"], [[1]])]))
    api, t = make_api(rec)
    t0 = t.now
    res = await D1Database(api, "db1").execute("INSERT INTO t VALUES (1)")  # not idempotent: a 429 never ran
    assert res.rows == [{"n": 1}]
    assert len(rec.requests) == 2
    assert t.now - t0 >= 3.0  # waited at least Retry-After before the second try
    assert api.retries["d1"] == 1


async def test_429_with_long_retry_after_blocks_every_adapter_and_fails_fast():
    rec = Recorder(error(429, "blocked", code=971, headers={"retry-after": "300"}))
    api, t = make_api(rec)
    with pytest.raises(CloudflareRateLimited) as info:
        await D1Database(api, "db1").execute("SELECT 1")
    assert info.value.retry_after == 300 and isinstance(info.value, BackendError)
    snap = api.budget.snapshot()
    assert snap["blocked_until"] is not None and snap["remaining"] == 0
    # every later call (any adapter) fails fast without reaching Cloudflare
    with pytest.raises(BudgetExhausted):
        await VectorizeIndex(api, "idx", dimensions=4, model="m").info()
    assert len(rec.requests) == 1
    t.now += 301
    rec.responses = [envelope({"dimensions": 4, "vectorCount": 0, "processedUpToMutation": None})]
    assert (await VectorizeIndex(api, "idx", dimensions=4, model="m").info()).dimensions == 4


async def test_5xx_retried_for_reads_not_for_plain_inserts():
    rec = Recorder(error(502, "bad gateway", code=10001), error(503, "unavailable", code=10001), envelope([d1_item()]))
    api, t = make_api(rec)
    db = D1Database(api, "db1")
    await db.execute("SELECT 1")
    assert len(rec.requests) == 3 and api.retries["d1"] == 2
    assert all(s > 0 for s in t.sleeps)  # backoff with jitter: never zero
    rec2 = Recorder(error(500, "internal", code=10001))
    api2, _ = make_api(rec2)
    with pytest.raises(BackendError):
        await D1Database(api2, "db1").execute("INSERT INTO t VALUES (1)")
    assert len(rec2.requests) == 1


async def test_html_5xx_body_is_handled():
    rec = Recorder(httpx.Response(502, text="<html>bad gateway</html>"), envelope([d1_item()]))
    api, _ = make_api(rec)
    await D1Database(api, "db1").execute("SELECT 1")
    assert len(rec.requests) == 2


@pytest.mark.parametrize("message", ["D1_ERROR: Network connection lost.", "D1_ERROR: transient issue on remote node",
                                     "D1_ERROR: D1 DB reset because its code was updated."])
async def test_transient_d1_errors_retry_only_idempotent_work(message):
    rec = Recorder(error(500, message), envelope([d1_item()]))
    api, _ = make_api(rec)
    db = D1Database(api, "db1")
    await db.execute("INSERT OR IGNORE INTO t VALUES (1)")
    assert len(rec.requests) == 2
    rec2 = Recorder(error(500, message), envelope([d1_item()]))
    api2, _ = make_api(rec2)
    with pytest.raises(BackendError):
        await D1Database(api2, "db1").execute("INSERT INTO t VALUES (1)")
    assert len(rec2.requests) == 1
    # the caller may vouch for a statement
    rec3 = Recorder(error(500, message), envelope([d1_item()]))
    api3, _ = make_api(rec3)
    await D1Database(api3, "db1").execute("UPDATE t SET a = 1 WHERE id = 2", idempotent=True)
    assert len(rec3.requests) == 2
    # a batch is idempotent only when every statement is
    rec4 = Recorder(error(500, message), envelope([d1_item(), d1_item()]))
    api4, _ = make_api(rec4)
    with pytest.raises(BackendError):
        await D1Database(api4, "db1").batch([Statement("DELETE FROM t"), Statement("INSERT INTO t VALUES (1)")])
    assert len(rec4.requests) == 1


async def test_overloaded_and_connect_errors_retry_even_non_idempotent_work():
    rec = Recorder(error(503, "D1_ERROR: D1 DB is overloaded. Requests queued for too long."), envelope([d1_item()]))
    api, _ = make_api(rec)
    await D1Database(api, "db1").execute("INSERT INTO t VALUES (1)")
    assert len(rec.requests) == 2
    rec2 = Recorder(httpx.ConnectError("refused"), envelope([d1_item()]))
    api2, _ = make_api(rec2)
    await D1Database(api2, "db1").execute("INSERT INTO t VALUES (1)")
    assert len(rec2.requests) == 2
    rec3 = Recorder(httpx.ReadTimeout("slow"), envelope([d1_item()]))
    api3, _ = make_api(rec3)
    with pytest.raises(BackendError):  # may have run: not retried
        await D1Database(api3, "db1").execute("INSERT INTO t VALUES (1)")
    assert len(rec3.requests) == 1


async def test_cpu_limit_reset_is_not_retried():
    rec = Recorder(error(500, "D1_ERROR: D1 DB exceeded its CPU time limit and was reset."), envelope([d1_item()]))
    api, _ = make_api(rec)
    with pytest.raises(sqlite3.OperationalError):
        await D1Database(api, "db1").execute("SELECT 1")
    assert len(rec.requests) == 1


async def test_retries_give_up_after_max_attempts():
    rec = Recorder(error(500, "internal", code=10001))
    api, _ = make_api(rec, max_attempts=3)
    with pytest.raises(BackendError) as info:
        await D1Database(api, "db1").execute("SELECT 1")
    assert len(rec.requests) == 3 and info.value.details["attempts"] == 3


# ==========================================================================================================
# Budget
# ==========================================================================================================


async def test_budget_waits_for_the_oldest_request_to_leave_the_window():
    t = FakeTime()
    b = RequestBudget(3, 10.0, max_wait=60, clock=t.clock, sleep=t.sleep)
    for _ in range(3):
        await b.acquire()
        t.now += 1
    assert t.sleeps == []
    t.now += 3
    await b.acquire()  # at 1006: must wait until the first (at 1000) leaves at 1010
    assert t.now >= 1010.0 and b.snapshot()["used"] == 3
    assert b.waits == 1


async def test_budget_fails_fast_when_the_wait_exceeds_the_bound():
    t = FakeTime()
    b = RequestBudget(2, 300.0, max_wait=5, clock=t.clock, sleep=t.sleep)
    await b.acquire()
    await b.acquire()
    with pytest.raises(BudgetExhausted) as info:
        await b.acquire()
    assert t.sleeps == [] and info.value.retry_after == pytest.approx(300.0)
    assert isinstance(info.value, BackendError) and b.refused == 1
    snap = b.snapshot()
    assert snap == {**snap, "used": 2, "limit": 2, "window": 300.0, "remaining": 0, "blocked_until": None}


async def test_budget_shared_by_all_adapters_never_exceeds_the_limit():
    rec = Recorder(envelope([d1_item()]))
    rec.route = lambda req: (
        envelope({"dimensions": 4, "vectorCount": 0, "processedUpToMutation": None}) if "/vectorize/" in req.url.path
        else envelope({"shape": [1, 4], "data": [[1, 0, 0, 0]]}) if "/ai/" in req.url.path
        else envelope([d1_item()])
    )
    api, t = make_api(rec, limit=4, window=60.0, max_wait=0)
    db, idx = D1Database(api, "db"), VectorizeIndex(api, "idx", dimensions=4, model="m")
    emb = WorkersAIEmbedder(api, dimensions=4)
    await db.execute("SELECT 1")
    await idx.info()  # /info, plus describing the index once (the recorded model)
    await emb.embed(["a"])
    with pytest.raises(BudgetExhausted):
        await db.execute("SELECT 2")
    assert len(rec.requests) == 4
    snap = api.snapshot()
    assert snap["requests"] == {"d1": 1, "vectorize": 2, "ai": 1}
    assert snap["budget"]["used"] == 4 and snap["budget"]["remaining"] == 0


async def test_server_ratelimit_headers_pause_before_the_token_is_spent():
    headers = {"x-ratelimit-limit": "1200", "x-ratelimit-remaining": "90", "x-ratelimit-reset": "40"}
    rec = Recorder(envelope([d1_item()], headers=headers))
    api, t = make_api(rec, max_wait=5)
    db = D1Database(api, "db")
    await db.execute("SELECT 1")  # other instances spent the token: 90 left <= the 100 reserve
    with pytest.raises(BudgetExhausted):
        await db.execute("SELECT 1")
    assert len(rec.requests) == 1 and api.last_server_remaining == 90


# ==========================================================================================================
# Vectorize
# ==========================================================================================================

DIMS = 4
MODEL = "test/model:mean"


def vectorize_route(state: dict):
    """A tiny Vectorize: describe, upsert (NDJSON), query, get_by_ids, delete_by_ids, info, metadata indexes."""
    state.setdefault("desc", {"name": "idx", "description": model_description(MODEL, DIMS),
                              "config": {"dimensions": DIMS, "metric": "cosine"}})
    state.setdefault("writes", [])
    state.setdefault("queries", [])
    state.setdefault("mi", {})
    state.setdefault("n", 0)

    def route(req: httpx.Request) -> httpx.Response:
        path = req.url.path.split("/vectorize/v2/indexes")[1]
        if path == "/idx" and req.method == "GET":
            return envelope(state["desc"])
        if path == "/idx/upsert":
            lines = [json.loads(x) for x in req.content.decode().splitlines() if x]
            state["writes"].append((req.headers["content-type"], lines))
            state["n"] += 1
            return envelope({"mutationId": f"m{state['n']}"})
        if path == "/idx/delete_by_ids":
            state["writes"].append(("delete", json.loads(req.content)["ids"]))
            state["n"] += 1
            return envelope({"mutationId": f"m{state['n']}"})
        if path == "/idx/query":
            body = json.loads(req.content)
            state["queries"].append(body)
            return envelope({"count": len(state.get("matches", [])), "matches": state.get("matches", [])})
        if path == "/idx/get_by_ids":
            ids = json.loads(req.content)["ids"]
            state.setdefault("gets", []).append(ids)
            return envelope([{"id": i, "values": [1, 0, 0, 0], "namespace": "o1", "metadata": {"full": i}}
                             for i in reversed(ids) if not i.startswith("missing")])
        if path == "/idx/info":
            return envelope({"dimensions": DIMS, "vectorCount": 3, "processedUpToDatetime": None,
                             "processedUpToMutation": state.get("processed")})
        if path == "/idx/metadata_index/list":
            return envelope({"metadataIndexes": [{"propertyName": p, "indexType": t} for p, t in state["mi"].items()]})
        if path == "/idx/metadata_index/create":
            body = json.loads(req.content)
            state["mi"][body["propertyName"]] = body["indexType"]
            state["n"] += 1
            state["processed"] = f"m{state['n']}"
            return envelope({"mutationId": f"m{state['n']}"})
        return error(404, "no route", code=7000)

    return route


def vec_index(state: dict, **kw):
    rec = Recorder()
    rec.route = vectorize_route(state)
    api, t = make_api(rec)
    return VectorizeIndex(api, "idx", dimensions=DIMS, model=MODEL, **kw), rec, t


def vectors(n: int, ns: str = "o1") -> list[Vector]:
    rng = np.random.default_rng(0)
    return [Vector(f"{ns}:{i}", rng.normal(size=DIMS).astype(np.float32) + 0.1, ns,
                   {"organization_id": ns, "kind": "thought", "parent_id": f"p{i % 7}"}) for i in range(n)]


async def test_upsert_splits_into_ndjson_requests_of_5000():
    state: dict = {}
    idx, rec, _ = vec_index(state)
    assert isinstance(idx, VectorIndex)
    mid = await idx.upsert(vectors(12_001))
    writes = state["writes"]
    assert [len(lines) for _, lines in writes] == [5000, 5000, 2001]
    assert all(ct == "application/x-ndjson" for ct, _ in writes)
    first = writes[0][1][0]
    assert set(first) == {"id", "namespace", "values", "metadata"} and first["namespace"] == "o1"
    assert len(first["values"]) == DIMS and abs(np.linalg.norm(first["values"]) - 1) < 1e-6  # unit rows
    assert mid == "m3" and idx.last_mutation == "m3"
    # the index was described once, before the first write
    assert sum(1 for r in rec.requests if r.method == "GET") == 1


async def test_upsert_validates_before_sending():
    state: dict = {}
    idx, rec, _ = vec_index(state)
    with pytest.raises(InvalidInput):
        await idx.upsert([Vector("x" * 65, np.ones(DIMS), "o1")])
    with pytest.raises(InvalidInput):
        await idx.upsert([Vector("a", np.ones(DIMS), "n" * 65)])
    with pytest.raises(InvalidInput):
        await idx.upsert([Vector("a", np.ones(DIMS + 1), "o1")])
    with pytest.raises(InvalidInput):
        await idx.upsert([Vector("a", np.ones(DIMS), "o1", {"big": "x" * 11_000})])
    with pytest.raises(InvalidInput):
        await idx.upsert([Vector("a", np.zeros(DIMS), "o1")])
    assert rec.requests == []
    assert await idx.upsert([]) is None
    # a repeated id is sent once: its last occurrence
    await idx.upsert([Vector("a", np.ones(DIMS), "o1", {"v": 1}), Vector("a", np.ones(DIMS), "o1", {"v": 2})])
    assert [line["metadata"] for line in state["writes"][0][1]] == [{"v": 2}]


@pytest.mark.parametrize(
    "desc, ok",
    [
        ({"description": model_description(MODEL, DIMS), "config": {"dimensions": DIMS, "metric": "cosine"}}, True),
        ({"description": "", "config": {"dimensions": DIMS, "metric": "cosine"}}, True),  # untagged: dims only
        ({"description": model_description("other/model:cls", DIMS), "config": {"dimensions": DIMS, "metric": "cosine"}}, False),
        ({"description": model_description(MODEL, DIMS), "config": {"dimensions": 768, "metric": "cosine"}}, False),
        ({"description": model_description(MODEL, DIMS), "config": {"dimensions": DIMS, "metric": "euclidean"}}, False),
    ],
)
async def test_index_refuses_vectors_of_another_model(desc, ok):
    state: dict = {"desc": {"name": "idx", **desc}}
    idx, _, _ = vec_index(state)
    if ok:
        await idx.upsert(vectors(1))
        assert (await idx.info()).model == (MODEL if desc["description"] else None)
    else:
        with pytest.raises(EmbeddingModelMismatch):
            await idx.upsert(vectors(1))
        with pytest.raises(EmbeddingModelMismatch):
            await idx.query(np.ones(DIMS), top_k=5, namespace="o1")
        assert state["writes"] == []


def _matches(n: int, meta: dict | None = None):
    return [{"id": f"o1:{i}", "score": 1 - i / 100, "namespace": "o1",
             **({"metadata": meta} if meta is not None else {})} for i in range(n)]


async def test_query_plans_cost_one_request_when_they_can():
    state: dict = {"matches": _matches(3, {"organization_id": "o1", "kind": "thought", "parent_id": "p"})}
    idx, rec, _ = vec_index(state)
    flt = {"kind": {"$in": ["thought"]}, "organization_id": {"$eq": "o1"}}
    out = await idx.query(np.ones(DIMS), top_k=10, namespace="o1", filter=flt, return_metadata=True)
    q = state["queries"][-1]
    assert (q["topK"], q["returnMetadata"], q["returnValues"], q["namespace"], q["filter"]) == (10, "all", False, "o1", flt)
    assert out[0].metadata == {"organization_id": "o1", "kind": "thought", "parent_id": "p"}
    # top_k > 20 with metadata: one request with the indexed fields (what search reads)
    out = await idx.query(np.ones(DIMS), top_k=60, namespace="o1", filter=flt, return_metadata=True)
    q = state["queries"][-1]
    assert (q["topK"], q["returnMetadata"]) == (60, "indexed")
    assert "gets" not in state and out[0].metadata["parent_id"] == "p"
    # no metadata: up to 100 in one request
    out = await idx.query(np.ones(DIMS), top_k=100, namespace="o1")
    assert state["queries"][-1]["returnMetadata"] == "none" and out[0].metadata is None
    assert sum(1 for r in rec.requests if r.url.path.endswith("/query")) == 3
    assert "gets" not in state
    with pytest.raises(InvalidInput):
        await idx.query(np.ones(DIMS), top_k=101, namespace="o1")
    with pytest.raises(InvalidInput):
        await idx.query(np.ones(DIMS), top_k=0, namespace="o1")


async def test_wide_query_fetches_full_metadata_only_for_cut_strings():
    long = "p" * 64  # an indexed string of 64 bytes may have been cut
    state: dict = {"matches": [{"id": "o1:0", "score": 0.9, "metadata": {"kind": "thought", "parent_id": long}},
                               {"id": "o1:1", "score": 0.8, "metadata": {"kind": "thought", "parent_id": "short"}}]}
    idx, _, _ = vec_index(state)
    out = await idx.query(np.ones(DIMS), top_k=50, namespace="o1", return_metadata=True)
    assert state["gets"] == [["o1:0"]]
    assert out[0].metadata == {"full": "o1:0"} and out[1].metadata["parent_id"] == "short"


async def test_wide_query_fetch_mode_and_values():
    state: dict = {"matches": _matches(30)}
    idx, _, _ = vec_index(state, wide_metadata="fetch")
    out = await idx.query(np.ones(DIMS), top_k=30, namespace="o1", return_metadata=True)
    assert state["queries"][-1]["returnMetadata"] == "none"
    assert state["gets"] == [[f"o1:{i}" for i in range(30)]]
    assert [m.id for m in out] == [f"o1:{i}" for i in range(30)] and out[5].metadata == {"full": "o1:5"}
    out = await idx.query(np.ones(DIMS), top_k=30, namespace="o1", return_values=True)
    assert state["queries"][-1]["returnValues"] is False and list(out[0].values) == [1, 0, 0, 0]
    out = await idx.query(np.ones(DIMS), top_k=20, namespace="o1", return_values=True, return_metadata=True)
    q = state["queries"][-1]
    assert (q["returnValues"], q["returnMetadata"]) == (True, "all")


async def test_get_and_delete_split_and_keep_order():
    state: dict = {}
    idx, _, _ = vec_index(state)
    ids = [f"o1:{i}" for i in range(250)] + ["missing-1"]
    got = await idx.get_by_ids(ids + ["o1:3"])
    assert [v.id for v in got] == ids[:250]  # asked order, unknown omitted, duplicates once
    assert [len(g) for g in state["gets"]] == [100, 100, 51]
    assert got[0].values.dtype == np.float32 and got[0].namespace == "o1"
    mid = await idx.delete_by_ids([f"o1:{i}" for i in range(2500)])
    assert [len(ids) for kind, ids in state["writes"]] == [1000, 1000, 500] and mid == "m3"


async def test_searchable_and_wait_for_follow_processed_up_to_mutation():
    state: dict = {}
    idx, rec, t = vec_index(state, info_max_age=0)
    m1 = await idx.upsert(vectors(1))
    m2 = await idx.upsert(vectors(1))
    state["processed"] = None
    assert not await idx.searchable(m1)
    state["processed"] = m1
    assert await idx.searchable(m1) and not await idx.searchable(m2)
    state["processed"] = m2  # a later mutation of ours: every earlier one is processed too
    assert await idx.searchable(m1) and await idx.searchable(m2)
    state["processed"] = "m1"
    assert await idx.searchable("m2")  # once seen processed, stays processed
    assert await idx.searchable(None)
    m3 = await idx.upsert(vectors(1))
    assert not await idx.wait_for(m3, timeout=0.2)
    state["processed"] = m3
    assert await idx.wait_for(m3, timeout=1)


async def test_writes_in_flight_together_are_not_ordered_by_their_responses():
    """Vectorize applies writes in the order it accepted them, which for two writes in flight at once need not be
    the order their responses come back in: a job's upsert beside an append's delete, two organizations' rounds.
    Seeing the first accepted one processed says nothing of the other (it did, and a search right after a
    conversation read "indexed" missed the newest message's vectors)."""
    state: dict = {}
    idx, rec, _ = vec_index(state, info_max_age=0, settle_seconds=30)
    sync_route, held = rec.route, asyncio.Event()

    async def route(req: httpx.Request) -> httpx.Response:
        res = sync_route(req)  # accepted now, in arrival order: m1, then m2
        if req.url.path.endswith("/upsert") and state["n"] == 1:
            await held.wait()  # m1's response comes back after m2's
        return res

    rec.route = route
    first = asyncio.create_task(idx.upsert(vectors(1)))
    while state["n"] < 1:
        await asyncio.sleep(0)
    m2 = await idx.upsert(vectors(1))
    held.set()
    m1 = await first
    assert (m1, m2) == ("m1", "m2")
    state["processed"] = m1
    assert await idx.searchable(m1) and not await idx.searchable(m2)
    assert not await idx.searchable(m2, issued_at=time.time() - 5)
    state["processed"] = m2
    assert await idx.searchable(m1) and await idx.searchable(m2)
    # a write sent after both responses came back: once it is processed, they are
    m3 = await idx.upsert(vectors(1))
    state["processed"] = m3
    assert await idx.searchable(m3)
    state["processed"] = None  # /info can lag behind what was already seen: seen processed stays processed
    assert await idx.searchable(m1) and await idx.searchable(m2) and await idx.searchable(m3)


async def test_searchable_for_ids_of_other_instances():
    state: dict = {}
    idx, _, _ = vec_index(state, info_max_age=0, settle_seconds=30)
    a = "01900000-0000-7000-8000-000000000001"
    b = "01900000-0001-7000-8000-000000000000"
    state["processed"] = b
    assert await idx.searchable(a)  # UUIDv7s order by time
    state["processed"] = a
    assert not await idx.searchable(b)
    # opaque ids of another instance: only equality, or time once the index moved
    state["processed"] = str(uuid.uuid4())
    foreign = str(uuid.uuid4())
    assert not await idx.searchable(foreign)
    assert not await idx.searchable(foreign, issued_at=time.time() - 5)
    assert await idx.searchable(foreign, issued_at=time.time() - 31)


async def test_info_cache_shares_one_request():
    state: dict = {"processed": "m9"}
    idx, rec, _ = vec_index(state, info_max_age=60)
    await asyncio.gather(*(idx.searchable(f"x{i}") for i in range(10)))
    assert sum(1 for r in rec.requests if r.url.path.endswith("/info")) == 1


async def test_ensure_metadata_indexes_creates_only_missing():
    state: dict = {"mi": {"kind": "string"}}
    idx, rec, _ = vec_index(state)
    report = await idx.ensure_metadata_indexes()
    assert report["present"] == ["kind"] and sorted(report["created"]) == sorted(set(INDEXED_PROPERTIES) - {"kind"})
    assert state["mi"] == INDEXED_PROPERTIES
    again = await idx.ensure_metadata_indexes()
    assert again["created"] == []


# ==========================================================================================================
# Workers AI
# ==========================================================================================================


def ai_route(req: httpx.Request) -> httpx.Response:
    body = json.loads(req.content)
    texts = body["text"]
    data = [[float(len(t)), 1.0] + [0.0] * 766 for t in texts]
    return envelope({"shape": [len(texts), 768], "data": data, "pooling": body["pooling"]})


async def test_embedder_splits_100_texts_per_call_in_order():
    rec = Recorder()
    rec.route = ai_route
    api, _ = make_api(rec)
    emb = WorkersAIEmbedder(api)
    assert isinstance(emb, Embedder) and emb.dimensions == 768 and emb.max_tokens == 512
    assert emb.model_id == "@cf/baai/bge-base-en-v1.5:mean"
    texts = ["x" * (i % 50 + 1) for i in range(250)]
    out = await emb.embed(texts)
    assert out.shape == (250, 768) and out.dtype == np.float32
    assert np.allclose(np.linalg.norm(out, axis=1), 1.0)
    bodies = rec.bodies()
    assert [len(b["text"]) for b in bodies] == [100, 100, 50]
    assert all(b["pooling"] == "mean" for b in bodies)
    assert all(r.url.path.endswith("/ai/run/@cf/baai/bge-base-en-v1.5") for r in rec.requests)
    # order kept: row i encodes len(texts[i])
    lens = out[:, 0] / out[:, 1]
    assert np.allclose(lens, [len(t) for t in texts])
    assert (await emb.embed([])).shape == (0, 768)


async def test_embedder_fits_texts_into_the_token_limit_and_fills_empties():
    rec = Recorder()
    rec.route = ai_route
    api, _ = make_api(rec)
    emb = WorkersAIEmbedder(api)
    long = " ".join(["word"] * 3000)
    await emb.embed([long, "", "   ", "ok"])
    sent = rec.bodies()[0]["text"]
    assert emb.count_tokens(sent[0]) <= 510 and sent[0].startswith("word word")
    assert sent[1] and sent[1].strip() and sent[2].strip() and sent[3] == "ok"


def test_count_tokens_is_conservative():
    emb = WorkersAIEmbedder.__new__(WorkersAIEmbedder)
    emb.exact_count = WordPieceCount()
    text = "Hello, world! Tokenization of unbelievably long words: antidisestablishmentarianism."
    n = emb.count_tokens(text)
    assert n >= conservative_token_count(text) >= len(text.split())
    assert n >= len(text) / 4
    assert emb.count_tokens("") == 0
    assert conservative_token_count("日本語のテキスト") >= 8  # CJK: a token per character at least


async def test_embed_query_uses_an_lru():
    rec = Recorder()
    rec.route = ai_route
    api, _ = make_api(rec)
    emb = WorkersAIEmbedder(api, query_cache_size=2)
    a = await emb.embed_query("alpha")
    b = await emb.embed_query("alpha")
    assert np.array_equal(a, b) and len(rec.requests) == 1
    await emb.embed_query("beta")
    await emb.embed_query("gamma")  # evicts alpha
    await emb.embed_query("alpha")
    assert len(rec.requests) == 4


async def test_embedder_rejects_malformed_output():
    rec = Recorder(envelope({"shape": [1, 3], "data": [[1, 2, 3]]}))
    api, _ = make_api(rec)
    with pytest.raises(BackendError):
        await WorkersAIEmbedder(api).embed(["a"])


async def test_ai_capacity_429_does_not_block_the_whole_budget():
    rec = Recorder(error(429, "out of capacity", code=3040, headers={"retry-after": "2"}),
                   envelope({"shape": [1, 768], "data": [[1.0] * 768]}))
    api, t = make_api(rec)
    await WorkersAIEmbedder(api).embed(["a"])
    assert len(rec.requests) == 2 and api.budget.snapshot()["blocked_until"] is None
    assert max(t.sleeps) >= 2
    rec2 = Recorder(error(429, "daily allocation", code=3036))
    api2, _ = make_api(rec2)
    with pytest.raises(BackendError):
        await WorkersAIEmbedder(api2).embed(["a"])
    assert len(rec2.requests) == 1


async def test_chat_json_mode_returns_the_parsed_object():
    schema = {"type": "object", "properties": {"title": {"type": "string"}}, "required": ["title"]}
    rec = Recorder(
        error(400, "JSON Mode couldn't be met", code=3030),
        envelope({"response": {"title": "hi"}, "usage": {}}),
        envelope({"response": '{"title": "as text"}'}),
    )
    api, _ = make_api(rec)
    chat = WorkersAIChat(api)
    assert await chat.complete_json([{"role": "user", "content": "name it"}], schema, system="be brief") == {"title": "hi"}
    body = rec.bodies()[0]
    assert body["response_format"] == {"type": "json_schema", "json_schema": schema}
    assert body["temperature"] == 0.2 and body["max_tokens"] >= 512
    assert body["messages"][0] == {"role": "system", "content": "be brief"}
    assert rec.requests[0].url.path.endswith("/ai/run/@cf/meta/llama-3.1-8b-instruct")
    assert await chat.complete_json("again", schema) == {"title": "as text"}


async def test_reranker_returns_indexes_best_first():
    rec = Recorder(envelope({"response": [{"id": 1, "score": 0.9}, {"id": 0, "score": 0.2}]}))
    api, _ = make_api(rec)
    out = await WorkersAIReranker(api).rerank("q", ["a", "b"])
    assert out == [(1, 0.9), (0, 0.2)]
    assert rec.bodies()[0] == {"query": "q", "contexts": [{"text": "a"}, {"text": "b"}]}
    assert rec.requests[0].url.path.endswith("/ai/run/@cf/baai/bge-reranker-base")


# ==========================================================================================================
# Factories (what the composition root builds with)
# ==========================================================================================================


def _settings(base_url: str = BASE, **kw):
    from api.settings import Settings

    return Settings(
        cloudflare_account_id=kw.pop("account", ACCOUNT), cloudflare_api_token=kw.pop("token", "tok"),
        cloudflare_d1_database_id=kw.pop("db", "db1"), cloudflare_vectorize_index=kw.pop("index", "idx"),
        cloudflare_api_base_url=base_url, **kw,
    )


async def test_factories_share_one_api_per_client():
    s = _settings()
    http = shared_client(s)
    try:
        assert isinstance(http, httpx.AsyncClient) and http.timeout.read and http.timeout.connect
        db = d1_database(s, http)
        emb = workers_ai_embedder(s, http)
        idx = vectorize_index(s, http, emb)
        assert db.api is emb.api is idx.api
        assert idx.dimensions == 768 and idx.model == emb.model_id
        assert cloudflare_stats(http)["budget"]["limit"] == 1100
        assert cloudflare_stats(None) is None
    finally:
        await http.aclose()
    with pytest.raises(InvalidInput):
        d1_database(_settings(db=None), None)
    with pytest.raises(InvalidInput):
        workers_ai_embedder(_settings(token=None), None)


# ==========================================================================================================
# Part 2: against the emulator
# ==========================================================================================================

emulator = pytest.importorskip("tests.cloudflare_emulator")


@pytest.fixture(scope="module")
def emu():
    with emulator.running_emulator() as e:
        yield e


@pytest.fixture()
def cf(emu):
    emu.clear_faults()
    emu.set_rate_limit(1200, 300)
    emu.vector_lag_ms = 0
    yield emu
    emu.clear_faults()
    emu.set_rate_limit(1200, 300)
    emu.vector_lag_ms = 0


def _uid(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


@pytest.fixture()
async def backend(cf):
    """Adapters on the emulator, a fresh D1 database and a fresh (unprovisioned) index name."""
    s = _settings(cf.base_url, account=cf.account, token=cf.token, db=_uid("db"), index=_uid("idx"))
    http = shared_client(s)
    emb = workers_ai_embedder(s, http)
    ns = type("B", (), {})()
    ns.settings, ns.http, ns.emb = s, http, emb
    ns.db = d1_database(s, http)
    ns.index = vectorize_index(s, http, emb)
    ns.api = ns.db.api
    yield ns
    await http.aclose()


async def test_emulator_migrations_apply_once_and_match_the_folder(backend):
    from services.storage.migrate import apply_pending, discover

    ran = await apply_pending(backend.db)
    assert ran == [m.name for m in discover()]
    assert await apply_pending(backend.db) == []
    names = [r["name"] for r in (await backend.db.execute("SELECT name FROM d1_migrations ORDER BY id")).rows]
    assert names == ran


async def test_emulator_batch_and_script_are_atomic(backend):
    db = backend.db
    await db.executescript("CREATE TABLE t (id TEXT PRIMARY KEY, n INTEGER NOT NULL);")
    with pytest.raises(sqlite3.IntegrityError):
        await db.batch([Statement("INSERT INTO t VALUES (?, ?)", ("a", 1)), Statement("INSERT INTO t VALUES (?, ?)", ("a", 2))])
    assert (await db.execute("SELECT count(*) AS n FROM t")).rows == [{"n": 0}]
    with pytest.raises(sqlite3.Error):
        await db.executescript("INSERT INTO t VALUES ('b', 1);\nINSERT INTO nope VALUES (1);\n")
    assert (await db.execute("SELECT count(*) AS n FROM t")).rows == [{"n": 0}]
    out = await db.batch([Statement("INSERT INTO t VALUES (?, ?)", ("a", 1)),
                          Statement("INSERT INTO t VALUES (?, ?) RETURNING id, n", ("b", 2)),
                          Statement("SELECT sum(n) AS s FROM t")])
    assert out[0].changes == 1 and out[1].rows == [{"id": "b", "n": 2}] and out[2].rows == [{"s": 3}]
    with pytest.raises(D1IntegrityError):
        await db.execute("INSERT INTO t VALUES (?, ?)", ["a", 5])
    res = await db.execute("INSERT INTO t (id, n) VALUES (?, ?) ON CONFLICT(id) DO NOTHING", ["a", 5])
    assert res.changes == 0
    # numbers bind as numbers: LIMIT ? and integer comparisons work
    assert (await db.execute("SELECT id FROM t WHERE n >= ? ORDER BY id LIMIT ?", [1, 1])).rows == [{"id": "a"}]
    # big ids as text survive exactly
    big = str(2**63 - 1)
    await db.execute("INSERT INTO t VALUES (?, ?)", [big, 0])
    assert (await db.execute("SELECT id FROM t WHERE id = ?", [big])).rows == [{"id": big}]


async def test_emulator_fts5_and_json_each_through_d1(backend):
    from services.storage.migrate import apply_pending

    await apply_pending(backend.db)
    db = backend.db
    stmts = [Statement("INSERT INTO chunks (organization_id, id, kind, parent_id, ordinal, content, token_count) "
                       "VALUES (?, ?, 'thought', ?, 0, ?, 3)", ("o1", f"c{i}", f"p{i}", text))
             for i, text in enumerate(["the quick brown fox", "lazy dogs sleeping", "foxes are quick"])]
    await db.batch(stmts)
    rows = (await db.execute(
        "SELECT c.id FROM chunks_fts JOIN chunks c ON c.pk = chunks_fts.rowid WHERE chunks_fts MATCH ? "
        "AND chunks_fts.organization_id = ? ORDER BY bm25(chunks_fts)", ["quick", "o1"])).rows
    assert sorted(r["id"] for r in rows) == ["c0", "c2"]
    ids = [f"c{i}" for i in range(3)] + [f"x{i}" for i in range(300)]  # > 100 ids: one bound JSON array
    rows = (await db.execute("SELECT id FROM chunks WHERE id IN (SELECT value FROM json_each(?)) ORDER BY id",
                             [json.dumps(ids)])).rows
    assert [r["id"] for r in rows] == ["c0", "c1", "c2"]
    await db.execute("DELETE FROM chunks WHERE id = ?", ["c0"])  # the trigger removes its keyword row
    rows = (await db.execute("SELECT rowid FROM chunks_fts WHERE chunks_fts MATCH ?", ["brown"])).rows
    assert rows == []


async def test_emulator_limits_are_enforced_client_side(backend, cf):
    cf.reset_counters()
    with pytest.raises(InvalidInput):
        await backend.db.execute("SELECT " + ",".join("?" * 101), list(range(101)))
    with pytest.raises(InvalidInput):
        await backend.db.execute("SELECT '" + "y" * 100_001 + "'")
    assert cf.counters_snapshot()["d1"] == 0
    # and the emulator agrees on the boundary
    assert (await backend.db.execute("SELECT " + ",".join("?" * 100) + " AS last", list(range(100)))).rows


async def test_emulator_transient_d1_retries(backend, cf):
    db = backend.db
    await db.executescript("CREATE TABLE IF NOT EXISTS r (id TEXT PRIMARY KEY);")
    cf.d1_transient_next(1, "network")
    assert (await db.execute("SELECT count(*) AS n FROM r")).rows == [{"n": 0}]
    cf.d1_transient_next(1, "remote")
    with pytest.raises(BackendError):  # a plain INSERT is not retried after it may have run
        await db.execute("INSERT INTO r VALUES ('a')")
    assert (await db.execute("SELECT count(*) AS n FROM r")).rows == [{"n": 0}]
    # lost response after the write ran: an idempotent write is retried and lands once
    cf.d1_transient_next(1, "network", after=True)
    await db.execute("INSERT OR IGNORE INTO r VALUES ('b')")
    assert (await db.execute("SELECT id FROM r")).rows == [{"id": "b"}]
    assert backend.api.retries["d1"] == 2


async def test_emulator_429_retry_after_is_honoured(backend, cf):
    cf.rate_limit_next(1, retry_after=1, path_contains="/d1/")
    t0 = time.monotonic()
    assert (await backend.db.execute("SELECT 1 AS one")).rows == [{"one": 1}]
    assert time.monotonic() - t0 >= 0.9
    assert backend.api.retries["d1"] == 1


async def test_emulator_ratelimit_headers_stop_before_the_block(backend, cf):
    cf.set_rate_limit(3, 300)
    cf.reset_counters()
    for _ in range(3):
        await backend.db.execute("SELECT 1")
    # the token has 0 requests left: the next call would start Cloudflare's 5-minute block, so it is refused here
    with pytest.raises(BudgetExhausted):
        await backend.db.execute("SELECT 1")
    counts = cf.counters_snapshot()
    assert counts["total"] == 3 and counts["by_status"].get("429", 0) == 0
    cf.set_rate_limit(1200, 300)
    backend.api.budget.unblock()


async def test_emulator_short_window_is_waited_out_not_tripped(backend, cf):
    cf.set_rate_limit(3, 1.5)
    cf.reset_counters()
    t0 = time.monotonic()
    for _ in range(7):
        await backend.db.execute("SELECT 1")
    assert time.monotonic() - t0 >= 1.5  # the calls waited for the token's window instead of tripping it
    counts = cf.counters_snapshot()
    assert counts["total"] == 7 and counts["by_status"].get("429", 0) == 0
    assert backend.api.budget.snapshot()["waits"] >= 2


async def test_emulator_global_block_stops_every_adapter(backend, cf):
    cf.reset_counters()
    cf.rate_limit_next(1, retry_after=300)
    with pytest.raises(CloudflareRateLimited):
        await backend.db.execute("SELECT 1")
    with pytest.raises(BudgetExhausted):  # blocked: the other adapters fail fast without calling
        await backend.emb.embed(["x"])
    with pytest.raises(BudgetExhausted):
        await backend.index.info()
    assert cf.counters_snapshot()["total"] == 1
    assert cloudflare_stats(backend.http)["budget"]["blocked_until"] > time.time() + 200
    backend.api.budget.unblock()


async def test_emulator_client_budget_prevents_the_block(cf):
    s = _settings(cf.base_url, account=cf.account, token=cf.token, db=_uid("db"))
    http = shared_client(s)
    try:
        db = d1_database(s, http)
        db.api.budget.limit = 5
        db.api.budget.max_wait = 0
        cf.set_rate_limit(6, 300)
        cf.reset_counters()
        for _ in range(5):
            await db.execute("SELECT 1")
        with pytest.raises(BudgetExhausted):
            await db.execute("SELECT 1")
        assert cf.counters_snapshot()["by_status"].get("429", 0) == 0
        assert cloudflare_stats(http)["budget"]["used"] == 5
    finally:
        await http.aclose()


async def provision(backend):
    await backend.index.create_index()
    report = await backend.index.ensure_metadata_indexes()
    assert sorted(report["created"]) == sorted(INDEXED_PROPERTIES)


async def test_emulator_vector_roundtrip_with_lag(backend, cf):
    from services.storage.scoped import OrgVectors

    await provision(backend)
    cf.vector_lag_ms = 400
    emb, index = backend.emb, backend.index
    texts = ["the cat sat on the mat", "stock markets fell sharply", "a kitten on a rug"]
    vals = await emb.embed(texts)
    a, b = OrgVectors(index, "orgA"), OrgVectors(index, "orgB")
    mid = await a.upsert([(f"c{i}", vals[i], {"kind": "thought", "parent_id": f"p{i}", "ordinal": 0}) for i in range(3)])
    await b.upsert([("c0", vals[0], {"kind": "thought", "parent_id": "pb", "ordinal": 0})])
    assert not await index.searchable(mid)
    assert await a.query(vals[0], top_k=5) == []  # not applied yet: keyword search covers this gap
    assert await index.wait_for(backend.index.last_mutation, timeout=10)
    assert await index.searchable(mid)
    hits = await a.query(vals[0], top_k=5, return_metadata=True, filter={"kind": {"$in": ["thought"]}})
    assert [h.id for h in hits][0] == "c0" and {h.id for h in hits} == {"c0", "c1", "c2"}
    assert hits[0].metadata["parent_id"] == "p0" and hits[0].metadata["ordinal"] == 0
    wide = await a.query(vals[0], top_k=50, return_metadata=True, filter={"parent_id": {"$eq": "p2"}})
    assert [h.id for h in wide] == ["c2"] and wide[0].metadata["kind"] == "thought"
    only_b = await b.query(vals[0], top_k=50, return_metadata=True)
    assert [h.id for h in only_b] == ["c0"] and only_b[0].metadata["parent_id"] == "pb"
    got = await a.get_by_ids(["c1", "c0", "nope"])
    assert [v.id for v in got] == ["c1", "c0"] and len(got[0].values) == 768
    assert await b.get_by_ids(["c1"]) == []
    dmid = await a.delete_by_ids(["c0", "c1"])
    assert await index.wait_for(dmid, timeout=10)
    assert [v.id for v in await a.get_by_ids(["c0", "c1", "c2"])] == ["c2"]
    assert [v.id for v in await b.get_by_ids(["c0"])] == ["c0"]
    info = await index.info()
    assert info.dimensions == 768 and info.vector_count == 2 and info.model == emb.model_id
    assert info.processed_up_to_mutation == dmid


async def test_emulator_index_of_another_model_is_refused(backend):
    api = backend.api
    other = VectorizeIndex(api, backend.settings.cloudflare_vectorize_index, dimensions=768,
                           model="@cf/baai/bge-base-en-v1.5:cls")
    await other.create_index()
    with pytest.raises(EmbeddingModelMismatch):
        await backend.index.upsert([Vector("o:1", np.ones(768), "o")])
    small = VectorizeIndex(api, _uid("small"), dimensions=384, model="x")
    await small.create_index()
    wrong = VectorizeIndex(api, small.name, dimensions=768, model=backend.emb.model_id)
    with pytest.raises(EmbeddingModelMismatch):
        await wrong.query(np.ones(768), top_k=3, namespace="o")


async def test_emulator_vectorize_5xx_is_retried(backend, cf):
    await provision(backend)
    cf.fail_next(2, status=503, path_contains="/upsert")
    mid = await backend.index.upsert([Vector("o:1", np.ones(768), "o", {"organization_id": "o"})])
    assert mid and backend.api.retries["vectorize"] == 2


async def test_emulator_embedder_batches_and_long_texts(backend, cf):
    cf.reset_counters()
    texts = [f"note number {i} about apples" for i in range(150)]
    out = await backend.emb.embed(texts)
    assert out.shape == (150, 768)
    assert cf.counters_snapshot()["ai"] == 2
    long = " ".join(f"word{i % 50}, and" for i in range(3000))
    vec = await backend.emb.embed([long])  # cut to fit instead of a 413
    assert vec.shape == (1, 768)
    q1 = await backend.emb.embed_query("apples")
    assert np.allclose(q1, (await backend.emb.embed(["apples"]))[0], atol=1e-6)


async def test_emulator_chunks_accepted_by_workers_ai(backend):
    from services.text.chunking import chunk_text, default_chunk_params

    emb = backend.emb
    text = "\n\n".join(" ".join(f"Sentence {p}-{i} talks about retrieval, memory and embeddings." for i in range(40))
                       for p in range(6))
    max_tokens, overlap = default_chunk_params(emb)
    pieces = chunk_text(text, count_tokens=emb.count_tokens, max_tokens=max_tokens, overlap_tokens=overlap)
    assert len(pieces) > 1
    before = emb.api.snapshot()["requests"]["ai"]
    out = await emb.embed(pieces)
    assert out.shape == (len(pieces), 768)
    assert emb.api.snapshot()["requests"]["ai"] - before == 1  # one call, no 413, no truncation needed
    assert all(emb._fit(p) == p for p in pieces)


async def test_emulator_chat_and_reranker(backend, cf):
    from api.composition.cloudflare import workers_ai_chat, workers_ai_reranker

    chat = workers_ai_chat(backend.settings, backend.http)
    cf.push_llm_response({"summary": "short", "tags": ["a-b"]})
    schema = {"type": "object", "properties": {"summary": {"type": "string"}, "tags": {"type": "array"}},
              "required": ["summary", "tags"]}
    assert await chat.complete_json("summarize: hello", schema) == {"summary": "short", "tags": ["a-b"]}
    req = cf.llm_requests[-1]
    assert req["response_format"]["type"] == "json_schema" and req["temperature"] == 0.2
    rr = workers_ai_reranker(backend.settings, backend.http)
    ranked = await rr.rerank("apple pie recipe", ["car engine repair", "how to bake an apple pie", "apple orchards"])
    assert ranked[0][0] == 1 and len(ranked) == 3


# -- operations: memex cloudflare check / memex reindex ------------------------------------------------------


async def test_emulator_check_reports_then_fixes(backend, cf):
    from api.composition.check import check

    s = backend.settings.with_(sql="d1", vectors="vectorize", embedder="workers-ai")
    lines: list[str] = []
    report = await check(s, out=lines.append, http=backend.http)
    text = "\n".join(lines)
    missing = {i.what for i in report.missing}
    assert not report.ok and missing == {"migrations", "Vectorize index"}, text
    assert "wrangler vectorize create" in text and "not applied: 0001_" in text
    report = await check(s, fix=True, out=lines.append, http=backend.http)
    assert report.ok, "\n".join(lines)
    lines.clear()
    report = await check(s, out=lines.append, http=backend.http)
    assert report.ok and all(not line.startswith("MISSING") for line in lines)
    assert any("metadata indexes" in line and "organization_id" in line for line in lines)
    # a metadata index that is missing is named exactly
    cf.vectorize.indexes[(cf.account, backend.index.name)].declared_meta.pop("parent_id")
    cf.vectorize.indexes[(cf.account, backend.index.name)].meta_indexes.pop("parent_id")
    report = await check(s, out=lines.append, http=backend.http)
    assert [i.what for i in report.missing] == ["metadata index parent_id"]


async def test_emulator_check_names_a_bad_token(cf):
    from api.composition.check import check

    s = _settings(cf.base_url, account=cf.account, token="wrong", db=_uid("db"), index=_uid("idx"),
                  sql="d1", vectors="vectorize", embedder="workers-ai")
    lines: list[str] = []
    report = await check(s, out=lines.append)
    assert [i.what for i in report.missing] == ["API token"]
    assert "D1 > Edit" in "\n".join(lines)


async def test_emulator_reindex_is_resumable(backend, tmp_path):
    from services.search.reindex import reindex
    from services.storage.migrate import apply_pending

    await apply_pending(backend.db)  # an organization's database (the org migration stream)
    await provision(backend)
    db = backend.db
    await db.batch([
        Statement("INSERT INTO chunks (organization_id, id, kind, parent_id, ordinal, content, token_count) "
                  "VALUES (?, ?, 'thought', ?, ?, ?, 5)", ("org_r", f"k{i}", f"p{i // 2}", i % 2, f"chunk {i} about pears"))
        for i in range(7)
    ])

    class Failing:
        """Embeds two pages, then fails (a crash mid-run)."""

        def __init__(self, inner, pages):
            self.inner, self.pages = inner, pages
            self.model_id, self.dimensions, self.max_tokens = inner.model_id, inner.dimensions, inner.max_tokens
            self.relevance_floor = inner.relevance_floor

        def count_tokens(self, text):
            return self.inner.count_tokens(text)

        async def embed(self, texts):
            if self.pages == 0:
                raise BackendError("boom")
            self.pages -= 1
            return await self.inner.embed(texts)

        async def embed_query(self, text):
            return (await self.embed([text]))[0]

    with pytest.raises(BackendError):
        await reindex(db, backend.index, Failing(backend.emb, 2), "org_r", state_dir=tmp_path, page_size=3, progress=False)
    state = json.loads((tmp_path / "org_r.json").read_text())
    assert state["finished"] is False and state["last_pk"] > 0
    result = await reindex(db, backend.index, backend.emb, "org_r", state_dir=tmp_path, page_size=3, progress=False)
    assert (result.total, result.resumed_from, result.embedded, result.searchable) == (7, 6, 1, True)
    from services.storage.scoped import OrgVectors

    got = await OrgVectors(backend.index, "org_r").get_by_ids([f"k{i}" for i in range(7)])
    assert len(got) == 7 and got[3].metadata == {"kind": "thought", "parent_id": "p1", "ordinal": 1, "organization_id": "org_r"}
    pending = (await db.execute("SELECT count(*) AS n FROM chunks WHERE indexed_at IS NULL")).rows[0]["n"]
    assert pending == 0
    # a stray vector (no chunk) is pruned; a finished run starts over next time
    await OrgVectors(backend.index, "org_r").upsert([("ghost", np.ones(768, dtype=np.float32),
                                                      {"kind": "thought", "parent_id": "x", "ordinal": 0})])
    result = await reindex(db, backend.index, backend.emb, "org_r", state_dir=tmp_path, page_size=50, prune=True, progress=False,
                           list_ids=backend.index.list_ids)
    assert (result.resumed_from, result.embedded, result.pruned) == (0, 7, 1)
    assert await OrgVectors(backend.index, "org_r").get_by_ids(["ghost"]) == []


async def test_emulator_memex_end_to_end_on_cloudflare(cf, tmp_path):
    """The whole service on D1 + Vectorize + Workers AI: capture -> worker -> (lag) -> hybrid search."""
    from api.wiring import Memex
    from services.search.search import SearchOptions
    from tenancy.models import AuthContext

    s = _settings(cf.base_url, account=cf.account, token=cf.token, db=_uid("db"), index=_uid("idx"),
                  sql="d1", vectors="vectorize", embedder="workers-ai", data_dir=tmp_path, run_worker=False)
    from api.composition.check import check

    assert (await check(s, fix=True, out=None)).ok
    cf.vector_lag_ms = 300
    memex = Memex(s)
    try:
        await memex.start(worker=False)
        org, _ = await memex.orgs.create(name="Acme", slug=_uid("acme")[:30])
        svc = await memex.for_org(AuthContext(org_id=org.id, org_slug=org.slug, principal="test", scopes=frozenset({"admin"})))
        index = (await memex.stores.open(org.id)).index
        cap = await svc.thoughts.capture("Remember: the staging database password rotates every Friday.")
        await memex.worker.drain(timeout=30)
        res = await svc.search.search(SearchOptions(query="when does the staging password rotate"))
        assert [h.document_id for h in res.results] == [cap.id]  # keyword search covers the vector lag
        assert await index.wait_for(index.last_mutation, timeout=10)
        res = await svc.search.search(SearchOptions(query="staging password rotation schedule", explain=True))
        assert res.results and res.results[0].document_id == cap.id
        assert res.results[0].explain["vector_rank"] == 1  # now found by its vector too
        stats = cloudflare_stats(memex.backend.http)
        assert stats["requests"]["d1"] > 0 and stats["requests"]["vectorize"] > 0 and stats["requests"]["ai"] > 0
    finally:
        await memex.stop()
