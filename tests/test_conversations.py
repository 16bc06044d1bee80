"""Conversations over real HTTP on loopback (and MCP through the SDK client).

Most tests run on a server with the hash embedder (fast, deterministic plumbing); one runs on the shared
server with the real MiniLM model to check that a paraphrase finds its message.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import random
import sqlite3
import time
from contextlib import asynccontextmanager

import httpx
import pytest

from api.conversations_cli import backfill_org
from services.adapters.hash_embedder import HashEmbedder
from services.adapters.sqlite import SqliteDatabase
from services.conversations.compression import decode_content, encode_content
from services.conversations.append import ConversationLimits, KeyedLocks
from services.conversations.conversations import Conversations
from services.conversations.messages import chunk_windows, window_starts
from services.conversations.models import MessageIn
from services.conversations.search import score_messages
from services.storage.scoped import OrgSql
from tests.conftest import EMU_INDEX, Live, assert_error, signup
from tests.mcp_client import mcp_session


@asynccontextmanager
async def second_instance_db(live: Live, org_id: str):
    """Another service instance's handle on the organization's database (a fresh connection or D1 client)."""
    location = live.org_location(org_id)
    if live.backend == "worker":
        from services.adapters.cloudflare.worker_client import WorkerClient, worker_http_client
        from services.adapters.cloudflare.worker_sql import WorkerSqlDatabase

        stack = live.stack  # type: ignore[attr-defined]  # tests.worker_live.WorkerLive
        async with worker_http_client() as http:
            yield WorkerSqlDatabase(WorkerClient(http, url=stack.url, secret=stack.secret), location)
        return
    if live.backend == "cloudflare":
        from api.composition.cloudflare import api_for, shared_client
        from services.adapters.cloudflare import D1Database

        http = shared_client(live.memex.settings)
        try:
            yield D1Database(api_for(live.memex.settings, http), location)
        finally:
            await http.aclose()
    else:
        db = SqliteDatabase(live.data_dir / "orgs" / location / "memex.sqlite3", readers=2)
        try:
            yield db
        finally:
            await db.close()


@pytest.fixture
def a(hlive):
    return signup(hlive, "conv-a")


@pytest.fixture
def b(hlive):
    return signup(hlive, "conv-b")


@pytest.fixture
def http(hlive):
    with hlive.client() as c:
        yield c


def _create(http, org, **body) -> str:
    r = http.post("/v1/conversations", json=body, headers=org.headers)
    assert r.status_code == 201, r.text
    return r.json()["id"]


def _msgs(n: int, start: int = 0, prefix: str = "turn") -> list[dict]:
    return [{"role": "user" if (start + i) % 2 == 0 else "assistant",
             "content": f"{prefix} {start + i}: " + "lorem ipsum " * ((start + i) % 7)}
            for i in range(n)]


def _append(http, org, cid, messages, **headers):
    return http.post(f"/v1/conversations/{cid}/messages", json={"messages": messages}, headers={**org.headers, **headers})


def _all_messages(http, org, cid) -> list[dict]:
    out, start = [], 1
    while True:
        page = http.get(f"/v1/conversations/{cid}/messages", params={"from": start, "limit": 1000}, headers=org.headers).json()
        out += page["messages"]
        if page["next_from"] is None:
            return out
        start = page["next_from"]


def _wait_indexed(live: Live, org, cid, timeout=30.0) -> dict:
    with live.client() as c:
        deadline = time.monotonic() + timeout
        while True:
            body = c.get(f"/v1/conversations/{cid}", headers=org.headers).json()
            if body["indexing"]["state"] == "indexed" or time.monotonic() > deadline:
                return body
            time.sleep(0.05)


def _wait_no_jobs(live: Live, org, timeout=30.0) -> None:
    """Until the organization has no job row and the worker is not running a batch (read in that order: a
    job deleted with its parent may still be running in the worker, finishing with index writes)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not live.sql("SELECT COUNT(*) FROM jobs WHERE organization_id = ?", (org.id,))[0][0] and not live.memex.worker.busy:
            return
        time.sleep(0.02)
    raise AssertionError(f"jobs of {org.id} still pending or running after {timeout}s")


def _chunks(live: Live, cid) -> list[tuple]:
    return live.sql(
        "SELECT id, pk, start_sequence, end_sequence, ordinal, content, indexed_at FROM chunks "
        "WHERE kind = 'conversation' AND parent_id = ? ORDER BY start_sequence", (cid,))


def _vectors(live: Live, org_id: str) -> dict[str, tuple[list[float], dict]]:
    """Local chunk id -> (values, metadata) of the organization's vectors, read from the index itself."""
    prefix = f"{org_id}:"
    if live.backend == "worker":
        return {v["id"][len(prefix):]: ([round(x, 6) for x in v["values"]], v.get("metadata") or {})
                for v in live.vector_records(prefix)}  # type: ignore[attr-defined]  # tests.worker_live.WorkerLive
    if live.backend == "cloudflare":
        live.emulator.flush_vectors()
        ids = live.vector_ids(prefix)
        out = {}
        with httpx.Client(headers=live.emulator.headers, timeout=30) as c:
            base = f"{live.emulator.account_url}/vectorize/v2/indexes/{EMU_INDEX}"
            for i in range(0, len(ids), 100):
                for v in c.post(f"{base}/get_by_ids", json={"ids": ids[i:i + 100]}).json()["result"]:
                    out[v["id"][len(prefix):]] = ([round(x, 6) for x in v["values"]], v.get("metadata") or {})
        return out
    org_id = prefix.split(":", 1)[0]
    with sqlite3.connect(live.data_dir / "orgs" / live.org_location(org_id) / "vectors.sqlite3") as conn:
        rows = conn.execute('SELECT id, "values", metadata FROM vectors WHERE id LIKE ?', (prefix + "%",)).fetchall()
    return {r[0][len(prefix):]: (r[1], json.loads(r[2])) for r in rows}


# -- windows --------------------------------------------------------------------------------------------


def test_incremental_windows_equal_the_seeds_windows_over_the_whole_conversation():
    rng = random.Random(7)
    for _ in range(200):
        windows: dict[int, tuple[int, int]] = {}
        last = 0
        for n in [rng.randint(1, 9) for _ in range(rng.randint(1, 8))]:
            new_last = last + n
            starts = window_starts(last, new_last)
            for s in starts:  # replaced or added
                windows[s] = (s, min(s + 4, new_last))
            # windows not touched were complete already
            assert all(e - s == 4 for s, (_, e) in windows.items() if s not in starts)
            last = new_last
        seed = chunk_windows([(i, "user", str(i)) for i in range(1, last + 1)])
        assert sorted(windows.values()) == [(s, e) for s, e, _ in seed]


