"""The cross-tenant suite (tests/test_cross_tenant.py), the thoughts API suite (tests/test_thoughts_api.py), the
tenancy suite (tests/test_tenancy_api.py), the conversations suite (tests/test_conversations.py, its integration
tests), the organization lifecycle suite (tests/test_org_lifecycle.py: export, import, delete over HTTP), the
isolation test (tests/test_isolation.py) and the bulk import suite (tests/test_bulk_import.py, over HTTP) once more,
on the Worker backend: the same test functions, imported here, run against ``memex cloudflare dev``'s stack
(``wrangler dev --local``: D1 and a SQLite Durable Object per organization) with the service on
``MEMEX_BACKEND=worker``: ``live`` with the local MiniLM embedder (as the suites expect; its 384-dimensional vectors
in an index of their own), ``hlive`` with the hash embedder (plumbing without the model's cost), each embedder on a
stack of its own (see ``hstack``).
Left out: the tests that name a backend's own settings or fixtures (health's sql/vectors, the CLI runs on a data
directory, the rate-limit fixture) and the unit tests. The servers are tests/worker_live.py's ``WorkerLive``: it
reads the stores through the Worker's protocol (an independent look at what the service stored: the control database,
each organization's Durable Object) and the vectors from the emulator's Vectorize; where a suite opened a database
file (a second instance's handle, legacy rows written by hand, a file's digest) it goes through the Worker instead.
Skipped, with the reason, when Node or worker/node_modules is missing."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if shutil.which("node") is None or shutil.which("npm") is None:
    pytest.skip("the Worker tests need Node.js and npm on PATH", allow_module_level=True)
if not (ROOT / "worker" / "node_modules" / ".bin" / "wrangler").exists():
    pytest.skip("the Worker's npm packages are not installed: run `npm ci --prefix worker`", allow_module_level=True)

from tests.conftest import signup  # noqa: E402
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
from tests.test_bulk_import import (  # noqa: E402,F401
    test_a_batch_answers_each_item_as_a_single_capture_would,
    test_a_batch_is_the_callers_organizations_alone,
)
from tests.test_conversations import (  # noqa: E402,F401
    a,
    b,
    http,
    test_backfill_cli_loop_shows_progress,
    test_backfill_is_resumable_and_changes_no_content,
    test_backfill_needs_admin,
    test_bad_input_is_4xx_with_the_error_body_and_changes_nothing,
    test_compression_round_trip_over_http,
    test_concurrent_appends_get_contiguous_sequences,
    test_concurrent_retries_with_one_key_append_once,
    test_create_get_list_and_pages,
    test_created_at_round_trip_and_from_to_filters,
    test_a_relative_date_in_the_query_favours_messages_of_that_range,
    test_bad_times_are_4xx_and_append_nothing,
    test_delete_right_after_append_leaves_no_vector,
    test_idempotency_key_replays_the_original_response,
    test_invalid_unicode_is_refused,
    test_legacy_rows_are_readable_and_searchable,
    test_mcp_conversation_tools,
    test_openapi_lists_the_conversation_operations,
    test_rechunking_touches_only_the_tail,
    test_rest_other_orgs_conversation_is_404_everywhere,
    test_retried_append_with_client_ids_is_a_no_op,
    test_search_lists_the_best_message_first_with_its_id_and_window,
    test_search_returns_windows_with_messages_and_best_sequence,
    test_semantic_search_pinpoints_a_paraphrased_fact,
    test_top_results_are_not_ten_neighbours_of_one_hit,
    test_turns_and_times_of_another_org_are_invisible,
    test_two_instances_appending_to_one_conversation_never_collide,
)
from tests.test_conversations import (  # noqa: E402,F401
    test_delete_leaves_nothing_behind as test_conversation_delete_leaves_nothing_behind,
)
from tests.test_delete_races import (  # noqa: E402,F401
    test_delete_cancels_every_queued_job_of_its_parent,
    test_delete_while_an_enrich_job_is_mid_way,
    test_delete_while_the_worker_holds_embedded_vectors,
    test_worker_upserts_between_the_deletes_vector_and_row_writes,
)
from tests.test_isolation import test_nothing_b_does_moves_a_scores_explain_ids_or_files  # noqa: E402,F401
from tests.test_org_lifecycle import (  # noqa: E402
    test_malformed_bundles_are_refused_and_leave_the_organization_empty as _malformed_bundles,
)
from tests.test_org_lifecycle import (  # noqa: E402,F401
    olive,
    test_a_bundle_larger_than_the_body_limit_is_streamed_in,
    test_a_client_that_disconnects_mid_body_leaves_the_organization_empty,
    test_everything_is_scoped_to_the_callers_organization,
    test_import_into_a_non_empty_organization_is_409,
    test_read_write_keys_get_403_and_nothing_happens,
    test_round_trip_export_import_export_then_delete,
    test_wrong_media_type_is_415,
)
from tests.test_usage import (  # noqa: E402,F401
    test_usage_counts_what_the_organization_holds_and_only_that,
    test_usage_needs_a_credential_and_the_read_scope_is_enough,
)
from tests.worker_live import worker_live, worker_stack  # noqa: E402
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

@pytest.fixture(scope="module")
def stack():
    with worker_stack() as dev:
        yield dev


@pytest.fixture(scope="module")
def hstack():
    """A stack of its own for the hash embedder's service. Instances that share a control database share its work
    hints, and so each other's jobs: on one stack, the MiniLM service's worker embedded the hash service's chunks with
    MiniLM (into the hash index the organization's route names), and the other way round. Those vectors mean nothing
    to the other model's queries, so a search there found nothing, or ranked by noise (the flaky paraphrase, relative
    date and contradiction tests). A deployment's instances share one embedder; two embedders need two deployments."""
    with worker_stack() as dev:
        yield dev


