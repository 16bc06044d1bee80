"""Knowledge bases over REST, for the organization's own credentials: create, read, change, delete, sync, import an
archive, rotate the webhook secret (``/v1/knowledge-bases``; ``{kb}`` is the slug or the id). Reading needs
``read``; everything that changes a knowledge base needs ``admin``. The published side (entries, search, MCP, by
tier) is api.knowledge_public; GitHub's webhook is api.webhooks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgspec
from litestar import Controller, Request, Response, delete, get, patch, post
from litestar.di import Provide
from litestar.openapi.spec import OpenAPIFormat, OpenAPIMediaType, OpenAPIType, Operation, RequestBody, Schema
from litestar.params import Parameter

from api.errors import error_responses
from api.limits import MAX_ARCHIVE_BYTES
from api.routes import ADMIN, AUTH_ERRORS, READ, org_services
from api.wiring import OrgServices
from services.knowledge.models import KnowledgeBase, KnowledgeBaseCreated, KnowledgeBaseList, Sync, SyncPage
from services.knowledge.service import Knowledge

__all__ = ["knowledge_handlers", "KnowledgeBaseCreateIn", "KnowledgeBaseUpdateIn", "SyncIn", "WebhookSecretOut"]

#: What a git source's url looks like (services.knowledge.gitsource.check_source_url decides what is accepted).
SOURCE_URL = r"^(https?://[^\s/?#@]+(/\S*)?|/\S*|file:///\S*)$"
Slug = Annotated[str, msgspec.Meta(min_length=1, max_length=64, pattern=r"^[a-z0-9](?:[a-z0-9-]{0,62}[a-z0-9])?$")]
Glob = Annotated[str, msgspec.Meta(min_length=1, max_length=300)]
Globs = Annotated[list[Glob], msgspec.Meta(max_length=50)]
Visibility = Literal["private", "open", "public", "members"]
Tier = Literal["open", "public", "members"]


class GitSourceIn(msgspec.Struct, tag_field="type", tag="git", forbid_unknown_fields=True):
    """A git repository over https (any host) or, where the operator allows it, a local path."""

    url: Annotated[str, msgspec.Meta(min_length=1, max_length=2000, pattern=SOURCE_URL,
                                     description="https://host/path (any git host), or a local path where allowed")]
    branch: Annotated[str, msgspec.Meta(min_length=1, max_length=200)] = "main"
    include: Globs | None = None
    exclude: Globs | None = None
    #: A token for a private repository (sent as HTTP basic auth, user x-access-token): stored, never returned.
    token: Annotated[str, msgspec.Meta(min_length=1, max_length=1000)] | None = None


class UploadSourceIn(msgspec.Struct, tag_field="type", tag="upload", forbid_unknown_fields=True):
    """A vault sent as a .zip or .tar.gz (POST .../import)."""

    include: Globs | None = None
    exclude: Globs | None = None


class OntologyIn(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """How files become entries. Omitted keys keep the seed's defaults; type_aliases merge over the default aliases
    (``concept`` -> tag, ``guide`` -> article; map one to null to drop it)."""

    #: Folder prefix -> content type (default: the seed's data/ map).
    path_types: dict[str, str] | msgspec.UnsetType = msgspec.UNSET
    #: Frontmatter type name -> content type.
    type_aliases: dict[str, str | None] | msgspec.UnsetType = msgspec.UNSET
    #: Skip files without ``publish: true`` (the seed's default: true).
    require_publish: bool | msgspec.UnsetType = msgspec.UNSET
    #: Skip files with ``draft: true`` (default: true).
    skip_drafts: bool | msgspec.UnsetType = msgspec.UNSET
    #: Read-only (what GET shows); ignored here.
    content_types: list[str] | msgspec.UnsetType = msgspec.UNSET


class KnowledgeBaseCreateIn(msgspec.Struct, forbid_unknown_fields=True):
    slug: Slug
    source: GitSourceIn | UploadSourceIn
    name: Annotated[str, msgspec.Meta(min_length=1, max_length=200)] | None = None
    #: Who can read it: private (this organization only; invisible to anyone else), members (this organization's
    #: credentials), public (any authenticated identity), open (anyone, no credential).
    visibility: Visibility = "private"
    #: The tier get_document / search_with_documents / a whole entry need (never lower than the visibility).
    document_tier: Tier = "members"
    ontology: OntologyIn | None = None
    #: Queue the first sync at once (git sources).
    sync: bool = True


class GitSourcePatch(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    url: Annotated[str, msgspec.Meta(min_length=1, max_length=2000, pattern=SOURCE_URL)] | msgspec.UnsetType = msgspec.UNSET
    branch: Annotated[str, msgspec.Meta(min_length=1, max_length=200)] | msgspec.UnsetType = msgspec.UNSET
    include: Globs | msgspec.UnsetType = msgspec.UNSET
    exclude: Globs | msgspec.UnsetType = msgspec.UNSET
    #: A new token; null removes the stored one.
    token: Annotated[str, msgspec.Meta(min_length=1, max_length=1000)] | None | msgspec.UnsetType = msgspec.UNSET


class KnowledgeBaseUpdateIn(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    name: Annotated[str, msgspec.Meta(min_length=1, max_length=200)] | msgspec.UnsetType = msgspec.UNSET
    slug: Slug | msgspec.UnsetType = msgspec.UNSET
    visibility: Visibility | msgspec.UnsetType = msgspec.UNSET
    document_tier: Tier | msgspec.UnsetType = msgspec.UNSET
    source: GitSourcePatch | msgspec.UnsetType = msgspec.UNSET
    ontology: OntologyIn | msgspec.UnsetType = msgspec.UNSET


class SyncIn(msgspec.Struct, forbid_unknown_fields=True):
    #: Compare every file of the source, not only what git says changed since the last sync.
    full: bool = False


class WebhookSecretOut(msgspec.Struct):
    id: str
    #: The new secret (shown once): set it as the GitHub webhook's secret.
    webhook_secret: str
    webhook_path: str


@dataclass
class _ArchiveOperation(Operation):
    """The import's request body: the archive's bytes (read whole by the handler, so Litestar cannot describe it)."""

    def __post_init__(self) -> None:
        self.request_body = RequestBody(
            required=True,
            description=f"A .zip or .tar.gz of the vault, at most {MAX_ARCHIVE_BYTES} bytes (64 MiB).",
            content={kind: OpenAPIMediaType(schema=Schema(type=OpenAPIType.STRING, format=OpenAPIFormat.BINARY,
                                                          max_length=MAX_ARCHIVE_BYTES))
                     for kind in ("application/zip", "application/gzip", "application/octet-stream")},
        )


KbRef = Annotated[str, Parameter(min_length=1, max_length=64, description="the knowledge base's slug or id")]
SyncId = Annotated[str, Parameter(min_length=1, max_length=64, description="sync id")]


def _knowledge(org: OrgServices) -> Knowledge:
    assert org.knowledge is not None
    return org.knowledge


def _plain(struct: msgspec.Struct | None) -> dict[str, Any] | None:
    return None if struct is None else msgspec.to_builtins(struct)


class KnowledgeBaseController(Controller):
    path = "/v1/knowledge-bases"
    tags = ["knowledge"]
    dependencies = {"org": Provide(org_services)}

    @post("/", operation_id="createKnowledgeBase", guards=[ADMIN], status_code=201,
          responses=error_responses(409, *AUTH_ERRORS),
          summary="Create a knowledge base (a git repository of markdown, or an upload target)",
          description="The response carries `webhook_secret`, shown once: GitHub's push webhook "
                      "(`POST /hooks/github/{id}`) is signed with it. A git source's first sync is queued at once.")
    async def create(self, data: KnowledgeBaseCreateIn, org: OrgServices) -> KnowledgeBaseCreated:
        ks = _knowledge(org)
        source = msgspec.to_builtins(data.source)
        row, secret, sync_id = await ks.bases.create(
            slug=data.slug, name=data.name, visibility=data.visibility, document_tier=data.document_tier,
            source={k: v for k, v in source.items() if v is not None}, ontology=_plain(data.ontology), sync=data.sync)
        view = await ks.bases.view(row)
        sync = await ks.bases.sync(row, sync_id, detail=False) if sync_id else None
        return KnowledgeBaseCreated(**msgspec.structs.asdict(view), webhook_secret=secret, sync=sync)

    @get("/", operation_id="listKnowledgeBases", guards=[READ], responses=error_responses(*AUTH_ERRORS),
         summary="The organization's knowledge bases, with their last sync",
         description=("Read scope. Every knowledge base with its source (never its token), visibility, counts and the state of "
                      "its last sync."))
    async def list_bases(self, org: OrgServices) -> KnowledgeBaseList:
        return KnowledgeBaseList(await _knowledge(org).bases.list())

    @get("/{kb:str}", operation_id="getKnowledgeBase", guards=[READ], responses=error_responses(404, *AUTH_ERRORS),
         summary="One knowledge base: source (never its token), ontology, counts, last sync",
         description="Read scope. By id or slug. Another organization's knowledge base is 404.")
    async def get_one(self, kb: KbRef, org: OrgServices) -> KnowledgeBase:
        return await _knowledge(org).bases.get(kb)

    @patch("/{kb:str}", operation_id="updateKnowledgeBase", guards=[ADMIN],
           responses=error_responses(404, 409, *AUTH_ERRORS),
           summary="Change a knowledge base's name, slug, visibility, document tier, source or ontology",
           description="A changed ontology or glob list makes the next sync a full one (every file compared).")
    async def update(self, kb: KbRef, data: KnowledgeBaseUpdateIn, org: OrgServices) -> KnowledgeBase:
        ks = _knowledge(org)
        row = await ks.bases.update(kb, msgspec.to_builtins(data))
        return await ks.bases.view(row)

    @delete("/{kb:str}", operation_id="deleteKnowledgeBase", guards=[ADMIN], responses=error_responses(404, *AUTH_ERRORS),
            summary="Delete a knowledge base: every entry, chunk, vector, link, sync record and its git mirror",
            description=("Admin scope. Removes everything the knowledge base holds, at once; its published URLs answer 404 "
                         "afterwards."))
    async def delete_one(self, kb: KbRef, org: OrgServices) -> None:
        await _knowledge(org).delete(kb)

    @post("/{kb:str}/sync", operation_id="syncKnowledgeBase", guards=[ADMIN], status_code=202,
          responses=error_responses(404, *AUTH_ERRORS),
          summary="Queue a sync from the git source (202 with the sync; a sync already queued is reused)",
          description=("Admin scope. The worker fetches the git source and updates the entries that changed (`full: true` "
                       "compares every file). Follow it with GET /v1/knowledge-bases/{kb}/syncs/{sync_id}."))
    async def sync(self, kb: KbRef, org: OrgServices, data: SyncIn | None = None) -> Sync:
        ks = _knowledge(org)
        row = await ks.bases.row(kb)
        sync_id, _ = await ks.bases.request_sync(row, "api", full=bool(data and data.full))
        return await ks.bases.sync(row, sync_id, detail=False)

    @get("/{kb:str}/syncs", operation_id="listKnowledgeBaseSyncs", guards=[READ],
         responses=error_responses(404, *AUTH_ERRORS), summary="Recent syncs, newest first, with their counts",
         description=("Read scope. The latest syncs with their state, commit and counts of entries added, updated, deleted, "
                      "unchanged, skipped and failed."))
    async def syncs(self, kb: KbRef, org: OrgServices,
                    limit: Annotated[int, Parameter(ge=1, le=100)] = 20) -> SyncPage:
        ks = _knowledge(org)
        return SyncPage(await ks.bases.syncs(await ks.bases.row(kb), limit))

    @get("/{kb:str}/syncs/{sync_id:str}", operation_id="getKnowledgeBaseSync", guards=[READ],
         responses=error_responses(404, *AUTH_ERRORS),
         summary="One sync: state, commit, counts, and every per-file error, warning, skip and unresolved link",
         description="Read scope. Everything one sync did, file by file.")
    async def sync_detail(self, kb: KbRef, sync_id: SyncId, org: OrgServices) -> Sync:
        ks = _knowledge(org)
        return await ks.bases.sync(await ks.bases.row(kb), sync_id)

    @post("/{kb:str}/import", operation_id="importKnowledgeBase", guards=[ADMIN], status_code=202,
          request_max_body_size=MAX_ARCHIVE_BYTES, operation_class=_ArchiveOperation,
          responses=error_responses(404, 409, 413, *AUTH_ERRORS),
          summary="Upload a vault as a .zip or .tar.gz (at most 64 MiB): it replaces the knowledge base's files",
          description="The archive is checked whole before anything is stored: absolute paths, `..`, links, special "
                      "files, duplicates, more than 20,000 members, more than 256 MiB unpacked or an archive bomb are "
                      "refused with 400/413 and nothing is applied. Markdown files and release markers (index.base) "
                      "are kept; the sync (202) applies them.")
    async def import_archive(self, kb: KbRef, request: Request, org: OrgServices) -> Response[Sync]:
        ks = _knowledge(org)
        row = await ks.bases.row(kb)
        sync_id = await ks.bases.import_archive(row, await request.body())
        return Response(await ks.bases.sync(row, sync_id, detail=False), status_code=202)

    @post("/{kb:str}/webhook-secret", operation_id="rotateKnowledgeBaseWebhookSecret", guards=[ADMIN], status_code=200,
          responses=error_responses(404, *AUTH_ERRORS),
          summary="Replace the webhook secret (the new one is shown once; the old one stops at once)",
          description=("Admin scope. Update the secret in the repository's webhook settings: deliveries signed with the old one "
                       "are refused from now on."))
    async def rotate(self, kb: KbRef, org: OrgServices) -> WebhookSecretOut:
        row, secret = await _knowledge(org).bases.rotate_secret(kb)
        return WebhookSecretOut(row["id"], secret, f"/hooks/github/{row['id']}")


knowledge_handlers = [KnowledgeBaseController]
