"""The serving process hands freed heap memory back to the system (api/heap.py): what a burst of work freed
(embedder runs, argon2 verifications) must not stay resident for the process's life."""

from __future__ import annotations

import time

import pytest

from api.heap import HeapTrimmer, resident_mb

pytestmark = pytest.mark.skipif(not HeapTrimmer().available, reason="glibc's malloc_trim is not available here")


def _fragmented_garbage(mb: int = 64) -> list[bytes]:
    """Fill ``mb`` MB of the heap with 64 KB blocks (under glibc's mmap threshold: they come from the heap) and
    free nine in ten: the survivors pin the freed blocks in the middle of the heap, where free() never returns
    them to the system."""
    blocks = [b"x" * 65536 for _ in range(mb * 16)]
    keep = blocks[::10]
    del blocks
    return keep


def test_a_trim_returns_freed_heap_pages_to_the_system():
    trimmer = HeapTrimmer()
    trimmer.trim()
    keep = _fragmented_garbage()
    before = resident_mb()
    assert trimmer.trim() is True
    after = resident_mb()
    assert before - after >= 30, (before, after)  # ~57 of the 64 MB were freed
    assert len(keep) == 103


def test_the_trimmer_trims_only_after_the_resident_set_grew():
    trimmer = HeapTrimmer(growth_mb=16)
    trimmer.trim()
    assert trimmer.check() is False  # nothing grew since
    keep = _fragmented_garbage()
    assert trimmer.check() is True
    assert trimmer.trims == 2
    assert trimmer.check() is False
    assert len(keep) == 103


def test_the_trimmer_thread_runs_checks_and_stops():
    trimmer = HeapTrimmer(period=0.01, growth_mb=16).start()
    try:
        keep = _fragmented_garbage()
        for _ in range(500):
            if trimmer.trims:
                break
            time.sleep(0.01)
        assert trimmer.trims >= 1
        assert len(keep) == 103
    finally:
        trimmer.stop()
    assert trimmer._thread is None
