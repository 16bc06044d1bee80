"""The tantivy keyword index of large organizations (services/adapters/keyword_index.py): it answers only when it
reflects the database exactly, and FTS5 answers otherwise, so what a search finds never depends on the index's state.

In process on the real embedded stores (the threshold lowered to one thought so that small organizations get an
index), then over HTTP with two organizations."""

from __future__ import annotations

import json
import shutil
import sqlite3
import tempfile
import time
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from api.settings import Settings
from api.wiring import Memex
from services.adapters.keyword_index import index_is_current
from services.search.search import SearchOptions
from tenancy.auth import AuthContext
from tests.conftest import backend_live, signup

FACTS = {
    "ferry": "The ferry to the island leaves from pier nine at seven every morning.",
    "badge": "Visitor badges are printed at the front desk and must be returned by six.",
    "server": "The build server reboots itself on Sunday night for kernel patches.",
    "coffee": "The coffee machine on the third floor takes oat milk cartons only.",
}


class Env:
    def __init__(self, tmp: Path, index_from: int = 1) -> None:
        self.tmp, self.index_from = tmp, index_from
        self.memex: Memex | None = None

    async def open(self) -> None:
        self.memex = Memex(Settings(data_dir=self.tmp, embedder="hash", keyword_index_from=self.index_from,
                                    run_worker=False))
        await self.memex.start(worker=False)

    async def close(self) -> None:
        await self.memex.stop()

    async def org(self, slug: str):
        org, _ = await self.memex.orgs.create(name=slug, slug=slug)
        return org

    async def svc(self, org):
        return await self.memex.for_org(AuthContext(org_id=org.id, org_slug=org.slug, principal="test",
                                                    scopes=frozenset({"admin"})))

    async def db(self, org):
        return (await self.memex.stores.open(org.id)).db

    def state(self, org) -> dict:
        return json.loads((self.memex.stores.directory(org.id) / "memex.sqlite3.keywords" / "state.json").read_text())


async def _found(svc, query: str) -> list[str]:
    res = await svc.search.search(SearchOptions(query=query, top_k=10))
    return [h.document_id for h in res.results]


@asynccontextmanager
async def opened(tmp: Path, index_from: int = 1):
    e = Env(tmp, index_from)
    await e.open()
    try:
        yield e
    finally:
        await e.close()


@pytest.fixture
async def env(tmp_path):
    async with opened(tmp_path) as e:
        yield e


async def _capture_facts(svc) -> dict[str, str]:
    return {k: (await svc.thoughts.capture(text)).id for k, text in FACTS.items()}


async def test_the_index_answers_only_when_current_and_fts5_covers_the_gap(env):
    org = await env.org("kwi-gap")
    svc = await env.svc(org)
    ids = await _capture_facts(svc)
    db = await env.db(org)
    assert await db.keyword_search(org.id, ["ferry", "pier"], 10) is None  # no index yet: FTS5 answers
    assert await _found(svc, "ferry pier") == [ids["ferry"]]
    assert await db.keyword_sync()
    hits = await db.keyword_search(org.id, ["ferry", "pier"], 10)
    assert hits is not None and [d for d, _ in hits] == [ids["ferry"]] and hits[0][1] > 0
    assert await _found(svc, "ferry pier") == [ids["ferry"]]  # now from the index
    # a capture the index has not applied: the index steps aside, and the capture is found at once
    new = (await svc.thoughts.capture("The ferry timetable changes in October for the winter season.")).id
    assert await db.keyword_search(org.id, ["ferry"], 10) is None
    assert set(await _found(svc, "ferry timetable winter")) >= {new}
    assert await db.keyword_sync()
    hits = await db.keyword_search(org.id, ["ferry"], 10)
    assert hits is not None and {d for d, _ in hits} == {ids["ferry"], new}


