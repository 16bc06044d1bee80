"""A knowledge base's published surfaces (the knowledge-server seed's §7 and §8), under ``/kb/{org}/{kb}/``:

* the read-only REST API ``api/v1/``: ``entries`` (list and filter), ``entries/{contentType}/{id}`` (a whole
  document with its links), ``search``, ``openapi.json``; GET and HEAD (CORS from any origin; every other method
  405); ETags on every answer; ``Cache-Control: public, max-age=300, stale-while-revalidate=3600`` where anyone may
  read the same answer (an open knowledge base, an open endpoint), ``private, no-cache`` otherwise (every error too);
* the MCP endpoint ``mcp`` (stateless Streamable HTTP, as ``/orgs/{slug}/mcp``): the seed's tools, resources and
  prompts (api.knowledge_tools).

Who may read (the seed's tiers, §2): ``open`` needs no credential; ``public`` any valid identity (an API key of any
organization, an Access JWT); ``members`` this organization's own credentials. A knowledge base's ``visibility`` is
the tier to see it at all (``private``: members, and it does not exist for anyone else: 404); its
``document_tier`` the tier for whole documents. Below the tier: 401 for a caller without a credential (one
would help), 404 for one with a credential (never 403: nothing is confirmed); on MCP the tool answers the seed's
``Requires <tier> access. Current: <tier>.`` Anonymous requests count against a per-address rate limit.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any

import mcp.types as t
import msgspec
from litestar import Request, Response, route
from litestar.params import Parameter
from litestar.types import ASGIApp
from mcp.server.lowlevel import Server
from mcp.server.lowlevel.helper_types import ReadResourceContents
from mcp.shared.exceptions import McpError

from api.auth import client_address
from api.errors import error_responses, exception_handlers
from api.knowledge_tools import (
    KB_TOOLS, PROMPTS, TIER_LEVEL, prompt_messages, read_resource, required_tier, resource_list, tier_error,
)
from api.mcp import checked_body, output_schema, stateless_app, stateless_refusal, tool_error, validator
from api.wiring import Memex
from services.errors import MemexError, NotFound, RateLimited, Unauthenticated
from services.knowledge.entries import Filters, KnowledgeReader, parse_date
from services.knowledge.models import Document, EntryPage, KnowledgeSearchResult
from services.knowledge.ontology import CONTENT_TYPES
from services.knowledge.service import Knowledge
from tenancy.auth import credentials_from
from tenancy.ratelimit import Limit

__all__ = ["knowledge_public_handlers", "PUBLIC_PREFIX", "Published", "published"]

log = logging.getLogger("memex.knowledge")

PUBLIC_PREFIX = "/kb/{org_slug:str}/{kb:str}"
OPEN_CACHE = "public, max-age=300, stale-while-revalidate=3600"
PRIVATE_CACHE = "private, no-cache"
VARY = "Authorization, Cf-Access-Jwt-Assertion, Cookie"


@dataclass
class Published:
    """One request's view of a published knowledge base: who is asking (their tier) and what they may see."""

    knowledge: Knowledge
    reader: KnowledgeReader
    tier: str
    org_slug: str

    @property
    def kb(self) -> dict[str, Any]:
        return self.reader.kb

    def allows(self, needs: str) -> bool:
        return TIER_LEVEL[self.tier] >= TIER_LEVEL[required_tier(self.kb, needs)]

    def require(self, needs: str) -> None:
        """Refuse a caller below the tier: 401 without a credential, 404 with one."""
        if self.allows(needs):
            return
        needed = required_tier(self.kb, needs)
        if self.tier == "open":
            raise Unauthenticated(f"this requires {needed} access: send a credential",
                                  details={"required": needed, "current": self.tier})
        raise NotFound("not found")

    def cache_control(self, needs: str) -> str:
        return OPEN_CACHE if required_tier(self.kb, needs) == "open" else PRIVATE_CACHE