def test_seed_chunk_format():
    assert chunk_windows([(2, "assistant", "b"), (1, "user", "a")]) == [(1, 2, "[user]: a\n[assistant]: b")]
    assert [(s, e) for s, e, _ in chunk_windows([(i, "user", "x") for i in range(1, 11)])] == [(1, 5), (4, 8), (7, 10), (10, 10)]


def test_compression_rules():
    assert encode_content("x" * 127) == ("x" * 127, "raw")
    stored, enc = encode_content("x" * 128)
    assert enc == "gzip+base64" and base64.b64decode(stored)[:2] == b"\x1f\x8b"
    assert decode_content(stored, enc) == "x" * 128
    assert decode_content("legacy text", None) == "legacy text"
    assert encode_content("é" * 64)[1] == "gzip+base64"  # 128 bytes of UTF-8, 64 characters


def test_best_message_scoring_prefers_the_matching_message():
    scores = score_messages("when did I move to Lisbon?", ["[filler] the weather", "I moved to Lisbon in 2019", "ok"])
    assert scores.index(max(scores)) == 1


# -- REST basics ----------------------------------------------------------------------------------------


def test_create_get_list_and_pages(hlive, a, http):
    cid = _create(http, a, title="Planning", metadata={"project": "apollo"})
    r = _append(http, a, cid, _msgs(12))
    assert r.status_code == 201, r.text
    body = r.json()
    assert body["appended"] == 12 and body["replayed"] == 0 and body["message_count"] == 12
    assert [m["sequence"] for m in body["messages"]] == list(range(1, 13))
    detail = http.get(f"/v1/conversations/{cid}", params={"limit": 5}, headers=a.headers).json()
    assert detail["title"] == "Planning" and detail["metadata"] == {"project": "apollo"} and detail["message_count"] == 12
    assert [m["sequence"] for m in detail["messages"]] == [1, 2, 3, 4, 5] and detail["next_from"] == 6
    page = http.get(f"/v1/conversations/{cid}/messages", params={"from": 6, "to": 9}, headers=a.headers).json()
    assert [m["sequence"] for m in page["messages"]] == [6, 7, 8, 9] and page["next_from"] is None
    assert [m["content"] for m in _all_messages(http, a, cid)] == [m["content"] for m in _msgs(12)]

    # Listing: most recently active first, paged with the cursor.
    others = [_create(http, a, title=f"c{i}") for i in range(4)]
    _append(http, a, others[0], _msgs(1))  # now the most recent
    seen, before = [], None
    while True:
        params = {"limit": 2, **({"before": before} if before else {})}
        page = http.get("/v1/conversations", params=params, headers=a.headers).json()
        seen += [c["id"] for c in page["conversations"]]
        before = page["next_before"]
        if before is None:
            break
    assert seen[0] == others[0] and sorted(seen) == sorted([cid, *others]) and len(seen) == len(set(seen))


async def test_concurrent_appends_get_contiguous_sequences(hlive, a, http):
    cid = _create(http, a)
    async with httpx.AsyncClient(base_url=hlive.base_url, timeout=60, headers=a.headers) as c:
        results = await asyncio.gather(*[
            c.post(f"/v1/conversations/{cid}/messages", json={"messages": _msgs(5, prefix=f"batch{k}")}) for k in range(10)
        ])
    assert all(r.status_code == 201 for r in results), [r.text for r in results]
    seqs = sorted(m["sequence"] for r in results for m in r.json()["messages"])
    assert seqs == list(range(1, 51))
    for r in results:  # each call got a contiguous run, in its own order
        got = [m["sequence"] for m in r.json()["messages"]]
        assert got == list(range(got[0], got[0] + 5))
    stored = _all_messages(http, a, cid)
    assert [m["sequence"] for m in stored] == list(range(1, 51))
    by_batch = {}
    for m in stored:
        by_batch.setdefault(m["content"].split(" ")[0], []).append(m["sequence"])
    assert all(v == list(range(v[0], v[0] + 5)) for v in by_batch.values())
    assert http.get(f"/v1/conversations/{cid}", headers=a.headers).json()["message_count"] == 50
    # The windows are exactly the seed's windows over the whole conversation.
    expected = chunk_windows([(m["sequence"], m["role"], m["content"]) for m in stored])
    assert [(c[2], c[3], c[5]) for c in _chunks(hlive, cid)] == expected


async def test_two_instances_appending_to_one_conversation_never_collide(hlive, a, http):
    """Two service instances (separate connections, separate in-process locks) share the database: the
    optimistic claim alone keeps sequences contiguous."""
    cid = _create(http, a)

    class NoVectors:
        async def delete_by_ids(self, ids):
            return None

    class Counter(HashEmbedder):
        def count_tokens(self, text):
            return len(text.split())

    async with second_instance_db(hlive, a.id) as db1, second_instance_db(hlive, a.id) as db2:
        instances = [Conversations(OrgSql(db, a.id), NoVectors(), Counter(), locks=KeyedLocks(), limits=ConversationLimits())
                     for db in (db1, db2)]
        calls = [inst.append(cid, [MessageIn(role="user", content=f"i{k % 2} call {k} msg {j}") for j in range(3)])
                 for k, inst in enumerate(instances * 8)]
        results = await asyncio.gather(*calls)
    seqs = sorted(m.sequence for res, _ in results for m in res.messages)
    assert seqs == list(range(1, 49))
    stored = _all_messages(http, a, cid)
    assert [m["sequence"] for m in stored] == list(range(1, 49))
    expected = chunk_windows([(m["sequence"], m["role"], m["content"]) for m in stored])
    assert [(c[2], c[3], c[5]) for c in _chunks(hlive, cid)] == expected


# -- idempotency ------------------------------------------------------------------------------------------


def test_retried_append_with_client_ids_is_a_no_op(hlive, a, http):
    cid = _create(http, a)
    msgs = [{**m, "client_id": f"m-{i}"} for i, m in enumerate(_msgs(4))]
    first = _append(http, a, cid, msgs).json()
    again = _append(http, a, cid, msgs)
    assert again.status_code == 200 and again.headers["idempotent-replayed"] == "true"  # nothing new written
    assert again.json()["messages"] == first["messages"] and again.json()["replayed"] == 4
    assert http.get(f"/v1/conversations/{cid}", headers=a.headers).json()["message_count"] == 4
    # A retry that adds a message appends only the new one, after the others.
    more = _append(http, a, cid, [*msgs[2:], {"role": "user", "content": "new", "client_id": "m-new"}])
    assert more.status_code == 201 and "idempotent-replayed" not in more.headers
    more = more.json()
    assert [m["sequence"] for m in more["messages"]] == [3, 4, 5] and more["replayed"] == 2
    assert hlive.sql("SELECT COUNT(*) FROM messages WHERE conversation_id = ?", (cid,)) == [(5,)]
    assert_error(_append(http, a, cid, [msgs[0], msgs[0]]), 400, "invalid_input")


