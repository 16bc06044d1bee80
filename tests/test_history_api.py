"""Write-time decisions, history and links over real HTTP on loopback (REST and MCP): a server with a scripted
embedder and a scripted language model for the merge / replace / contradiction paths, and the shared live
servers (embedded and D1 + Vectorize, the real model, no language model) for the defaults and tenancy. The captures
here wait for their decisions (``"wait": true``) except where a test says it checks the worker's."""

from __future__ import annotations

import json
import time

import pytest

from api.app import create_app
from api.settings import Settings
from api.composition.backend import build_backend
from api.wiring import Memex
from tests.conftest import Live, assert_error, signup
from tests.decision_doubles import ScriptedEmbedder, ScriptedLLM, basis, near
from tests.live import serve
from tests.mcp_client import mcp_session

OLD = "The quarterly review moved to the Oslo office."
NEW = "The quarterly review is now held in the Bergen office."


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    settings = Settings(data_dir=tmp_path_factory.mktemp("decisions"), embedder="hash", signup_rate_per_hour=100_000,
                        auth_failures_per_minute=100_000, key_rate_per_minute=1_000_000, worker_poll_seconds=0.2,
                        org_rate_per_minute=1_000_000, auth_address_failures_per_minute=100_000)
    backend = build_backend(settings)
    backend.embedder = ScriptedEmbedder()
    backend.llm = ScriptedLLM()
    memex = Memex(settings, backend=backend)
    with serve(create_app(memex=memex)) as base:
        yield Live(base, memex, settings.data_dir)


def _script(server: Live, *answers):
    llm: ScriptedLLM = server.memex.backend.llm
    llm.answers[:] = list(answers)
    llm.calls.clear()
    return llm


_AXES: dict[str, int] = {}


def _pair(server: Live, tag: str, cos: float) -> tuple[str, str]:
    """Two texts whose embeddings are at cosine ``cos`` (on a fresh pair of axes)."""
    emb: ScriptedEmbedder = server.memex.backend.embedder
    i = _AXES.setdefault(tag, 2 * len(_AXES))  # a fresh pair of axes per tag: no two pairs can interfere
    return emb.set(f"{OLD} ({tag})", basis(i)), emb.set(f"{NEW} ({tag})", near(i, i + 1, cos))


def _history_rows(server: Live, org_id: str):
    return server.sql("SELECT id, thought_id, original_id, content FROM thought_history WHERE organization_id = ? ORDER BY id",
                      (org_id,))


def test_merge_history_restore_and_purge_over_rest(scripted):
    a = signup(scripted, "merge")
    old_text, new_text = _pair(scripted, "merge", 0.9)
    with scripted.client() as c:
        old = c.post("/v1/thoughts", json={"wait": True, "content": old_text}, headers=a.headers).json()
        assert old["decision"] == {"action": "created"}
        _script(scripted, {"action": "merge", "target_id": "m1",
                           "merged_content": "The quarterly review: Bergen office (was Oslo)."})
        r = c.post("/v1/thoughts", json={"wait": True, "content": new_text, "source": "chat"}, headers=a.headers)
        assert r.status_code == 201, r.text
        merged = r.json()
        assert merged["decision"]["action"] == "merged" and merged["decision"]["related_id"] == old["id"]
        assert_error(c.get(f"/v1/thoughts/{old['id']}", headers=a.headers), 404)
        detail = c.get(f"/v1/thoughts/{merged['id']}", headers=a.headers).json()
        assert detail["content"].startswith("The quarterly review: Bergen") and detail["links"] == []
        assert {(h["original_id"], h["content"]) for h in detail["history"]} == {(old["id"], old_text), (None, new_text)}
        hist = c.get(f"/v1/thoughts/{merged['id']}/history", headers=a.headers).json()
        assert hist["thought_id"] == merged["id"] and len(hist["entries"]) == 2
        incoming = next(h for h in hist["entries"] if h["original_id"] is None)
        original = next(h for h in hist["entries"] if h["original_id"] is not None)

        r = c.post(f"/v1/thoughts/{merged['id']}/history/{incoming['id']}/restore", headers=a.headers)
        assert r.status_code == 201, r.text
        restored = r.json()
        assert restored["decision"]["action"] == "created"
        assert c.get(f"/v1/thoughts/{restored['id']}", headers=a.headers).json()["content"] == new_text
        assert [h["id"] for h in c.get(f"/v1/thoughts/{merged['id']}/history",
                                       headers=a.headers).json()["entries"]] == [original["id"]]
        assert_error(c.post(f"/v1/thoughts/{merged['id']}/history/{incoming['id']}/restore", headers=a.headers), 404)

        assert c.delete(f"/v1/thoughts/{merged['id']}/history/{original['id']}", headers=a.headers).status_code == 204
        assert c.get(f"/v1/thoughts/{merged['id']}/history", headers=a.headers).json()["entries"] == []
        assert c.delete(f"/v1/thoughts/{merged['id']}/history", headers=a.headers).status_code == 204
        assert_error(c.delete(f"/v1/thoughts/{merged['id']}/history/{original['id']}", headers=a.headers), 404)