async def published(request: Request, org_slug: str, kb_ref: str) -> Published:
    """Resolve the organization, the caller's tier and the knowledge base (404 when it is private to someone else,
    or does not exist), then the visibility (401 / 404 below it)."""
    memex: Memex = request.app.state.memex
    creds = credentials_from(request.headers, request.cookies, client_address(request), None)
    if not creds.authorization and not creds.access_token:
        limit = Limit("kb-anonymous", memex.settings.kb_public_rate_per_minute, 60)
        verdict = await memex.rate_limits.hit(limit, creds.client)
        if not verdict.allowed:
            raise RateLimited("too many anonymous requests from this address", retry_after=verdict.retry_after or 1,
                              details={"limit": limit.name, "policy": verdict.limit.policy}, headers=verdict.headers())
    tier, _ = await memex.auth.tier(creds, org_slug)
    try:
        org = await memex.orgs.by_slug(org_slug)
    except NotFound:
        raise NotFound("knowledge base not found") from None
    if org.status != "active":
        raise NotFound("knowledge base not found")
    store = await memex.stores.open(org.id)
    knowledge = memex.knowledge(org.id, store.sql, store.vectors)
    try:
        row = await knowledge.bases.row(kb_ref)
    except NotFound:
        raise NotFound("knowledge base not found") from None
    if row["visibility"] == "private" and tier != "members":
        raise NotFound("knowledge base not found")
    pub = Published(knowledge, KnowledgeReader(store.sql, row), tier, org.slug)
    pub.require("kb")
    return pub


def _json_response(request: Request, data: Any, cache: str) -> Response[bytes]:
    """The body with an ETag (304 when the client has it), the cache policy and Vary."""
    body = msgspec.json.encode(data)
    etag = '"' + hashlib.sha256(body).hexdigest()[:32] + '"'
    headers = {"ETag": etag, "Cache-Control": cache, "Vary": VARY}
    wanted = request.headers.get("if-none-match")
    if wanted and etag in [w.strip().removeprefix("W/") for w in wanted.split(",")]:
        return Response(b"", status_code=304, headers=headers)
    return Response(body, media_type="application/json", headers=headers)


def _operation_id(name: str) -> Callable[..., str]:
    def make(_handler: Any, method: str, _components: Any) -> str:
        return name if method == "GET" else f"{name}Head"

    return make


ContentType = Annotated[str | None, Parameter(query="contentType", max_length=20, required=False,
                                             description="content type (a parent type also matches its subtypes)")]
Group = Annotated[str | None, Parameter(min_length=1, max_length=200, required=False, description="group")]
Release = Annotated[str | None, Parameter(min_length=1, max_length=200, required=False, description="release id")]
Status = Annotated[str | None, Parameter(min_length=1, max_length=200, required=False, description="status")]
Tags = Annotated[str | None, Parameter(min_length=1, max_length=2000, required=False,
                                       description="comma-separated tags: entries with any of them")]
DateFrom = Annotated[str | None, Parameter(query="dateFrom", max_length=40, required=False,
                                           description="entries dated on or after (ISO-8601 date or epoch ms)")]
DateTo = Annotated[str | None, Parameter(query="dateTo", max_length=40, required=False,
                                         description="entries dated on or before (ISO-8601 date or epoch ms)")]
OrgSlug = Annotated[str, Parameter(min_length=1, max_length=64, description="the organization's slug")]
KbRef = Annotated[str, Parameter(min_length=1, max_length=64, description="the knowledge base's slug or id")]
PUBLIC_SECURITY = [{}, {"apiKey": []}, {"accessJwt": []}]
PUBLIC_ERRORS = error_responses(400, 401, 404, 429)
_EPOCH_MS = re.compile(r"-?[0-9]{1,20}")