def test_idempotency_key_replays_the_original_response(hlive, a, http):
    cid = _create(http, a)
    msgs = _msgs(3)
    first = _append(http, a, cid, msgs, **{"Idempotency-Key": "req-1"})
    assert first.status_code == 201 and "idempotent-replayed" not in first.headers
    _append(http, a, cid, _msgs(2, start=3))
    again = _append(http, a, cid, msgs, **{"Idempotency-Key": "req-1"})
    assert again.status_code == 200 and again.headers["idempotent-replayed"] == "true"
    # the original result, saying that all of it was replayed this time
    assert again.json() == {**first.json(), "replayed": 3} and first.json()["replayed"] == 0
    assert hlive.sql("SELECT COUNT(*) FROM messages WHERE conversation_id = ?", (cid,)) == [(5,)]
    # The same key with another request is a conflict, and changes nothing.
    assert_error(_append(http, a, cid, _msgs(1), **{"Idempotency-Key": "req-1"}), 409, "conflict")
    assert hlive.sql("SELECT COUNT(*) FROM messages WHERE conversation_id = ?", (cid,)) == [(5,)]


async def test_concurrent_retries_with_one_key_append_once(hlive, a, http):
    cid = _create(http, a)
    msgs = _msgs(5)
    async with httpx.AsyncClient(base_url=hlive.base_url, timeout=60, headers={**a.headers, "Idempotency-Key": "same"}) as c:
        results = await asyncio.gather(*[c.post(f"/v1/conversations/{cid}/messages", json={"messages": msgs}) for _ in range(6)])
    assert sorted(r.status_code for r in results) == [200] * 5 + [201]  # one append, five replays
    assert len({json.dumps({**r.json(), "replayed": 0}, sort_keys=True) for r in results}) == 1
    assert sorted(r.json()["replayed"] for r in results) == [0] + [5] * 5
    assert hlive.sql("SELECT COUNT(*) FROM messages WHERE conversation_id = ?", (cid,)) == [(5,)]


# -- compression ------------------------------------------------------------------------------------------

TRICKY = [
    "short",
    "",
    "x" * 127,
    "y" * 128,
    "Zürich — naïve café, 東京タワー, Ελληνικά, עברית (RTL), emoji 👩🏽‍💻🏳️‍🌈 and combining é" * 3,
    "line endings\r\nare kept\rexactly\n\ttabs\t and trailing spaces   \n\n",
    "\u0000 nul and \u0007 bell and \u001b[31m ansi \u001b[0m" * 5,
    base64.b64encode(random.Random(1).randbytes(3000)).decode(),
    "".join(chr(random.Random(2).randint(0x20, 0x2FFF)) for _ in range(2000)),
    "\ufeffBOM first, zero\u200bwidth, NBSP\u00a0, \U0010fffd plane-16" * 4,
    "{\"looks\": \"like json\", \"gzip\": \"H4sIAAAAAAAA\"}" * 10,
]


def test_compression_round_trip_over_http(hlive, a, http):
    cid = _create(http, a)
    r = _append(http, a, cid, [{"role": "tool", "content": t, "metadata": {"i": i}} for i, t in enumerate(TRICKY)])
    assert r.status_code == 201, r.text
    got = _all_messages(http, a, cid)
    assert [m["content"] for m in got] == TRICKY and [m["metadata"] for m in got] == [{"i": i} for i in range(len(TRICKY))]
    rows = hlive.sql("SELECT content, content_encoding FROM messages WHERE conversation_id = ? ORDER BY sequence", (cid,))
    for text, (stored, enc) in zip(TRICKY, rows, strict=True):
        assert enc == ("raw" if len(text.encode()) < 128 else "gzip+base64")
        assert (stored == text) if enc == "raw" else (decode_content(stored, enc) == text)
    english = rows[3]
    assert len(english[0]) < 128  # 128 identical bytes compress well


def test_invalid_unicode_is_refused(hlive, a, http):
    cid = _create(http, a)
    body = b'{"messages": [{"role": "user", "content": "lone \\ud800 surrogate"}]}'
    r = http.post(f"/v1/conversations/{cid}/messages", content=body, headers={**a.headers, "content-type": "application/json"})
    assert 400 <= r.status_code < 500
    assert hlive.sql("SELECT COUNT(*) FROM messages WHERE conversation_id = ?", (cid,)) == [(0,)]


def _insert_legacy(live: Live, org_id: str, cid: str, texts: list[str]) -> None:
    if live.backend == "worker":  # no file: the same rows, written through the Worker in one transaction
        base = live.sql("SELECT last_sequence FROM conversations WHERE organization_id = ? AND id = ?", (org_id, cid),
                        org=org_id)[0][0]
        live.write(org_id, [  # type: ignore[attr-defined]  # tests.worker_live.WorkerLive
            *[("INSERT INTO messages (organization_id, id, conversation_id, sequence, role, content, content_encoding, "
               "metadata, created_at) VALUES (?, ?, ?, ?, 'user', ?, NULL, '{}', 1)",
               (org_id, f"legacy{cid[:8]}{base + i:04d}", cid, base + i, t)) for i, t in enumerate(texts, start=1)],
            ("UPDATE conversations SET last_sequence = last_sequence + ?, message_count = message_count + ? "
             "WHERE organization_id = ? AND id = ?", (len(texts), len(texts), org_id, cid))])
        return
    with sqlite3.connect(live.org_db_paths()[org_id]) as conn:
        base = conn.execute("SELECT last_sequence FROM conversations WHERE organization_id = ? AND id = ?",
                            (org_id, cid)).fetchone()[0]
        for i, t in enumerate(texts, start=1):
            conn.execute(
                "INSERT INTO messages (organization_id, id, conversation_id, sequence, role, content, content_encoding, "
                "metadata, created_at) VALUES (?, ?, ?, ?, 'user', ?, NULL, '{}', 1)",
                (org_id, f"legacy{cid[:8]}{base + i:04d}", cid, base + i, t),
            )
        conn.execute("UPDATE conversations SET last_sequence = last_sequence + ?, message_count = message_count + ? "
                     "WHERE organization_id = ? AND id = ?", (len(texts), len(texts), org_id, cid))


