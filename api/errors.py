"""Every error leaves as ``{"error": {"code", "message", "details", "request_id"}}`` with the right status: the one
mapper. ``request_id`` is the request's ``X-Request-Id`` (api.request_log)."""

from __future__ import annotations

import logging
from typing import Annotated, Any

import msgspec
from litestar import MediaType, Request, Response
from litestar.exceptions import HTTPException, ValidationException
from litestar.openapi.datastructures import ResponseSpec

from api.request_log import current_request_id
from services.errors import MemexError, RateLimited, answer_status

__all__ = ["ErrorBody", "ErrorDetail", "exception_handlers", "error_response", "error_responses"]

log = logging.getLogger("memex.api")

_CODES = {
    400: "invalid_input",
    401: "unauthenticated",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    406: "not_acceptable",
    409: "conflict",
    413: "payload_too_large",
    414: "uri_too_long",
    415: "unsupported_media_type",
    429: "rate_limited",
    431: "headers_too_large",
    500: "internal",
    503: "backend_unavailable",
    507: "insufficient_storage",
}


class ErrorDetail(msgspec.Struct):
    #: A stable machine-readable code (``not_found``, ``invalid_input``, ``rate_limited``...).
    code: str
    message: str
    details: dict[str, Any]
    request_id: Annotated[str, msgspec.Meta(
        description="The request's id: its X-Request-Id response header, and the request log's request_id")]


class ErrorBody(msgspec.Struct):
    error: ErrorDetail


def error_response(status: int, code: str, message: str, details: dict[str, Any] | None = None, headers=None) -> Response:
    return Response(
        content={"error": {"code": code, "message": message, "details": details or {},
                           "request_id": current_request_id()}},
        status_code=status,
        media_type=MediaType.JSON,
        headers=headers,
    )


def _memex(_: Request, exc: MemexError) -> Response:
    headers = {**exc.headers, "Retry-After": str(exc.retry_after)} if isinstance(exc, RateLimited) else None
    status = answer_status(exc)
    if status >= 500:
        log.warning("backend error: %s %s", exc.message, exc.details)
    return error_response(status, exc.code, exc.message, exc.details, headers)


def _http(_: Request, exc: HTTPException) -> Response:
    status = exc.status_code
    details: dict[str, Any] = {}
    message = exc.detail or "error"
    if isinstance(exc, ValidationException) or status == 400:
        status = 400
        if isinstance(exc.extra, list):
            details["errors"] = [
                {k: v for k, v in e.items() if k in ("key", "message", "source")} if isinstance(e, dict) else str(e)
                for e in exc.extra
            ]
    if isinstance(exc.extra, dict):
        details.update(exc.extra)
    return error_response(status, _CODES.get(status, "error"), message, details, exc.headers)


def _internal(_: Request, exc: Exception) -> Response:
    log.exception("unhandled error", exc_info=exc)
    return error_response(500, "internal", "internal server error")


exception_handlers = {MemexError: _memex, HTTPException: _http, Exception: _internal}


def error_responses(*statuses: int) -> dict[int, ResponseSpec]:
    descriptions = {
        400: "Invalid input",
        401: "Missing or invalid credentials",
        403: "The credential lacks the scope this needs",
        404: "Not found (or not yours)",
        409: "Conflict",
        413: "Payload too large",
        429: "Rate limited; see Retry-After",
        507: "Insufficient storage: the disk is full; nothing was written",
    }
    return {
        s: ResponseSpec(data_container=ErrorBody, description=descriptions.get(s, "Error"), generate_examples=False)
        for s in statuses
    }
