"""Two organizations on one deployment: each endpoint and tool, the other's key and the other's ids.
Nothing visible, nothing changed, 404 (never 403) for the other's things."""

from __future__ import annotations

import json

import pytest

from tests.conftest import assert_error, signup
from tests.mcp_client import mcp_session

SECRET = "Project Nightingale launches on March 3rd with the quantum ledger feature."


@pytest.fixture
def pair(live):
    a, b = signup(live, "tenant-a"), signup(live, "tenant-b")
    with live.client() as c:
        tid = c.post("/v1/thoughts", json={"content": SECRET, "metadata": {"owner": "a"}}, headers=a.headers).json()["id"]
    live.wait_indexed(a.headers, tid)
    return a, b, tid


def _snapshot(live, org_id):
    return (
        live.sql("SELECT id, content, updated_at FROM documents WHERE organization_id = ? ORDER BY id", (org_id,)),
        live.sql("SELECT id, revoked_at FROM api_keys WHERE organization_id = ? ORDER BY id", (org_id,)),
        live.sql("SELECT email FROM memberships WHERE organization_id = ?", (org_id,)),
    )


def test_rest_other_orgs_ids_are_404_and_nothing_changes(live, pair, client):
    a, b, tid = pair
    before = _snapshot(live, a.id)
    assert_error(client.get(f"/v1/thoughts/{tid}", headers=b.headers), 404, "not_found")
    assert_error(client.get(f"/thought/{tid}", headers=b.headers), 404)
    assert_error(client.delete(f"/v1/thoughts/{tid}", headers=b.headers), 404)
    assert_error(client.delete(f"/thought/{tid}", headers=b.headers), 404)
    assert_error(client.delete(f"/v1/keys/{a.key_id}", headers=b.headers), 404)
    with live.client() as c:
        c.post("/v1/members", json={"email": "ann@a.example", "role": "member"}, headers=a.headers)
    before = _snapshot(live, a.id)
    assert_error(client.delete("/v1/members/ann@a.example", headers=b.headers), 404)
    assert _snapshot(live, a.id) == before
    # A's key still works after B's attempts.
    assert client.get(f"/v1/thoughts/{tid}", headers=a.headers).status_code == 200


def test_rest_listings_and_search_never_show_the_other_org(live, pair, client):
    a, b, tid = pair
    assert client.get("/v1/thoughts", params={"limit": 100}, headers=b.headers).json()["thoughts"] == []
    assert client.get("/thoughts", headers=b.headers).json()["thoughts"] == []
    for path in ("/v1/search", "/search"):
        res = client.post(path, json={"query": "Project Nightingale quantum ledger launch", "top_k": 50},
                          headers=b.headers).json()
        assert res["results"] == []
    keys_b = client.get("/v1/keys", headers=b.headers).json()["keys"]
    assert {k["id"] for k in keys_b} == {b.key_id}
    assert client.get("/v1/members", headers=b.headers).json()["members"] == []
    assert client.get("/v1/org", headers=b.headers).json()["organization"]["id"] == b.id


def test_same_content_in_two_orgs_stays_two_thoughts(live, pair, client):
    a, b, tid = pair
    r = client.post("/v1/thoughts", json={"content": SECRET}, headers=b.headers)
    assert r.status_code == 201 and r.json()["id"] != tid  # idempotency is per organization: no existence oracle
    assert client.get(f"/v1/thoughts/{tid}", headers=a.headers).json()["metadata"] == {"owner": "a"}


def test_request_bodies_cannot_name_an_organization(live, pair, client):
    a, b, _ = pair
    assert_error(client.post("/v1/thoughts", json={"content": "x", "organization_id": a.id}, headers=b.headers), 400)
    assert_error(client.post("/v1/search", json={"query": "x", "organization_id": a.id}, headers=b.headers), 400)


async def test_mcp_other_org_url_is_404_and_other_ids_are_not_found(live, pair):
    a, b, tid = pair
    with live.client() as c:
        hdr = {**b.headers, "accept": "application/json, text/event-stream"}
        init = {"jsonrpc": "2.0", "id": 1, "method": "tools/list"}
        assert_error(c.post(f"/orgs/{a.slug}/mcp", json=init, headers=hdr), 404)
    before = _snapshot(live, a.id)
    async with mcp_session(b.mcp_url, b.headers) as s:
        for tool in ("get_thought", "delete_thought"):
            res = await s.call_tool(tool, {"id": tid})
            assert res.isError and json.loads(res.content[0].text)["error"]["code"] == "not_found"
        found = await s.call_tool("semantic_search", {"query": "Nightingale quantum ledger", "top_k": 50})
        assert found.structuredContent["results"] == []
        recent = await s.call_tool("list_recent", {"limit": 100})
        assert recent.structuredContent["thoughts"] == []
    assert _snapshot(live, a.id) == before


def test_vectors_live_in_their_own_namespace(live, pair):
    a, b, tid = pair
    rows = live.vectors(f"{a.id}:")
    assert rows and not live.vector_ids(f"{b.id}:")
    assert all(ns == a.id and md["organization_id"] == a.id for _, ns, md in rows)
