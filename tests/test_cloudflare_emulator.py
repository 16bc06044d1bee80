"""The local Cloudflare REST emulator, exercised through real HTTP on loopback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.cloudflare_emulator import CloudflareEmulator, running_emulator

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def emu():
    with running_emulator() as e:
        yield e


@pytest.fixture()
def cf(emu):
    """A client on /accounts/{account}; knobs are put back after each test."""
    emu.clear_faults()
    emu.set_rate_limit(1200, 300)
    emu.vector_lag_ms = 0
    with httpx.Client(base_url=emu.account_url, headers=emu.headers, timeout=10) as c:
        yield c
    emu.clear_faults()
    emu.clear_llm()
    emu.set_rate_limit(1200, 300)
    emu.vector_lag_ms = 0


_n = 0


def unique(prefix: str) -> str:
    global _n
    _n += 1
    return f"{prefix}-{os.getpid()}-{_n}"


def ok(r: httpx.Response):
    body = r.json()
    assert r.status_code < 300 and body["success"] is True, r.text
    assert body["errors"] == [] and body["messages"] == []
    return body["result"]


def fail(r: httpx.Response, status: int):
    body = r.json()
    assert r.status_code == status, r.text
    assert body["success"] is False and body["result"] is None and body["messages"] == []
    assert isinstance(body["errors"], list) and body["errors"]
    assert set(body["errors"][0]) == {"code", "message"}
    return body["errors"][0]


def q(cf, db, sql, params=None, raw=False):
    body = {"sql": sql}
    if params is not None:
        body["params"] = params
    return cf.post(f"/d1/database/{db}/{'raw' if raw else 'query'}", json=body)


def ndjson(*vectors: dict) -> bytes:
    return "".join(json.dumps(v) + "\n" for v in vectors).encode()


def upsert(cf, index, *vectors, op="upsert"):
    r = cf.post(f"/vectorize/v2/indexes/{index}/{op}", content=ndjson(*vectors),
                headers={"Content-Type": "application/x-ndjson"})
    return ok(r)["mutationId"]


def make_index(cf, dims=4, metric="cosine", indexes=()):
    name = unique("idx")
    res = ok(cf.post("/vectorize/v2/indexes", json={"name": name, "config": {"dimensions": dims, "metric": metric}}))
    assert res["config"] == {"dimensions": dims, "metric": metric}
    for prop, typ in indexes:
        ok(cf.post(f"/vectorize/v2/indexes/{name}/metadata_index/create",
                   json={"propertyName": prop, "indexType": typ}))
    return name


def query(cf, index, **body):
    return cf.post(f"/vectorize/v2/indexes/{index}/query", json=body)


# --------------------------------------------------------------------------------------------------------
# envelope + auth
# --------------------------------------------------------------------------------------------------------

def test_envelope_and_auth(emu, cf):
    r = q(cf, "envdb", "SELECT 1 AS one")
    body = r.json()
    assert set(body) == {"success", "errors", "messages", "result"}
    assert body["result"][0]["results"] == [{"one": 1}]
    assert r.headers["x-ratelimit-limit"] == "1200"

    url = f"{emu.account_url}/d1/database/envdb/query"
    err = fail(httpx.post(url, json={"sql": "SELECT 1"}), 401)
    assert err["code"] == 10000
    err = fail(httpx.post(url, json={"sql": "SELECT 1"}, headers={"Authorization": "Bearer nope"}), 403)
    assert err["code"] == 10000
    other = f"{emu.base_url}/accounts/someone-else/d1/database/envdb/query"
    assert fail(httpx.post(other, json={"sql": "SELECT 1"}, headers=emu.headers), 403)["code"] == 10000
    fail(cf.get("/no/such/thing"), 404)
    fail(cf.delete("/vectorize/v2/indexes/x/query"), 405)
    fail(cf.post("/d1/database/envdb/query", content=b"{not json"), 400)


# --------------------------------------------------------------------------------------------------------
# D1
# --------------------------------------------------------------------------------------------------------

def test_d1_query_raw_meta_and_types(cf):
    db = unique("db")
    res = ok(q(cf, db, "CREATE TABLE t(id INTEGER PRIMARY KEY, n INTEGER, s TEXT, r REAL);"
                       "INSERT INTO t(n, s, r) VALUES (?, ?, ?), (?, ?, ?);"
                       "SELECT id, n, s, r FROM t ORDER BY id",
               ["1", "x", "1.5", 2, None, 3.0]))
    assert len(res) == 3 and all(item["success"] for item in res)
    meta = res[1]["meta"]
    for key in ("changes", "changed_db", "duration", "last_row_id", "rows_read", "rows_written", "size_after",
                "served_by_primary", "served_by_region", "timings"):
        assert key in meta
    assert meta["changes"] == 2 and meta["changed_db"] is True and meta["last_row_id"] == 2
    # "1" became an INTEGER through column affinity; 3.0 prints as 3 (a JS number)
    assert res[2]["results"] == [{"id": 1, "n": 1, "s": "x", "r": 1.5}, {"id": 2, "n": 2, "s": None, "r": 3}]

    raw = ok(q(cf, db, "SELECT typeof(n) AS tn, 9007199254740993 AS big, x'0102' AS b FROM t WHERE id = ?",
               ["1"], raw=True))
    assert raw[0]["results"] == {"columns": ["tn", "big", "b"], "rows": [["integer", 9007199254740992, [1, 2]]]}

    info = ok(cf.get(f"/d1/database/{db}"))
    assert info["uuid"] == db and info["num_tables"] >= 1 and info["file_size"] > 0


def test_d1_batch_is_atomic(cf):
    db = unique("db")
    ok(q(cf, db, "CREATE TABLE t(id TEXT PRIMARY KEY)"))
    r = cf.post(f"/d1/database/{db}/query", json={"batch": [
        {"sql": "INSERT INTO t VALUES (?)", "params": ["a"]},
        {"sql": "INSERT INTO t VALUES (?)", "params": ["a"]},  # duplicate -> whole request rolls back
    ]})
    err = fail(r, 400)
    assert err["message"].startswith("D1_ERROR: ") and "UNIQUE constraint failed" in err["message"]
    fail(q(cf, db, "INSERT INTO t VALUES ('b'); INSERT INTO missing VALUES (1)"), 400)
    assert ok(q(cf, db, "SELECT count(*) AS n FROM t"))[0]["results"] == [{"n": 0}]

    res = ok(cf.post(f"/d1/database/{db}/raw", json={"batch": [
        {"sql": "INSERT INTO t VALUES (?)", "params": ["a"]},
        {"sql": "SELECT id FROM t"},
    ]}))
    assert res[1]["results"]["rows"] == [["a"]]


@pytest.mark.parametrize("stmt", ["BEGIN", "BEGIN TRANSACTION", "COMMIT", "SAVEPOINT s1", "ROLLBACK",
                                  "/* c */ begin immediate"])
def test_d1_rejects_transaction_statements(cf, stmt):
    db = unique("db")
    ok(q(cf, db, "CREATE TABLE t(x)"))
    err = fail(q(cf, db, f"INSERT INTO t VALUES (1); {stmt}; INSERT INTO t VALUES (2)"), 400)
    assert "cannot start a transaction within a transaction" in err["message"]
    assert ok(q(cf, db, "SELECT count(*) AS n FROM t"))[0]["results"] == [{"n": 0}]


def test_d1_limits(cf):
    db = unique("db")
    ok(q(cf, db, "CREATE TABLE t(x)"))
    ok(q(cf, db, f"SELECT {', '.join(['?'] * 100)}", list(range(100))))
    err = fail(q(cf, db, f"SELECT {', '.join(['?'] * 101)}", list(range(101))), 400)
    assert "too many SQL variables" in err["message"]
    ok(q(cf, db, "SELECT '" + "x" * 99_000 + "' AS s"))
    err = fail(q(cf, db, "SELECT '" + "x" * 100_001 + "' AS s"), 400)
    assert "Statement too long" in err["message"]
    # limits are per statement: two 60 kB statements in one request are fine
    ok(q(cf, db, "INSERT INTO t VALUES ('" + "y" * 60_000 + "'); INSERT INTO t VALUES ('" + "z" * 60_000 + "')"))
    fail(q(cf, db, "SELECT ?, ?", ["only-one"]), 400)
    err = fail(q(cf, db, "SELECT ?", [{"an": "object"}]), 400)
    assert err["message"].startswith("D1_TYPE_ERROR")


def test_d1_sql_features(cf):
    db = unique("db")
    ok(q(cf, db, "CREATE TABLE p(id INTEGER PRIMARY KEY);"
                 "CREATE TABLE c(id INTEGER PRIMARY KEY, p INTEGER REFERENCES p(id) ON DELETE CASCADE);"
                 "CREATE VIRTUAL TABLE f USING fts5(body);"
                 "CREATE TRIGGER tr AFTER INSERT ON p BEGIN INSERT INTO f(body) VALUES ('parent ' || NEW.id); END;"))
    err = fail(q(cf, db, "PRAGMA foreign_keys = OFF; INSERT INTO c(p) VALUES (42)"), 400)
    assert "FOREIGN KEY constraint failed" in err["message"]
    ok(q(cf, db, "INSERT INTO p(id) VALUES (1); INSERT INTO c(p) VALUES (1); DELETE FROM p WHERE id = 1"))
    res = ok(q(cf, db, "SELECT (SELECT count(*) FROM c) AS children, (SELECT body FROM f WHERE f MATCH 'parent') AS hit,"
                       " json_extract(?, '$.a') AS a, ? ->> '$.b' AS b",
               ['{"a": 5}', '{"b": "x"}']))
    assert res[0]["results"] == [{"children": 0, "hit": "parent 1", "a": 5, "b": "x"}]
    err = fail(q(cf, db, "SELECT json_extract('{oops', '$.a')"), 400)
    assert "malformed JSON" in err["message"]
    ids = ok(q(cf, db, "SELECT value FROM json_each(?1) ORDER BY value", [json.dumps(["b", "a"])]))
    assert ids[0]["results"] == [{"value": "a"}, {"value": "b"}]


def test_d1_fixed_database_list():
    with running_emulator(databases=["known-db"]) as e:
        with httpx.Client(base_url=e.account_url, headers=e.headers) as c:
            ok(q(c, "known-db", "SELECT 1"))
            assert fail(q(c, "other-db", "SELECT 1"), 404)["code"] == 7404
            assert fail(c.get("/d1/database/other-db"), 404)["code"] == 7404
            created = ok(c.post("/d1/database", json={"name": "made"}))
            ok(q(c, created["uuid"], "SELECT 1"))
            assert {d["uuid"] for d in ok(c.get("/d1/database"))} == {"known-db", created["uuid"]}


# --------------------------------------------------------------------------------------------------------
# Vectorize
# --------------------------------------------------------------------------------------------------------

def test_vectorize_index_crud(cf):
    name = make_index(cf, dims=3)
    assert name in [i["name"] for i in ok(cf.get("/vectorize/v2/indexes"))]
    assert ok(cf.get(f"/vectorize/v2/indexes/{name}"))["config"]["dimensions"] == 3
    assert fail(cf.post("/vectorize/v2/indexes", json={"name": name, "config": {"dimensions": 3, "metric": "cosine"}}),
                409)
    fail(cf.post("/vectorize/v2/indexes", json={"name": "bad-metric", "config": {"dimensions": 3, "metric": "l1"}}), 400)
    preset = unique("preset")
    res = ok(cf.post("/vectorize/v2/indexes", json={"name": preset, "config": {"preset": "@cf/baai/bge-base-en-v1.5"}}))
    assert res["config"] == {"dimensions": 768, "metric": "cosine"}
    ok(cf.delete(f"/vectorize/v2/indexes/{name}"))
    fail(cf.get(f"/vectorize/v2/indexes/{name}"), 404)


def test_vectorize_lagged_visibility_and_info(emu, cf):
    name = make_index(cf)
    emu.vector_lag_ms = 3_600_000  # an hour: nothing applies during the test unless flushed (no race with a clock)
    m1 = upsert(cf, name, {"id": "a", "values": [1, 0, 0, 0]})
    m2 = upsert(cf, name, {"id": "b", "values": [0, 1, 0, 0]})
    assert m1 != m2 and m1 < m2
    info = ok(cf.get(f"/vectorize/v2/indexes/{name}/info"))
    assert set(info) == {"dimensions", "vectorCount", "processedUpToDatetime", "processedUpToMutation"}
    assert info["vectorCount"] == 0 and info["processedUpToMutation"] != m2
    assert ok(query(cf, name, vector=[1, 0, 0, 0]))["count"] == 0
    assert ok(cf.post(f"/vectorize/v2/indexes/{name}/get_by_ids", json={"ids": ["a"]})) == []
    emu.flush_vectors()
    info = ok(cf.get(f"/vectorize/v2/indexes/{name}/info"))
    assert info["processedUpToMutation"] == m2 and info["vectorCount"] == 2
    # a short lag applies by itself, in order (waited for as a condition, however slow the machine)
    emu.vector_lag_ms = 50
    m2b = upsert(cf, name, {"id": "b", "values": [0, 1, 0, 0]})
    deadline = time.monotonic() + 30
    while ok(cf.get(f"/vectorize/v2/indexes/{name}/info"))["processedUpToMutation"] != m2b:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert ok(cf.get(f"/vectorize/v2/indexes/{name}/info"))["vectorCount"] == 2
    res = ok(query(cf, name, vector=[1, 0, 0, 0], topK=1))
    assert res == {"count": 1, "matches": [{"id": "a", "score": pytest.approx(1.0)}]}
    # flush knob
    m3 = cf.post(f"/vectorize/v2/indexes/{name}/delete_by_ids", json={"ids": ["a"]}).json()["result"]["mutationId"]
    emu.flush_vectors()
    assert ok(cf.get(f"/vectorize/v2/indexes/{name}/info"))["processedUpToMutation"] == m3


def test_vectorize_filters_only_on_preindexed_properties(cf):
    name = make_index(cf)
    upsert(cf, name, {"id": "early", "values": [1, 0, 0, 0], "metadata": {"kind": "note", "n": 1}})
    ok(cf.post(f"/vectorize/v2/indexes/{name}/metadata_index/create",
               json={"propertyName": "kind", "indexType": "string"}))
    ok(cf.post(f"/vectorize/v2/indexes/{name}/metadata_index/create",
               json={"propertyName": "n", "indexType": "number"}))
    upsert(cf, name,
           {"id": "late", "values": [0.9, 0.1, 0, 0], "metadata": {"kind": "note", "n": 5, "extra": "e"}},
           {"id": "fact", "values": [0.8, 0.2, 0, 0], "metadata": {"kind": "fact", "n": 10}})
    assert ok(cf.get(f"/vectorize/v2/indexes/{name}/metadata_index/list"))["metadataIndexes"] == [
        {"propertyName": "kind", "indexType": "string"}, {"propertyName": "n", "indexType": "number"}]

    def ids(flt, **kw):
        return [m["id"] for m in ok(query(cf, name, vector=[1, 0, 0, 0], topK=10, filter=flt, **kw))["matches"]]

    assert ids(None) == ["early", "late", "fact"]
    assert ids({"kind": "note"}) == ["late"]                  # "early" predates the index
    assert ids({"kind": {"$eq": "note"}}) == ["late"]
    assert ids({"kind": {"$ne": "note"}}) == ["fact"]
    assert ids({"kind": {"$in": ["note", "fact"]}}) == ["late", "fact"]
    assert ids({"kind": {"$nin": ["note"]}}) == ["fact"]
    assert ids({"n": {"$gte": 5, "$lt": 10}}) == ["late"]
    assert ids({"n": {"$gt": 5}}) == ["fact"]
    assert ids({"kind": "note", "n": {"$lte": 5}}) == ["late"]
    assert ids({"extra": "e"}) == []                          # never indexed
    # re-upserting brings the early vector into the index
    upsert(cf, name, {"id": "early", "values": [1, 0, 0, 0], "metadata": {"kind": "note", "n": 1}})
    assert ids({"kind": "note"}) == ["early", "late"]
    # filter applies before topK
    assert [m["id"] for m in ok(query(cf, name, vector=[1, 0, 0, 0], topK=1, filter={"kind": "fact"}))["matches"]] \
        == ["fact"]
    # returnMetadata: indexed -> only indexed fields; all -> everything
    m = ok(query(cf, name, vector=[0.9, 0.1, 0, 0], topK=1, returnMetadata="indexed"))["matches"][0]
    assert m["id"] == "late" and m["metadata"] == {"kind": "note", "n": 5}
    m = ok(query(cf, name, vector=[0.9, 0.1, 0, 0], topK=1, returnMetadata="all"))["matches"][0]
    assert m["metadata"] == {"kind": "note", "n": 5, "extra": "e"}
    fail(query(cf, name, vector=[1, 0, 0, 0], filter={"kind": {"$regex": "x"}}), 400)
    fail(query(cf, name, vector=[1, 0, 0, 0], filter={"n": {"$gt": 1, "$gte": 2}}), 400)
    fail(query(cf, name, vector=[1, 0, 0, 0], filter={"$or": []}), 400)


def test_vectorize_metadata_index_limits(cf):
    name = make_index(cf, indexes=[(f"p{i}", "string") for i in range(10)])
    fail(cf.post(f"/vectorize/v2/indexes/{name}/metadata_index/create",
                 json={"propertyName": "p10", "indexType": "string"}), 400)
    fail(cf.post(f"/vectorize/v2/indexes/{name}/metadata_index/create",
                 json={"propertyName": "p0", "indexType": "string"}), 409)
    ok(cf.post(f"/vectorize/v2/indexes/{name}/metadata_index/delete", json={"propertyName": "p0"}))
    assert len(ok(cf.get(f"/vectorize/v2/indexes/{name}/metadata_index/list"))["metadataIndexes"]) == 9


def test_vectorize_topk_limits(cf):
    name = make_index(cf)
    upsert(cf, name, *({"id": f"v{i}", "values": [1, i, 0, 0]} for i in range(30)))
    assert ok(query(cf, name, vector=[1, 0, 0, 0]))["count"] == 5  # default topK
    assert ok(query(cf, name, vector=[1, 0, 0, 0], topK=100))["count"] == 30
    assert ok(query(cf, name, vector=[1, 0, 0, 0], topK=100, returnMetadata="indexed"))["count"] == 30
    fail(query(cf, name, vector=[1, 0, 0, 0], topK=101), 400)
    assert ok(query(cf, name, vector=[1, 0, 0, 0], topK=20, returnValues=True))["count"] == 20
    fail(query(cf, name, vector=[1, 0, 0, 0], topK=21, returnValues=True), 400)
    fail(query(cf, name, vector=[1, 0, 0, 0], topK=21, returnMetadata="all"), 400)
    fail(query(cf, name, vector=[1, 0, 0], topK=1), 400)  # dimension mismatch
    fail(query(cf, name, vector=[1, 0, 0, 0], returnMetadata=True), 400)


def test_vectorize_namespaces_get_delete_insert(cf):
    name = make_index(cf)
    upsert(cf, name, {"id": "t1-a", "values": [1, 0, 0, 0], "namespace": "t1", "metadata": {"x": 1}},
           {"id": "t2-a", "values": [1, 0, 0, 0], "namespace": "t2"},
           {"id": "none", "values": [1, 0, 0, 0]})
    res = ok(query(cf, name, vector=[1, 0, 0, 0], namespace="t1"))
    assert [(m["id"], m["namespace"]) for m in res["matches"]] == [("t1-a", "t1")]
    assert ok(query(cf, name, vector=[1, 0, 0, 0], namespace="t3"))["count"] == 0
    assert ok(query(cf, name, vectorId="t2-a", namespace="t2"))["matches"][0]["id"] == "t2-a"

    got = ok(cf.post(f"/vectorize/v2/indexes/{name}/get_by_ids", json={"ids": ["t1-a", "missing", "t2-a"]}))
    assert got == [{"id": "t1-a", "values": [1.0, 0.0, 0.0, 0.0], "metadata": {"x": 1}, "namespace": "t1"},
                   {"id": "t2-a", "values": [1.0, 0.0, 0.0, 0.0], "metadata": {}, "namespace": "t2"}]
    # insert keeps the existing vector; upsert replaces it whole (no metadata merge)
    upsert(cf, name, {"id": "t1-a", "values": [0, 1, 0, 0], "namespace": "t1"}, op="insert")
    assert ok(cf.post(f"/vectorize/v2/indexes/{name}/get_by_ids", json={"ids": ["t1-a"]}))[0]["values"][0] == 1.0
    upsert(cf, name, {"id": "t1-a", "values": [0, 1, 0, 0], "namespace": "t1"})
    assert ok(cf.post(f"/vectorize/v2/indexes/{name}/get_by_ids", json={"ids": ["t1-a"]}))[0]["metadata"] == {}
    assert "mutationId" in ok(cf.post(f"/vectorize/v2/indexes/{name}/delete_by_ids", json={"ids": ["t1-a", "x"]}))
    assert ok(cf.post(f"/vectorize/v2/indexes/{name}/get_by_ids", json={"ids": ["t1-a"]})) == []
    listed = ok(cf.get(f"/vectorize/v2/indexes/{name}/list", params={"count": 1}))
    assert listed["count"] == 1 and listed["totalCount"] == 2 and listed["isTruncated"] is True
    rest = ok(cf.get(f"/vectorize/v2/indexes/{name}/list", params={"cursor": listed["nextCursor"]}))
    assert [v["id"] for v in listed["vectors"] + rest["vectors"]] == ["none", "t2-a"]


def test_vectorize_write_validation(cf):
    name = make_index(cf, dims=2)

    def write(body: bytes, **kw):
        return cf.post(f"/vectorize/v2/indexes/{name}/upsert", content=body,
                       headers={"Content-Type": "application/x-ndjson"}, **kw)

    fail(write(ndjson({"id": "a", "values": [1, 2, 3]})), 400)
    fail(write(ndjson({"id": "x" * 65, "values": [1, 2]})), 400)
    ok(write(ndjson({"id": "x" * 64, "values": [1, 2]})))
    fail(write(ndjson({"id": "m", "values": [1, 2], "metadata": {"big": "y" * 10_300}})), 400)
    fail(write(ndjson(*({"id": f"v{i}", "values": [1, 0]} for i in range(5001)))), 400)
    ok(write(ndjson(*({"id": f"v{i}", "values": [1, 0]} for i in range(5000)))))
    fail(write(b'{"id": "a", "values": [1, 2]}\nnot json\n'), 400)
    ok(write(b'{"id": "a", "values": [1, 2]}\nnot json\n', params={"unparsable-behavior": "discard"}))
    # multipart field "vectors" (what wrangler sends)
    r = cf.post(f"/vectorize/v2/indexes/{name}/insert",
                files={"vectors": ("v.ndjson", ndjson({"id": "mp", "values": [0, 1]}), "application/x-ndjson")})
    ok(r)
    assert ok(cf.post(f"/vectorize/v2/indexes/{name}/get_by_ids", json={"ids": ["mp"]}))[0]["id"] == "mp"


# --------------------------------------------------------------------------------------------------------
# Workers AI
# --------------------------------------------------------------------------------------------------------

EMBED = "/ai/run/@cf/baai/bge-base-en-v1.5"


def test_ai_embeddings(cf):
    res = ok(cf.post(EMBED, json={"text": ["The user prefers vim for editing", "What editor does the user prefer?",
                                           "Quarterly revenue grew by ten percent"]}))
    assert res["shape"] == [3, 768] and res["pooling"] == "mean" and len(res["data"][0]) == 768
    a, b, c = res["data"]
    dot = lambda x, y: sum(i * j for i, j in zip(x, y, strict=True))  # noqa: E731
    assert dot(a, a) == pytest.approx(1.0, abs=1e-6)
    assert dot(a, b) > 0.4 > abs(dot(a, c))
    again = ok(cf.post(EMBED, json={"text": "The user prefers vim for editing"}))
    assert again["shape"] == [1, 768] and again["data"][0] == a
    cls = ok(cf.post(EMBED, json={"text": "The user prefers vim for editing", "pooling": "cls"}))
    assert cls["pooling"] == "cls" and abs(dot(cls["data"][0], a)) < 0.5

    assert fail(cf.post(EMBED, json={"text": ["x"] * 101}), 400)["code"] == 3003
    assert fail(cf.post(EMBED, json={"text": ["ok", ""]}), 400)["code"] == 3003
    assert fail(cf.post(EMBED, json={}), 400)["code"] == 3003
    assert fail(cf.post(EMBED, json={"text": "word " * 600}), 413)["code"] == 3006
    ok(cf.post(EMBED, json={"text": ["x"] * 100}))
    assert fail(cf.post("/ai/run/@cf/nope/model", json={"text": "x"}), 400)["code"] == 5007


def test_ai_reranker_and_llm(emu, cf):
    res = ok(cf.post("/ai/run/@cf/baai/bge-reranker-base", json={
        "query": "which editor does the user prefer",
        "contexts": [{"text": "revenue grew"}, {"text": "the user prefers the vim editor"}, {"text": "user"}],
        "top_k": 2}))
    assert [r["id"] for r in res["response"]] == [1, 2]
    assert 0 < res["response"][1]["score"] < res["response"][0]["score"] < 1

    llm = "/ai/run/@cf/meta/llama-3.1-8b-instruct"
    schema = {"type": "object", "properties": {"facts": {"type": "array", "items": {"type": "string"}}},
              "required": ["facts"]}
    out = ok(cf.post(llm, json={"messages": [{"role": "user", "content": "hi"}],
                                "response_format": {"type": "json_schema", "json_schema": schema}}))
    assert out["response"] == {"facts": []} and set(out["usage"]) >= {"prompt_tokens", "completion_tokens",
                                                                         "total_tokens"}
    emu.push_llm_response({"facts": ["a"]}, "plain text", "not json", {"__error__": {"status": 429, "code": 3040,
                                                                                    "message": "out of capacity"}})
    jm = {"response_format": {"type": "json_object"}}
    assert ok(cf.post(llm, json={"prompt": "x", **jm}))["response"] == {"facts": ["a"]}
    assert ok(cf.post(llm, json={"prompt": "x"}))["response"] == "plain text"
    assert "JSON Mode" in fail(cf.post(llm, json={"prompt": "x", **jm}), 400)["message"]
    assert fail(cf.post(llm, json={"prompt": "x"}), 429)["code"] == 3040
    assert ok(cf.post(llm, json={"prompt": "echo me"}))["response"] == "echo me"
    assert emu.llm_requests[-1]["prompt"] == "echo me"
    assert fail(cf.post(llm, json={"max_tokens": 5}), 400)["code"] == 3003


# --------------------------------------------------------------------------------------------------------
# rate limit, faults, counters, admin HTTP
# --------------------------------------------------------------------------------------------------------

def test_global_rate_limit_blocks_everything(emu, cf):
    emu.set_rate_limit(20, 1.0)
    for i in range(20):
        r = q(cf, "rl", "SELECT 1")
        assert r.status_code == 200, i
        assert r.headers["x-ratelimit-remaining"] == str(19 - i)
    r = q(cf, "rl", "SELECT 1")
    fail(r, 429)
    assert r.headers["retry-after"] == "1" and r.headers["x-ratelimit-remaining"] == "0"
    assert "x-ratelimit-limit" in r.headers and "x-ratelimit-reset" in r.headers
    # every API call is blocked until the window passes, whatever the product
    fail(cf.post(EMBED, json={"text": "x"}), 429)
    fail(cf.get("/vectorize/v2/indexes"), 429)
    time.sleep(1.05)
    ok(q(cf, "rl", "SELECT 1"))


def test_fault_injection_and_counters(emu, cf):
    emu.reset_counters()
    emu.rate_limit_next(2, retry_after=3, path_contains="/d1/")
    ok(cf.get("/vectorize/v2/indexes"))  # does not match the path filter
    for _ in range(2):
        r = q(cf, "faults", "SELECT 1")
        fail(r, 429)
        assert r.headers["retry-after"] == "3"
    ok(q(cf, "faults", "SELECT 1"))

    emu.fail_next(1, status=503)
    fail(cf.post(EMBED, json={"text": "x"}), 503)
    emu.d1_transient_next(1)
    err = fail(q(cf, "faults", "SELECT 1"), 500)
    assert err["message"] == "D1_ERROR: Network connection lost."
    emu.d1_transient_next(1, message="remote")
    assert "transient issue on remote node" in fail(q(cf, "faults", "SELECT 1"), 500)["message"]

    # after=True: the work is done, but the client sees a failure (retry must be idempotent)
    ok(q(cf, "faults", "CREATE TABLE IF NOT EXISTS t(x)"))
    emu.d1_transient_next(1, after=True)
    fail(q(cf, "faults", "INSERT INTO t VALUES (1)"), 500)
    assert ok(q(cf, "faults", "SELECT count(*) AS n FROM t"))[0]["results"] == [{"n": 1}]

    emu.fail_next(1, status=502, raw_body="<html>bad gateway</html>")
    r = q(cf, "faults", "SELECT 1")
    assert r.status_code == 502 and r.text.startswith("<html>")

    counts = emu.reset_counters()
    assert counts["d1"] == 9 and counts["vectorize"] == 1 and counts["ai"] == 1 and counts["total"] == 11
    assert counts["by_op"]["d1.query"] == 9
    assert counts["by_database"] == {"faults": 9}  # D1 requests by the database their path names
    assert emu.counters_snapshot()["total"] == 0


def test_admin_http(emu, cf):
    with httpx.Client(base_url=emu.admin_url) as admin:
        assert admin.get("/health").json() == {"ok": True}
        admin.post("/counters/reset")
        assert admin.post("/faults", json={"kind": "status", "status": 503, "count": 1, "path_contains": "/ai/"}
                          ).status_code == 200
        assert len(admin.get("/faults").json()["faults"]) == 1
        fail(cf.post(EMBED, json={"text": "x"}), 503)
        ok(cf.post(EMBED, json={"text": "x"}))
        cfg = admin.post("/config", json={"vector_lag_ms": 250, "rate_limit": 500, "rate_window_s": 60}).json()
        assert cfg["vector_lag_ms"] == 250 and cfg["rate_limit"] == 500 and emu.vector_lag_ms == 250
        assert admin.post("/config", json={"bogus": 1}).status_code == 400
        admin.post("/llm/responses", json={"responses": [{"a": 1}]})
        out = ok(cf.post("/ai/run/@cf/meta/llama-3.1-8b-instruct",
                         json={"prompt": "x", "response_format": {"type": "json_object"}}))
        assert out["response"] == {"a": 1}
        assert admin.get("/counters").json()["ai"] == 3
        assert admin.post("/vectorize/flush").json() == {"ok": True}
        assert admin.post("/faults", json={"kind": "nope"}).status_code == 400
        assert admin.get("/nothing").status_code == 404


def test_persistence_and_cli(tmp_path):
    data = tmp_path / "cf"
    with running_emulator(data_dir=data) as e, httpx.Client(base_url=e.account_url, headers=e.headers) as c:
        ok(q(c, "keep", "CREATE TABLE t(x); INSERT INTO t VALUES (7)"))
        name = make_index(c, dims=2, indexes=[("k", "string")])
        upsert(c, name, {"id": "a", "values": [1, 0], "metadata": {"k": "v"}})
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.cloudflare_emulator", "--port", "0", "--data-dir", str(data),
         "--account", "acc2", "--token", "tok2", "--vector-lag-ms", "5"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        base = proc.stdout.readline().strip()
        assert base.startswith("http://127.0.0.1:") and base.endswith("/client/v4")
        with httpx.Client(base_url=f"{base}/accounts/acc2", headers={"Authorization": "Bearer tok2"}) as c:
            ok(q(c, "fresh", "SELECT 1"))  # a different account: separate data
            fail(c.get("/vectorize/v2/indexes/" + name), 404)
        assert httpx.get(base.replace("/client/v4", "/__emulator/config")).json()["vector_lag_ms"] == 5
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    with running_emulator(data_dir=data) as e, httpx.Client(base_url=e.account_url, headers=e.headers) as c:
        assert ok(q(c, "keep", "SELECT x FROM t"))[0]["results"] == [{"x": 7}]
        res = ok(query(c, name, vector=[1, 0], filter={"k": "v"}))
        assert [m["id"] for m in res["matches"]] == ["a"]


def test_emulator_object_api():
    e = CloudflareEmulator(account="a1", token=["t1", "t2"], rate_limit=3, rate_window_s=60)
    with e:
        assert e.base_url.endswith("/client/v4") and e.account == "a1"
        # the limit is per token
        for tok in ("t1", "t2"):
            h = {"Authorization": f"Bearer {tok}"}
            codes = [httpx.get(f"{e.account_url}/vectorize/v2/indexes", headers=h).status_code for _ in range(4)]
            assert codes == [200, 200, 200, 429]
        e.reset_rate_limit()
        assert httpx.get(f"{e.account_url}/vectorize/v2/indexes", headers=e.headers).status_code == 200
