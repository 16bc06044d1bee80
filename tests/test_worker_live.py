"""The newcomer path on the Worker backend, for real: ``memex cloudflare dev``'s stack (``wrangler dev --local`` running
worker/, with D1 and a SQLite Durable Object per organization simulated by miniflare, and the Cloudflare emulator
standing in for Vectorize and Workers AI), and the service (``memex serve``'s app under uvicorn) with
``MEMEX_BACKEND=worker`` over real HTTP on loopback.

The service is also given Cloudflare REST credentials pointing at a second emulator (a trap, as a production
deployment keeps its token for setup): the data path must not call it once. Skipped, with the reason, when Node or
worker/node_modules is missing (``npm ci --prefix worker``)."""

from __future__ import annotations

import asyncio
import io
import json
import shutil
import tempfile
import threading
import time
import zipfile
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]
if shutil.which("node") is None or shutil.which("npm") is None:
    pytest.skip("the Worker tests need Node.js and npm on PATH", allow_module_level=True)
if not (ROOT / "worker" / "node_modules" / ".bin" / "wrangler").exists():
    pytest.skip("the Worker's npm packages are not installed: run `npm ci --prefix worker`", allow_module_level=True)

from api.cloudflare_dev_cli import start_dev  # noqa: E402
from api.composition.check import run_check  # noqa: E402
from api.settings import Settings  # noqa: E402
from services.adapters.cloudflare.worker_client import WorkerClient  # noqa: E402
from services.adapters.cloudflare.worker_sql import WorkerSqlDatabase  # noqa: E402
from services.storage.migrate import CONTROL_DIR, ORG_DIR, discover  # noqa: E402
from tests.cloudflare_emulator import running_emulator  # noqa: E402
from tests.conftest import assert_error, signup, start_live  # noqa: E402
from tests.kb_vault import KEYWORDS, TYPES_BY_ID, vault_files  # noqa: E402
from tests.mcp_client import mcp_session  # noqa: E402


@pytest.fixture(scope="module")
def stack():
    with tempfile.TemporaryDirectory() as tmp:
        dev = start_dev(ROOT, port=0, state_dir=Path(tmp) / "dev", vector_lag_ms=50, say=lambda _: None)
        with dev:
            yield dev


@pytest.fixture(scope="module")
def trap():
    """Where the service's Cloudflare REST credentials point: nothing on the data path may reach it."""
    with running_emulator() as emu:
        yield emu


@pytest.fixture(scope="module")
def wlive(stack, trap):
    with tempfile.TemporaryDirectory() as tmp:
        server, ctx = start_live(
            Path(tmp), embedder="workers-ai", backend="worker", worker_url=stack.url, worker_secret=stack.secret,
            cloudflare_vectorize_index=stack.index, cloudflare_account_id=trap.account,
            cloudflare_api_token=trap.token, cloudflare_api_base_url=trap.base_url)
        try:
            yield server
        finally:
            ctx.__exit__(None, None, None)


@pytest.fixture
def http(wlive):
    with wlive.client() as c:
        yield c


def worker_sql(stack, db: str, sql: str, params=()) -> list[dict]:
    """Read a store through the Worker directly (an independent look at where the data is)."""
    async def go():
        async with httpx.AsyncClient() as h:
            return (await WorkerSqlDatabase(WorkerClient(h, url=stack.url, secret=stack.secret), db).execute(
                sql, params)).rows
    return asyncio.run(go())


def emulator_counters(stack) -> dict:
    return httpx.get(f"{stack.admin_url}/counters", timeout=10).json()


def capture(http, org, content: str) -> str:
    r = http.post("/v1/thoughts", json={"content": content}, headers=org.headers)
    assert r.status_code == 201, r.text
    return r.json()["id"]