def _uncached(handler: Callable[[Request, Any], Response]) -> Callable[[Request, Any], Response]:
    """The service's error mapper, plus the cache policy of a refusal: a 401 or 404 here depends on who asks (a member
    gets 200 at the same URL), so no shared cache may store it and serve it to someone else."""

    def answer(request: Request, exc: Any) -> Response:
        response = handler(request, exc)
        response.headers.update({"Cache-Control": PRIVATE_CACHE, "Vary": VARY})
        return response

    return answer


PUBLIC_EXCEPTION_HANDLERS = {kind: _uncached(handler) for kind, handler in exception_handlers.items()}


def _filters(content_type: str | None, group: str | None, release: str | None, status: str | None, tags: str | None,
             date_from: str | None, date_to: str | None) -> Filters:
    def when(value: str | None, field: str) -> int | None:
        if value is not None and _EPOCH_MS.fullmatch(value):  # ASCII digits only ('²'.isdigit() is true)
            return parse_date(int(value), field)
        return parse_date(value, field)

    tag_list = tuple(x.strip() for x in (tags or "").split(",") if x.strip())
    return Filters(content_type=content_type or None, group=group, release=release, status=status, tags=tag_list,
                   date_from=when(date_from, "dateFrom"), date_to=when(date_to, "dateTo")).check()


@route(PUBLIC_PREFIX + "/api/v1/entries", http_method=["GET", "HEAD"], operation_id=_operation_id("listPublicEntries"),
       tags=["knowledge (public)"], security=PUBLIC_SECURITY, exclude_from_auth=True, responses=PUBLIC_ERRORS,
       exception_handlers=PUBLIC_EXCEPTION_HANDLERS,
       summary="List a knowledge base's entries, filtered by content type, group, release, status, tags or date",
       description=("Published read-only API. A page of entries (titles, types, dates, tags; no document bodies). Open "
                    "knowledge bases need no credential; `public` ones any valid credential; `members` ones this organization's "
                    "own. Below the tier: 401 without a credential, 404 with one."))
async def list_entries(request: Request, org_slug: OrgSlug, kb: KbRef, content_type: ContentType = None,
                       group: Group = None, release: Release = None, status: Status = None, tags: Tags = None,
                       date_from: DateFrom = None, date_to: DateTo = None,
                       limit: Annotated[int, Parameter(ge=1, le=100)] = 20,
                       offset: Annotated[int, Parameter(ge=0, le=1_000_000)] = 0) -> Response[EntryPage]:
    pub = await published(request, org_slug, kb)
    page = await pub.reader.list_entries(_filters(content_type, group, release, status, tags, date_from, date_to),
                                         limit=limit, offset=offset)
    return _json_response(request, page, pub.cache_control("kb"))


@route(PUBLIC_PREFIX + "/api/v1/entries/{content_type:str}/{entry_id:str}", http_method=["GET", "HEAD"],
       operation_id=_operation_id("getPublicEntry"), tags=["knowledge (public)"], security=PUBLIC_SECURITY,
       exclude_from_auth=True, responses=PUBLIC_ERRORS, exception_handlers=PUBLIC_EXCEPTION_HANDLERS,
       summary="One entry: the whole document (frontmatter fields, markdown body) with its links and backlinks",
       description="Needs the knowledge base's document tier (default: members).")
async def get_entry(request: Request, org_slug: OrgSlug, kb: KbRef,
                    content_type: Annotated[str, Parameter(max_length=20, description="the entry's content type")],
                    entry_id: Annotated[str, Parameter(min_length=1, max_length=64, description="the entry's id")],
                    ) -> Response[Document]:
    pub = await published(request, org_slug, kb)
    pub.require("document")
    if content_type not in CONTENT_TYPES:
        raise NotFound("entry not found", details={"contentType": content_type[:20]})
    doc = await pub.reader.document(content_type, entry_id)
    return _json_response(request, doc, pub.cache_control("document"))


