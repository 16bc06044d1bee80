"""The per-organization MCP endpoint: Streamable HTTP, stateless, JSON responses.

Each POST builds a fresh low-level MCP Server for this request and this organization, answers, and is gone:
no tenant identity survives in any shared object. The tool list follows the credential's scopes (a key
without ``write`` never sees a write tool). ``/orgs/{slug}/mcp`` must name the caller's own organization
(404 otherwise); ``/mcp`` takes the organization from the credential. GET and DELETE are 405: a stateless
server has no stream to open and no session to end.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import mcp.types as t
from jsonschema import Draft202012Validator
import msgspec
from litestar import Request, route
from litestar.types import ASGIApp, Message, Receive, Scope, Send
from mcp.server.lowlevel import Server
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
from mcp.server.transport_security import TransportSecuritySettings

from api.errors import error_response
from api.limits import MAX_JSON_DEPTH
from api.request_log import current_request_id
from api.strict import json_too_deep
from api.wiring import Memex, OrgServices
from services.errors import MemexError, NotFound
from services.models import CaptureResult, SearchResult, ThoughtDetail, ThoughtPage
from services.search.search import SearchOptions
from services.text.temporal import MAX_MS

__all__ = ["mcp_handlers", "McpTool", "TOOLS", "register_tools", "stateless_app", "stateless_refusal", "checked_body",
           "tool_error", "validator"]

log = logging.getLogger("memex.mcp")
_SURROGATE = re.compile("[\ud800-\udfff]")


def output_schema(tp: Any) -> dict[str, Any]:
    """A self-contained JSON Schema object for a msgspec type (top-level $ref resolved, $defs kept)."""
    (schema,), defs = msgspec.json.schema_components([tp], ref_template="#/$defs/{name}")
    if "$ref" in schema:
        schema = dict(defs[schema["$ref"].rsplit("/", 1)[1]])
    if defs:
        schema["$defs"] = defs
    return schema


def to_plain(value: Any) -> dict[str, Any]:
    return msgspec.to_builtins(value)


@dataclass(frozen=True)
class McpTool:
    name: str
    scope: str
    description: str
    input_schema: dict[str, Any]
    output_schema: dict[str, Any]
    run: Callable[[OrgServices, dict[str, Any]], Awaitable[dict[str, Any]]]

    def definition(self) -> t.Tool:
        return t.Tool(name=self.name, description=self.description, inputSchema=self.input_schema,
                      outputSchema=self.output_schema)


def _obj(properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


_ID = {"type": "string", "minLength": 1, "maxLength": 64}


async def _capture(org: OrgServices, a: dict[str, Any]) -> dict[str, Any]:
    return to_plain(await org.thoughts.capture(a["content"], source=a.get("source"), metadata=a.get("metadata"),
                                               wait=a.get("wait", False)))


async def _search(org: OrgServices, a: dict[str, Any]) -> dict[str, Any]:
    return to_plain(
        await org.search.search(
            SearchOptions(query=a["query"], top_k=a.get("top_k", 10), tags=a.get("tags") or (),
                          include_content=a.get("include_content", False), min_score=a.get("min_score"))
        )
    )


async def _get(org: OrgServices, a: dict[str, Any]) -> dict[str, Any]:
    return to_plain(await org.thoughts.get(a["id"]))


async def _delete(org: OrgServices, a: dict[str, Any]) -> dict[str, Any]:
    await org.thoughts.delete(a["id"])
    return {"id": a["id"], "deleted": True}


async def _mark_used(org: OrgServices, a: dict[str, Any]) -> dict[str, Any]:
    return {"ids": await org.thoughts.mark_used(a["ids"])}


async def _recent(org: OrgServices, a: dict[str, Any]) -> dict[str, Any]:
    return to_plain(await org.thoughts.list_recent(limit=a.get("limit", 20), before=a.get("before"),
                                                   before_id=a.get("before_id")))


TOOLS: list[McpTool] = [
    McpTool(
        "capture_thought", "write",
        "Save a markdown note to this organization's memory. Idempotent: the same content returns the same id. "
        "Answered at once with decision 'pending': the duplicate / contradiction / merge decision follows moments "
        "later (get_thought shows it). With wait: true the result's decision says what happened: created, duplicate "
        "(blocked; the existing id is returned), flagged (a possible duplicate of related_id), contradiction, merged, "
        "replaced or kept_both.",
        _obj({"content": {"type": "string", "minLength": 1, "description": "markdown text (at most 256 KiB of UTF-8)"},
              "source": {"type": "string", "maxLength": 500, "description": "where it came from, e.g. obsidian:note.md"},
              "metadata": {"type": "object", "description": "any JSON object"},
              "wait": {"type": "boolean", "default": False,
                       "description": "wait for the write-time decision before answering"}}, ["content"]),
        output_schema(CaptureResult), _capture,
    ),
    McpTool(
        "semantic_search", "read",
        "Search this organization's memory by meaning and keywords; returns the best matching passages.",
        _obj({"query": {"type": "string", "minLength": 1, "maxLength": 4000},
              "top_k": {"type": "integer", "minimum": 1, "maximum": 100, "default": 10},
              "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 50, "description": "any of these tags"},
              "include_content": {"type": "boolean", "default": False, "description": "include each whole document"},
              "min_score": {"type": "number", "minimum": 0, "maximum": 10,
                            "description": "drop hits scoring below this; absent: weak matches are dropped, "
                                           "so an unrelated query returns few or no hits; 0: every candidate"}},
             ["query"]),
        output_schema(SearchResult), _search,
    ),
    McpTool("get_thought", "read", "Fetch one thought with its chunks by id.", _obj({"id": _ID}, ["id"]),
            output_schema(ThoughtDetail), _get),
    McpTool(
        "delete_thought", "write", "Delete a thought, its chunks and all its vectors.", _obj({"id": _ID}, ["id"]),
        {"type": "object", "properties": {"id": {"type": "string"}, "deleted": {"type": "boolean"}},
         "required": ["id", "deleted"]},
        _delete,
    ),
    McpTool(
        "mark_used", "write",
        "Tell memory which thoughts you actually used (acted on, quoted, relied on). Used thoughts rank slightly "
        "higher in later searches (at most 5 %, fading over weeks); search results alone never count as use.",
        _obj({"ids": {"type": "array", "items": _ID, "minItems": 1, "maxItems": 100, "uniqueItems": True}}, ["ids"]),
        {"type": "object", "properties": {"ids": {"type": "array", "items": {"type": "string"}}}, "required": ["ids"]},
        _mark_used,
    ),
    McpTool(
        "list_recent", "read", "The most recent thoughts, newest first; page with before (epoch ms) and before_id.",
        _obj({"limit": {"type": "integer", "minimum": 1, "maximum": 100, "default": 20},
              "before": {"type": "integer", "minimum": 0, "maximum": MAX_MS},
              "before_id": {"type": "string", "maxLength": 64}}, []),
        output_schema(ThoughtPage), _recent,
    ),
]

#: Other features add their tools here (name -> tool); the endpoint offers every tool the scopes allow.
_REGISTRY: dict[str, McpTool] = {tool.name: tool for tool in TOOLS}


def register_tools(tools: list[McpTool]) -> None:
    for tool in tools:
        _REGISTRY[tool.name] = tool
        _DEFINITIONS.pop(tool.name, None)
        _VALIDATORS.pop(tool.name, None)


_DEFINITIONS: dict[str, t.Tool] = {}
_VALIDATORS: dict[str, Draft202012Validator] = {}


def _definition(tool: McpTool) -> t.Tool:
    found = _DEFINITIONS.get(tool.name)
    if found is None:
        found = _DEFINITIONS[tool.name] = tool.definition()
    return found


def validator(name: str, schema: dict[str, Any]) -> Draft202012Validator:
    found = _VALIDATORS.get(name)
    if found is None:
        found = _VALIDATORS[name] = Draft202012Validator(schema)
    return found


def build_server(org: OrgServices) -> Server:
    server = Server("memex", version="1.0.0", instructions=f"Memory of the organization '{org.ctx.org_slug}'.")
    visible = {name: tool for name, tool in _REGISTRY.items() if org.ctx.allows(tool.scope)}

    @server.list_tools()
    async def list_tools() -> list[t.Tool]:
        return [_definition(tool) for tool in visible.values()]

    # The SDK would re-check each schema against its metaschema and validate input and output on every call
    # (~30 ms a search); validators are compiled once per tool instead, and results are returned whole.
    @server.call_tool(validate_input=False)
    async def call_tool(name: str, arguments: dict[str, Any]) -> t.CallToolResult:
        tool = visible.get(name)
        if tool is None:
            return tool_error("not_found", f"unknown tool {name!r}")
        arguments = arguments or {}
        error = next(iter(validator(tool.name, tool.input_schema).iter_errors(arguments)), None)
        if error is not None:
            path = "/".join(str(p) for p in error.absolute_path)
            return tool_error("invalid_input", f"Input validation error: {error.message}", {"field": path} if path else {})
        try:
            data = await tool.run(org, arguments)
        except MemexError as exc:
            return tool_error(exc.code, exc.message, exc.details)
        except Exception:  # never the raw exception text in a tool result
            log.exception("MCP tool %s failed", tool.name)
            return tool_error("internal", "internal server error")
        return t.CallToolResult(
            content=[t.TextContent(type="text", text=msgspec.json.encode(data).decode())], structuredContent=data
        )

    return server


def tool_error(code: str, message: str, details: dict[str, Any] | None = None) -> t.CallToolResult:
    body = {"error": {"code": code, "message": message, "details": details or {}}}
    # valid UTF-8 whatever the message quotes (a lone surrogate becomes U+FFFD)
    text = _SURROGATE.sub("\ufffd", json.dumps(body, ensure_ascii=False, default=str))
    return t.CallToolResult(content=[t.TextContent(type="text", text=text)], isError=True)


def _security(memex: Memex) -> TransportSecuritySettings | None:
    s = memex.settings
    if not s.mcp_allowed_hosts and not s.mcp_allowed_origins:
        return None
    return TransportSecuritySettings(
        enable_dns_rebinding_protection=True, allowed_hosts=s.mcp_allowed_hosts, allowed_origins=s.mcp_allowed_origins
    )


async def _endpoint(request: Request, slug: str | None) -> ASGIApp:
    memex: Memex = request.app.state.memex
    ctx = request.user
    if slug is not None and slug != ctx.org_slug:
        raise NotFound("organization not found")
    if request.method != "POST":
        return stateless_refusal()
    body = await checked_body(request)
    if not isinstance(body, bytes):
        return body
    org = await memex.for_org(ctx)
    return stateless_app(memex, body, lambda: build_server(org))


def stateless_refusal() -> ASGIApp:
    """GET and DELETE on a stateless MCP endpoint: 405 (no stream to open, no session to end)."""
    return error_response(405, "method_not_allowed", "this MCP endpoint is stateless: POST JSON-RPC messages",
                          headers={"Allow": "POST"})


async def checked_body(request: Request) -> bytes | ASGIApp:
    """The request's JSON-RPC body, or the 400 that answers a body the SDK must not see (too deep, not JSON)."""
    body = await request.body()  # bounded by api.limits (413)
    if json_too_deep(body):
        return error_response(400, "invalid_input", f"JSON nests deeper than {MAX_JSON_DEPTH} levels",
                              {"jsonrpc_code": -32700})
    try:  # the SDK's json.loads would take lone surrogates (and recurse without bound)
        msgspec.json.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError) as exc:
        return error_response(400, "invalid_input", "the body is not valid JSON (UTF-8, no lone surrogates)",
                              {"jsonrpc_code": -32700, "reason": str(exc)[:200]})
    return body