LEGACY = [f"Legacy message {i}: " + ("the quarterly report discusses revenue growth in the northern region. " * (i % 4))
          for i in range(25)]


def test_legacy_rows_are_readable_and_searchable(hlive, a, http):
    cid = _create(http, a)
    _insert_legacy(hlive, a.id, cid, LEGACY[:6])
    assert [m["content"] for m in _all_messages(http, a, cid)] == LEGACY[:6]
    # Appending after legacy rows re-chunks from them (they are read as they are).
    _append(http, a, cid, [{"role": "assistant", "content": "the walrus tusk inventory is complete"}])
    hits = http.post("/v1/search", json={"query": "walrus tusk", "kinds": ["conversation"], "conversation_id": cid},
                     headers=a.headers).json()["results"]
    assert hits and hits[0]["best_sequence"] == 7
    chunk = [c for c in _chunks(hlive, cid) if c[2] == 4][0]
    assert chunk[3] == 7 and chunk[5].startswith("[user]: " + LEGACY[3])
    hits = http.post("/v1/search", json={"query": "Legacy message 5 quarterly report", "kinds": ["conversation"],
                                         "conversation_id": cid}, headers=a.headers).json()["results"]
    assert hits[0]["start_sequence"] == 4 and hits[0]["best_sequence"] == 6
    assert [m["content"] for m in hits[0]["messages"]] == [*LEGACY[3:6], "the walrus tusk inventory is complete"]


def test_backfill_is_resumable_and_changes_no_content(hlive, a, b, http):
    cid = _create(http, a)
    _insert_legacy(hlive, a.id, cid, LEGACY)
    other = _create(http, b)
    _insert_legacy(hlive, b.id, other, LEGACY[:3])
    before = _all_messages(http, a, cid)

    first = http.post("/v1/admin/backfill/compress", params={"batch_size": 10}, headers=a.headers)
    assert first.status_code == 200, first.text
    body = first.json()
    assert body["processed"] == 10 and body["remaining"] == 15 and not body["done"] and body["next_cursor"]
    # Stopped here; resume from the cursor until done.
    cursor, rounds = body["next_cursor"], 1
    while cursor:
        body = http.post("/v1/admin/backfill/compress", params={"batch_size": 10, "cursor": cursor}, headers=a.headers).json()
        cursor, rounds = body["next_cursor"], rounds + 1
    assert body["done"] and body["remaining"] == 0 and rounds == 3
    rows = hlive.sql("SELECT content_encoding, COUNT(*) FROM messages WHERE organization_id = ? GROUP BY 1", (a.id,))
    assert None not in dict(rows)
    after = _all_messages(http, a, cid)
    # Every message reads back exactly as before; only how it is stored changed (and the API says so).
    assert [{**m, "content_encoding": None} for m in after] == before
    assert {m["content_encoding"] for m in before} == {None} and None not in {m["content_encoding"] for m in after}
    # The other organization's legacy rows were not touched.
    assert hlive.sql("SELECT COUNT(*) FROM messages WHERE organization_id = ? AND content_encoding IS NULL", (b.id,)) == [(3,)]
    again = http.post("/v1/admin/backfill/compress", headers=a.headers).json()
    assert again["processed"] == 0 and again["done"]


async def test_backfill_cli_loop_shows_progress(hlive, a, http):
    cid = _create(http, a)
    _insert_legacy(hlive, a.id, cid, LEGACY[:12])
    async with second_instance_db(hlive, a.id) as db:
        conv = Conversations(OrgSql(db, a.id), None, None, locks=KeyedLocks())
        out = io.StringIO()
        totals = await backfill_org(conv, batch_size=5, label=a.slug, stream=out, show=True)
    assert totals["processed"] == 12 and totals["cursor"] is None
    drawn = out.getvalue().replace("\r", "\n").splitlines()  # tqdm redraws its line with carriage returns
    assert drawn[-1].startswith(f"{a.slug}: 100%|") and "| 12/12 [" in drawn[-1]
    assert [m["content"] for m in _all_messages(http, a, cid)] == LEGACY[:12]


def test_backfill_needs_admin(hlive, a, http):
    key = http.post("/v1/keys", json={"name": "rw", "scopes": ["read", "write"]}, headers=a.headers).json()["key"]
    assert_error(http.post("/v1/admin/backfill/compress", headers={"authorization": f"Bearer {key}"}), 403, "forbidden")


# -- chunks, vectors, delete ------------------------------------------------------------------------------


def test_rechunking_touches_only_the_tail(hlive, a, http):
    cid = _create(http, a)
    _append(http, a, cid, _msgs(7))
    _wait_indexed(hlive, a, cid)
    before = _chunks(hlive, cid)
    assert [(c[2], c[3]) for c in before] == [(1, 5), (4, 7), (7, 7)]
    vectors_before = _vectors(hlive, a.id)
    assert {c[0] for c in before} <= set(vectors_before)

    _append(http, a, cid, _msgs(3, start=7))
    after_append = _chunks(hlive, cid)
    assert after_append[0] == before[0]  # the full window: same id, same row, same indexed_at
    assert [(c[2], c[3]) for c in after_append] == [(1, 5), (4, 8), (7, 10), (10, 10)]
    assert not {c[0] for c in after_append[1:]} & {c[0] for c in before}
    # The replaced windows' vectors are gone at once; the new ones arrive with the worker.
    assert not {before[1][0], before[2][0]} & set(_vectors(hlive, a.id))
    _wait_indexed(hlive, a, cid)
    vectors_after = _vectors(hlive, a.id)
    assert vectors_after[before[0][0]] == vectors_before[before[0][0]]
    for c in after_append:
        assert c[0] in vectors_after
        md = vectors_after[c[0]][1]
        assert md["organization_id"] == a.id and md["parent_id"] == cid and md["kind"] == "conversation"
        assert (md["start_sequence"], md["end_sequence"]) == (c[2], c[3])
    stored = _all_messages(http, a, cid)
    expected = chunk_windows([(m["sequence"], m["role"], m["content"]) for m in stored])
    assert [(c[2], c[3], c[5]) for c in _chunks(hlive, cid)] == expected


