"""The whole organization's lifecycle over REST (admin scope): export it as a bundle, import a bundle into an
empty organization, delete it. The bundle format: docs/export-bundle.md (services.bundle).

Everything acts on the caller's own organization: no route takes an organization id or slug to act on (the
delete's ``confirm`` must repeat the caller's slug; any other value is a 400 that deletes nothing)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Annotated

from litestar import Request, delete, get, post
from litestar.datastructures import State
from litestar.openapi.datastructures import ResponseSpec
from litestar.openapi.spec import OpenAPIMediaType, Operation, RequestBody, Schema
from litestar.openapi.spec.enums import OpenAPIType
from litestar.params import Parameter
from litestar.response import Stream

from api.errors import error_responses
from api.limits import MAX_IMPORT_BYTES
from api.routes import ADMIN, AUTH_ERRORS
from api.wiring import Memex
from services.errors import InvalidInput, MemexError
from services.storage.scoped import OrgSql
from services.bundle.export import BundleExport
from services.bundle.importer import BundleImport
from services.bundle.records import MEDIA_TYPE, BundleOrganization, ImportResult

__all__ = ["org_lifecycle_handlers", "bundle_export", "bundle_import", "IMPORT_MEDIA_TYPES"]

#: Media types an import accepts (NDJSON and its JSON Lines aliases).
IMPORT_MEDIA_TYPES = frozenset({MEDIA_TYPE, "application/jsonl", "application/x-jsonlines", "application/jsonlines"})


class UnsupportedMediaType(MemexError):
    code = "unsupported_media_type"
    status = 415


async def bundle_export(memex: Memex, org_id: str, *, progress=None) -> BundleExport:
    """The organization's export, prepared (its counts read: an error surfaces before any byte is sent)."""
    org = await memex.orgs.by_id(org_id)
    store = await memex.stores.open(org_id)
    export = BundleExport(store.sql, OrgSql(memex.control, org_id),
                          BundleOrganization(id=org.id, slug=org.slug, name=org.name, created_at=org.created_at),
                          progress=progress)
    await export.prepare()
    return export


async def bundle_import(memex: Memex, org_id: str, *, on_header=None, progress=None) -> BundleImport:
    store = await memex.stores.open(org_id)
    return BundleImport(store.sql, OrgSql(memex.control, org_id), store.vectors, memex.backend.embedder,
                        thought_limits=memex.limits, conversation_limits=memex.conversation_limits,
                        on_header=on_header, progress=progress)


def _filename(slug: str) -> str:
    return f"memex-{slug}-{datetime.now(timezone.utc).strftime('%Y%m%dT%H%M%SZ')}.jsonl"


@get("/v1/org/export", operation_id="exportOrganization", tags=["organizations"], guards=[ADMIN],
     media_type=MEDIA_TYPE,
     responses={200: ResponseSpec(data_container=str, media_type=MEDIA_TYPE, generate_examples=False,
                                  description="The bundle: one JSON record per line (docs/export-bundle.md)"),
                **error_responses(*AUTH_ERRORS)},
     summary="Export the whole organization as a versioned JSON Lines bundle (streamed)",
     description=(
         "Streams `application/x-ndjson`: a header line (`{\"type\": \"memex.bundle\", \"version\": 1, ...}`), then "
         "one record per line: thoughts, their history entries and links, each conversation followed by its "
         "messages (plain text), the API keys' metadata (never a secret), the Access bindings, and a trailer "
         "line with the count of every record type, so a truncated download is detectable (no trailer, or "
         "counts that do not match). Chunks and vectors are not exported: an import rebuilds them. The export "
         "reads a live organization page by page: it is not a point-in-time snapshot of writes made while it "
         "streams. Format: docs/export-bundle.md."))
async def export_org(request: Request, state: State) -> Stream:
    export = await bundle_export(state.memex, request.user.org_id)
    return Stream(export.lines(), media_type=MEDIA_TYPE, headers={
        "content-disposition": f'attachment; filename="{_filename(export.organization.slug)}"'})


@dataclass
class _ImportOperation(Operation):
    """The import's request body (the handler reads it as a stream, so Litestar cannot describe it)."""

    def __post_init__(self) -> None:
        self.request_body = RequestBody(
            required=True,
            description=(f"A bundle from GET /v1/org/export (`{MEDIA_TYPE}`; `application/jsonl` is accepted too), "
                         f"read as it streams; at most {MAX_IMPORT_BYTES} bytes (1 GiB), far above the "
                         "8 MiB of other requests."),
            content={MEDIA_TYPE: OpenAPIMediaType(schema=Schema(
                type=OpenAPIType.STRING, max_length=MAX_IMPORT_BYTES,
                description="JSON Lines: the header, the records, the trailer (docs/export-bundle.md)"))},
        )


@post("/v1/org/import", operation_id="importOrganization", tags=["organizations"], guards=[ADMIN], status_code=200,
      request_max_body_size=MAX_IMPORT_BYTES, operation_class=_ImportOperation,
      responses=error_responses(409, 413, 415, 507, *AUTH_ERRORS),
      summary="Restore a bundle into this organization, which must be empty (streamed; up to 1 GiB)",
      description=(
          "Restores a bundle from GET /v1/org/export into the caller's organization, which must have no thoughts, "
          "conversations or history entries (409 otherwise). The body is read as it streams, line by line, and "
          "validated as it is written; any refusal (400 with `details.line` for a malformed line, an unknown "
          "version or record type, records out of order, a missing or wrong trailer; 413 for content over the "
          "limits) rolls back everything it wrote, so the organization stays empty. Thought, history and "
          "conversation ids are kept; chunks are rebuilt and queued for embedding: imported content is "
          "keyword-searchable at once and semantically searchable once the worker has embedded it. The bundle's "
          "organization id, slug and name are not applied (the organization keeps its own); keys are listed in a "
          "bundle but never recreated (their secrets cannot be exported); Access bindings are restored. "
          "Format: docs/export-bundle.md."))
async def import_org(request: Request, state: State) -> ImportResult:
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media not in IMPORT_MEDIA_TYPES:
        raise UnsupportedMediaType(f"send the bundle as {MEDIA_TYPE}", details={"content_type": media[:100]})
    memex: Memex = state.memex
    org_id = request.user.org_id
    importer = await bundle_import(memex, org_id)
    result = await importer.run(request.stream())
    memex.wake(org_id)
    return result


Confirm = Annotated[str, Parameter(query="confirm", min_length=1, max_length=100,
                                   description="The organization's slug, repeated: the deletion happens only when it "
                                               "matches the caller's organization")]


@delete("/v1/org", operation_id="deleteOrganization", tags=["organizations"], guards=[ADMIN],
        responses=error_responses(*AUTH_ERRORS),
        summary="Delete the caller's organization for good: its data, vectors, keys and bindings",
        description=(
            "Deletes the caller's organization: its database (thoughts, conversations, history, jobs), its vectors, "
            "its API keys, Access bindings and usage. `confirm` must equal the organization's slug (400 otherwise, "
            "and nothing is deleted). Every key of the organization stops working at once. Export it first "
            "(GET /v1/org/export) to keep a copy."))
async def delete_org(request: Request, state: State, confirm: Confirm) -> None:
    memex: Memex = state.memex
    org = await memex.orgs.by_id(request.user.org_id)
    if confirm != org.slug:
        raise InvalidInput("confirm must be the slug of the organization being deleted (the caller's own)",
                           details={"field": "confirm"})
    await memex.delete_org(org.id)


org_lifecycle_handlers = [export_org, import_org, delete_org]