def test_replace_contradiction_and_duplicate_over_rest(scripted):
    a = signup(scripted, "replace")
    with scripted.client() as c:
        old_text, new_text = _pair(scripted, "replace", 0.9)
        old = c.post("/v1/thoughts", json={"wait": True, "content": old_text}, headers=a.headers).json()
        scripted.wait_indexed(a.headers, old["id"])
        _script(scripted, {"action": "replace", "target_id": "m1"})
        new = c.post("/v1/thoughts", json={"wait": True, "content": new_text}, headers=a.headers).json()
        assert new["decision"]["action"] == "replaced" and new["decision"]["related_id"] == old["id"]
        assert not scripted.vector_ids(f"{a.id}:") or all(
            v[2]["parent_id"] != old["id"] for v in scripted.vectors(f"{a.id}:"))
        assert [h["original_id"] for h in c.get(f"/v1/thoughts/{new['id']}/history",
                                                headers=a.headers).json()["entries"]] == [old["id"]]

        one, two = _pair(scripted, "contradiction", 0.7)
        first = c.post("/v1/thoughts", json={"wait": True, "content": one}, headers=a.headers).json()
        llm = _script(scripted, {"action": "contradiction", "conflicting_id": "m1", "reason": "different city"})
        second = c.post("/v1/thoughts", json={"wait": True, "content": two}, headers=a.headers).json()
        assert "DIRECTLY CONFLICT" in llm.prompt
        assert second["decision"] == {"action": "contradiction", "related_id": first["id"], "reason": "different city",
                                      "similarity": pytest.approx(0.7, abs=1e-3)}
        l1 = c.get(f"/v1/thoughts/{first['id']}", headers=a.headers).json()["links"]
        l2 = c.get(f"/v1/thoughts/{second['id']}", headers=a.headers).json()["links"]
        assert [(x["thought_id"], x["direction"], x["kind"]) for x in l1] == [(second["id"], "incoming", "contradicts")]
        assert [(x["thought_id"], x["direction"]) for x in l2] == [(first["id"], "outgoing")]
        assert c.delete(f"/v1/thoughts/{second['id']}", headers=a.headers).status_code == 204
        assert c.get(f"/v1/thoughts/{first['id']}", headers=a.headers).json()["links"] == []

        dup_old, dup_new = _pair(scripted, "duplicate", 0.97)
        kept = c.post("/v1/thoughts", json={"wait": True, "content": dup_old}, headers=a.headers).json()
        llm = _script(scripted)
        r = c.post("/v1/thoughts", json={"wait": True, "content": dup_new}, headers=a.headers)
        assert r.status_code == 200 and r.json()["id"] == kept["id"] and r.json()["created"] is False
        assert r.json()["decision"]["action"] == "duplicate" and llm.calls == []
        assert scripted.sql("SELECT COUNT(*) FROM documents WHERE organization_id = ? AND content = ?", (a.id, dup_new)) == [(0,)]