async def test_deletes_and_edits_reach_the_index(env):
    org = await env.org("kwi-edits")
    svc = await env.svc(org)
    ids = await _capture_facts(svc)
    db = await env.db(org)
    assert await db.keyword_sync()
    await svc.thoughts.delete(ids["badge"])
    sql = await env.memex.org_sql(org.id)
    await sql.execute("UPDATE documents SET content = ?3 WHERE organization_id = ?1 AND id = ?2",
                      [ids["coffee"], "The espresso machine on the third floor is broken until Monday."])
    assert await db.keyword_sync()
    assert await db.keyword_search(org.id, ["badges", "desk"], 10) == []
    assert await db.keyword_search(org.id, ["coffee", "oat"], 10) == []
    hits = await db.keyword_search(org.id, ["espresso"], 10)
    assert [d for d, _ in hits] == [ids["coffee"]]
    # the same words as FTS5 finds them: stems and folded diacritics
    cafe = (await svc.thoughts.capture("The Café Noir on Rue Cler serves espressos until midnight.")).id
    assert await db.keyword_sync()
    assert [d for d, _ in await db.keyword_search(org.id, ["cafe"], 10)] == [cafe]
    assert {d for d, _ in await db.keyword_search(org.id, ["espresso"], 10)} == {ids["coffee"], cafe}
    assert await _found(svc, "visitor badges front desk") == []


async def test_a_restart_opens_the_index_without_rebuilding_and_catches_up(env):
    org = await env.org("kwi-restart")
    svc = await env.svc(org)
    ids = await _capture_facts(svc)
    assert await (await env.db(org)).keyword_sync()
    before = env.state(org)
    # written while the index is not looking (it catches up only when asked or searched): the next process applies it
    await svc.thoughts.delete(ids["server"])
    await env.close()
    await env.open()
    svc = await env.svc(org)
    db = await env.db(org)
    assert await db.keyword_search(org.id, ["server", "reboots"], 10) is None  # behind by the delete
    assert await _found(svc, "build server reboots") == []
    assert await db.keyword_sync()
    after = env.state(org)
    assert after["generation"] == before["generation"]  # caught up in place, not rebuilt
    assert after["seq"] == before["seq"] + 1
    assert [d for d, _ in await db.keyword_search(org.id, ["ferry"], 10)] == [ids["ferry"]]


@pytest.mark.parametrize("damage", ["state", "elsewhere", "index", "log", "layout"])
async def test_a_damaged_state_index_or_log_means_a_rebuild_with_the_same_answers(env, damage):
    org = await env.org(f"kwi-damage-{damage}")
    svc = await env.svc(org)
    ids = await _capture_facts(svc)
    assert await (await env.db(org)).keyword_sync()
    before = env.state(org)
    root = env.memex.stores.directory(org.id) / "memex.sqlite3.keywords"
    late = (await svc.thoughts.capture("A late note about the ferry's new pier.")).id
    await env.close()
    if damage == "state":
        (root / "state.json").write_text("{not json")
    elif damage == "elsewhere":  # a state naming an index outside the index's own directory is not opened
        shutil.copytree(root / before["generation"], root.parent / "gen-9")
        (root / "state.json").write_text(json.dumps({**before, "generation": "../gen-9"}))
    elif damage == "index":
        for f in (root / before["generation"]).iterdir():
            if f.name == "meta.json":
                f.write_text("garbage")
    elif damage == "layout":  # an index an older release wrote (its state names no layout): rebuilt, not read
        (root / "state.json").write_text(json.dumps({k: v for k, v in before.items() if k != "layout"}))
    else:  # the log no longer reaches back to the index's position (as after 100,000 changes)
        with sqlite3.connect(env.memex.stores.directory(org.id) / "memex.sqlite3") as conn:
            conn.execute("DELETE FROM keyword_changes WHERE seq <= ?", (before["seq"] + 1,))
    await env.open()
    svc = await env.svc(org)
    db = await env.db(org)
    assert set(await _found(svc, "ferry pier")) == {ids["ferry"], late}  # FTS5 meanwhile
    assert await db.keyword_sync()
    assert env.state(org)["generation"] != before["generation"]
    assert [p.name for p in root.glob("gen-*")] == [env.state(org)["generation"]]  # the old generation is gone
    hits = await db.keyword_search(org.id, ["ferry", "pier"], 10)
    assert {d for d, _ in hits} == {ids["ferry"], late}


