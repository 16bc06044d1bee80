"""The three storage ports, as narrow Protocols with frozen value types.

* ``SqlDatabase``: D1's semantics. One statement, or an atomic batch of statements, with positional
  parameters; rows plus meta. There is no BEGIN/COMMIT: a unit of work is one batch.
* ``VectorIndex``: Vectorize's semantics. upsert / query / get_by_ids / delete_by_ids, each vector in one
  namespace, metadata filters with ``$eq $ne $in $nin $lt $lte $gt $gte``.
* ``Embedder``: texts -> float32 unit vectors, with the model id and dimensions it produces.

Services never see these directly with an organization id in hand: they receive handles bound to one
organization (``OrgSql``, ``OrgVectors`` in ``services.scoped``), made by ``for_org(org_id)``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

__all__ = [
    "SqlValue",
    "Statement",
    "SqlResult",
    "SqlDatabase",
    "Vector",
    "VectorMatch",
    "VectorIndexInfo",
    "VectorIndex",
    "Embedder",
    "ChatMessage",
    "LLMResult",
    "LLM",
    "Reranker",
]

SqlValue = str | int | float | bytes | None


@dataclass(frozen=True, slots=True)
class Statement:
    """One SQL statement with positional parameters (``?`` or ``?NNN``)."""

    sql: str
    params: tuple[SqlValue, ...] = ()


@dataclass(frozen=True, slots=True)
class SqlResult:
    """What one statement returned: rows as dicts, plus D1's meta fields."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    changes: int = 0
    last_row_id: int = 0


@runtime_checkable
class SqlDatabase(Protocol):
    """A SQLite-dialect database with D1's semantics."""

    async def execute(self, sql: str, params: Sequence[SqlValue] = ()) -> SqlResult:
        """Run one statement (in its own implicit transaction)."""
        ...

    async def batch(self, statements: Sequence[Statement]) -> list[SqlResult]:
        """Run statements in order, atomically: all of them take effect or none does."""
        ...

    async def executescript(self, sql: str) -> None:
        """Run a multi-statement script atomically (used for migrations)."""
        ...

    async def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class Vector:
    id: str
    values: np.ndarray | Sequence[float]
    namespace: str
    metadata: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class VectorMatch:
    id: str
    score: float
    namespace: str | None = None
    metadata: Mapping[str, Any] | None = None
    values: Sequence[float] | None = None


@dataclass(frozen=True, slots=True)
class VectorIndexInfo:
    dimensions: int
    vector_count: int
    model: str | None = None
    processed_up_to_mutation: str | None = None


@runtime_checkable
class VectorIndex(Protocol):
    """A vector index with Vectorize's semantics. Ids are index-global."""

    dimensions: int

    async def upsert(self, vectors: Sequence[Vector]) -> str | None:
        """Insert or replace vectors; returns a mutation id where the backend has one."""
        ...

    async def query(
        self,
        vector: np.ndarray | Sequence[float],
        *,
        top_k: int,
        namespace: str,
        filter: Mapping[str, Any] | None = None,
        return_metadata: bool = False,
        return_values: bool = False,
    ) -> list[VectorMatch]:
        """Nearest vectors by cosine similarity inside one namespace, best first."""
        ...

    async def get_by_ids(self, ids: Sequence[str]) -> list[Vector]: ...

    async def delete_by_ids(self, ids: Sequence[str]) -> str | None: ...

    async def info(self) -> VectorIndexInfo: ...

    async def close(self) -> None: ...


@runtime_checkable
class Embedder(Protocol):
    """Turns texts into L2-normalised float32 vectors.

    An embedder may also carry ``relevance_floor: float | None``: the cosine below which a query-text pair is
    weak evidence of relevance for this model (calibrated on data; services.search's relevance floor). Absent
    or None: no floor for this model's vector side.
    """

    model_id: str
    dimensions: int
    max_tokens: int

    def count_tokens(self, text: str) -> int:
        """Tokens the model would see for ``text`` (without special tokens)."""
        ...

    async def embed(self, texts: Sequence[str]) -> np.ndarray:
        """Shape (len(texts), dimensions), float32, each row of unit length."""
        ...


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: str  # system | user | assistant
    content: str


@dataclass(frozen=True, slots=True)
class LLMResult:
    """A JSON-mode completion: the parsed object plus the tokens it cost (for per-organization budgets)."""

    data: Any
    prompt_tokens: int = 0
    completion_tokens: int = 0


@runtime_checkable
class LLM(Protocol):
    """A chat model answering in JSON (Workers AI llama-3.1-8b, any OpenAI-compatible endpoint)."""

    model_id: str

    async def complete_json(
        self, messages: Sequence[ChatMessage], *, schema: Mapping[str, Any], max_tokens: int = 512,
        temperature: float = 0.2,
    ) -> LLMResult:
        """Raises BackendError when the model cannot be reached or does not answer in JSON."""
        ...


@runtime_checkable
class Reranker(Protocol):
    """Scores (query, passage) pairs; higher is more relevant."""

    model_id: str

    async def rerank(self, query: str, passages: Sequence[str]) -> list[float]:
        """One score per passage, in the passages' order."""
        ...
