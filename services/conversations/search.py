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
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from functools import lru_cache
from itertools import repeat
from typing import Any

import msgspec
import numpy as np

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
#: Candidate messages given a local score (analysed: BM25 over them, trigram closeness): the best this many by
#: their turn and window scores (with the date boost); the rest keep the user prior only. The local part weighs
#: at most W_LOCAL * 1.45 (~0.07), so it reorders near-ties; analysing every message of every candidate window
#: (~260 a search at 1,000 conversations) was most of the hydrator's time (bench/README.md).
LOCAL_POOL = 64


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
    return list(_analyse(text)[0])


def _analyse(text: str) -> tuple[tuple[str, ...], str]:
    """One pass over a message: its ``terms`` (a tuple: ``count`` and ``in`` on it run in C) and its content
    words joined by spaces and padded with one each side (what ``_closeness`` looks for the query's trigrams in)."""
    words = _WORD.findall(text.lower())
    content = [w for w in words if w not in _STOP]
    return tuple(map(_stem, content or words)), f" {' '.join(content)} " if content else ""


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
_ANALYSED: OrderedDict[tuple[str, str], tuple[tuple[str, ...], str]] = OrderedDict()


def _analysed(org_id: str, row: dict[str, Any]) -> tuple[tuple[str, ...], str]:
    key = (org_id, row["id"])
    hit = _ANALYSED.get(key)
    if hit is not None:
        _ANALYSED.move_to_end(key)
        return hit
    hit = _ANALYSED[key] = _analyse(decode_content(row["content"], row["content_encoding"]))
    if len(_ANALYSED) > ANALYSED_CACHE:
        _ANALYSED.popitem(last=False)
    return hit


def _closeness(q_trigrams: set[str], padded: str) -> float:
    """Character-trigram closeness of a text to the query, normalised for the text's length (0..1). ``padded``:
    the text's content words joined by spaces, one space each side (``_analyse``): a query trigram (from one
    padded word) is in it exactly when some word of the text holds it, so one substring test per trigram."""
    if not q_trigrams or not padded:
        return 0.0
    found = sum(map(padded.__contains__, q_trigrams))  # substring tests run in C
    return found / math.sqrt(len(q_trigrams) * len(padded))


def score_messages(query: str, texts: Sequence[str]) -> list[float]:
    """BM25 of ``query`` over ``texts``, document frequencies from ``texts`` themselves."""
    docs = [_analyse(t)[0] for t in texts]
    return _Bm25(terms(query), docs).scores(docs)


