"""The Cloudflare REST client shared by the D1, Vectorize and Workers AI adapters.

One ``CloudflareApi`` per ``httpx.AsyncClient`` (so per process: the composition root makes one client): base URL
and account, bearer auth, the envelope (``{"success", "errors", "messages", "result"}``), the request budget,
per-kind counters, and retries.

Retries (exponential backoff with jitter, at most ``max_attempts`` tries, each try spends a budget slot):

* always, whatever the work: failures where the request provably did not run — connect errors and connect
  or pool timeouts (nothing reached Cloudflare), 429 (the rate limiter answers before anything runs;
  ``Retry-After`` is honoured, and a wait longer than ``max_retry_after`` is not slept through: the budget is
  blocked for that long and the call fails with ``CloudflareRateLimited``), and D1 "overloaded" (the
  request was queued and then refused);
* only for idempotent work (reads, Vectorize upsert/delete, embeddings, SQL the D1 adapter classifies as
  idempotent or the caller marks so): read/write timeouts and dropped connections after sending, 5xx, and
  the transient D1 errors "Network connection lost", "transient issue on remote node", "DB reset because
  its code was updated" and storage reset/startup errors — in those cases the statement may have
  committed before the failure was reported, so a plain ``INSERT`` is not sent twice.

Errors map to ``services.errors``: everything here is a ``BackendError`` (503) subclass; the D1 adapter turns
SQL errors into sqlite3-style exceptions on top of ``CloudflareApiError``.
"""

from __future__ import annotations

import asyncio
import email.utils
import logging
import math
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import httpx

from services.errors import BackendError

from .budget import RequestBudget

__all__ = [
    "CloudflareApi",
    "CloudflareApiError",
    "CloudflareAuthError",
    "CloudflareNotFound",
    "CloudflareRateLimited",
    "KINDS",
    "default_timeout",
    "http_client",
]

log = logging.getLogger("memex.cloudflare")

KINDS = ("d1", "vectorize", "ai")

#: D1 messages meaning the request was refused before it ran: safe to retry any statement.
D1_NOT_RUN = ("overloaded",)
#: D1 messages meaning "try again", but the statement may have run: retried for idempotent work only.
D1_TRANSIENT = (
    "network connection lost",
    "transient issue on remote node",
    "reset because its code was updated",
    "storage caused object to be reset",
    "internal error while starting up",
    "object to be reset",  # storage resets; CPU/memory-limit resets are excluded below
)
D1_NOT_TRANSIENT = ("cpu time limit", "memory limit", "exceeded its cpu", "exceeded its memory")
#: Workers AI 429s that are not the global API rate limit (they must not block D1 and Vectorize).
AI_OWN_429_CODES = {3036, 3040}
AI_NO_RETRY_CODES = {3036}  # the free daily allocation is spent: waiting seconds will not help


def default_timeout() -> httpx.Timeout:
    """D1 and the API cap a request at 30 s: read a little longer than that before giving up."""
    return httpx.Timeout(connect=5.0, read=40.0, write=30.0, pool=10.0)


def http_client() -> httpx.AsyncClient:
    """An HTTP client for the Cloudflare API (the composition root makes one per process; the backend closes it)."""
    return httpx.AsyncClient(
        timeout=default_timeout(),
        limits=httpx.Limits(max_connections=32, max_keepalive_connections=16, keepalive_expiry=30.0),
        headers={"User-Agent": "memex/0.1 (+httpx)"},
        follow_redirects=False,
    )


class CloudflareApiError(BackendError):
    """A Cloudflare API call failed (after any retries)."""

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        errors: list[dict[str, Any]] | None = None,
        kind: str = "",
        attempts: int = 1,
        details: dict[str, Any] | None = None,
    ) -> None:
        info = {"status": status, "kind": kind, "attempts": attempts}
        if errors:
            info["errors"] = errors[:5]
        super().__init__(message, details={**info, **(details or {})})
        self.status = status
        self.errors = errors or []
        self.kind = kind
        self.attempts = attempts

    @property
    def codes(self) -> list[int]:
        return [e.get("code") for e in self.errors if isinstance(e, dict) and isinstance(e.get("code"), int)]

    @property
    def text(self) -> str:
        """Every error message joined (what the D1 adapter reads for SQL errors)."""
        msgs = [str(e.get("message", "")) for e in self.errors if isinstance(e, dict)]
        return "; ".join(m for m in msgs if m) or self.message


class CloudflareAuthError(CloudflareApiError):
    """401/403 or code 10000: the token is wrong, expired, or lacks a permission."""


class CloudflareNotFound(CloudflareApiError):
    """404: the database, index or model does not exist (or the account id is wrong)."""


class CloudflareRateLimited(CloudflareApiError):
    """429 that retries could not get past (the whole token may be blocked for minutes)."""

    def __init__(self, message: str, *, retry_after: float, **kw: Any) -> None:
        super().__init__(message, details={"retry_after": max(1, math.ceil(retry_after))}, **kw)
        self.retry_after = retry_after


