"""Knowledge base syncs, end to end through the running service on both backends (embedded, and D1 + Vectorize on the
Cloudflare emulator): a generated vault in a git repository (tests/kb_vault.py) synced in full, then incrementally
(add, modify, rename, delete), after a force-push, after a crash mid-sync; GitHub's webhook; archive uploads (and the
archives refused); every filter on both sides of the hybrid search; and a deletion that leaves nothing behind."""

from __future__ import annotations

import hashlib
import hmac
import io
import json
import tarfile
import tempfile
import time
import uuid
import zipfile
from pathlib import Path

import httpx
import pytest

from services.adapters.cloudflare.vectorize import INDEXED_PROPERTIES
from services.search.indexing import KNOWLEDGE_FIELDS
from tests.conftest import assert_error, backend_live, signup
from tests.kb_vault import (
    BROKEN_YAML_FILE, GROUP_OF, HUGE_FILE, KEYWORDS, LATIN1_FILE, RELEASE_OF, STATUS_OF, TYPES_BY_ID, UNRESOLVED_LINKS,
    PATHS_BY_ID, GitVault, frontmatter, vault_files,
)

#: What the fixture vault becomes: every valid entry, plus the files kept with a warning (an alias type, a dropped
#: invalid field) and the first of the two files sharing an id (in path order).
KEPT = {**TYPES_BY_ID, "stewardship": "tag", "harvest-fair": "gathering", "broken-url-link": "link", "shared-name": "pattern"}
FAILED = {BROKEN_YAML_FILE: "malformed YAML", HUGE_FILE: "larger than 1 MiB", LATIN1_FILE: "not UTF-8",
          "docs/commons-lab/shared-name.md": "duplicate id 'shared-name'"}
SKIPPED = {"data/questions/unasked-question.md", "data/links/bookmark-without-publish.md",
           "data/stories/articles/draft-essay.md"}


@pytest.fixture(scope="module", params=["embedded", "cloudflare"])
def kb_live(request):
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "vaults").mkdir()
        with backend_live(request.param, root, kb_local_roots=[str(root / "vaults")], kb_allow_http=True) as server:
            server.vaults = root / "vaults"
            yield server


def admin(live) -> tuple[httpx.Client, object]:
    org = signup(live, "kb")
    return live.client(headers=org.headers), org


def new_vault(live, files=None) -> GitVault:
    vault = GitVault(live.vaults / uuid.uuid4().hex[:8])
    vault.write(vault_files() if files is None else files)
    vault.commit("first")
    return vault


def create(c: httpx.Client, vault: GitVault, slug: str = "coop", **extra) -> dict:
    r = c.post("/v1/knowledge-bases", json={"slug": slug, "visibility": "open", "document_tier": "open",
                                            "source": {"type": "git", "url": str(vault.path)}, **extra})
    assert r.status_code == 201, r.text
    return r.json()


def settled(c: httpx.Client, kb: str, sync_id: str | None = None, timeout: float = 90.0) -> dict:
    """The knowledge base once its sync (the newest, or ``sync_id``) finished and every chunk is searchable."""
    deadline = time.monotonic() + timeout
    while True:
        view = c.get(f"/v1/knowledge-bases/{kb}").json()
        last = view["last_sync"]
        done = last is not None and last["state"] in ("succeeded", "failed") and (sync_id is None or last["id"] == sync_id)
        if done and view["chunks"] == view["chunks_searchable"]:
            return view
        assert time.monotonic() < deadline, view
        time.sleep(0.1)


def detail(c: httpx.Client, kb: str, sync_id: str) -> dict:
    r = c.get(f"/v1/knowledge-bases/{kb}/syncs/{sync_id}")
    assert r.status_code == 200, r.text
    return r.json()


def sync(c: httpx.Client, kb: str, **body) -> dict:
    r = c.post(f"/v1/knowledge-bases/{kb}/sync", json=body or None)
    assert r.status_code == 202, r.text
    settled(c, kb, r.json()["id"])
    return detail(c, kb, r.json()["id"])


