"""The history of merged and replaced originals, and the links between thoughts (services.thoughts.decisions).

A merge or a replace moves the superseded original (and, for a merge, the incoming content) to
``thought_history`` under the canonical thought. Entries stay, restorable, until an explicit purge: deleting
the canonical thought keeps them (they are other content; reachable by the deleted id until purged). A
restore is a new capture through the normal write path (no write-time decision: the caller chose to bring it
back) and then removes the entry.
"""

from __future__ import annotations

import json
from typing import Any, Protocol

from services.errors import NotFound
from services.models import CaptureResult, Decision, HistoryEntry, ThoughtHistory, ThoughtLink
from services.storage.scoped import OrgSql

__all__ = ["ThoughtHistoryService", "Capture", "history_of", "links_of", "DETAIL_HISTORY"]

#: History entries shown on GET /v1/thoughts/{id} (all of them on /history).
DETAIL_HISTORY = 20
MAX_HISTORY = 500


def _entry(r: dict[str, Any]) -> HistoryEntry:
    return HistoryEntry(
        id=r["id"], thought_id=r["thought_id"], original_id=r["original_id"], action=r["action"], reason=r["reason"],
        content=r["content"], content_hash=r["content_hash"], source=r["source"],
        metadata=json.loads(r["metadata"] or "{}"), summary=r["summary"],
        tags=json.loads(r["tags"]) if r["tags"] else [],
        original_created_at=r["original_created_at"], original_updated_at=r["original_updated_at"],
        created_at=r["created_at"],
    )


async def history_of(sql: OrgSql, thought_id: str, *, limit: int = MAX_HISTORY) -> list[HistoryEntry]:
    rows = await sql.rows(
        "SELECT * FROM thought_history WHERE organization_id = ?1 AND thought_id = ?2 "
        "ORDER BY created_at DESC, id DESC LIMIT ?3",
        [thought_id, limit],
    )
    return [_entry(r) for r in rows]


async def links_of(sql: OrgSql, thought_id: str) -> list[ThoughtLink]:
    rows = await sql.rows(
        "SELECT from_id, to_id, kind, reason, created_at FROM thought_links "
        "WHERE organization_id = ?1 AND (from_id = ?2 OR to_id = ?2) ORDER BY created_at, from_id, to_id",
        [thought_id],
    )
    return [
        ThoughtLink(
            thought_id=r["to_id"] if r["from_id"] == thought_id else r["from_id"], kind=r["kind"],
            direction="outgoing" if r["from_id"] == thought_id else "incoming", reason=r["reason"],
            created_at=r["created_at"],
        )
        for r in rows
    ]


class Capture(Protocol):
    """What a restore needs of the thoughts service (``services.thoughts.thoughts.Thoughts``): its write path.
    History takes it through this instead of importing the service, which imports history."""

    async def capture(self, content: str, *, source: str | None = None, metadata: dict[str, Any] | None = None,
                      decide: bool = True) -> CaptureResult: ...


class ThoughtHistoryService:
    def __init__(self, sql: OrgSql, thoughts: Capture) -> None:
        self.sql = sql
        self.thoughts = thoughts

    async def _known(self, thought_id: str) -> None:
        """404 unless the thought exists or still has history entries (kept after its deletion)."""
        row = await self.sql.one(
            "SELECT EXISTS (SELECT 1 FROM documents WHERE organization_id = ?1 AND id = ?2) "
            "OR EXISTS (SELECT 1 FROM thought_history WHERE organization_id = ?1 AND thought_id = ?2) AS known",
            [thought_id],
        )
        if not row or not row["known"]:
            raise NotFound("thought not found", details={"id": thought_id})

    async def list(self, thought_id: str) -> ThoughtHistory:
        entries = await history_of(self.sql, thought_id)
        if not entries:
            await self._known(thought_id)
        return ThoughtHistory(thought_id=thought_id, entries=entries)

    async def _entry_row(self, thought_id: str, history_id: str) -> dict[str, Any]:
        row = await self.sql.one(
            "SELECT * FROM thought_history WHERE organization_id = ?1 AND id = ?2 AND thought_id = ?3",
            [history_id, thought_id],
        )
        if row is None:
            raise NotFound("history entry not found", details={"id": thought_id, "history_id": history_id})
        return row

    async def restore(self, thought_id: str, history_id: str) -> CaptureResult:
        """Recreate the original as a thought (a new id, unless the same content is stored already), then
        drop the entry. The entry goes only after the write succeeded."""
        row = await self._entry_row(thought_id, history_id)
        result = await self.thoughts.capture(
            row["content"], source=row["source"], metadata=json.loads(row["metadata"] or "{}"), decide=False
        )
        await self.sql.execute("DELETE FROM thought_history WHERE organization_id = ?1 AND id = ?2", [history_id])
        result.decision = Decision(
            action="created" if result.created else "duplicate",
            related_id=None if result.created else result.id,
            reason=f"restored from the history of {thought_id}" + ("" if result.created else "; the content was already stored"),
        )
        return result

    async def purge(self, thought_id: str, history_id: str | None = None) -> int:
        """Delete one entry, or all of a thought's; returns how many went."""
        if history_id is not None:
            await self._entry_row(thought_id, history_id)
            res = await self.sql.execute(
                "DELETE FROM thought_history WHERE organization_id = ?1 AND id = ?2 AND thought_id = ?3",
                [history_id, thought_id],
            )
            return res.changes
        await self._known(thought_id)
        res = await self.sql.execute(
            "DELETE FROM thought_history WHERE organization_id = ?1 AND thought_id = ?2", [thought_id]
        )
        return res.changes
