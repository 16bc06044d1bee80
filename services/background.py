"""Whether the running code is background work (the job worker's rounds), for adapters that can trade a turn of
latency for fewer requests.

``IN_BACKGROUND`` is a context variable: the job worker sets it for its loop (and ``drain``), and every task it
starts inherits it, so a round's concurrent calls can share requests (the Worker client's coalescing,
``services.adapters.cloudflare.worker_client``) while the request path sends its own at once."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

__all__ = ["IN_BACKGROUND", "background"]

IN_BACKGROUND: ContextVar[bool] = ContextVar("memex_in_background", default=False)


@contextmanager
def background() -> Iterator[None]:
    """Mark the code inside (and the tasks it starts) as background work."""
    token = IN_BACKGROUND.set(True)
    try:
        yield
    finally:
        IN_BACKGROUND.reset(token)
