"""Enrichment (summary, tags, importance), the LLM adapters, the per-organization LLM budget and the two-pass
backfill.

Most tests run the real app on loopback with the hash embedder and a scripted LLM (a test double of the
``LLM`` port, steered by ``llm-*:`` lines in the note); the Workers AI adapter runs against the Cloudflare
emulator's scriptable llama, the OpenAI-compatible adapter against a fake chat-completions server on loopback.
"""

from __future__ import annotations

import asyncio
import io
import json
import re
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest

from api.enrichment_cli import backfill_enrich_org
from api.settings import Settings
from api.wiring import Memex
from services.adapters.llm import OpenAICompatibleLLM, WorkersAIRerankerPort, parse_json_content
from services.adapters.sqlite import SqliteDatabase
from services.errors import BackendError
from services.enrichment.llm_budget import BudgetedLLM, BudgetExceeded, LLMBudget
from services.storage.migrate import CONTROL_DIR, apply_pending
from services.ports import ChatMessage, LLMResult
from services.storage.scoped import OrgSql, OrgVectors
from services.enrichment.tagging import (
    canonical_tags, clip, extractive_summary, heuristic_importance, keyphrase_tags, normalize_tag,
)
from services.jobs.worker import Job
from services.search.indexing import embed_parent
from tenancy.models import AuthContext
from tests.conftest import assert_error, provision_emulator, signup, start_live
from tests.live import serve

KEBAB = re.compile(r"^[a-z0-9]+(?:-[a-z0-9]+)*$")


# -- the scripted LLM --------------------------------------------------------------------------------------

class ScriptedLLM:
    """A test double of the LLM port. The note steers the answer:
    ``llm-tags: a, b`` / ``llm-summary: ...`` / ``llm-importance: 5`` / ``llm-fail: json|shape|error``."""

    model_id = "scripted-llm"

    def __init__(self) -> None:
        self.calls: list[list[str]] = []
        self.lock = threading.Lock()

    async def complete_json(self, messages, *, schema, max_tokens=512, temperature=0.2) -> LLMResult:
        with self.lock:
            self.calls.append([m.content for m in messages])
        note = messages[-1].content.split("Note:", 1)[-1]
        d = {k: v.strip() for k, v in re.findall(r"llm-(\w+):[ \t]*([^\n]*)", note)}
        fail = d.get("fail")
        if fail == "error":
            raise BackendError("scripted model failure")
        if fail == "json":
            return LLMResult(data="this is not an object", prompt_tokens=50, completion_tokens=5)
        if fail == "shape":
            return LLMResult(data={"summary": 42, "tags": "nope"}, prompt_tokens=50, completion_tokens=5)
        tags = [t.strip() for t in d.get("tags", "scripted-topic, memex, testing").split(",")]
        data = {"summary": d.get("summary", "A scripted summary of the note"), "tags": tags,
                "importance": int(d.get("importance", "3"))}
        return LLMResult(data=data, prompt_tokens=100, completion_tokens=20)

    def prompts_containing(self, marker: str) -> list[str]:
        with self.lock:
            return ["\n".join(c) for c in self.calls if marker in "\n".join(c)]

    async def aclose(self) -> None:
        pass


