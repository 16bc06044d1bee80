"""Ranking after fusion (memory-layer-lessons): relevance x recency x frequency x importance x penalty.

Applied by ``services.search.Search`` on the hydrated hits, after fusion and the per-parent de-duplication
(over-fetched by 3), after the optional reranker, before the top-k cut:

* relevance: the fused score (convex combination of normalised BM25 and cosine, services.search), or the reranker's score when a reranker ran.
* recency: ``exp(-ln 2 * age / half_life)`` = ``0.5 ** (age / half_life)``. The seed writes
  ``exp(-age / halfLife)``, which halves at ``ln 2 * halfLife`` (0.69 x the stated half-life) and is at 0.37
  after one "half-life"; we use the ln 2 scaling so a half-life means what it says: 0.5 after 7 days for a
  task, 90 for work, 180 for context. The class comes from the tags (and metadata ``type``/``kind``/
  ``category``): any task-like tag -> task; else any context tag -> context; else work. Age is from the
  thought's ``updated_at`` (a repeated capture of the same content refreshes it).
* frequency: ``1 + log1p(recall_count)``; ``recall_count`` is bumped for every thought a search returns in
  its first 10 results (``recall_top``: a client asking for 100 candidates to rerank itself is not recalling
  100 memories), off the response's path (counts are coalesced in process and written with one UPDATE per
  organization). ``recall_top = 0`` counts nothing, which leaves frequency at 1.0 (benchmarks: every query
  would otherwise change the scores of the next ones).
* importance: enrichment's 1-5 -> ``0.8 + importance / 5 * 0.4`` (0.88 - 1.20); NULL or 0 -> 1.0. Only a
  model's judgement counts (the seed's "separate LLM pass"): the deterministic enrichment's keyword heuristic
  (``enrichment_state = 'extractive'``) is shown in explain but multiplies by 1.0. Reciprocal-rank fusion
  puts neighbouring ranks ~1.6 % apart, so a +/-15 % heuristic would outrank relevance: measured here, a
  postmortem at cosine -0.02 rose above a gardening note at 0.41 for "growing vegetables outdoors" because
  the heuristic rated the postmortem 4 and the note 3.
* penalty: short entries (fewer than 5 words: "done", "see above") x 0.85; rolled-up entries (metadata
  ``rollup: true`` or ``type``/``kind`` ``rollup``/``digest``, or a ``rollup``/``roll-up``/``digest`` tag:
  they repeat their sources, which should rank first) x 0.8; both multiply.

Conversation windows get recency only (context class, age from the window's newest message): they have no
recall count or importance, and their windows are built, not appended, so no penalty.

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
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from services.ids import now_ms
from services.models import SearchHit
from services.ports import SqlDatabase
from services.scoped import OrgSql

__all__ = [
    "RankingConfig", "Ranking", "RecallCounter", "RerankCache", "recency", "frequency", "importance",
    "decay_class", "penalty", "is_rollup", "TASK_TAGS", "CONTEXT_TAGS",
]

log = logging.getLogger("memex.ranking")

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
    #: A search counts as a recall of the thoughts in its first ``recall_top`` results (0: none counted).
    recall_top: int = 10

    def half_life_days(self, cls: str) -> float:
        return {"task": self.task_half_life_days, "context": self.context_half_life_days}.get(cls, self.work_half_life_days)


# -- the multipliers (pure) ------------------------------------------------------------------------

def recency(age_ms: float, half_life_days: float) -> float:
    """0.5 ** (age / half-life): 1.0 now, 0.5 after one half-life. Future timestamps count as now."""
    if half_life_days <= 0:
        return 1.0
    return math.exp(-LN2 * max(0.0, age_ms) / (half_life_days * DAY_MS))


def frequency(recall_count: int | None) -> float:
    return 1.0 + math.log1p(max(0, recall_count or 0))


def importance(level: int | None) -> float:
    """1-5 -> 0.88-1.20; unknown (NULL) or 0 -> 1.0."""
    if not level:
        return 1.0
    level = min(5, max(1, int(level)))
    return 0.8 + (level / 5) * 0.4


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


# -- recall counts ----------------------------------------------------------------------------------

class RecallCounter:
    """Counts the thoughts searches return and adds them to ``documents.recall_count`` in the background:
    one UPDATE per organization per flush, ``delay`` seconds after the first count (coalescing bursts)."""

    def __init__(self, db: SqlDatabase, *, delay: float = 0.5) -> None:
        self.db = db
        self.delay = delay
        self._pending: dict[str, Counter[str]] = {}
        self._task: asyncio.Task | None = None

    def add(self, org_id: str, doc_ids: Sequence[str]) -> None:
        if not doc_ids:
            return
        self._pending.setdefault(org_id, Counter()).update(doc_ids)
        if self._task is None or self._task.done():
            try:
                self._task = asyncio.get_running_loop().create_task(self._later(), name="memex-recall-flush")
            except RuntimeError:  # no running loop: counted, written by the next flush()
                pass

    async def _later(self) -> None:
        await asyncio.sleep(self.delay)
        await self.flush()

    async def flush(self) -> None:
        pending, self._pending = self._pending, {}
        for org_id, counts in pending.items():
            try:
                await OrgSql(self.db, org_id).execute(
                    "UPDATE documents SET recall_count = recall_count + "
                    "(SELECT CAST(j.value AS INTEGER) FROM json_each(?2) AS j WHERE j.key = documents.id) "
                    "WHERE organization_id = ?1 AND id IN (SELECT key FROM json_each(?2))",
                    [json.dumps(dict(counts))],
                )
            except Exception:  # a lost count is not worth failing anything for
                log.warning("recall counts for %s not written", org_id, exc_info=True)

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
    recall: RecallCounter | None = None
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
        features = await self._features(sql, [h.document_id for h in hits if h.kind == "thought"])
        now = self.clock()
        cfg = self.config
        for h in hits:
            relevance = h.score
            if h.kind == "thought":
                f = features.get(h.document_id, {})
                updated = f.get("updated_at") or h.created_at
                cls = decay_class(h.tags, h.metadata, cfg)
                rec = recency(now - updated, cfg.half_life_days(cls))
                freq = frequency(f.get("recall_count"))
                judged = f.get("enrichment_state") != "extractive"  # a model's importance, or one set by hand
                imp = importance(f.get("importance")) if judged else 1.0
                chars = f.get("chars")
                words = len(h.chunk_content.split()) if chars is not None and chars <= 200 else None
                pen, why = penalty(words, is_rollup(h.tags, h.metadata), cfg)
                parts = {"recency_class": cls, "recall_count": f.get("recall_count") or 0,
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

    async def _features(self, sql: OrgSql, doc_ids: list[str]) -> dict[str, dict[str, Any]]:
        if not doc_ids:
            return {}
        rows = await sql.rows(
            "SELECT id, updated_at, recall_count, importance, enrichment_state, length(content) AS chars FROM documents "
            "WHERE organization_id = ?1 AND id IN (SELECT value FROM json_each(?2))",
            [json.dumps(sorted(set(doc_ids)))],
        )
        return {r["id"]: r for r in rows}

    def returned(self, org_id: str, hits: Sequence[SearchHit]) -> None:
        """Count the thoughts a search returned (written in the background)."""
        if self.recall is not None and self.config.recall_top > 0:
            self.recall.add(org_id, [h.document_id for h in hits[: self.config.recall_top] if h.kind == "thought"])
