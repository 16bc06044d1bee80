"""Handles bound to one organization: the only way services reach the stores.

``OrgSql`` wraps the organization's own database (services.storage: one database per organization), which
is the wall between tenants: a statement run through it cannot reach another organization's rows, whatever
it says. It also binds ``?1`` to the organization id in every statement, and every statement still filters
on ``organization_id = ?1``: defence in depth, and what keeps a row written in the wrong database invisible.
Services number their own parameters from ``?2``.

``OrgVectors`` puts every vector in the organization's namespace, stamps ``organization_id`` into its
metadata, filters every query on it, and prefixes vector ids with the organization id (Vectorize ids are
index-global), so get and delete by id can only ever touch the organization's own vectors.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from services.ports import SqlDatabase, SqlResult, SqlValue, Statement, Vector, VectorIndex, VectorMatch

__all__ = ["OrgSql", "OrgVectors", "bind_statement"]

_BARE_PARAM = re.compile(r"\?(?!\d)")


def bind_statement(org_id: str, sql: str, params: Sequence[SqlValue]) -> Statement:
    if _BARE_PARAM.search(sql):
        raise AssertionError(f"tenant statements number their parameters from ?2: {sql[:120]!r}")
    return Statement(sql, (org_id, *params))


@dataclass(frozen=True, slots=True)
class OrgSql:
    """A SqlDatabase handle for one organization: ``db`` is that organization's own database."""

    db: SqlDatabase
    org_id: str

    async def execute(self, sql: str, params: Sequence[SqlValue] = ()) -> SqlResult:
        st = bind_statement(self.org_id, sql, params)
        return await self.db.execute(st.sql, st.params)

    async def rows(self, sql: str, params: Sequence[SqlValue] = ()) -> list[dict[str, Any]]:
        return (await self.execute(sql, params)).rows

    def rows_now(self, sql: str, params: Sequence[SqlValue] = ()) -> list[dict[str, Any]] | None:
        """``rows`` at once on the event loop, where the database can (``read_now``: embedded SQLite, its reader for
        the loop not in use); else None, and the caller awaits ``rows``. Only for a statement the caller bounds to a
        few row lookups."""
        read = getattr(self.db, "read_now", None)
        if read is None:
            return None
        st = bind_statement(self.org_id, sql, params)
        result = read(st.sql, st.params)
        return result.rows if result is not None else None

    async def one(self, sql: str, params: Sequence[SqlValue] = ()) -> dict[str, Any] | None:
        rows = (await self.execute(sql, params)).rows
        return rows[0] if rows else None

    def stmt(self, sql: str, *params: SqlValue) -> Statement:
        return bind_statement(self.org_id, sql, params)

    async def batch(self, statements: Sequence[Statement]) -> list[SqlResult]:
        """Statements made with ``stmt()`` (already bound), run atomically."""
        for st in statements:
            if not st.params or st.params[0] != self.org_id:
                raise AssertionError("batch statements must be built with OrgSql.stmt()")
        return await self.db.batch(statements)


@dataclass(frozen=True, slots=True)
class OrgVectors:
    """A VectorIndex handle for one organization (namespace = organization id)."""

    index: VectorIndex
    org_id: str

    @property
    def dimensions(self) -> int:
        return self.index.dimensions

    def _vid(self, local_id: str) -> str:
        return f"{self.org_id}:{local_id}"

    def _local(self, vector_id: str) -> str | None:
        prefix = f"{self.org_id}:"
        return vector_id[len(prefix):] if vector_id.startswith(prefix) else None

    async def upsert(self, items: Sequence[tuple[str, np.ndarray, Mapping[str, Any]]]) -> str | None:
        vectors = [
            Vector(
                id=self._vid(local_id),
                values=values,
                namespace=self.org_id,
                metadata={**metadata, "organization_id": self.org_id},
            )
            for local_id, values, metadata in items
        ]
        return await self.index.upsert(vectors) if vectors else None

    async def query(
        self,
        vector: np.ndarray,
        *,
        top_k: int,
        filter: Mapping[str, Any] | None = None,
        return_metadata: bool = False,
    ) -> list[VectorMatch]:
        flt = {**(filter or {}), "organization_id": {"$eq": self.org_id}}
        matches = await self.index.query(
            vector, top_k=top_k, namespace=self.org_id, filter=flt, return_metadata=return_metadata
        )
        out = []
        for m in matches:
            local = self._local(m.id)
            if local is None or (m.namespace not in (None, self.org_id)):
                continue  # never trust a backend to have filtered: drop anything not ours
            out.append(VectorMatch(id=local, score=m.score, namespace=self.org_id, metadata=m.metadata))
        return out

    async def get_by_ids(self, local_ids: Sequence[str]) -> list[Vector]:
        found = await self.index.get_by_ids([self._vid(i) for i in local_ids])
        out = []
        for v in found:
            local = self._local(v.id)
            if local is not None and v.namespace == self.org_id:
                out.append(Vector(id=local, values=v.values, namespace=v.namespace, metadata=v.metadata))
        return out

    async def delete_by_ids(self, local_ids: Sequence[str]) -> str | None:
        if not local_ids:
            return None
        return await self.index.delete_by_ids([self._vid(i) for i in local_ids])
