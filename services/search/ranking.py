"""Ranking after fusion (memory-layer-lessons): relevance x recency x frequency x importance x penalty.

Applied by ``services.search.search.Search`` on the hydrated hits, after fusion and the per-parent de-duplication
(over-fetched by 3), after the optional reranker, before the top-k cut. Relevance decides; the other
factors are bounded multipliers that reorder near-ties and cannot lift a weak match over a clearly better one:

* relevance: the fused score (convex combination of normalised BM25 and cosine, services.search.fusion), or the
  reranker's score when a reranker ran.
* recency: ``1 - RECENCY_SPAN * (1 - 0.5 ** (age / half_life))``, in [0.92, 1.0]: 1.0 now, 0.96 after one
  half-life, 0.92 for the very old. Half-lives by class: 7 days for a task, 90 for work, 180 for context; the
  class comes from the tags (and metadata ``type``/``kind``/``category``): any task-like tag -> task; else any
  context tag -> context; else work. Age is from the thought's ``updated_at``. (The seed's ``exp(-age /
  halfLife)`` used as a plain multiplier put a year-old note at 0.02 of a new one: an exact old answer lost to
  any fresh loose match.)
* frequency: deliberate use only, never searches (a search that raised the scores of what it returned made
  the next, unrelated searches return the same notes: SciFact nDCG@10 fell from 74 to 51.6 with that default).
  A use is a thought fetched by id (``GET /v1/thoughts/{id}``, MCP ``get_thought``; once an hour per thought,
  so polling is one use) or marked used (``POST /v1/thoughts/{id}/used``, MCP ``mark_used``; every time).
  Uses decay with a 30-day half-life (``uses_now``, the decayed count) and saturate:
  ``1 + USE_SPAN * (1 - 0.5 ** (uses_now / USE_SATURATION))``, in [1.0, 1.05]
  (one fresh use 1.016, two 1.025, ten 1.048; the cap is 1.05 however often a note is used). Uses are stored as
  ``documents.use_weight``, the sum over uses of ``2 ** ((t_use - USE_EPOCH) / half-life)``; the decayed count
  at ``now`` is ``use_weight * 2 ** (-(now - USE_EPOCH) / half-life)``. Adding a use is one additive UPDATE
  (atomic on D1 too, no read-modify-write), and no timer has to age the counts. Writes are coalesced in process
  and flushed in the background, one UPDATE per organization.
* importance: a model's 1-5 judgement -> ``1 + IMPORTANCE_SPAN * (level - 3) / 2``, in [0.97, 1.03]; NULL, 0
  or the deterministic enrichment's keyword heuristic (``enrichment_state = 'extractive'``) -> 1.0 (shown in
  explain, not applied).
* penalty: short entries (fewer than 5 words: "done", "see above") x 0.85; rolled-up entries (metadata
  ``rollup: true`` or ``type``/``kind`` ``rollup``/``digest``, or a ``rollup``/``roll-up``/``digest`` tag:
  they repeat their sources, which should rank first) x 0.8; both multiply. Penalties only lower.

The multipliers together lie in [0.92 * 0.97, 1.05 * 1.03] = [0.892, 1.082]: a hit can overtake another only
when its relevance is within a factor 1.082 / 0.892 = 1.21 of it (penalties aside).

Conversation hits get recency only (context class, age from the newest message of the hit): they have no
uses or importance, and their windows are built, not appended, so no penalty.

With ``explain``, each hit's ``explain`` object carries every part; ``score`` is exactly
``relevance * recency * frequency * importance * penalty`` (multiplied in that order, not rounded).

The reranker's results are cached per (organization, query, candidate set) for an hour, in process.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from services.ids import now_ms
from services.models import SearchHit
from services.storage.scoped import OrgSql

__all__ = [
    "RankingConfig", "Ranking", "UseRecorder", "RerankCache", "recency", "frequency", "importance",
    "decay_class", "penalty", "is_rollup", "uses_now", "use_weight", "TASK_TAGS", "CONTEXT_TAGS",
    "RECENCY_SPAN", "USE_SPAN", "USE_SATURATION", "USE_HALF_LIFE_DAYS", "IMPORTANCE_SPAN", "FEATURE_NAMES",
    "feature_columns", "RANKING_FEATURES",
]

log = logging.getLogger("memex.ranking")

#: What the ranking stage reads of a thought (from ``documents``). A hydrator that reads them with its hits sets
#: them on each hit as the private attribute ``RANKING_FEATURES`` (a dict of these columns), sparing the stage its
#: read (on D1 an API request per search).
FEATURE_NAMES = ("id", "updated_at", "use_weight", "use_count", "last_used_at", "importance", "enrichment_state",
                 "chars")


def feature_columns(table: str = "", chunk: str | None = None) -> str:
    """The select list of ``FEATURE_NAMES`` from ``documents`` (``table``: the alias it has in the statement).

    ``chars`` (what the short-thought penalty asks: is the thought at most 200 characters?) is the length of the
    thought's only chunk, its trimmed text, and NULL when it has more than one (a chunk holds up to ~250 tokens: a
    thought of two is far longer). ``length(content)`` read the whole document, every overflow page of it: at 30
    hits of 40,000 words that was ~6 ms of a search (bench/README.md). The chunk subquery reads two chunk rows at
    most, by the ``chunks_by_parent`` index.

    ``chunk``: the alias of a chunk of the same thought that the statement reads anyway (a hit's own chunk). The
    thought has one chunk when no other is in ``chunks_by_parent``, which the index alone answers, and its length
    is then that chunk's: no other chunk's row is read (the subquery above reads up to two per hit: for 30 hits on a
    cold SQLite cache at 100,000 chunks, 2.6 -> 1.5 ms; bench/README.md)."""
    at = f"{table}." if table else ""
    outer = at or "documents."
    features = ", ".join(at + name for name in FEATURE_NAMES[:-1])
    if chunk is not None:
        return features + (
            f", CASE WHEN {chunk}.kind = 'thought' AND {chunk}.parent_id = {outer}id AND NOT EXISTS (SELECT 1 FROM "
            f"chunks fc WHERE fc.organization_id = {outer}organization_id AND fc.kind = 'thought' AND fc.parent_id = "
            f"{outer}id AND fc.ordinal <> {chunk}.ordinal) THEN length({chunk}.content) END AS chars")
    return features + (
        ", (SELECT CASE WHEN count(*) = 1 THEN length(max(f.content)) END FROM (SELECT fc.content FROM chunks fc "
        f"WHERE fc.organization_id = {outer}organization_id AND fc.kind = 'thought' AND fc.parent_id = {outer}id "
        "ORDER BY fc.ordinal LIMIT 2) AS f) AS chars")


RANKING_FEATURES = "_ranking_features"

DAY_MS = 86_400_000
LN2 = math.log(2.0)

TASK_TAGS = frozenset(
    "task tasks todo todos to-do action-item action-items reminder reminders deadline deadlines due follow-up "
    "follow-ups next-step next-steps chore chores errand errands checklist".split()
)
CONTEXT_TAGS = frozenset(
    "context background preference preferences profile personal bio biography identity about-me person people "
    "family relationship relationships values habit habits reference fact facts".split()
)
ROLLUP_MARKS = frozenset(("rollup", "roll-up", "digest"))

#: Most recency can take off: a very old note scores 0.92 of a new one with the same relevance.
RECENCY_SPAN = 0.08
#: Most use can add: a heavily used note scores at most 1.05 of an unused one.
USE_SPAN = 0.05
#: Decayed uses at which half of USE_SPAN is reached.
USE_SATURATION = 2.0
#: Uses lose half their weight in this many days.
USE_HALF_LIFE_DAYS = 30.0
#: Importance 5 multiplies by 1 + IMPORTANCE_SPAN, importance 1 by 1 - IMPORTANCE_SPAN.
IMPORTANCE_SPAN = 0.03
#: The origin of use weights (2026-01-01 UTC). Weights grow by 2 ** 12 a year: float64 holds them for ~80 years.
USE_EPOCH_MS = 1_767_225_600_000


@dataclass(frozen=True)
class RankingConfig:
    task_half_life_days: float = 7.0
    work_half_life_days: float = 90.0
    context_half_life_days: float = 180.0
    task_tags: frozenset[str] = TASK_TAGS
    context_tags: frozenset[str] = CONTEXT_TAGS
    #: Fewer words than this is a short entry.
    short_words: int = 5
    short_penalty: float = 0.85
    rollup_penalty: float = 0.8
    #: Seconds a reranker's result is reused for the same query and candidates.
    rerank_cache_seconds: float = 3600.0

    def half_life_days(self, cls: str) -> float:
        return {"task": self.task_half_life_days, "context": self.context_half_life_days}.get(cls, self.work_half_life_days)


# -- the multipliers (pure) ------------------------------------------------------------------------

def recency(age_ms: float, half_life_days: float) -> float:
    """``1 - RECENCY_SPAN * (1 - 0.5 ** (age / half-life))``: 1.0 now, 0.96 after one half-life, towards 0.92.
    Future timestamps count as now."""
    if half_life_days <= 0:
        return 1.0
    decayed = math.exp(-LN2 * max(0.0, age_ms) / (half_life_days * DAY_MS))
    return 1.0 - RECENCY_SPAN * (1.0 - decayed)


def use_weight(at_ms: int) -> float:
    """What one use at ``at_ms`` adds to ``documents.use_weight``."""
    return 2.0 ** ((at_ms - USE_EPOCH_MS) / (USE_HALF_LIFE_DAYS * DAY_MS))


def uses_now(weight: float | None, now_ms_: int) -> float:
    """The decayed number of uses at ``now_ms_`` (each use counts 1 when fresh, 0.5 a half-life later)."""
    if not weight:
        return 0.0
    return float(weight) * 2.0 ** (-(now_ms_ - USE_EPOCH_MS) / (USE_HALF_LIFE_DAYS * DAY_MS))


def frequency(uses: float | None) -> float:
    """``1 + USE_SPAN * (1 - 0.5 ** (uses / USE_SATURATION))``: 1.0 unused, saturating at 1.05."""
    return 1.0 + USE_SPAN * (1.0 - 0.5 ** (max(0.0, uses or 0.0) / USE_SATURATION))


def importance(level: int | None) -> float:
    """1-5 -> 0.97-1.03; unknown (NULL) or 0 -> 1.0."""
    if not level:
        return 1.0
    level = min(5, max(1, int(level)))
    return 1.0 + IMPORTANCE_SPAN * (level - 3) / 2


def _marks(tags: Iterable[str], metadata: Mapping[str, Any] | None) -> set[str]:
    out = {t.lower() for t in tags if isinstance(t, str)}
    for key in ("type", "kind", "category"):
        v = (metadata or {}).get(key)
        if isinstance(v, str):
            out.add(v.lower())
    return out


def decay_class(tags: Iterable[str], metadata: Mapping[str, Any] | None, config: RankingConfig) -> str:
    marks = _marks(tags, metadata)
    if marks & config.task_tags or any(m.startswith(("task-", "todo-")) for m in marks):
        return "task"
    if marks & config.context_tags:
        return "context"
    return "work"


def is_rollup(tags: Iterable[str], metadata: Mapping[str, Any] | None) -> bool:
    return (metadata or {}).get("rollup") is True or bool(_marks(tags, metadata) & ROLLUP_MARKS)


def penalty(words: int | None, rollup: bool, config: RankingConfig) -> tuple[float, list[str]]:
    factor, why = 1.0, []
    if words is not None and words < config.short_words:
        factor *= config.short_penalty
        why.append("short")
    if rollup:
        factor *= config.rollup_penalty
        why.append("rollup")
    return factor, why


# -- uses -------------------------------------------------------------------------------------------

class UseRecorder:
    """Records deliberate uses of thoughts (fetched by id, marked used) in ``documents.use_weight`` /
    ``use_count`` / ``last_used_at``, in the background: one UPDATE per organization per flush, ``delay``
    seconds after the first use (coalescing bursts). Searches never record anything here.

    A thought fetched by id counts once per ``fetch_window_seconds`` (in this process): a client polling a
    thought's indexing state, or re-reading it, is one use, not hundreds. Marking used always counts."""

    def __init__(self, sql_for: Callable[[str], Awaitable[OrgSql]], *, delay: float = 0.5, clock: Callable[[], int] = now_ms,
                 fetch_window_seconds: float = 3600.0, max_fetches_remembered: int = 100_000) -> None:
        self.sql_for = sql_for  # organization id -> its database, bound to it
        self.delay = delay
        self.clock = clock
        self.fetch_window_ms = fetch_window_seconds * 1000
        self.max_fetches_remembered = max_fetches_remembered
        self._pending: dict[str, dict[str, list[float]]] = {}  # org -> doc -> [weight, count, last]
        self._fetched: OrderedDict[tuple[str, str], int] = OrderedDict()  # (org, doc) -> when a fetch last counted
        self._task: asyncio.Task | None = None

    def add(self, org_id: str, doc_ids: Sequence[str], *, fetched: bool = False) -> None:
        now = self.clock()
        if fetched:
            doc_ids = [d for d in doc_ids if self._first_fetch(org_id, d, now)]
        if not doc_ids:
            return
        weight = use_weight(now)
        pending = self._pending.setdefault(org_id, {})
        for doc_id in doc_ids:
            entry = pending.setdefault(doc_id, [0.0, 0, now])
            entry[0] += weight
            entry[1] += 1
            entry[2] = now
        if self._task is None or self._task.done():
            try:
                self._task = asyncio.get_running_loop().create_task(self._later(), name="memex-use-flush")
            except RuntimeError:  # no running loop: recorded, written by the next flush()
                pass

    def _first_fetch(self, org_id: str, doc_id: str, now: int) -> bool:
        key = (org_id, doc_id)
        last = self._fetched.get(key)
        if last is not None and now - last < self.fetch_window_ms:
            return False
        self._fetched[key] = now
        self._fetched.move_to_end(key)
        while len(self._fetched) > self.max_fetches_remembered:
            self._fetched.popitem(last=False)
        return True

    async def _later(self) -> None:
        # Uses added while a flush is writing find this task still running (so they schedule nothing): flush
        # again until nothing is pending.
        while True:
            await asyncio.sleep(self.delay)
            await self.flush()
            if not self._pending:
                return

    async def flush(self) -> None:
        pending, self._pending = self._pending, {}
        for org_id, uses in pending.items():
            try:
                await (await self.sql_for(org_id)).execute(
                    "UPDATE documents SET "
                    "use_weight = use_weight + "
                    "(SELECT json_extract(j.value, '$[0]') FROM json_each(?2) AS j WHERE j.key = documents.id), "
                    "use_count = use_count + "
                    "(SELECT json_extract(j.value, '$[1]') FROM json_each(?2) AS j WHERE j.key = documents.id), "
                    "last_used_at = (SELECT json_extract(j.value, '$[2]') FROM json_each(?2) AS j WHERE j.key = documents.id) "
                    "WHERE organization_id = ?1 AND id IN (SELECT key FROM json_each(?2))",
                    [json.dumps(uses)],
                )
            except Exception:  # a lost use is not worth failing anything for
                log.warning("uses for %s not written", org_id, exc_info=True)

    async def close(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
        await self.flush()


# -- reranker cache ---------------------------------------------------------------------------------

Rerank = Callable[[str, list[SearchHit]], Awaitable[list[SearchHit]]]


class RerankCache:
    """The reranker's output (which hits, in which order, with which scores) per (organization, query, the
    ordered candidate set), for ``ttl`` seconds, in process."""

    def __init__(self, *, ttl: float = 3600.0, max_entries: int = 4096, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl = ttl
        self.max_entries = max_entries
        self.clock = clock
        self._entries: OrderedDict[tuple, tuple[float, list[tuple[str, float]]]] = OrderedDict()
        self.hits = 0
        self.misses = 0

    async def run(self, org_id: str, query: str, hits: list[SearchHit], rerank: Rerank) -> list[SearchHit]:
        key = (org_id, query, tuple((h.kind, h.chunk_id) for h in hits))
        found = self._entries.get(key)
        if found is not None and self.clock() - found[0] <= self.ttl:
            self.hits += 1
            self._entries.move_to_end(key)
            by_id = {h.chunk_id: h for h in hits}
            out = []
            for chunk_id, score in found[1]:
                h = by_id[chunk_id]
                h.score = score
                out.append(h)
            return out
        self.misses += 1
        out = await rerank(query, hits)
        self._entries[key] = (self.clock(), [(h.chunk_id, h.score) for h in out])
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
        return out


# -- the stage --------------------------------------------------------------------------------------

@dataclass
class Ranking:
    """The ranking stage of one deployment (shared by every organization's Search)."""

    config: RankingConfig = field(default_factory=RankingConfig)
    uses: UseRecorder | None = None
    rerank_cache: RerankCache | None = None
    clock: Callable[[], int] = now_ms

    async def apply(
        self, sql: OrgSql, query: str, hits: list[SearchHit], *, explain: bool = False, rerank: Rerank | None = None,
    ) -> list[SearchHit]:
        """Rerank (cached) when a reranker is given, multiply every hit's score by its parts, sort best first."""
        reranked: dict[str, float] = {}
        if rerank is not None and hits:
            before = {h.chunk_id: h.score for h in hits}
            if self.rerank_cache is not None:
                hits = await self.rerank_cache.run(sql.org_id, query, hits, rerank)
            else:
                hits = await rerank(query, hits)
            reranked = {h.chunk_id: h.score for h in hits if h.chunk_id in before}
            fused_of = before
        else:
            fused_of = {h.chunk_id: h.score for h in hits}
        features = await self._features(sql, [h for h in hits if h.kind == "thought"])
        now = self.clock()
        cfg = self.config
        for h in hits:
            relevance = h.score
            if h.kind == "thought":
                f = features.get(h.document_id, {})
                updated = f.get("updated_at") or h.created_at
                cls = decay_class(h.tags, h.metadata, cfg)
                rec = recency(now - updated, cfg.half_life_days(cls))
                used = uses_now(f.get("use_weight"), now)
                freq = frequency(used)
                judged = f.get("enrichment_state") != "extractive"  # a model's importance, or one set by hand
                imp = importance(f.get("importance")) if judged else 1.0
                chars = f.get("chars")
                words = len(h.chunk_content.split()) if chars is not None and chars <= 200 else None
                pen, why = penalty(words, is_rollup(h.tags, h.metadata), cfg)
                parts = {"recency_class": cls, "uses": f.get("use_count") or 0, "uses_now": round(used, 6),
                         "last_used_at": f.get("last_used_at"),
                         "importance_level": f.get("importance"),
                         "importance_source": f.get("enrichment_state") if f.get("importance") else None,
                         "penalties": why}
            else:  # conversation windows: recency only, from the window's newest message
                cls = "context"
                stamps = [m.get("created_at") for m in (h.messages or []) if isinstance(m.get("created_at"), int)]
                updated = max(stamps) if stamps else h.created_at
                rec = recency(now - updated, cfg.half_life_days(cls))
                freq = imp = pen = 1.0
                parts = {"recency_class": cls}
            score = relevance * rec * freq * imp * pen
            h.score = score
            if explain:
                h.explain = {
                    **(h.explain or {}),
                    **parts,
                    "fused": fused_of.get(h.chunk_id),
                    "rerank": reranked.get(h.chunk_id),
                    "relevance": relevance,
                    "age_days": round(max(0, now - updated) / DAY_MS, 3),
                    "half_life_days": cfg.half_life_days(cls),
                    "recency": rec,
                    "frequency": freq,
                    "importance": imp,
                    "penalty": pen,
                    "score": score,
                    "formula": "score = relevance * recency * frequency * importance * penalty",
                }
        hits.sort(key=lambda h: h.score, reverse=True)
        return hits

    async def _features(self, sql: OrgSql, hits: list[SearchHit]) -> dict[str, dict[str, Any]]:
        """The thought hits' ranking features by document id: those their hydrator read with them
        (``RANKING_FEATURES``, no round trip), the others read now."""
        out: dict[str, dict[str, Any]] = {}
        for h in hits:
            found = getattr(h, RANKING_FEATURES, None)
            if found is not None:
                out[h.document_id] = found
        doc_ids = {h.document_id for h in hits} - set(out)
        if not doc_ids:
            return out
        rows = await sql.rows(
            "SELECT " + feature_columns() + " FROM documents "
            "WHERE organization_id = ?1 AND id IN (SELECT value FROM json_each(?2))",
            [json.dumps(sorted(doc_ids))],
        )
        out.update((r["id"], r) for r in rows)
        return out

    def used(self, org_id: str, doc_ids: Sequence[str], *, fetched: bool = False) -> None:
        """Record deliberate uses of these thoughts (written in the background); ``fetched``: read by id
        (counted once an hour per thought)."""
        if self.uses is not None:
            self.uses.add(org_id, list(doc_ids), fetched=fetched)
