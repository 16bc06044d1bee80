"""Conversation hits for the hybrid search: the best single messages (turns) first, each with the window
around it, diverse across the conversation and its sessions.

Turn-level ranking (issue 9, item 4). The search retrieves two chunk kinds for ``conversation``: the 5-message
windows (context: a short reply like "yes, last Tuesday" means something only next to its question) and the
single turns (migration 0008: one keyword row and one vector per message, embedded at write time by the
worker). Both go through the same BM25 + vector convex fusion. Each candidate message ``t`` (a retrieved
turn, or any message of a retrieved window) is scored::

    score(t) = W_TURN * turn(t) + W_WINDOW * window(t) + W_LOCAL * local(t)

``turn(t)``: the fused score of t's own turn chunk (the lowest retrieved turn's score when it was not
retrieved); ``window(t)``: the best fused score of a retrieved window holding t; ``local(t)``: the
no-model pinpointing below (BM25 over the candidate messages + trigram closeness + user prior), which breaks
ties among the messages of a window found by meaning alone. A resolved relative date in the query ("last
week", "in March", ``services.text.temporal``) multiplies the score of a message said in that range by
``1 + W_DATE`` (a boost, never a filter); ``from`` / ``to`` are hard filters on the message's own
``created_at``.

Diversity: the hits are picked greedily; after each pick, the messages within +-``NEIGHBOURS`` of it (same
conversation) count ``NEIGHBOUR_FACTOR`` of their score, those repeating its text (same conversation, same
stemmed words: "Thanks!", a pasted line) ``REPEAT_FACTOR``, and every message of the same session (its
``session`` label within its conversation) ``SESSION_FACTOR`` per hit already taken from it, so the top 10 is
not ten neighbours of one hit and multi-hop questions get evidence from several places. Measured on
bench/bench_turns.py (overall turn recall@10): without the repeat factor 74.3 -> 69.6; a session factor of 0.95
cost 2.3 points and 0.9 more (so it is 1.0: off); the neighbour factor (0.3-0.8) changed nothing there, and
is what keeps a cluster of near-identical turns from filling the page (tests). Each hit is one
message: ``best_sequence`` / ``message_id`` name it, ``messages`` is the window around it (+-``CONTEXT``
messages, ``start_sequence`` .. ``end_sequence``), ``chunk_id`` is its turn chunk (or, for a conversation
appended before 0008, the window that found it). The weights are measured on bench/bench_turns.py.

The original notes on the no-model pinpointing follow.

The search finds conversation windows (chunks of kind ``conversation``); this hydrator turns each winning
window into a hit carrying the conversation id, the sequence range, the original messages of that range
(decompressed, with their metadata) and ``best_sequence``: the message of the range that best matches the
query. That choice costs no model call (``local`` in a message's score): BM25 of the query's terms over the messages of the
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
from collections import Counter, OrderedDict
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import msgspec

from services.conversations.compression import decode_content

from services.conversations.messages import format_line, message_from_row
from services.errors import NotFound
from services.ids import now_ms
from services.models import SearchHit
from services.storage.scoped import OrgSql
from services.search.fusion import explain_candidate
from services.text.temporal import resolve_relative

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
#: Weights of a message's score (module docstring); measured on bench/bench_turns.py (overall turn recall@10):
#: 0.5 / 0.35 / 0.15 with both vector weights 0.6: 74.3; turn vector weight 0.8: 75.7; and W_LOCAL 0.05: 76.4;
#: and no session factor: 80.4; W_TURN 0.6: 80.7 (0.4 / 0.45 / 0.15: 72.2). Window vector weight 0.8: -0.7.
W_TURN, W_WINDOW, W_LOCAL = 0.6, 0.35, 0.05
#: Weight of the vector side within a turn's and a window's own score (the search's fusion uses 0.6 for every
#: kind; a turn is short, its keywords are few and its meaning is what matters).
TURN_VECTOR_WEIGHT, WINDOW_VECTOR_WEIGHT = 0.8, 0.6
#: A message whose text repeats a picked one's (same conversation) counts REPEAT_FACTOR of its score.
REPEAT_FACTOR = 0.5
#: A message said in the range a relative date of the query names: score x (1 + W_DATE).
W_DATE = 0.25
#: Diversity: messages within +-NEIGHBOURS of a picked one count NEIGHBOUR_FACTOR of their score; each hit
#: already taken from a session multiplies its other messages by SESSION_FACTOR.
NEIGHBOURS, NEIGHBOUR_FACTOR, SESSION_FACTOR = 2, 0.5, 1.0
#: Messages each side of a hit's message in its window (``messages``).
CONTEXT = 2
#: Fused candidates (windows and turns) the search hands this hydrator, whatever top_k.
DEPTH = 200


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
    return _analyse(text)[0]


def _analyse(text: str) -> tuple[list[str], str]:
    """One pass over a message: its ``terms`` and its content words joined by spaces (what ``_closeness``
    compares the query's trigrams with)."""
    words = _WORD.findall(text.lower())
    content = [w for w in words if w not in _STOP]
    return [_stem(w) for w in (content or words)], " ".join(content)


def _trigrams(text: str) -> set[str]:
    out: set[str] = set()
    for w in _WORD.findall(text.lower()):
        if w in _STOP:
            continue
        padded = f" {w} "
        out.update(padded[i : i + 3] for i in range(len(padded) - 2))
    return out


#: Analysed messages (``_analyse``) kept between searches, by (organization, message id): a message's text never
#: changes (compression re-encodes it, the same text), and the candidates of related queries overlap.
ANALYSED_CACHE = 20_000
_ANALYSED: OrderedDict[tuple[str, str], tuple[list[str], str]] = OrderedDict()


def _analysed(org_id: str, row: dict[str, Any]) -> tuple[list[str], str]:
    key = (org_id, row["id"])
    hit = _ANALYSED.get(key)
    if hit is not None:
        _ANALYSED.move_to_end(key)
        return hit
    hit = _ANALYSED[key] = _analyse(decode_content(row["content"], row["content_encoding"]))
    if len(_ANALYSED) > ANALYSED_CACHE:
        _ANALYSED.popitem(last=False)
    return hit


def _closeness(q_trigrams: set[str], words: str) -> float:
    """Character-trigram closeness of a text to the query, normalised for the text's length (0..1). ``words``:
    the text's content words joined by spaces (``_analyse``)."""
    if not q_trigrams or not words:
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


class ConversationHydrator:
    """The ``conversation`` hydrator of ``services.search.search.Search`` (stateless; one per service)."""

    #: Keep every candidate chunk (the search collapses other kinds to one hit per parent).
    collapse_per_parent = False
    #: Chunk kinds it ranks: windows and single turns (migration 0008).
    chunk_kinds: tuple[str, ...] = ("conversation", "turn")
    #: Fused candidates it wants (it ranks messages, not chunks: more candidates than hits).
    depth = DEPTH

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
        chunks = {r["id"]: r for r in chunk_rows if r["kind"] in self.chunk_kinds}
        turn_of: dict[tuple[str, int], tuple[float, Any]] = {}  # (conversation, sequence) -> (fused, candidate)
        windows: list[tuple[Any, str, int, int]] = []
        for c in group:
            row = chunks.get(c.chunk_id)  # a chunk replaced or deleted meanwhile is skipped
            if row is None:
                continue
            if row["kind"] == "turn":
                own = (1 - TURN_VECTOR_WEIGHT) * c.keyword_part + TURN_VECTOR_WEIGHT * c.vector_part
                turn_of.setdefault((row["parent_id"], row["start_sequence"]), (own, c))
            else:
                own = (1 - WINDOW_VECTOR_WEIGHT) * c.keyword_part + WINDOW_VECTOR_WEIGHT * c.vector_part
                windows.append((own, c, row["parent_id"], row["start_sequence"], row["end_sequence"]))
        windows.sort(key=lambda w: w[0], reverse=True)
        if not turn_of and not windows:
            return []
        turn_floor = min((f for f, _ in turn_of.values()), default=0.0)
        window_of: dict[tuple[str, int], tuple[float, Any]] = {}
        for own, c, cid, lo, hi in windows:  # best first: the first window holding a message is its best
            for s in range(lo, hi + 1):
                window_of.setdefault((cid, s), (own, c))
        window_floor = min((w[0] for w in windows), default=0.0)
        keys = list(dict.fromkeys([*turn_of, *window_of]))

        rows = await sql.rows(
            "SELECT m.id, m.conversation_id, m.sequence, m.role, m.content, m.content_encoding, m.metadata, "
            "m.client_id, m.created_at, m.session FROM json_each(?2) AS r CROSS JOIN messages AS m "
            "ON m.organization_id = ?1 AND m.conversation_id = json_extract(r.value, '$[0]') "
            "AND m.sequence = json_extract(r.value, '$[1]')",
            [json.dumps(keys)],
        )
        msgs = {(r["conversation_id"], r["sequence"]): r for r in rows}
        lo_t, hi_t = opts.time_from, opts.time_to
        keys = [k for k in keys if k in msgs and (lo_t is None or msgs[k]["created_at"] >= lo_t)
                and (hi_t is None or msgs[k]["created_at"] <= hi_t)]
        if not keys:
            return []
        analysed = {k: _analysed(sql.org_id, msgs[k]) for k in keys}
        docs = {k: a[0] for k, a in analysed.items()}
        bm25 = _Bm25(terms(opts.query), list(docs.values()))
        full = bm25.full()
        local_bm25 = dict(zip(keys, bm25.scores([docs[k] for k in keys]), strict=True))
        q_trigrams = _trigrams(opts.query)
        ref = opts.reference_time if opts.reference_time is not None else now_ms()
        dated = resolve_relative(opts.query, ref)

        scored: dict[tuple[str, int], float] = {}
        parts: dict[tuple[str, int], dict[str, float]] = {}
        for k in keys:
            turn = turn_of[k][0] if k in turn_of else turn_floor
            window = window_of[k][0] if k in window_of else window_floor
            local = (local_bm25[k] / full + W_TRIGRAM * _closeness(q_trigrams, analysed[k][1])
                     + (W_USER if msgs[k]["role"] == "user" else 0.0))
            score = W_TURN * turn + W_WINDOW * window + W_LOCAL * local
            in_range = dated is not None and dated[0] <= msgs[k]["created_at"] <= dated[1]
            if in_range:
                score *= 1 + W_DATE
            scored[k] = score
            parts[k] = {"turn": round(turn, 6), "window": round(window, 6), "local": round(local, 6),
                        "date_boost": in_range}

        picked = _diverse(scored, {k: (k[0], msgs[k]["session"]) for k in keys},
                          {k: (k[0], " ".join(docs[k])) for k in keys}, opts.top_k)
        return await self._hits(sql, picked, msgs, turn_of, window_of, chunks, parts, dated, opts)

    async def _hits(self, sql: OrgSql, picked: list[tuple[tuple[str, int], float]], msgs, turn_of, window_of,
                    chunks, parts, dated, opts: Any) -> list[SearchHit]:
        if not picked:
            return []
        texts = {k: decode_content(msgs[k]["content"], msgs[k]["content_encoding"]) for k, _ in picked}
        ranges = [[cid, max(1, s - CONTEXT), s + CONTEXT] for (cid, s), _ in picked]
        ctx_rows, turn_rows, convs = await _gather(
            sql.rows(
                "SELECT m.id, m.conversation_id, m.sequence, m.role, m.content, m.content_encoding, m.metadata, "
                "m.client_id, m.created_at, m.session FROM json_each(?2) AS r CROSS JOIN messages AS m "
                "ON m.organization_id = ?1 AND m.conversation_id = json_extract(r.value, '$[0]') "
                "AND m.sequence BETWEEN json_extract(r.value, '$[1]') AND json_extract(r.value, '$[2]')",
                [json.dumps(ranges)],
            ),
            sql.rows(  # the turn chunks of picked messages that only a window found
                "SELECT c.id, c.parent_id, c.start_sequence FROM json_each(?2) AS r CROSS JOIN chunks AS c "
                "ON c.organization_id = ?1 AND c.kind = 'turn' AND c.parent_id = json_extract(r.value, '$[0]') "
                "AND c.ordinal = json_extract(r.value, '$[1]')",
                [json.dumps([list(k) for k, _ in picked if k not in turn_of])],
            ),
            sql.rows(
                "SELECT id, title, metadata, created_at FROM conversations WHERE organization_id = ?1 "
                "AND id IN (SELECT value FROM json_each(?2))",
                [json.dumps(sorted({k[0] for k, _ in picked}))],
            ),
        )
        around: dict[str, dict[int, dict[str, Any]]] = {}
        for r in ctx_rows:
            around.setdefault(r["conversation_id"], {})[r["sequence"]] = msgspec.to_builtins(message_from_row(r))
        turn_ids = {(r["parent_id"], r["start_sequence"]): r["id"] for r in turn_rows}
        conv_rows = {r["id"]: r for r in convs}
        hits = []
        for (cid, seq), score in picked:
            conv = conv_rows.get(cid)
            near = around.get(cid, {})
            if conv is None or seq not in near:
                continue  # deleted meanwhile
            window = [near[s] for s in sorted(near) if abs(s - seq) <= CONTEXT]
            cand = turn_of[(cid, seq)][1] if (cid, seq) in turn_of else window_of[(cid, seq)][1]
            chunk_id = cand.chunk_id if (cid, seq) in turn_of else turn_ids.get((cid, seq), cand.chunk_id)
            explain = None
            if opts.explain:
                explain = {**explain_candidate(cand), **parts[(cid, seq)], "message_score": round(score, 6),
                           "formula": f"message = {W_TURN} * turn + {W_WINDOW} * window + {W_LOCAL} * local "
                                      f"(x {1 + W_DATE} in the query's date range), then diversity",
                           "date_range": list(dated[:2]) if dated else None, "date_text": dated[2] if dated else None}
            hits.append(
                SearchHit(
                    kind="conversation",
                    document_id=cid,
                    chunk_id=chunk_id,
                    chunk_content=format_line(msgs[(cid, seq)]["role"], texts[(cid, seq)]),
                    score=round(score, 6),
                    summary=conv["title"],
                    metadata=json.loads(conv["metadata"] or "{}"),
                    created_at=conv["created_at"],
                    conversation_id=cid,
                    start_sequence=window[0]["sequence"],
                    end_sequence=window[-1]["sequence"],
                    best_sequence=seq,
                    message_id=msgs[(cid, seq)]["id"],
                    messages=window,
                    explain=explain,
                )
            )
        return hits


def _diverse(scored: dict[tuple[str, int], float], session: dict[tuple[str, int], str],
             text: dict[tuple[str, int], tuple[str, str]], k: int) -> list[tuple[tuple[str, int], float]]:
    """Greedy pick of ``k`` messages: a picked message's neighbours (+-NEIGHBOURS, same conversation) count
    NEIGHBOUR_FACTOR, and each pick from a session multiplies that session's other messages by SESSION_FACTOR.
    Returns ``(key, adjusted score)`` best first."""
    order = sorted(scored, key=lambda key: (-scored[key], key))
    factor = dict.fromkeys(order, 1.0)
    out: list[tuple[tuple[str, int], float]] = []
    taken: set[tuple[str, int]] = set()
    while len(out) < k and len(taken) < len(order):
        best, best_score = None, -1.0
        for key in order:
            if scored[key] <= best_score:
                break  # sorted by base score; factors only lower it
            if key in taken:
                continue
            adjusted = scored[key] * factor[key]
            if adjusted > best_score:
                best, best_score = key, adjusted
        if best is None:
            break
        taken.add(best)
        out.append((best, best_score))
        cid, seq = best
        for key in order:
            if key in taken:
                continue
            if key[0] == cid and abs(key[1] - seq) <= NEIGHBOURS:
                factor[key] *= NEIGHBOUR_FACTOR
            if session[key] == session[best]:
                factor[key] *= SESSION_FACTOR
            if text[key] == text[best]:
                factor[key] *= REPEAT_FACTOR
    return out


async def _gather(*aws):
    import asyncio

    return await asyncio.gather(*aws)
