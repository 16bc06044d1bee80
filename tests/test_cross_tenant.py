"""Two organizations on one deployment: each endpoint and tool, the other's key and the other's ids.
Nothing visible, nothing changed, 404 (never 403) for the other's things."""

from __future__ import annotations

import io
import json
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from api.webhooks import signature
from tests.conftest import assert_error, backend_live, error_body, signup
from tests.kb_published import create_kb, git_vault, wait_synced
from tests.kb_vault import BROKEN_YAML_FILE
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


# -- knowledge bases ------------------------------------------------------------------------------------------

KB_BRANCH = "release-candidate-7"  # a branch A's "broken" knowledge base follows and its repository lacks
KB_SEVEN = ("search_knowledge", "define_term", "search_lexicon", "list_groups", "list_releases", "get_document",
            "search_with_documents")


@dataclass
class KbTenants:
    live: object
    a: object
    b: object
    #: A's knowledge bases (slug -> as GET showed it once synced): handbook (git, private, synced with per-file
    #: errors), broken (git, its sync failed), drop (an upload target); B's only one is notes.
    kbs: dict
    secret: str
    vault: str


@pytest.fixture(scope="module", params=["embedded", "cloudflare"])
def kbt(request):
    """Two organizations with knowledge bases on a fresh service (git sources from local paths need the
    deployment's kb_local_roots), once per backend."""
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        with backend_live(request.param, tmp, kb_local_roots=[str(tmp / "vaults")]) as server:
            vault = git_vault(tmp / "vaults" / "handbook")
            notes = git_vault(tmp / "vaults" / "notes", {"data/concepts/tithe.md": (
                "---\ntitle: Tithe\npublish: true\ndate: 2024-01-01\n---\n\nA tenth, set aside.\n").encode()})
            a, b = signup(server, "kb-tenant-a"), signup(server, "kb-tenant-b")
            with server.client() as c:
                create_kb(c, a, "broken", str(vault.path), branch=KB_BRANCH)
                create_kb(c, b, "notes", str(notes.path))
                # handbook's sync and embedding wake the organization while broken's failed sync waits for its
                # retries: they must still come (services/jobs/worker.py keeps a retry until its time has passed)
                created = create_kb(c, a, "handbook", str(vault.path))
                r = c.post("/v1/knowledge-bases", json={"slug": "drop", "source": {"type": "upload"}}, headers=a.headers)
                assert r.status_code == 201, r.text
                kbs = {**wait_synced(c, a, ["broken"], state="failed"), **wait_synced(c, a, ["handbook"])}
                kbs["drop"] = c.get("/v1/knowledge-bases/drop", headers=a.headers).json()
                wait_synced(c, b, ["notes"])
            yield KbTenants(server, a, b, kbs, created["webhook_secret"], str(vault.path))
            vault.close()
            notes.close()


def _kb_snapshot(live, org_id):
    return (
        live.sql("SELECT id, slug, name, visibility, document_tier, source, source_token, ontology, webhook_secret, "
                 "last_commit, updated_at FROM knowledge_bases WHERE organization_id = ? ORDER BY id", (org_id,)),
        live.sql("SELECT id, kb_id, state, trigger, full, error FROM knowledge_syncs WHERE organization_id = ? ORDER BY id",
                 (org_id,)),
        live.sql("SELECT kb_id, id, content_type, title, body FROM knowledge_entries WHERE organization_id = ? "
                 "ORDER BY kb_id, id", (org_id,)),
        live.sql("SELECT COUNT(*) FROM knowledge_uploads WHERE organization_id = ?", (org_id,)),
        live.sql("SELECT COUNT(*) FROM chunks WHERE organization_id = ? AND kind = 'knowledge'", (org_id,)),
    )