def test_the_newcomer_path_runs_on_the_worker(wlive, http, stack):
    health = http.get("/health").json()
    assert (health["sql"], health["vectors"], health["embedder"]) == ("worker", "worker", "workers-ai")
    a, b = signup(wlive, "wk-a"), signup(wlive, "wk-b")

    notes = {
        "cache": "Checkout was slow because the pricing cache expired every minute; we raised the TTL to one hour.",
        "garden": "Tomatoes need six hours of direct sunlight and deep watering twice a week in July.",
        "tax": "Quarterly estimated taxes are due in April, June, September and January.",
    }
    ids = {name: capture(http, a, text) for name, text in notes.items()}
    # keyword side at once, before any embedding
    hits = http.post("/v1/search", json={"query": "pricing cache"}, headers=a.headers).json()["results"]
    assert hits and hits[0]["document_id"] == ids["cache"]
    for tid in ids.values():
        detail = wlive.wait_indexed(a.headers, tid, timeout=60)
        assert detail["indexing"]["state"] == "indexed", detail
    r = http.post("/v1/search", json={"query": "tomatoes sunlight watering", "top_k": 3, "explain": True},
                  headers=a.headers)
    assert r.status_code == 200, r.text
    top = r.json()["results"][0]
    assert top["document_id"] == ids["garden"] and top["explain"]["vector_rank"] == 1

    # a conversation: created, appended to, read back, found by search
    r = http.post("/v1/conversations", json={"title": "deploy chat"}, headers=a.headers)
    assert r.status_code == 201, r.text
    cid = r.json()["id"]
    msgs = [{"role": "user", "content": "When do we rotate the staging certificates?"},
            {"role": "assistant", "content": "Staging certificates rotate on the first Monday of each quarter."}]
    r = http.post(f"/v1/conversations/{cid}/messages", json={"messages": msgs}, headers=a.headers)
    assert r.status_code == 201, r.text
    got = http.get(f"/v1/conversations/{cid}/messages", headers=a.headers).json()
    assert [m["content"] for m in got["messages"]] == [m["content"] for m in msgs]
    deadline = time.monotonic() + 60
    while True:
        found = http.post("/v1/search", json={"query": "staging certificates rotate", "kinds": ["conversation"]},
                          headers=a.headers).json()
        if any(h.get("conversation_id") == cid for h in found["results"]) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert any(h.get("conversation_id") == cid for h in found["results"]), found

    # another organization sees none of it: 404, nothing changed
    assert_error(http.get(f"/v1/thoughts/{ids['cache']}", headers=b.headers), 404)
    assert_error(http.delete(f"/v1/thoughts/{ids['cache']}", headers=b.headers), 404)
    assert_error(http.get(f"/v1/conversations/{cid}", headers=b.headers), 404)
    assert http.post("/v1/search", json={"query": "pricing cache tomatoes"}, headers=b.headers).json()["results"] == []
    assert http.get(f"/v1/thoughts/{ids['cache']}", headers=a.headers).status_code == 200

    # export, then delete the organization: its key stops, its Durable Object and vectors are emptied, its route goes
    r = http.get("/v1/org/export", headers=a.headers)
    assert r.status_code == 200, r.text
    exported = [json.loads(line) for line in r.content.splitlines() if line.strip()]
    assert {t for t in notes.values()} <= {rec.get("content") for rec in exported}
    assert worker_sql(stack, f"org:{a.id}", "SELECT COUNT(*) AS n FROM documents") == [{"n": 3}]
    r = http.delete("/v1/org", params={"confirm": a.slug}, headers=a.headers)
    assert r.status_code == 204, r.text
    assert_error(http.get("/v1/thoughts", headers=a.headers), 401, "unauthenticated")
    left = worker_sql(stack, f"org:{a.id}", "SELECT (SELECT COUNT(*) FROM documents) + (SELECT COUNT(*) FROM chunks) + "
                      "(SELECT COUNT(*) FROM conversations) + (SELECT COUNT(*) FROM messages) + "
                      "(SELECT COUNT(*) FROM chunks_fts) AS n")
    assert left == [{"n": 0}]
    assert worker_sql(stack, "control", "SELECT COUNT(*) AS n FROM org_databases WHERE organization_id = ?",
                      (a.id,)) == [{"n": 0}]
    httpx.post(f"{stack.admin_url}/vectorize/flush", timeout=10)
    vec = httpx.post(f"{stack.emulator_url}/accounts/test-account/vectorize/v2/indexes/{stack.index}/query",
                     headers={"Authorization": "Bearer test-token"}, timeout=10,
                     json={"vector": [0.1] * 768, "topK": 10, "namespace": a.id}).json()["result"]["matches"]
    assert vec == []
    assert http.get("/v1/thoughts", headers=b.headers).status_code == 200


async def test_search_over_mcp(wlive):
    org = signup(wlive, "wk-mcp")
    async with mcp_session(org.mcp_url, org.headers) as s:
        cap = await s.call_tool("capture_thought", {"content": "The staging database password rotates every 30 days."})
        assert not cap.isError, cap.content
        tid = cap.structuredContent["id"]
        found = await s.call_tool("semantic_search", {"query": "staging password rotation", "top_k": 5})
        assert found.structuredContent["results"][0]["document_id"] == tid


