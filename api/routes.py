"""REST controllers: thin; each calls the organization's bound services."""

from __future__ import annotations

from typing import Annotated

import msgspec

from litestar import Controller, Request, Response, delete, get, post
from litestar.datastructures import State
from litestar.di import Provide
from litestar.openapi.datastructures import ResponseSpec
from litestar.params import Parameter

from api.auth import client_address, require
from api.errors import error_responses
from api.limits import MAX_BATCH_BODY_BYTES
from api.schemas import (
    ApiKeyOut, CaptureBatchIn, CaptureIn, Health, IssuedKeyOut, KeyCreateIn, KeyList, MemberIn, MemberList, MemberOut,
    OrganizationOut, SearchIn, SearchOut, ServiceTokenIn, ServiceTokenList, ServiceTokenOut, SignupIn, SignupOut,
    WhoAmI,
)
from api.wiring import Memex, OrgServices
from services.errors import RateLimited
from services.ids import now_ms
from services.models import BatchCaptureResult, CaptureResult, ThoughtDetail, ThoughtPage
from services.search.search import SearchOptions
from services.text.temporal import MAX_MS, time_options
from tenancy.keys import KeyRecord

__all__ = ["route_handlers", "org_services"]

READ, WRITE, ADMIN = require("read"), require("write"), require("admin")
AUTH_ERRORS = (400, 401, 403, 429)  # 400: any malformed path, query or body


async def org_services(request: Request) -> OrgServices:
    return await request.app.state.memex.for_org(request.user)


def capture_responses():
    return {200: ResponseSpec(data_container=CaptureResult,
                              description="Already captured: the existing thought (updated_at bumped)"),
            **error_responses(413, *AUTH_ERRORS)}


def _key_out(r: KeyRecord) -> ApiKeyOut:
    return ApiKeyOut(r.id, r.name, r.prefix, r.scopes, r.created_at, r.expires_at, r.revoked_at, r.last_used_at)


def mcp_url(request: Request, slug: str) -> str:
    base = request.app.state.memex.settings.public_url or str(request.base_url).rstrip("/")
    return f"{base}/orgs/{slug}/mcp"


# -- public -----------------------------------------------------------------------------------------

@post("/v1/signup", operation_id="signup", tags=["organizations"], security=[{}], exclude_from_auth=True,
      responses=error_responses(400, 409, 429), summary="Create an organization and its first admin key",
      description=("Public, no credential. Creates the organization (its slug names its URLs: `/orgs/{slug}/mcp`) and an admin "
                   "API key; the raw key is in this response only (store it now: it cannot be shown again). Sign-ups are rate "
                   "limited per client address (429 with Retry-After). A slug that is taken is 409."))
async def signup(data: SignupIn, request: Request, state: State) -> SignupOut:
    memex: Memex = state.memex
    address = client_address(request)
    verdict = await memex.rate_limits.check(memex.signup_limit, address)
    if not verdict.allowed:
        raise RateLimited("too many sign-ups from this address", retry_after=verdict.retry_after,
                          details={"limit": "signup", "policy": verdict.limit.policy}, headers=verdict.headers())
    org, issued = await memex.orgs.create(name=data.name, slug=data.slug)
    await memex.rate_limits.hit(memex.signup_limit, address)  # only sign-ups that happened count
    r = issued.record
    return SignupOut(
        organization=OrganizationOut(org.id, org.slug, org.name, org.created_at),
        api_key=IssuedKeyOut(r.id, r.name, r.prefix, r.scopes, r.created_at, r.expires_at, r.revoked_at, r.last_used_at,
                             key=issued.raw),
        mcp_url=mcp_url(request, org.slug),
    )


@get("/health", operation_id="health", tags=["operations"], security=[{}], exclude_from_auth=True,
     summary="Service health: backends, embedding model, pending jobs, free disk",
     description=("Public, no credential. `status` is `ok`, or `degraded` while the job worker is paused (a full disk). Names "
                  "the SQL, vector and embedder backends in use, the embedding model, the jobs waiting across all "
                  "organizations, the free bytes of the SQL store's file system (embedded backend) and the Cloudflare API "
                  "budget (Cloudflare backend)."))
async def health(state: State) -> Health:
    memex: Memex = state.memex
    s = memex.settings
    paused = memex.worker.paused
    return Health(
        status="degraded" if paused else "ok", sql=s.sql, vectors=s.vectors, embedder=s.embedder,
        embedding_model=memex.backend.embedder.model_id, pending_jobs=await memex.worker.pending(),
        cloudflare=memex.backend.cloudflare_stats(), free_bytes=memex.control.free_bytes(), worker_paused=paused,
    )


# -- the caller's organization ------------------------------------------------------------------------

