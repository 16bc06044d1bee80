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
