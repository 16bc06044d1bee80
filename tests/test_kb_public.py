"""A knowledge base's published REST API (``/kb/{org}/{kb}/api/v1/``), on both backends: listing and its filters,
whole documents with their links, search and its filters, the tiers (who may read what, and the exact status
otherwise), and the HTTP rules (cache headers, ETags, HEAD, 405, CORS, 404 and 400 answers).

One organization holds a knowledge base of each visibility (tests/kb_published.py), synced from the fixture vault
(tests/kb_vault.py) with the real embedding model, so search results are what a user would get."""

from __future__ import annotations

import tempfile
from pathlib import Path

import httpx
import pytest

from tests.conftest import assert_error, error_body
from tests.kb_published import OPEN_CACHE, PRIVATE_CACHE, published_kbs
from tests.kb_vault import GROUP_OF, KEYWORDS, LINKS, PATHS_BY_ID, RELEASE_OF, STATUS_OF, TYPES_BY_ID

#: The seed's parent types (§3.4) and what each one also matches.
FAMILIES = {
    "reference": {"reference", "index", "link", "tag"},
    "resource": {"resource", "pattern", "practice", "primitive", "protocol", "playbook"},
    "story": {"story", "study", "article"},
    "data": {"data", "person", "group", "project", "place", "gathering"},
}
#: Published files the vault holds that must never become entries (unpublished, drafts, excluded folders).
NEVER_ENTRIES = {"unasked-question", "bookmark-without-publish", "draft-essay", "unfinished-idea"}
#: The fixture vault's dates (tests/kb_vault.py _DATES) as epoch ms.
MS = {"2023-09-14": 1694649600000, "2024-02-07": 1707264000000, "2024-04-30": 1714435200000}
ENDPOINTS = {"list": "/entries", "document": "/entries/tag/quorum", "search": "/search?q=quorum",
             "openapi": "/openapi.json"}
#: (caller, visibility of the knowledge base) -> status of (list, document, search, openapi); every knowledge base
#: here needs members for whole documents.
MATRIX = {
    "anonymous": {"coop": (200, 401, 200, 200), "pub": (401,) * 4, "mem": (401,) * 4, "priv": (404,) * 4},
    "other": {"coop": (200, 404, 200, 200), "pub": (200, 404, 200, 200), "mem": (404,) * 4, "priv": (404,) * 4},
    "member": {"coop": (200,) * 4, "pub": (200,) * 4, "mem": (200,) * 4, "priv": (200,) * 4},
    "revoked": {"coop": (401,) * 4, "pub": (401,) * 4, "mem": (401,) * 4, "priv": (401,) * 4},
}


@pytest.fixture(scope="module", params=["embedded", "cloudflare"])
def kb(request):
    with tempfile.TemporaryDirectory() as tmp, published_kbs(request.param, Path(tmp), embedder="local") as pub:
        yield pub


@pytest.fixture(scope="module")
def client(kb):
    with kb.live.client() as c:
        yield c


@pytest.fixture(scope="module")
def everything(kb, client) -> dict[str, dict]:
    """Every entry of the open knowledge base, as an anonymous caller lists them: id -> entry."""
    r = client.get(kb.api("coop", "/entries"), params={"limit": 100})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["total"] == len(body["entries"]) < 100
    return {e["id"]: e for e in body["entries"]}


def _ids(client, url: str, **params) -> set[str]:
    r = client.get(url, params={"limit": 100, **params})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["total"] == len(body["entries"])
    return {e["id"] for e in body["entries"]}


def _search(client, url: str, q: str, headers=None, **params) -> list[dict]:
    r = client.get(url, params={"q": q, **params}, headers=headers or {})
    assert r.status_code == 200, r.text
    assert r.json()["query"] == q
    return r.json()["results"]


# -- listing ------------------------------------------------------------------------------------------------