def _retry_after(headers: Mapping[str, str]) -> float | None:
    raw = headers.get("retry-after")
    if raw is None:
        return None
    raw = raw.strip()
    try:
        return max(0.0, float(raw))
    except ValueError:
        pass
    try:  # an HTTP date
        when = email.utils.parsedate_to_datetime(raw)
        return max(0.0, when.timestamp() - time.time())
    except (TypeError, ValueError, IndexError):
        return None


def _int_header(headers: Mapping[str, str], name: str) -> int | None:
    raw = headers.get(name)
    try:
        return int(float(raw)) if raw is not None else None
    except ValueError:
        return None


class CloudflareApi:
    """Authenticated, budgeted, retrying calls to ``{base_url}/accounts/{account_id}/...``."""

    def __init__(
        self,
        http: httpx.AsyncClient,
        *,
        account_id: str,
        api_token: str,
        base_url: str = "https://api.cloudflare.com/client/v4",
        budget: RequestBudget | None = None,
        max_attempts: int = 5,
        backoff_base: float = 0.25,
        backoff_cap: float = 8.0,
        max_retry_after: float = 20.0,
        token_limit: int = 1200,
        sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
    ) -> None:
        self.http = http
        self.account_id = account_id
        self.api_token = api_token
        self.base_url = base_url.rstrip("/")
        self.budget = budget or RequestBudget()
        self.max_attempts = max(1, max_attempts)
        self.backoff_base = backoff_base
        self.backoff_cap = backoff_cap
        self.max_retry_after = max_retry_after
        #: When the token's own remaining count (x-ratelimit-remaining) falls to this reserve, every caller
        #: pauses until x-ratelimit-reset: other instances share the token, this budget only sees its own.
        self.server_reserve = max(0, token_limit - self.budget.limit)
        self._sleep = sleep
        self.requests: Counter[str] = Counter()
        self.retries: Counter[str] = Counter()
        self.failures: Counter[str] = Counter()
        self.by_status: Counter[int] = Counter()
        self.last_server_remaining: int | None = None

    # -- urls ----------------------------------------------------------------------------------------

    def account_path(self, path: str) -> str:
        return f"{self.base_url}/accounts/{self.account_id}/{path.lstrip('/')}"

    def _headers(self, extra: Mapping[str, str] | None) -> dict[str, str]:
        h = {"Authorization": f"Bearer {self.api_token}", "Accept": "application/json"}
        if extra:
            h.update(extra)
        return h

    # -- the call ------------------------------------------------------------------------------------

    def _backoff(self, attempt: int) -> float:
        d = min(self.backoff_cap, self.backoff_base * (2 ** (attempt - 1)))
        return d / 2 + random.uniform(0, d / 2)  # "equal jitter": never ~0, never in lock-step

    async def call(
        self,
        kind: str,
        method: str,
        path: str,
        *,
        idempotent: bool,
        json: Any = None,
        content: bytes | None = None,
        headers: Mapping[str, str] | None = None,
        params: Mapping[str, Any] | None = None,
        classify: Callable[[CloudflareApiError], str | None] | None = None,
        timeout: httpx.Timeout | float | None = None,
        envelope: bool = False,
    ) -> Any:
        """One API call; returns the envelope's ``result`` (the whole envelope with ``envelope=True``: for the
        list endpoints, whose ``result_info`` carries the pagination).

        ``classify(error)`` may return ``"not_run"`` (retry always), ``"transient"`` (retry when idempotent),
        ``"fatal"`` (never retry) or ``None`` (the generic rules: 429 always, 5xx when idempotent) for an
        error envelope — the D1 adapter uses it to read D1's messages.
        """
        url = self.account_path(path)
        hdrs = self._headers(headers)
        attempt = 0
        while True:
            attempt += 1
            await self.budget.acquire(what=f"{kind} {method} {path.split('/')[0]}")
            self.requests[kind] += 1
            try:
                kwargs: dict[str, Any] = {"headers": hdrs, "params": params}
                if content is not None:
                    kwargs["content"] = content
                elif json is not None:
                    kwargs["json"] = json
                if timeout is not None:
                    kwargs["timeout"] = timeout
                resp = await self.http.request(method, url, **kwargs)
            except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as exc:
                err = CloudflareApiError(
                    f"cannot reach the Cloudflare API ({kind}): {exc.__class__.__name__}: {exc}", kind=kind,
                    attempts=attempt,
                )
                if attempt < self.max_attempts:
                    await self._retry(kind, self._backoff(attempt), err)
                    continue
                raise self._failed(err) from exc
            except (httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError) as exc:
                err = CloudflareApiError(
                    f"Cloudflare API call ({kind}) failed mid-flight: {exc.__class__.__name__}: {exc}", kind=kind,
                    attempts=attempt,
                )
                if idempotent and attempt < self.max_attempts:
                    await self._retry(kind, self._backoff(attempt), err)
                    continue
                raise self._failed(err) from exc

            self.by_status[resp.status_code] += 1
            self._watch_server_budget(resp)
            body: Any
            try:
                body = resp.json()
            except ValueError:
                body = None
            ok = isinstance(body, dict) and body.get("success") is True and resp.status_code < 400
            if ok:
                return body if envelope else body.get("result")

            err = self._error(kind, resp, body, attempt)
            verdict = classify(err) if classify is not None else None
            retry_after = _retry_after(resp.headers)
            delay: float | None = None
            if resp.status_code == 429:
                own = bool(set(err.codes) & AI_OWN_429_CODES)
                wait = retry_after if retry_after is not None else (None if own else 60.0)
                if set(err.codes) & AI_NO_RETRY_CODES:
                    raise self._failed(err)
                if not own:
                    self.budget.block(wait or 0.0, f"Cloudflare answered 429 on {kind}")
                if wait is not None and wait > self.max_retry_after:
                    raise self._failed(
                        CloudflareRateLimited(
                            f"Cloudflare rate limit: blocked for {wait:.0f} s ({kind})", retry_after=wait,
                            status=429, errors=err.errors, kind=kind, attempts=attempt,
                        )
                    )
                delay = max(wait or 0.0, self._backoff(attempt))
                if attempt >= self.max_attempts:
                    raise self._failed(
                        CloudflareRateLimited(
                            f"Cloudflare rate limit ({kind}): still 429 after {attempt} attempts",
                            retry_after=wait or 1.0, status=429, errors=err.errors, kind=kind, attempts=attempt,
                        )
                    )
                # the budget block (if any) already delays the next try; sleep only the remainder
                if not own:
                    delay = max(0.0, delay - (wait or 0.0)) + 0.001
            elif verdict == "not_run":
                delay = self._backoff(attempt)
            elif verdict == "fatal":
                raise self._failed(err)
            elif idempotent and (verdict == "transient" or resp.status_code >= 500):
                delay = max(self._backoff(attempt), retry_after or 0.0)
                if retry_after is not None and retry_after > self.max_retry_after:
                    raise self._failed(err)
            if delay is None or attempt >= self.max_attempts:
                raise self._failed(err)
            await self._retry(kind, delay, err)

    async def _retry(self, kind: str, delay: float, err: CloudflareApiError) -> None:
        self.retries[kind] += 1
        log.info("retrying Cloudflare %s call in %.2f s: %s", kind, delay, err.message)
        await self._sleep(delay)

    def _failed(self, err: CloudflareApiError) -> CloudflareApiError:
        self.failures[err.kind] += 1
        return err

    def _watch_server_budget(self, resp: httpx.Response) -> None:
        remaining = _int_header(resp.headers, "x-ratelimit-remaining")
        if remaining is None:
            return
        self.last_server_remaining = remaining
        server_limit = _int_header(resp.headers, "x-ratelimit-limit")
        reserve = self.server_reserve if server_limit is None else max(0, server_limit - self.budget.limit)
        if resp.status_code != 429 and remaining <= reserve:
            reset = _int_header(resp.headers, "x-ratelimit-reset")
            if reset:
                self.budget.block(float(reset), f"token has {remaining} requests left in Cloudflare's window")

    @staticmethod
    def _error(kind: str, resp: httpx.Response, body: Any, attempt: int) -> CloudflareApiError:
        status = resp.status_code
        errors: list[dict[str, Any]] = []
        if isinstance(body, dict) and isinstance(body.get("errors"), list):
            errors = [e if isinstance(e, dict) else {"message": str(e)} for e in body["errors"]]
        if not errors:
            snippet = resp.text[:200].strip() if body is None else ""
            errors = [{"code": None, "message": snippet or f"HTTP {status}"}]
        text = "; ".join(str(e.get("message", "")) for e in errors)
        codes = {e.get("code") for e in errors}
        if status in (401, 403) or 10000 in codes:
            cls: type[CloudflareApiError] = CloudflareAuthError
            msg = f"Cloudflare rejected the API token ({kind}): {text}"
        elif status == 404 or 7404 in codes:
            cls, msg = CloudflareNotFound, f"Cloudflare {kind} resource not found: {text}"
        else:
            cls, msg = CloudflareApiError, f"Cloudflare {kind} call failed (HTTP {status}): {text}"
        return cls(msg, status=status, errors=errors, kind=kind, attempts=attempt)

    # -- reporting -----------------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """Counters per kind (d1, vectorize, ai) and the budget, for /health and metrics."""
        return {
            "requests": {k: self.requests.get(k, 0) for k in KINDS},
            "retries": {k: self.retries.get(k, 0) for k in KINDS},
            "failures": {k: self.failures.get(k, 0) for k in KINDS},
            "by_status": {str(k): v for k, v in sorted(self.by_status.items())},
            "server_remaining": self.last_server_remaining,
            "budget": self.budget.snapshot(),
        }
