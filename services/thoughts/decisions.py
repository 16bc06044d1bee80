"""Write-time decisions (memory-layer-lessons): one embedding and one vector query per new thought decide
whether it is a duplicate, contradicts, replaces or merges with what the organization already has.

Bands, by the best cosine similarity among the organization's thoughts (kind 'thought' only):

* ``>= 0.95``: a duplicate. Blocked before any model is asked: nothing is stored, the existing id is returned.
* ``0.85 - 0.95``: the language model chooses exactly one of contradiction / replace / merge / keep_both
  (the seed's combined prompt, JSON). Without a model (none configured, or the organization's budget spent)
  the thought is kept and *flagged* as a possible duplicate of the candidate.
* ``0.45 - 0.85``: the model is asked about contradiction only (a lighter prompt). Without one: created.
* below ``0.45``: created, no model call.

The model's answer is validated: the action must be one the band allows, the id must be one of the candidates
offered (replace and merge only those at >= 0.85), a merge needs non-empty merged content within the size
limit and whole (untruncated) inputs. Anything else, garbage JSON or an exception included, is keep_both.

An embedding barely sees numbers and negations ("standup at 9:30" vs "standup at 10:30" are > 0.95 with
MiniLM): a >= 0.95 match whose numbers or negation words differ is not blocked but decided as the 0.85 -
0.95 band (the model sees a likely contradiction or replace; without one it is kept and flagged).

What the one embedding covers: the thought's first chunk. It is exactly the vector the embedding job needs
for that chunk, so it is handed over (``RecentVectors``) instead of being computed twice. For a multi-chunk
thought it does not cover the rest, so a >= 0.95 match there is not enough to block: it is treated as the
0.85 - 0.95 band (decided by the model, else flagged).

The index may lag: a thought captured moments ago may have no searchable vector yet (its job has not run, or
Vectorize has not applied the write). The vectors computed at capture by this process are compared as well
(the organization's most recent ones, a matrix product over at most a few hundred vectors), which covers
that window on one instance. Not covered: a near-duplicate captured on *another* instance less than the
index lag ago (seconds on Vectorize). Keyword-searching the pending chunks and embedding them would close it
at the cost of extra model runs on every capture during bursts; we don't: an exact repeat is still caught by
the content hash, and a near-duplicate that slips through is kept (never lost), as with keep_both.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from services.errors import RateLimited
from services.ports import LLM, ChatMessage, Embedder, SqlResult, Statement, VectorMatch
from services.search.recent_vectors import RecentVectors
from services.search.selective import Selective, all_common, remember
from services.storage.scoped import OrgSql, OrgVectors

__all__ = [
    "DUPLICATE_BLOCK", "DUPLICATE_FLAG", "CANDIDATE_MIN", "Decisions", "Plan", "Similar", "validate_answer",
    "COMBINED_SCHEMA", "CONTRADICTION_SCHEMA", "Prefetched",
]

log = logging.getLogger("memex.decisions")

DUPLICATE_BLOCK = 0.95
DUPLICATE_FLAG = 0.85
CANDIDATE_MIN = 0.45
MAX_CANDIDATES = 5
OVERFETCH = 3  # chunks per parent: query wider, then keep the best chunk of each thought
PROMPT_CHARS = 2000  # of each memory shown to the model; a truncated one can't be merged

SYSTEM = "You maintain a long-term memory store. You compare a NEW memory with EXISTING ones and answer in JSON only."

COMBINED = (
    "Choose exactly one action. Prioritise in this order:\n"
    '1. "contradiction" - new memory DIRECTLY CONFLICTS with an existing one\n'
    '2. "replace" - new memory clearly supersedes an existing one\n'
    '3. "merge" - both memories are complementary and better as one combined entry\n'
    '4. "keep_both" - memories are different enough to coexist\n'
    "Respond with JSON only.\n"
    '{"action":"keep_both"} OR {"action":"contradiction","conflicting_id":"<id>","reason":"<10 words max>"} OR '
    '{"action":"replace","target_id":"<id>"} OR {"action":"merge","target_id":"<id>","merged_content":"<text>"}'
)

CONTRADICTION = (
    "Does the NEW memory DIRECTLY CONFLICT with one of the EXISTING memories (they cannot both be true)?\n"
    "Respond with JSON only.\n"
    '{"action":"keep_both"} OR {"action":"contradiction","conflicting_id":"<id>","reason":"<10 words max>"}'
)

COMBINED_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "action": {"type": "string", "enum": ["contradiction", "replace", "merge", "keep_both"]},
        "conflicting_id": {"type": "string"},
        "target_id": {"type": "string"},
        "merged_content": {"type": "string"},
        "reason": {"type": "string"},
    },
    "required": ["action"],
}
CONTRADICTION_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "action": {"type": "string", "enum": ["contradiction", "keep_both"]},
        "conflicting_id": {"type": "string"},
        "reason": {"type": "string"},
    },
    "required": ["action"],
}


#: The lexical gate (used without a language model): probe with this many of the new text's longest words,
#: look at this many keyword candidates, and embed only when one holds this share of the new text's words.
GATE_TERMS = 8
GATE_CANDIDATES = 5
GATE_CONTAINMENT = 0.5
_GATE_WORD = re.compile(r"[^\W_]{3,}", re.UNICODE)
_GATE_STOP = frozenset(
    "the and for are but not you all any can had her was one our out has him his how its may new now old see "
    "two who did get let put say she too use that with have this will your from they been were said each which "
    "their there what when where would about could other than then them these some into more also only".split()
)


def _gate_statement(org_id: str, probe: list[str], before_id: str | None = None) -> tuple[str, list[Any]]:
    """The lexical gate's keyword lookup: the thoughts' chunks matching the probe words, best first (with
    ``before_id``: only the thoughts captured before that one). The MATCH leaves out the probe's words that most of
    the organization's chunks hold (``Selective``, as the search's keyword side does): a thought close enough to
    matter shares the new text's rarer words too, and FTS5 ranks every row a MATCH finds, so one common word made
    this lookup read most of a large organization (160 ms a thought at 100,000 chunks; bench/README.md)."""
    match = Selective(org_id, "chunks_fts", probe, anchor=False)
    sql = (
        f"{match.prefix}SELECT {match.column}c.parent_id, c.content, "
        "(c.indexed_at IS NULL OR c.vector_mutation IS NOT NULL) AS pending "
        "FROM chunks_fts JOIN chunks c ON c.pk = chunks_fts.rowid "
    )
    if before_id is not None:
        sql += ("JOIN documents d ON d.organization_id = c.organization_id AND d.id = c.parent_id "
                "JOIN documents me ON me.organization_id = ?1 AND me.id = ?4 ")
    sql += (f"WHERE chunks_fts MATCH {match.operand} AND chunks_fts.organization_id = ?1 AND c.organization_id = ?1 "
            "AND c.kind = 'thought' ")
    if before_id is not None:
        sql += "AND (d.created_at < me.created_at OR (d.created_at = me.created_at AND d.id < ?4)) "
    sql += "ORDER BY rank LIMIT ?3"
    return sql, [match.param, GATE_CANDIDATES] + ([before_id] if before_id is not None else [])


def _gate_probe(words: set[str]) -> list[str]:
    """The probe: the text's longest words (the likeliest to be rare), at most GATE_TERMS."""
    return sorted(words, key=lambda w: (-len(w), w))[:GATE_TERMS]