def wait_enriched(client: httpx.Client, headers: dict, thought_id: str, timeout: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        body = client.get(f"/v1/thoughts/{thought_id}", headers=headers).json()
        if body.get("enrichment") is not None:
            return body
        assert time.monotonic() < deadline, f"not enriched in {timeout}s: {body}"
        time.sleep(0.05)


def capture(client: httpx.Client, org, content: str) -> str:
    r = client.post("/v1/thoughts", json={"content": content}, headers=org.headers)
    assert r.status_code == 201, r.text
    return r.json()["id"]


@pytest.fixture(scope="module")
def slive():
    """The service with the hash embedder and the scripted LLM."""
    with tempfile.TemporaryDirectory() as tmp:
        server, ctx = start_live(Path(tmp), embedder="hash")
        server.llm = ScriptedLLM()
        server.memex.backend.llm = server.llm
        try:
            yield server
        finally:
            ctx.__exit__(None, None, None)


@pytest.fixture(scope="module")
def nlive():
    """The service with no LLM (the default): the deterministic paths."""
    with tempfile.TemporaryDirectory() as tmp:
        server, ctx = start_live(Path(tmp), embedder="hash")
        try:
            yield server
        finally:
            ctx.__exit__(None, None, None)


@pytest.fixture
def http(slive):
    with slive.client() as c:
        yield c


# -- pure helpers ------------------------------------------------------------------------------------------

def test_tags_are_normalised_to_kebab_case_and_the_vocabulary_spelling():
    assert normalize_tag("Vector Databases") == "vector-databases"
    assert normalize_tag("Café_Ops!") == "cafe-ops"
    assert normalize_tag("#K8s") == "k8s"
    assert normalize_tag("  ") is None and normalize_tag(12) is None and normalize_tag("2024") is None
    vocab = ["vector-database", "k8s", "api-gateway"]
    assert canonical_tags(["Vector DBs", "vector_databases", "VectorDatabase", "K8S", "api gateways", "New Topic"],
                          vocab) == ["vector-dbs", "vector-database", "k8s", "api-gateway", "new-topic"]
    # two new spellings of one tag collapse to the first; at most 7
    assert canonical_tags(["release-notes", "release-note", "ReleaseNotes"]) == ["release-notes"]
    assert len(canonical_tags([f"t{i}x" for i in range(20)])) == 7


def test_extractive_summary_is_one_trimmed_line():
    note = "---\ntitle: x\n---\n\n```\ncode\n```\n## The **billing** [migration](http://x) plan ##\n\nBody text."
    assert extractive_summary(note) == "The billing migration plan"
    long = "word " * 100
    s = extractive_summary(long)
    assert len(s) <= 140 and s.endswith("…") and "  " not in s
    assert not s[:-1].endswith(" wor")  # cut on a word boundary
    assert extractive_summary("First sentence is here today. Second one follows.") == "First sentence is here today."
    assert extractive_summary("   \n\n---\n") is None
    assert clip("a" * 200) == "a" * 139 + "…"


def test_keyphrase_tags_reuse_the_vocabulary_and_are_deterministic():
    note = ("# Postgres migration plan\n\nWe decided to move the billing service from MySQL to Postgres before the Q3 "
            "deadline, with logical replication and zero downtime on our Kubernetes clusters.")
    vocab = ["kubernetes", "database-migration", "billing"]
    tags = keyphrase_tags(note, vocab)
    assert tags == keyphrase_tags(note, vocab)
    assert tags[:2] == ["kubernetes", "billing"]  # vocabulary tags present in the text come first
    assert 3 <= len(tags) <= 7 and all(KEBAB.match(t) for t in tags)
    assert "postgres" in tags


def test_importance_heuristic():
    assert heuristic_importance("We decided the API must stay backwards compatible until the June deadline.") == 4
    assert heuristic_importance("Incident: production outage, we decided to roll back. Postmortem due Friday.") == 5
    assert heuristic_importance("The office coffee machine is on the third floor near the windows.") == 3
    assert heuristic_importance("random idea: paint the meeting room green") == 2


# -- the budget (in process) -------------------------------------------------------------------------------

class CountingLLM:
    model_id = "counting"

    def __init__(self, prompt_tokens=100, completion_tokens=50):
        self.calls = 0
        self.pt, self.ct = prompt_tokens, completion_tokens

    async def complete_json(self, messages, *, schema, max_tokens=512, temperature=0.2):
        self.calls += 1
        await asyncio.sleep(0.001)
        return LLMResult({"ok": True}, self.pt, self.ct)

    async def aclose(self) -> None:
        pass


@pytest.fixture
async def db(tmp_path):
    """The control database: LLM usage is counted there, beside the organizations (Memex.budgeted_llm)."""
    d = SqliteDatabase(tmp_path / "control.sqlite3")
    await apply_pending(d, CONTROL_DIR)
    for org in ("org_a", "org_b"):
        await d.execute("INSERT INTO organizations (id, slug, name, created_at) VALUES (?, ?, ?, 0)", (org, org, org))
    yield d
    await d.close()


MSG = [ChatMessage("user", "hello there")]


async def test_budget_stops_calls_by_count_and_records_the_refusal(db):
    inner = CountingLLM()
    llm = BudgetedLLM(inner, OrgSql(db, "org_a"), LLMBudget(calls_per_day=3, tokens_per_day=1_000_000))
    for _ in range(3):
        await llm.complete_json(MSG, schema={})
    with pytest.raises(BudgetExceeded) as exc:
        await llm.complete_json(MSG, schema={})
    assert exc.value.retry_after >= 1
    assert await llm.try_complete_json(MSG, schema={}) is None
    assert inner.calls == 3  # refused before anything was sent
    usage = await llm.usage()
    assert (usage["calls"], usage["tokens"], usage["refused"]) == (3, 3 * 150, 2)


async def test_budget_stops_calls_by_tokens(db):
    inner = CountingLLM(prompt_tokens=100, completion_tokens=150)
    llm = BudgetedLLM(inner, OrgSql(db, "org_a"), LLMBudget(calls_per_day=1000, tokens_per_day=600))
    await llm.complete_json(MSG, schema={})  # 250
    await llm.complete_json(MSG, schema={})  # 500
    assert await llm.try_complete_json(MSG, schema={}) is not None  # 500 + prompt estimate fits: runs, 750
    assert await llm.try_complete_json(MSG, schema={}) is None  # over: refused
    assert inner.calls == 3
    assert (await llm.usage())["tokens"] == 750


async def test_budget_is_per_organization_day_and_atomic(db):
    inner = CountingLLM()
    budget = LLMBudget(calls_per_day=5, tokens_per_day=10_000_000)
    a = BudgetedLLM(inner, OrgSql(db, "org_a"), budget)
    results = await asyncio.gather(*(a.try_complete_json(MSG, schema={}) for _ in range(20)))
    assert sum(r is not None for r in results) == 5 and inner.calls == 5  # concurrent callers never overspend
    b = BudgetedLLM(inner, OrgSql(db, "org_b"), budget)
    assert await b.try_complete_json(MSG, schema={}) is not None  # org b's budget is its own
    tomorrow = BudgetedLLM(inner, OrgSql(db, "org_a"), budget, clock=lambda: time.time() + 86400)
    assert await tomorrow.try_complete_json(MSG, schema={}) is not None  # a new UTC day, a new budget
    rows = (await db.execute("SELECT organization_id, calls FROM llm_usage ORDER BY organization_id, day")).rows
    assert [(r["organization_id"], r["calls"]) for r in rows] == [("org_a", 5), ("org_a", 1), ("org_b", 1)]


# -- enrichment through the API (scripted LLM) -------------------------------------------------------------

def test_capture_is_enriched_after_the_write_and_surfaced_everywhere(slive, http):
    org = signup(slive, "enr")
    content = ("Chose Qdrant over pgvector for the recall service.\nllm-tags: Vector Databases, Qdrant, "
               "recall_service, Architecture Decision\nllm-summary: Picked Qdrant for recall\nllm-importance: 5")
    r = http.post("/v1/thoughts", json={"content": content}, headers=org.headers)
    assert r.status_code == 201, r.text
    tid = r.json()["id"]
    body = wait_enriched(http, org.headers, tid)
    assert body["enrichment"] == "llm"
    assert body["summary"] == "Picked Qdrant for recall"
    assert body["tags"] == ["vector-databases", "qdrant", "recall-service", "architecture-decision"]
    assert body["importance"] == 5
    listed = http.get("/v1/thoughts", headers=org.headers).json()["thoughts"]
    assert listed[0]["tags"] == body["tags"] and listed[0]["summary"] == body["summary"]
    hits = http.post("/v1/search", json={"query": "Qdrant pgvector recall"}, headers=org.headers).json()["results"]
    assert hits and hits[0]["tags"] == body["tags"] and hits[0]["summary"] == body["summary"]
    legacy = http.get(f"/thought/{tid}", headers=org.headers).json()
    assert legacy["tags"] == body["tags"]
    # the tags are in the vector metadata too (for filtering)
    slive.wait_indexed(org.headers, tid)
    vectors = slive.vectors(f"{org.id}:")
    assert vectors and all(md.get("tags") == body["tags"] for _, _, md in vectors)


def test_tags_reuse_the_organizations_vocabulary(slive, http):
    org = signup(slive, "voc")
    first = capture(http, org, "Notes on our vector store.\nllm-tags: vector-database, kubernetes, postgres")
    wait_enriched(http, org.headers, first)
    marker = "second-vocab-note"
    second = capture(http, org, f"{marker}: more.\nllm-tags: Vector Databases, K8s cluster, Postgres, kubernetes")
    body = wait_enriched(http, org.headers, second)
    assert body["tags"] == ["vector-database", "k8s-cluster", "postgres", "kubernetes"]
    prompt = slive.llm.prompts_containing(marker)[-1]
    hint = prompt.split("Existing tags", 1)[1].split("Note:")[0]
    assert {"vector-database", "kubernetes", "postgres"} <= set(re.findall(r"[a-z0-9-]+", hint))


def test_too_few_tags_are_topped_up_and_bad_importance_falls_back(slive, http):
    org = signup(slive, "few")
    tid = capture(http, org, "We must rotate the database credentials before the audit deadline.\n"
                             "llm-tags: credentials\nllm-importance: 9")
    body = wait_enriched(http, org.headers, tid)
    assert body["enrichment"] == "llm"
    assert body["tags"][0] == "credentials" and len(body["tags"]) == 3
    assert all(KEBAB.match(t) for t in body["tags"])
    assert body["importance"] == 4  # the heuristic: "must", "deadline"


@pytest.mark.parametrize("failure", ["json", "shape", "error"])
def test_a_failing_model_leaves_empty_fields_and_the_capture_stands(slive, http, failure):
    org = signup(slive, "fail")
    tid = capture(http, org, f"Pelican crossing notes {failure}.\nllm-fail: {failure}")
    body = wait_enriched(http, org.headers, tid)
    assert (body["enrichment"], body["summary"], body["tags"], body["importance"]) == ("failed", None, [], None)
    hits = http.post("/v1/search", json={"query": "pelican crossing"}, headers=org.headers).json()["results"]
    assert [h["document_id"] for h in hits] == [tid]


def test_the_vocabulary_offered_never_holds_another_organizations_tags(slive, http):
    a, b = signup(slive, "ta"), signup(slive, "tb")
    secret = "zebra-secret-project"
    topics = ["Sailing route through the northern fjords", "Violin practice schedule for spring recitals",
              "Compost bin temperature readings this week"]
    for i, topic in enumerate(topics):
        wait_enriched(http, a.headers, capture(http, a, f"{topic}.\nllm-tags: {secret}, alpha-topic, shared-{i}"))
    marker_a, marker_b = "a-control-note", "b-probe-note"
    wait_enriched(http, a.headers, capture(http, a, f"{marker_a}.\nllm-tags: x-tag, y-tag, z-tag"))
    wait_enriched(http, b.headers, capture(http, b, f"{marker_b}.\nllm-tags: b-one, b-two, b-three"))
    assert secret in slive.llm.prompts_containing(marker_a)[-1]  # the control: A's vocabulary is offered to A
    prompt_b = slive.llm.prompts_containing(marker_b)[-1]
    assert secret not in prompt_b and "alpha-topic" not in prompt_b
    # and B's own data
    tags_b = {t for (t,) in slive.sql("SELECT tag FROM tag_counts WHERE organization_id = ?", (b.id,))}
    assert tags_b == {"b-one", "b-two", "b-three"}


# -- budgets through the API --------------------------------------------------------------------------------

def test_over_budget_enrichment_is_skipped_recorded_and_per_organization():
    with tempfile.TemporaryDirectory() as tmp:
        server, ctx = start_live(Path(tmp), embedder="hash", llm_calls_per_day=2)
        llm = server.memex.backend.llm = ScriptedLLM()
        try:
            a, b = signup(server, "ba"), signup(server, "bb")
            with server.client() as c:
                # unrelated notes, so the write-time decisions never ask the model (only enrichment does)
                notes = ["Kayaks need fresh varnish.", "Quarterly taxes filed online.", "Sourdough starter died again."]
                ids = [capture(c, a, n) for n in notes]
                states = [wait_enriched(c, a.headers, i) for i in ids]
                assert [s["enrichment"] for s in states] == ["llm", "llm", "skipped_budget"]
                assert (states[2]["summary"], states[2]["tags"], states[2]["importance"]) == (None, [], None)
                assert len(llm.prompts_containing("You index notes")) == 2  # the third call was never made
                # another organization's budget is untouched
                other = wait_enriched(c, b.headers, capture(c, b, "Budget note for the other org."))
                assert other["enrichment"] == "llm"
            usage = server.sql("SELECT organization_id, calls, refused FROM llm_usage ORDER BY calls DESC")
            assert (a.id, 2, 1) in usage and (b.id, 1, 0) in usage
        finally:
            ctx.__exit__(None, None, None)


# -- without an LLM -----------------------------------------------------------------------------------------

def test_without_a_model_enrichment_is_extractive_and_deterministic(nlive):
    a, b = signup(nlive, "na"), signup(nlive, "nb")
    note = ("## Incident review: search outage\n\nThe search cluster went down after a bad deploy. We decided to add "
            "canary deploys and must page the on-call engineer within five minutes.")
    with nlive.client() as c:
        one = wait_enriched(c, a.headers, capture(c, a, note))
        two = wait_enriched(c, b.headers, capture(c, b, note))
    for body in (one, two):
        assert body["enrichment"] == "extractive"
        assert body["summary"] == "Incident review: search outage"
        assert 3 <= len(body["tags"]) <= 7 and all(KEBAB.match(t) for t in body["tags"])
        assert body["importance"] == 5
    assert one["tags"] == two["tags"]


def test_without_a_model_vocabulary_tags_in_the_text_are_reused(nlive):
    org = signup(nlive, "nv")
    with nlive.client() as c:
        wait_enriched(c, org.headers, capture(c, org, "# Kubernetes upgrade\n\nKubernetes nodes upgraded to 1.30."))
        body = wait_enriched(c, org.headers, capture(c, org, "Helm charts for the ingress controllers on kubernetes."))
    assert body["tags"][0] == "kubernetes"


# -- tags reach vectors written before the enrichment --------------------------------------------------------

async def _memex(tmp: Path, **overrides) -> tuple[Memex, OrgSql, OrgVectors, str]:
    m = Memex(Settings(data_dir=tmp, embedder="hash", run_worker=False, **overrides))
    await m.start(worker=False)
    org, _ = await m.orgs.create(name="late", slug=f"late-{int(time.time() * 1e6) % 10**9}")
    store = await m.stores.open(org.id)
    return m, store.sql, store.vectors, org.id


async def test_tags_are_added_to_vectors_written_before_the_enrichment(tmp_path):
    m, sql, vectors, org_id = await _memex(tmp_path)
    try:
        ctx = AuthContext(org_id=org_id, org_slug="late", principal="t", scopes=frozenset({"read", "write"}))
        res = await (await m.for_org(ctx)).thoughts.capture("Grafana dashboards for the Loki logging pipeline and alerts.")
        await embed_parent(sql, vectors, m.backend.embedder, Job(0, org_id, "embed", res.id, 1))  # embed first
        (chunk,) = await sql.rows("SELECT id FROM chunks WHERE organization_id = ?1", [])
        assert "tags" not in (await vectors.get_by_ids([chunk["id"]]))[0].metadata
        e = await m.enricher(sql, vectors).enrich(res.id)
        got = (await vectors.get_by_ids([chunk["id"]]))[0]
        assert got.metadata["tags"] == e.tags and e.state == "extractive"
        assert got.metadata["parent_id"] == res.id  # the rest of the metadata is kept
        await m.worker.drain(10)  # the queued jobs find nothing left to do
        assert await m.enricher(sql, vectors).enrich(res.id) is None  # already enriched: not again
    finally:
        await m.stop()


async def test_on_vectorize_a_vector_not_visible_yet_is_embedded_again_with_the_tags(tmp_path):
    from services.adapters.hash_embedder import HashEmbedder
    from tests.cloudflare_emulator import running_emulator

    emb = HashEmbedder()
    with running_emulator(data_dir=tmp_path / "emu", vector_lag_ms=60_000, rate_limit=1_000_000) as emu:
        # the Cloudflare backend (D1 + Vectorize on the emulator): a database and its vectors live together
        m, sql, vectors, org_id = await _memex(
            tmp_path / "svc", **provision_emulator(emu, dimensions=emb.dimensions, model=emb.model_id))
        try:
            ctx = AuthContext(org_id=org_id, org_slug="late", principal="t", scopes=frozenset({"read", "write"}))
            res = await (await m.for_org(ctx)).thoughts.capture("Terraform modules for the staging VPC peering setup.")
            await embed_parent(sql, vectors, m.backend.embedder, Job(0, org_id, "embed", res.id, 1))
            e = await m.enricher(sql, vectors).enrich(res.id)  # the vector is not applied yet (60 s lag)
            pending = await sql.rows("SELECT kind FROM jobs WHERE organization_id = ?1 AND target_id = ?2", [res.id])
            assert "embed" in [p["kind"] for p in pending]
            while await m.worker.run_once():  # the re-queued embedding writes the vector with its tags
                pass
            emu.flush_vectors()
            (chunk,) = await sql.rows("SELECT id FROM chunks WHERE organization_id = ?1", [])
            got = await vectors.get_by_ids([chunk["id"]])
            assert got and got[0].metadata.get("tags") == e.tags
        finally:
            await m.stop()


# -- the two-pass backfill -----------------------------------------------------------------------------------

def _reset(server, org) -> None:
    """Make an organization's thoughts look like pre-enrichment rows."""
    server.sql("UPDATE documents SET summary = NULL, tags = NULL, importance = NULL, enrichment_state = NULL, "
               "enriched_at = NULL WHERE organization_id = ?", (org.id,))


def test_backfill_two_passes_resumable(slive, http):
    org = signup(slive, "bf")
    topics = ["Glacier hiking permits", "Espresso grinder calibration", "Mortgage refinancing quotes",
              "Telescope mirror collimation", "Beehive winter insulation"]  # unrelated: no write-time decision
    notes = [f"{t} (bf-topic).\nllm-tags: seed-tag-{i % 2}, common-seed, note-{i}" for i, t in enumerate(topics)]
    ids = [capture(http, org, n) for n in notes]
    for i in ids:
        wait_enriched(http, org.headers, i)
    _reset(slive, org)
    assert slive.sql("SELECT COUNT(*) FROM tag_counts WHERE organization_id = ?", (org.id,)) == [(0,)]
    before = len(slive.llm.calls)

    def call(**params):
        r = http.post("/v1/admin/backfill/enrich", params=params, headers=org.headers)
        assert r.status_code == 200, r.text
        return r.json()

    r1 = call(batch_size=2)
    assert (r1["phase"], r1["processed"], r1["enriched"], r1["done"]) == (1, 2, 0, False)
    assert r1["cursor"].startswith("1:") and r1["remaining"] == 3
    # pass 1 persists nothing
    assert slive.sql("SELECT COUNT(*) FROM documents WHERE organization_id = ? AND enrichment_state IS NOT NULL",
                     (org.id,)) == [(0,)]
    r2 = call(batch_size=2)  # resumes from the stored checkpoint
    assert r2["phase"] == 1 and r2["processed"] == 2
    r3 = call(batch_size=2)  # the last row of pass 1, then the first of pass 2
    assert r3["phase"] == 2 and r3["processed"] == 2 and r3["enriched"] == 1
    seen = []
    while True:
        r = call(batch_size=2)
        seen.append(r)
        if r["done"]:
            break
    assert r["cursor"] is None and r["phase"] == 3
    assert sum(x["enriched"] for x in [r3, *seen]) == 5
    # 5 rows x 2 passes
    assert len(slive.llm.calls) - before == 10
    prompts = slive.llm.prompts_containing("bf-topic")[-10:]
    assert all("Existing tags" not in p for p in prompts[:5])  # pass 1: no vocabulary anchor
    assert all("common-seed" in p.split("Note:")[0] for p in prompts[5:])  # pass 2: the seed is offered
    rows = slive.sql("SELECT enrichment_state, tags FROM documents WHERE organization_id = ?", (org.id,))
    assert all(s == "llm" and "common-seed" in json.loads(t) for s, t in rows)
    # nothing left: done, no model call
    again = call(batch_size=10)
    assert again["done"] and again["processed"] == 0 and len(slive.llm.calls) - before == 10


def test_backfill_stops_at_the_budget_and_resumes():
    with tempfile.TemporaryDirectory() as tmp:
        server, ctx = start_live(Path(tmp), embedder="hash", llm_calls_per_day=4)
        server.memex.backend.llm = ScriptedLLM()
        try:
            org = signup(server, "bb")
            with server.client() as c:
                ids = [capture(c, org, n) for n in ("Bicycle chain needs oil.", "Garden hose leaks water.")]
                for i in ids:
                    wait_enriched(c, org.headers, i)  # 2 calls spent
                _reset(server, org)
                r = c.post("/v1/admin/backfill/enrich", params={"batch_size": 10}, headers=org.headers).json()
                # pass 1 takes the 2 calls left; pass 2 is refused and stops where it is
                assert r["stopped"] == "budget" and r["processed"] == 2 and r["phase"] == 2 and not r["done"]
                assert r["cursor"] == "2:" and r["remaining"] == 2
                server.sql("DELETE FROM llm_usage WHERE organization_id = ?", (org.id,))  # a new day
                r = c.post("/v1/admin/backfill/enrich", params={"batch_size": 10}, headers=org.headers).json()
                assert r["done"] and r["enriched"] == 2 and r["stopped"] is None
        finally:
            ctx.__exit__(None, None, None)


def test_backfill_endpoint_needs_admin_and_touches_only_the_callers_data(slive, http):
    a, b = signup(slive, "adm"), signup(slive, "oth")
    rw = http.post("/v1/keys", json={"name": "rw", "scopes": ["read", "write"]}, headers=a.headers).json()["key"]
    assert_error(http.post("/v1/admin/backfill/enrich", headers={"authorization": f"Bearer {rw}"}), 403, "forbidden")
    assert_error(http.post("/v1/admin/backfill/enrich"), 401)
    assert_error(http.post("/v1/admin/backfill/enrich", params={"cursor": "nope"}, headers=a.headers), 400)
    bid = capture(http, b, "Other org's private note.\nllm-tags: b-private, b-two, b-three")
    wait_enriched(http, b.headers, bid)
    _reset(slive, b)
    # A runs a backfill, also with a cursor naming B's thought: nothing of B's changes
    for params in ({"batch_size": 50}, {"cursor": f"2:{bid[:-1]}", "batch_size": 50}, {"restart": "true"}):
        r = http.post("/v1/admin/backfill/enrich", params=params, headers=a.headers)
        assert r.status_code == 200, r.text
        assert r.json()["processed"] == 0
    assert slive.sql("SELECT enrichment_state, tags FROM documents WHERE organization_id = ?", (b.id,)) == [(None, None)]
    assert http.get(f"/v1/thoughts/{bid}", headers=a.headers).status_code == 404


def test_backfill_cli_runs_to_the_end_with_a_progress_bar(nlive):
    org = signup(nlive, "cli")
    with nlive.client() as c:
        ids = [capture(c, org, f"CLI backfill note {i}: Rust async runtimes and tokio tuning.") for i in range(3)]
        for i in ids:
            wait_enriched(c, org.headers, i)
    _reset(nlive, org)
    ctx = AuthContext(org_id=org.id, org_slug=org.slug, principal="cli", scopes=frozenset({"admin"}))
    enricher = asyncio.run_coroutine_threadsafe(nlive.memex.for_org(ctx), _server_loop(nlive)).result(timeout=30).enrichment
    out = io.StringIO()
    fut = asyncio.run_coroutine_threadsafe(backfill_enrich_org(enricher, batch_size=2, label=org.slug, stream=out,
                                                               show=True), _server_loop(nlive))
    totals = fut.result(timeout=60)
    assert totals["done"] and totals["processed"] == 6 and totals["enriched"] == 3
    lines = out.getvalue().strip().replace("\r", "\n").splitlines()  # tqdm redraws with carriage returns
    assert lines[-1].startswith(org.slug) and "6/6" in lines[-1] and "pass 2" in "".join(lines)
    assert nlive.sql("SELECT COUNT(*) FROM documents WHERE organization_id = ? AND enrichment_state = 'extractive'",
                     (org.id,)) == [(3,)]


def _server_loop(server):
    """The event loop the served app runs on (the backend's connections belong to it)."""
    task = server.memex.worker._task
    return task.get_loop()


# -- the Workers AI adapter on the emulator's llama ----------------------------------------------------------

def test_workers_ai_llm_enriches_through_the_emulator(tmp_path):
    from tests.cloudflare_emulator import running_emulator

    with running_emulator(data_dir=tmp_path / "emu", rate_limit=1_000_000) as emu:
        server, ctx = start_live(
            tmp_path / "svc", embedder="hash", llm="workers-ai", cloudflare_account_id=emu.account,
            cloudflare_api_token=emu.token, cloudflare_api_base_url=emu.base_url, cloudflare_budget_limit=1_000_000,
        )
        try:
            org = signup(server, "wai")
            emu.push_llm_response({"summary": "Moved CI to self-hosted runners", "tags": ["CI/CD", "GitHub Actions",
                                   "self hosted runners"], "importance": 3})
            with server.client() as c:
                body = wait_enriched(c, org.headers, capture(c, org, "We moved CI to self-hosted GitHub runners."))
                assert body["enrichment"] == "llm" and body["summary"] == "Moved CI to self-hosted runners"
                assert body["tags"] == ["ci-cd", "github-actions", "self-hosted-runners"]
                req = emu.llm_requests[-1]
                assert req["temperature"] == 0.2 and req["response_format"]["type"] == "json_schema"
                assert "self-hosted GitHub runners" in req["messages"][-1]["content"]
                tokens = server.sql("SELECT calls, tokens FROM llm_usage WHERE organization_id = ?", (org.id,))
                assert tokens[0][0] == 1 and tokens[0][1] > 0  # the usage the API reported
                # an AI error and a non-JSON answer: empty fields, the capture stands
                emu.push_llm_response({"__error__": {"status": 400, "code": 5006, "message": "AiError: bad"}})
                bad = wait_enriched(c, org.headers, capture(c, org, "A second note for the failing model."))
                assert (bad["enrichment"], bad["tags"]) == ("failed", [])
                emu.push_llm_response("not json at all", "still not json")
                bad = wait_enriched(c, org.headers, capture(c, org, "A third note for the failing model."))
                assert (bad["enrichment"], bad["tags"]) == ("failed", [])
        finally:
            ctx.__exit__(None, None, None)


async def test_workers_ai_reranker_port_scores_in_passage_order(tmp_path):
    from api.composition.cloudflare import api_for, shared_client
    from services.adapters.cloudflare import WorkersAIReranker
    from tests.cloudflare_emulator import running_emulator

    with running_emulator(data_dir=tmp_path / "emu") as emu:
        settings = Settings(cloudflare_account_id=emu.account, cloudflare_api_token=emu.token,
                            cloudflare_api_base_url=emu.base_url)
        http_client = shared_client(settings)
        try:
            port = WorkersAIRerankerPort(WorkersAIReranker(api_for(settings, http_client)))
            scores = await port.rerank("rust async runtime", ["a cake recipe", "the rust async runtime tokio", "rust"])
            assert len(scores) == 3 and scores[1] == max(scores) and scores[0] == min(scores)
            assert await port.rerank("q", []) == []
        finally:
            await http_client.aclose()


# -- the OpenAI-compatible adapter against a fake server ----------------------------------------------------

class FakeOpenAI:
    """A chat-completions endpoint on loopback: answers from a queue, records requests."""

    def __init__(self) -> None:
        self.queue: list = []
        self.requests: list[dict] = []

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif msg["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        headers = {k.decode(): v.decode() for k, v in scope["headers"]}
        req = json.loads(body or b"{}")
        self.requests.append({"path": scope["path"], "headers": headers, "body": req})
        entry = self.queue.pop(0) if self.queue else None
        if callable(entry):
            entry = entry(req)
        status, payload = 200, None
        if isinstance(entry, tuple):
            status, payload = entry
        elif isinstance(entry, str):
            payload = {"choices": [{"message": {"role": "assistant", "content": entry}}],
                       "usage": {"prompt_tokens": 40, "completion_tokens": 12}}
        else:
            payload = {"choices": [{"message": {"role": "assistant", "content": json.dumps(
                {"summary": "Default fake summary", "tags": ["fake-one", "fake-two", "fake-three"], "importance": 2})}}],
                "usage": {"prompt_tokens": 40, "completion_tokens": 12}}
        data = json.dumps(payload).encode()
        await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": data})


@pytest.fixture(scope="module")
def fake_openai():
    fake = FakeOpenAI()
    with serve(fake) as url:
        fake.url = url
        yield fake


async def test_openai_adapter_request_parsing_retries_and_fallback(fake_openai):
    fake = fake_openai
    llm = OpenAICompatibleLLM(fake.url + "/v1", "test-model", api_key="sk-test")
    try:
        fake.queue[:] = ['```json\n{"summary": "s", "tags": ["a"], "importance": 1}\n```']
        res = await llm.complete_json([ChatMessage("user", "hi")], schema={"type": "object"}, max_tokens=99)
        assert res.data == {"summary": "s", "tags": ["a"], "importance": 1}
        assert (res.prompt_tokens, res.completion_tokens) == (40, 12)
        req = fake.requests[-1]
        assert req["path"] == "/v1/chat/completions" and req["headers"]["authorization"] == "Bearer sk-test"
        assert req["body"]["model"] == "test-model" and req["body"]["temperature"] == 0.2
        assert req["body"]["max_tokens"] == 99 and req["body"]["response_format"]["type"] == "json_schema"
        assert req["body"]["response_format"]["json_schema"]["schema"] == {"type": "object"}
        # 503 then success: retried
        n = len(fake.requests)
        fake.queue[:] = [(503, {"error": "busy"}), '{"ok": true}']
        assert (await llm.complete_json([ChatMessage("user", "x")], schema={})).data == {"ok": True}
        assert len(fake.requests) - n == 2
        # a server that refuses json_schema: asked again with json_object, and remembered
        fake.queue[:] = [(400, {"error": "response_format json_schema unsupported"}), '{"ok": 1}', '{"ok": 2}']
        assert (await llm.complete_json([ChatMessage("user", "x")], schema={"type": "object"})).data == {"ok": 1}
        assert fake.requests[-1]["body"]["response_format"] == {"type": "json_object"}
        assert (await llm.complete_json([ChatMessage("user", "x")], schema={"type": "object"})).data == {"ok": 2}
        assert fake.requests[-1]["body"]["response_format"] == {"type": "json_object"}
        # not JSON, or a hard error: BackendError
        fake.queue[:] = ["I cannot answer in JSON, sorry"]
        with pytest.raises(BackendError):
            await llm.complete_json([ChatMessage("user", "x")], schema={})
        fake.queue[:] = [(401, {"error": "bad key"})]
        with pytest.raises(BackendError):
            await llm.complete_json([ChatMessage("user", "x")], schema={})
    finally:
        await llm.aclose()
    assert parse_json_content('noise {"a": 1} trailing') == {"a": 1}


def test_openai_llm_enriches_end_to_end(tmp_path, fake_openai):
    fake_openai.queue[:] = []
    server, ctx = start_live(tmp_path, embedder="hash", llm="openai", llm_base_url=fake_openai.url + "/v1",
                             llm_model="local-model", llm_response_format="json_object")
    try:
        org = signup(server, "oai")
        with server.client() as c:
            body = wait_enriched(c, org.headers, capture(c, org, "Ollama runs the local model for enrichment."))
        assert (body["enrichment"], body["summary"], body["importance"]) == ("llm", "Default fake summary", 2)
        assert body["tags"] == ["fake-one", "fake-two", "fake-three"]
        req = fake_openai.requests[-1]["body"]
        assert req["model"] == "local-model" and req["response_format"] == {"type": "json_object"}
        assert "authorization" not in fake_openai.requests[-1]["headers"]
    finally:
        ctx.__exit__(None, None, None)


def test_unknown_or_missing_model_settings_fail_clearly(tmp_path):
    from api.composition.backend import build_backend
    from services.errors import InvalidInput

    for overrides, text in (({"llm": "gpt"}, "MEMEX_LLM"), ({"llm": "openai"}, "MEMEX_LLM_BASE_URL"),
                            ({"reranker": "magic"}, "MEMEX_RERANKER")):
        with pytest.raises(InvalidInput, match=text):
            build_backend(Settings(data_dir=tmp_path, embedder="hash", **overrides))


# -- on both backends (SQLite + local vectors; D1 + Vectorize on the emulator) -------------------------------

def test_enrichment_on_every_backend_reaches_rows_vocabulary_and_vectors(live, org, client):
    first = capture(client, org, "# Kubernetes upgrade\n\nThe Kubernetes control plane was upgraded to 1.30 last night.")
    wait_enriched(client, org.headers, first)
    tid = capture(client, org, "Helm charts for the ingress controllers on the kubernetes cluster.")
    body = wait_enriched(client, org.headers, tid)
    assert body["enrichment"] == "extractive" and body["tags"][0] == "kubernetes"
    assert body["summary"] == "Helm charts for the ingress controllers on the kubernetes cluster."
    assert live.sql("SELECT uses FROM tag_counts WHERE organization_id = ? AND tag = 'kubernetes'", (org.id,)) == [(2,)]
    live.wait_indexed(org.headers, tid)
    chunk_ids = [c["id"] for c in body["chunks"]]
    vectors = {vid.split(":", 1)[1]: md for vid, _, md in live.vectors(f"{org.id}:")}
    assert all(vectors[c].get("tags") == body["tags"] for c in chunk_ids)
    client.delete(f"/v1/thoughts/{first}", headers=org.headers)
    assert live.sql("SELECT uses FROM tag_counts WHERE organization_id = ? AND tag = 'kubernetes'", (org.id,)) == [(1,)]