def stateless_app(memex: Memex, body: bytes, build: Callable[[], Server]) -> ASGIApp:
    """An ASGI app answering one JSON-RPC POST with a fresh server from ``build`` (stateless, JSON responses)."""
    security = _security(memex)

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        manager = StreamableHTTPSessionManager(app=build(), stateless=True, json_response=True,
                                               security_settings=security)
        async with manager.run():
            await manager.handle_request(scope, _replay(body), _error_bodies(send))

    return app


def _replay(body: bytes) -> Receive:
    sent = False

    async def receive() -> Message:
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return receive


_TRANSPORT_MESSAGES = {-32700: "the body is not valid JSON", -32602: "not a valid JSON-RPC message"}
_TRANSPORT_CODES = {400: "invalid_input", 403: "forbidden", 404: "not_found", 405: "method_not_allowed",
                    406: "not_acceptable", 415: "unsupported_media_type", 421: "misdirected_request", 500: "internal"}


def _error_bodies(send: Send) -> Send:
    """The SDK transport answers its own errors (JSON-RPC errors or plain text): as the one error body."""
    held: dict[str, Any] = {}

    async def wrapped(message: Message) -> None:
        if message["type"] == "http.response.start" and message["status"] >= 400:
            held.update(start=message, body=b"")
            return
        if not held:
            await send(message)
            return
        held["body"] += message.get("body", b"")
        if message.get("more_body"):
            return
        start = held["start"]
        status = start["status"]
        code, text = None, held["body"].decode("utf-8", "replace")
        try:
            err = json.loads(text).get("error") or {}
            code, text = err.get("code"), str(err.get("message") or text)
        except (ValueError, AttributeError):
            pass
        text = _TRANSPORT_MESSAGES.get(code, text.strip()[:300] or "error")
        details = {"jsonrpc_code": code} if isinstance(code, int) else {}
        out = msgspec.json.encode({"error": {"code": _TRANSPORT_CODES.get(status, "error"), "message": text,
                                             "details": details, "request_id": current_request_id()}})
        headers = [(k, v) for k, v in start.get("headers", []) if k.lower() not in (b"content-type", b"content-length")]
        await send({**start, "headers": [*headers, (b"content-type", b"application/json"),
                                         (b"content-length", str(len(out)).encode())]})
        await send({"type": "http.response.body", "body": out})

    return wrapped


@route("/orgs/{org_slug:str}/mcp", http_method=["GET", "POST", "DELETE"], operation_id="mcpForOrg",
       include_in_schema=False)
async def mcp_for_org(request: Request, org_slug: str) -> ASGIApp:
    return await _endpoint(request, org_slug)


@route("/mcp", http_method=["GET", "POST", "DELETE"], operation_id="mcp", include_in_schema=False)
async def mcp_from_credential(request: Request) -> ASGIApp:
    return await _endpoint(request, None)


mcp_handlers = [mcp_for_org, mcp_from_credential]
