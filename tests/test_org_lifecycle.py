"""The whole organization's lifecycle over real HTTP on loopback, on both backends: export a bundle, import it
into an empty organization, delete an organization (services.bundle, api.org_lifecycle); and the same
from the shell (memex org export / import / delete)."""

from __future__ import annotations

from pathlib import Path

import json
import logging
import os
import subprocess
import sys
import time

import httpx
import pytest

from api.limits import MAX_BODY_BYTES
from services.conversations.messages import chunk_windows
from tests.conftest import Live, Org, assert_error, signup, start_live
from tests.decision_doubles import ScriptedLLM

NDJSON = {"content-type": "application/x-ndjson"}

LISBON = "The team offsite is in Lisbon during the first week of May with the whole engineering group invited."
PORTO = "The team offsite is in Porto during the first week of May with the whole engineering group invited."
TUESDAY = "Our quarterly planning meeting happens every Tuesday morning in the large conference room downstairs."
THURSDAY = "Our quarterly planning meeting happens every Thursday afternoon in the small room upstairs near the kitchen."
NOTES = [
    "The checkout outage was Redis pool exhaustion; we raised the pool to 400 connections.",
    "Kubernetes node autoscaling lags by four minutes when the spot market is tight.",
    "## Runbook\n\nRotate the signing certificate every ninety days.\n\nThe staging cluster mirrors production.",
    "Customer Acme asked for SAML single sign-on before renewing their contract in Q3.",
]


@pytest.fixture
def olive(hlive):
    """The service with the hash embedder, once per backend (conftest's hlive)."""
    return hlive


@pytest.fixture
def http(olive):
    with olive.client() as c:
        yield c


# -- helpers --------------------------------------------------------------------------------------------


