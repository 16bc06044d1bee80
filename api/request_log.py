"""Request ids and the request log: one line per request on the logger ``memex.request``.

``request_log(app)`` is the outermost ASGI layer (around api.limits' guard, so what the guard refuses is logged
and carries an id too). Per HTTP request it

- takes the client's ``X-Request-Id`` when it is sane (1-128 of ``[A-Za-z0-9._:-]``), else makes one
  (``req_`` + 24 hex digits); the id is returned as ``X-Request-Id`` on every response and is what
  ``current_request_id()`` answers while the request runs (api.errors puts it in every error body);
- logs one line when the response is done: method, the route's path template (``/v1/thoughts/{thought_id}``;
  ``<unmatched>`` for a request no route took, never the raw path), status, duration in ms, organization id and
  credential when authenticated (a key's id, never its secret), and the request id. Never a body, a query
  string or a header's value.

Text (the default), after ``TEXT_FORMAT``'s time, level and logger name:
``GET /v1/thoughts/{thought_id} 200 3.1ms org=org_... key=key_... request_id=req_...`` (``key=`` names an API key's
id, ``user`` for a Cloudflare Access user (the address is not logged), ``service:<common name>`` for an Access
service token, ``-`` for none). ``MEMEX_LOG_FORMAT=json``: one JSON object per line on stderr, ``{"time", "level",
"logger", "method", "path", "status", "duration_ms", "org_id", "key_id", "principal", "request_id"}``; the
service's other records are JSON lines too (``{"time", "level", "logger", "message"}``). ``logging_config()`` is
what the app gives Litestar to set that up.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from contextvars import ContextVar
from typing import Any

from litestar.logging.config import LoggingConfig
from litestar.types import ASGIApp, Message, Receive, Scope, Send

from tenancy.models import AuthContext

__all__ = ["request_log", "logging_config", "current_request_id", "new_request_id", "JsonLineFormatter",
           "UNMATCHED", "LOGGER_NAME", "REQUEST_ID_HEADER", "TEXT_FORMAT"]

LOGGER_NAME = "memex.request"
REQUEST_ID_HEADER = "X-Request-Id"
#: The path of a request no route took: a 404, a 405 (no route for the method), or refused by api.limits before
#: routing (413, 414, 431). Never the raw path: it can carry ids and text.
UNMATCHED = "<unmatched>"

log = logging.getLogger(LOGGER_NAME)
_HEADER = REQUEST_ID_HEADER.lower().encode()
_SANE = re.compile(rb"[A-Za-z0-9._:-]{1,128}")
_current: ContextVar[str | None] = ContextVar("memex_request_id", default=None)


def new_request_id() -> str:
    return "req_" + os.urandom(12).hex()


def current_request_id() -> str:
    """The running request's id (a fresh one outside a request: an error body always names one)."""
    return _current.get() or new_request_id()


def _client_id(headers: Any) -> str | None:
    for name, value in headers:
        if name == _HEADER:
            return value.decode("ascii") if _SANE.fullmatch(value) else None
    return None


def _credential(user: Any) -> tuple[str | None, str | None, str | None]:
    """(org id, key id, principal kind) of an authenticated request; an Access user's address is withheld."""
    if not isinstance(user, AuthContext):
        return None, None, None
    kind = user.principal.split(":", 1)[0]
    principal = user.principal if kind == "service" else kind
    return user.org_id, user.key_id, principal


def request_log(app: ASGIApp) -> ASGIApp:
    async def logged(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        rid = _client_id(scope["headers"]) or new_request_id()
        token = _current.set(rid)
        header = (_HEADER, rid.encode())
        started = time.perf_counter()
        status: int | None = None

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message = {**message, "headers": [*message.get("headers", ()), header]}  # type: ignore[typeddict-item]
            await send(message)

        try:
            await app(scope, receive, send_with_id)
        finally:
            _current.reset(token)
            if log.isEnabledFor(logging.INFO):
                _emit(scope, status, (time.perf_counter() - started) * 1000, rid)

    return logged


def _emit(scope: Scope, status: int | None, ms: float, rid: str) -> None:
    method = scope.get("method", "-")
    path = scope.get("path_template") or UNMATCHED
    org_id, key_id, principal = _credential(scope.get("user"))
    key = key_id or principal or "-"
    fields = {"method": method, "path": path, "status": status, "duration_ms": round(ms, 1), "org_id": org_id,
              "key_id": key_id, "principal": principal, "request_id": rid}
    log.info("%s %s %s %.1fms org=%s key=%s request_id=%s", method, path, status if status is not None else "-", ms,
             org_id or "-", key, rid, extra={"memex_request": fields})


class JsonLineFormatter(logging.Formatter):
    """One JSON object per record: time (UTC, ms), level, logger, and the request's fields (a record without
    them: its message)."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(), "logger": record.name,
        }
        fields = getattr(record, "memex_request", None)
        if fields is not None:
            out.update(fields)
        else:
            out["message"] = record.getMessage()
            if record.exc_info:
                out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


#: The text format of every log line the service writes (``MEMEX_LOG_FORMAT=text``).
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def logging_config(fmt: str) -> LoggingConfig:
    """The app's logging (Litestar configures the root logger with it, written to stderr off the event loop through
    a queue): ``text`` lines (``TEXT_FORMAT``), or ``json``: one JSON object per line (``JsonLineFormatter``), the
    request lines and every other record of the service."""
    formatter = {"()": f"{__name__}.JsonLineFormatter"} if fmt == "json" else {"format": TEXT_FORMAT}
    return LoggingConfig(formatters={"standard": formatter})