def entries(c: httpx.Client, org, kb: str = "coop", **params) -> dict[str, dict]:
    out, offset = {}, 0
    while True:
        page = c.get(f"/kb/{org.slug}/{kb}/api/v1/entries", params={**params, "limit": 100, "offset": offset}).json()
        out.update({e["id"]: e for e in page["entries"]})
        offset += 100
        if offset >= page["total"]:
            return out


def chunk_state(live, org) -> dict[str, tuple]:
    """Each knowledge chunk's id -> (its entry's path, content, when it was embedded): what re-embedding changes."""
    rows = live.sql("SELECT c.id, e.path, c.content, c.indexed_at FROM chunks c JOIN knowledge_entries e "
                    "ON e.uid = c.parent_id WHERE c.kind = 'knowledge' AND c.organization_id = ?", (org.id,))
    return {r[0]: (r[1], r[2], r[3]) for r in rows}


def search_ids(c: httpx.Client, org, q: str, kb: str = "coop", **params) -> list[str]:
    r = c.get(f"/kb/{org.slug}/{kb}/api/v1/search", params={"q": q, "limit": 20, **params})
    assert r.status_code == 200, r.text
    return [h["id"] for h in r.json()["results"]]


# -- a full sync --------------------------------------------------------------------------------------------


def test_the_vector_metadata_indexes_cover_every_knowledge_filter():
    """Vectorize filters only on properties indexed before a vector is written: `memex cloudflare check --fix` (and the
    emulator's provisioning) creates one for each field the knowledge search filters on."""
    assert KNOWLEDGE_FIELDS.items() <= INDEXED_PROPERTIES.items()
    assert len(INDEXED_PROPERTIES) <= 10  # Vectorize's limit per index


def test_a_full_sync_turns_the_vault_into_entries_and_reports_every_file(kb_live):
    c, org = admin(kb_live)
    vault = new_vault(kb_live)
    created = create(c, vault)
    assert created["webhook_secret"] and created["sync"]["state"] in ("queued", "running", "succeeded")
    view = settled(c, "coop")
    s = detail(c, "coop", view["last_sync"]["id"])
    assert s["state"] == "succeeded" and s["mode"] == "full" and s["commit"] == vault.head()
    assert s["counts"] == {"added": len(KEPT), "updated": 0, "deleted": 0, "unchanged": 0, "skipped": len(SKIPPED),
                           "failed": len(FAILED)}
    assert {e["path"]: e["reason"] for e in s["errors"]}.keys() == FAILED.keys()
    for e in s["errors"]:
        assert FAILED[e["path"]] in e["reason"], e
    assert {x["path"] for x in s["skipped"]} == SKIPPED
    assert {(w["path"], w["field"]) for w in s["warnings"]} >= {
        ("data/gatherings/harvest-fair.md", "date"), ("data/links/broken-url-link.md", "url")}
    assert sorted((u["path"], u["target"]) for u in s["unresolved_links"]) == sorted(UNRESOLVED_LINKS)

    found = entries(c, org)
    assert {i: e["contentType"] for i, e in found.items()} == KEPT
    assert all(found[i]["group"] == g for i, g in GROUP_OF.items() if i in found)
    assert all(found[i]["status"] == st for i, st in STATUS_OF.items() if i in found)
    assert all(found[i]["release"] == r for i, r in RELEASE_OF.items() if i in found)
    # nothing from drafts/, dot-folders or attachments
    assert not any(e["path"].startswith(("drafts/", ".obsidian/", "attachments/")) for e in found.values())
    assert view["entries"] == len(KEPT) and view["chunks"] == view["chunks_searchable"] > 0
    # every chunk keyword-searchable and in the index, with the filterable fields in its vector's metadata
    vectors = {vid.split(":", 1)[1]: md for vid, ns, md in kb_live.vectors(org.id + ":")}
    chunks = chunk_state(kb_live, org)
    assert set(chunks) <= set(vectors)
    md = next(md for md in vectors.values() if md.get("kind") == "knowledge" and md.get("group"))
    assert md["kb"] == created["id"] and md["contentType"] in KEPT.values() and isinstance(md["date"], int)
    for entry_id, word in list(KEYWORDS.items())[:5]:
        if entry_id in KEPT:
            assert search_ids(c, org, word)[0] == entry_id