class _Bm25:
    """BM25 of one query, with document frequencies and mean length from a pool of documents (term tuples). The
    query's few terms are counted in every document by ``tuple.count`` and the scores summed as arrays: no Python
    loop over a document's terms, nor over the documents (the same floating-point operations, in the same order,
    as the per-document sum)."""

    def __init__(self, query_terms: Sequence[str], pool: Sequence[tuple[str, ...]]) -> None:
        self.wanted = list(dict.fromkeys(query_terms))
        self.pool = pool
        n = len(pool)
        self.avg = sum(map(len, pool)) / max(1, n) or 1.0
        self.counts = {t: np.fromiter(map(tuple.count, pool, repeat(t, n)), dtype=np.float64, count=n)
                       for t in self.wanted}
        df = {t: int(np.count_nonzero(f)) for t, f in self.counts.items()}
        n = max(1, n)
        self.idf = {t: math.log(1 + (n - df[t] + 0.5) / (df[t] + 0.5)) for t in self.wanted}

    def full(self) -> float:
        """About what a document holding every query term once would score (a scale for the scores)."""
        return sum(self.idf.values()) or 1.0

    def scores(self, docs: Sequence[tuple[str, ...]] | None = None) -> list[float]:
        """The scores of ``docs`` (None: the pool's own documents)."""
        docs = self.pool if docs is None else docs
        n = len(docs)
        counts = self.counts if docs is self.pool else {
            t: np.fromiter(map(tuple.count, docs, repeat(t, n)), dtype=np.float64, count=n) for t in self.wanted}
        norm = K1 * (1 - B + B * np.fromiter(map(len, docs), dtype=np.float64, count=n) / self.avg)
        out = np.zeros(n)
        for t in self.wanted:
            f = counts[t]
            out += np.where(f > 0, self.idf[t] * f * (K1 + 1) / (f + norm), 0.0)
        return out.tolist()


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
            "SELECT id, kind, parent_id, start_sequence, end_sequence FROM chunks WHERE organization_id = ?1 "
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

        rows = await sql.rows(  # the candidate messages as runs of consecutive ones: one index seek per run
            "SELECT m.id, m.conversation_id, m.sequence, m.role, m.content, m.content_encoding, m.created_at, "
            "m.session FROM json_each(?2) AS r CROSS JOIN messages AS m "
            "ON m.organization_id = ?1 AND m.conversation_id = json_extract(r.value, '$[0]') "
            "AND m.sequence BETWEEN json_extract(r.value, '$[1]') AND json_extract(r.value, '$[2]')",
            [json.dumps(_runs(keys))],
        )
        msgs = {(r["conversation_id"], r["sequence"]): r for r in rows}
        lo_t, hi_t = opts.time_from, opts.time_to
        keys = [k for k in keys if k in msgs and (lo_t is None or msgs[k]["created_at"] >= lo_t)
                and (hi_t is None or msgs[k]["created_at"] <= hi_t)]
        if not keys:
            return []
        ref = opts.reference_time if opts.reference_time is not None else now_ms()
        dated = resolve_relative(opts.query, ref)
        base: dict[tuple[str, int], tuple[float, float, float, bool]] = {}  # turn, window, turn + window, dated
        for k in keys:
            turn = turn_of[k][0] if k in turn_of else turn_floor
            window = window_of[k][0] if k in window_of else window_floor
            in_range = dated is not None and dated[0] <= msgs[k]["created_at"] <= dated[1]
            base[k] = (turn, window, (W_TURN * turn + W_WINDOW * window) * (1 + W_DATE if in_range else 1.0), in_range)
        # The local score (BM25 over the pool, trigram closeness) for the LOCAL_POOL best by turn and window only
        pool = sorted(keys, key=lambda k: (-base[k][2], k))[:LOCAL_POOL]
        analysed = {k: _analysed(sql.org_id, msgs[k]) for k in pool}
        bm25 = _Bm25(terms(opts.query), [analysed[k][0] for k in pool])
        full = bm25.full()
        local_bm25 = dict(zip(pool, bm25.scores(), strict=True))
        q_trigrams = _trigrams(opts.query)

        scored: dict[tuple[str, int], float] = {}
        parts: dict[tuple[str, int], dict[str, float]] = {}
        for k in keys:
            turn, window, _, in_range = base[k]
            local = W_USER if msgs[k]["role"] == "user" else 0.0
            if k in analysed:
                local += local_bm25[k] / full + W_TRIGRAM * _closeness(q_trigrams, analysed[k][1])
            score = W_TURN * turn + W_WINDOW * window + W_LOCAL * local
            if in_range:
                score *= 1 + W_DATE
            scored[k] = score
            if opts.explain:
                parts[k] = {"turn": round(turn, 6), "window": round(window, 6), "local": round(local, 6),
                            "date_boost": in_range}

        def text(k: tuple[str, int]) -> Hashable:  # analysed when a pick from its conversation asks
            return _analysed(sql.org_id, msgs[k])[0]

        picked = _diverse(scored, {k: (k[0], msgs[k]["session"]) for k in keys}, text, opts.top_k)
        return await self._hits(sql, picked, msgs, turn_of, window_of, chunks, parts, dated, opts)

    async def _hits(self, sql: OrgSql, picked: list[tuple[tuple[str, int], float]], msgs, turn_of, window_of,
                    chunks, parts, dated, opts: Any) -> list[SearchHit]:
        if not picked:
            return []
        texts = {k: decode_content(msgs[k]["content"], msgs[k]["content_encoding"]) for k, _ in picked}
        ranges = [[cid, max(1, s - CONTEXT), s + CONTEXT] for (cid, s), _ in picked]
        # One statement: the messages around each pick, each with its conversation's fields and its turn chunk's
        # id (the hit's chunk when only a window found the message). A deleted conversation has no rows.
        ctx_rows = await sql.rows(
            "SELECT m.id, m.conversation_id, m.sequence, m.role, m.content, m.content_encoding, m.metadata, "
            "m.client_id, m.created_at, m.session, v.title AS conversation_title, "
            "v.metadata AS conversation_metadata, v.created_at AS conversation_created_at, "
            "(SELECT t.id FROM chunks AS t WHERE t.organization_id = ?1 AND t.kind = 'turn' "
            "AND t.parent_id = m.conversation_id AND t.ordinal = m.sequence) AS turn_chunk_id "
            "FROM json_each(?2) AS r CROSS JOIN messages AS m "
            "ON m.organization_id = ?1 AND m.conversation_id = json_extract(r.value, '$[0]') "
            "AND m.sequence BETWEEN json_extract(r.value, '$[1]') AND json_extract(r.value, '$[2]') "
            "CROSS JOIN conversations AS v ON v.organization_id = ?1 AND v.id = m.conversation_id",
            [json.dumps(ranges)],
        )
        around: dict[str, dict[int, dict[str, Any]]] = {}
        turn_ids: dict[tuple[str, int], str] = {}
        conv_rows: dict[str, dict[str, Any]] = {}
        for r in ctx_rows:
            around.setdefault(r["conversation_id"], {})[r["sequence"]] = msgspec.to_builtins(message_from_row(r))
            if r["turn_chunk_id"] is not None:
                turn_ids[(r["conversation_id"], r["sequence"])] = r["turn_chunk_id"]
            conv_rows[r["conversation_id"]] = {"title": r["conversation_title"],
                                               "metadata": r["conversation_metadata"],
                                               "created_at": r["conversation_created_at"]}
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