def _footprint(live: Live, org_id: str, cid: str) -> dict:
    return {
        "messages": live.sql("SELECT COUNT(*) FROM messages WHERE organization_id = ? AND conversation_id = ?",
                             (org_id, cid))[0][0],
        "chunks": live.sql("SELECT COUNT(*) FROM chunks WHERE organization_id = ? AND parent_id = ?", (org_id, cid))[0][0],
        "fts": live.sql("SELECT COUNT(*) FROM chunks_fts WHERE organization_id = ? AND rowid NOT IN (SELECT pk FROM chunks)",
                        (org_id,))[0][0],
        "jobs": live.sql("SELECT COUNT(*) FROM jobs WHERE organization_id = ? AND target_id = ?", (org_id, cid))[0][0],
        "keys": live.sql("SELECT COUNT(*) FROM conversation_idempotency WHERE organization_id = ? AND conversation_id = ?",
                         (org_id, cid))[0][0],
        "conversation": live.sql("SELECT COUNT(*) FROM conversations WHERE organization_id = ? AND id = ?", (org_id, cid))[0][0],
    }


def test_delete_leaves_nothing_behind(hlive, a, http):
    cid = _create(http, a)
    _append(http, a, cid, _msgs(11), **{"Idempotency-Key": "del-1"})
    _wait_indexed(hlive, a, cid)
    chunk_ids = [c[0] for c in _chunks(hlive, cid)]
    pks = [c[1] for c in _chunks(hlive, cid)]
    assert chunk_ids and set(chunk_ids) <= set(_vectors(hlive, a.id))
    assert http.delete(f"/v1/conversations/{cid}", headers=a.headers).status_code == 204
    assert _footprint(hlive, a.id, cid) == {"messages": 0, "chunks": 0, "fts": 0, "jobs": 0, "keys": 0, "conversation": 0}
    assert hlive.sql(f"SELECT COUNT(*) FROM chunks_fts WHERE rowid IN ({','.join(map(str, pks))})", org=a.id) == [(0,)]
    assert not set(chunk_ids) & set(_vectors(hlive, a.id))
    assert_error(http.get(f"/v1/conversations/{cid}", headers=a.headers), 404, "not_found")
    assert_error(http.delete(f"/v1/conversations/{cid}", headers=a.headers), 404, "not_found")


def test_delete_right_after_append_leaves_no_vector(hlive, a, http):
    """Delete while the embedding job is pending or running: the worker's late vectors are removed too."""
    for _ in range(5):
        cid = _create(http, a)
        _append(http, a, cid, _msgs(20))
        assert http.delete(f"/v1/conversations/{cid}", headers=a.headers).status_code == 204
        _wait_no_jobs(hlive, a)
        assert not [v for v, (_, md) in _vectors(hlive, a.id).items() if md["parent_id"] == cid]
        assert _footprint(hlive, a.id, cid)["chunks"] == 0


# -- search -------------------------------------------------------------------------------------------------

FACTS = [
    ("user", "Let's plan the offsite agenda for the platform team."),
    ("assistant", "Sure. Do you want to start with the roadmap review or the retro?"),
    ("user", "Roadmap first. Also, my passport number changed, it now ends in 4471."),
    ("assistant", "Noted. Roadmap review first, then the retrospective."),
    ("user", "We should book the venue near the harbour with the big projector."),
    ("assistant", "I will look for venues by the harbour with projectors."),
    ("user", "Budget is capped at twelve thousand euros for the whole event."),
    ("assistant", "Understood: twelve thousand euros is the cap."),
    ("user", "The caterer must offer vegetarian and gluten free menus."),
    ("assistant", "I will shortlist caterers with vegetarian and gluten-free options."),
]


def test_search_returns_windows_with_messages_and_best_sequence(hlive, a, http):
    cid = _create(http, a, title="Offsite")
    _append(http, a, cid, [{"role": r, "content": c, "metadata": {"n": i}} for i, (r, c) in enumerate(FACTS)])
    tid = http.post("/v1/thoughts", json={"content": "The harbour venue has a projector and seats forty."},
                    headers=a.headers).json()["id"]
    _wait_indexed(hlive, a, cid)
    hlive.wait_indexed(a.headers, tid)

    r = http.post("/v1/search", json={"query": "caterer menus gluten free", "kinds": ["conversation"], "conversation_id": cid,
                                      "explain": True}, headers=a.headers)
    assert r.status_code == 200, r.text
    hits = r.json()["results"]
    top = hits[0]
    assert top["kind"] == "conversation" and top["conversation_id"] == cid and top["summary"] == "Offsite"
    assert top["best_sequence"] == 9
    assert top["start_sequence"] <= 9 <= top["end_sequence"]
    assert [m["sequence"] for m in top["messages"]] == list(range(top["start_sequence"], top["end_sequence"] + 1))
    assert all(m["content"] == FACTS[m["sequence"] - 1][1] and m["metadata"] == {"n": m["sequence"] - 1} for m in top["messages"])
    assert top["chunk_content"].startswith(f"[{FACTS[top['start_sequence'] - 1][0]}]: ")
    # Scoped to one conversation, a search still returns several windows of it (each pinpointing another message).
    r = http.post("/v1/search", json={"query": "harbour venue budget euros", "kinds": ["conversation"], "conversation_id": cid},
                  headers=a.headers).json()["results"]
    assert len(r) >= 2 and len({h["chunk_id"] for h in r}) == len(r)
    assert len({h["best_sequence"] for h in r}) == len(r)
    # One search over both kinds.
    both = http.post("/v1/search", json={"query": "harbour venue projector", "kinds": ["conversation", "thought"]},
                     headers=a.headers).json()["results"]
    assert {"conversation", "thought"} <= {h["kind"] for h in both}
    assert any(h["kind"] == "thought" and h["document_id"] == tid for h in both)
    # Scoped to a conversation that does not exist: 404.
    assert_error(http.post("/v1/search", json={"query": "x", "kinds": ["conversation"], "conversation_id": "nope"},
                           headers=a.headers), 404, "not_found")


def test_semantic_search_pinpoints_a_paraphrased_fact(live, client):
    """The real model: a question in other words finds the window and the message."""
    org = signup(live, "conv-semantic")
    cid = client.post("/v1/conversations", json={}, headers=org.headers).json()["id"]
    filler = [("user", "Can you help me refactor this Python function that parses dates?"),
              ("assistant", "Yes, use datetime.strptime with an explicit format string and handle ValueError."),
              ("user", "Thanks. What about time zones?"),
              ("assistant", "Attach a tzinfo with zoneinfo.ZoneInfo and convert to UTC before storing.")]
    fact = ("user", "By the way, my sister Margaret just adopted a greyhound called Biscuit.")
    convo = filler * 3 + [fact] + filler * 3
    client.post(f"/v1/conversations/{cid}/messages", json={"messages": [{"role": r, "content": c} for r, c in convo]},
                headers=org.headers)
    _wait_indexed(live, org, cid, timeout=120)
    hits = client.post("/v1/search", json={"query": "what dog did my sibling get?", "kinds": ["conversation"], "top_k": 3},
                       headers=org.headers).json()["results"]
    assert hits and hits[0]["start_sequence"] <= 13 <= hits[0]["end_sequence"]
    assert hits[0]["best_sequence"] == 13