@route(PUBLIC_PREFIX + "/api/v1/search", http_method=["GET", "HEAD"], operation_id=_operation_id("searchPublic"),
       tags=["knowledge (public)"], security=PUBLIC_SECURITY, exclude_from_auth=True, responses=PUBLIC_ERRORS,
       exception_handlers=PUBLIC_EXCEPTION_HANDLERS,
       summary="Search a knowledge base (hybrid keyword + vector, reranked when a reranker is configured)",
       description=("Published read-only API. Passages that match the query, with their entries, as the caller's tier allows "
                    "(see the knowledge base's visibility)."))
async def search(request: Request, org_slug: OrgSlug, kb: KbRef,
                 q: Annotated[str, Parameter(min_length=1, max_length=1000, description="the query")],
                 content_type: ContentType = None, group: Group = None, release: Release = None,
                 status: Status = None, tags: Tags = None, date_from: DateFrom = None, date_to: DateTo = None,
                 limit: Annotated[int, Parameter(ge=1, le=20)] = 5) -> Response[KnowledgeSearchResult]:
    pub = await published(request, org_slug, kb)
    found = await pub.knowledge.search(pub.reader).search(
        q, _filters(content_type, group, release, status, tags, date_from, date_to), limit=limit)
    return _json_response(request, found, pub.cache_control("kb"))


@route(PUBLIC_PREFIX + "/api/v1/openapi.json", http_method=["GET", "HEAD"], operation_id=_operation_id("publicOpenApi"),
       tags=["knowledge (public)"], security=PUBLIC_SECURITY, exclude_from_auth=True, responses=PUBLIC_ERRORS,
       exception_handlers=PUBLIC_EXCEPTION_HANDLERS,
       summary="The OpenAPI document of this knowledge base's public API",
       description=("Published read-only API. The OpenAPI document of these public routes, with this knowledge base's URL as "
                    "its server."))
async def public_openapi(request: Request, org_slug: OrgSlug, kb: KbRef) -> Response[dict[str, Any]]:
    pub = await published(request, org_slug, kb)
    base = request.app.state.memex.settings.public_url or str(request.base_url).rstrip("/")
    doc = public_openapi_document(request.app.openapi_schema.to_schema(),
                                  f"{base}/kb/{pub.org_slug}/{pub.kb['slug']}/api/v1", pub.kb["name"])
    return _json_response(request, doc, pub.cache_control("kb"))


def public_openapi_document(full: dict[str, Any], server: str, name: str) -> dict[str, Any]:
    """The service's OpenAPI document cut down to one knowledge base's public API (paths relative to ``server``)."""
    prefix = "/kb/{org_slug}/{kb}/api/v1"
    paths: dict[str, Any] = {}
    for path, item in full.get("paths", {}).items():
        if not path.startswith(prefix):
            continue
        item = json.loads(json.dumps(item))
        for op in item.values():
            if isinstance(op, dict):
                op["parameters"] = [p for p in op.get("parameters", []) if p.get("name") not in ("org_slug", "kb")]
        paths[path[len(prefix):]] = item
    schemas = full.get("components", {}).get("schemas", {})
    wanted: set[str] = set()
    todo = [paths]
    while todo:
        node = todo.pop()
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/components/schemas/"):
                name_ = ref.rsplit("/", 1)[1]
                if name_ not in wanted and name_ in schemas:
                    wanted.add(name_)
                    todo.append(schemas[name_])
            todo.extend(node.values())
        elif isinstance(node, list):
            todo.extend(node)
    return {
        "openapi": full.get("openapi", "3.1.0"),
        "info": {"title": f"{name}: public knowledge API", "version": full.get("info", {}).get("version", "1.0.0"),
                 "description": "Read-only access to a knowledge base's entries and search (GET, CORS from any origin)."},
        "servers": [{"url": server}],
        "paths": paths,
        "components": {"schemas": {k: schemas[k] for k in sorted(wanted)},
                       "securitySchemes": full.get("components", {}).get("securitySchemes", {})},
    }


# -- MCP ------------------------------------------------------------------------------------------------------