#: What a decision shows of a candidate (the model's prompt, the salient facts): continued with the ids' JSON array.
_PROMPT_ROWS = (
    "SELECT id, substr(content, 1, ?2) AS content, length(content) AS chars FROM documents "
    "WHERE organization_id = ?1 AND id IN (SELECT value FROM json_each(?3))"
)


def _words(text: str) -> set[str]:
    return {w for w in (m.lower() for m in _GATE_WORD.findall(text)) if w not in _GATE_STOP}


@dataclass(slots=True)
class Similar:
    """An existing thought close to the new one."""

    id: str
    score: float
    content: str = ""
    truncated: bool = False


@dataclass(slots=True)
class Prefetched:
    """What a worker's round read at once for the decisions of its thoughts (``Decisions.prefetch``): each thought's
    vector matches, and what the decisions show of the thoughts they may be compared with (``asked``: the ids read;
    one of them missing from ``rows`` is gone)."""

    matches: dict[str, list[VectorMatch]]
    rows: dict[str, dict[str, Any]]
    asked: set[str]
    #: Text -> its vector: the gate's close thoughts not searchable yet, embedded for the whole round in one call.
    texts: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass(slots=True)
class Plan:
    """What capture does: created | duplicate | flagged | keep_both | contradiction | replace | merge."""

    action: str
    related_id: str | None = None
    reason: str | None = None
    similarity: float | None = None
    merged_content: str | None = None
    #: The first chunk's embedding (handed to the embedding job).
    vector: np.ndarray | None = None