# -- bad input ----------------------------------------------------------------------------------------------


def test_bad_input_is_4xx_with_the_error_body_and_changes_nothing(hlive, a, http):
    cid = _create(http, a)
    _append(http, a, cid, _msgs(2))
    _wait_indexed(hlive, a, cid)
    _wait_no_jobs(hlive, a)
    snapshot = _footprint(hlive, a.id, cid)
    cases = [
        ({"messages": []}, 400),
        ({"messages": _msgs(101)}, 400),
        ({"messages": [{"role": "robot", "content": "x"}]}, 400),
        ({"messages": [{"role": "user"}]}, 400),
        ({"messages": [{"role": "user", "content": 5}]}, 400),
        ({"messages": [{"role": "user", "content": "x", "organization_id": "org_x"}]}, 400),
        ({"messages": [{"role": "user", "content": "x", "metadata": [1]}]}, 400),
        ({"messages": [{"role": "user", "content": "x", "client_id": ""}]}, 400),
        ({"messages": _msgs(1), "extra": 1}, 400),
        ({"messages": [{"role": "user", "content": "é" * 40_000}]}, 413),
        ({"messages": [{"role": "user", "content": "x", "metadata": {"k": "v" * 20_000}}]}, 413),
    ]
    for body, status in cases:
        assert_error(http.post(f"/v1/conversations/{cid}/messages", json=body, headers=a.headers), status)
    assert_error(http.post(f"/v1/conversations/{cid}/messages", content=b"{not json",
                           headers={**a.headers, "content-type": "application/json"}), 400)
    assert_error(_append(http, a, cid, _msgs(1), **{"Idempotency-Key": "k" * 300}), 400)
    assert _footprint(hlive, a.id, cid) == snapshot
    assert_error(http.post("/v1/conversations", json={"title": "t" * 501}, headers=a.headers), 400)
    assert_error(http.post("/v1/conversations", json={"metadata": "no"}, headers=a.headers), 400)
    assert_error(http.post("/v1/conversations", json={"organization_id": a.id}, headers=a.headers), 400)
    for params in ({"from": 0}, {"limit": 0}, {"limit": 1001}, {"to": 0}):
        assert_error(http.get(f"/v1/conversations/{cid}/messages", params=params, headers=a.headers), 400)
    empty = http.get(f"/v1/conversations/{cid}/messages", params={"from": 5, "to": 2}, headers=a.headers).json()
    assert empty["messages"] == [] and empty["next_from"] is None
    assert_error(http.get("/v1/conversations", params={"before": "garbage"}, headers=a.headers), 400)
    assert_error(http.get("/v1/conversations", params={"limit": 101}, headers=a.headers), 400)
    assert_error(http.post("/v1/admin/backfill/compress", params={"batch_size": 0}, headers=a.headers), 400)
    assert_error(_append(http, a, "no-such-conversation", _msgs(1)), 404, "not_found")
    # Scopes: a read-only key reads but cannot write.
    key = http.post("/v1/keys", json={"name": "ro", "scopes": ["read"]}, headers=a.headers).json()["key"]
    ro = {"authorization": f"Bearer {key}"}
    assert http.get(f"/v1/conversations/{cid}", headers=ro).status_code == 200
    assert_error(http.post(f"/v1/conversations/{cid}/messages", json={"messages": _msgs(1)}, headers=ro), 403, "forbidden")
    assert_error(http.post("/v1/conversations", json={}, headers=ro), 403)
    assert_error(http.delete(f"/v1/conversations/{cid}", headers=ro), 403)
    assert_error(http.get("/v1/conversations"), 401)
    assert _footprint(hlive, a.id, cid) == snapshot


# -- tenancy ------------------------------------------------------------------------------------------------


def _org_snapshot(live: Live, org_id: str):
    return (
        live.sql("SELECT id, title, metadata, message_count, last_sequence, updated_at FROM conversations "
                 "WHERE organization_id = ? ORDER BY id", (org_id,)),
        live.sql("SELECT id, sequence, content, content_encoding FROM messages WHERE organization_id = ? ORDER BY id", (org_id,)),
        live.sql("SELECT id, content FROM chunks WHERE organization_id = ? ORDER BY id", (org_id,)),
        sorted(_vectors(live, org_id)),
    )


def test_rest_other_orgs_conversation_is_404_everywhere(hlive, a, b, http):
    cid = _create(http, a, title="secret plans")
    _append(http, a, cid, [{"role": "user", "content": "the vault code is ocelot seven"}] + _msgs(6))
    _insert_legacy(hlive, a.id, cid, ["a legacy row of a's"])
    _wait_indexed(hlive, a, cid)
    before = _org_snapshot(hlive, a.id)
    assert_error(http.get(f"/v1/conversations/{cid}", headers=b.headers), 404, "not_found")
    assert_error(http.get(f"/v1/conversations/{cid}/messages", headers=b.headers), 404, "not_found")
    assert_error(_append(http, b, cid, _msgs(1)), 404, "not_found")
    assert_error(_append(http, b, cid, _msgs(1), **{"Idempotency-Key": "x"}), 404, "not_found")
    assert_error(http.delete(f"/v1/conversations/{cid}", headers=b.headers), 404, "not_found")
    for kinds in (["conversation"], ["conversation", "thought"]):
        assert_error(http.post("/v1/search", json={"query": "vault code ocelot", "kinds": kinds, "conversation_id": cid},
                               headers=b.headers), 404, "not_found")
    assert http.post("/v1/search", json={"query": "vault code ocelot", "kinds": ["conversation", "thought"], "top_k": 50},
                     headers=b.headers).json()["results"] == []
    assert http.get("/v1/conversations", params={"limit": 100}, headers=b.headers).json()["conversations"] == []
    assert http.post("/v1/admin/backfill/compress", headers=b.headers).status_code == 200
    assert _org_snapshot(hlive, a.id) == before
    # A still sees everything.
    assert http.get(f"/v1/conversations/{cid}", headers=a.headers).json()["message_count"] == 8