def settle(live: Live, org: Org, timeout: float = 60.0) -> None:
    """Until the organization has no job left, every chunk is indexed (and confirmed searchable) and the worker
    is idle."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        jobs = live.sql("SELECT COUNT(*) FROM jobs WHERE organization_id = ?", (org.id,))[0][0]
        pending = live.sql("SELECT COUNT(*) FROM chunks WHERE organization_id = ? AND (indexed_at IS NULL "
                           "OR vector_mutation IS NOT NULL)", (org.id,))[0][0]
        if not jobs and not pending and not live.memex.worker.busy:
            return
        time.sleep(0.05)
    raise AssertionError(f"{org.id} did not settle in {timeout}s: jobs "
                         f"{live.sql('SELECT kind, state, attempts, last_error FROM jobs WHERE organization_id = ?', (org.id,))}")


def capture(http, org: Org, content: str, **body) -> dict:
    r = http.post("/v1/thoughts", json={"content": content, "wait": True, **body}, headers=org.headers)
    assert r.status_code in (200, 201), r.text
    return r.json()


def long_message(i: int) -> str:
    return f"Message {i}: the replica lag on the orders database reached {i * 3} seconds at peak. " * (1 + i % 4)


def seed(live: Live, http, org: Org) -> dict:
    """Thoughts (one replaced, so one history entry; one contradiction link; one used), two conversations (one
    with 23 messages, long ones stored compressed, appended twice; one empty), keys and Access bindings."""
    out: dict = {}
    capture(http, org, LISBON, source="planning")
    capture(http, org, TUESDAY)
    settle(live, org)  # decisions query the index: the originals must be in it
    live.memex.backend.llm = ScriptedLLM({"action": "replace", "target_id": "m1"})
    try:
        porto = capture(http, org, PORTO, source="planning", metadata={"city": "Porto"})
        assert porto["decision"]["action"] == "replaced", porto
        settle(live, org)
        live.memex.backend.llm = ScriptedLLM({"action": "contradiction", "conflicting_id": "m1", "reason": "the day"})
        thursday = capture(http, org, THURSDAY)
        assert thursday["decision"]["action"] == "contradiction", thursday
    finally:
        live.memex.backend.llm = None
    out["porto"] = porto["id"]
    out["notes"] = [capture(http, org, n, source="wiki", metadata={"n": i})["id"] for i, n in enumerate(NOTES)]
    assert http.post(f"/v1/thoughts/{out['notes'][0]}/used", headers=org.headers).status_code == 204

    cid = http.post("/v1/conversations", json={"title": "replica lag", "metadata": {"team": "db"}},
                    headers=org.headers).json()["id"]
    first = [{"role": "user" if i % 2 == 0 else "assistant", "content": long_message(i) if i % 3 else f"short {i}",
              "client_id": f"c{i}", "metadata": {"i": i}, "created_at": 1_700_000_000_000 + i * 1000}
             for i in range(10)]
    assert http.post(f"/v1/conversations/{cid}/messages", json={"messages": first, "session": "s1"},
                     headers=org.headers).status_code == 201
    more = [{"role": "tool" if i == 12 else "user", "content": long_message(i)} for i in range(10, 23)]
    assert http.post(f"/v1/conversations/{cid}/messages", json={"messages": more}, headers=org.headers).status_code == 201
    empty = http.post("/v1/conversations", json={"title": "nothing yet"}, headers=org.headers).json()["id"]
    out["conversations"] = [cid, empty]

    agent = http.post("/v1/keys", json={"name": "agent", "scopes": ["read"], "expires_in_seconds": 3600},
                      headers=org.headers).json()
    gone = http.post("/v1/keys", json={"name": "old", "scopes": ["write"]}, headers=org.headers).json()
    assert http.delete(f"/v1/keys/{gone['id']}", headers=org.headers).status_code == 204
    out["secrets"] = [org.key, agent["key"], gone["key"]]
    assert http.post("/v1/members", json={"email": "ops@example.com", "role": "member"},
                     headers=org.headers).status_code in (200, 201)
    assert http.post("/v1/service-tokens", json={"common_name": "ci-bot.access", "name": "CI", "scopes": ["read"]},
                     headers=org.headers).status_code in (200, 201)
    settle(live, org)
    deadline = time.monotonic() + 10  # the use is written a moment after it is recorded
    while live.sql("SELECT use_count FROM documents WHERE id = ?", (out["notes"][0],), org=org.id)[0][0] != 1:
        assert time.monotonic() < deadline, "the use was not written"
        time.sleep(0.05)
    return out


def export(http, org: Org) -> bytes:
    r = http.get("/v1/org/export", headers=org.headers)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("application/x-ndjson")
    assert "attachment" in r.headers["content-disposition"]
    return r.content


def records(bundle: bytes) -> list[dict]:
    return [json.loads(line) for line in bundle.splitlines() if line.strip()]


def comparable(bundle: bytes) -> list[dict]:
    """What two bundles of the same data share: everything but the organization, the export time and the keys
    (a bundle's keys are the exporting organization's; an import never recreates keys)."""
    out = []
    for r in records(bundle):
        if r["type"] == "key":
            continue
        if r["type"] in ("memex.bundle", "trailer"):
            r = {"type": r["type"], "counts": {k: v for k, v in r["counts"].items() if k != "key"}}
        out.append(r)
    return out


def org_rows(live: Live, org: Org) -> dict[str, int]:
    """What an organization holds, table by table (the control tables included)."""
    tables = ["documents", "chunks", "chunks_fts", "documents_fts", "jobs", "conversations", "messages",
              "thought_history", "thought_links", "tag_counts"]
    out = {t: live.sql(f"SELECT COUNT(*) FROM {t} WHERE organization_id = ?", (org.id,))[0][0] for t in tables}
    for t in ("memberships", "service_tokens"):
        out[t] = live.sql(f"SELECT COUNT(*) FROM {t} WHERE organization_id = ?", (org.id,))[0][0]
    return out


def messages_of(http, org: Org, cid: str) -> list[dict]:
    page = http.get(f"/v1/conversations/{cid}/messages", params={"limit": 1000}, headers=org.headers)
    assert page.status_code == 200, page.text
    return page.json()["messages"]


def chunk_set(live: Live, org: Org) -> list[tuple]:
    return sorted(live.sql("SELECT kind, parent_id, ordinal, content, start_sequence, end_sequence FROM chunks "
                           "WHERE organization_id = ?", (org.id,)))


def do_import(http, org: Org, body, **headers) -> httpx.Response:
    return http.post("/v1/org/import", content=body, headers={**org.headers, **NDJSON, **headers})


# -- the round trip ---------------------------------------------------------------------------------------


def test_round_trip_export_import_export_then_delete(olive, http):
    a = signup(olive, "life-a")
    seeded = seed(olive, http, a)
    bundle_a = export(http, a)
    recs = records(bundle_a)
    text = bundle_a.decode()

    # the header, the records in their sections, the trailer
    header, trailer = recs[0], recs[-1]
    assert header["type"] == "memex.bundle" and header["version"] == 1
    assert header["organization"]["id"] == a.id and header["organization"]["slug"] == a.slug
    org_migrations = sorted(f.name for f in (Path(__file__).resolve().parents[1] / "migrations" / "org").glob("*.sql"))
    assert header["schema"] == org_migrations[-1]  # the newest organization migration
    assert trailer["type"] == "trailer"
    kinds = [r["type"] for r in recs[1:-1]]
    counted = {k: kinds.count(k) for k in trailer["counts"]}
    assert counted == trailer["counts"] == header["counts"]
    assert trailer["counts"] == {"thought": 7, "thought_history": 1, "thought_link": 1, "conversation": 2, "message": 23,
                                 "knowledge_base": 0, "key": 3, "membership": 1, "service_token": 1}
    order = ["thought", "thought_history", "thought_link", "conversation", "key", "membership", "service_token"]
    sections = [order.index("conversation" if k == "message" else k) for k in kinds]
    assert sections == sorted(sections)
    # what restoring needs is there; no secret ever is
    by_id = {r["id"]: r for r in recs if r["type"] == "thought"}
    porto = by_id[seeded["porto"]]
    assert porto["content"] == PORTO and porto["source"] == "planning" and porto["metadata"] == {"city": "Porto"}
    assert porto["enrichment_state"] and porto["created_at"] <= porto["updated_at"]
    # enriched by the extractive default, or failed (the scripted model's answer has no tags): both kinds travel
    assert {"extractive", "failed"} <= {r["enrichment_state"] for r in by_id.values()}
    assert all(r["summary"] and r["tags"] for r in by_id.values() if r["enrichment_state"] == "extractive")
    assert by_id[seeded["notes"][0]]["use_count"] == 1 and by_id[seeded["notes"][0]]["use_weight"] > 0
    history = next(r for r in recs if r["type"] == "thought_history")
    assert (history["thought_id"], history["action"], history["content"]) == (seeded["porto"], "replaced", LISBON)
    link = next(r for r in recs if r["type"] == "thought_link")
    assert link["kind"] == "contradicts" and {link["from_id"], link["to_id"]} <= set(by_id)
    for secret in seeded["secrets"]:
        assert secret not in text and secret[20:] not in text  # mx_<16 hex id>_<43 secret characters>
    assert "key_hash" not in text and "argon2" not in text
    keys = [r for r in recs if r["type"] == "key"]
    assert {k["name"] for k in keys} == {"default", "agent", "old"}
    assert next(k for k in keys if k["name"] == "old")["revoked_at"]
    # messages are plain text, whatever their storage
    cid = seeded["conversations"][0]
    stored = olive.sql("SELECT content_encoding FROM messages WHERE conversation_id = ?", (cid,), org=a.id)
    assert {e for (e,) in stored} == {"raw", "gzip+base64"}
    exported = [r for r in recs if r["type"] == "message"]
    assert [m["content"] for m in exported] == [m["content"] for m in messages_of(http, a, cid)]
    assert [m["sequence"] for m in exported] == list(range(1, 24))

    # into a new organization: the same ids, the same chunks, then the same bundle
    c = signup(olive, "life-c")
    r = do_import(http, c, bundle_a)
    assert r.status_code == 200, r.text
    result = r.json()
    assert result["imported"] == {**trailer["counts"], "key": 0}
    assert result["not_imported"]["key"] == 3 and result["chunks_pending"] > 0 and result["indexing"] == "pending"
    assert "searchable" in result["note"]
    settle(olive, c)
    bundle_c = export(http, c)
    assert comparable(bundle_c) == comparable(bundle_a)
    assert records(bundle_c)[0]["organization"]["id"] == c.id
    assert [r["name"] for r in records(bundle_c) if r["type"] == "key"] == ["default"]  # C's own key only
    assert chunk_set(olive, c) == [(k, p, o, t, s, e) for k, p, o, t, s, e in chunk_set(olive, a)]
    assert len(olive.vectors(f"{c.id}:")) == len(chunk_set(olive, c))
    for conv in seeded["conversations"]:
        assert messages_of(http, c, conv) == messages_of(http, a, conv)
    windows = olive.sql("SELECT start_sequence, end_sequence, content FROM chunks WHERE kind = 'conversation' "
                        "AND parent_id = ? ORDER BY start_sequence", (cid,), org=c.id)
    lines = [(m["sequence"], m["role"], m["content"]) for m in messages_of(http, c, cid)]
    assert [tuple(w) for w in windows] == chunk_windows(lines)  # what 23 appends one by one would have made
    # found again, by keywords and by meaning
    hits = http.post("/v1/search", json={"query": "offsite Porto first week of May"}, headers=c.headers).json()["results"]
    assert hits and hits[0]["document_id"] == seeded["porto"]
    hits = http.post("/v1/search", json={"query": "replica lag orders database", "kinds": ["conversation"]},
                     headers=c.headers).json()["results"]
    assert hits and hits[0]["conversation_id"] == cid
    assert http.get(f"/v1/thoughts/{seeded['porto']}/history", headers=c.headers).json()["entries"][0]["content"] == LISBON

    # delete A: 204; its key stops at once; its database, folder, vectors and control rows are gone
    org_tables = ("documents", "chunks", "chunks_fts", "conversations", "messages", "thought_history")
    if olive.backend == "worker":  # the organization's Durable Object (no file): it holds A's rows
        assert olive.org_location(a.id) == f"org:{a.id}"
        assert all(olive.sql(f"SELECT COUNT(*) FROM {t}", org=a.id)[0][0] for t in org_tables)
    else:
        db_path = olive.org_db_paths()[a.id]
        assert db_path.exists()
    assert olive.vectors(f"{a.id}:")
    assert_error(http.delete("/v1/org", headers=a.headers), 400)  # confirm is required
    assert_error(http.delete("/v1/org", params={"confirm": c.slug}, headers=a.headers), 400, "invalid_input")
    assert http.get("/v1/org", headers=a.headers).status_code == 200
    r = http.delete("/v1/org", params={"confirm": a.slug}, headers=a.headers)
    assert r.status_code == 204, r.text
    assert_error(http.get("/v1/thoughts", headers=a.headers), 401, "unauthenticated")
    assert_error(http.get("/v1/org/export", headers=a.headers), 401)
    if olive.backend == "worker":  # the Durable Object is emptied (an object cannot be deleted, only emptied)
        assert [olive.sql(f"SELECT COUNT(*) FROM {t}", org=a.id)[0][0] for t in org_tables] == [0] * len(org_tables)
    else:
        assert not db_path.exists()
    if olive.backend == "embedded":
        assert not db_path.parent.exists()
    assert olive.vectors(f"{a.id}:") == []
    for table in ("api_keys", "memberships", "service_tokens", "llm_usage", "org_databases"):
        assert olive.sql(f"SELECT COUNT(*) FROM {table} WHERE organization_id = ?", (a.id,)) == [(0,)], table
    assert olive.sql("SELECT COUNT(*) FROM organizations WHERE id = ?", (a.id,)) == [(0,)]
    if olive.backend != "worker":  # (the Worker's route is the org_databases row, checked above)
        assert a.id not in olive.org_db_paths()
    # C is untouched
    assert http.get(f"/v1/thoughts/{seeded['porto']}", headers=c.headers).status_code == 200
    assert len(records(export(http, c))) == len(records(bundle_c))


# -- tenancy, scopes, refusals --------------------------------------------------------------------------------


def test_everything_is_scoped_to_the_callers_organization(olive, http):
    a, b = signup(olive, "scope-a"), signup(olive, "scope-b")
    capture(http, a, NOTES[0])
    capture(http, b, NOTES[1])
    settle(olive, a)
    bundle_b = export(http, b)
    assert a.id not in bundle_b.decode() and NOTES[0] not in bundle_b.decode()
    assert [r["content"] for r in records(bundle_b) if r["type"] == "thought"] == [NOTES[1]]
    before = org_rows(olive, a)
    err = assert_error(http.delete("/v1/org", params={"confirm": a.slug}, headers=b.headers), 400, "invalid_input")
    assert a.slug not in err["message"] and err["details"] == {"field": "confirm"}
    assert org_rows(olive, a) == before and http.get("/v1/org", headers=a.headers).status_code == 200
    assert http.get("/v1/org", headers=b.headers).status_code == 200  # B was not deleted either
    # another organization's slug or header does not change whose organization an admin key acts on
    assert_error(http.get("/v1/org/export", headers={**b.headers, "Memex-Organization": a.slug}), 404)


def test_read_write_keys_get_403_and_nothing_happens(olive, http):
    a = signup(olive, "scope-rw")
    capture(http, a, NOTES[2])
    rw = http.post("/v1/keys", json={"name": "rw", "scopes": ["read", "write"]}, headers=a.headers).json()["key"]
    headers = {"authorization": f"Bearer {rw}"}
    settle(olive, a)
    before = org_rows(olive, a)
    assert_error(http.get("/v1/org/export", headers=headers), 403, "forbidden")
    assert_error(http.post("/v1/org/import", content=b"{}\n", headers={**headers, **NDJSON}), 403, "forbidden")
    assert_error(http.delete("/v1/org", params={"confirm": a.slug}, headers=headers), 403, "forbidden")
    assert org_rows(olive, a) == before and http.get("/v1/org", headers=a.headers).status_code == 200


def test_import_into_a_non_empty_organization_is_409(olive, http):
    a, b = signup(olive, "full-a"), signup(olive, "full-b")
    capture(http, a, NOTES[0])
    bundle = export(http, a)
    capture(http, b, NOTES[3])
    settle(olive, b)
    before = org_rows(olive, b)
    err = assert_error(do_import(http, b, bundle), 409, "conflict")
    assert err["details"]["holds"] == ["thoughts"]
    assert org_rows(olive, b) == before
    # a conversation alone makes it non-empty too
    d = signup(olive, "full-d")
    http.post("/v1/conversations", json={"title": "x"}, headers=d.headers)
    assert_error(do_import(http, d, bundle), 409, "conflict")


def test_wrong_media_type_is_415(olive, http):
    a = signup(olive, "media")
    assert_error(http.post("/v1/org/import", content=b"{}", headers={**a.headers, "content-type": "application/json"}),
                 415, "unsupported_media_type")


def synthetic(org_id: str = "org_0000000000000000", *, thoughts: int = 150, messages: int = 40,
              message_bytes: int = 200) -> list[dict]:
    """A hand-made bundle: enough records that an import writes several batches before it reaches its end."""
    now = 1_750_000_000_000
    recs: list[dict] = [{"type": "memex.bundle", "version": 1, "exported_at": now, "schema": None,
                         "organization": {"id": org_id, "slug": "hand-made", "name": "Hand", "created_at": now},
                         "counts": {}}]
    recs += [{"type": "thought", "id": f"t{i:05d}", "content": f"Synthetic note {i} about subject {i * 7919 % 1000}.",
              "tags": ["synthetic"], "created_at": now + i, "updated_at": now + i} for i in range(thoughts)]
    recs.append({"type": "thought_history", "id": "h1", "thought_id": "t00000", "action": "merged",
                 "content": "an older note", "original_created_at": now, "original_updated_at": now, "created_at": now})
    recs.append({"type": "thought_link", "from_id": "t00001", "to_id": "t00000", "kind": "contradicts",
                 "created_at": now})
    recs.append({"type": "conversation", "id": "conv1", "message_count": messages, "created_at": now, "updated_at": now})
    filler = "x" * max(0, message_bytes - 40)
    recs += [{"type": "message", "id": f"m{i:05d}", "conversation_id": "conv1", "sequence": i + 1,
              "role": "user" if i % 2 else "assistant", "content": f"message {i} {filler} {i}", "created_at": now + i}
             for i in range(messages)]
    recs.append({"type": "membership", "email": "hand@example.com", "role": "viewer", "created_at": now})
    counts = {}
    for r in recs[1:]:
        counts[r["type"]] = counts.get(r["type"], 0) + 1
    recs.append({"type": "trailer", "counts": counts})
    return recs


def ndjson(recs: list[dict]) -> bytes:
    return b"".join(json.dumps(r).encode() + b"\n" for r in recs)


EMPTY = {"documents": 0, "chunks": 0, "chunks_fts": 0, "documents_fts": 0, "jobs": 0, "conversations": 0,
         "messages": 0, "thought_history": 0, "thought_links": 0, "tag_counts": 0, "memberships": 0,
         "service_tokens": 0}


def test_malformed_bundles_are_refused_and_leave_the_organization_empty(olive, http, caplog):
    caplog.set_level(logging.INFO, logger="memex.bundle")
    org = signup(olive, "malformed")
    good = synthetic()
    n = len(good)
    late = n - 3  # a line near the end: several batches were written by then (and must be rolled back)

    def broken(i: int, line: bytes) -> bytes:
        lines = ndjson(good).splitlines(keepends=True)
        lines[i] = line
        return b"".join(lines)

    cases = [
        (b"", 400, None, "empty"),
        (ndjson(good[1:]), 400, 1, "header"),
        (ndjson([{**good[0], "version": 2}, *good[1:]]), 400, 1, "version 2"),
        (ndjson([{**good[0], "type": "other.bundle"}, *good[1:]]), 400, 1, "header"),
        (b"not json\n" + ndjson(good[1:]), 400, 1, "JSON"),
        (broken(late, b'{"type": "message", "id": "m9", "conv\n'), 400, late + 1, "JSON"),
        (broken(late, b'{"type": "recipe", "id": "r1"}\n'), 400, late + 1, "unknown record type"),
        (broken(late, json.dumps({**good[late], "sequence": 999}).encode() + b"\n"), 400, late + 1, "sequence"),
        (broken(late, json.dumps({**good[late], "extra": 1}).encode() + b"\n"), 400, late + 1, "unknown field"),
        (broken(5, json.dumps({**good[5], "content_hash": "0" * 64}).encode() + b"\n"), 400, 6, "content_hash"),
        (broken(5, json.dumps({**good[5], "id": "t00000"}).encode() + b"\n"), 400, 6, "repeats"),
        (broken(3, json.dumps({"type": "knowledge_base", "id": "kb"}).encode() + b"\n"), 400, 4, "reserved"),
        (ndjson([good[0], *good[2:3], good[1], *good[3:]]), 400, None, None),  # fine: two thoughts swapped
        (ndjson([good[0], good[-2], *good[1:-2], good[-1]]), 400, 3, "order"),  # the membership first
        (ndjson([good[0], good[-3], *good[1:-3], *good[-2:]]), 400, 2, "must follow its conversation"),
        (ndjson(good[:-1]), 400, n - 1, "truncated"),  # no trailer
        (ndjson(good)[: len(ndjson(good)) // 2], 400, None, None),  # cut in the middle of a line
        (ndjson([*good[:-1], {"type": "trailer", "counts": {**good[-1]["counts"], "thought": 149}}]), 400, n, "counts"),
        (ndjson([*good, good[-2]]), 400, n + 1, "trailer"),  # something after the trailer
    ]
    for body, status, line, words in cases:
        if line is None and words is None and body.endswith(b"\n"):
            continue  # the swapped thoughts: valid, checked below
        r = do_import(http, org, body)
        err = assert_error(r, status)
        if line is not None:
            assert err["details"]["line"] == line, (words, err)
        if words:
            assert words.lower() in err["message"].lower(), (words, err)
        assert org_rows(olive, org) == EMPTY, (words, err)
    # the late refusals came after batches had been written: those were rolled back
    rolled = [r.getMessage() for r in caplog.records if "rolling back" in r.getMessage() and org.id in r.getMessage()]
    assert len(rolled) >= 5, rolled
    # and the organization is still empty enough to take the valid bundle
    r = do_import(http, org, ndjson([good[0], *good[2:3], good[1], *good[3:]]))
    assert r.status_code == 200, r.text
    assert r.json()["imported"]["thought"] == 150 and r.json()["imported"]["membership"] == 1
    settle(olive, org)
    assert org_rows(olive, org)["documents"] == 150


def test_a_bundle_larger_than_the_body_limit_is_streamed_in(olive, http):
    org = signup(olive, "large")
    recs = synthetic(thoughts=5, messages=150, message_bytes=60_000)
    body = ndjson(recs)
    assert len(body) > MAX_BODY_BYTES

    def pieces():  # no Content-Length: the body streams in chunks
        for i in range(0, len(body), 256 * 1024):
            yield body[i:i + 256 * 1024]

    r = http.post("/v1/org/import", content=pieces(), headers={**org.headers, **NDJSON})
    assert r.status_code == 200, r.text
    assert r.json()["imported"]["message"] == 150
    assert olive.sql("SELECT COUNT(*) FROM messages WHERE organization_id = ?", (org.id,)) == [(150,)]
    # the general limit still holds everywhere else
    other = signup(olive, "large-other")
    assert_error(http.post("/v1/thoughts", content=body[:MAX_BODY_BYTES + 10],
                           headers={**other.headers, "content-type": "application/json"}), 413)


def test_a_client_that_disconnects_mid_body_leaves_the_organization_empty(olive):
    org = signup(olive, "gone")
    body = ndjson(synthetic(thoughts=400, messages=0))

    class Gone(Exception):
        pass

    def half():
        yield body[: len(body) * 3 // 4]  # several batches' worth of thoughts
        deadline = time.monotonic() + 20
        while not org_rows(olive, org)["documents"]:  # the server has written some of them
            assert time.monotonic() < deadline
            time.sleep(0.02)
        raise Gone

    with olive.client() as c, pytest.raises((Gone, httpx.HTTPError)):
        c.post("/v1/org/import", content=half(), headers={**org.headers, **NDJSON})
    deadline = time.monotonic() + 30  # the server rolls back once it sees the disconnect
    while org_rows(olive, org) != EMPTY:
        assert time.monotonic() < deadline, org_rows(olive, org)
        time.sleep(0.05)
    with olive.client() as c:  # and it can take the whole bundle afterwards
        r = c.post("/v1/org/import", content=body, headers={**org.headers, **NDJSON})
        assert r.status_code == 200, r.text


# -- the shell --------------------------------------------------------------------------------------------


def test_cli_round_trip(tmp_path):
    server, ctx = start_live(tmp_path, embedder="hash")
    try:
        a = signup(server, "shell-a")
        with server.client() as c:
            for note in NOTES:
                capture(c, a, note)
            cid = c.post("/v1/conversations", json={"title": "t"}, headers=a.headers).json()["id"]
            c.post(f"/v1/conversations/{cid}/messages", headers=a.headers,
                   json={"messages": [{"role": "user", "content": long_message(i)} for i in range(7)]})
        settle(server, a)
    finally:
        ctx.__exit__(None, None, None)

    def memex(*args, ok=True):
        out = subprocess.run([sys.executable, "-m", "api.cli", *args, "--data-dir", str(tmp_path)], capture_output=True,
                             env={**os.environ, "MEMEX_EMBEDDER": "hash", "MEMEX_PROGRESS": "always"}, timeout=120)
        assert (out.returncode == 0) == ok, out.stderr.decode()
        return out

    bundle = tmp_path / "a.jsonl"
    done = memex("org", "export", "--org", a.slug, "-o", str(bundle), "--json")
    assert b"export " in done.stderr and b"records/s" in done.stderr  # tqdm's bar (MEMEX_PROGRESS=always)
    assert json.loads(done.stdout)["counts"]["thought"] == len(NOTES)  # the summary, the bundle in the file
    stdout_bundle = memex("org", "export", "--org", a.slug).stdout  # the bundle on stdout, the summary on stderr
    assert comparable(stdout_bundle) == comparable(bundle.read_bytes())
    memex("org", "create", "--name", "Shell C", "--slug", "shell-c")
    done = memex("org", "import", "--org", "shell-c", str(bundle), "--json")
    assert b"import shell-c" in done.stderr
    assert json.loads(done.stdout)["imported"]["message"] == 7
    again = memex("org", "import", "--org", "shell-c", str(bundle), ok=False)
    assert b"empty organization" in again.stderr
    assert comparable(memex("org", "export", "--org", "shell-c").stdout) == comparable(bundle.read_bytes())
    assert b"nothing was deleted" in memex("org", "delete", "--org", a.slug, "--confirm", "shell-c", ok=False).stderr
    assert json.loads(memex("org", "delete", "--org", a.slug, "--confirm", a.slug, "--json").stdout)["deleted"] == a.slug
    assert not (tmp_path / "orgs" / a.id).exists()
    memex("org", "export", "--org", a.slug, ok=False)
    assert not list(tmp_path.glob("*.partial"))