def _runs(keys: list[tuple[str, int]]) -> list[list[Any]]:
    """``(conversation, sequence)`` keys as ``[conversation, first, last]`` runs of consecutive sequences."""
    runs: list[list[Any]] = []
    for cid, seq in sorted(keys):
        if runs and runs[-1][0] == cid and runs[-1][2] == seq - 1:
            runs[-1][2] = seq
        else:
            runs.append([cid, seq, seq])
    return runs


def _diverse(scored: dict[tuple[str, int], float], session: dict[tuple[str, int], Hashable],
             text: Callable[[tuple[str, int]], Hashable], k: int) -> list[tuple[tuple[str, int], float]]:
    """Greedy pick of ``k`` messages: a picked message's neighbours (+-NEIGHBOURS, same conversation) count
    NEIGHBOUR_FACTOR, each pick from a session multiplies that session's other messages by SESSION_FACTOR, and a
    message repeating a picked one's text (``text``: same conversation, same terms) counts REPEAT_FACTOR.
    Returns ``(key, adjusted score)`` best first. A pick lowers only the messages it shares a conversation, a
    session or a text with, found through indexes of those rather than by a pass over every candidate."""
    order = sorted(scored, key=lambda key: (-scored[key], key))
    factor = dict.fromkeys(order, 1.0)
    by_conv: dict[str, list[tuple[str, int]]] = {}
    by_session: dict[Hashable, list[tuple[str, int]]] = {}
    for key in order:
        by_conv.setdefault(key[0], []).append(key)
        by_session.setdefault(session[key], []).append(key)
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
        said = text(best)
        for key in by_conv[cid]:  # neighbours and repeats are in the pick's own conversation
            if key in taken:
                continue
            if abs(key[1] - seq) <= NEIGHBOURS:
                factor[key] *= NEIGHBOUR_FACTOR
            if text(key) == said:
                factor[key] *= REPEAT_FACTOR
        if SESSION_FACTOR != 1.0:
            for key in by_session[session[best]]:
                if key not in taken:
                    factor[key] *= SESSION_FACTOR
    return out