def test_other_orgs_history_ids_are_404_and_nothing_changes(scripted):
    a, b = signup(scripted, "hist-a"), signup(scripted, "hist-b")
    old_text, new_text = _pair(scripted, "tenancy", 0.9)
    with scripted.client() as c:
        c.post("/v1/thoughts", json={"wait": True, "content": old_text}, headers=a.headers)
        _script(scripted, {"action": "replace", "target_id": "m1"})
        tid = c.post("/v1/thoughts", json={"wait": True, "content": new_text}, headers=a.headers).json()["id"]
        entry = c.get(f"/v1/thoughts/{tid}/history", headers=a.headers).json()["entries"][0]["id"]
        before = _history_rows(scripted, a.id)
        assert len(before) == 1
        assert_error(c.get(f"/v1/thoughts/{tid}/history", headers=b.headers), 404, "not_found")
        assert_error(c.post(f"/v1/thoughts/{tid}/history/{entry}/restore", headers=b.headers), 404)
        assert_error(c.delete(f"/v1/thoughts/{tid}/history/{entry}", headers=b.headers), 404)
        assert_error(c.delete(f"/v1/thoughts/{tid}/history", headers=b.headers), 404)
        assert_error(c.get(f"/v1/thoughts/{tid}", headers=b.headers), 404)
        # B's own thought id with A's entry id is 404 too
        mine = c.post("/v1/thoughts", json={"wait": True, "content": "B's own unrelated note about tulips."},
                      headers=b.headers).json()["id"]
        assert_error(c.post(f"/v1/thoughts/{mine}/history/{entry}/restore", headers=b.headers), 404)
        assert_error(c.delete(f"/v1/thoughts/{mine}/history/{entry}", headers=b.headers), 404)
        # B's near-identical capture is never decided against A's thought
        emb: ScriptedEmbedder = scripted.memex.backend.embedder
        probe = emb.set("B writes about the review too.", near(_AXES["tenancy"] + 1, 299, 0.999))
        llm = _script(scripted)
        r = c.post("/v1/thoughts", json={"wait": True, "content": probe}, headers=b.headers)
        assert r.status_code == 201 and r.json()["decision"] == {"action": "created"} and llm.calls == []
    assert _history_rows(scripted, a.id) == before
    assert scripted.sql("SELECT COUNT(*) FROM documents WHERE organization_id = ? AND id = ?", (a.id, tid)) == [(1,)]


async def test_history_tools_over_mcp_and_their_tenancy(scripted):
    a, b = signup(scripted, "mcp-hist-a"), signup(scripted, "mcp-hist-b")
    old_text, new_text = _pair(scripted, "mcp", 0.9)
    async with mcp_session(a.mcp_url, a.headers) as s:
        names = {t.name for t in (await s.list_tools()).tools}
        assert {"thought_history", "restore_thought"} <= names
        first = await s.call_tool("capture_thought", {"wait": True, "content": old_text})
        assert first.structuredContent["decision"] == {"action": "created"}
        _script(scripted, {"action": "replace", "target_id": "m1"})
        cap = await s.call_tool("capture_thought", {"wait": True, "content": new_text})
        assert not cap.isError and cap.structuredContent["decision"]["action"] == "replaced"
        tid = cap.structuredContent["id"]
        hist = await s.call_tool("thought_history", {"id": tid})
        assert not hist.isError and len(hist.structuredContent["entries"]) == 1
        entry = hist.structuredContent["entries"][0]["id"]
    before = _history_rows(scripted, a.id)
    async with mcp_session(b.mcp_url, b.headers) as s:
        for tool, args in (("thought_history", {"id": tid}), ("restore_thought", {"id": tid, "history_id": entry})):
            res = await s.call_tool(tool, args)
            assert res.isError and json.loads(res.content[0].text)["error"]["code"] == "not_found"
    assert _history_rows(scripted, a.id) == before
    with scripted.client() as c:
        r = c.post("/v1/keys", json={"name": "reader", "scopes": ["read"]}, headers=a.headers)
        reader = {"authorization": f"Bearer {r.json()['key']}"}
    async with mcp_session(a.mcp_url, reader) as s:
        names = {t.name for t in (await s.list_tools()).tools}
        assert "thought_history" in names and "restore_thought" not in names
    async with mcp_session(a.mcp_url, a.headers) as s:
        res = await s.call_tool("restore_thought", {"id": tid, "history_id": entry})
        assert not res.isError and res.structuredContent["created"] is True
        assert res.structuredContent["decision"]["action"] == "created"
    assert _history_rows(scripted, a.id) == []