_WORD = re.compile(r"\w+", re.UNICODE)
_NEGATIONS = frozenset(
    "not no never none nothing nobody cannot without don doesn didn isn aren wasn weren won wouldn shouldn can".split()
)


def salient(text: str) -> set[str]:
    """The words an embedding barely sees but that change what a note says: numbers and negations."""
    return {w for w in (m.lower() for m in _WORD.findall(text)) if w in _NEGATIONS or any(ch.isdigit() for ch in w)}


def _band(best: float, multi_chunk: bool, same_facts: bool = True) -> str:
    if best >= DUPLICATE_BLOCK:
        return "flag" if multi_chunk or not same_facts else "duplicate"
    if best >= DUPLICATE_FLAG:
        return "flag"
    if best >= CANDIDATE_MIN:
        return "candidate"
    return "none"


def _short(text: Any, limit: int = 200) -> str | None:
    if not isinstance(text, str) or not text.strip():
        return None
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def validate_answer(
    data: Any, offered: Mapping[str, Similar], *, band: str, new_truncated: bool = False,
    max_content_bytes: int = 256 * 1024,
) -> Plan:
    """The model's answer as a Plan, or keep_both (with the reason it was refused) when it is not valid.

    ``offered`` maps the ids shown to the model (short aliases) to the candidates; a candidate's real id is
    accepted too. ``band`` is ``flag`` (all four actions) or ``candidate`` (contradiction or keep_both)."""
    best = max(offered.values(), key=lambda c: c.score) if offered else None

    def keep(reason: str) -> Plan:
        return Plan("keep_both", best.id if best else None, reason, round(best.score, 4) if best else None)

    if not isinstance(data, dict):
        return keep("invalid model answer: not a JSON object")
    action = data.get("action")
    allowed = ("contradiction", "replace", "merge", "keep_both") if band == "flag" else ("contradiction", "keep_both")
    if action not in allowed:
        return keep(f"invalid model answer: action {str(action)[:40]!r} not allowed here")
    if action == "keep_both":
        return keep(_short(data.get("reason")) or "the model chose to keep both")

    by_real = {c.id: c for c in offered.values()}
    key = "conflicting_id" if action == "contradiction" else "target_id"
    raw = data.get(key)
    cand = (offered.get(raw) or by_real.get(raw)) if isinstance(raw, str) else None
    if cand is None:
        return keep(f"invalid model answer: {key} is not one of the candidates")
    sim = round(cand.score, 4)
    if action == "contradiction":
        return Plan("contradiction", cand.id, _short(data.get("reason")) or "contradicts an existing thought", sim)
    if cand.score < DUPLICATE_FLAG:
        return keep(f"invalid model answer: {action} of a candidate below {DUPLICATE_FLAG}")
    if action == "replace":
        return Plan("replace", cand.id, _short(data.get("reason")) or "supersedes an existing thought", sim)
    merged = data.get("merged_content")
    if not isinstance(merged, str) or not merged.strip():
        return keep("invalid model answer: merge without merged_content")
    if new_truncated or cand.truncated:
        return keep("not merged: a memory was too long to show the model whole")
    if len(merged.encode("utf-8")) > max_content_bytes:
        return keep("invalid model answer: merged_content is over the size limit")
    return Plan("merge", cand.id, _short(data.get("reason")) or "merged with an existing thought", sim,
                merged_content=merged.strip())