class OrgController(Controller):
    path = "/v1"
    tags = ["organizations"]
    dependencies = {"org": Provide(org_services)}

    @get("/org", operation_id="whoami", guards=[READ], responses=error_responses(*AUTH_ERRORS),
         summary="The caller's organization, principal and scopes",
         description=("Who the credential is: the organization (id, slug, name), the principal (`key:<id>`, `user:<email>` or "
                      "`service:<common name>`), its scopes, and the organization's MCP URL. Needs the read scope."))
    async def whoami(self, org: OrgServices, request: Request, state: State) -> WhoAmI:
        o = await state.memex.orgs.by_id(org.ctx.org_id)
        return WhoAmI(OrganizationOut(o.id, o.slug, o.name, o.created_at), org.ctx.principal,
                      sorted(org.ctx.scopes), mcp_url(request, o.slug))


class KeyController(Controller):
    path = "/v1/keys"
    tags = ["keys"]
    guards = [ADMIN]
    dependencies = {"org": Provide(org_services)}

    @post("/", operation_id="createKey", responses=error_responses(*AUTH_ERRORS),
          summary="Create an API key (the raw key is in this response only)",
          description=("Admin scope. Give a name, scopes (`read`, `write`, `admin`; admin implies the others) and optionally "
                       "`expires_in_seconds`. The answer's `key` is the secret (`mx_<id>_<secret>`): shown in this response "
                       "only, stored as an argon2id hash."))
    async def create(self, data: KeyCreateIn, org: OrgServices) -> IssuedKeyOut:
        expires_at = now_ms() + data.expires_in_seconds * 1000 if data.expires_in_seconds else None
        issued = await org.keys.create(name=data.name, scopes=list(data.scopes), expires_at=expires_at)
        r = issued.record
        return IssuedKeyOut(r.id, r.name, r.prefix, r.scopes, r.created_at, r.expires_at, r.revoked_at, r.last_used_at,
                            key=issued.raw)

    @get("/", operation_id="listKeys", responses=error_responses(*AUTH_ERRORS), summary="List API keys (never a secret)",
         description=("Admin scope. Every key of the organization with its name, prefix, scopes, creation, expiry, revocation "
                      "and last use; never a secret."))
    async def list_keys(self, org: OrgServices) -> KeyList:
        return KeyList([_key_out(r) for r in await org.keys.list()])

    @delete("/{key_id:str}", operation_id="revokeKey", responses=error_responses(404, *AUTH_ERRORS),
            summary="Revoke an API key (effective at once)",
            description=("Admin scope. The key stops working at once on every instance (revocations are checked within a "
                         "second). Another organization's key id, or an unknown one, is 404."))
    async def revoke(self, key_id: Annotated[str, Parameter(max_length=64)], org: OrgServices) -> None:
        await org.keys.revoke(key_id)


class AccessController(Controller):
    path = "/v1"
    tags = ["access"]
    guards = [ADMIN]
    dependencies = {"org": Provide(org_services)}

    @post("/members", operation_id="addMember", responses=error_responses(*AUTH_ERRORS),
          summary="Let a Cloudflare Access user (by email) in with a role",
          description=("Admin scope. Behind Cloudflare Access: the user with this email, authenticated by Access, gets the "
                       "role's scopes in this organization (owner and admin: every scope; member: read and write; viewer: "
                       "read). Adding an existing member changes their role."))
    async def add_member(self, data: MemberIn, org: OrgServices) -> MemberOut:
        m = await org.bindings.add_member(data.email, data.role)
        return MemberOut(m.email, m.role, m.created_at)

    @get("/members", operation_id="listMembers", responses=error_responses(*AUTH_ERRORS),
         summary="List the Cloudflare Access users let in, with their roles",
         description="Admin scope. Every member of the organization (email, role, when added).")
    async def list_members(self, org: OrgServices) -> MemberList:
        return MemberList([MemberOut(m.email, m.role, m.created_at) for m in await org.bindings.members()])

    @delete("/members/{email:str}", operation_id="removeMember", responses=error_responses(404, *AUTH_ERRORS),
            summary="Remove a Cloudflare Access user from the organization",
            description=("Admin scope. The user's Access identity no longer reaches this organization (effective at once). An "
                         "unknown email is 404."))
    async def remove_member(self, email: Annotated[str, Parameter(max_length=320)], org: OrgServices) -> None:
        await org.bindings.remove_member(email)

    @post("/service-tokens", operation_id="bindServiceToken", responses=error_responses(409, *AUTH_ERRORS),
          summary="Bind a Cloudflare Access service token (its common_name) to this organization",
          description=("Admin scope. Requests carrying an Access service token with this common name act for this organization "
                       "with the given scopes. A common name bound already (here or elsewhere) is 409."))
    async def add_token(self, data: ServiceTokenIn, org: OrgServices) -> ServiceTokenOut:
        t = await org.bindings.add_service_token(data.common_name, data.name or data.common_name, list(data.scopes))
        return ServiceTokenOut(t.common_name, t.name, t.scopes, t.created_at)

    @get("/service-tokens", operation_id="listServiceTokens", responses=error_responses(*AUTH_ERRORS),
         summary="List the Cloudflare Access service tokens bound to this organization",
         description="Admin scope. Every bound service token (common name, name, scopes, when bound).")
    async def list_tokens(self, org: OrgServices) -> ServiceTokenList:
        tokens = await org.bindings.service_tokens()
        return ServiceTokenList([ServiceTokenOut(t.common_name, t.name, t.scopes, t.created_at) for t in tokens])

    @delete("/service-tokens/{common_name:str}", operation_id="unbindServiceToken", responses=error_responses(404, *AUTH_ERRORS),
            summary="Unbind a Cloudflare Access service token",
            description=("Admin scope. The service token no longer reaches this organization (effective at once). An unknown "
                         "common name is 404."))
    async def remove_token(self, common_name: Annotated[str, Parameter(max_length=200)], org: OrgServices) -> None:
        await org.bindings.remove_service_token(common_name)


