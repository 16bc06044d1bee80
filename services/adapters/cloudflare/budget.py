"""A client-side request budget for the Cloudflare API, shared by the D1, Vectorize and Workers AI adapters.

Cloudflare allows 1,200 requests per 5 minutes per API token across the whole API, and a token that goes
over is blocked for the next 5 minutes on *every* call. This budget keeps this process under a configurable
share of that (default 1,100 per 300 s, a sliding window): a request that would exceed it waits for the
oldest request to leave the window, or fails fast with ``BudgetExhausted`` (a ``BackendError``, 503) when the
wait would exceed ``max_wait`` seconds. A 429 from Cloudflare, or response headers saying the token (shared
with other instances) is nearly spent, ``block()`` the budget so every adapter stops sending until the block
ends instead of extending Cloudflare's.

Asyncio only (one event loop per process); no lock is needed: the check-and-record in ``acquire`` runs
without an ``await`` in between.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

from services.errors import BackendError

__all__ = ["RequestBudget", "BudgetExhausted", "DEFAULT_LIMIT", "DEFAULT_WINDOW", "DEFAULT_MAX_WAIT"]

DEFAULT_LIMIT = 1100
DEFAULT_WINDOW = 300.0
DEFAULT_MAX_WAIT = 30.0


class BudgetExhausted(BackendError):
    """The request budget (or a Cloudflare block) would make this call wait longer than allowed."""

    code = "backend_unavailable"

    def __init__(self, message: str, *, retry_after: float, details: dict[str, Any] | None = None) -> None:
        super().__init__(message, details={"retry_after": max(1, round(retry_after)), **(details or {})})
        self.retry_after = retry_after


class RequestBudget:
    """Sliding-window request budget: at most ``limit`` requests in any ``window`` seconds."""

    def __init__(
        self,
        limit: int = DEFAULT_LIMIT,
        window: float = DEFAULT_WINDOW,
        *,
        max_wait: float = DEFAULT_MAX_WAIT,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
    ) -> None:
        if limit < 1 or window <= 0:
            raise ValueError("budget limit must be >= 1 and window > 0")
        self.limit = int(limit)
        self.window = float(window)
        self.max_wait = float(max_wait)
        self._clock = clock
        self._wall = wall
        self._sleep = sleep
        self._hits: deque[float] = deque()
        self._blocked_until = 0.0  # monotonic
        self._block_reason: str | None = None
        self.waits = 0
        self.waited_seconds = 0.0
        self.refused = 0
        self.blocks = 0

    # -- the budget ----------------------------------------------------------------------------------

    def _purge(self, now: float) -> None:
        cutoff = now - self.window
        hits = self._hits
        while hits and hits[0] <= cutoff:
            hits.popleft()

    def _wait_needed(self, now: float) -> float:
        if self._blocked_until > now:
            return self._blocked_until - now
        self._purge(now)
        if len(self._hits) >= self.limit:
            return self._hits[len(self._hits) - self.limit] + self.window - now
        return 0.0

    async def acquire(self, *, max_wait: float | None = None, what: str = "request") -> None:
        """Take one request slot, waiting up to ``max_wait`` seconds (default ``self.max_wait``) for one."""
        bound = self.max_wait if max_wait is None else max_wait
        start = self._clock()
        deadline = start + bound
        waited = False
        while True:
            now = self._clock()
            wait = self._wait_needed(now)
            if wait <= 0:
                self._hits.append(now)
                if waited:
                    self.waited_seconds += now - start
                return
            if now + wait > deadline + 1e-9:
                self.refused += 1
                blocked = self._blocked_until > now
                raise BudgetExhausted(
                    (
                        f"Cloudflare API calls are blocked for {wait:.0f} s more ({self._block_reason})"
                        if blocked
                        else f"Cloudflare request budget spent ({self.limit} per {self.window:.0f} s): "
                        f"the next slot frees in {wait:.1f} s"
                    ),
                    retry_after=wait,
                    details={"what": what, "limit": self.limit, "window": self.window},
                )
            if not waited:
                self.waits += 1
                waited = True
            await self._sleep(min(wait, max(0.0, deadline - now)) + 0.001)

    def block(self, seconds: float, reason: str = "Cloudflare answered 429") -> None:
        """Stop every caller for ``seconds`` (never shortens an existing block)."""
        if seconds <= 0:
            return
        until = self._clock() + seconds
        if until > self._blocked_until:
            self._blocked_until = until
            self._block_reason = reason
            self.blocks += 1

    def unblock(self) -> None:
        self._blocked_until = 0.0
        self._block_reason = None

    # -- reporting -----------------------------------------------------------------------------------

    @property
    def used(self) -> int:
        self._purge(self._clock())
        return len(self._hits)

    def snapshot(self) -> dict[str, Any]:
        """For /health and metrics: ``used``, ``limit``, ``window``, ``remaining``, ``blocked_until``
        (epoch seconds, or None), plus wait/refusal/block counters."""
        now = self._clock()
        self._purge(now)
        blocked = self._blocked_until > now
        return {
            "used": len(self._hits),
            "limit": self.limit,
            "window": self.window,
            "remaining": 0 if blocked else max(0, self.limit - len(self._hits)),
            "blocked_until": (self._wall() + (self._blocked_until - now)) if blocked else None,
            "blocked_reason": self._block_reason if blocked else None,
            "waits": self.waits,
            "waited_seconds": round(self.waited_seconds, 3),
            "refused": self.refused,
            "blocks": self.blocks,
        }