class Decisions:
    """The write-time decision of one organization's captures."""

    def __init__(
        self,
        sql: OrgSql,
        vectors: OrgVectors,
        embedder: Embedder,
        *,
        llm: LLM | None = None,
        recent: RecentVectors | None = None,
        max_content_bytes: int = 256 * 1024,
        lexical_gate: bool = False,
    ) -> None:
        self.lexical_gate = lexical_gate
        self.sql = sql
        self.vectors = vectors
        self.embedder = embedder
        self.llm = llm
        self.recent = recent
        self.max_content_bytes = max_content_bytes

    async def embed(self, text: str) -> np.ndarray:
        return (await self.embedder.embed([text]))[0]

    async def _matches(self, vector: np.ndarray) -> list[VectorMatch]:
        return await self.vectors.query(
            vector, top_k=MAX_CANDIDATES * OVERFETCH, filter={"kind": {"$eq": "thought"}}, return_metadata=True
        )

    async def prefetch(self, asks: Sequence[tuple[str, np.ndarray]], also: Sequence[str] = (),
                       pending: Mapping[str, Sequence[tuple[str, str]]] | None = None,
                       in_hand: Mapping[str, np.ndarray] | None = None, concurrency: int = 4) -> Prefetched:
        """For a worker's round: the vector matches of each ``(thought id, vector)`` in ``asks`` (one index query
        each, a few at a time); the texts of ``pending`` (thought id -> the gate's close thoughts not searchable
        yet, (id, text)) that its matches do not cover, embedded in one call (``in_hand``: text -> a vector the
        round has already); then in one SQL read what the decisions show of every thought they may be compared
        with (the matches at or above ``CANDIDATE_MIN``, and ``also``: the round's own thoughts, the gate's)."""
        gate = asyncio.Semaphore(max(1, concurrency))

        async def one(vector: np.ndarray) -> list[VectorMatch]:
            async with gate:
                return await self._matches(vector)

        found = await asyncio.gather(*(one(v) for _, v in asks))
        matches = {doc_id: m for (doc_id, _), m in zip(asks, found, strict=True)}
        ids = set(also)
        texts: dict[str, np.ndarray] = {}
        for doc_id, ms in matches.items():
            parents = {(m.metadata or {}).get("parent_id") for m in ms}
            for m in ms:
                md = m.metadata or {}
                if md.get("kind") == "thought" and md.get("parent_id") and m.score >= CANDIDATE_MIN:
                    ids.add(md["parent_id"])
            for p, text in (pending or {}).get(doc_id, ()):
                if p not in parents and text not in texts:
                    texts[text] = (in_hand or {}).get(text)
        embed = [t for t, v in texts.items() if v is None]
        if embed:
            texts.update(zip(embed, await self.embedder.embed(embed), strict=True))
        rows = {r["id"]: r for r in await self.sql.rows(_PROMPT_ROWS, [PROMPT_CHARS, json.dumps(sorted(ids))])} \
            if ids else {}
        return Prefetched(matches, rows, ids, texts)

    async def candidates(self, vector: np.ndarray, pending: Sequence[tuple[str, str]] = (),
                         extra: Sequence[tuple[str, np.ndarray]] = (), *, own_id: str | None = None,
                         prefetched: Prefetched | None = None) -> list[Similar]:
        """The organization's thoughts nearest to ``vector`` (>= 0.45, best first, at most 5), each checked to
        still exist in SQL (the index can hold a vector of a thought deleted moments ago). ``pending``: (id, text)
        of close thoughts not in the index yet, embedded here; ``extra``: (id, vector) of thoughts whose vectors are
        in hand (the worker's round); ``own_id``: the stored thought being decided (never its own candidate);
        ``prefetched``: what the round read at once (its matches for ``own_id``, the candidates' rows)."""
        best: dict[str, float] = {parent: float(np.dot(vector, v)) for parent, v in extra}
        if prefetched is not None and own_id in prefetched.matches:
            matches = prefetched.matches[own_id]
        else:
            matches = await self._matches(vector)
        for m in matches:
            md = m.metadata or {}
            parent = md.get("parent_id")
            if md.get("kind") == "thought" and parent and m.score > best.get(parent, -1.0):
                best[parent] = float(m.score)
        missing = [(p, text) for p, text in pending if p not in best]  # not in the index, nor in hand
        if missing:  # found by the lexical gate but not yet in the index: one small embedding call (or the round's)
            known = prefetched.texts if prefetched is not None else {}
            ask = list(dict.fromkeys(text for _, text in missing if text not in known))
            values = {**known, **dict(zip(ask, await self.embedder.embed(ask), strict=True))} if ask else known
            for parent, text in missing:
                best[parent] = max(best.get(parent, -1.0), float(np.dot(vector, values[text])))
        if self.recent is not None:
            for parent, score in self.recent.similar(self.sql.org_id, vector):
                if score > best.get(parent, -1.0):
                    best[parent] = score
        best.pop(own_id, None)  # its own vector (written by an earlier attempt of its job) is not a candidate
        near = sorted(((p, s) for p, s in best.items() if s >= CANDIDATE_MIN), key=lambda x: x[1], reverse=True)
        near = near[:MAX_CANDIDATES]
        if not near:
            return []
        found: dict[str, dict[str, Any]] = {}
        ask = [p for p, _ in near]
        if prefetched is not None:
            found = {p: prefetched.rows[p] for p in ask if p in prefetched.rows}
            ask = [p for p in ask if p not in prefetched.asked]
        if ask:
            found.update((r["id"], r) for r in await self.sql.rows(_PROMPT_ROWS, [PROMPT_CHARS, json.dumps(ask)]))
        return [
            Similar(p, min(1.0, s), found[p]["content"], found[p]["chars"] > PROMPT_CHARS)
            for p, s in near
            if p in found
        ]

    async def plausible_many(self, first_chunks: Sequence[str], ids: Sequence[str]
                             ) -> list[list[tuple[str, str, bool]]]:
        """``plausible`` for several stored thoughts (``ids``, with their first chunks) in one round trip (one SQL
        batch: on D1 one request), each against the thoughts captured before it: itself and later ones are not
        what it is decided against."""
        stmts = self.plausible_stmts(first_chunks, ids)
        asked = [st for st in stmts if st is not None]
        return self.plausible_results(first_chunks, stmts, await self.sql.batch(asked) if asked else [])

    def plausible_stmts(self, first_chunks: Sequence[str], ids: Sequence[str]) -> list[Statement | None]:
        """The statements of ``plausible_many`` (None for a text with no word to probe), for a caller that sends them
        in a batch of its own; ``plausible_results`` reads their results."""
        out: list[Statement | None] = []
        for text, doc_id in zip(first_chunks, ids, strict=True):
            probe = _gate_probe(_words(text))
            if not probe or all_common(self.sql.org_id, "chunks_fts", probe):  # see plausible_results
                out.append(None)
                continue
            sql, params = _gate_statement(self.sql.org_id, probe, doc_id)
            out.append(self.sql.stmt(sql, *params))
        return out

    def plausible_results(self, first_chunks: Sequence[str], stmts: Sequence[Statement | None],
                          results: Sequence[SqlResult]) -> list[list[tuple[str, str, bool]] | None]:
        """Per text: the close thoughts, [] for none, or None when the gate was not asked because every probe word
        is common in the organization (the lookup would read a large share of it, where the index query it means
        to spare costs the same whatever the words: the decision asks the index)."""
        out: list[list[tuple[str, str, bool]] | None] = [[] for _ in first_chunks]
        answers = iter(results)
        for i, st in enumerate(stmts):
            words = _words(first_chunks[i])
            probe = _gate_probe(words)
            if st is None:
                if probe:  # words to probe, all common
                    out[i] = None
                continue
            rows = next(answers).rows
            remember((self.sql.org_id, "chunks_fts"), probe, rows)
            out[i] = [(r["parent_id"], r["content"], bool(r["pending"])) for r in rows
                      if len(words & _words(r["content"])) >= GATE_CONTAINMENT * len(words)]
        return out

    async def plausible(self, first_chunk: str) -> list[tuple[str, str, bool]] | None:
        """Without a language model only similarity >= 0.85 changes the outcome, and texts that close share
        most of their words. One keyword lookup (the new text's rarest-looking words) finds any thought that
        could be that close; when none shares GATE_CONTAINMENT of the words, the capture skips the model run
        on the request path (the worker embeds it as usual). Returns the close thoughts as (id, chunk text,
        whether its vector is not searchable yet), or None when every probe word is common in the organization
        (``plausible_results``): the decision then embeds and asks the index."""
        words = _words(first_chunk)
        if not words:
            return []
        probe = _gate_probe(words)
        if all_common(self.sql.org_id, "chunks_fts", probe):
            return None
        rows = await self.sql.rows(*_gate_statement(self.sql.org_id, probe))
        remember((self.sql.org_id, "chunks_fts"), probe, rows)
        return [
            (r["parent_id"], r["content"], bool(r["pending"]))
            for r in rows
            if len(words & _words(r["content"])) >= GATE_CONTAINMENT * len(words)
        ]

    async def decide(self, content: str, first_chunk: str, *, multi_chunk: bool) -> Plan:
        pending: list[tuple[str, str]] = []
        if self.lexical_gate and self.llm is None:
            close = await self.plausible(first_chunk)
            if close is not None and not close:
                return Plan("created")
            # close thoughts captured moments ago (vectors not searchable yet) are compared directly
            pending = [(pid, text) for pid, text, not_searchable in close or () if not_searchable]
        vector = await self.embed(first_chunk)
        plan = await self._decide(content, vector, multi_chunk=multi_chunk, pending=pending)
        plan.vector = vector
        return plan

    async def decide_embedded(self, content: str, vector: np.ndarray, *, multi_chunk: bool,
                              close: Sequence[tuple[str, str, bool]] | None = None,
                              extra: Sequence[tuple[str, np.ndarray]] = (), own_id: str | None = None,
                              prefetched: Prefetched | None = None) -> Plan:
        """The decision of a thought whose first chunk's vector is in hand (the worker's embedding round).
        ``close``: what the lexical gate found for it (``plausible_many``), None when the gate was not asked (a
        language model is configured, or the gate is off); ``extra``: (id, vector) of thoughts captured before it
        whose vectors the index does not show yet; ``own_id``: the thought's id (never its own candidate);
        ``prefetched``: what its round read at once (``prefetch``)."""
        if close is not None and not close:  # nothing shares enough words, in the index or in this round
            return Plan("created")
        pending = [(pid, text) for pid, text, not_searchable in (close or ()) if not_searchable]
        return await self._decide(content, vector, multi_chunk=multi_chunk, pending=pending, extra=extra,
                                  own_id=own_id, prefetched=prefetched)

    @property
    def gated(self) -> bool:
        """Whether the lexical gate decides first (no language model: only >= 0.85 changes an outcome)."""
        return self.lexical_gate and self.llm is None

    async def _decide(
        self, content: str, vector: np.ndarray, *, multi_chunk: bool, pending: Sequence[tuple[str, str]] = (),
        extra: Sequence[tuple[str, np.ndarray]] = (), own_id: str | None = None, prefetched: Prefetched | None = None,
    ) -> Plan:
        cands = await self.candidates(vector, pending, extra, own_id=own_id, prefetched=prefetched)
        if not cands:
            return Plan("created")
        top = cands[0]
        new_facts, old_facts = salient(content[:PROMPT_CHARS]), salient(top.content)
        same_facts = (new_facts <= old_facts) if top.truncated else (new_facts == old_facts)
        band = _band(top.score, multi_chunk, same_facts)
        sim = round(top.score, 4)
        if band == "duplicate":
            return Plan("duplicate", top.id, f"near-identical to an existing thought (similarity {sim})", sim)
        if self.llm is None:
            return self._without_model(band, top, "no language model configured")
        offered = {f"m{i + 1}": c for i, c in enumerate(cands)}
        messages = self._messages(content, offered, band)
        schema = COMBINED_SCHEMA if band == "flag" else CONTRADICTION_SCHEMA
        if band == "flag":
            max_tokens = min(2048, 128 + 2 * (self.embedder.count_tokens(content[:PROMPT_CHARS])
                                               + self.embedder.count_tokens(top.content)))
        else:
            max_tokens = 96
        try:
            result = await self.llm.complete_json(messages, schema=schema, max_tokens=max_tokens, temperature=0.2)
        except RateLimited:  # the organization's LLM budget is spent (BudgetExceeded): as without a model
            return self._without_model(band, top, "the organization's language-model budget is spent")
        except Exception as exc:  # the model failed or answered no JSON: keep both, never block the write
            log.warning("decision model call failed: %s", exc)
            return Plan("keep_both", top.id, f"the model failed ({type(exc).__name__}); kept both", sim)
        return validate_answer(result.data, offered, band=band, new_truncated=len(content) > PROMPT_CHARS,
                               max_content_bytes=self.max_content_bytes)

    @staticmethod
    def _without_model(band: str, top: Similar, why: str) -> Plan:
        sim = round(top.score, 4)
        if band == "flag":
            return Plan("flagged", top.id, f"possible duplicate (similarity {sim}); {why}", sim)
        return Plan("created", top.id, None, sim)

    @staticmethod
    def _messages(content: str, offered: Mapping[str, Similar], band: str) -> list[ChatMessage]:
        def clip(text: str, truncated: bool) -> str:
            return text[:PROMPT_CHARS] + (" […]" if truncated or len(text) > PROMPT_CHARS else "")

        existing = "\n\n".join(
            f'[id: "{alias}"] (similarity {c.score:.2f})\n{clip(c.content, c.truncated)}' for alias, c in offered.items()
        )
        instructions = COMBINED if band == "flag" else CONTRADICTION
        user = f"{instructions}\n\nNEW memory:\n{clip(content, False)}\n\nEXISTING memories:\n{existing}"
        return [ChatMessage("system", SYSTEM), ChatMessage("user", user)]

