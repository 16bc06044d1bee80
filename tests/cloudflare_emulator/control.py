"""Run-time knobs: global rate limit, fault injection, request counters.

Everything here is thread-safe: the server runs in its own thread while tests poke the knobs from theirs.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

FAULT_KINDS = ("rate_limit", "status", "d1_transient")
D1_TRANSIENT_MESSAGES = {
    "network": "D1_ERROR: Network connection lost.",
    "remote": "D1_ERROR: transient issue on remote node",
}


class RateLimiter:
    """Global limit per token: ``limit`` requests per sliding ``window_s``.

    The request that would be number ``limit + 1`` inside the window is answered 429 and starts a block of
    ``window_s`` seconds during which *every* call with that token is answered 429 (the docs: "every API call
    is blocked for the next 5 minutes"). Blocked calls do not extend the block. When the block ends the
    token starts with an empty window.
    """

    def __init__(self, limit: int = 1200, window_s: float = 300.0):
        self._lock = threading.Lock()
        self.limit = int(limit)
        self.window_s = float(window_s)
        self._hits: dict[str, deque[float]] = {}
        self._blocked_until: dict[str, float] = {}

    def configure(self, limit: int | None = None, window_s: float | None = None) -> None:
        with self._lock:
            if limit is not None:
                self.limit = int(limit)
            if window_s is not None:
                self.window_s = float(window_s)
            self._hits.clear()
            self._blocked_until.clear()

    def reset(self) -> None:
        with self._lock:
            self._hits.clear()
            self._blocked_until.clear()

    def hit(self, token: str) -> tuple[bool, dict[str, str]]:
        """Count one request. Returns (allowed, headers)."""
        now = time.monotonic()
        with self._lock:
            until = self._blocked_until.get(token)
            if until is not None:
                if now < until:
                    return False, self._blocked_headers(until - now)
                del self._blocked_until[token]
                self._hits.pop(token, None)
            hits = self._hits.setdefault(token, deque())
            cutoff = now - self.window_s
            while hits and hits[0] <= cutoff:
                hits.popleft()
            if len(hits) >= self.limit:
                self._blocked_until[token] = now + self.window_s
                hits.clear()
                return False, self._blocked_headers(self.window_s)
            hits.append(now)
            reset = max(0.0, hits[0] + self.window_s - now)
            return True, {
                "x-ratelimit-limit": str(self.limit),
                "x-ratelimit-remaining": str(max(0, self.limit - len(hits))),
                "x-ratelimit-reset": str(max(1, math.ceil(reset))),
            }

    def _blocked_headers(self, remaining_s: float) -> dict[str, str]:
        secs = str(max(1, math.ceil(remaining_s)))
        return {
            "retry-after": secs,
            "x-ratelimit-limit": str(self.limit),
            "x-ratelimit-remaining": "0",
            "x-ratelimit-reset": secs,
        }

    def snapshot(self) -> dict[str, Any]:
        now = time.monotonic()
        with self._lock:
            return {
                "limit": self.limit,
                "window_s": self.window_s,
                "blocked": {t: round(u - now, 3) for t, u in self._blocked_until.items() if u > now},
                "in_window": {t: len(h) for t, h in self._hits.items()},
            }


@dataclass
class Fault:
    """One fault rule: the next ``count`` API requests whose path contains ``path_contains`` (and whose
    method equals ``method`` when given) get this failure instead of (or, with ``after=True``, after) being
    served."""

    kind: str = "status"                 # rate_limit | status | d1_transient
    count: int = 1
    path_contains: str | None = None
    method: str | None = None
    status: int | None = None            # default: 429 / 500 / 500 by kind
    retry_after: float | None = None     # seconds; rate_limit default 1
    message: str | None = None           # error message (d1_transient: full D1 message or "network"/"remote")
    code: int | None = None
    after: bool = False                  # run the request for real, then answer the failure anyway
    raw_body: str | None = None          # answer this non-JSON body instead of an envelope (e.g. an HTML 502)
    id: int = field(default=0)

    def matches(self, method: str, path: str) -> bool:
        if self.count <= 0:
            return False
        if self.path_contains and self.path_contains not in path:
            return False
        if self.method and self.method.upper() != method.upper():
            return False
        return True

    def response(self) -> tuple[int, dict | str, dict[str, str]]:
        from .errors import D1_SQL_ERROR, RATE_LIMITED, SERVER_ERROR, error_envelope

        headers: dict[str, str] = {}
        if self.kind == "rate_limit":
            status = self.status or 429
            ra = self.retry_after if self.retry_after is not None else 1
            headers["retry-after"] = str(max(0, math.ceil(ra)))
            headers["x-ratelimit-remaining"] = "0"
            code = self.code or RATE_LIMITED
            msg = self.message or "Please wait and consider throttling your request speed"
        elif self.kind == "d1_transient":
            status = self.status or 500
            code = self.code or D1_SQL_ERROR
            msg = D1_TRANSIENT_MESSAGES.get(self.message or "network", self.message or "")
        else:
            status = self.status or 500
            code = self.code or SERVER_ERROR
            msg = self.message or ("Service unavailable" if status == 503 else "Internal server error")
            if self.retry_after is not None:
                headers["retry-after"] = str(max(0, math.ceil(self.retry_after)))
        if self.raw_body is not None:
            headers["content-type"] = "text/html; charset=utf-8"
            return status, self.raw_body, headers
        return status, error_envelope(code, msg), headers


class Faults:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rules: list[Fault] = []
        self._next_id = 1

    def add(self, **kw: Any) -> Fault:
        kind = kw.get("kind", "status")
        if kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault kind {kind!r}; expected one of {FAULT_KINDS}")
        allowed = {f for f in Fault.__dataclass_fields__ if f != "id"}
        unknown = set(kw) - allowed
        if unknown:
            raise ValueError(f"unknown fault fields {sorted(unknown)}")
        with self._lock:
            fault = Fault(**kw, id=self._next_id)
            self._next_id += 1
            self._rules.append(fault)
            return fault

    def take(self, method: str, path: str) -> Fault | None:
        with self._lock:
            for rule in self._rules:
                if rule.matches(method, path):
                    rule.count -= 1
                    if rule.count <= 0:
                        self._rules.remove(rule)
                    return rule
        return None

    def clear(self) -> None:
        with self._lock:
            self._rules.clear()

    def list(self) -> list[dict]:
        with self._lock:
            return [asdict(r) for r in self._rules]


class Counters:
    """Requests received under /client/v4, by kind (d1 / vectorize / ai / other), by operation, by status and, for
    requests naming a D1 database (``d1/database/{db}/...``), by that database id.

    Every request is counted, whatever its outcome (auth failure, 429, injected fault, error)."""

    KINDS = ("d1", "vectorize", "ai", "other")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kinds = dict.fromkeys(self.KINDS, 0)
        self._ops: dict[str, int] = {}
        self._statuses: dict[str, int] = {}
        self._databases: dict[str, int] = {}

    def record(self, kind: str, op: str, database: str | None = None) -> None:
        with self._lock:
            self._kinds[kind] = self._kinds.get(kind, 0) + 1
            self._ops[op] = self._ops.get(op, 0) + 1
            if database is not None:
                self._databases[database] = self._databases.get(database, 0) + 1

    def record_status(self, status: int) -> None:
        with self._lock:
            key = str(status)
            self._statuses[key] = self._statuses.get(key, 0) + 1

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            out: dict[str, Any] = dict(self._kinds)
            out["total"] = sum(self._kinds.values())
            out["by_op"] = dict(self._ops)
            out["by_status"] = dict(self._statuses)
            out["by_database"] = dict(self._databases)
            return out

    def reset(self) -> dict[str, Any]:
        with self._lock:
            out: dict[str, Any] = dict(self._kinds)
            out["total"] = sum(self._kinds.values())
            out["by_op"] = dict(self._ops)
            out["by_status"] = dict(self._statuses)
            out["by_database"] = dict(self._databases)
            self._kinds = dict.fromkeys(self.KINDS, 0)
            self._ops = {}
            self._statuses = {}
            self._databases = {}
            return out