async def test_zero_turns_the_index_off(tmp_path):
    async with opened(tmp_path, index_from=0) as env:
        org = await env.org("kwi-off")
        svc = await env.svc(org)
        ids = await _capture_facts(svc)
        db = await env.db(org)
        assert not await db.keyword_sync()
        assert await db.keyword_search(org.id, ["ferry"], 10) is None
        assert await _found(svc, "ferry pier") == [ids["ferry"]]
        assert not (env.memex.stores.directory(org.id) / "memex.sqlite3.keywords").exists()


async def test_an_organization_below_the_threshold_gets_no_index(tmp_path):
    async with opened(tmp_path, index_from=5) as env:
        org = await env.org("kwi-small")
        svc = await env.svc(org)
        for text in list(FACTS.values())[:3]:
            await svc.thoughts.capture(text)
        db = await env.db(org)
        assert not await db.keyword_sync()
        assert not (env.memex.stores.directory(org.id) / "memex.sqlite3.keywords" / "state.json").exists()
        for text in list(FACTS.values())[3:] + ["One more note about the ferry.", "And the pier."]:
            await svc.thoughts.capture(text)
        assert await db.keyword_sync()  # five thoughts: indexed


def _until_current(data: Path, orgs, search, kind=None) -> None:
    """Search each organization (a search starts its index's catch-up) until every one's index is current."""
    deadline = time.monotonic() + 60
    while not all(index_is_current(data / "orgs" / org.id / "memex.sqlite3", kind) for org in orgs):
        assert time.monotonic() < deadline, "the indexes never caught up"
        for org in orgs:
            search(org)
        time.sleep(0.1)


def test_over_http_each_organization_searches_only_its_own_index():
    """Two organizations with the same words: each one's search, served by its own index once current, finds only
    its own thoughts; another organization's thought id is 404 to read or delete, and a delete stays its owner's."""
    with tempfile.TemporaryDirectory() as tmp, backend_live("embedded", Path(tmp), keyword_index_from=1) as live:
        a, b = signup(live, "kwa"), signup(live, "kwb")
        with live.client() as c:
            mine = {}
            for org, word in ((a, "alpha"), (b, "beta")):
                for i, text in enumerate(FACTS.values()):
                    r = c.post("/v1/thoughts", json={"content": f"{text} ({word} copy {i})"}, headers=org.headers)
                    assert r.status_code == 201, r.text
                    mine.setdefault(org.id, set()).add(r.json()["id"])

            def search(org, query):
                r = c.post("/v1/search", json={"query": query, "top_k": 20}, headers=org.headers)
                assert r.status_code == 200, r.text
                return {h["document_id"] for h in r.json()["results"]}

            _until_current(Path(tmp), (a, b), lambda org: search(org, "ferry pier island"))
            assert search(a, "ferry pier island") and search(a, "ferry pier island") <= mine[a.id]
            assert search(b, "ferry pier island") and search(b, "ferry pier island") <= mine[b.id]
            assert search(a, "beta") == set() and search(b, "alpha") == set()
            found = search(a, "ferry pier island")
            some_a = sorted(found)[0]
            assert c.get(f"/v1/thoughts/{some_a}", headers=b.headers).status_code == 404
            assert c.delete(f"/v1/thoughts/{some_a}", headers=b.headers).status_code == 404
            assert search(a, "ferry pier island") == found  # nothing changed for its owner
            assert c.delete(f"/v1/thoughts/{some_a}", headers=a.headers).status_code in (200, 204)
            assert search(a, "ferry pier island") == found - {some_a}  # the owner's delete: gone at once
            assert search(b, "ferry pier island") <= mine[b.id]


