"""Conversation hits for the hybrid search: the seed's read path plus the one message that answers.

The search finds conversation windows (chunks of kind ``conversation``); this hydrator turns each winning
window into a hit carrying the conversation id, the sequence range, the original messages of that range
(decompressed, with their metadata) and ``best_sequence``: the message of the range that best matches the
query. That choice costs no model call (see ``_best``): BM25 of the query's terms over the messages of the
hits being built (stems, stop words dropped), plus a length-normalised character-trigram closeness and a
small prior for user turns, which decide when no term matches (a window found by meaning alone). Embedding
the candidate messages at query time was measured at ~8-20 ms per message with the local model on this
2-core machine: more than the whole search budget for the 5-50 messages of the hits.

Windows overlap, so two windows of one conversation can point at the same best message: the lower-ranked
one is dropped, so that each hit pinpoints a different message. Unlike thoughts, conversations are not
collapsed to one hit per parent (``collapse_per_parent = False``): a search scoped to one conversation
returns its best windows, not just one.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import msgspec

from services.conversations import message_from_row
from services.errors import NotFound
from services.models import SearchHit
from services.scoped import OrgSql
from services.search import explain_candidate

__all__ = ["ConversationHydrator", "score_messages", "terms"]

_WORD = re.compile(r"\w+", re.UNICODE)
_STOP = frozenset(
    "a an and are as at be been but by for from has have had how i in is it its of on or that the this to was "
    "were what when where which who whom why will with you your yours do does did doing can could should would "
    "me my mine we our us he she him her his they them their there here then than so if not no yes about into "
    "over just also very any some all more most such only own same too s t don now am been being let lets ok "
    "okay thanks thank please tell know remember said say".split()
)
_SUFFIXES = ("ingly", "edly", "ings", "ing", "ied", "ies", "ed", "es", "ly", "s")
K1, B = 1.2, 0.75
W_TRIGRAM, W_USER = 0.3, 0.15
_PREFETCH = 5  # extra candidates hydrated beyond top_k, for the ones dropped as repeats


@lru_cache(maxsize=65536)
def _stem(word: str) -> str:
    for suffix in _SUFFIXES:
        if word.endswith(suffix) and len(word) - len(suffix) >= 3:
            word = word[: -len(suffix)] + ("y" if suffix in ("ied", "ies") else "")
            break
    if len(word) > 3 and word.endswith("e"):
        word = word[:-1]
    return word[:7]


def terms(text: str) -> list[str]:
    """Stemmed content words of ``text`` (stop words dropped unless nothing else is left)."""
    words = [w.lower() for w in _WORD.findall(text)]
    content = [w for w in words if w not in _STOP]
    return [_stem(w) for w in (content or words)]


def _trigrams(text: str) -> set[str]:
    out: set[str] = set()
    for w in _WORD.findall(text.lower()):
        if w in _STOP:
            continue
        padded = f" {w} "
        out.update(padded[i : i + 3] for i in range(len(padded) - 2))
    return out


def _closeness(q_trigrams: set[str], text: str) -> float:
    """Character-trigram closeness of a text to the query, normalised for the text's length (0..1)."""
    if not q_trigrams:
        return 0.0
    words = " ".join(w for w in _WORD.findall(text.lower()) if w not in _STOP)
    if not words:
        return 0.0
    padded = f" {words} "
    found = sum(1 for g in q_trigrams if g in padded)  # substring tests run in C
    return found / math.sqrt(len(q_trigrams) * len(padded))


def score_messages(query: str, texts: Sequence[str]) -> list[float]:
    """BM25 of ``query`` over ``texts``, document frequencies from ``texts`` themselves."""
    docs = [terms(t) for t in texts]
    return _Bm25(terms(query), docs).scores(docs)


class _Bm25:
    """BM25 of one query, with document frequencies and mean length from a pool of documents."""

    def __init__(self, query_terms: Sequence[str], pool: Sequence[Sequence[str]]) -> None:
        self.wanted = set(query_terms)
        n = max(1, len(pool))
        self.avg = sum(len(d) for d in pool) / n or 1.0
        df = Counter(t for d in pool for t in self.wanted.intersection(d))
        self.idf = {t: math.log(1 + (n - df.get(t, 0) + 0.5) / (df.get(t, 0) + 0.5)) for t in self.wanted}

    def full(self) -> float:
        """About what a document holding every query term once would score (a scale for the scores)."""
        return sum(self.idf.values()) or 1.0

    def scores(self, docs: Sequence[Sequence[str]]) -> list[float]:
        out = []
        for d in docs:
            tf = Counter(t for t in d if t in self.wanted)
            norm = K1 * (1 - B + B * len(d) / self.avg)
            out.append(sum(self.idf[t] * f * (K1 + 1) / (f + norm) for t, f in tf.items()))
        return out


