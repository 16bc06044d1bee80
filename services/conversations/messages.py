"""Messages as stored, and the chunks made of them.

A message is one ``messages`` row (its content compressed at rest, ``services.conversations.compression``). Its
chunks: sliding windows of ``WINDOW`` messages with stride ``STRIDE`` (windows start at sequences 1, 4, 7, ... and
window ``s`` covers ``s .. min(s + 4, last)``, the seed's ``chunkMessages``), and one ``turn`` per message; both
show a message as ``format_line``'s ``[role]: content``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import anyio.to_thread

from services.conversations.compression import decode_content
from services.conversations.models import Message

__all__ = ["WINDOW", "STRIDE", "CHUNK_KINDS", "OFF_LOOP_BYTES", "format_line", "window_starts", "chunk_windows",
           "message_from_row", "decode_rows"]

WINDOW = 5
STRIDE = 3
#: Chunk kinds of a conversation: its windows and its single turns (migration 0008).
CHUNK_KINDS = "('conversation', 'turn')"
#: Compress or decompress this many bytes of messages in a worker thread, not on the event loop.
OFF_LOOP_BYTES = 256 * 1024


def format_line(role: str, content: str) -> str:
    return f"[{role}]: {content}"


def window_starts(old_last: int, new_last: int) -> list[int]:
    """Start sequences of the windows that an append taking the last sequence from ``old_last`` to
    ``new_last`` creates or changes: every window that was short (``s + 4 > old_last``) and exists now."""
    lo = max(1, old_last - WINDOW + 2)
    k = -(-(lo - 1) // STRIDE)
    return list(range(1 + STRIDE * k, new_last + 1, STRIDE))


def chunk_windows(lines: Sequence[tuple[int, str, str]]) -> list[tuple[int, int, str]]:
    """The seed's chunkMessages over ``(sequence, role, content)``: ``(start, end, text)`` per window."""
    ordered = sorted(lines)
    out = []
    for i in range(0, len(ordered), STRIDE):
        window = ordered[i : i + WINDOW]
        out.append((window[0][0], window[-1][0], "\n".join(format_line(r, c) for _, r, c in window)))
    return out


def message_from_row(r: dict[str, Any]) -> Message:
    return Message(
        id=r["id"],
        conversation_id=r["conversation_id"],
        sequence=r["sequence"],
        role=r["role"],
        content=decode_content(r["content"], r["content_encoding"]),
        metadata=json.loads(r["metadata"] or "{}"),
        client_id=r["client_id"],
        created_at=r["created_at"],
        session=r.get("session"),
        content_encoding=r["content_encoding"],
    )


async def decode_rows(rows: list[dict[str, Any]]) -> list[Message]:
    if sum(len(r["content"]) for r in rows) > OFF_LOOP_BYTES:
        return await anyio.to_thread.run_sync(lambda: [message_from_row(r) for r in rows])
    return [message_from_row(r) for r in rows]