def build_kb_server(pub: Published) -> Server:
    """A fresh MCP server for one request to one knowledge base (tools by tier, resources, prompts)."""
    kb = pub.kb
    base = f"mcp://{pub.org_slug}/{kb['slug']}"
    server = Server(f"memex-kb-{kb['slug']}", version="1.0.0",
                    instructions=f"The knowledge base '{kb['name']}'. Start with search_knowledge or define_term.")
    tools = {tool.name: tool for tool in KB_TOOLS}

    @server.list_tools()
    async def list_tools() -> list[t.Tool]:
        return [t.Tool(name=x.name, description=x.description, inputSchema=x.input_schema(),
                       outputSchema=output_schema(x.output)) for x in KB_TOOLS]

    @server.call_tool(validate_input=False)
    async def call_tool(name: str, arguments: dict[str, Any]) -> t.CallToolResult:
        tool = tools.get(name)
        if tool is None:
            return tool_error("not_found", f"unknown tool {name!r}")
        if not pub.allows(tool.needs):
            text = tier_error(required_tier(kb, tool.needs), pub.tier)
            return t.CallToolResult(content=[t.TextContent(type="text", text=text)], isError=True)
        arguments = arguments or {}
        error = next(iter(validator(f"kb:{tool.name}", tool.input_schema()).iter_errors(arguments)), None)
        if error is not None:
            path = "/".join(str(p) for p in error.absolute_path)
            return tool_error("invalid_input", f"Input validation error: {error.message}", {"field": path} if path else {})
        try:
            data, text = await tool.run(pub.knowledge, pub.reader, arguments)
        except MemexError as exc:
            return tool_error(exc.code, exc.message, exc.details)
        except Exception:  # never the raw exception text in a tool result (the SDK would send str(exc))
            log.exception("knowledge tool %s failed", tool.name)
            return tool_error("internal", "internal server error")
        plain = msgspec.to_builtins(data)
        return t.CallToolResult(content=[t.TextContent(type="text", text=text or msgspec.json.encode(plain).decode())],
                                structuredContent=plain)

    @server.list_resources()
    async def list_resources() -> list[t.Resource]:
        return [t.Resource(uri=uri, name=name, description=desc, mimeType=mime)
                for uri, name, desc, mime in resource_list(base)]

    @server.read_resource()
    async def read(uri: Any) -> list[ReadResourceContents]:
        try:
            mime, text = await read_resource(base, str(uri), pub.reader, json.loads(kb["ontology"] or "{}"))
        except NotFound as exc:
            raise McpError(t.ErrorData(code=-32002, message=exc.message)) from None
        return [ReadResourceContents(content=text, mime_type=mime)]

    @server.list_prompts()
    async def list_prompts() -> list[t.Prompt]:
        return [t.Prompt(name=p.name, description=p.description,
                         arguments=[t.PromptArgument(name=n, description=d, required=r) for n, d, r in p.arguments])
                for p in PROMPTS]

    @server.get_prompt()
    async def get_prompt(name: str, arguments: dict[str, str] | None) -> t.GetPromptResult:
        try:
            description, text = prompt_messages(name, kb["name"], arguments)
        except MemexError as exc:
            raise McpError(t.ErrorData(code=-32602, message=exc.message)) from None
        return t.GetPromptResult(description=description, messages=[
            t.PromptMessage(role="user", content=t.TextContent(type="text", text=text))])

    return server


@route(PUBLIC_PREFIX + "/mcp", http_method=["GET", "POST", "DELETE"], operation_id="mcpForKnowledgeBase",
       include_in_schema=False, exclude_from_auth=True)
async def kb_mcp(request: Request, org_slug: str, kb: str) -> ASGIApp:
    pub = await published(request, org_slug, kb)
    if request.method != "POST":
        return stateless_refusal()
    body = await checked_body(request)
    if not isinstance(body, bytes):
        return body
    return stateless_app(request.app.state.memex, body, lambda: build_kb_server(pub))


knowledge_public_handlers = [list_entries, get_entry, search, public_openapi, kb_mcp]