def _best(bm25: _Bm25, messages: list[dict[str, Any]], docs: list[list[str]], q_trigrams: set[str]) -> int:
    """The message of a window that best matches the query.

    Query terms (BM25, as a share of what matching every term would score) carry it; a window found by meaning
    alone has none, so two weaker signals decide among its messages and break close calls elsewhere: the
    character-trigram closeness to the query (length-normalised), and a prior for what the user said (what
    an agent is asked to recall is most often the user's own facts and preferences).
    """
    scores = bm25.scores(docs)
    full = bm25.full()

    def score(i: int) -> float:
        cos = _closeness(q_trigrams, messages[i]["content"])
        return scores[i] / full + W_TRIGRAM * cos + (W_USER if messages[i]["role"] == "user" else 0.0)

    return messages[max(range(len(messages)), key=lambda i: (score(i), -i))]["sequence"]


class ConversationHydrator:
    """The ``conversation`` hydrator of ``services.search.Search`` (stateless; one per service)."""

    #: Keep every winning window of a conversation (the search collapses other kinds to one hit per parent).
    collapse_per_parent = False

    async def check_parent(self, sql: OrgSql, parent_id: str) -> None:
        """A search scoped to a conversation that is not the caller's is 404, never an empty result."""
        row = await sql.one("SELECT 1 AS found FROM conversations WHERE organization_id = ?1 AND id = ?2", [parent_id])
        if row is None:
            raise NotFound("conversation not found", details={"conversation_id": parent_id})

    async def __call__(self, sql: OrgSql, group: list, opts: Any) -> list[SearchHit]:
        chunk_rows = await sql.rows(
            "SELECT id, kind, parent_id, content, start_sequence, end_sequence FROM chunks WHERE organization_id = ?1 "
            "AND id IN (SELECT value FROM json_each(?2))",
            [json.dumps([c.chunk_id for c in group])],
        )
        chunks = {r["id"]: r for r in chunk_rows if r["kind"] == "conversation"}
        live = [c for c in group if c.chunk_id in chunks]  # a chunk replaced or deleted meanwhile is skipped
        hits: list[SearchHit] = []
        seen: set[tuple[str, int]] = set()
        q_trigrams = _trigrams(opts.query)
        want = opts.top_k
        start = 0
        while start < len(live) and len(hits) < want:
            batch = live[start : start + want - len(hits) + _PREFETCH]
            start += len(batch)
            hits.extend(await self._hydrate(sql, batch, chunks, opts, seen, q_trigrams))
        return hits[:want]

    async def _hydrate(self, sql: OrgSql, batch: list, chunks: dict, opts: Any, seen: set, q_trigrams: set) -> list[SearchHit]:
        ranges = [[chunks[c.chunk_id]["parent_id"], chunks[c.chunk_id]["start_sequence"], chunks[c.chunk_id]["end_sequence"]]
                  for c in batch]
        rows = await sql.rows(
            "SELECT m.id, m.conversation_id, m.sequence, m.role, m.content, m.content_encoding, m.metadata, "
            "m.client_id, m.created_at FROM json_each(?2) AS r CROSS JOIN messages AS m ON m.organization_id = ?1 "
            "AND m.conversation_id = json_extract(r.value, '$[0]') "
            "AND m.sequence BETWEEN json_extract(r.value, '$[1]') AND json_extract(r.value, '$[2]')",
            [json.dumps(ranges)],
        )
        by_conv: dict[str, dict[int, dict[str, Any]]] = {}
        for r in rows:
            by_conv.setdefault(r["conversation_id"], {})[r["sequence"]] = msgspec.to_builtins(message_from_row(r))
        convs = {
            r["id"]: r
            for r in await sql.rows(
                "SELECT id, title, metadata, created_at FROM conversations WHERE organization_id = ?1 "
                "AND id IN (SELECT value FROM json_each(?2))",
                [json.dumps(sorted({rg[0] for rg in ranges}))],
            )
        }
        windows = []
        for c, (cid, lo, hi) in zip(batch, ranges):
            msgs = [by_conv.get(cid, {}).get(s) for s in range(lo, hi + 1)]
            if cid in convs and msgs and all(m is not None for m in msgs):
                windows.append((c, cid, lo, hi, msgs))
        docs = {(cid, m["sequence"]): terms(m["content"]) for _, cid, _, _, msgs in windows for m in msgs}
        bm25 = _Bm25(terms(opts.query), list(docs.values()))
        hits = []
        for c, cid, lo, hi, msgs in windows:
            best = _best(bm25, msgs, [docs[(cid, m["sequence"])] for m in msgs], q_trigrams)
            if (cid, best) in seen:
                continue  # an overlapping, better-ranked window already pinpoints this message
            seen.add((cid, best))
            conv = convs[cid]
            hits.append(
                SearchHit(
                    kind="conversation",
                    document_id=cid,
                    chunk_id=c.chunk_id,
                    chunk_content=chunks[c.chunk_id]["content"],
                    score=round(c.fused, 6),
                    summary=conv["title"],
                    metadata=json.loads(conv["metadata"] or "{}"),
                    created_at=conv["created_at"],
                    conversation_id=cid,
                    start_sequence=lo,
                    end_sequence=hi,
                    best_sequence=best,
                    messages=msgs,
                    explain=explain_candidate(c) if opts.explain else None,
                )
            )
        return hits