async def test_a_writer_held_elsewhere_leaves_fts5_answering_until_it_is_released(env):
    """Another process writing the same index (two services on one data directory): the catch-up cannot take the
    writer, searches keep finding every thought through FTS5, and the index catches up once the writer is free."""
    import gc

    import tantivy

    org = await env.org("kwi-locked")
    svc = await env.svc(org)
    ids = await _capture_facts(svc)
    db = await env.db(org)
    assert await db.keyword_sync()
    root = env.memex.stores.directory(org.id) / "memex.sqlite3.keywords"
    other = tantivy.Index.open(str(root / env.state(org)["generation"])).writer(heap_size=15_000_000, num_threads=1)
    late = (await svc.thoughts.capture("The ferry company adds a night crossing from the pier.")).id
    assert not await db.keyword_sync()
    assert set(await _found(svc, "ferry pier")) == {ids["ferry"], late}
    del other
    gc.collect()
    assert await db.keyword_sync()
    assert {d for d, _ in await db.keyword_search(org.id, ["ferry", "pier"], 10)} == {ids["ferry"], late}


async def test_a_row_of_another_organization_in_the_database_is_never_a_hit(env):
    """Defence in depth, as every statement filters on organization_id: a document row of another organization
    planted in this organization's database is indexed with its organization and never returned to this one."""
    org = await env.org("kwi-planted")
    svc = await env.svc(org)
    ids = await _capture_facts(svc)
    with sqlite3.connect(env.memex.stores.directory(org.id) / "memex.sqlite3") as conn:
        conn.execute("INSERT INTO documents (organization_id, id, content, content_hash, created_at, updated_at) "
                     "VALUES ('org_intruder', 'doc_planted', 'The ferry pier ferry pier ferry pier.', 'h', 1, 1)")
    db = await env.db(org)
    assert await db.keyword_sync()
    assert [d for d, _ in await db.keyword_search(org.id, ["ferry", "pier"], 10)] == [ids["ferry"]]
    assert [d for d, _ in await db.keyword_search("org_intruder", ["ferry", "pier"], 10)] == ["doc_planted"]
    assert await _found(svc, "ferry pier") == [ids["ferry"]]


async def test_a_hit_carries_its_own_id_whatever_its_form(env):
    """The index returns most ids from two numeric columns (32 hex digits, ``new_id``'s form) and any other id
    (an imported one, upper-case hex) from its stored text: each hit is the document's id exactly."""
    org = await env.org("kwi-ids")
    svc = await env.svc(org)
    ids = await _capture_facts(svc)
    others = {"note-1": "The ferry crew checks tickets at the pier gate.",
              "ABCDEF0123456789ABCDEF0123456789": "A spare ferry waits at the north pier in storms.",
              "0123456789abcdef0123456789abcdeg": "Pier lights on the ferry route were replaced in May."}
    with sqlite3.connect(env.memex.stores.directory(org.id) / "memex.sqlite3") as conn:
        for doc, text in others.items():
            conn.execute("INSERT INTO documents (organization_id, id, content, content_hash, created_at, updated_at) "
                         "VALUES (?, ?, ?, ?, 1, 1)", (org.id, doc, text, doc))
    db = await env.db(org)
    assert await db.keyword_sync()
    hits = await db.keyword_search(org.id, ["ferry", "pier"], 10)
    assert sorted(d for d, _ in hits) == sorted([ids["ferry"], *others])


# -- the conversation chunks' index (ChunkKeywordIndex) ----------------------------------------------------------

TALKS = {
    "ferry": ["When does the ferry to the island leave?", "From pier nine, at seven every morning."],
    "badge": ["Where do visitors get a badge?", "Badges are printed at the front desk; return them by six."],
    "coffee": ["Which milk does the coffee machine take?", "The third floor machine takes oat milk cartons only."],
}


async def _talk(svc, lines: list[str]) -> str:
    from services.conversations.models import MessageIn
    conv = await svc.conversations.create(title=lines[0])
    await svc.conversations.append(conv.id, [MessageIn(role="user" if i % 2 == 0 else "assistant", content=text)
                                             for i, text in enumerate(lines)])
    return conv.id


