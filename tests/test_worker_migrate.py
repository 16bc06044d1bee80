"""`memex cloudflare migrate`, for real: a REST-backed deployment (D1 per organization and Vectorize on the Cloudflare
emulator, filled through the API) is moved by the command into the local Worker (`wrangler dev --local`: the control
database on its D1 binding, one SQLite Durable Object per organization); the service on the Worker backend then serves
the old thoughts and conversations to the old keys (keyword and vector search: the vectors stayed in the index both
backends read), tenancy intact; a second run moves nothing. Skipped, with the reason, without Node or
worker/node_modules (`npm ci --prefix worker`)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if shutil.which("node") is None or shutil.which("npm") is None:
    pytest.skip("the Worker tests need Node.js and npm on PATH", allow_module_level=True)
if not (ROOT / "worker" / "node_modules" / ".bin" / "wrangler").exists():
    pytest.skip("the Worker's npm packages are not installed: run `npm ci --prefix worker`", allow_module_level=True)

from api.cloudflare_dev_cli import start_dev  # noqa: E402
from tests.conftest import assert_error, signup, start_live  # noqa: E402

REST_CONTROL = "memex-rest-control"


def _migrate(stack, rest: dict) -> dict:
    env = {**os.environ, "CLOUDFLARE_ACCOUNT_ID": rest["cloudflare_account_id"],
           "CLOUDFLARE_API_TOKEN": rest["cloudflare_api_token"], "CLOUDFLARE_D1_DATABASE_ID": REST_CONTROL,
           "CLOUDFLARE_API_BASE_URL": rest["cloudflare_api_base_url"], "CLOUDFLARE_VECTORIZE_INDEX": stack.index,
           "MEMEX_WORKER_URL": stack.url, "MEMEX_WORKER_SECRET": stack.secret}
    result = subprocess.run([sys.executable, "-m", "api.cli", "cloudflare", "migrate", "--json"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


def test_a_rest_deployment_moves_into_the_worker_and_serves_the_old_keys():
    with tempfile.TemporaryDirectory() as tmp, start_dev(ROOT, port=0, state_dir=Path(tmp) / "dev",
                                                          vector_lag_ms=0, say=lambda _: None) as stack:
        rest = dict(sql="d1", vectors="vectorize", cloudflare_account_id="test-account",
                    cloudflare_api_token="test-token", cloudflare_d1_database_id=REST_CONTROL,
                    cloudflare_vectorize_index=stack.index, cloudflare_api_base_url=stack.emulator_url,
                    cloudflare_budget_limit=1_000_000)
        server, ctx = start_live(Path(tmp) / "rest", embedder="workers-ai", **rest)
        try:
            a, b = signup(server, "mig-a"), signup(server, "mig-b")
            notes = {"garden": "Tomatoes need six hours of direct sunlight and deep watering twice a week.",
                     "tax": "Quarterly estimated taxes are due in April, June, September and January."}
            with server.client() as c:
                ids = {}
                for name, text in notes.items():
                    r = c.post("/v1/thoughts", headers=a.headers, json={"content": text, "wait": True})
                    assert r.status_code == 201, r.text
                    ids[name] = r.json()["id"]
                r = c.post("/v1/thoughts", headers=b.headers, json={"content": "Org B's own note about sourdough."})
                assert r.status_code == 201, r.text
                cid = c.post("/v1/conversations", headers=a.headers, json={"title": "certs"}).json()["id"]
                r = c.post(f"/v1/conversations/{cid}/messages", headers=a.headers, json={"messages": [
                    {"role": "user", "content": "When do the staging certificates rotate?"}]})
                assert r.status_code == 201, r.text
            for tid in ids.values():
                assert server.wait_indexed(a.headers, tid, timeout=60)["indexing"]["state"] == "indexed"
        finally:
            ctx.__exit__(None, None, None)  # writers stopped, as the command asks

        report = _migrate(stack, rest)
        assert report["layout"] == "per-organization" and report["control"] == "copied"
        assert set(report["moved"]) == {a.id, b.id}
        assert report["moved"][a.id]["documents"] == 2 and report["moved"][a.id]["messages"] == 1

        server, ctx = start_live(Path(tmp) / "worker", embedder="workers-ai", backend="worker", worker_url=stack.url,
                                 worker_secret=stack.secret, cloudflare_vectorize_index=stack.index)
        try:
            with server.client() as c:
                got = c.get(f"/v1/thoughts/{ids['garden']}", headers=a.headers)
                assert got.status_code == 200 and got.json()["content"] == notes["garden"]
                hits = c.post("/v1/search", headers=a.headers, json={"query": "quarterly taxes due", "explain": True,
                                                                      "kinds": ["thought"]}).json()["results"]
                assert hits and hits[0]["document_id"] == ids["tax"]
                assert hits[0]["explain"]["vector_rank"] is not None, hits[0]  # the vectors were found where they were
                msgs = c.get(f"/v1/conversations/{cid}/messages", headers=a.headers).json()["messages"]
                assert [m["content"] for m in msgs] == ["When do the staging certificates rotate?"]
                assert_error(c.get(f"/v1/thoughts/{ids['garden']}", headers=b.headers), 404)
                assert c.post("/v1/search", headers=b.headers, json={"query": "tomatoes taxes"}).json()["results"] \
                    and all(h["document_id"] not in ids.values() for h in c.post(
                        "/v1/search", headers=b.headers, json={"query": "tomatoes taxes"}).json()["results"])
                r = c.post("/v1/thoughts", headers=a.headers, json={"content": "A new note after the move."})
                assert r.status_code == 201, r.text
        finally:
            ctx.__exit__(None, None, None)

        again = _migrate(stack, rest)
        assert again["moved"] == {} and set(again["skipped"]) == {a.id, b.id}