def test_a_knowledge_base_syncs_and_is_searchable_on_the_worker(wlive, stack):
    org = signup(wlive, "wk-kb")
    with wlive.client(headers=org.headers) as c:
        r = c.post("/v1/knowledge-bases", json={"slug": "coop", "visibility": "open", "source": {"type": "upload"}})
        assert r.status_code == 201, r.text
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w") as z:
            for path, data in vault_files().items():
                z.writestr(f"vault-main/{path}", data if isinstance(data, bytes) else data.encode())
        r = c.post("/v1/knowledge-bases/coop/import", content=buf.getvalue(), headers={"content-type": "application/zip"})
        assert r.status_code == 202, r.text
        sync_id, deadline = r.json()["id"], time.monotonic() + 120
        while True:
            view = c.get("/v1/knowledge-bases/coop").json()
            last = view["last_sync"]
            if last and last["id"] == sync_id and last["state"] in ("succeeded", "failed") and \
                    view["chunks"] == view["chunks_searchable"]:
                break
            assert time.monotonic() < deadline, view
            time.sleep(0.2)
        assert last["state"] == "succeeded", view
        page = c.get(f"/kb/{org.slug}/coop/api/v1/entries", params={"limit": 100}).json()
        assert set(TYPES_BY_ID) <= {e["id"] for e in page["entries"]}
        entry = sorted(TYPES_BY_ID)[0]
        hits = c.get(f"/kb/{org.slug}/coop/api/v1/search", params={"q": KEYWORDS[entry]}).json()["results"]
        assert hits and entry in {h.get("id") or h.get("entry_id") for h in hits}, hits
    # its entries are in the organization's own Durable Object
    rows = worker_sql(stack, f"org:{org.id}", "SELECT COUNT(*) AS n FROM knowledge_entries WHERE organization_id = ?",
                      (org.id,))
    assert rows[0]["n"] >= len(TYPES_BY_ID)


def test_each_organization_is_its_own_durable_object(wlive, http, stack):
    quiet, crowded = signup(wlive, "wk-quiet"), signup(wlive, "wk-crowded")
    capture(http, quiet, "Quokkabell migration plan: move the archive next Tuesday.")
    capture(http, quiet, "Lunch order for the offsite: twelve sandwiches and fruit.")

    def keyword_score() -> float:
        r = http.post("/v1/search", json={"query": "quokkabell archive", "explain": True, "min_score": 0},
                      headers=quiet.headers)
        assert r.status_code == 200, r.text
        hit = next(h for h in r.json()["results"] if h["explain"].get("keyword_score") is not None)
        return hit["explain"]["keyword_score"]

    before = keyword_score()
    for i in range(12):  # the other organization floods the same words: bm25 statistics must not move
        capture(http, crowded, f"Quokkabell archive report {i}: quokkabell archive quokkabell.")
    assert keyword_score() == before
    # the routing names two objects, and each holds only its own organization's rows
    routes = worker_sql(stack, "control", "SELECT organization_id, backend, location FROM org_databases WHERE "
                        "organization_id IN (?, ?) ORDER BY location", (quiet.id, crowded.id))
    assert {(r["backend"], r["location"]) for r in routes} == {("worker", f"org:{quiet.id}"),
                                                                ("worker", f"org:{crowded.id}")}
    for org, n in ((quiet, 2), (crowded, 12)):
        rows = worker_sql(stack, f"org:{org.id}", "SELECT organization_id, COUNT(*) AS n FROM documents GROUP BY 1")
        assert rows == [{"organization_id": org.id, "n": n}]


def test_cloudflare_check_asks_the_worker(stack, trap, capsys, tmp_path):
    """`memex cloudflare check --json` on the Worker backend pings the Worker (protocol, version, bundled org schema),
    reads (--fix: applies) the control database's migrations and the bound index through it, never Cloudflare's REST
    API; a wrong secret and an index the Worker does not bind are reported missing (exit 1)."""
    settings = dict(data_dir=tmp_path, backend="worker", worker_url=stack.url, worker_secret=stack.secret,
                    embedder="workers-ai", cloudflare_vectorize_index=stack.index, cloudflare_account_id=trap.account,
                    cloudflare_api_token=trap.token, cloudflare_api_base_url=trap.base_url)
    rest_before = trap.counters_snapshot()["total"]

    def check(fix: bool = False, **changes) -> tuple[int, dict]:
        rc = run_check(Settings(**{**settings, **changes}), fix=fix, as_json=True)
        return rc, json.loads(capsys.readouterr().out)

    # --fix applies the control database's pending migrations through the Worker (none once the service has run)
    rc, report = check(fix=True)
    assert rc == 0, report
    rc, report = check()
    items = {i["what"]: i for i in report["items"]}
    assert rc == 0 and report["ok"], report
    assert {w: i["status"] for w, i in items.items()} == {
        "settings": "ok", "Worker": "ok", "org schema": "ok", "migrations": "ok", "Workers AI": "ok",
        "Vectorize index": "ok"}, report
    assert "protocol 1" in items["Worker"]["detail"]
    assert discover(ORG_DIR)[-1].name in items["org schema"]["detail"]
    assert f"all {len(discover(CONTROL_DIR))} applied" in items["migrations"]["detail"]
    assert f"{stack.index}: 768 dimensions" in items["Vectorize index"]["detail"]
    assert report["cloudflare"]["worker"]["requests"] >= 4 and report["cloudflare"]["worker"]["failures"] == 0

    rc, report = check(worker_secret="w" * 40)
    assert rc == 1 and [(i["what"], i["status"]) for i in report["items"]] == [("settings", "ok"),
                                                                            ("Worker secret", "missing")], report
    rc, report = check(cloudflare_vectorize_index="memex-not-bound")
    index = next(i for i in report["items"] if i["what"] == "Vectorize index")
    assert rc == 1 and index["status"] == "missing" and "binds no index" in index["detail"], report
    assert trap.counters_snapshot()["total"] == rest_before  # no REST call: the Worker answered everything