def _zip(files: dict[str, str]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
    return buf.getvalue()


def test_kb_management_by_another_org_is_404_and_changes_nothing(kbt):
    a, b, live = kbt.a, kbt.b, kbt.live
    before = _kb_snapshot(live, a.id)
    archive = _zip({"data/concepts/planted.md": "---\ntitle: Planted\npublish: true\ndate: 2024-01-01\n---\n\nB was here.\n"})
    with live.client() as c:
        syncs = {slug: (kb["last_sync"] or {}).get("id") for slug, kb in kbt.kbs.items()}
        for slug, kb in kbt.kbs.items():
            for ref in (slug, kb["id"]):
                base = f"/v1/knowledge-bases/{ref}"
                assert_error(c.get(base, headers=b.headers), 404, "not_found")
                assert_error(c.get(f"{base}/syncs", headers=b.headers), 404, "not_found")
                if syncs[slug]:
                    assert_error(c.get(f"{base}/syncs/{syncs[slug]}", headers=b.headers), 404, "not_found")
                    # B's own knowledge base with A's sync id
                    assert_error(c.get(f"/v1/knowledge-bases/notes/syncs/{syncs[slug]}", headers=b.headers), 404)
                assert_error(c.patch(base, json={"name": "taken", "visibility": "open", "document_tier": "open",
                                                 "slug": "taken"}, headers=b.headers), 404, "not_found")
                assert_error(c.post(f"{base}/sync", json={"full": True}, headers=b.headers), 404, "not_found")
                assert_error(c.post(f"{base}/import", content=archive,
                                    headers={**b.headers, "content-type": "application/zip"}), 404, "not_found")
                assert_error(c.post(f"{base}/webhook-secret", headers=b.headers), 404, "not_found")
                assert_error(c.delete(base, headers=b.headers), 404, "not_found")
        assert [x["slug"] for x in c.get("/v1/knowledge-bases", headers=b.headers).json()["knowledge_bases"]] == ["notes"]
        # A's knowledge bases are as they were: read back by A, and the webhook secret B tried to rotate still signs
        for slug, kb in kbt.kbs.items():
            mine = c.get(f"/v1/knowledge-bases/{slug}", headers=a.headers).json()
            assert {k: mine[k] for k in ("id", "name", "visibility", "document_tier", "entries", "chunks")} == {
                k: kb[k] for k in ("id", "name", "visibility", "document_tier", "entries", "chunks")}
            assert (mine["last_sync"] or {}).get("id") == syncs[slug]
        body = b'{"zen": "Keep it logically awesome."}'
        ping = c.post(f"/hooks/github/{kbt.kbs['handbook']['id']}", content=body, headers={
            "x-github-event": "ping", "x-hub-signature-256": signature(kbt.secret, body), "content-type": "application/json"})
        assert ping.status_code == 200 and ping.json()["status"] == "pong"
    assert _kb_snapshot(live, a.id) == before
    assert live.sql("SELECT COUNT(*) FROM knowledge_entries WHERE organization_id = ? AND id = 'planted'", (b.id,)) == [(0,)]


def test_kb_private_published_surfaces_do_not_exist_for_another_org(kbt):
    a, b = kbt.a, kbt.b
    init = {"jsonrpc": "2.0", "id": 1, "method": "tools/list"}
    accept = {"accept": "application/json, text/event-stream"}
    with kbt.live.client() as c:
        for ref in ("handbook", kbt.kbs["handbook"]["id"]):
            for path in ("/entries", "/entries/tag/quorum", "/search?q=quorum", "/openapi.json"):
                mine = c.get(f"/kb/{a.slug}/{ref}/api/v1{path}", headers=a.headers)
                assert mine.status_code == 200, (ref, path)
                theirs = c.get(f"/kb/{a.slug}/{ref}/api/v1{path}", headers=b.headers)
                nothing = c.get(f"/kb/{a.slug}/no-such-kb/api/v1{path}", headers=b.headers)
                assert_error(theirs, 404, "not_found")
                assert error_body(theirs) == error_body(nothing)
            assert c.post(f"/kb/{a.slug}/{ref}/mcp", json=init, headers={**accept, **a.headers}).status_code == 200
            assert_error(c.post(f"/kb/{a.slug}/{ref}/mcp", json=init, headers={**accept, **b.headers}), 404, "not_found")
        # B's slug with A's knowledge base id: each organization's URL holds its own knowledge bases only
        assert_error(c.get(f"/kb/{b.slug}/{kbt.kbs['handbook']['id']}/api/v1/entries", headers=b.headers), 404)


async def test_kb_tools_on_the_org_mcp_cannot_name_another_orgs_knowledge_base(kbt):
    a, b = kbt.a, kbt.b
    before = _kb_snapshot(kbt.live, a.id)
    args = {"search_knowledge": {"query": "germination"}, "define_term": {"term": "quorum"},
            "search_lexicon": {"keyword": "quorum"}, "list_groups": {}, "list_releases": {},
            "get_document": {"contentType": "tag", "id": "quorum"}, "search_with_documents": {"query": "germination"}}
    async with mcp_session(b.mcp_url, b.headers) as s:
        for tool in KB_SEVEN:
            for ref in ("handbook", kbt.kbs["handbook"]["id"], "broken", kbt.kbs["drop"]["id"]):
                res = await s.call_tool(tool, {**args[tool], "knowledge_base": ref})
                assert res.isError and json.loads(res.content[0].text)["error"]["code"] == "not_found", (tool, ref)
        listed = (await s.call_tool("list_knowledge_bases", {})).structuredContent["knowledge_bases"]
        assert [x["slug"] for x in listed] == ["notes"]
        own = await s.call_tool("define_term", {"term": "quorum"})  # B's only knowledge base, not A's
        assert own.structuredContent["found"] is False
        assert (await s.call_tool("define_term", {"term": "tithe"})).structuredContent["found"] is True
    async with mcp_session(a.mcp_url, a.headers) as s:  # the same calls work for A
        res = await s.call_tool("get_document", {**args["get_document"], "knowledge_base": "handbook"})
        assert res.structuredContent["id"] == "quorum"
    assert _kb_snapshot(kbt.live, a.id) == before


def test_kb_sync_errors_are_never_visible_to_another_org(kbt):
    a, b = kbt.a, kbt.b
    broken, handbook = kbt.kbs["broken"], kbt.kbs["handbook"]
    secrets = {broken["last_sync"]["error"], KB_BRANCH, kbt.vault, broken["id"], handbook["id"], kbt.kbs["drop"]["id"],
               broken["last_sync"]["id"], handbook["last_sync"]["id"], BROKEN_YAML_FILE}
    assert KB_BRANCH in broken["last_sync"]["error"]
    seen = []
    with kbt.live.client() as c:
        detail = c.get(f"/v1/knowledge-bases/handbook/syncs/{handbook['last_sync']['id']}", headers=a.headers).json()
        assert BROKEN_YAML_FILE in {e["path"] for e in detail["errors"]}  # A sees its per-file errors
        assert c.get("/v1/knowledge-bases/broken/syncs", headers=a.headers).json()["syncs"][0]["error"]
        for path in ("/v1/knowledge-bases", "/v1/knowledge-bases/notes", "/v1/knowledge-bases/notes/syncs",
                     f"/v1/knowledge-bases/broken/syncs/{broken['last_sync']['id']}",
                     f"/v1/knowledge-bases/{broken['id']}/syncs", f"/v1/knowledge-bases/{handbook['id']}",
                     f"/kb/{a.slug}/broken/api/v1/entries", f"/kb/{a.slug}/handbook/api/v1/search?q=yaml"):
            seen.append(c.get(path, headers=b.headers).text)
        notes_sync = c.get("/v1/knowledge-bases/notes", headers=b.headers).json()["last_sync"]["id"]
        seen.append(c.get(f"/v1/knowledge-bases/notes/syncs/{notes_sync}", headers=b.headers).text)
    leaked = {s for s in secrets for text in seen if s in text}
    assert leaked == set()
