"""Thoughts over REST, through real HTTP on loopback, on the embedded default (real MiniLM model)."""

from __future__ import annotations

from tests.conftest import assert_error, signup

NOTE = (
    "# Postmortem: checkout latency\n\n"
    "The checkout service slowed down because the Redis connection pool was exhausted during the flash sale.\n\n"
    "We raised the pool size from 50 to 400 and added a circuit breaker around the cache client."
)


def test_capture_is_idempotent_on_content(live, org, client):
    r1 = client.post("/v1/thoughts", json={"content": NOTE, "source": "notes/pm.md", "metadata": {"team": "payments"}},
                     headers=org.headers)
    assert r1.status_code == 201, r1.text
    first = r1.json()
    assert first["created"] is True and first["chunks"] >= 1
    r2 = client.post("/v1/thoughts", json={"content": NOTE}, headers=org.headers)
    assert r2.status_code == 200
    second = r2.json()
    assert second["id"] == first["id"] and second["created"] is False
    assert second["updated_at"] >= first["updated_at"]
    assert live.sql("SELECT COUNT(*) FROM documents WHERE organization_id = ?", (org.id,)) == [(1,)]


def test_capture_is_keyword_searchable_at_once_and_vector_indexed_soon(live, org, client):
    r = client.post("/v1/thoughts", json={"content": "The zebrafish aquarium heater failed on Tuesday."}, headers=org.headers)
    tid = r.json()["id"]
    # Searchable immediately through the keyword side, before any embedding has run.
    hits = client.post("/v1/search", json={"query": "zebrafish heater"}, headers=org.headers).json()["results"]
    assert hits and hits[0]["document_id"] == tid
    detail = live.wait_indexed(org.headers, tid)
    assert detail["indexing"] == {"state": "indexed", "chunks_total": 1, "chunks_indexed": 1}
    assert all(c["indexed"] for c in detail["chunks"])
    assert live.vector_ids(f"{org.id}:{detail['chunks'][0]['id']}")


def test_semantic_search_finds_paraphrase(live, org, client):
    docs = {
        "cache": NOTE,
        "garden": "Tomatoes need six hours of direct sunlight and deep watering twice a week in July.",
        "tax": "Quarterly estimated taxes are due in April, June, September and January.",
    }
    ids = {}
    for name, content in docs.items():
        ids[name] = client.post("/v1/thoughts", json={"content": content}, headers=org.headers).json()["id"]
    for tid in ids.values():
        live.wait_indexed(org.headers, tid)
    # No keyword overlap with the garden note: only the vector side can find it.
    r = client.post("/v1/search", json={"query": "growing vegetables outdoors", "top_k": 3, "explain": True}, headers=org.headers)
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert results[0]["document_id"] == ids["garden"]
    assert results[0]["explain"]["vector_rank"] == 1
    r = client.post("/v1/search", json={"query": "why was checkout slow?", "include_content": True}, headers=org.headers)
    top = r.json()["results"][0]
    assert top["document_id"] == ids["cache"] and top["document_content"] == NOTE
    # whole documents only when asked for (the default hit carries its chunk, not the document)
    r = client.post("/v1/search", json={"query": "why was checkout slow?"}, headers=org.headers)
    top = r.json()["results"][0]
    assert top["document_id"] == ids["cache"] and top.get("document_content") is None and top["chunk_content"]


def test_long_note_is_chunked_within_model_limit(live, org, client):
    paragraphs = [
        f"Section {i}. " + " ".join(f"The {w} subsystem handles request {i * 7 + j}."
                                    for j, w in enumerate(["billing", "search", "auth", "cache", "queue", "storage"] * 3))
        for i in range(12)
    ]
    content = "\n\n".join(paragraphs)
    r = client.post("/v1/thoughts", json={"content": content}, headers=org.headers)
    assert r.status_code == 201
    detail = client.get(f"/v1/thoughts/{r.json()['id']}", headers=org.headers).json()
    assert len(detail["chunks"]) > 1
    assert all(c["token_count"] <= 256 for c in detail["chunks"])
    assert [c["ordinal"] for c in detail["chunks"]] == list(range(len(detail["chunks"])))


