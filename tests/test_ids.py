"""Ids of stored rows (thoughts, chunks, conversations, messages, knowledge-base entries) are UUIDv7s: they carry
their creation millisecond and sort in creation order, so each new row lands at the right edge of the indexes on
ids (the capture rate at 100,000 thoughts, bench/README.md), and they stay unguessable (74 random bits)."""

from __future__ import annotations

import time
import uuid

from services.ids import new_id


def test_ids_are_uuid7s_that_sort_in_creation_order():
    before = time.time_ns() // 1_000_000
    ids = []
    for _ in range(5):
        ids.append(new_id())
        time.sleep(0.002)
    after = time.time_ns() // 1_000_000
    assert ids == sorted(ids)
    for i in ids:
        u = uuid.UUID(hex=i)
        assert len(i) == 32 and i == u.hex
        assert u.version == 7 and u.variant == uuid.RFC_4122
        assert before <= u.int >> 80 <= after  # the creation millisecond
    many = [new_id() for _ in range(50_000)]
    assert len(set(many)) == len(many)
    # the random part really varies within one millisecond
    assert len({i[16:] for i in many}) == len(many)


def test_a_captured_thought_and_its_chunks_get_time_ordered_ids(live, org):
    with live.client(headers=org.headers) as c:
        first = c.post("/v1/thoughts", json={"content": "the first note of the day"}).json()
        time.sleep(0.002)
        second = c.post("/v1/thoughts", json={"content": "a second note, later"}).json()
    assert first["id"] < second["id"]
    assert uuid.UUID(hex=first["id"]).version == 7
    chunk_ids = [r[0] for r in live.sql("SELECT id FROM chunks WHERE parent_id IN (?, ?) ORDER BY pk",
                                         (first["id"], second["id"]), org=org.id)]
    assert len(chunk_ids) == 2 and chunk_ids == sorted(chunk_ids)