def test_listing_holds_every_published_entry_with_its_fields(everything):
    assert set(TYPES_BY_ID) <= set(everything)
    assert not NEVER_ENTRIES & set(everything)
    for eid, ctype in TYPES_BY_ID.items():
        e = everything[eid]
        assert (e["contentType"], e["path"], e["group"], e["status"]) == (
            ctype, PATHS_BY_ID[eid], GROUP_OF.get(eid), STATUS_OF.get(eid)), e
        assert e["title"] and e["description"] and ctype in e["tags"]
    for eid, release in RELEASE_OF.items():
        assert everything[eid]["release"] == release


def test_listing_pages_with_limit_offset_and_total(kb, client, everything):
    seen: list[str] = []
    for offset in range(0, len(everything) + 7, 7):
        r = client.get(kb.api("coop", "/entries"), params={"limit": 7, "offset": offset})
        body = r.json()
        assert (body["total"], body["limit"], body["offset"]) == (len(everything), 7, offset)
        assert len(body["entries"]) == max(0, min(7, len(everything) - offset))
        seen += [e["id"] for e in body["entries"]]
    assert sorted(seen) == sorted(everything) and len(seen) == len(set(seen))
    first = client.get(kb.api("coop", "/entries")).json()
    assert first["limit"] == 20 and first["offset"] == 0 and len(first["entries"]) == 20


@pytest.mark.parametrize("ctype", ["pattern", "tag", "question", "file"])
def test_filter_by_content_type(kb, client, everything, ctype):
    got = _ids(client, kb.api("coop", "/entries"), contentType=ctype)
    assert got == {i for i, e in everything.items() if e["contentType"] == ctype}
    assert {i for i, t in TYPES_BY_ID.items() if t == ctype} <= got and got


@pytest.mark.parametrize("parent", sorted(FAMILIES))
def test_filter_by_a_parent_type_matches_the_types_below_it(kb, client, everything, parent):
    got = _ids(client, kb.api("coop", "/entries"), contentType=parent)
    assert got == {i for i, e in everything.items() if e["contentType"] in FAMILIES[parent]}
    expected = {i for i, t in TYPES_BY_ID.items() if t in FAMILIES[parent]}
    assert expected <= got
    assert {TYPES_BY_ID[i] for i in expected} == {t for t in FAMILIES[parent] if t in TYPES_BY_ID.values()}


def test_filter_by_group_release_and_status(kb, client, everything):
    url = kb.api("coop", "/entries")
    for group in set(GROUP_OF.values()):
        got = _ids(client, url, group=group)
        assert {i for i, g in GROUP_OF.items() if g == group} <= got
        assert got == {i for i, e in everything.items() if e["group"] == group}
    assert _ids(client, url, release="water-module") == {i for i, r in RELEASE_OF.items() if r == "water-module"}
    kit = _ids(client, url, release="field-kit-2024")
    assert {i for i, r in RELEASE_OF.items() if r == "field-kit-2024"} <= kit  # the innermost release only:
    assert not kit & {i for i, r in RELEASE_OF.items() if r == "water-module"}
    for status in set(STATUS_OF.values()):
        assert _ids(client, url, status=status) == {i for i, s in STATUS_OF.items() if s == status}
    assert _ids(client, url, group="no-such-group") == set()
    both = _ids(client, url, contentType="resource", group="commons-lab")
    assert both == {i for i, t in TYPES_BY_ID.items() if t in FAMILIES["resource"] and GROUP_OF.get(i) == "commons-lab"}


def test_filter_by_tags_matches_any_of_them(kb, client, everything):
    url = kb.api("coop", "/entries")
    got = _ids(client, url, tags="treasury-guild,tag")
    assert got == {i for i, e in everything.items() if {"treasury-guild", "tag"} & set(e["tags"])}
    assert {"quorum", "reserve-fund", "dues-schedule"} <= got and "seed-library" not in got
    assert _ids(client, url, tags=" pattern ") == {i for i, e in everything.items() if "pattern" in e["tags"]}


