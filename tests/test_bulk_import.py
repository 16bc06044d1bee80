"""Bulk import: ``POST /v1/thoughts:batch`` (both backends, real HTTP) and ``memex import FILE`` (the shell, on a data
directory): per-item statuses, idempotent per item, tenancy, and everything searchable afterwards."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import assert_error, signup

ROOT = Path(__file__).resolve().parents[1]


def _settled(live, headers, ids: list[str], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    with live.client() as c:
        for tid in ids:
            while c.get(f"/v1/thoughts/{tid}", headers=headers).json()["indexing"]["state"] != "indexed":
                assert time.monotonic() < deadline, tid
                time.sleep(0.05)


def test_a_batch_answers_each_item_as_a_single_capture_would(hlive):
    org = signup(hlive, "bulk")
    items = [{"content": f"Bulk note {i}: the greenhouse vent {i} opens at {10 + i} degrees.", "source": "import"}
             for i in range(120)]
    items += [{"content": items[3]["content"]},  # the same content twice in one batch
              {"content": "x" * (256 * 1024 + 1)},  # too large: refused alone
              {"content": "with wait", "wait": True},  # decisions in a batch are the worker's
              {"content": "metadata too big", "metadata": {"k": "v" * 20_000}}]
    with hlive.client(headers=org.headers) as c:
        r = c.post("/v1/thoughts:batch", json={"items": items})
        assert r.status_code == 200, r.text
        body = r.json()
        assert (body["created"], body["existing"], body["failed"]) == (120, 1, 3)
        results = body["results"]
        assert [x["index"] for x in results] == list(range(len(items)))
        assert all(x["status"] == 201 and x["result"]["decision"] == {"action": "pending"} for x in results[:120])
        assert results[120]["status"] == 200 and results[120]["result"]["id"] == results[3]["result"]["id"]
        assert [x["status"] for x in results[121:]] == [413, 400, 413]
        assert results[121]["error"]["code"] == "payload_too_large" and results[122]["error"]["details"]["field"] == "wait"
        ids = [x["result"]["id"] for x in results[:120]]
        # durable and keyword-searchable at once, embedded by the worker
        hit = c.post("/v1/search", json={"query": "greenhouse vent 57 opens"}).json()["results"]
        assert hit and hit[0]["document_id"] == ids[57]
        _settled(hlive, org.headers, ids)
        # sending the batch again stores nothing twice
        again = c.post("/v1/thoughts:batch", json={"items": items[:120]}).json()
        assert again["created"] == 0 and again["existing"] == 120
        assert [x["result"]["id"] for x in again["results"]] == ids
        assert hlive.sql("SELECT COUNT(*) FROM documents WHERE organization_id = ?", (org.id,)) == [(120,)]
        assert_error(c.post("/v1/thoughts:batch", json={"items": []}), 400)
        assert_error(c.post("/v1/thoughts:batch", json={"items": [{"content": "n"}] * 1001}), 400)


def test_a_batch_is_the_callers_organizations_alone(hlive):
    a, b = signup(hlive, "bulk-a"), signup(hlive, "bulk-b")
    text = "A's unique note about the lighthouse fuel ledger."
    with hlive.client() as c:
        mine = c.post("/v1/thoughts:batch", json={"items": [{"content": text}]}, headers=a.headers).json()
        theirs = c.post("/v1/thoughts:batch", json={"items": [{"content": text}]}, headers=b.headers).json()
        # the same content in another organization is that organization's own new thought: nothing of A shows
        ours, their = mine["results"][0], theirs["results"][0]
        assert their["status"] == 201 and their["result"]["id"] != ours["result"]["id"]
        assert hlive.sql("SELECT COUNT(*) FROM documents WHERE organization_id = ?", (a.id,)) == [(1,)]
        key = c.post("/v1/keys", json={"name": "reader", "scopes": ["read"]}, headers=a.headers).json()["key"]
        assert_error(c.post("/v1/thoughts:batch", json={"items": [{"content": "no"}]},
                            headers={"authorization": f"Bearer {key}"}), 403)
        assert_error(c.post("/v1/thoughts:batch", json={"items": [{"content": "no"}]}), 401)


def test_memex_import_streams_a_jsonl_file_into_an_organization(tmp_path):
    env = {**os.environ, "MEMEX_EMBEDDER": "hash", "MEMEX_DATA_DIR": str(tmp_path / "data"), "MEMEX_PROGRESS": "always"}
    memex = [sys.executable, "-m", "api.cli"]
    subprocess.run([*memex, "org", "create", "--name", "Acme", "--slug", "acme"], env=env, cwd=ROOT, check=True,
                   capture_output=True)
    lines = [json.dumps({"content": f"Imported note {i} about the seed library shelf {i}."}) for i in range(300)]
    lines.append("this line is not JSON")
    lines.append(json.dumps({"type": "conversation", "title": "support", "messages": [
        {"role": "user", "content": "The seed library shelf 12 is empty."},
        {"role": "assistant", "content": "I will restock shelf 12 with bean seeds."}]}))
    lines.append(json.dumps({"type": "poem", "content": "?"}))
    source = tmp_path / "notes.jsonl"
    source.write_text("\n".join(lines) + "\n")
    run = subprocess.run([*memex, "import", str(source), "--org", "acme", "--batch", "100", "--json"], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 1, run.stderr  # two lines refused
    summary = json.loads(run.stdout)
    assert summary["thoughts"] == {"created": 300, "existing": 0, "refused": 0}
    assert (summary["conversations"], summary["messages"]) == (1, 2)
    assert [e["line"] for e in summary["errors"]] == [301, 303]
    assert summary["indexing"]["jobs"] > 0 and "import acme" in run.stderr and "indexing" in run.stderr
    again = subprocess.run([*memex, "import", str(source), "--org", "acme", "--json"], env=env, cwd=ROOT, capture_output=True,
                           text=True, timeout=300)
    assert json.loads(again.stdout)["thoughts"] == {"created": 0, "existing": 300, "refused": 0}
    missing = subprocess.run([*memex, "import", str(source), "--org", "nobody"], env=env, cwd=ROOT, capture_output=True,
                             text=True, timeout=120)
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
