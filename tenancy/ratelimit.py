"""Rate limits on the `limits` library: moving windows kept in a storage named by a URI.

``memory://`` (the default) keeps the counters in this process: right for the embedded shape, where one
process serves. Where several processes serve (the Cloudflare shape, or several workers behind a balancer),
name a shared storage they all reach (``redis://host:6379``, ``rediss://``, ``redis+sentinel://``,
``memcached://host:11211``, ``mongodb://``; the client library each needs is installed separately), or each
process counts on its own and every limit is in effect multiplied by the number of processes.

The window is a moving one (exact: no burst at a window boundary) where the storage supports it (memory,
redis, mongodb); memcached gets the sliding-window counter. If a shared storage fails, requests are let
through (logged): an outage of the counter store must not take the service down with it.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from limits import RateLimitItem, RateLimitItemPerHour, RateLimitItemPerMinute
from limits.aio.storage import MovingWindowSupport, Storage
from limits.aio.strategies import MovingWindowRateLimiter, RateLimiter, SlidingWindowCounterRateLimiter
from limits.errors import ConfigurationError, StorageError
from limits.storage import storage_from_string

__all__ = ["Limit", "Verdict", "RateLimits", "storage_for", "ConfigurationError"]

log = logging.getLogger("memex.ratelimit")


def storage_for(uri: str) -> Storage:
    """The async storage behind a `limits` storage URI (``memory://``, ``redis://…``; ``async+`` optional).
    Raises ``ConfigurationError`` for an unknown scheme or a missing client library (nothing connects yet)."""
    uri = (uri or "memory://").strip()
    if not uri.startswith("async+"):
        uri = "async+" + uri
    storage = storage_from_string(uri, wrap_exceptions=True)
    if not isinstance(storage, Storage):  # cannot happen with an async+ scheme; narrows the type
        raise ConfigurationError(f"{uri!r} is not an async storage")
    return storage


@dataclass(frozen=True, slots=True)
class Limit:
    """One policy: ``amount`` per ``window`` seconds, under a ``name`` that prefixes its counters."""

    name: str
    amount: int
    window: int

    @property
    def policy(self) -> str:
        """The ``RateLimit-Policy`` form: ``<amount>;w=<seconds>``."""
        return f"{self.amount};w={self.window}"

    def item(self) -> RateLimitItem:
        per = RateLimitItemPerHour if self.window == 3600 else RateLimitItemPerMinute
        return per(self.amount, namespace=f"memex-{self.name}")


@dataclass(frozen=True, slots=True)
class Verdict:
    """What a limit said: allowed or not, what is left and in how many seconds a slot frees."""

    limit: Limit
    allowed: bool
    remaining: int
    reset: int  # seconds until the next slot frees (0: nothing counted)

    @property
    def retry_after(self) -> int:
        return 0 if self.allowed else max(1, self.reset)

    def headers(self) -> dict[str, str]:
        """``RateLimit-Limit``/``-Remaining``/``-Reset`` and ``RateLimit-Policy`` (IETF httpapi draft)."""
        return {
            "RateLimit-Limit": str(self.limit.amount),
            "RateLimit-Remaining": str(max(0, self.remaining)),
            "RateLimit-Reset": str(max(0, self.reset)),
            "RateLimit-Policy": self.limit.policy,
        }


class RateLimits:
    """The limiter over one storage; ``hit`` counts, ``check`` only looks."""

    def __init__(self, storage_uri: str = "memory://") -> None:
        self.storage_uri = storage_uri
        self.storage = storage_for(storage_uri)
        self.strategy: RateLimiter = (
            MovingWindowRateLimiter(self.storage) if isinstance(self.storage, MovingWindowSupport)
            else SlidingWindowCounterRateLimiter(self.storage)
        )
        self._items: dict[Limit, RateLimitItem] = {}
        self._warned = 0.0

    def _item(self, limit: Limit) -> RateLimitItem:
        item = self._items.get(limit)
        if item is None:
            item = self._items[limit] = limit.item()
        return item

    async def _stats(self, limit: Limit, identifier: str, allowed: bool) -> Verdict:
        stats = await self.strategy.get_window_stats(self._item(limit), identifier)
        reset = max(0, math.ceil(stats.reset_time - time.time())) if stats.remaining < limit.amount else 0
        return Verdict(limit, allowed, stats.remaining, reset)

    async def hit(self, limit: Limit, identifier: str) -> Verdict:
        """Count one action against ``limit`` for ``identifier``; over the limit, nothing is counted."""
        return await self._verdict(self.strategy.hit, limit, identifier)

    async def check(self, limit: Limit, identifier: str) -> Verdict:
        """Whether one more action would be allowed, counting nothing."""
        return await self._verdict(self.strategy.test, limit, identifier)

    async def _verdict(self, op: Callable[[RateLimitItem, str], Awaitable[bool]], limit: Limit, identifier: str) -> Verdict:
        try:
            allowed = await op(self._item(limit), identifier)
            return await self._stats(limit, identifier, allowed)
        except StorageError as exc:
            return self._fail_open(limit, exc)

    def _fail_open(self, limit: Limit, exc: Exception) -> Verdict:
        now = time.monotonic()
        if now - self._warned > 60:  # once a minute, not once a request
            self._warned = now
            log.warning("rate-limit storage %s failed (%s): letting requests through", self.storage_uri.split("@")[-1], exc)
        return Verdict(limit, True, limit.amount, 0)