def test_filter_by_date_range(kb, client, everything):
    url = kb.api("coop", "/entries")
    since = _ids(client, url, dateFrom="2024-04-30")
    assert since == {i for i, e in everything.items() if e["date"] is not None and e["date"] >= MS["2024-04-30"]}
    assert since and "harvest-fair" not in since  # an entry without a date is left out by a bound
    until = _ids(client, url, dateTo="2023-09-14")
    assert until == {i for i, e in everything.items() if e["date"] is not None and e["date"] <= MS["2023-09-14"]}
    assert "quorum" in until  # inclusive
    window = _ids(client, url, dateFrom="2024-02-07", dateTo="2024-04-30")
    assert window == {i for i, e in everything.items()
                      if e["date"] is not None and MS["2024-02-07"] <= e["date"] <= MS["2024-04-30"]}
    assert window == _ids(client, url, dateFrom=str(MS["2024-02-07"]), dateTo=str(MS["2024-04-30"]))  # epoch ms
    assert window == _ids(client, url, dateFrom="2024-02-07T00:00:00Z", dateTo="2024-04-30T00:00:00")


# -- documents ----------------------------------------------------------------------------------------------


def test_a_whole_document_with_its_links_and_backlinks(kb, client, everything):
    backlinks: dict[str, set[str]] = {}
    for source, targets in LINKS.items():
        for target in targets:
            backlinks.setdefault(target, set()).add(source)
    for eid in sorted(set(LINKS) | set(backlinks)):
        r = client.get(kb.api("coop", f"/entries/{TYPES_BY_ID[eid]}/{eid}"), headers=kb.member)
        assert r.status_code == 200, r.text
        doc = r.json()
        assert (doc["id"], doc["contentType"], doc["path"]) == (eid, TYPES_BY_ID[eid], PATHS_BY_ID[eid])
        assert KEYWORDS[eid] in doc["content"].lower() and doc["metadata"]["title"] == doc["title"]
        assert {x["id"] for x in doc["links"] if x["resolved"]} == LINKS.get(eid, set()), eid
        assert {x["id"] for x in doc["backlinks"]} == backlinks.get(eid, set()), eid
        for link in doc["links"]:
            if link["resolved"]:
                assert (link["contentType"], link["title"]) == (TYPES_BY_ID[link["id"]], everything[link["id"]]["title"])


def test_links_keep_their_label_and_unresolved_targets(kb, client):
    doc = client.get(kb.api("coop", "/entries/project/solar-canopy"), headers=kb.member).json()
    links = {x["id"]: x for x in doc["links"]}
    assert links["ada-okonkwo"]["label"] == "Ada" and links["ada-okonkwo"]["resolved"] is True
    ghost = links["participatory-budget-ledger"]
    assert ghost["resolved"] is False and ghost["contentType"] is None
    assert doc["metadata"]["status"] == "active" and doc["commitSha"]


def test_a_knowledge_base_is_also_reachable_by_its_id(kb, client, everything):
    kb_id = kb.kbs["coop"]["id"]
    assert _ids(client, kb.api(kb_id, "/entries")) == set(everything)
    r = client.get(kb.api(kb_id, "/entries/tag/quorum"), headers=kb.member)
    assert r.status_code == 200 and r.json()["id"] == "quorum"


# -- search -------------------------------------------------------------------------------------------------


def test_each_keyword_finds_its_entry_first(kb, client):
    misses = {}
    for eid, word in KEYWORDS.items():
        results = _search(client, kb.api("coop", "/search"), word)
        if not results or results[0]["id"] != eid:
            misses[word] = [x["id"] for x in results[:3]]
    assert misses == {}
    hit = _search(client, kb.api("coop", "/search"), "germination")[0]
    assert (hit["contentType"], hit["title"], hit["path"], hit["group"]) == (
        "pattern", "Seed Library", PATHS_BY_ID["seed-library"], "commons-lab")
    assert "germination" in hit["snippet"].lower() and "document" not in hit