async def test_mcp_conversation_tools(hlive, a, b, http):
    async with mcp_session(a.mcp_url, a.headers) as s:
        names = {t.name for t in (await s.list_tools()).tools}
        assert {"create_conversation", "append_messages", "get_conversation", "list_conversations",
                "delete_conversation", "search_conversations"} <= names
        tools = {t.name: t for t in (await s.list_tools()).tools}
        assert tools["append_messages"].outputSchema
        assert tools["append_messages"].inputSchema["required"] == ["conversation_id", "messages"]
        made = await s.call_tool("create_conversation", {"title": "via mcp"})
        cid = made.structuredContent["id"]
        msgs = [{"role": r, "content": c, "client_id": f"k{i}"} for i, (r, c) in enumerate(FACTS)]
        app = await s.call_tool("append_messages", {"conversation_id": cid, "messages": msgs, "idempotency_key": "mcp-1"})
        assert not app.isError and app.structuredContent["appended"] == 10
        again = await s.call_tool("append_messages", {"conversation_id": cid, "messages": msgs, "idempotency_key": "mcp-1"})
        # the original result, saying that all of it was replayed this time
        assert again.structuredContent == {**app.structuredContent, "replayed": 10} and app.structuredContent["replayed"] == 0
        got = await s.call_tool("get_conversation", {"conversation_id": cid, "limit": 4})
        assert [m["sequence"] for m in got.structuredContent["messages"]] == [1, 2, 3, 4]
        assert got.structuredContent["next_from"] == 5
        listed = await s.call_tool("list_conversations", {"limit": 5})
        assert listed.structuredContent["conversations"][0]["id"] == cid
        found = await s.call_tool("search_conversations", {"query": "caterer menus gluten free", "conversation_id": cid})
        assert not found.isError and found.structuredContent["results"][0]["best_sequence"] == 9
        bad = await s.call_tool("append_messages", {"conversation_id": cid, "messages": [{"role": "robot", "content": "x"}]})
        assert bad.isError

    before = _org_snapshot(hlive, a.id)
    async with mcp_session(b.mcp_url, b.headers) as s:
        for tool, args in [
            ("get_conversation", {"conversation_id": cid}),
            ("append_messages", {"conversation_id": cid, "messages": [{"role": "user", "content": "intrusion"}]}),
            ("delete_conversation", {"conversation_id": cid}),
            ("search_conversations", {"query": "caterer", "conversation_id": cid}),
        ]:
            res = await s.call_tool(tool, args)
            assert res.isError and json.loads(res.content[0].text)["error"]["code"] == "not_found", (tool, res)
        assert (await s.call_tool("list_conversations", {})).structuredContent["conversations"] == []
        found = await s.call_tool("search_conversations", {"query": "caterer gluten free", "include_thoughts": True})
        assert found.structuredContent["results"] == []
    assert _org_snapshot(hlive, a.id) == before

    key = http.post("/v1/keys", json={"name": "ro", "scopes": ["read"]}, headers=a.headers).json()["key"]
    async with mcp_session(a.mcp_url, {"authorization": f"Bearer {key}"}) as s:
        names = {t.name for t in (await s.list_tools()).tools}
        assert {"get_conversation", "list_conversations", "search_conversations"} <= names
        assert not {"create_conversation", "append_messages", "delete_conversation"} & names

    async with mcp_session(a.mcp_url, a.headers) as s:
        gone = await s.call_tool("delete_conversation", {"conversation_id": cid})
        assert gone.structuredContent == {"conversation_id": cid, "deleted": True}
    _wait_no_jobs(hlive, a)
    assert _footprint(hlive, a.id, cid)["chunks"] == 0


def test_openapi_lists_the_conversation_operations(hlive, http):
    doc = http.get("/schema/openapi.json").json()
    ops = {op["operationId"] for path in doc["paths"].values() for op in path.values()
           if isinstance(op, dict) and "operationId" in op}
    assert {"createConversation", "listConversations", "getConversation", "deleteConversation", "appendMessages",
            "listMessages", "backfillCompress"} <= ops


# -- turn-level retrieval, message times (issue 9, item 4) ----------------------------------------------------

DAY_MS = 86_400_000


def _search(http, org, query, **body):
    r = http.post("/v1/search", json={"query": query, "kinds": ["conversation"], **body}, headers=org.headers)
    assert r.status_code == 200, r.text
    return r.json()["results"]


def test_search_lists_the_best_message_first_with_its_id_and_window(hlive, a, http):
    cid = _create(http, a, title="Offsite")
    appended = _append(http, a, cid, [{"role": r, "content": c} for r, c in FACTS]).json()["messages"]
    _wait_indexed(hlive, a, cid)
    hits = _search(http, a, "caterers vegetarian gluten-free shortlist")
    top = hits[0]
    assert top["best_sequence"] == 10 and top["message_id"] == appended[9]["id"]
    assert top["conversation_id"] == cid and top["chunk_content"] == f"[assistant]: {FACTS[9][1]}"
    # the window around the message: +-2, clipped to the conversation
    assert (top["start_sequence"], top["end_sequence"]) == (8, 10)
    assert [m["sequence"] for m in top["messages"]] == [8, 9, 10]
    assert next(m for m in top["messages"] if m["sequence"] == 10)["id"] == top["message_id"]
    # every hit is another message, best first
    assert len({(h["conversation_id"], h["best_sequence"]) for h in hits}) == len(hits)
    assert [h["score"] for h in hits] == sorted((h["score"] for h in hits), reverse=True)


def test_top_results_are_not_ten_neighbours_of_one_hit(hlive, a, http):
    cid = _create(http, a)
    cluster = [{"role": "user" if i % 2 == 0 else "assistant", "session": "s1",
                "content": f"kayak rental paddle notes part {i}: the kayak paddle rental shop on the river"} for i in range(12)]
    _append(http, a, cid, cluster)
    for label in ("s2", "s3"):
        kayak = {"role": "user", "content": f"In {label} we booked the kayak paddle rental for the river again"}
        body = {"session": label, "messages": _msgs(6, prefix=f"{label} chat") + [kayak] + _msgs(6, prefix=f"{label} more")}
        assert http.post(f"/v1/conversations/{cid}/messages", json=body, headers=a.headers).status_code == 201
    _wait_indexed(hlive, a, cid)
    hits = _search(http, a, "kayak paddle rental river", conversation_id=cid)
    assert len(hits) == 10
    sessions = {m["session"] for h in hits for m in h["messages"] if m["sequence"] == h["best_sequence"]}
    assert {"s1", "s2", "s3"} <= sessions
    in_cluster = [h["best_sequence"] for h in hits if h["best_sequence"] <= 12]
    assert len(in_cluster) < 10


