"""The enrichment backfill (``Backfill``): two passes over the rows without enrichment (state NULL, failed or
skipped, and no enrich job pending), resumable from a checkpoint row (``enrichment_backfill``):
    pass 1 enriches them with no vocabulary anchor and keeps only their tags, as a vocabulary seed;
    pass 2 enriches them again with the vocabulary-aware prompt (the organization's tags and the seed) and
    persists the result. A spent budget stops a batch where it is; the next call resumes there.

It runs an organization's ``Enricher`` (services.enrichment.enrichment) over those rows, a batch per call
(``POST /v1/admin/backfill/enrich``, ``memex enrich backfill``).
"""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass, field

import msgspec

from services.enrichment.enrichment import ENRICH_JOB, Enricher, Enrichment
from services.errors import InvalidInput
from services.ids import now_ms

__all__ = ["Backfill", "EnrichBackfillResult"]

_NEEDS = "(enrichment_state IS NULL OR enrichment_state IN ('failed', 'skipped_budget'))"
_CURSOR = re.compile(r"^([12]):([0-9A-Za-z_-]{0,64})$")


class EnrichBackfillResult(msgspec.Struct, kw_only=True):
    #: 1: seeding the vocabulary (nothing persisted), 2: persisting, 3: finished.
    phase: int
    #: Documents handled by this call (both passes).
    processed: int
    #: Documents whose enrichment was persisted by this call (pass 2).
    enriched: int
    #: Documents whose enrichment failed in pass 2 (stored empty, state failed).
    failed: int
    #: Documents still to handle in the current pass.
    remaining: int
    #: Tags pass 1 collected so far (the vocabulary seed).
    seed_tags: int
    #: Pass and last document handled ("2:<id>"); pass it back to resume from there. Null when finished.
    cursor: str | None
    done: bool
    #: Why the call stopped early: "budget" (the daily LLM budget is spent) or "concurrent" (another run
    #: moved the checkpoint), else null.
    stopped: str | None = None


@dataclass(slots=True)
class _Checkpoint:
    phase: int
    cursor: str
    seed: dict[str, int] = field(default_factory=dict)
    processed: int = 0