# (keyword's entry, a filter that leaves it out, a filter that keeps it)
SEARCH_FILTERS = [
    ("seed-library", {"contentType": "practice"}, {"contentType": "pattern"}),
    ("seed-library", {"contentType": "story"}, {"contentType": "resource"}),
    ("seed-library", {"group": "treasury-guild"}, {"group": "commons-lab"}),
    ("soil-testing", {"release": "budget-handbook"}, {"release": "field-kit-2024"}),
    ("solar-canopy", {"status": "exploring"}, {"status": "active"}),
    ("seed-library", {"tags": "treasury-guild,larchwood"}, {"tags": "treasury-guild,pattern"}),
    ("seed-library", {"dateFrom": "2024-02-08"}, {"dateFrom": "2024-02-07"}),
    ("seed-library", {"dateTo": "2024-02-06"}, {"dateTo": "2024-02-07"}),
    ("seed-library", {"dateFrom": "2023-01-01", "dateTo": "2024-01-31"}, {"dateFrom": "2024-01-01", "dateTo": "2024-12-31"}),
]


@pytest.mark.parametrize(("eid", "out", "keep"), SEARCH_FILTERS,
                         ids=[f"{e}-{'-'.join(o)}" for e, o, _ in SEARCH_FILTERS])
def test_search_filters_exclude_and_include(kb, client, everything, eid, out, keep):
    url = kb.api("coop", "/search")
    word = KEYWORDS[eid]
    assert _search(client, url, word)[0]["id"] == eid
    left_out = _search(client, url, word, limit=20, **out)
    assert eid not in {x["id"] for x in left_out}
    kept = _search(client, url, word, limit=20, **keep)
    assert kept and kept[0]["id"] == eid
    for results, flt in ((left_out, out), (kept, keep)):
        for hit in results:
            assert _matches(everything[hit["id"]], flt), (hit["id"], flt)


def _matches(entry: dict, flt: dict) -> bool:
    ok = True
    if "contentType" in flt:
        ok &= entry["contentType"] in FAMILIES.get(flt["contentType"], {flt["contentType"]})
    for key in ("group", "release", "status"):
        if key in flt:
            ok &= entry[key] == flt[key]
    if "tags" in flt:
        ok &= bool(set(flt["tags"].split(",")) & set(entry["tags"]))
    if "dateFrom" in flt:
        ok &= entry["date"] is not None and entry["date"] >= _ms(flt["dateFrom"])
    if "dateTo" in flt:
        ok &= entry["date"] is not None and entry["date"] <= _ms(flt["dateTo"])
    return ok


def _ms(day: str) -> int:
    import datetime

    return int(datetime.datetime.fromisoformat(day).replace(tzinfo=datetime.timezone.utc).timestamp() * 1000)


def test_search_limit_is_1_to_20(kb, client):
    url = kb.api("coop", "/search")
    assert len(_search(client, url, "Larchwood cooperative notes", limit=20)) == 20
    assert len(_search(client, url, "Larchwood cooperative notes", limit=3)) == 3
    assert len(_search(client, url, "Larchwood cooperative notes")) == 5  # the default
    for bad in (0, 21, -1, "many"):
        assert_error(client.get(url, params={"q": "quorum", "limit": bad}), 400, "invalid_input")
    for q in ("", "   "):
        assert_error(client.get(url, params={"q": q}), 400, "invalid_input")
    assert_error(client.get(url), 400, "invalid_input")


# -- tiers --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("caller", sorted(MATRIX))
def test_tier_matrix(kb, client, caller):
    headers = kb.callers[caller]
    got, expected = {}, {}
    for slug, statuses in MATRIX[caller].items():
        for (name, path), status in zip(ENDPOINTS.items(), statuses, strict=True):
            r = client.get(kb.api(slug, path), headers=headers)
            got[slug, name], expected[slug, name] = r.status_code, status
            if r.status_code != 200:
                assert_error(r, r.status_code, {401: "unauthenticated", 404: "not_found"}.get(r.status_code))
    assert got == expected


