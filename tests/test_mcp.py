"""The per-organization MCP endpoint, driven by the mcp SDK's client over loopback HTTP."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from tests.conftest import assert_error, signup
from tests.mcp_client import mcp_session

WRITE_TOOLS = {"capture_thought", "delete_thought"}
READ_TOOLS = {"semantic_search", "get_thought", "list_recent"}


def _key(live, org, scopes):
    with live.client() as c:
        r = c.post("/v1/keys", json={"name": f"{'-'.join(scopes)} key", "scopes": scopes}, headers=org.headers)
        assert r.status_code == 201, r.text
        return {"authorization": f"Bearer {r.json()['key']}"}


async def test_thought_tools_round_trip(live, org):
    async with mcp_session(org.mcp_url, org.headers) as s:
        tools = {t.name: t for t in (await s.list_tools()).tools}
        assert WRITE_TOOLS | READ_TOOLS <= set(tools)
        assert all(t.outputSchema and t.inputSchema["type"] == "object" for t in tools.values())

        cap = await s.call_tool("capture_thought", {"content": "The staging database password rotates every 30 days.",
                                                    "source": "mcp-test"})
        assert not cap.isError, cap.content
        tid = cap.structuredContent["id"]
        assert cap.structuredContent["created"] is True

        again = await s.call_tool("capture_thought", {"content": "The staging database password rotates every 30 days."})
        assert again.structuredContent["id"] == tid and again.structuredContent["created"] is False

        got = await s.call_tool("get_thought", {"id": tid})
        assert got.structuredContent["source"] == "mcp-test" and got.structuredContent["chunks"]

        found = await s.call_tool("semantic_search", {"query": "staging password rotation", "top_k": 5})
        assert found.structuredContent["results"][0]["document_id"] == tid

        recent = await s.call_tool("list_recent", {"limit": 5})
        assert recent.structuredContent["thoughts"][0]["id"] == tid

        gone = await s.call_tool("delete_thought", {"id": tid})
        assert gone.structuredContent == {"id": tid, "deleted": True}
        missing = await s.call_tool("get_thought", {"id": tid})
        assert missing.isError and json.loads(missing.content[0].text)["error"]["code"] == "not_found"


async def test_tool_list_follows_the_key_scopes(live, org):
    async with mcp_session(org.mcp_url, _key(live, org, ["read"])) as s:
        names = {t.name for t in (await s.list_tools()).tools}
        assert READ_TOOLS <= names and not (WRITE_TOOLS & names)
        denied = await s.call_tool("capture_thought", {"content": "should not be stored"})
        assert denied.isError
    with live.client() as c:
        assert c.post("/v1/search", json={"query": "should not be stored"}, headers=org.headers).json()["results"] == []


async def test_bad_tool_input_is_an_error_result(live, org):
    async with mcp_session(org.mcp_url, org.headers) as s:
        bad = await s.call_tool("semantic_search", {"query": "x", "top_k": 500})
        assert bad.isError
        bad = await s.call_tool("capture_thought", {"content": "x" * (256 * 1024 + 10)})
        assert bad.isError and json.loads(bad.content[0].text)["error"]["code"] == "payload_too_large"


async def test_mcp_without_org_in_url_uses_the_credential(live, org):
    url = live.base_url + "/mcp"
    async with mcp_session(url, org.headers) as s:
        cap = await s.call_tool("capture_thought", {"content": "captured through the org-less MCP URL"})
        tid = cap.structuredContent["id"]
    with live.client() as c:
        assert c.get(f"/v1/thoughts/{tid}", headers=org.headers).status_code == 200


def test_mcp_http_rules(live, org, client):
    assert_error(client.get(f"/orgs/{org.slug}/mcp", headers=org.headers), 405)
    assert_error(client.delete(f"/orgs/{org.slug}/mcp", headers=org.headers), 405)
    assert_error(client.post(f"/orgs/{org.slug}/mcp", json={}), 401)
    init = {"jsonrpc": "2.0", "id": 1, "method": "tools/list"}
    hdr = {**org.headers, "accept": "application/json, text/event-stream"}
    assert_error(client.post("/orgs/no-such-org/mcp", json=init, headers=hdr), 404)
    r = client.post(f"/orgs/{org.slug}/mcp", json=init, headers=hdr)
    assert r.status_code == 200 and r.json()["result"]["tools"]


@pytest.fixture
def guarded(tmp_path):
    from tests.conftest import start_live

    server, ctx = start_live(tmp_path, embedder="hash", mcp_allowed_hosts=["127.0.0.1:*"], mcp_allowed_origins=["http://127.0.0.1:*"])
    yield server
    ctx.__exit__(None, None, None)


def test_host_and_origin_checking_is_configurable(guarded):
    org = signup(guarded, "guard")
    init = {"jsonrpc": "2.0", "id": 1, "method": "tools/list"}
    hdr = {**org.headers, "accept": "application/json, text/event-stream"}
    with guarded.client() as c:
        assert c.post(f"/orgs/{org.slug}/mcp", json=init, headers=hdr).status_code == 200
        assert c.post(f"/orgs/{org.slug}/mcp", json=init, headers={**hdr, "origin": "https://evil.example"}).status_code == 403
        assert c.post(f"/orgs/{org.slug}/mcp", json=init, headers={**hdr, "host": "evil.example"}).status_code == 421


async def test_mark_used_counts_only_the_callers_own_thoughts(live, org, other_org):
    """mark_used: the organization's own ids are recorded; another organization's id is not_found and records
    nothing (nothing visible, nothing changed); a read-only key does not see the tool."""
    with live.client() as c:
        tid = c.post("/v1/thoughts", json={"content": "Alpha's deploy freeze starts on the 20th."},
                     headers=org.headers).json()["id"]
    async with mcp_session(other_org.mcp_url, other_org.headers) as s:
        denied = await s.call_tool("mark_used", {"ids": [tid]})
        assert denied.isError and json.loads(denied.content[0].text)["error"]["code"] == "not_found"
    async with mcp_session(org.mcp_url, _key(live, org, ["read"])) as s:
        assert "mark_used" not in {t.name for t in (await s.list_tools()).tools}
    async with mcp_session(org.mcp_url, org.headers) as s:
        done = await s.call_tool("mark_used", {"ids": [tid]})
        assert not done.isError and done.structuredContent == {"ids": [tid]}
        missing = await s.call_tool("mark_used", {"ids": [tid, "th_not_there"]})
        assert missing.isError and json.loads(missing.content[0].text)["error"]["code"] == "not_found"
    deadline = time.monotonic() + 15  # uses are written in the background, within about a second
    while live.sql("SELECT use_count FROM documents WHERE id = ?", (tid,)) != [(1,)] and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert live.sql("SELECT use_count FROM documents WHERE id = ?", (tid,)) == [(1,)]  # only the owner's one mark
