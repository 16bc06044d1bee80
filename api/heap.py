"""The serving process's C heap (glibc): fewer arenas, and freed memory handed back to the system.

* ``cap_malloc_arenas``: glibc gives each thread that allocates its own malloc arena (up to 8 x cores) and rarely
  returns their memory; the embedder's and the SQL adapter's worker threads made ~300 MB of such slack under a soak
  (bench/bench_soak.py with MALLOC_ARENA_MAX=2: 850-950 MB instead of 1.1-1.3 GB).
* ``HeapTrimmer``: what the embedder's runs, argon2's 19 MiB verifications and the vector index's growth free
  stays resident: glibc raises its mmap threshold after the first large free (up to 32 MiB), so later buffers of
  that size come from the heap and are kept there. A thread checks the resident set four times a second and, when
  it grew by ``growth_mb`` since the last trim, calls ``malloc_trim(0)``, which returns every free page, including
  pages in the middle of the heap. Loading SciFact (5,183 abstracts, 4 clients), peak RSS: 512 MB without,
  392-408 MB checking once a second, 365 MB trimming every 0.2 s, at the same ingest rate (bench/README.md,
  "Peak memory"). A trim takes ~0.8-1.6 ms (p50; 11 ms at most measured), on its own thread.

Both are no-ops off glibc (``malloc_trim`` missing) and when the operator set ``MALLOC_ARENA_MAX`` (the cap).
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from typing import Any

__all__ = ["HeapTrimmer", "cap_malloc_arenas", "resident_mb"]

_M_ARENA_MAX = -8


def _libc() -> Any | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim  # noqa: B018 - glibc only (musl has no malloc_trim)
        return libc
    except (OSError, AttributeError):
        return None


def cap_malloc_arenas(arenas: int = 2) -> None:
    """As MALLOC_ARENA_MAX=arenas would, set before the threads start."""
    libc = _libc()
    if libc is None or os.environ.get("MALLOC_ARENA_MAX"):
        return
    libc.mallopt(_M_ARENA_MAX, arenas)


def resident_mb() -> float:
    """This process's resident set, in MB (0.0 where /proc is missing)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            pages = int(f.read().split()[1])
    except (OSError, IndexError, ValueError):
        return 0.0
    return pages * os.sysconf("SC_PAGE_SIZE") / 1e6


class HeapTrimmer:
    """Returns the heap's free pages to the system when the resident set has grown (see the module docstring)."""

    def __init__(self, *, period: float = 0.25, growth_mb: float = 4.0) -> None:
        self.period = period
        self.growth_mb = growth_mb
        self.trims = 0
        self._libc = _libc()
        self._baseline = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def available(self) -> bool:
        return self._libc is not None

    def trim(self) -> bool:
        """Trim now; True when glibc gave memory back."""
        if self._libc is None:
            return False
        released = bool(self._libc.malloc_trim(0))
        self.trims += 1
        self._baseline = resident_mb()
        return released

    def check(self) -> bool:
        """Trim if the resident set grew by ``growth_mb`` since the last trim; True when it trimmed."""
        if self._libc is None or resident_mb() < self._baseline + self.growth_mb:
            return False
        self.trim()
        return True

    def start(self) -> "HeapTrimmer":
        if self._libc is not None and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="memex-heap-trim", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self.check()