def test_document_tier_below_and_above_the_visibility(kb, client):
    doc = "/entries/tag/quorum"
    assert client.get(kb.api("opendocs", doc)).status_code == 200
    assert client.get(kb.api("opendocs", doc), headers=kb.other.headers).status_code == 200
    assert_error(client.get(kb.api("pubdocs", doc)), 401, "unauthenticated")
    assert client.get(kb.api("pubdocs", doc), headers=kb.other.headers).status_code == 200
    assert client.get(kb.api("pubdocs", doc), headers=kb.member).json()["id"] == "quorum"
    # a 404 for a credential below the tier says nothing about whether the entry exists
    below = client.get(kb.api("coop", doc), headers=kb.other.headers)
    missing = client.get(kb.api("coop", "/entries/tag/no-such-term"), headers=kb.other.headers)
    assert below.status_code == missing.status_code == 404 and error_body(below) == error_body(missing)


def test_a_private_knowledge_base_does_not_exist_for_anyone_else(kb, client):
    for headers in ({}, kb.other.headers):
        for path in ENDPOINTS.values():
            private = client.get(kb.api("priv", path), headers=headers)
            unknown = client.get(kb.api("no-such-kb", path), headers=headers)
            assert private.status_code == unknown.status_code == 404
            assert error_body(private) == error_body(unknown)
        by_id = client.get(kb.api(kb.kbs["priv"]["id"], "/entries"), headers=headers)
        assert by_id.status_code == 404 and error_body(by_id) == error_body(unknown)


def test_an_admin_key_of_the_owner_reads_everything(kb, client):
    for slug in ("coop", "pub", "mem", "priv"):
        for path in ENDPOINTS.values():
            assert client.get(kb.api(slug, path), headers=kb.org.headers).status_code == 200, (slug, path)


# -- HTTP rules ---------------------------------------------------------------------------------------------


def test_cache_control_is_public_only_where_everyone_gets_the_same_answer(kb, client):
    cases = [
        ("coop", "/entries", {}, OPEN_CACHE),
        ("coop", "/search?q=quorum", kb.member, OPEN_CACHE),
        ("coop", "/openapi.json", kb.other.headers, OPEN_CACHE),
        ("coop", "/entries/tag/quorum", kb.member, PRIVATE_CACHE),  # documents need members here
        ("opendocs", "/entries/tag/quorum", {}, OPEN_CACHE),
        ("pubdocs", "/entries", {}, OPEN_CACHE),
        ("pubdocs", "/entries/tag/quorum", kb.other.headers, PRIVATE_CACHE),
        ("pub", "/entries", kb.other.headers, PRIVATE_CACHE),
        ("pub", "/search?q=quorum", kb.member, PRIVATE_CACHE),
        ("mem", "/openapi.json", kb.member, PRIVATE_CACHE),
        ("priv", "/entries", kb.member, PRIVATE_CACHE),
    ]
    for slug, path, headers, cache in cases:
        r = client.get(kb.api(slug, path), headers=headers)
        assert r.status_code == 200, (slug, path, r.text)
        assert r.headers["cache-control"] == cache, (slug, path)
        assert "authorization" in r.headers["vary"].lower()


def test_refusals_are_never_stored_by_a_shared_cache(kb, client):
    """A 401 or 404 depends on who asks (a member gets 200 at the same URL): it must not be served from a shared
    cache to someone else."""
    for slug, path, headers, status in [("pub", "/entries", {}, 401), ("priv", "/entries", {}, 404),
                                        ("mem", "/search?q=quorum", kb.other.headers, 404),
                                        ("coop", "/entries/tag/quorum", {}, 401),
                                        ("coop", "/entries", kb.revoked, 401)]:
        r = client.get(kb.api(slug, path), headers=headers)
        assert r.status_code == status
        assert r.headers.get("cache-control") == PRIVATE_CACHE, (slug, path, dict(r.headers))
        assert "authorization" in r.headers.get("vary", "").lower()


