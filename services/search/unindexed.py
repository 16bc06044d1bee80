"""Keyword hits whose chunks are not in the vector index yet, scored by their meaning at search time.

A capture (a thought, a conversation's new turns, a knowledge base's synced entries) is keyword-searchable when it is
acknowledged; its chunks are embedded by the job worker afterwards: at once when the worker is idle, minutes later
behind an import, seconds later on Vectorize, which applies writes asynchronously. Meanwhile the keyword side finds
the hit and the vector side cannot, and fusion gives it the vector side's floor, so anything close in meaning to
the query outranks it: what an agent has just remembered would not come back first (before this, a capture searched
at once by its own unique word was in the top 5 for 8 of 100 captures with MiniLM; the relevance floor could drop
it altogether).

So a search embeds the first ``UNINDEXED_EMBEDS`` of those chunks itself (best keyword hit first), scores them
against the query exactly, as the index would, and fuses them as vector-side rows (``fuse(unindexed=...)``). Each
vector is left in ``RecentVectors`` (services.search.recent_vectors): the chunk's embedding job takes it instead of
running the model again, so the work moves earlier rather than being done twice.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from services.ports import Embedder
from services.search.fusion import VectorRow

__all__ = ["UNINDEXED_EMBEDS", "embed_unindexed"]

log = logging.getLogger("services.search")

#: Chunks not indexed yet that one search embeds, at most. Behind an import many keyword hits may be waiting; the
#: best of them are the ones that can reach the first results, and each costs the search one model run.
UNINDEXED_EMBEDS = 8


async def embed_unindexed(embedder: Embedder, recent: Any, org_id: str, query_vector: np.ndarray,
                          chunks: list[dict[str, Any]]) -> list[VectorRow]:
    """The first ``UNINDEXED_EMBEDS`` of ``chunks`` (dicts with id, kind, parent_id, content; best keyword hit
    first) as vector rows, best first: each chunk's vector (from ``recent``, the organization's own entries, else
    embedded now and left there) and its cosine with the query. An embedder failure returns none: those hits keep
    the vector side's floor, and the search answers as before."""
    picked = chunks[:UNINDEXED_EMBEDS]
    if not picked:
        return []
    cached = [recent.get(org_id, r["content"]) if recent is not None else None for r in picked]
    missing = [r["content"] for r, v in zip(picked, cached, strict=True) if v is None]
    try:
        fresh = iter(await embedder.embed(missing) if missing else ())
    except Exception:  # noqa: BLE001 - the model is optional here; the index will have these chunks soon
        log.warning("embedding %d chunks not indexed yet failed; their hits keep the vector floor",
                    len(missing), exc_info=True)
        return []
    q = np.asarray(query_vector, dtype=np.float32)
    out: list[VectorRow] = []
    for r, v in zip(picked, cached, strict=True):
        if v is None:
            v = next(fresh)
            if recent is not None:
                recent.put(org_id, r["content"], v)
        out.append((r["id"], r["kind"], r["parent_id"], float(np.dot(v, q))))
    out.sort(key=lambda r: r[3], reverse=True)
    return out
