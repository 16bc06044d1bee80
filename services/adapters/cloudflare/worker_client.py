"""The client of the Memex data-plane Worker (worker/; the protocol, version 1, is docs/worker-protocol.md).

One ``WorkerClient`` per process (the composition root makes it on the backend's HTTP client): every Worker
adapter (``worker_sql``, ``worker_vectors``, ``worker_ai``) sends its operations through it, so requests are
signed, retried and counted in one place.

Wire
    ``POST {url}/v1/rpc`` with ``{"v": 1, "ops": [...]}`` (``"atomic": true`` on request), answered
    ``{"v": 1, "results": [...]}``, one result per op. Headers ``X-Memex-Protocol: 1``, ``X-Memex-Timestamp``
    (unix seconds), ``X-Memex-Nonce`` (24 random url-safe characters, new for every try) and
    ``X-Memex-Signature: v1=<hex HMAC-SHA256(secret, "<timestamp>.<nonce>.<body>")>`` (``sign``). A BLOB
    travels as ``{"$b64": "..."}`` both ways (``encode_value``, ``decode_value``).

Retries (exponential backoff with jitter, at most ``max_attempts`` tries, each with a fresh timestamp and nonce):

* always: failures where the request provably did not run — connect errors, connect/pool timeouts, and 429
  (``Retry-After`` honoured up to ``max_retry_after`` seconds);
* only when every op of the request is idempotent (the caller says; the SQL adapter classifies statements as the
  D1 adapter does): read/write timeouts and connections dropped after sending, HTTP 5xx, and — for a request of
  one op — an op error saying the Durable Object or D1 was reset or lost the connection (the op may have run).
  An op error saying it was refused before running ("overloaded") is retried whatever the op.

Errors are ``BackendError`` (503) subclasses: ``WorkerAuthError`` (the Worker refused the signature: another
secret, or a clock more than 300 s off), ``WorkerProtocolError`` (another protocol version), ``WorkerError``
(unreachable, 4xx/5xx, a malformed answer), and ``WorkerOpError`` for an op that answered ``ok: false`` (the
adapters map SQL errors in it to the sqlite3 exceptions the D1 adapter raises).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import logging
import random
import secrets
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import httpx

from services.background import IN_BACKGROUND
from services.errors import BackendError, InvalidInput, PayloadTooLarge

from .client import D1_NOT_RUN, D1_NOT_TRANSIENT, D1_TRANSIENT, _retry_after

__all__ = [
    "PROTOCOL",
    "MAX_OPS",
    "MAX_BODY_BYTES",
    "WorkerClient",
    "WorkerError",
    "WorkerAuthError",
    "WorkerProtocolError",
    "WorkerOpError",
    "sign",
    "new_nonce",
    "encode_value",
    "decode_value",
    "worker_http_client",
]

log = logging.getLogger("memex.worker")

PROTOCOL = 1
MAX_OPS = 500
MAX_BODY_BYTES = 32 * 1024 * 1024
#: How far the Worker lets a timestamp stray from its clock (what its refusal means when ours is off).
REPLAY_WINDOW = 300


def worker_http_client() -> httpx.AsyncClient:
    """An HTTP client for the Worker (the composition root makes one per process; the backend closes it)."""
    return httpx.AsyncClient(
        timeout=httpx.Timeout(connect=5.0, read=60.0, write=30.0, pool=10.0),
        limits=httpx.Limits(max_connections=64, max_keepalive_connections=32, keepalive_expiry=30.0),
        headers={"User-Agent": "memex/0.1 (+httpx; worker protocol 1)"},
        follow_redirects=False,
    )


# -- the wire ----------------------------------------------------------------------------------------------------


def sign(secret: bytes, timestamp: int, nonce: str, body: bytes) -> str:
    """``v1=<lowercase hex HMAC-SHA256(secret, "<timestamp>.<nonce>.<body>")>``."""
    mac = hmac.new(secret, f"{int(timestamp)}.{nonce}.".encode("ascii") + body, hashlib.sha256)
    return "v1=" + mac.hexdigest()


def new_nonce() -> str:
    """24 characters of ``[A-Za-z0-9_-]`` (144 random bits)."""
    return secrets.token_urlsafe(18)


def encode_value(value: Any) -> Any:
    """A SQL value for the wire: bytes become ``{"$b64": ...}``, everything else is itself."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return {"$b64": base64.b64encode(bytes(value)).decode("ascii")}
    return value


def decode_value(value: Any) -> Any:
    """A result cell from the wire: ``{"$b64": ...}`` becomes bytes."""
    if isinstance(value, dict) and len(value) == 1 and isinstance(value.get("$b64"), str):
        try:
            return base64.b64decode(value["$b64"], validate=True)
        except ValueError as exc:
            raise BackendError("the Worker answered a malformed $b64 value") from exc
    return value


