"""A small in-process sliding-window limiter (per identifier). Per process, like Litestar's own; the
Cloudflare deployment runs several instances, so each limit is per instance there (documented)."""

from __future__ import annotations

import math
import time
from collections import deque

__all__ = ["WindowLimiter"]


class WindowLimiter:
    def __init__(self, limit: int, window_seconds: float, *, max_keys: int = 100_000) -> None:
        self.limit = limit
        self.window = window_seconds
        self.max_keys = max_keys
        self._hits: dict[str, deque[float]] = {}

    def _prune(self, key: str, now: float) -> deque[float]:
        hits = self._hits.get(key)
        if hits is None:
            if len(self._hits) >= self.max_keys:
                self._hits.clear()  # bounded memory under a flood of identifiers
            hits = self._hits[key] = deque()
        while hits and hits[0] <= now - self.window:
            hits.popleft()
        return hits

    def retry_after(self, key: str) -> int:
        """Seconds until ``key`` may act again; 0 when it is under its limit now."""
        now = time.monotonic()
        hits = self._prune(key, now)
        if len(hits) < self.limit:
            return 0
        return max(1, math.ceil(hits[0] + self.window - now))

    def hit(self, key: str) -> int:
        """Record one action; returns 0 if allowed, else the seconds to wait (nothing recorded)."""
        wait = self.retry_after(key)
        if wait == 0:
            self._hits[key].append(time.monotonic())
        return wait
