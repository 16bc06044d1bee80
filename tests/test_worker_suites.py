"""The cross-tenant suite (tests/test_cross_tenant.py), the thoughts API suite (tests/test_thoughts_api.py) and the
tenancy suite (tests/test_tenancy_api.py) once more, on the Worker backend: the same test functions, imported here,
run against ``memex cloudflare dev``'s stack (``wrangler dev --local``: D1 and a SQLite Durable Object per
organization) with the service on ``MEMEX_BACKEND=worker`` and the local MiniLM embedder (as the suites expect; its
384-dimensional vectors in an index of their own). Left out: the tests that name a backend's own settings or
fixtures (health's sql/vectors, the CLI run, the rate-limit fixture). The fixtures ``live`` and ``kbt`` are this
module's: ``WorkerLive`` reads the stores through the Worker's protocol (an independent look at what the service
stored: the control database, each organization's Durable Object) and the vectors from the emulator's Vectorize.
Skipped, with the reason, when Node or worker/node_modules is missing."""

from __future__ import annotations

import json
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]
if shutil.which("node") is None or shutil.which("npm") is None:
    pytest.skip("the Worker tests need Node.js and npm on PATH", allow_module_level=True)
if not (ROOT / "worker" / "node_modules" / ".bin" / "wrangler").exists():
    pytest.skip("the Worker's npm packages are not installed: run `npm ci --prefix worker`", allow_module_level=True)

from api.cloudflare_dev_cli import _provision_index, start_dev  # noqa: E402
from services.adapters.cloudflare.worker_client import WorkerClient, decode_value  # noqa: E402
from tests.conftest import _CONTROL_TABLES, Live, signup, start_live  # noqa: E402
from tests.kb_published import create_kb, git_vault, wait_synced  # noqa: E402
from tests.test_cross_tenant import (  # noqa: E402,F401  (the suite, collected here on the Worker backend)
    KB_BRANCH,
    KbTenants,
    pair,
    test_kb_management_by_another_org_is_404_and_changes_nothing,
    test_kb_private_published_surfaces_do_not_exist_for_another_org,
    test_kb_sync_errors_are_never_visible_to_another_org,
    test_kb_tools_on_the_org_mcp_cannot_name_another_orgs_knowledge_base,
    test_mcp_other_org_url_is_404_and_other_ids_are_not_found,
    test_request_bodies_cannot_name_an_organization,
    test_rest_listings_and_search_never_show_the_other_org,
    test_rest_other_orgs_ids_are_404_and_nothing_changes,
    test_same_content_in_two_orgs_stays_two_thoughts,
    test_vectors_live_in_their_own_namespace,
)
from tests.test_tenancy_api import (  # noqa: E402,F401
    test_expired_and_malformed_keys_are_401,
    test_key_lifecycle_and_scopes,
    test_signup_returns_the_raw_key_once,
    test_slug_is_unique,
    test_slug_rules,
)
from tests.test_thoughts_api import (  # noqa: E402,F401
    test_bad_input_is_a_clear_4xx_and_changes_nothing,
    test_bodies_must_be_json_and_utf8,
    test_capture_is_idempotent_on_content,
    test_capture_is_keyword_searchable_at_once_and_vector_indexed_soon,
    test_delete_leaves_nothing_behind,
    test_list_recent_pages_with_a_stable_cursor,
    test_long_note_is_chunked_within_model_limit,
    test_semantic_search_finds_paraphrase,
    test_seed_routes_work_for_existing_clients,
)

MINILM_INDEX = "memex-minilm-384"