@pytest.mark.parametrize("path", ["/entries?group=commons-lab", "/entries/tag/quorum", "/search?q=germination",
                                  "/openapi.json"])
def test_etag_and_304(kb, client, path):
    url = kb.api("coop", path)
    first = client.get(url, headers=kb.member)
    etag = first.headers["etag"]
    assert first.status_code == 200 and etag.startswith('"') and etag.endswith('"') and len(etag) > 2
    assert client.get(url, headers=kb.member).headers["etag"] == etag  # the same answer, the same tag
    for sent in (etag, f"W/{etag}", f'"stale", {etag}'):
        r = client.get(url, headers={**kb.member, "if-none-match": sent})
        assert r.status_code == 304 and r.content == b"", sent
        assert r.headers["etag"] == etag and r.headers["cache-control"] == first.headers["cache-control"]
    changed = client.get(url, headers={**kb.member, "if-none-match": '"something-else"'})
    assert changed.status_code == 200 and changed.content == first.content
    head = client.head(url, headers={**kb.member, "if-none-match": etag})
    assert head.status_code == 304


def test_different_answers_have_different_etags(kb, client):
    tags = {client.get(kb.api("coop", "/entries"), params=p).headers["etag"]
            for p in ({}, {"limit": 5}, {"group": "commons-lab"}, {"contentType": "tag"})}
    assert len(tags) == 4


@pytest.mark.parametrize("path", ["/entries", "/entries/tag/quorum", "/search?q=quorum", "/openapi.json"])
def test_head_answers_like_get_without_a_body(kb, client, path):
    url = kb.api("opendocs", path)
    get, head = client.get(url), client.head(url)
    assert head.status_code == get.status_code == 200
    assert head.content == b""
    for name in ("etag", "cache-control", "content-type", "vary"):
        assert head.headers[name] == get.headers[name], name
    assert int(head.headers["content-length"]) == len(get.content)
    refused = client.head(kb.api("pub", path))
    assert refused.status_code == 401 and refused.content == b""


@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE", "PATCH"])
def test_other_methods_are_405(kb, client, method):
    for path in ENDPOINTS.values():
        for headers in ({}, kb.org.headers):
            r = client.request(method, kb.api("opendocs", path), headers=headers, json={"q": "x"})
            assert_error(r, 405, "method_not_allowed")
            allowed = {m.strip() for m in r.headers["allow"].split(",")}
            assert {"GET", "HEAD"} <= allowed and method not in allowed
    # nothing happened: the entry is still there
    assert client.get(kb.api("opendocs", "/entries/tag/quorum")).status_code == 200


@pytest.mark.parametrize("origin", ["https://docs.example.org", "http://localhost:3000", "null"])
def test_cors_from_any_origin(kb, client, origin):
    for path in ENDPOINTS.values():
        pre = client.options(kb.api("coop", path), headers={
            "origin": origin, "access-control-request-method": "GET",
            "access-control-request-headers": "authorization, if-none-match"})
        assert pre.status_code in (200, 204), pre.text
        assert pre.headers["access-control-allow-origin"] in ("*", origin)
        methods = {m.strip() for m in pre.headers["access-control-allow-methods"].split(",")}
        assert {"GET", "HEAD"} <= methods or methods == {"*"}
        allowed = pre.headers["access-control-allow-headers"].lower()
        assert "authorization" in allowed and "if-none-match" in allowed
    r = client.get(kb.api("coop", "/entries"), headers={"origin": origin})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] in ("*", origin)
    assert "etag" in r.headers["access-control-expose-headers"].lower()  # a browser script can read it
    refused = client.get(kb.api("pub", "/entries"), headers={"origin": origin})
    assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] in ("*", origin)