def test_created_at_round_trip_and_from_to_filters(hlive, a, http):
    cid = _create(http, a)
    body = {"created_at": "2024-03-04", "session": "2024-03-04", "messages": [
        {"role": "user", "content": "We decided to move the standup to ten for the Lisbon team",
         "created_at": "2024-03-04T09:30:00Z"},
        {"role": "assistant", "content": "Noted, standup at ten with Lisbon", "ts": 1709545200000},
        {"role": "user", "content": "And the Lisbon retro moves to Fridays"},
    ]}
    r = http.post(f"/v1/conversations/{cid}/messages", json=body, headers=a.headers)
    assert r.status_code == 201, r.text
    r = http.post(f"/v1/conversations/{cid}/messages", headers=a.headers, json={"messages": [
        {"role": "user", "content": "Lisbon standup is back at nine", "created_at": "2024-05-20T08:00:00+02:00",
         "session": "may"}]})
    assert r.status_code == 201, r.text
    msgs = _all_messages(http, a, cid)
    assert [m["created_at"] for m in msgs] == [1709544600000, 1709545200000, 1709510400000, 1716184800000]
    assert [m["session"] for m in msgs] == ["2024-03-04", "2024-03-04", "2024-03-04", "may"]
    _wait_indexed(hlive, a, cid)

    def seqs(**bounds):
        return sorted(h["best_sequence"] for h in _search(http, a, "Lisbon standup", conversation_id=cid, **bounds))

    assert seqs() == [1, 2, 3, 4]
    assert seqs(**{"from": "2024-05-01"}) == [4]
    assert seqs(to="2024-03-31T23:59:59Z") == [1, 2, 3]
    assert seqs(**{"from": 1709544600000, "to": 1709545200000}) == [1, 2]
    assert seqs(**{"from": "2025-01-01"}) == []
    # the hit's messages carry their own times
    assert all(m["created_at"] in (1709544600000, 1709545200000) for h in _search(
        http, a, "Lisbon standup", **{"from": 1709544600000, "to": 1709545200000}) for m in h["messages"]
        if m["sequence"] == h["best_sequence"])


def test_a_relative_date_in_the_query_favours_messages_of_that_range(hlive, a, http):
    cid = _create(http, a)
    _append(http, a, cid, [{"role": "user", "content": "We decided to use Postgres for the billing service",
                            "created_at": "2024-01-10"}])
    _append(http, a, cid, [{"role": "user", "content": "We decided to use Postgres for the reporting service",
                            "created_at": "2024-03-04"}])
    _wait_indexed(hlive, a, cid)
    query = "what did we decide about Postgres last week"
    # min_score 0: the hash embedder's vectors are too weak for the relevance floor on this short query
    hits = _search(http, a, query, reference_time="2024-01-16T12:00:00Z", explain=True, min_score=0)
    assert hits[0]["best_sequence"] == 1 and hits[0]["explain"]["date_boost"] is True
    assert hits[0]["explain"]["date_text"] == "last week"
    hits = _search(http, a, query, reference_time="2024-03-12T12:00:00Z", min_score=0)
    assert hits[0]["best_sequence"] == 2


def test_bad_times_are_4xx_and_append_nothing(hlive, a, http):
    cid = _create(http, a)
    for message in [
        {"role": "user", "content": "x", "created_at": "yesterday"},
        {"role": "user", "content": "x", "created_at": 1709545200},  # seconds, not milliseconds
        {"role": "user", "content": "x", "created_at": 1.5},
        {"role": "user", "content": "x", "created_at": -5},
        {"role": "user", "content": "x", "created_at": "2024-02-30"},
        {"role": "user", "content": "x", "session": ""},
    ]:
        err = assert_error(_append(http, a, cid, [message]), 400)
        assert err["code"] in ("invalid_input", "validation_error", "bad_request"), err
    assert_error(http.post(f"/v1/conversations/{cid}/messages", json={"created_at": "soon", "messages": _msgs(1)},
                           headers=a.headers), 400)
    assert _all_messages(http, a, cid) == []
    for bounds in [{"from": "garbage"}, {"to": 12}, {"reference_time": "x"}, {"from": True}]:
        assert_error(http.post("/v1/search", json={"query": "x", "kinds": ["conversation"], **bounds}, headers=a.headers), 400)
    # from after to is an empty range, not an error: nothing matches it
    empty = http.post("/v1/search", json={"query": "x", "kinds": ["conversation"], "from": "2024-05-01", "to": "2024-04-01",
                                          "min_score": 0}, headers=a.headers)
    assert empty.status_code == 200 and empty.json()["results"] == []


async def test_turns_and_times_of_another_org_are_invisible(hlive, a, b, http):
    cid = _create(http, a)
    _append(http, a, cid, [{"role": "user", "content": "The vault combination is 4471 zebra", "created_at": "2024-03-04",
                            "session": "secret"}])
    _wait_indexed(hlive, a, cid)
    assert _search(http, a, "vault combination zebra")[0]["conversation_id"] == cid
    # b: nothing, whatever the filters; a's conversation id is 404 (not 403)
    assert _search(http, b, "vault combination zebra") == []
    assert _search(http, b, "vault combination zebra", **{"from": "2024-01-01", "to": "2024-12-31"}) == []
    assert_error(http.post("/v1/search", json={"query": "vault", "kinds": ["conversation"], "conversation_id": cid,
                                               "from": "2024-01-01"}, headers=b.headers), 404, "not_found")
    assert_error(_append(http, b, cid, [{"role": "user", "content": "x", "created_at": "2024-03-04"}]), 404, "not_found")
    async with mcp_session(b.mcp_url, b.headers) as s:
        res = await s.call_tool("search_conversations", {"query": "vault zebra", "conversation_id": cid, "from": "2024-01-01"})
        assert res.isError and json.loads(res.content[0].text)["error"]["code"] == "not_found"
        res = await s.call_tool("search_conversations", {"query": "vault zebra", "from": "2024-01-01", "to": "2024-12-31"})
        assert res.structuredContent["results"] == []
    async with mcp_session(a.mcp_url, a.headers) as s:
        res = await s.call_tool("search_conversations", {"query": "vault zebra", "from": "2024-03-01", "to": "2024-03-31"})
        assert [h["conversation_id"] for h in res.structuredContent["results"]] == [cid]
        res = await s.call_tool("search_conversations", {"query": "vault zebra", "from": "2024-04-01"})
        assert res.structuredContent["results"] == []
        bad = await s.call_tool("search_conversations", {"query": "vault", "from": 12})
        assert bad.isError and json.loads(bad.content[0].text)["error"]["code"] == "invalid_input"