async def _talked(svc, query: str, **opts) -> list[str]:
    res = await svc.search.search(SearchOptions(query=query, top_k=10, kinds=("conversation",), **opts))
    return [h.conversation_id for h in res.results]


async def _chunk_hits(db, org, words: list[str]) -> set[str] | None:
    """The conversations the chunk index's hits belong to (None: it steps aside)."""
    answer = await db.keyword_search(org.id, words, 100, chunk_kinds=["conversation", "turn"])
    if answer is None:
        return None
    sql_rows = await db.execute(
        "SELECT parent_id FROM chunks WHERE pk IN (SELECT value FROM json_each(?1))", [json.dumps([pk for pk, _ in answer])])
    return {r["parent_id"] for r in sql_rows.rows}


async def test_conversation_chunks_get_an_index_that_answers_only_when_current(env):
    org = await env.org("kwi-talks")
    svc = await env.svc(org)
    convs = {k: await _talk(svc, lines) for k, lines in TALKS.items()}
    db = await env.db(org)
    assert await _chunk_hits(db, org, ["ferry", "pier"]) is None  # no index yet: chunks_fts answers
    assert (await _talked(svc, "ferry pier"))[0] == convs["ferry"]
    assert await db.keyword_sync(chunks=True)
    assert (env.memex.stores.directory(org.id) / "memex.sqlite3.chunk-keywords" / "state.json").is_file()
    assert await _chunk_hits(db, org, ["ferry", "pier"]) == {convs["ferry"]}
    assert (await _talked(svc, "ferry pier"))[0] == convs["ferry"]  # now from the index
    # a message the index has not applied: it steps aside, and the message is found at once
    from services.conversations.models import MessageIn
    await svc.conversations.append(convs["badge"], [MessageIn(role="user", content="Is the walrus exhibit open?")])
    assert await _chunk_hits(db, org, ["walrus"]) is None
    assert (await _talked(svc, "walrus exhibit"))[0] == convs["badge"]
    assert await db.keyword_sync(chunks=True)
    assert await _chunk_hits(db, org, ["walrus"]) == {convs["badge"]}
    # a deleted conversation's chunks leave the index
    await svc.conversations.delete(convs["coffee"])
    assert await db.keyword_sync(chunks=True)
    assert await _chunk_hits(db, org, ["oat", "milk", "cartons"]) == set()
    assert convs["coffee"] not in await _talked(svc, "oat milk cartons")
    # the thoughts' index is another one: a conversation is never a thought's hit
    await svc.thoughts.capture("The walrus exhibit opens in spring.")
    assert await db.keyword_sync()
    hits = await db.keyword_search(org.id, ["walrus"], 10)
    assert hits is not None and len(hits) == 1
    # the search's keyword side is the index's: with chunks_fts emptied, it still finds the words
    await db.execute("DELETE FROM chunks_fts")
    rows, _, _ = await svc.search._keyword("walrus exhibit", ["conversation", "turn"], None, 100)
    assert {r[2] for r in rows} == {convs["badge"]}


async def test_the_chunk_index_gives_the_same_conversations_as_chunks_fts(tmp_path):
    """Every query word BM25-ranked by tantivy, against FTS5's: the same conversations on top for queries one
    conversation answers; within a conversation or a time window, chunks_fts answers (their filters)."""
    found: dict[str, list[list[str]]] = {}
    for name, index_from in (("fts", 0), ("index", 1)):
        async with opened(tmp_path / name, index_from) as e:
            org = await e.org("kwi-same")
            svc = await e.svc(org)
            convs = {k: await _talk(svc, lines) for k, lines in TALKS.items()}
            if index_from:
                assert await (await e.db(org)).keyword_sync(chunks=True)
            out = []
            for q in ("ferry island pier", "visitor badge front desk", "coffee oat milk"):
                out.append([next(k for k, v in convs.items() if v == c) for c in await _talked(svc, q)][:1])
            when = int(time.time() * 1000)
            out.append(sorted({next(k for k, v in convs.items() if v == c) for c in await _talked(
                svc, "ferry pier badge desk", parent_id=convs["badge"])}))
            out.append([next(k for k, v in convs.items() if v == c) for c in await _talked(
                svc, "ferry pier", time_from=when - 3_600_000)][:1])
            found[name] = out
    assert found["fts"] == found["index"] == [["ferry"], ["badge"], ["coffee"], ["badge"], ["ferry"]]