def test_unknown_org_kb_or_entry_is_404(kb, client):
    for url, headers in [
        ("/kb/no-such-org/coop/api/v1/entries", {}),
        ("/kb/no-such-org/coop/api/v1/entries", kb.member),
        (kb.api("no-such-kb", "/entries"), {}),
        (kb.api("no-such-kb", "/search?q=quorum"), kb.member),
        (kb.api("opendocs", "/entries/tag/no-such-term"), {}),
        (kb.api("opendocs", "/entries/pattern/quorum"), {}),  # an entry under another type
        (kb.api("opendocs", "/entries/widget/quorum"), {}),  # not a content type
        (kb.api("coop", "/entries/tag/no-such-term"), kb.member),
        (f"/kb/{kb.other.slug}/coop/api/v1/entries", {}),  # the same slug, another organization (which has none)
    ]:
        assert_error(client.get(url, headers=headers), 404, "not_found")


@pytest.mark.parametrize("params", [
    {"contentType": "widget"}, {"contentType": "Pattern"}, {"dateFrom": "2024-13-45"}, {"dateFrom": "yesterday"},
    {"dateTo": "2024-02-30"}, {"dateFrom": "²"}, {"dateTo": "1²"}, {"dateFrom": "2024-05-01", "dateTo": "2024-01-01"},
    {"dateFrom": "99999999999999999999"}, {"tags": ",".join(f"t{i}" for i in range(21))},
])
def test_bad_filter_values_are_400(kb, client, params):
    for path, extra in (("/entries", {}), ("/search", {"q": "quorum"})):
        for slug in ("coop", "priv"):
            err = assert_error(client.get(kb.api(slug, path), params={**extra, **params}, headers=kb.member), 400,
                               "invalid_input")
            assert err["message"]


def test_listing_limit_and_offset_bounds(kb, client):
    url = kb.api("coop", "/entries")
    for params in ({"limit": 0}, {"limit": 101}, {"offset": -1}, {"limit": "ten"}):
        assert_error(client.get(url, params=params), 400, "invalid_input")
    assert len(client.get(url, params={"limit": 100}).json()["entries"]) == client.get(url).json()["total"]


def test_openapi_document_of_the_public_api(kb, client, everything):
    r = client.get(kb.api("coop", "/openapi.json"))
    doc = r.json()
    assert doc["openapi"].startswith("3.")
    server = doc["servers"][0]["url"]
    assert doc["servers"] == [{"url": f"{kb.live.base_url}{kb.api('coop')}"}]
    assert set(doc["paths"]) == {"/entries", "/entries/{content_type}/{entry_id}", "/search", "/openapi.json"}
    assert all(set(item) == {"get"} for item in doc["paths"].values())
    search = {p["name"]: p for p in doc["paths"]["/search"]["get"]["parameters"]}
    assert set(search) == {"q", "contentType", "group", "release", "status", "tags", "dateFrom", "dateTo", "limit"}
    assert search["q"]["required"] is True and search["limit"]["schema"]["maximum"] == 20
    listing = {p["name"]: p for p in doc["paths"]["/entries"]["get"]["parameters"]}
    assert listing["limit"]["schema"]["maximum"] == 100 and "offset" in listing
    _assert_refs_resolve(doc, doc)
    assert "/v1/" not in r.text.replace("/api/v1", "")  # none of the management API
    # the server URL is this knowledge base: following it lists the same entries
    with httpx.Client(timeout=60) as raw:
        assert {e["id"] for e in raw.get(server + "/entries", params={"limit": 100}).json()["entries"]} == set(everything)
    by_id = client.get(kb.api(kb.kbs["mem"]["id"], "/openapi.json"), headers=kb.member).json()
    assert by_id["servers"][0]["url"].endswith((kb.api("mem"), kb.api(kb.kbs["mem"]["id"])))
    assert by_id["paths"] == doc["paths"]


def _assert_refs_resolve(node, doc) -> None:
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str):
            assert ref.startswith("#/components/schemas/") and ref.rsplit("/", 1)[1] in doc["components"]["schemas"], ref
        for value in node.values():
            _assert_refs_resolve(value, doc)
    elif isinstance(node, list):
        for value in node:
            _assert_refs_resolve(value, doc)