# -- the shared live servers: embedded and D1 + Vectorize, the real model, no language model ----------

def test_near_identical_capture_is_blocked_without_a_model(live, org, client):
    text = "The quarterly planning meeting is on Tuesday in room 4 with the platform team."
    first = client.post("/v1/thoughts", json={"wait": True, "content": text}, headers=org.headers).json()
    assert first["decision"] == {"action": "created"}
    r = client.post("/v1/thoughts", json={"wait": True, "content": text.rstrip(".")}, headers=org.headers)
    assert r.status_code == 200, r.text
    assert r.json()["id"] == first["id"] and r.json()["decision"]["action"] == "duplicate"
    # a changed number is not a duplicate: kept (and flagged when that close)
    r = client.post("/v1/thoughts", json={"wait": True, "content": text.replace("room 4", "room 5")}, headers=org.headers)
    assert r.status_code == 201 and r.json()["decision"]["action"] in ("flagged", "created")
    other = client.post("/v1/thoughts", json={"wait": True, "content": "Sourdough needs a ripe starter and a long cold proof."},
                        headers=org.headers)
    assert other.status_code == 201 and other.json()["decision"] == {"action": "created"}


def test_by_default_a_capture_is_answered_at_once_and_the_worker_decides(live, org, client):
    """Without "wait", a capture is acknowledged with decision "pending" (durable and keyword-searchable at once); the
    worker decides when it embeds it: a near-identical note ends in the first one's history, a different one is
    created, and each thought shows its decision."""
    text = "The quarterly budget review is on Thursday in the north conference room with finance."
    first = client.post("/v1/thoughts", json={"content": text}, headers=org.headers)
    assert first.status_code == 201 and first.json()["decision"] == {"action": "pending"}
    hit = client.post("/v1/search", json={"query": "quarterly budget review north conference room"}, headers=org.headers)
    assert first.json()["id"] in [h["document_id"] for h in hit.json()["results"]]  # keyword-searchable at once
    live.wait_indexed(org.headers, first.json()["id"])
    second = client.post("/v1/thoughts", json={"content": text.rstrip(".")}, headers=org.headers).json()
    other = client.post("/v1/thoughts", json={"content": "Sourdough needs a ripe starter and a long cold proof."},
                        headers=org.headers).json()
    assert second["decision"] == other["decision"] == {"action": "pending"}
    assert live.wait_indexed(org.headers, other["id"])["decision"] == {"action": "created"}
    deadline = time.monotonic() + 30
    while client.get(f"/v1/thoughts/{second['id']}", headers=org.headers).status_code != 404:
        assert time.monotonic() < deadline, "the near-identical capture was not decided"
        time.sleep(0.05)
    history = client.get(f"/v1/thoughts/{first.json()['id']}/history", headers=org.headers).json()["entries"]
    assert [e["content"] for e in history] == [text.rstrip(".")] and "duplicate" in history[0]["reason"]
    assert client.get(f"/v1/thoughts/{first.json()['id']}", headers=org.headers).json()["decision"] == {
        "action": "created"}


def _use_counts(live, org) -> dict[str, int]:
    return dict(live.sql("SELECT id, use_count FROM documents WHERE organization_id = ?", (org.id,)))


def _wait_uses(live, org, expected: dict[str, int]) -> dict[str, int]:
    """Uses are written in the background (coalesced, within about a second): wait for them to land."""
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        counts = _use_counts(live, org)
        if all(counts[i] >= n for i, n in expected.items()):
            return counts
        time.sleep(0.05)
    return _use_counts(live, org)