def test_an_unchanged_repository_syncs_without_embedding_anything(kb_live):
    c, org = admin(kb_live)
    create(c, new_vault(kb_live))
    settled(c, "coop")
    before = chunk_state(kb_live, org)
    for body in ({}, {"full": True}):
        s = sync(c, "coop", **body)
        assert s["state"] == "succeeded"
        assert s["counts"]["added"] == s["counts"]["updated"] == s["counts"]["deleted"] == 0
        assert chunk_state(kb_live, org) == before  # the same chunks, embedded at the same time: nothing redone
    assert s["mode"] == "full" and s["counts"]["unchanged"] >= len(KEPT)


def test_incremental_sync_applies_adds_modifies_renames_and_deletes(kb_live):
    c, org = admin(kb_live)
    vault = new_vault(kb_live)
    create(c, vault)
    settled(c, "coop")
    before = chunk_state(kb_live, org)
    first = vault.head()
    fresh = frontmatter({"title": "Seed Vault Rota", "publish": True, "date": "2024-07-01", "tags": ["seeds"]})
    quorum = vault_files()[PATHS_BY_ID["quorum"]]
    quorum = quorum if isinstance(quorum, str) else quorum.decode()
    vault.write({"data/resources/practices/seed-vault-rota.md": fresh + "Who opens the zyxqwv seed vault each week.\n",
                 PATHS_BY_ID["quorum"]: quorum + "\nQuorum is now plumbtrine.\n",
                 PATHS_BY_ID["consent-rounds"]: None})
    vault.rename("data/places/larchwood-valley.md", "data/places/larchwood-vale.md")
    vault.commit("second")
    s = sync(c, "coop")
    assert s["mode"] == "incremental" and s["base_commit"] == first and s["commit"] == vault.head()
    # a rename is a delete and an add (the entry id follows the file name)
    assert s["counts"]["added"] == 2 and s["counts"]["updated"] == 1 and s["counts"]["deleted"] == 2
    found = entries(c, org)
    assert "seed-vault-rota" in found and "larchwood-vale" in found
    assert "consent-rounds" not in found and "larchwood-valley" not in found
    assert search_ids(c, org, "zyxqwv")[0] == "seed-vault-rota" and search_ids(c, org, "plumbtrine")[0] == "quorum"
    after = chunk_state(kb_live, org)
    changed = {"data/resources/practices/seed-vault-rota.md", PATHS_BY_ID["quorum"], "data/places/larchwood-vale.md"}
    removed = {PATHS_BY_ID["consent-rounds"], PATHS_BY_ID["larchwood-valley"]}
    # every other entry kept its chunks and vectors: not re-embedded
    assert {k: v for k, v in after.items() if v[0] not in changed} == {
        k: v for k, v in before.items() if v[0] not in changed | removed}
    # the vectors of the deleted entries and of the modified one's old chunks are gone from the index
    gone = {k for k, v in before.items() if v[0] in removed | {PATHS_BY_ID["quorum"]}}
    assert gone and not gone & {v.split(":", 1)[1] for v in kb_live.vector_ids(org.id + ":")}
    # quorum's link to the deleted entry is unresolved now
    assert (PATHS_BY_ID["quorum"], "consent-rounds") in {(u["path"], u["target"]) for u in s["unresolved_links"]}