# -- errors ------------------------------------------------------------------------------------------------------


class WorkerError(BackendError):
    """The Worker could not be reached, or answered a failure (after any retries)."""

    def __init__(self, message: str, *, status: int | None = None, error_code: str | None = None, attempts: int = 1,
                 details: dict[str, Any] | None = None) -> None:
        info: dict[str, Any] = {"status": status, "attempts": attempts}
        if error_code:
            info["worker_code"] = error_code
        super().__init__(message, details={**info, **(details or {})})
        self.status = status
        self.error_code = error_code
        self.attempts = attempts

    @property
    def text(self) -> str:
        return self.message


class WorkerAuthError(WorkerError):
    """401/403: the Worker refused the request's signature (a different MEMEX_WORKER_SECRET, or a clock more than
    300 s from the Worker's)."""


class WorkerProtocolError(WorkerError):
    """The Worker speaks another protocol version (400 unsupported_protocol): deploy matching versions."""


class WorkerOpError(WorkerError):
    """One op answered ``{"ok": false, "error": {"code", "message"}}``."""

    def __init__(self, op: str, code: str, message: str, *, index: int = 0, attempts: int = 1) -> None:
        super().__init__(f"Worker op {op} failed ({code}): {message}", error_code=code, attempts=attempts,
                         details={"op": op, "op_index": index})
        self.op = op
        self.op_code = code
        self.op_message = message
        self.index = index

    @property
    def text(self) -> str:
        return self.op_message


def _op_verdict(message: str) -> str | None:
    """How an op failure reads: "not_run" (refused before running), "transient" (may have run), or None."""
    low = message.lower()
    if any(m in low for m in D1_NOT_TRANSIENT):
        return None
    if any(m in low for m in D1_NOT_RUN):
        return "not_run"
    if any(m in low for m in D1_TRANSIENT) or "durable object reset" in low or "object reset because" in low:
        return "transient"
    return None