async def test_a_damaged_chunk_index_is_rebuilt_and_an_older_database_gets_the_log(env):
    org = await env.org("kwi-talk-damage")
    svc = await env.svc(org)
    convs = {k: await _talk(svc, lines) for k, lines in TALKS.items()}
    db = await env.db(org)
    assert await db.keyword_sync(chunks=True)
    root = env.memex.stores.directory(org.id) / "memex.sqlite3.chunk-keywords"
    (root / "state.json").write_text("{not json")
    await env.close()
    await env.open()
    db = await env.db(org)
    assert await _chunk_hits(db, org, ["ferry"]) is None  # unreadable state: chunks_fts answers, the index rebuilds
    assert await db.keyword_sync(chunks=True)
    assert await _chunk_hits(db, org, ["ferry"]) == {convs["ferry"]}
    rows = (await db.execute("SELECT count(*) AS n FROM chunk_keyword_changes")).rows
    assert rows[0]["n"] > 0  # migration 0005's triggers log the conversations' chunks


def test_over_http_each_organization_searches_only_its_own_conversation_index():
    """The conversation chunks' index, two organizations with the same words: each one's conversation search, served
    by its own index once current, finds only its own conversations; another organization's conversation is 404 to
    search within or delete, and a delete stays its owner's."""
    from services.adapters.keyword_index import ChunkKeywordIndex

    with tempfile.TemporaryDirectory() as tmp, backend_live("embedded", Path(tmp), keyword_index_from=1) as live:
        a, b = signup(live, "kca"), signup(live, "kcb")
        with live.client() as c:
            mine: dict[str, set[str]] = {}
            for org, word in ((a, "alpha"), (b, "beta")):
                for key, lines in TALKS.items():
                    r = c.post("/v1/conversations", json={"title": f"{key} {word}"}, headers=org.headers)
                    assert r.status_code == 201, r.text
                    cid = r.json()["id"]
                    r = c.post(f"/v1/conversations/{cid}/messages", headers=org.headers, json={"messages": [
                        {"role": "user", "content": f"{text} ({word})"} for text in lines]})
                    assert r.status_code in (200, 201), r.text
                    mine.setdefault(org.id, set()).add(cid)

            def search(org, query, **extra):
                r = c.post("/v1/search", json={"query": query, "top_k": 20, "kinds": ["conversation"], **extra},
                           headers=org.headers)
                return r.status_code, {h["conversation_id"] for h in r.json().get("results", [])}

            _until_current(Path(tmp), (a, b), lambda org: search(org, "ferry pier island"), ChunkKeywordIndex)
            status, found = search(a, "ferry pier island")
            assert status == 200 and found and found <= mine[a.id]
            status, found_b = search(b, "ferry pier island")
            assert status == 200 and found_b and found_b <= mine[b.id]
            assert search(a, "beta")[1] == set() and search(b, "alpha")[1] == set()
            some_a = sorted(found)[0]
            assert search(b, "ferry", conversation_id=some_a)[0] == 404
            assert c.delete(f"/v1/conversations/{some_a}", headers=b.headers).status_code == 404
            assert search(a, "ferry pier island")[1] == found  # nothing changed for its owner
            assert c.delete(f"/v1/conversations/{some_a}", headers=a.headers).status_code in (200, 204)
            assert search(a, "ferry pier island")[1] == found - {some_a}  # the owner's delete: gone at once
            assert search(b, "ferry pier island")[1] == found_b