def test_list_recent_pages_with_a_stable_cursor(live, client):
    org = signup(live, "pager")
    made = []
    for i in range(7):
        made.append(client.post("/v1/thoughts", json={"content": f"page note number {i}"}, headers=org.headers).json()["id"])
    seen, before, before_id = [], None, None
    while True:
        params = {"limit": 3}
        if before is not None:
            params.update(before=before, before_id=before_id)
        page = client.get("/v1/thoughts", params=params, headers=org.headers).json()
        seen += [t["id"] for t in page["thoughts"]]
        if page["next_before"] is None:
            break
        before, before_id = page["next_before"], page["next_before_id"]
    assert sorted(seen) == sorted(made) and len(seen) == len(set(seen))
    created = [t["created_at"] for t in client.get("/v1/thoughts", params={"limit": 100}, headers=org.headers).json()["thoughts"]]
    assert created == sorted(created, reverse=True)
    # The seed's epoch-ms cursor still works on its own.
    newest = client.get("/thoughts", params={"limit": 1}, headers=org.headers).json()["thoughts"][0]
    older = client.get("/thoughts", params={"limit": 100, "before": newest["created_at"]}, headers=org.headers).json()
    assert all(t["created_at"] < newest["created_at"] for t in older["thoughts"])


def test_delete_leaves_nothing_behind(live, org, client):
    tid = client.post("/v1/thoughts", json={"content": "ephemeral: the wifi password is on the fridge"},
                      headers=org.headers).json()["id"]
    chunk_ids = [c["id"] for c in live.wait_indexed(org.headers, tid)["chunks"]]
    assert live.vector_ids(f"{org.id}:{chunk_ids[0]}")
    assert client.delete(f"/v1/thoughts/{tid}", headers=org.headers).status_code == 204
    assert_error(client.get(f"/v1/thoughts/{tid}", headers=org.headers), 404, "not_found")
    assert live.sql("SELECT COUNT(*) FROM documents WHERE id = ?", (tid,)) == [(0,)]
    assert live.sql("SELECT COUNT(*) FROM chunks WHERE parent_id = ?", (tid,)) == [(0,)]
    assert live.sql("SELECT COUNT(*) FROM chunks_fts WHERE chunks_fts MATCH 'fridge'") == [(0,)]
    assert live.sql("SELECT COUNT(*) FROM documents_fts WHERE documents_fts MATCH 'fridge'") == [(0,)]
    assert live.sql("SELECT COUNT(*) FROM documents_fts WHERE document_id = ?", (tid,)) == [(0,)]
    assert live.sql("SELECT COUNT(*) FROM documents_fts_keys WHERE document_id = ?", (tid,)) == [(0,)]
    assert live.sql("SELECT COUNT(*) FROM jobs WHERE target_id = ?", (tid,)) == [(0,)]
    assert live.vector_ids(f"{org.id}:{chunk_ids[0]}") == []
    assert client.post("/v1/search", json={"query": "wifi password fridge"}, headers=org.headers).json()["results"] == []
    assert_error(client.delete(f"/v1/thoughts/{tid}", headers=org.headers), 404)


def test_seed_routes_work_for_existing_clients(live, org, client):
    r = client.post("/capture", json={"content": "legacy client note about sourdough starters"}, headers=org.headers)
    assert r.status_code == 201
    tid = r.json()["id"]
    assert client.get(f"/thought/{tid}", headers=org.headers).json()["id"] == tid
    assert client.post("/search", json={"query": "sourdough"}, headers=org.headers).json()["results"][0]["document_id"] == tid
    assert any(t["id"] == tid for t in client.get("/thoughts", params={"limit": 5}, headers=org.headers).json()["thoughts"])
    assert client.delete(f"/thought/{tid}", headers=org.headers).status_code == 204