@pytest.fixture(scope="module")
def hlive(hstack):
    """conftest's ``hlive`` (the hash embedder: plumbing without the model's cost) on the Worker backend, on a stack
    of its own (``hstack``)."""
    with tempfile.TemporaryDirectory() as tmp, worker_live(hstack, Path(tmp), embedder="hash") as server:
        yield server


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


def test_malformed_bundles_are_refused_and_leave_the_organization_empty(hlive, caplog):
    with hlive.client() as c:  # (test_org_lifecycle's olive and http)
        _malformed_bundles(hlive, c, caplog)


def _minilm_cosines(live, org, texts_by_chunk: dict[str, str]) -> dict[str, float]:
    """Each stored vector of ``org`` against MiniLM's embedding of its chunk's text (1.0: MiniLM made it)."""
    import asyncio

    import numpy as np

    from services.adapters.onnx_embedder import OnnxMiniLMEmbedder

    records = {r["id"].split(":", 1)[1]: r["values"] for r in live.vector_records(f"{org.id}:")}
    ids = [cid for cid in texts_by_chunk if cid in records]
    expected = asyncio.run(OnnxMiniLMEmbedder().embed([texts_by_chunk[cid] for cid in ids]))
    return {cid: float(np.dot(np.asarray(records[cid], dtype=np.float32), expected[i])) for i, cid in enumerate(ids)}


def test_an_instance_of_another_embedding_model_leaves_an_organization_alone(live, monkeypatch, tmp_path):
    """Instances of two embedding models on one deployment (two deployments sharing a control plane, a rolling deploy
    that changed MEMEX_EMBEDDER). Each organization records the model its vectors are made with: an instance of
    another model answers 503 embedding_model_mismatch and changes nothing, its job worker leaves the organization's
    jobs to the right instances (every vector stays the recorded model's), and `memex reindex --org` run with the new
    model's settings moves the organization to that model, after which the old instances refuse it."""
    import os
    import subprocess
    import sys

    import services.storage.stores as stores_module
    from tests.conftest import assert_error
    from tests.worker_live import INDEXES, worker_live

    monkeypatch.setattr(stores_module, "MODEL_RECHECK_SECONDS", 0.0, raising=False)  # each request reads the record
    mine = signup(live, "minilm")
    first_text = "The tide tables for the harbour are posted on the blue board beside the ferry ramp."
    with live.client() as c:
        first = c.post("/v1/thoughts", json={"content": first_text}, headers=mine.headers).json()
    live.wait_indexed(mine.headers, first["id"])
    with worker_live(live.stack, tmp_path / "hash", embedder="hash") as other:
        theirs = signup(other, "hashmodel")
        with other.client() as c:
            before = live.sql("SELECT id, content, decision FROM documents", org=mine.id)
            assert_error(c.get(f"/v1/thoughts/{first['id']}", headers=mine.headers), 503, "embedding_model_mismatch")
            assert_error(c.post("/v1/thoughts", json={"content": "a note from the wrong model"}, headers=mine.headers),
                         503, "embedding_model_mismatch")
            assert live.sql("SELECT id, content, decision FROM documents", org=mine.id) == before  # nothing changed
            assert c.get("/v1/thoughts", headers=theirs.headers).status_code == 200
        with live.client() as c:  # and the other way round
            assert_error(c.get("/v1/thoughts", headers=theirs.headers), 503, "embedding_model_mismatch")
            texts = [f"Harbour note {i}: the {w} ferry leaves at {7 + i} from the north pier, weather permitting."
                     for i, w in enumerate(["early", "second", "noon", "late", "night", "last"])]
            made = [c.post("/v1/thoughts", json={"content": t}, headers=mine.headers).json()["id"] for t in texts]
        for tid in made:  # both workers saw the work hints of these captures: only live's may embed them
            assert live.wait_indexed(mine.headers, tid)["indexing"]["state"] == "indexed"
        chunks = {row[0]: row[1] for row in live.sql("SELECT id, content FROM chunks WHERE organization_id = ?",
                                                     (mine.id,), org=mine.id)}
        cosines = _minilm_cosines(live, mine, chunks)
        assert len(cosines) == len(chunks) == 1 + len(texts)
        assert min(cosines.values()) > 0.99, cosines

        env = {**os.environ, "MEMEX_BACKEND": "worker", "MEMEX_WORKER_URL": live.stack.url,
               "MEMEX_WORKER_SECRET": live.stack.secret, "CLOUDFLARE_VECTORIZE_INDEX": INDEXES["hash"],
               "MEMEX_EMBEDDER": "hash"}
        done = subprocess.run([sys.executable, "-m", "api.cli", "reindex", "--org", mine.slug, "--json",
                               "--data-dir", str(tmp_path / "reindex")], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        assert json.loads(done.stdout)["chunks"] == len(chunks)
        with other.client() as c:  # the organization is the hash model's now
            got = c.get(f"/v1/thoughts/{first['id']}", headers=mine.headers)
            assert got.status_code == 200 and got.json()["content"] == first_text
        with live.client() as c:
            assert_error(c.get(f"/v1/thoughts/{first['id']}", headers=mine.headers), 503, "embedding_model_mismatch")