# -- thoughts and search ----------------------------------------------------------------------------

ThoughtId = Annotated[str, Parameter(max_length=64, description="thought id")]
Limit = Annotated[int, Parameter(ge=1, le=100)]
Before = Annotated[int | None, Parameter(ge=0, le=MAX_MS, description="epoch ms: only thoughts created strictly before")]
BeforeId = Annotated[str | None, Parameter(max_length=64, description="tie-break cursor from next_before_id")]


async def _capture(data: CaptureIn, org: OrgServices) -> Response[CaptureResult]:
    res = await org.thoughts.capture(data.content, source=data.source, metadata=data.metadata, wait=data.wait)
    return Response(res, status_code=201 if res.created else 200)


async def _search(data: SearchIn, org: OrgServices) -> SearchOut:
    res = await org.search.search(
        SearchOptions(query=data.query, top_k=data.top_k, tags=data.tags, kinds=data.kinds,
                      parent_id=data.conversation_id, include_content=data.include_content, explain=data.explain,
                      min_score=data.min_score, **time_options(data.time_from, data.time_to, data.reference_time))
    )
    return SearchOut(res.query, res.results)


@post("/v1/thoughts:batch", operation_id="captureThoughts", tags=["thoughts"], guards=[WRITE], status_code=200,
      dependencies={"org": Provide(org_services)}, request_max_body_size=MAX_BATCH_BODY_BYTES,
      responses=error_responses(413, *AUTH_ERRORS),
      summary="Capture up to 1,000 thoughts at once, each answered as a single capture would be",
      description="Each item is the body of POST /v1/thoughts (`wait` excepted: the worker makes every decision). "
                  "Each result carries its item's index and the status a single capture would have answered: 201 "
                  "stored, 200 already stored (idempotent per item: sending a batch again stores nothing twice), "
                  "400/413 refused (the others are still stored). New thoughts are written 50 per transaction, "
                  "keyword-searchable at once and embedded by the worker. At most 64 MiB.")
async def capture_batch(data: CaptureBatchIn, org: OrgServices) -> BatchCaptureResult:
    return await org.thoughts.capture_many([msgspec.structs.asdict(item) for item in data.items])


