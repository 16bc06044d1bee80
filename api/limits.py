"""Request limits enforced before any route runs, answered with the one error body.

``guard(app)`` wraps the Litestar ASGI handler (the outermost layer after the HTTP server):

- a URL (path and query) longer than ``MAX_URL_BYTES`` is 414, request headers over ``MAX_HEADER_BYTES`` in
  total are 431: whatever HTTP server lets such a request through;
- a body longer than ``MAX_BODY_BYTES`` is 413: at once when Content-Length says so, else as soon as the
  streamed body passes the limit (the app then sees a disconnect and its own reply is dropped). This covers
  every route, the MCP endpoint included, whose SDK transport would read any body whole;
  ``POST /v1/org/import`` may send up to ``MAX_IMPORT_BYTES`` (an organization's bundle, which that
  route reads as it streams, line by line: ``LARGE_BODIES``), a knowledge base's archive import up to
  ``MAX_ARCHIVE_BYTES``;
- an OPTIONS reply's ``Allow`` (and a CORS preflight's ``Access-Control-Allow-Methods``) lists exactly the methods
  of the route (Litestar's automatic OPTIONS handler
  can name the methods of a sibling handler group only).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable

import msgspec
from litestar.types import ASGIApp, Message, Receive, Scope, Send

from api.request_log import current_request_id

__all__ = ["guard", "error_bytes", "body_limit", "MAX_BODY_BYTES", "MAX_IMPORT_BYTES", "MAX_ARCHIVE_BYTES",
           "MAX_BATCH_BODY_BYTES", "MAX_URL_BYTES", "MAX_HEADER_BYTES",
           "MAX_JSON_DEPTH"]

log = logging.getLogger("memex.api")

#: Largest request body (a capture is at most 1 MiB of text; a conversation append at most 100 x 64 KiB).
MAX_BODY_BYTES = 8 * 1024 * 1024
#: Largest organization bundle (POST /v1/org/import reads it as it streams, never whole: api.org_lifecycle).
MAX_IMPORT_BYTES = 1024 * 1024 * 1024
#: Largest knowledge base archive (POST /v1/knowledge-bases/{kb}/import; services.knowledge.archive).
MAX_ARCHIVE_BYTES = 64 * 1024 * 1024
#: Largest batch capture (POST /v1/thoughts:batch: up to 1,000 thoughts).
MAX_BATCH_BODY_BYTES = 64 * 1024 * 1024
#: Routes whose body may be larger than MAX_BODY_BYTES: (method, path) -> their limit; and path patterns.
LARGE_BODIES = {("POST", "/v1/org/import"): MAX_IMPORT_BYTES, ("POST", "/v1/thoughts:batch"): MAX_BATCH_BODY_BYTES}
LARGE_BODY_PATTERNS = [("POST", re.compile(r"^/v1/knowledge-bases/[^/]+/import$"), MAX_ARCHIVE_BYTES)]
#: Longest path + query string.
MAX_URL_BYTES = 8 * 1024
#: Largest total of request header names and values.
MAX_HEADER_BYTES = 16 * 1024
#: Deepest nesting of arrays and objects in a JSON body (metadata included).
MAX_JSON_DEPTH = 32

_CODES = {400: "invalid_input", 413: "payload_too_large", 414: "uri_too_long", 431: "headers_too_large",
          500: "internal", 501: "not_implemented"}


def error_bytes(status: int, message: str, details: dict | None = None, code: str | None = None,
                request_id: str | None = None) -> bytes:
    return msgspec.json.encode(
        {"error": {"code": code or _CODES.get(status, "error"), "message": message, "details": details or {},
                   "request_id": request_id or current_request_id()}}
    )


async def _reply(send: Send, status: int, message: str, details: dict | None = None,
                 headers: list[tuple[bytes, bytes]] | None = None) -> None:
    body = error_bytes(status, message, details)
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"), *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


class _TooLarge(Exception):
    pass


def body_limit(scope: Scope) -> int:
    """The largest body this request may send: MAX_BODY_BYTES, or a streamed route's own limit."""
    method = scope.get("method", "")
    found = LARGE_BODIES.get((method, scope["path"]))
    if found is not None:
        return found
    return next((limit for m, pattern, limit in LARGE_BODY_PATTERNS if m == method and pattern.match(scope["path"])),
                MAX_BODY_BYTES)


def guard(app: ASGIApp, route_methods: Callable[[Scope], set[str] | None]) -> ASGIApp:
    """``route_methods(scope)``: the methods the request's route answers (for OPTIONS' Allow)."""

    async def guarded(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        url = len(scope.get("raw_path") or scope["path"].encode("utf-8", "replace")) + len(scope.get("query_string", b""))
        if url > MAX_URL_BYTES:
            await _reply(send, 414, f"the URL is longer than {MAX_URL_BYTES} bytes", {"limit": MAX_URL_BYTES})
            return
        header_bytes = sum(len(k) + len(v) for k, v in scope["headers"])
        if header_bytes > MAX_HEADER_BYTES:
            await _reply(send, 431, f"the request headers are larger than {MAX_HEADER_BYTES} bytes",
                         {"limit": MAX_HEADER_BYTES})
            return
        limit = body_limit(scope)
        length = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if length is not None and length.isdigit() and int(length) > limit:
            await _reply(send, 413, f"the body is larger than {limit} bytes", {"limit": limit})
            return

        state = {"received": 0, "started": False, "refused": False}

        async def limited_receive() -> Message:
            if state["refused"]:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                state["received"] += len(message.get("body", b""))
                if state["received"] > limit:
                    state["refused"] = True
                    if not state["started"]:
                        state["started"] = True
                        await _reply(send, 413, f"the body is larger than {limit} bytes", {"limit": limit})
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: Message) -> None:
            if state["refused"]:
                return  # the 413 has been sent; the app's own reply to the disconnect goes nowhere
            if message["type"] == "http.response.start":
                state["started"] = True
                if scope.get("method") == "OPTIONS":
                    message = _fix_allow(message, scope, route_methods)
            await send(message)

        try:
            await app(scope, limited_receive, guarded_send)
        except Exception:
            log.exception("unhandled error outside the route handlers")
            if not state["started"]:
                await _reply(send, 500, "internal server error")

    return guarded


#: The headers of an OPTIONS reply that name methods: Allow, and a CORS preflight's Access-Control-Allow-Methods.
_METHOD_HEADERS = (b"allow", b"access-control-allow-methods")


def _fix_allow(message: Message, scope: Scope, route_methods: Callable[[Scope], set[str] | None]) -> Message:
    """An OPTIONS reply names exactly the route's methods, in Allow and in a CORS preflight's answer alike (a
    read-only route, the published knowledge API, advertises GET, HEAD and OPTIONS, not every method)."""
    headers = message.get("headers") or []
    if not any(k.lower() in _METHOD_HEADERS for k, _ in headers):
        return message
    methods = route_methods(scope)
    if not methods:
        return message
    allow = ", ".join(sorted(methods | {"OPTIONS"})).encode()
    return {**message, "headers": [(k, allow if k.lower() in _METHOD_HEADERS else v) for k, v in headers]}
