"""A knowledge base's MCP endpoint (``/kb/{org}/{kb}/mcp``) driven by the mcp SDK's client, on both backends: the
seven tools with real content, the tier errors, the four resources and three prompts, the HTTP answers for callers
who may not see the knowledge base; and the same tools on the organization's own MCP URL (``/orgs/{slug}/mcp``)
with a ``knowledge_base`` argument."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
from mcp.shared.exceptions import McpError

from tests.conftest import assert_error, error_body
from tests.kb_published import create_kb, git_vault, published_kbs, wait_synced
from tests.kb_vault import GROUP_OF, LINKS, PATHS_BY_ID, RELEASE_OF, RELEASES, TYPES_BY_ID, frontmatter
from tests.mcp_client import mcp_session

SEVEN = {"search_knowledge", "define_term", "search_lexicon", "list_groups", "list_releases", "get_document",
         "search_with_documents"}
KBS = {"coop": ("open", "members"), "pub": ("public", "members"), "mem": ("members", "members"),
       "priv": ("private", "members"), "pubdocs": ("open", "public")}
#: The other organization's only knowledge base: a two-note vault.
ALMANAC = {
    "data/concepts/frost-date.md": (frontmatter({"title": "Frost Date", "date": "2024-03-01", "description": "Last frost.",
                                                 "tags": ["garden"], "aliases": ["last frost"], "publish": True})
                                    + "\nThe day after which no frost is expected; sowing waits for it.\n").encode(),
    "data/places/north-bed.md": (frontmatter({"title": "North Bed", "date": "2024-03-02", "description": "A bed.",
                                              "tags": ["garden"], "publish": True})
                                 + "\nThe shaded bed where the rhubarb grows.\n").encode(),
}


@pytest.fixture(scope="module", params=["embedded", "cloudflare"])
def kb(request):
    with tempfile.TemporaryDirectory() as tmp, published_kbs(request.param, Path(tmp), kbs=KBS) as pub:
        almanac = git_vault(Path(tmp) / "vaults" / "almanac", ALMANAC)
        with pub.live.client() as c:
            create_kb(c, pub.other, "almanac", str(almanac.path), visibility="members")
            wait_synced(c, pub.other, ["almanac"])
        yield pub
        almanac.close()


def _error(result) -> dict:
    assert result.isError, result.content
    return json.loads(result.content[0].text)["error"]


def _text(result) -> str:
    return result.content[0].text


async def test_exactly_the_seven_tools(kb):
    async with mcp_session(kb.mcp_url("coop"), {}) as s:
        tools = {t.name: t for t in (await s.list_tools()).tools}
    assert set(tools) == SEVEN
    assert all(t.description and t.inputSchema["type"] == "object" and t.outputSchema for t in tools.values())
    assert set(tools["get_document"].inputSchema["required"]) == {"contentType", "id"}
    assert "resource" in tools["get_document"].inputSchema["properties"]["contentType"]["enum"]
    assert tools["search_knowledge"].inputSchema["required"] == ["query"]
    assert "knowledge_base" not in tools["search_knowledge"].inputSchema["properties"]


async def test_search_knowledge(kb):
    async with mcp_session(kb.mcp_url("coop"), {}) as s:
        found = await s.call_tool("search_knowledge", {"query": "germination"})
        assert not found.isError
        top = found.structuredContent["results"][0]
        assert (top["id"], top["contentType"], top["path"]) == ("seed-library", "pattern", PATHS_BY_ID["seed-library"])
        assert "document" not in top and json.loads(_text(found)) == found.structuredContent
        kept = await s.call_tool("search_knowledge", {"query": "germination",
                                                      "filters": {"contentType": "resource", "group": "commons-lab"}})
        assert kept.structuredContent["results"][0]["id"] == "seed-library"
        for flt in ({"contentType": "practice"}, {"group": "treasury-guild"}, {"tags": ["tag"]},
                    {"dateFrom": "2024-02-08"}):
            left = await s.call_tool("search_knowledge", {"query": "germination", "filters": flt})
            assert "seed-library" not in {r["id"] for r in left.structuredContent["results"]}, flt
        nitrogen = await s.call_tool("search_knowledge", {"query": "nitrogen", "filters": {"release": "field-kit-2024"}})
        assert nitrogen.structuredContent["results"][0]["id"] == "soil-testing"
        assert _error(await s.call_tool("search_knowledge", {"query": "x", "filters": {"limit": 21}}))["code"] == "invalid_input"
        bad = await s.call_tool("search_knowledge", {"query": "x", "filters": {"contentType": "widget"}})
        assert _error(bad)["code"] == "invalid_input"


async def test_define_term_by_title_or_alias(kb):
    async with mcp_session(kb.mcp_url("coop"), {}) as s:
        for term in ("Quorum", "QUORUM!", "  quorum. ", "Minimum-Attendance", "quorum threshold"):
            res = await s.call_tool("define_term", {"term": term})
            assert not res.isError and res.structuredContent["found"] is True, term
            definition = res.structuredContent["definition"]
            assert definition["id"] == "quorum" and definition["title"] == "Quorum"
            assert "abstention" in definition["definition"].lower()
            assert definition["aliases"] == ["minimum attendance", "quorum threshold"]
            assert _text(res).startswith("Quorum: ")
        for term in ("consent rounds", "seed-library", "Frost Date"):  # not a lexicon entry (or another org's)
            res = await s.call_tool("define_term", {"term": term})
            assert not res.isError and _text(res) == f'Term "{term}" not found in lexicon.'
            assert res.structuredContent == {"term": term, "found": False, "definition": None}


async def test_search_lexicon_finds_only_terms(kb):
    async with mcp_session(kb.mcp_url("coop"), {}) as s:
        res = await s.call_tool("search_lexicon", {"keyword": "abstention"})
        assert [t["id"] for t in res.structuredContent["results"]][:1] == ["quorum"]
        assert res.structuredContent["results"][0]["related_terms"] == ["consent", "supermajority"]
        tags = {i for i, t in TYPES_BY_ID.items() if t == "tag"} | {"stewardship"}
        for keyword in ("germination", "quorum", "cooperative"):
            found = (await s.call_tool("search_lexicon", {"keyword": keyword})).structuredContent["results"]
            assert {t["id"] for t in found} <= tags, keyword
        assert (await s.call_tool("search_lexicon", {"keyword": "germination"})).structuredContent["results"] == []


async def test_list_groups_and_releases(kb):
    async with mcp_session(kb.mcp_url("coop"), {}) as s:
        groups = {g["group"]: g for g in (await s.call_tool("list_groups", {})).structuredContent["groups"]}
        releases = {r["id"]: r for r in (await s.call_tool("list_releases", {})).structuredContent["releases"]}
    assert set(groups) == set(GROUP_OF.values())
    with kb.live.client() as c:
        for name, g in groups.items():
            assert g["entries"] >= sum(1 for v in GROUP_OF.values() if v == name)
            listed = c.get(kb.api("coop", "/entries"), params={"group": name}).json()["total"]
            assert g["entries"] == listed, name
    circle = groups["stewardship-circle"]  # the group that has its own entry (data/groups/)
    assert (circle["id"], circle["title"]) == ("stewardship-circle", "Stewardship Circle")
    assert {r["id"]: (r["path"], r["title"], r.get("parent")) for r in releases.values()} == {
        r["id"]: (folder, r["title"], r["parent"]) for folder, r in RELEASES.items()}
    for rid, r in releases.items():
        assert r["entries"] >= sum(1 for v in RELEASE_OF.values() if v == rid) and r["description"]


async def test_get_document_and_search_with_documents(kb):
    async with mcp_session(kb.mcp_url("coop"), kb.member) as s:
        doc = await s.call_tool("get_document", {"contentType": "tag", "id": "quorum"})
        assert not doc.isError
        body = doc.structuredContent
        assert (body["id"], body["contentType"], body["path"]) == ("quorum", "tag", PATHS_BY_ID["quorum"])
        assert "abstention" in body["content"] and body["metadata"]["aliases"]
        assert {x["id"] for x in body["links"] if x["resolved"]} == LINKS["quorum"]
        assert {x["id"] for x in body["backlinks"]} == {k for k, v in LINKS.items() if "quorum" in v}
        missing = await s.call_tool("get_document", {"contentType": "tag", "id": "no-such-term"})
        assert _error(missing)["code"] == "not_found"
        wrong_type = await s.call_tool("get_document", {"contentType": "pattern", "id": "quorum"})
        assert _error(wrong_type)["code"] == "not_found"
        found = await s.call_tool("search_with_documents", {"query": "germination", "filters": {"limit": 3}})
        assert not found.isError
        results = found.structuredContent["results"]
        assert results[0]["id"] == "seed-library" and len(results) <= 3
        assert all(r["document"]["id"] == r["id"] and r["document"]["content"] for r in results)
        assert "Germination" in results[0]["document"]["content"]


@pytest.mark.parametrize(("slug", "caller", "current", "required"), [
    ("coop", "anonymous", "open", "members"),
    ("coop", "other", "public", "members"),
    ("pub", "other", "public", "members"),
    ("pubdocs", "anonymous", "open", "public"),
])
async def test_document_tools_below_the_document_tier(kb, slug, caller, current, required):
    async with mcp_session(kb.mcp_url(slug), kb.callers[caller]) as s:
        for name, args in (("get_document", {"contentType": "tag", "id": "quorum"}),
                           ("get_document", {"contentType": "tag", "id": "no-such-term"}),
                           ("search_with_documents", {"query": "germination"})):
            res = await s.call_tool(name, args)
            assert res.isError and [c.text for c in res.content] == [f"Requires {required} access. Current: {current}."]
        # the browse tools answer the same caller
        assert (await s.call_tool("search_knowledge", {"query": "germination"})).structuredContent["results"]
        assert (await s.call_tool("define_term", {"term": "quorum"})).structuredContent["found"] is True
        assert not (await s.call_tool("list_groups", {})).isError


async def test_document_tools_at_the_document_tier(kb):
    async with mcp_session(kb.mcp_url("pubdocs"), kb.other.headers) as s:
        doc = await s.call_tool("get_document", {"contentType": "tag", "id": "quorum"})
        assert not doc.isError and doc.structuredContent["id"] == "quorum"
    async with mcp_session(kb.mcp_url("priv"), kb.member) as s:
        found = await s.call_tool("search_with_documents", {"query": "germination"})
        assert found.structuredContent["results"][0]["document"]["id"] == "seed-library"


async def test_resources(kb):
    base = f"mcp://{kb.org.slug}/coop"
    async with mcp_session(kb.mcp_url("coop"), {}) as s:
        listed = {str(r.uri): r for r in (await s.list_resources()).resources}
        assert set(listed) == {f"{base}/prompts/knowledge-search", f"{base}/data/ontology", f"{base}/data/groups",
                               f"{base}/data/releases"}
        contents = {}
        for uri, res in listed.items():
            got = (await s.read_resource(uri)).contents
            assert len(got) == 1 and got[0].mimeType == res.mimeType
            contents[uri.rsplit("/", 1)[1]] = got[0].text
        groups = (await s.call_tool("list_groups", {})).structuredContent["groups"]
        releases = (await s.call_tool("list_releases", {})).structuredContent["releases"]
        for uri in (f"{base}/data/nothing", f"mcp://{kb.org.slug}/pub/data/groups", "mcp://elsewhere/coop/data/groups",
                    "https://example.org/"):
            with pytest.raises(McpError):
                await s.read_resource(uri)
    prompt = contents["knowledge-search"]
    assert listed[f"{base}/prompts/knowledge-search"].mimeType == "text/plain"
    assert "coop" in prompt and "search_knowledge" in prompt and "define_term" in prompt
    ontology = json.loads(contents["ontology"])
    assert len(ontology["content_types"]) == 21 and "resource" in ontology["content_types"]
    assert set(ontology["hierarchy"]["resource"]) == {"pattern", "practice", "primitive", "protocol", "playbook"}
    assert json.loads(contents["groups"]) == groups
    assert json.loads(contents["releases"]) == releases
    # the URIs are stable: the same through the knowledge base's id in the endpoint's URL
    async with mcp_session(kb.mcp_url(kb.kbs["coop"]["id"]), {}) as s:
        assert {str(r.uri) for r in (await s.list_resources()).resources} == set(listed)
        assert json.loads((await s.read_resource(f"{base}/data/groups")).contents[0].text) == groups


async def test_prompts(kb):
    async with mcp_session(kb.mcp_url("coop"), {}) as s:
        prompts = {p.name: p for p in (await s.list_prompts()).prompts}
        assert {n: [(a.name, a.required) for a in p.arguments] for n, p in prompts.items()} == {
            "research-topic": [("topic", True), ("depth", False)],
            "explain-pattern": [("pattern", True)],
            "compare-practices": [("practice1", True), ("practice2", True)],
        }
        shallow = await s.get_prompt("research-topic", {"topic": "seed swaps"})
        deep = await s.get_prompt("research-topic", {"topic": "seed swaps", "depth": "deep"})
        explain = await s.get_prompt("explain-pattern", {"pattern": "Rotating Facilitation"})
        compare = await s.get_prompt("compare-practices", {"practice1": "consent rounds", "practice2": "majority vote"})
        for got in (shallow, deep, explain, compare):
            assert len(got.messages) == 1 and got.messages[0].role == "user"
        text = {name: got.messages[0].content.text for name, got in
                (("shallow", shallow), ("deep", deep), ("explain", explain), ("compare", compare))}
        assert '"seed swaps"' in text["shallow"] and '"seed swaps"' in text["deep"] and text["shallow"] != text["deep"]
        assert "comprehensive" in text["deep"] and "brief" in text["shallow"]
        assert '"Rotating Facilitation"' in text["explain"]
        assert '"consent rounds"' in text["compare"] and '"majority vote"' in text["compare"]
        assert all("coop" in t for t in text.values())
        for name, args in (("research-topic", {}), ("research-topic", {"depth": "deep"}), ("explain-pattern", {}),
                           ("compare-practices", {"practice1": "a"}), ("research-topic", {"topic": "x", "depth": "huge"}),
                           ("no-such-prompt", {"topic": "x"})):
            with pytest.raises(McpError):
                await s.get_prompt(name, args)


def test_who_may_reach_the_endpoint(kb):
    """Below the knowledge base's visibility the endpoint itself answers over HTTP: 401 without a credential, 404
    with one; a private knowledge base is 404 for everyone else, as if it did not exist."""
    init = {"jsonrpc": "2.0", "id": 1, "method": "tools/list"}
    accept = {"accept": "application/json, text/event-stream"}
    cases = [("priv", "anonymous", 404), ("priv", "other", 404), ("priv", "revoked", 401), ("priv", "member", 200),
             ("mem", "anonymous", 401), ("mem", "other", 404), ("mem", "member", 200),
             ("pub", "anonymous", 401), ("pub", "other", 200), ("coop", "anonymous", 200), ("coop", "revoked", 401)]
    with kb.live.client() as c:
        unknown = c.post(f"/kb/{kb.org.slug}/no-such-kb/mcp", json=init, headers={**accept, **kb.other.headers})
        for slug, caller, status in cases:
            r = c.post(f"/kb/{kb.org.slug}/{slug}/mcp", json=init, headers={**accept, **kb.callers[caller]})
            if status == 200:
                assert r.status_code == 200 and {t["name"] for t in r.json()["result"]["tools"]} == SEVEN, (slug, caller)
            else:
                assert_error(r, status, {401: "unauthenticated", 404: "not_found"}[status])
        for caller in ("anonymous", "other"):
            private = c.post(f"/kb/{kb.org.slug}/priv/mcp", json=init, headers={**accept, **kb.callers[caller]})
            assert error_body(private) == error_body(unknown)
        assert_error(c.get(f"/kb/{kb.org.slug}/coop/mcp"), 405)


async def test_the_organizations_mcp_url_names_the_knowledge_base(kb):
    async with mcp_session(kb.org.mcp_url, kb.member) as s:
        tools = {t.name: t for t in (await s.list_tools()).tools}
        assert SEVEN | {"list_knowledge_bases"} <= set(tools)
        for name in SEVEN:
            schema = tools[name].inputSchema
            assert "knowledge_base" in schema["properties"] and "knowledge_base" not in schema["required"], name
        listed = (await s.call_tool("list_knowledge_bases", {})).structuredContent["knowledge_bases"]
        assert {x["slug"] for x in listed} == set(KBS)
        unnamed = _error(await s.call_tool("define_term", {"term": "quorum"}))
        assert unnamed["code"] == "invalid_input" and sorted(unnamed["details"]["knowledge_bases"]) == sorted(KBS)
        for ref in ("priv", kb.kbs["priv"]["id"], "coop"):
            res = await s.call_tool("define_term", {"term": "quorum", "knowledge_base": ref})
            assert res.structuredContent["definition"]["id"] == "quorum", ref
        doc = await s.call_tool("get_document", {"knowledge_base": "coop", "contentType": "tag", "id": "quorum"})
        assert doc.structuredContent["id"] == "quorum" and doc.structuredContent["backlinks"]
        found = await s.call_tool("search_with_documents", {"knowledge_base": "mem", "query": "germination"})
        assert found.structuredContent["results"][0]["document"]["id"] == "seed-library"
        groups = await s.call_tool("list_groups", {"knowledge_base": "pub"})
        assert {g["group"] for g in groups.structuredContent["groups"]} == set(GROUP_OF.values())
        missing = await s.call_tool("define_term", {"term": "quorum", "knowledge_base": "no-such-kb"})
        assert _error(missing)["code"] == "not_found"


async def test_with_one_knowledge_base_the_argument_is_optional(kb):
    async with mcp_session(kb.other.mcp_url, kb.other.headers) as s:
        listed = (await s.call_tool("list_knowledge_bases", {})).structuredContent["knowledge_bases"]
        assert [x["slug"] for x in listed] == ["almanac"]
        term = await s.call_tool("define_term", {"term": "Last Frost"})
        assert term.structuredContent["definition"]["id"] == "frost-date"
        found = await s.call_tool("search_knowledge", {"query": "rhubarb"})
        assert [r["id"] for r in found.structuredContent["results"]][:1] == ["north-bed"]
        assert (await s.call_tool("define_term", {"term": "quorum"})).structuredContent["found"] is False
        for ref in ("coop", kb.kbs["coop"]["id"], "priv"):  # the other organization's knowledge bases
            res = await s.call_tool("define_term", {"term": "quorum", "knowledge_base": ref})
            assert _error(res)["code"] == "not_found", ref
