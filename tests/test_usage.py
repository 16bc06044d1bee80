"""GET /v1/usage through real HTTP, on both backends: the counts are the organization's own (checked against its
database files directly), another organization's key sees only its own, the limits are the deployment's, and no
key is 401."""

from __future__ import annotations

import io
import re
import time
import zipfile

from api.limits import MAX_BATCH_BODY_BYTES, MAX_BODY_BYTES
from tests.conftest import assert_error, signup

COUNTED = {"thoughts": "documents", "chunks": "chunks", "conversations": "conversations",
           "knowledge_bases": "knowledge_bases", "knowledge_entries": "knowledge_entries"}

ENTRY = "---\ntitle: {0}\ntype: article\npublish: true\n---\n\n# {0}\n\n{1}\n"


def _zip(files: dict[str, str]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name, text in files.items():
            zf.writestr(name, text)
    return buf.getvalue()


def _settled(c, headers, kb: str, sync_id: str) -> None:
    deadline = time.monotonic() + 90
    while True:
        last = c.get(f"/v1/knowledge-bases/{kb}", headers=headers).json()["last_sync"]
        if last and last["id"] == sync_id and last["state"] in ("succeeded", "failed"):
            assert last["state"] == "succeeded", last
            return
        assert time.monotonic() < deadline, last
        time.sleep(0.1)


def test_usage_counts_what_the_organization_holds_and_only_that(hlive):
    a, b = signup(hlive, "usage-a"), signup(hlive, "usage-b")
    with hlive.client() as c:
        for text in ("the boiler needs servicing in march", "invoices go to the shared drive",
                     "standup moved to ten o'clock"):
            assert c.post("/v1/thoughts", json={"content": text}, headers=a.headers).status_code == 201
        conv = c.post("/v1/conversations", json={"title": "planning"}, headers=a.headers).json()["id"]
        r = c.post(f"/v1/conversations/{conv}/messages", headers=a.headers,
                   json={"messages": [{"role": "user", "content": "shall we meet on friday?"},
                                      {"role": "assistant", "content": "friday at noon works"},
                                      {"role": "user", "content": "booked"}]})
        assert r.status_code == 201, r.text
        r = c.post("/v1/knowledge-bases", headers=a.headers, json={"slug": "handbook", "source": {"type": "upload"}})
        assert r.status_code == 201, r.text
        r = c.post("/v1/knowledge-bases/handbook/import", headers={**a.headers, "content-type": "application/zip"},
                   content=_zip({"vault/docs/people/onboarding.md": ENTRY.format("Onboarding", "Read the handbook first."),
                                 "vault/docs/people/holidays.md": ENTRY.format("Holidays", "Twenty-five days a year.")}))
        assert r.status_code == 202, r.text
        _settled(c, a.headers, "handbook", r.json()["id"])
        assert c.post("/v1/thoughts", json={"content": "b's only thought"}, headers=b.headers).status_code == 201

        mine = c.get("/v1/usage", headers=a.headers)
        assert mine.status_code == 200, mine.text
        theirs = c.get("/v1/usage", headers=b.headers).json()
    usage = mine.json()
    assert usage["organization_id"] == a.id and theirs["organization_id"] == b.id
    counts = usage["counts"]
    for field, table in COUNTED.items():  # the organization's own rows, read from its database file
        expected = hlive.sql(f"SELECT COUNT(*) FROM {table} WHERE organization_id = ?", (a.id,))[0][0]
        assert counts[field] == expected, (field, counts, expected)
    assert counts["thoughts"] == 3 and counts["conversations"] == 1 and counts["messages"] == 3
    assert counts["knowledge_bases"] == 1 and counts["knowledge_entries"] == 2
    assert counts["chunks"] >= 3 + 2 + 1 and counts["pending_jobs"] >= 0
    # the other organization sees its own one thought, nothing of the first
    assert theirs["counts"] == {**theirs["counts"], "thoughts": 1, "conversations": 0, "messages": 0,
                                "knowledge_bases": 0, "knowledge_entries": 0}
    assert 1 <= theirs["counts"]["chunks"] < counts["chunks"]

    storage = usage["storage"]
    if hlive.backend == "embedded":
        location = hlive.data_dir / "orgs" / hlive.org_location(a.id)
        assert storage["database_bytes"] >= (location / "memex.sqlite3").stat().st_size > 0
        assert storage["vector_bytes"] >= 0
    else:  # D1 and Vectorize do not say
        assert storage == {"database_bytes": None, "vector_bytes": None}

    llm = usage["llm"]
    assert llm["configured"] is False and (llm["calls"], llm["tokens"], llm["refused"]) == (0, 0, 0)
    settings = hlive.memex.settings
    assert (llm["calls_per_day"], llm["tokens_per_day"]) == (settings.llm_calls_per_day, settings.llm_tokens_per_day)
    assert re.fullmatch(r"\d{4}-\d\d-\d\d", llm["day"]), llm

    limits = usage["limits"]
    assert limits == {**limits, "max_request_body_bytes": MAX_BODY_BYTES, "max_batch_body_bytes": MAX_BATCH_BODY_BYTES,
                      "max_content_bytes": settings.max_content_bytes, "max_metadata_bytes": settings.max_metadata_bytes,
                      "max_batch_items": 1000, "max_messages_per_append": 100,
                      "credential_requests_per_minute": settings.key_rate_per_minute,
                      "organization_requests_per_minute": settings.org_rate_per_minute}


def test_usage_needs_a_credential_and_the_read_scope_is_enough(hlive):
    org = signup(hlive, "usage-auth")
    with hlive.client() as c:
        assert_error(c.get("/v1/usage"), 401, "unauthenticated")
        assert_error(c.get("/v1/usage", headers={"authorization": "Bearer mx_nope_nope"}), 401)
        r = c.post("/v1/keys", json={"name": "reader", "scopes": ["read"]}, headers=org.headers)
        assert r.status_code == 201, r.text
        reader = {"authorization": f"Bearer {r.json()['key']}"}
        got = c.get("/v1/usage", headers=reader)
        assert got.status_code == 200 and got.json()["organization_id"] == org.id