def _dumps(obj: Any) -> bytes:
    try:
        return json.dumps(obj, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode("utf-8")
    except ValueError as exc:  # NaN / Infinity
        raise InvalidInput(f"a value for the Worker is not JSON: {exc}") from exc


# -- the client --------------------------------------------------------------------------------------------------


class WorkerClient:
    """Signed, retrying, counted calls to one Worker."""

    def __init__(
        self,
        http: httpx.AsyncClient,
        *,
        url: str,
        secret: str | bytes,
        max_attempts: int = 4,
        backoff_base: float = 0.1,
        backoff_cap: float = 4.0,
        max_retry_after: float = 20.0,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
        coalesce: bool = False,
        coalesce_bytes: int = 1024 * 1024,
    ) -> None:
        self.http = http
        self.url = url.rstrip("/")
        self.endpoint = self.url + "/v1/rpc"
        self._secret = secret.encode("utf-8") if isinstance(secret, str) else bytes(secret)
        self.max_attempts = max(1, max_attempts)
        self.backoff_base = backoff_base
        self.backoff_cap = backoff_cap
        self.max_retry_after = max_retry_after
        self._clock = clock
        self._sleep = sleep
        #: HTTP requests sent (every try counts), ops sent by name, retries, failures, answers by status.
        self.requests = 0
        self.ops: Counter[str] = Counter()
        self.retries = 0
        self.failures = 0
        self.by_status: Counter[int] = Counter()
        #: Coalescing (``run``): single ops submitted in the same event-loop turn share one request (non-atomic,
        #: each op its own transaction, as in any request), up to ``coalesce_bytes`` of ops and MAX_OPS. Off, ops
        #: of background work (the job worker's rounds: ``services.background``) coalesce all the same.
        self.coalesce = coalesce
        self.coalesce_bytes = coalesce_bytes
        self.coalesced = 0  # ops that shared a request with another caller's
        self._queue: list[tuple[bytes, str, bool, asyncio.Future[dict]]] = []
        self._drain_scheduled = False
        self._inflight: set[asyncio.Task[None]] = set()

    def __repr__(self) -> str:  # never the secret
        return f"WorkerClient({self.url!r})"

    # -- one request ---------------------------------------------------------------------------------------------

    def _backoff(self, attempt: int) -> float:
        d = min(self.backoff_cap, self.backoff_base * (2 ** (attempt - 1)))
        return d / 2 + random.uniform(0, d / 2)

    def signed_headers(self, body: bytes) -> dict[str, str]:
        ts = int(self._clock())
        nonce = new_nonce()
        return {
            "Content-Type": "application/json",
            "Accept": "application/json",
            "X-Memex-Protocol": str(PROTOCOL),
            "X-Memex-Timestamp": str(ts),
            "X-Memex-Nonce": nonce,
            "X-Memex-Signature": sign(self._secret, ts, nonce, body),
        }

    async def send(self, ops: Sequence[Mapping[str, Any]], *, idempotent: bool, atomic: bool = False) -> list[dict]:
        """Send ``ops`` in one request; the results, one per op, each ``{"ok": true, ...}`` or ``{"ok": false,
        "error": {...}}`` (``raise_for`` turns one into an exception). Transport failures raise ``WorkerError``."""
        if not ops:
            return []
        if len(ops) > MAX_OPS:
            raise InvalidInput(f"at most {MAX_OPS} ops per Worker request, not {len(ops)}")
        payload: dict[str, Any] = {"v": PROTOCOL, "ops": list(ops)}
        if atomic:
            payload["atomic"] = True
        body = _dumps(payload)
        if len(body) > MAX_BODY_BYTES:
            raise PayloadTooLarge(f"a Worker request is {len(body)} bytes; the protocol takes at most {MAX_BODY_BYTES}",
                                  details={"bytes": len(body), "limit": MAX_BODY_BYTES})
        return await self._post(body, [str(op.get("op")) for op in ops], idempotent=idempotent)

    async def _post(self, body: bytes, names: list[str], *, idempotent: bool) -> list[dict]:
        ops_count = len(names)
        attempt = 0
        while True:
            attempt += 1
            self.requests += 1
            self.ops.update(names)
            try:
                resp = await self.http.post(self.endpoint, content=body, headers=self.signed_headers(body))
            except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as exc:
                err = WorkerError(f"cannot reach the Worker at {self.url}: {exc.__class__.__name__}: {exc}",
                                  attempts=attempt)
                if attempt < self.max_attempts:
                    await self._retry(self._backoff(attempt), err)
                    continue
                raise self._failed(err) from exc
            except (httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError) as exc:
                err = WorkerError(f"Worker request failed mid-flight: {exc.__class__.__name__}: {exc}", attempts=attempt)
                if idempotent and attempt < self.max_attempts:
                    await self._retry(self._backoff(attempt), err)
                    continue
                raise self._failed(err) from exc

            self.by_status[resp.status_code] += 1
            if resp.status_code == 200:
                results = self._results(resp, ops_count, attempt)
                if ops_count == 1 and not results[0].get("ok"):
                    verdict = _op_verdict(str((results[0].get("error") or {}).get("message", "")))
                    if attempt < self.max_attempts and (verdict == "not_run" or (verdict == "transient" and idempotent)):
                        await self._retry(self._backoff(attempt), self.op_error(names[0], results[0], 0, attempt))
                        continue
                return results

            err = self._http_error(resp, attempt)
            delay: float | None = None
            retry_after = _retry_after(resp.headers)
            if resp.status_code == 429:
                wait = retry_after if retry_after is not None else self._backoff(attempt)
                if wait <= self.max_retry_after:
                    delay = max(wait, self._backoff(attempt))
            elif resp.status_code >= 500 and idempotent:
                delay = max(self._backoff(attempt), min(retry_after or 0.0, self.max_retry_after))
            if delay is None or attempt >= self.max_attempts:
                raise self._failed(err)
            await self._retry(delay, err)

    def _results(self, resp: httpx.Response, n: int, attempt: int) -> list[dict]:
        try:
            body = resp.json()
        except ValueError:
            body = None
        results = body.get("results") if isinstance(body, dict) else None
        if not isinstance(results, list) or len(results) != n or not all(isinstance(r, dict) for r in results):
            raise self._failed(WorkerError(
                f"the Worker answered a malformed body ({n} results expected)", status=resp.status_code,
                attempts=attempt, details={"body": resp.text[:200]}))
        if body.get("v") != PROTOCOL:
            raise self._failed(WorkerProtocolError(
                f"the Worker answered protocol version {body.get('v')!r}; this service speaks {PROTOCOL}",
                status=resp.status_code, attempts=attempt))
        return results

    def _http_error(self, resp: httpx.Response, attempt: int) -> WorkerError:
        status = resp.status_code
        code, message = None, ""
        try:
            body = resp.json()
        except ValueError:
            body = None
        if isinstance(body, dict) and isinstance(body.get("error"), dict):
            code = body["error"].get("code")
            message = str(body["error"].get("message") or "")
        message = message or resp.text[:200].strip() or f"HTTP {status}"
        if status in (401, 403):
            return WorkerAuthError(
                f"the Worker refused this service's signature (HTTP {status}, {code}): {message} — MEMEX_WORKER_SECRET "
                f"must equal the Worker's secret, and the clocks agree within {REPLAY_WINDOW} s",
                status=status, error_code=code, attempts=attempt)
        if code == "unsupported_protocol":
            return WorkerProtocolError(
                f"the Worker does not speak protocol {PROTOCOL}: {message} (deploy the Worker of this release)",
                status=status, error_code=code, attempts=attempt)
        return WorkerError(f"the Worker answered HTTP {status} ({code or 'no code'}): {message}", status=status,
                           error_code=code, attempts=attempt)

    async def _retry(self, delay: float, err: WorkerError) -> None:
        self.retries += 1
        log.info("retrying a Worker request in %.2f s: %s", delay, err.message)
        await self._sleep(delay)

    def _failed(self, err: WorkerError) -> WorkerError:
        self.failures += 1
        return err

    # -- one op --------------------------------------------------------------------------------------------------

    @staticmethod
    def op_error(op: str, result: Mapping[str, Any], index: int = 0, attempts: int = 1) -> WorkerOpError:
        error = result.get("error") if isinstance(result.get("error"), dict) else {}
        return WorkerOpError(op, str(error.get("code") or "error"), str(error.get("message") or "no message"),
                             index=index, attempts=attempts)

    def raise_for(self, op: str, result: Mapping[str, Any], index: int = 0) -> dict:
        """``result`` when it is ``ok``; else its ``WorkerOpError``."""
        if result.get("ok") is True:
            return dict(result)
        raise self.op_error(op, result, index)

    async def run(self, op: Mapping[str, Any], *, idempotent: bool) -> dict:
        """One op; its result (``ok``), or its ``WorkerOpError``. With ``coalesce``, the op may share its request with
        other callers' ops of the same event-loop turn (and so may the op of background work, whatever ``coalesce``
        says); an op failure that one request of its own would retry (a store reset, "overloaded") is then sent again
        alone."""
        name = str(op.get("op"))
        if not (self.coalesce or IN_BACKGROUND.get()):
            (result,) = await self.send([op], idempotent=idempotent)
            return self.raise_for(name, result)
        encoded = _dumps(op)
        if len(encoded) > self.coalesce_bytes:
            (result,) = await self.send([op], idempotent=idempotent)
            return self.raise_for(name, result)
        loop = asyncio.get_running_loop()
        future: asyncio.Future[dict] = loop.create_future()
        self._queue.append((encoded, name, idempotent, future))
        if not self._drain_scheduled:
            self._drain_scheduled = True
            loop.call_soon(self._drain)
        result = await future
        if not result.get("ok"):
            verdict = _op_verdict(str((result.get("error") or {}).get("message", "")))
            if verdict == "not_run" or (verdict == "transient" and idempotent):
                (result,) = await self.send([op], idempotent=idempotent)
        return self.raise_for(name, result)

    def _drain(self) -> None:
        """Send what this turn queued: one request per ``coalesce_bytes`` of ops (at most MAX_OPS each)."""
        self._drain_scheduled = False
        queue, self._queue = self._queue, []
        group: list[tuple[bytes, str, bool, asyncio.Future[dict]]] = []
        size = 0
        for item in queue:
            if group and (len(group) >= MAX_OPS or size + len(item[0]) > self.coalesce_bytes):
                self._spawn(group)
                group, size = [], 0
            group.append(item)
            size += len(item[0]) + 1
        if group:
            self._spawn(group)

    def _spawn(self, group: list[tuple[bytes, str, bool, asyncio.Future[dict]]]) -> None:
        task = asyncio.get_running_loop().create_task(self._send_group(group))
        self._inflight.add(task)
        task.add_done_callback(self._inflight.discard)

    async def _send_group(self, group: list[tuple[bytes, str, bool, asyncio.Future[dict]]]) -> None:
        body = f'{{"v":{PROTOCOL},"ops":['.encode() + b",".join(g[0] for g in group) + b"]}"
        if len(group) > 1:
            self.coalesced += len(group)
        try:
            results = await self._post(body, [g[1] for g in group], idempotent=all(g[2] for g in group))
        except BaseException as exc:  # every caller of the request learns why it failed
            for g in group:
                if not g[3].done():
                    g[3].set_exception(exc)
            if not isinstance(exc, Exception):
                raise
            return
        for g, res in zip(group, results, strict=True):
            if not g[3].done():
                g[3].set_result(res)

    async def ping(self) -> dict:
        """``{"protocol", "worker_version", "org_schema_version"}`` (a signed round trip: checks URL and secret)."""
        return await self.run({"op": "ping"}, idempotent=True)

    # -- reporting -----------------------------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """For /health and the benchmark: requests, ops by name, retries, failures, answers by status."""
        return {
            "url": self.url,
            "requests": self.requests,
            "ops": dict(sorted(self.ops.items())),
            "retries": self.retries,
            "failures": self.failures,
            "coalesced_ops": self.coalesced,
            "by_status": {str(k): v for k, v in sorted(self.by_status.items())},
        }