def test_a_force_push_falls_back_to_a_full_comparison(kb_live):
    c, org = admin(kb_live)
    vault = new_vault(kb_live)
    base = vault.head()
    vault.write({"data/concepts/ephemeral-term.md": frontmatter({"title": "Ephemeral", "publish": True,
                                                                "date": "2024-01-01"}) + "Gone after the force-push.\n"})
    vault.commit("to be rewritten")
    create(c, vault)
    settled(c, "coop")
    assert "ephemeral-term" in entries(c, org)
    vault.reset_hard(base)  # history rewritten: the synced commit is no ancestor of the new head
    vault.write({"data/concepts/rewritten-term.md": frontmatter({"title": "Rewritten", "publish": True,
                                                                "date": "2024-01-02"}) + "After the force-push.\n"})
    vault.commit("rewritten")
    s = sync(c, "coop")
    assert s["mode"] == "full" and s["commit"] == vault.head()
    assert s["counts"]["added"] == 1 and s["counts"]["deleted"] == 1 and s["counts"]["updated"] == 0
    found = entries(c, org)
    assert "rewritten-term" in found and "ephemeral-term" not in found and set(found) == set(KEPT) | {"rewritten-term"}


def test_a_sync_interrupted_mid_way_resumes_and_converges(kb_live, monkeypatch):
    """A crash between two batches (the job's process dies; its lease expires and the job runs again): the second
    run goes on from the files the first did not record, and the knowledge base ends as a clean sync leaves it."""
    import services.knowledge.sync as sync_module

    c, org = admin(kb_live)
    vault = new_vault(kb_live)
    monkeypatch.setattr(sync_module, "BATCH_FILES", 5)
    prepared: list[str] = []
    real_prepare = sync_module.prepare

    def counting(path, *args, **kwargs):
        prepared.append(path)
        return real_prepare(path, *args, **kwargs)

    monkeypatch.setattr(sync_module, "prepare", counting)
    real_apply = sync_module.Syncer._apply
    calls = {"n": 0}

    async def crashing(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("the process died here")
        return await real_apply(self, *args, **kwargs)

    monkeypatch.setattr(sync_module.Syncer, "_apply", crashing)
    create(c, vault)
    view = settled(c, "coop", timeout=120)
    s = detail(c, "coop", view["last_sync"]["id"])
    assert calls["n"] > 3 and s["state"] == "succeeded"
    # the two batches applied before the crash were not prepared again
    assert len(prepared) == len(set(prepared))
    assert s["counts"]["added"] == len(KEPT) and s["counts"]["failed"] == len(FAILED)
    assert {i: e["contentType"] for i, e in entries(c, org).items()} == KEPT
    assert kb_live.sql("SELECT COUNT(*) FROM knowledge_sync_files WHERE sync_id = ?", (s["id"],))[0][0] == s["files_done"]


# -- the webhook ---------------------------------------------------------------------------------------------


def _push(c: httpx.Client, kb_id: str, secret: str | None, payload: dict, *, event: str = "push",
          delivery: str | None = None, signature: str | None = None) -> httpx.Response:
    body = json.dumps(payload).encode()
    headers = {"content-type": "application/json", "x-github-event": event,
               "x-github-delivery": delivery or str(uuid.uuid4())}
    if signature is not None:
        headers["x-hub-signature-256"] = signature
    elif secret is not None:
        headers["x-hub-signature-256"] = "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()
    return c.post(f"/hooks/github/{kb_id}", content=body, headers=headers)


def test_a_signed_push_webhook_syncs_the_change_within_seconds(kb_live):
    c, org = admin(kb_live)
    vault = new_vault(kb_live)
    kb = create(c, vault)
    settled(c, "coop")
    anon = kb_live.client()
    kb_id, secret = kb["id"], kb["webhook_secret"]
    push = {"ref": "refs/heads/main", "after": "0" * 40, "commits": []}
    # signatures: missing, wrong, signed with another secret: 401, nothing queued
    syncs_before = len(c.get("/v1/knowledge-bases/coop/syncs").json()["syncs"])
    assert_error(_push(anon, kb_id, None, push), 401)
    assert_error(_push(anon, kb_id, None, push, signature="sha256=" + "0" * 64), 401)
    assert_error(_push(anon, kb_id, "not-the-secret", push), 401)
    assert_error(_push(anon, "kb_0000000000000000", secret, push), 404)
    assert len(c.get("/v1/knowledge-bases/coop/syncs").json()["syncs"]) == syncs_before
    # ping, another event, another branch
    r = _push(anon, kb_id, secret, {"zen": "Keep it logically awesome."}, event="ping")
    assert r.status_code == 200 and r.json()["status"] == "pong"
    r = _push(anon, kb_id, secret, {}, event="issues")
    assert r.status_code == 200 and r.json()["status"] == "ignored"
    r = _push(anon, kb_id, secret, {**push, "ref": "refs/heads/feature"})
    assert r.status_code == 200 and r.json()["status"] == "ignored" and "refs/heads/main" in r.json()["reason"]
    # a push: the change shows within seconds
    vault.write({"data/concepts/new-term.md": frontmatter({"title": "Gloamrest", "publish": True, "date": "2024-08-01"})
                 + "The gloamrest is the quiet hour after the assembly.\n"})
    vault.commit("add a term")
    started = time.monotonic()
    r = _push(anon, kb_id, secret, {**push, "after": vault.head()}, delivery="delivery-1")
    assert r.status_code == 202 and r.json()["status"] == "queued"
    view = settled(c, "coop", r.json()["sync_id"])
    assert view["last_sync"]["mode"] == "incremental" and view["last_commit"] == vault.head()
    assert search_ids(c, org, "gloamrest")[0] == "new-term"
    assert time.monotonic() - started < 30
    # a redelivery queues nothing
    r = _push(anon, kb_id, secret, {**push, "after": vault.head()}, delivery="delivery-1")
    assert r.status_code == 200 and r.json()["status"] == "duplicate"
    assert len(c.get("/v1/knowledge-bases/coop/syncs").json()["syncs"]) == syncs_before + 1
    # a rotated secret: the old one stops at once
    rotated = c.post("/v1/knowledge-bases/coop/webhook-secret").json()["webhook_secret"]
    assert_error(_push(anon, kb_id, secret, push), 401)
    assert _push(anon, kb_id, rotated, push).status_code == 202


# -- uploads -------------------------------------------------------------------------------------------------


def _zip(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in files.items():
            z.writestr(name, data)
    return buf.getvalue()


def _targz(files: dict[str, bytes], *, link: str | None = None) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as t:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
        if link:
            info = tarfile.TarInfo(link)
            info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
            t.addfile(info)
    return buf.getvalue()


def test_an_uploaded_vault_syncs_and_a_new_upload_replaces_it(kb_live):
    c, org = admin(kb_live)
    r = c.post("/v1/knowledge-bases", json={"slug": "up", "visibility": "open", "source": {"type": "upload"}})
    assert r.status_code == 201 and r.json()["sync"] is None
    files = {f"vault-main/{p}": (d if isinstance(d, bytes) else d.encode()) for p, d in vault_files().items()}
    r = c.post("/v1/knowledge-bases/up/import", content=_zip(files), headers={"content-type": "application/zip"})
    assert r.status_code == 202, r.text
    settled(c, "up", r.json()["id"])
    s = detail(c, "up", r.json()["id"])
    assert s["trigger"] == "import" and s["counts"]["added"] == len(KEPT) and s["counts"]["failed"] == len(FAILED)
    assert set(entries(c, org, "up")) == set(KEPT)
    assert kb_live.sql("SELECT COUNT(*) FROM knowledge_uploads", (), org=org.id)[0][0] == 0  # staging cleared
    # a second upload, as a .tar.gz, without two files: they are deleted, the rest unchanged
    smaller = {p: (d if isinstance(d, bytes) else d.encode()) for p, d in vault_files().items()
               if p not in (PATHS_BY_ID["quorum"], PATHS_BY_ID["consent-rounds"])}
    r = c.post("/v1/knowledge-bases/up/import", content=_targz(smaller), headers={"content-type": "application/gzip"})
    assert r.status_code == 202
    settled(c, "up", r.json()["id"])
    s = detail(c, "up", r.json()["id"])
    assert s["counts"]["deleted"] == 2 and s["counts"]["added"] == 0 and s["counts"]["unchanged"] >= len(KEPT) - 2
    # a git knowledge base takes no archive
    create(c, new_vault(kb_live), slug="gitkb")
    assert_error(c.post("/v1/knowledge-bases/gitkb/import", content=_zip({"a.md": b"x"})), 409)


@pytest.mark.parametrize("attack,status,reason", [
    ("zip_slip", 400, "path_traversal"), ("absolute", 400, "absolute_path"), ("symlink", 400, "link"),
    ("not_archive", 400, "not_an_archive"), ("bomb", 413, "bomb"),
])
def test_a_refused_archive_applies_nothing(kb_live, attack, status, reason):
    c, org = admin(kb_live)
    c.post("/v1/knowledge-bases", json={"slug": "up", "source": {"type": "upload"}})
    good = {"data/concepts/fine.md": frontmatter({"title": "Fine", "publish": True, "date": "2024-01-01"}).encode() + b"ok"}
    body = {
        "zip_slip": lambda: _zip({**good, "../../evil.md": b"x"}),
        "absolute": lambda: _targz({**good, "/etc/evil.md": b"x"}),
        "symlink": lambda: _targz(good, link="data/concepts/link.md"),
        "not_archive": lambda: b"just some bytes, not an archive",
        "bomb": lambda: _zip({**good, "zeros.md": b"\0" * (64 * 1024 * 1024)}),
    }[attack]()
    err = assert_error(c.post("/v1/knowledge-bases/up/import", content=body), status)
    assert err["details"]["reason"] == reason
    assert c.get("/v1/knowledge-bases/up/syncs").json()["syncs"] == []
    assert kb_live.sql("SELECT COUNT(*) FROM knowledge_uploads", (), org=org.id)[0][0] == 0
    assert kb_live.sql("SELECT COUNT(*) FROM knowledge_entries", (), org=org.id)[0][0] == 0


def test_an_archive_may_be_up_to_64_mib_where_other_bodies_stop_at_8():
    from api.limits import MAX_ARCHIVE_BYTES, MAX_BODY_BYTES, body_limit

    assert body_limit({"method": "POST", "path": "/v1/knowledge-bases/coop/import"}) == MAX_ARCHIVE_BYTES == 64 << 20
    assert body_limit({"method": "POST", "path": "/v1/knowledge-bases/coop/sync"}) == MAX_BODY_BYTES


# -- filters on both sides ------------------------------------------------------------------------------------


def test_every_filter_applies_to_both_sides_of_the_search(kb_live):
    """A word only one entry holds finds it through the keyword side and the vector side alike; a filter that excludes
    the entry must remove it from both (either side alone would bring it back), one that includes it keeps it."""
    c, org = admin(kb_live)
    create(c, new_vault(kb_live))
    settled(c, "coop")
    found = entries(c, org)
    checked = 0
    for entry_id, word in KEYWORDS.items():
        e = found.get(entry_id)
        if e is None or not (e["group"] and e["tags"] and e["date"]):
            continue
        day = time.strftime("%Y-%m-%d", time.gmtime(e["date"] / 1000))
        before = time.strftime("%Y-%m-%d", time.gmtime(e["date"] / 1000 - 86400))
        keeps = [{"contentType": e["contentType"]}, {"group": e["group"]}, {"tags": e["tags"][0]},
                 {"dateFrom": day, "dateTo": day}]
        drops = [{"contentType": "person" if e["contentType"] != "person" else "place"}, {"group": "no-such-group"},
                 {"tags": "no-such-tag"}, {"dateTo": before}]
        if e["release"]:
            keeps.append({"release": e["release"]})
            drops.append({"release": "no-such-release"})
        if e["status"]:
            keeps.append({"status": e["status"]})
            drops.append({"status": "no-such-status"})
        assert entry_id in search_ids(c, org, word)
        for params in keeps:
            assert entry_id in search_ids(c, org, word, **params), params
        for params in drops:
            assert entry_id not in search_ids(c, org, word, **params), params
        checked += 1
    assert checked >= 3
    # a parent type matches the types below it
    resource_hits = search_ids(c, org, "pattern practice protocol playbook primitive", contentType="resource")
    assert resource_hits and all(found[i]["contentType"] in ("resource", "pattern", "practice", "primitive", "protocol",
                                                            "playbook") for i in resource_hits)


@pytest.mark.parametrize("side", ["keyword", "vector"])
def test_each_side_filters_on_its_own(kb_live, side):
    """The two candidate lists, read separately (a second service instance on the same stores): each honours every
    filter on its own."""
    import asyncio

    from api.wiring import Memex
    from services.knowledge.entries import Filters
    from tenancy.models import AuthContext

    c, org = admin(kb_live)
    create(c, new_vault(kb_live))
    settled(c, "coop")
    found = entries(c, org)
    entry_id, e = next((i, e) for i, e in found.items() if e["group"] and e["tags"] and e["date"] and i in KEYWORDS)
    other_type = "person" if e["contentType"] != "person" else "place"
    cases = [(Filters(), True), (Filters(content_type=e["contentType"]), True), (Filters(content_type=other_type), False),
             (Filters(group=e["group"]), True), (Filters(group="nope"), False), (Filters(tags=(e["tags"][0],)), True),
             (Filters(tags=("nope",)), False), (Filters(date_from=e["date"], date_to=e["date"]), True),
             (Filters(date_to=e["date"] - 1), False)]

    async def run() -> list[bool]:
        memex = Memex(kb_live.memex.settings.with_(run_worker=False))
        await memex.start(worker=False)
        try:
            ctx = AuthContext(org.id, org.slug, f"key:{org.key_id}", frozenset({"read"}), org.key_id)
            knowledge = (await memex.for_org(ctx)).knowledge
            reader = await knowledge.reader("coop")
            search = knowledge.search(reader)
            out = []
            for flt, _ in cases:
                rows, _ = await (search._keyword(KEYWORDS[entry_id], flt) if side == "keyword"
                                 else search._vector(KEYWORDS[entry_id], flt))
                by_uid = await reader.rows_by_uid([r[2] for r in rows])
                out.append(entry_id in {by_uid[r[2]]["id"] for r in rows if r[2] in by_uid})
            return out
        finally:
            await memex.stop()

    assert asyncio.run(run()) == [expected for _, expected in cases]


# -- deletion ---------------------------------------------------------------------------------------------------


def test_deleting_a_knowledge_base_leaves_nothing_behind(kb_live):
    c, org = admin(kb_live)
    vault = new_vault(kb_live)
    kb = create(c, vault)
    settled(c, "coop")
    c.post("/v1/knowledge-bases/coop/sync")  # a sync queued when it goes
    chunk_ids = set(chunk_state(kb_live, org))
    assert chunk_ids
    r = c.delete("/v1/knowledge-bases/coop")
    assert r.status_code == 204
    assert_error(c.get("/v1/knowledge-bases/coop"), 404)
    assert_error(c.get(f"/kb/{org.slug}/coop/api/v1/entries"), 404)
    for table in ("knowledge_bases", "knowledge_entries", "knowledge_links", "knowledge_files", "knowledge_syncs",
                  "knowledge_sync_files", "knowledge_uploads", "knowledge_deliveries", "vector_gc"):
        assert kb_live.sql(f"SELECT COUNT(*) FROM {table}", (), org=org.id)[0][0] == 0, table
    assert kb_live.sql("SELECT COUNT(*) FROM chunks WHERE kind = 'knowledge'", (), org=org.id)[0][0] == 0
    assert kb_live.sql("SELECT COUNT(*) FROM jobs WHERE kind IN ('kb_sync', 'kb_embed') AND state = 'pending'",
                       (), org=org.id)[0][0] == 0
    assert kb_live.sql("SELECT COUNT(*) FROM knowledge_base_routes WHERE id = ?", (kb["id"],))[0][0] == 0
    time.sleep(0.3)  # a job that was mid-flight has finished
    left = {v.split(":", 1)[1] for v in kb_live.vector_ids(org.id + ":")}
    assert not chunk_ids & left
    assert not (kb_live.memex.knowledge_config.cache_root / org.id / kb["id"]).exists()
    assert_error(_push(kb_live.client(), kb["id"], kb["webhook_secret"], {"ref": "refs/heads/main"}), 404)


# -- the second stage ------------------------------------------------------------------------------------------


def test_with_a_reranker_the_candidates_are_reranked_and_the_result_cached(tmp_path):
    """MEMEX_RERANKER=workers-ai (bge-reranker-base, on the emulator): the first candidates are rescored on their title,
    description and passage and come back in the reranker's order with its score; the same query over the same
    candidates within the hour costs no second model call (the seed's rerank cache)."""
    from tests.cloudflare_emulator.ai import rerank_score

    (tmp_path / "vaults").mkdir()
    with backend_live("cloudflare", tmp_path, kb_local_roots=[str(tmp_path / "vaults")], reranker="workers-ai") as live:
        live.vaults = tmp_path / "vaults"
        c, org = admin(live)
        create(c, new_vault(live))
        settled(c, "coop")
        query = "how does the circle rotate the facilitator role"
        before = live.emulator.counters_snapshot()["by_op"]
        hits = c.get(f"/kb/{org.slug}/coop/api/v1/search", params={"q": query, "limit": 10}).json()["results"]
        after = live.emulator.counters_snapshot()["by_op"]
        reranks = {op: n - before.get(op, 0) for op, n in after.items() if "rerank" in op and n != before.get(op, 0)}
        assert sum(reranks.values()) == 1, after
        scores = [h["rerankScore"] for h in hits]
        assert hits and all(s is not None for s in scores) and scores == sorted(scores, reverse=True)
        for h in hits:  # each score is the model's for the hit's title, description and passage
            passage = "\n".join(p for p in (h["title"], h.get("description"), h["snippet"]) if p)[:2000]
            assert h["rerankScore"] == pytest.approx(rerank_score(query, passage), abs=1e-5)
        again = c.get(f"/kb/{org.slug}/coop/api/v1/search", params={"q": query, "limit": 10}).json()["results"]
        assert [h["id"] for h in again] == [h["id"] for h in hits]
        final = live.emulator.counters_snapshot()["by_op"]
        assert {op: n for op, n in final.items() if "rerank" in op} == {op: n for op, n in after.items() if "rerank" in op}


def test_a_hit_shows_the_passage_that_holds_the_query_words(kb_live):
    """A long entry whose only mention of the query's word is in a late passage: the hit is found and shows that
    passage (not the passage nearest by meaning), and the relevance floor judges the entry by it."""
    c, org = admin(kb_live)
    filler = "\n\n".join(f"Paragraph {i} on the orchard's pruning calendar, grafting, mulch and the cider press rota. "
                         "The stewards walk the rows each autumn and note the trees that need care. " * 3
                         for i in range(12))
    vault = new_vault(kb_live, {"data/resources/practices/orchard-care.md":
                                frontmatter({"title": "Orchard care", "publish": True, "date": "2024-05-05"})
                                + filler + "\n\nThe old quillwort hedge marks the northern boundary.\n"})
    create(c, vault)
    view = settled(c, "coop")
    assert view["chunks"] > 2  # the word sits in a late chunk
    r = c.get(f"/kb/{org.slug}/coop/api/v1/search", params={"q": "quillwort"}).json()["results"]
    assert [h["id"] for h in r] == ["orchard-care"] and "quillwort" in r[0]["snippet"]