def test_bad_input_is_a_clear_4xx_and_changes_nothing(live, org, client):
    before = live.sql("SELECT COUNT(*) FROM documents WHERE organization_id = ?", (org.id,))
    h = org.headers
    assert_error(client.post("/v1/thoughts", json={"content": 5}, headers=h), 400, "invalid_input")
    assert_error(client.post("/v1/thoughts", json={"content": ""}, headers=h), 400)
    assert_error(client.post("/v1/thoughts", json={"content": "   "}, headers=h), 400)
    assert_error(client.post("/v1/thoughts", json={"content": "x", "organization_id": "org_other"}, headers=h), 400)
    assert_error(client.post("/v1/thoughts", json={"content": "x", "metadata": [1]}, headers=h), 400)
    assert_error(client.post("/v1/thoughts", content=b"{nope", headers={**h, "content-type": "application/json"}), 400)
    big = "a" * (256 * 1024 + 1)
    assert_error(client.post("/v1/thoughts", json={"content": big}, headers=h), 413, "payload_too_large")
    assert_error(client.post("/v1/thoughts", json={"content": "ok", "metadata": {"blob": "b" * 20000}}, headers=h), 413)
    assert_error(client.post("/v1/search", json={"query": ""}, headers=h), 400)
    assert_error(client.post("/v1/search", json={"query": "x", "top_k": 101}, headers=h), 400)
    assert_error(client.post("/v1/search", json={"query": "x", "kinds": ["nope"]}, headers=h), 400)
    assert_error(client.get("/v1/thoughts", params={"limit": 0}, headers=h), 400)
    assert_error(client.get("/v1/thoughts", params={"limit": "many"}, headers=h), 400)
    assert_error(client.put("/v1/thoughts", headers=h), 405, "method_not_allowed")
    assert_error(client.get("/v1/nothing-here", headers=h), 404)
    assert live.sql("SELECT COUNT(*) FROM documents WHERE organization_id = ?", (org.id,)) == before


def test_health_and_docs_are_public(live, client):
    h = client.get("/health").json()
    assert h["status"] == "ok" and "MiniLM" in h["embedding_model"]
    if live.backend == "embedded":
        assert (h["sql"], h["vectors"], h["cloudflare"]) == ("sqlite", "local", None)
    else:  # the Cloudflare request budget is reported
        assert (h["sql"], h["vectors"]) == ("d1", "vectorize")
        assert h["cloudflare"]["budget"]["used"] > 0 and h["cloudflare"]["requests"]["d1"] > 0
    spec = client.get("/schema/openapi.json").json()
    assert spec["openapi"].startswith("3.1")
    page = client.get("/schema/swagger")
    assert page.status_code == 200 and "/schema/assets/swagger-ui-bundle.js" in page.text
    assert client.get("/schema/assets/swagger-ui-bundle.js").status_code == 200


def test_capture_latency_is_not_waiting_for_the_model(live, org, client):
    """The write path acknowledges before embedding: a capture returns pending, the worker finishes later."""
    r = client.post("/v1/thoughts", json={"content": "fresh note " * 40}, headers=org.headers)
    assert r.status_code == 201 and r.json()["indexing"]["state"] == "pending"
    assert live.wait_indexed(org.headers, r.json()["id"])["indexing"]["state"] == "indexed"


def test_bodies_must_be_json_and_utf8(live, org, client):
    h = org.headers
    assert_error(client.post("/v1/thoughts", content=b'{"content": "hi"}', headers={**h, "content-type": "text/plain"}),
                 415, "unsupported_media_type")
    json_h = {**h, "content-type": "application/json"}
    assert_error(client.post("/v1/thoughts", content=b'{"content": "\xff\xfe bad"}', headers=json_h), 400)
    assert_error(client.post("/v1/thoughts", content=b'{"content": "\\ud800 lone"}', headers=json_h), 400)
    assert_error(client.post("/v1/thoughts", content=b'[]', headers=json_h), 400)
    assert_error(client.post("/v1/search", content=b'{"query": "x", "explain": 0}', headers=json_h), 400)
    # FTS5 syntax in a query is treated as words, never as an expression
    for q in ['"*^:()', "NEAR(a b) OR AND NOT", "title:x*", "-"]:
        assert client.post("/v1/search", json={"query": q}, headers=h).status_code == 200