class Backfill:
    """One organization's backfill, through its ``Enricher``."""

    def __init__(self, enricher: Enricher) -> None:
        self.enricher = enricher
        self.sql = enricher.sql

    async def pending_count(self) -> int:
        """Rows the backfill would enrich (no enrichment, and no enrich job pending)."""
        row = await self.sql.one(
            f"SELECT COUNT(*) AS n FROM documents WHERE organization_id = ?1 AND {_NEEDS} "
            "AND NOT EXISTS (SELECT 1 FROM jobs WHERE jobs.organization_id = ?1 AND jobs.kind = ?2 "
            "AND jobs.target_id = documents.id AND jobs.state = 'pending')",
            [ENRICH_JOB],
        )
        return int(row["n"]) if row else 0

    async def _targets(self, after: str, limit: int) -> list[dict]:
        return await self.sql.rows(
            f"SELECT id, content FROM documents WHERE organization_id = ?1 AND {_NEEDS} AND id > ?2 "
            "AND NOT EXISTS (SELECT 1 FROM jobs WHERE jobs.organization_id = ?1 AND jobs.kind = ?3 "
            "AND jobs.target_id = documents.id AND jobs.state = 'pending') ORDER BY id LIMIT ?4",
            [after, ENRICH_JOB, limit],
        )

    async def _remaining(self, after: str) -> int:
        row = await self.sql.one(
            f"SELECT COUNT(*) AS n FROM documents WHERE organization_id = ?1 AND {_NEEDS} AND id > ?2 "
            "AND NOT EXISTS (SELECT 1 FROM jobs WHERE jobs.organization_id = ?1 AND jobs.kind = ?3 "
            "AND jobs.target_id = documents.id AND jobs.state = 'pending')",
            [after, ENRICH_JOB],
        )
        return int(row["n"]) if row else 0

    async def left(self) -> int:
        """Document-passes the backfill has left from its checkpoint (for a progress bar): two per row to
        enrich on a new run, fewer part-way."""
        cp = await self._load()
        pending = await self.pending_count()
        if cp is None or cp.phase >= 3:
            return 2 * pending
        if cp.phase == 1:
            return await self._remaining(cp.cursor) + pending
        return await self._remaining(cp.cursor)

    async def _load(self) -> _Checkpoint | None:
        row = await self.sql.one(
            "SELECT pass, cursor, seed, processed FROM enrichment_backfill WHERE organization_id = ?1"
        )
        if row is None:
            return None
        try:
            seed = {str(k): int(v) for k, v in json.loads(row["seed"] or "{}").items()}
        except (ValueError, TypeError, AttributeError):
            seed = {}
        return _Checkpoint(int(row["pass"]), row["cursor"] or "", seed, int(row["processed"] or 0))

    async def _start(self) -> _Checkpoint:
        now = now_ms()
        await self.sql.execute(
            "INSERT INTO enrichment_backfill (organization_id, pass, cursor, seed, processed, started_at, updated_at) "
            "VALUES (?1, 1, '', '{}', 0, ?2, ?2) ON CONFLICT(organization_id) DO UPDATE SET "
            "pass = 1, cursor = '', seed = '{}', processed = 0, started_at = ?2, updated_at = ?2",
            [now],
        )
        return _Checkpoint(1, "")

    async def _save(self, old: tuple[int, str], cp: _Checkpoint) -> bool:
        """Move the checkpoint from ``old`` (pass, cursor) to ``cp``; False when another run moved it first."""
        seed = dict(sorted(cp.seed.items(), key=lambda kv: (-kv[1], kv[0]))[:500])
        res = await self.sql.execute(
            "UPDATE enrichment_backfill SET pass = ?2, cursor = ?3, seed = ?4, processed = ?5, updated_at = ?6 "
            "WHERE organization_id = ?1 AND pass = ?7 AND cursor = ?8",
            [cp.phase, cp.cursor, json.dumps(seed), cp.processed, now_ms(), old[0], old[1]],
        )
        return res.changes > 0

    async def run(self, *, batch_size: int = 50, cursor: str | None = None, restart: bool = False) -> EnrichBackfillResult:
        """Handle up to ``batch_size`` documents of the two-pass backfill, from the stored checkpoint (or from
        ``cursor``, "<pass>:<last id>"); call again until ``done``."""
        if not 1 <= batch_size <= 1000:
            raise InvalidInput("batch_size must be 1-1000", details={"field": "batch_size"})
        override = None
        if cursor is not None:
            m = _CURSOR.match(cursor)
            if not m:
                raise InvalidInput("cursor must be '<pass>:<document id>' as returned", details={"field": "cursor"})
            override = (int(m.group(1)), m.group(2))
        cp = await self._load()
        if cp is None or restart:
            cp = await self._start()
        elif cp.phase >= 3 and override is None:
            if await self.pending_count() == 0:
                return EnrichBackfillResult(phase=3, processed=0, enriched=0, failed=0, remaining=0,
                                            seed_tags=len(cp.seed), cursor=None, done=True)
            cp = await self._start()  # new rows to enrich since the last run: a new run
        if override is not None and (override[0], override[1]) != (cp.phase, cp.cursor):
            stored = (cp.phase, cp.cursor)
            cp.phase, cp.cursor = override
            if not await self._save(stored, cp):
                cp = await self._load() or cp
        processed = enriched = failed = 0
        stopped: str | None = None
        slots = batch_size
        sem = asyncio.Semaphore(max(1, self.enricher.config.concurrency))

        async def compute(content: str, vocab: list[str]) -> Enrichment:
            async with sem:
                return await self.enricher.compute(content, vocab)

        while slots > 0 and cp.phase in (1, 2):
            old = (cp.phase, cp.cursor)
            rows = await self._targets(cp.cursor, slots)
            if not rows:
                cp.phase, cp.cursor = cp.phase + 1, ""
                if not await self._save(old, cp):
                    stopped = "concurrent"
                    break
                continue
            vocab = [] if cp.phase == 1 else await self.enricher.vocabulary(cp.seed)
            outcomes = await asyncio.gather(*(compute(r["content"], vocab) for r in rows))
            done_rows: list[tuple[dict, Enrichment]] = []
            for r, e in zip(rows, outcomes, strict=True):
                if e.state == "skipped_budget":
                    stopped = "budget"
                    break
                done_rows.append((r, e))
            if cp.phase == 1:
                for _, e in done_rows:
                    for t in e.tags:
                        cp.seed[t] = cp.seed.get(t, 0) + 1
            else:
                await self.enricher.persist_many([(r["id"], e) for r, e in done_rows])
                enriched += sum(e.state != "failed" for _, e in done_rows)
                failed += sum(e.state == "failed" for _, e in done_rows)
            if done_rows:
                cp.cursor = done_rows[-1][0]["id"]
                cp.processed += len(done_rows)
                processed += len(done_rows)
                if not await self._save(old, cp):
                    stopped = "concurrent"
                    break
            if stopped:
                break
            slots -= len(rows)
        finished = cp.phase >= 3
        return EnrichBackfillResult(
            phase=min(cp.phase, 3), processed=processed, enriched=enriched, failed=failed,
            remaining=0 if finished else await self._remaining(cp.cursor), seed_tags=len(cp.seed),
            cursor=None if finished else f"{cp.phase}:{cp.cursor}", done=finished, stopped=stopped,
        )