def test_explain_over_rest_adds_up_and_only_deliberate_use_counts(live, org, client):
    ids = [client.post("/v1/thoughts", json={"wait": True, "content": c}, headers=org.headers).json()["id"] for c in (
        "Lighthouse keepers logged the fog horn schedule every night.",
        "The lighthouse lens was replaced with an LED array in 2019.",
    )]
    for tid in ids:
        live.wait_indexed(org.headers, tid)  # polls GET /v1/thoughts/{id}: a fetch by id, one use however often
    assert _wait_uses(live, org, {ids[0]: 1, ids[1]: 1}) == {ids[0]: 1, ids[1]: 1}
    for _ in range(20):  # searches are not uses
        results = client.post("/v1/search", json={"query": "lighthouse fog horn", "explain": True},
                              headers=org.headers).json()["results"]
    assert {r["document_id"] for r in results} >= set(ids)
    for r in results:
        e = r["explain"]
        assert e["relevance"] * e["recency"] * e["frequency"] * e["importance"] * e["penalty"] == r["score"] == e["score"]
        assert e["uses"] == 1 and 1.0 < e["frequency"] <= 1.05
    assert client.post(f"/v1/thoughts/{ids[0]}/used", headers=org.headers).status_code == 204
    assert client.get(f"/v1/thoughts/{ids[1]}", headers=org.headers).status_code == 200  # within the hour: no new use
    counts = _wait_uses(live, org, {ids[0]: 2})
    assert counts[ids[0]] == 2 and counts[ids[1]] == 1, counts  # exactly: twenty searches added nothing
    listed = {t["id"]: t for t in client.get("/v1/thoughts?limit=5", headers=org.headers).json()["thoughts"]}
    assert listed[ids[0]]["uses"] == 2 and listed[ids[0]]["last_used_at"] > 0
    results = client.post("/v1/search", json={"query": "lighthouse fog horn", "explain": True},
                          headers=org.headers).json()["results"]
    e0 = next(r for r in results if r["document_id"] == ids[0])["explain"]
    assert e0["uses"] == 2 and e0["frequency"] <= 1.05


def test_marking_another_orgs_thought_used_is_404_and_changes_nothing(live, org, other_org, client):
    tid = client.post("/v1/thoughts", json={"wait": True, "content": "Alpha's launch checklist lives in the ops wiki."},
                      headers=org.headers).json()["id"]
    assert_error(client.post(f"/v1/thoughts/{tid}/used", headers=other_org.headers), 404)
    assert_error(client.post("/v1/thoughts/th_does_not_exist/used", headers=org.headers), 404)
    with live.client() as c:
        r = c.post("/v1/keys", json={"name": "reader", "scopes": ["read"]}, headers=org.headers)
        reader = {"authorization": f"Bearer {r.json()['key']}"}
    assert_error(client.post(f"/v1/thoughts/{tid}/used", headers=reader), 403)
    assert client.post(f"/v1/thoughts/{tid}/used", headers=org.headers).status_code == 204
    assert _wait_uses(live, org, {tid: 1})[tid] == 1  # only the owner's own mark landed


def test_history_endpoints_are_404_for_another_orgs_thought(live, org, other_org, client):
    tid = client.post("/v1/thoughts", json={"wait": True, "content": "Alpha's private note on the merger timeline."},
                      headers=org.headers).json()["id"]
    assert client.get(f"/v1/thoughts/{tid}/history", headers=org.headers).json() == {"thought_id": tid, "entries": []}
    b = other_org.headers
    assert_error(client.get(f"/v1/thoughts/{tid}/history", headers=b), 404)
    assert_error(client.post(f"/v1/thoughts/{tid}/history/hst_0000/restore", headers=b), 404)
    assert_error(client.delete(f"/v1/thoughts/{tid}/history", headers=b), 404)
    assert_error(client.delete(f"/v1/thoughts/{tid}/history/hst_0000", headers=b), 404)
    assert_error(client.post(f"/v1/thoughts/{tid}/history/hst_0000/restore", headers=org.headers), 404)
    assert client.get(f"/v1/thoughts/{tid}", headers=org.headers).json()["history"] == []