class WorkerLive(Live):
    """``Live`` whose ``sql`` and ``vectors`` read through the Worker (synchronously: async tests call them too)."""

    stack: object = None

    def _query(self, db: str, query: str, params=()) -> list[tuple]:
        stack = self.stack
        body = json.dumps({"v": 1, "ops": [{"op": "sql.batch", "db": db, "statements": [
            {"sql": query, "params": list(params)}]}]}).encode()
        signer = WorkerClient(None, url=stack.url, secret=stack.secret)  # type: ignore[arg-type]  # headers only
        r = httpx.post(f"{stack.url}/v1/rpc", content=body, headers=signer.signed_headers(body), timeout=30)
        assert r.status_code == 200, r.text
        res = r.json()["results"][0]
        assert res["ok"], res
        out = res["results"][0]
        return [tuple(decode_value(v) for v in row) for row in out["rows"]]

    def sql(self, query: str, params=(), *, org: str | None = None) -> list[tuple]:
        if _CONTROL_TABLES.search(query):
            return self._query("control", query, params)
        orgs = [r[0] for r in self._query("control", "SELECT organization_id FROM org_databases ORDER BY created_at")]
        named = [p for p in (org, *params) if isinstance(p, str) and p in orgs]
        results = [self._query(f"org:{o}", query, params) for o in (named[:1] or orgs)]
        if len(results) == 1:
            return results[0]
        head = query.lstrip().upper()
        if results and all(len(r) == 1 for r in results) and head.startswith(("SELECT COUNT(", "SELECT SUM(",
                                                                                  "SELECT COALESCE(MAX(", "SELECT MAX(")):
            pick = max if "MAX(" in head.split("FROM")[0] else sum
            return [tuple(pick(r[0][i] or 0 for r in results) for i in range(len(results[0][0])))]
        return [row for r in results for row in r]

    def vectors(self, prefix: str = "") -> list[tuple[str, str, dict]]:
        stack = self.stack
        httpx.post(f"{stack.admin_url}/vectorize/flush", timeout=30)
        base = f"{stack.emulator_url}/accounts/test-account/vectorize/v2/indexes/{MINILM_INDEX}"
        ids, cursor, out = [], None, []
        with httpx.Client(headers={"Authorization": "Bearer test-token"}, timeout=30) as c:
            while True:
                page = c.get(f"{base}/list", params={"count": 1000, **({"cursor": cursor} if cursor else {})}).json()
                ids += [v["id"] for v in page["result"]["vectors"] if v["id"].startswith(prefix)]
                if not page["result"].get("isTruncated"):
                    break
                cursor = page["result"]["nextCursor"]
            for i in range(0, len(ids), 100):
                got = c.post(f"{base}/get_by_ids", json={"ids": ids[i:i + 100]}).json()["result"]
                out += [(v["id"], v.get("namespace"), v.get("metadata") or {}) for v in got]
        return out


@pytest.fixture(scope="module")
def stack():
    with tempfile.TemporaryDirectory() as tmp:
        with start_dev(ROOT, port=0, state_dir=Path(tmp) / "dev", vector_lag_ms=50, say=lambda _: None) as dev:
            yield dev


@contextmanager
def worker_live(stack, tmp: Path, **overrides):
    _provision_index(stack.emulator_url, MINILM_INDEX, 384)
    server, ctx = start_live(tmp, embedder="local", backend="worker", worker_url=stack.url,
                             worker_secret=stack.secret, cloudflare_vectorize_index=MINILM_INDEX, **overrides)
    live = WorkerLive(server.base_url, server.memex, server.data_dir, backend="worker")
    live.stack = stack
    try:
        yield live
    finally:
        ctx.__exit__(None, None, None)


@pytest.fixture(scope="module")
def live(stack):
    with tempfile.TemporaryDirectory() as tmp, worker_live(stack, Path(tmp)) as server:
        yield server


@pytest.fixture(scope="module")
def kbt(stack):
    """tests/test_cross_tenant.py's ``kbt`` on the Worker backend."""
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        with worker_live(stack, tmp / "service", kb_local_roots=[str(tmp / "vaults")]) as server:
            vault = git_vault(tmp / "vaults" / "handbook")
            notes = git_vault(tmp / "vaults" / "notes", {"data/concepts/tithe.md": (
                "---\ntitle: Tithe\npublish: true\ndate: 2024-01-01\n---\n\nA tenth, set aside.\n").encode()})
            a, b = signup(server, "kb-tenant-a"), signup(server, "kb-tenant-b")
            with server.client() as c:
                create_kb(c, a, "broken", str(vault.path), branch=KB_BRANCH)
                create_kb(c, b, "notes", str(notes.path))
                created = create_kb(c, a, "handbook", str(vault.path))
                r = c.post("/v1/knowledge-bases", json={"slug": "drop", "source": {"type": "upload"}}, headers=a.headers)
                assert r.status_code == 201, r.text
                kbs = {**wait_synced(c, a, ["broken"], state="failed"), **wait_synced(c, a, ["handbook"])}
                kbs["drop"] = c.get("/v1/knowledge-bases/drop", headers=a.headers).json()
                wait_synced(c, b, ["notes"])
            yield KbTenants(server, a, b, kbs, created["webhook_secret"], str(vault.path))
            vault.close()
            notes.close()