class ThoughtController(Controller):
    path = "/v1/thoughts"
    tags = ["thoughts"]
    dependencies = {"org": Provide(org_services)}

    @post("/", operation_id="captureThought", guards=[WRITE], status_code=201, responses=capture_responses(),
          summary="Capture a thought (201 new; 200 when the same content exists: idempotent on its SHA-256)",
          description=("Write scope. Stores markdown `content` (at most MEMEX_MAX_CONTENT_BYTES, 256 KiB by default) with an "
                       "optional `source` and `metadata`. The thought is keyword-searchable at once; the worker embeds it and "
                       "makes the write-time decision (duplicate, contradiction, merge...) moments later, unless `wait: true` "
                       "asks the answer to carry it."))
    async def capture(self, data: CaptureIn, org: OrgServices) -> Response[CaptureResult]:
        return await _capture(data, org)

    @get("/", operation_id="listThoughts", guards=[READ], responses=error_responses(*AUTH_ERRORS),
         summary="Recent thoughts, newest first",
         description=("Read scope. A page of thoughts, newest first; page on with `before` (epoch ms) and `before_id` from the "
                      "previous page's `next_before` / `next_before_id`."))
    async def list_recent(self, org: OrgServices, limit: Limit = 20, before: Before = None,
                          before_id: BeforeId = None) -> ThoughtPage:
        return await org.thoughts.list_recent(limit=limit, before=before, before_id=before_id)

    @get("/{thought_id:str}", operation_id="getThought", guards=[READ], responses=error_responses(404, *AUTH_ERRORS),
         summary="A thought with its chunks and indexing state",
         description=("Read scope. The thought's content, source, metadata, summary and tags, its chunks and whether they are "
                      "indexed yet. Fetching a thought counts as a use of it for ranking. Another organization's id is 404."))
    async def get_one(self, thought_id: ThoughtId, org: OrgServices) -> ThoughtDetail:
        return await org.thoughts.get(thought_id)

    @post("/{thought_id:str}/used", operation_id="markThoughtUsed", guards=[WRITE], status_code=204,
          responses=error_responses(404, *AUTH_ERRORS),
          summary="Mark a thought as used: deliberate use raises its ranking a little (at most 5 %, decaying)",
          description=("Write scope. Tell memory that a thought was acted on or relied on; it then ranks slightly higher in "
                       "later searches. Search results alone never count as use."))
    async def mark_used(self, thought_id: ThoughtId, org: OrgServices) -> None:
        await org.thoughts.mark_used([thought_id])

    @delete("/{thought_id:str}", operation_id="deleteThought", guards=[WRITE], responses=error_responses(404, *AUTH_ERRORS),
            summary="Delete a thought: rows, keyword index and vectors",
            description="Write scope. Removes the thought, its chunks, its keyword index entries and its vectors, at once.")
    async def delete_one(self, thought_id: ThoughtId, org: OrgServices) -> None:
        await org.thoughts.delete(thought_id)


@post("/v1/search", operation_id="search", tags=["search"], guards=[READ], status_code=200,
      dependencies={"org": Provide(org_services)}, responses=error_responses(404, *AUTH_ERRORS),
      summary="Hybrid (keyword + vector) search over the organization's memory",
      description=("Read scope. Finds the best matching passages of thoughts (and, with `kinds`, conversations) by meaning and "
                   "keywords together, ranked by relevance, recency and use. Filter by tags, time range or one conversation; "
                   "`explain: true` adds each hit's score breakdown; `min_score` drops weak hits."))
async def search(data: SearchIn, org: OrgServices) -> SearchOut:
    return await _search(data, org)


class LegacyController(Controller):
    """The second-brain seed's own routes, for its existing clients."""

    path = "/"
    tags = ["second-brain compatibility"]
    dependencies = {"org": Provide(org_services)}

    @post("/capture", operation_id="legacyCapture", guards=[WRITE], status_code=201, responses=capture_responses(),
          summary="Capture a thought (the original second-brain route)",
          description="Write scope. Same as POST /v1/thoughts, kept for the seed's existing clients.")
    async def capture(self, data: CaptureIn, org: OrgServices) -> Response[CaptureResult]:
        return await _capture(data, org)

    @post("/search", operation_id="legacySearch", guards=[READ], status_code=200, responses=error_responses(404, *AUTH_ERRORS),
          summary="Search memory (the original second-brain route)",
          description="Read scope. Same as POST /v1/search, kept for the seed's existing clients.")
    async def search(self, data: SearchIn, org: OrgServices) -> SearchOut:
        return await _search(data, org)

    @get("/thought/{thought_id:str}", operation_id="legacyGetThought", guards=[READ],
         responses=error_responses(404, *AUTH_ERRORS),
         summary="Fetch one thought (the original second-brain route)",
         description="Read scope. Same as GET /v1/thoughts/{thought_id}, kept for the seed's existing clients.")
    async def get_one(self, thought_id: ThoughtId, org: OrgServices) -> ThoughtDetail:
        return await org.thoughts.get(thought_id)

    @delete("/thought/{thought_id:str}", operation_id="legacyDeleteThought", guards=[WRITE],
            responses=error_responses(404, *AUTH_ERRORS),
            summary="Delete a thought (the original second-brain route)",
            description="Write scope. Same as DELETE /v1/thoughts/{thought_id}, kept for the seed's existing clients.")
    async def delete_one(self, thought_id: ThoughtId, org: OrgServices) -> None:
        await org.thoughts.delete(thought_id)

    @get("/thoughts", operation_id="legacyListThoughts", guards=[READ], responses=error_responses(*AUTH_ERRORS),
         summary="Recent thoughts (the original second-brain route)",
         description="Read scope. Same as GET /v1/thoughts (without `before_id`), kept for the seed's existing clients.")
    async def list_recent(self, org: OrgServices, limit: Limit = 20, before: Before = None) -> ThoughtPage:
        return await org.thoughts.list_recent(limit=limit, before=before)


route_handlers = [signup, health, OrgController, KeyController, AccessController, capture_batch, ThoughtController, search,
                  LegacyController]