def test_concurrent_captures_share_worker_requests(wlive, http, stack):
    """Eight agents capture at once: until every thought is indexed and its vector write confirmed, the service sends
    the Worker fewer than 2.5 requests per capture, one of them the capture's own (the job worker's rounds work on all
    organizations at once, and their ops share requests; before, each organization's round was its own requests: 4.6
    measured here, 2.9 with every op coalesced). Waiting reads the stores through another client, so only the
    service's requests count."""
    orgs = [signup(wlive, "wk-burst") for _ in range(8)]
    for o in orgs:  # first use of each key and organization (authentication, routing) out of the figure
        wlive.wait_indexed(o.headers, capture(http, o, f"{o.slug}: warm-up note about the greenhouse."), timeout=60)
    worker = wlive.memex.backend.worker

    def settled() -> bool:
        return all(worker_sql(stack, f"org:{o.id}", "SELECT COUNT(*) AS n FROM chunks WHERE indexed_at IS NULL OR "
                              "vector_mutation IS NOT NULL")[0]["n"] == 0 for o in orgs) and \
            all(worker_sql(stack, f"org:{o.id}", "SELECT COUNT(*) AS n FROM jobs")[0]["n"] == 0 for o in orgs)

    deadline = time.monotonic() + 60
    while not settled():
        assert time.monotonic() < deadline
        time.sleep(0.2)
    before = worker.requests
    errors: list[str] = []

    def agent(o) -> None:
        with wlive.client() as c:
            for j in range(5):
                r = c.post("/v1/thoughts", headers=o.headers,
                           json={"content": f"{o.slug} field note {j}: the copper wire shipment {j} left the depot."})
                if r.status_code != 201:
                    errors.append(r.text)

    threads = [threading.Thread(target=agent, args=(o,)) for o in orgs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    deadline = time.monotonic() + 120
    while not settled():
        assert time.monotonic() < deadline, "the captures were not indexed"
        time.sleep(0.2)
    per_capture = (worker.requests - before) / 40
    print(f"\nWorker requests per capture (8 agents at once, until indexed): {per_capture:.2f}; "
          f"coalesced ops: {worker.coalesced}")
    assert per_capture < 2.5, worker.snapshot()
    assert worker.coalesced > 0


def test_no_cloudflare_rest_call_on_the_data_path(wlive, http, stack, trap):
    """After every test above (module order): the trap saw nothing; the emulator saw only Vectorize and Workers AI
    calls (the Worker's), no D1; and the service's own Worker requests per capture are counted."""
    org = signup(wlive, "wk-count")
    worker = wlive.memex.backend.worker
    before = worker.requests
    tids = [capture(http, org, f"Measurement note {i}: the flux capacitor reading was {i * 7} units.") for i in range(10)]
    for tid in tids:
        wlive.wait_indexed(org.headers, tid, timeout=60)
    per_capture = (worker.requests - before) / len(tids)
    print(f"\nWorker requests per capture (signed up, 10 captures, until indexed): {per_capture:.1f}; "
          f"ops: {worker.snapshot()['ops']}")
    assert trap.counters_snapshot()["total"] == 0
    counters = emulator_counters(stack)
    assert counters["d1"] == 0 and counters["vectorize"] > 0 and counters["ai"] > 0, counters
    assert wlive.memex.backend.cloudflare_stats() == {"worker": worker.snapshot()}
    assert worker.requests > 0 and worker.failures == 0
