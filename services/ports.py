"""The ports, as complete Protocols with frozen value types.

* ``SqlDatabase``: D1's semantics. One statement, or an atomic batch of statements, with positional
  parameters; rows plus meta. There is no BEGIN/COMMIT: a unit of work is one batch.
* ``VectorIndex``: Vectorize's semantics. upsert / query / get_by_ids / delete_by_ids, each vector in one
  namespace, metadata filters with ``$eq $ne $in $nin $lt $lte $gt $gte``.
* ``Embedder``: texts -> float32 unit vectors, with the model id and dimensions it produces.
* ``LLM`` and ``Reranker``: the optional models (a JSON-mode chat model, a second-stage reranker).

Every adapter implements every member of its port, so services call them directly and never probe for a
method: where a backend has nothing to do (a checkpoint on D1) or cannot answer (listing a Vectorize
namespace) the member says so (a no-op, None). The composition root checks each adapter it builds with
``require`` and refuses one that lacks a member. ``wait_searchable`` polls an index until a write is visible.

Services never see these directly with an organization id in hand: they receive handles bound to one
organization (``OrgSql``, ``OrgVectors`` in ``services.storage.scoped``), made by ``for_org(org_id)``.
"""

from __future__ import annotations

import asyncio
import time
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, runtime_checkable

import numpy as np

from services.errors import InvalidInput, MemexError

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
    "model_input_tokens",
    "ChatMessage",
    "LLMResult",
    "LLM",
    "Reranker",
    "missing_members",
    "require",
    "wait_searchable",
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

    async def checkpoint(self) -> None:
        """Fold a write-ahead log into the database and truncate it (the worker calls it when space returns
        after a full disk). A database without a local log (D1) does nothing."""
        ...

    def free_bytes(self) -> int | None:
        """Free space on the file system holding the database; None when unknown or not local (D1)."""
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
    #: True when a write becomes visible to queries some time after the call returns (Vectorize): the worker
    #: then records the mutation id and confirms it with ``searchable``. False: visible on return.
    applies_writes_later: bool

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

    async def searchable(self, mutation_id: str | None, *, issued_at: float | None = None) -> bool:
        """Whether the write that returned ``mutation_id`` (and every earlier one) is visible to queries.
        ``issued_at`` (epoch seconds) is when it was written, for ids the index cannot order. An index that
        applies writes synchronously always answers True."""
        ...

    async def ids_in_namespace(self, namespace: str) -> set[str] | None:
        """Every vector id stored in ``namespace`` (reconciling the SQL store against the index); None when
        the backend cannot list a namespace (Vectorize)."""
        ...

    async def checkpoint(self) -> None:
        """Fold a local write-ahead log into the index file and truncate it; remote indexes do nothing."""
        ...

    def free_bytes(self) -> int | None:
        """Free space on the file system holding the index; None when unknown or not local."""
        ...

    async def close(self) -> None: ...


@runtime_checkable
class Embedder(Protocol):
    """Turns texts into L2-normalised float32 vectors."""

    model_id: str
    dimensions: int
    max_tokens: int
    #: The cosine below which a query-text pair is weak evidence of relevance for this model (calibrated on
    #: data; services.search.relevance's floor). None: no floor for this model's vector side.
    relevance_floor: float | None

    def count_tokens(self, text: str) -> int:
        """Tokens the model would see for ``text`` (without special tokens)."""
        ...

    async def embed(self, texts: Sequence[str]) -> np.ndarray:
        """Shape (len(texts), dimensions), float32, each row of unit length."""
        ...

    async def embed_query(self, text: str) -> np.ndarray:
        """A search query -> shape (dimensions,), float32, unit length. A model without a query-specific
        mode embeds the text as a document (``embed([text])[0]``)."""
        ...


def model_input_tokens(embedder: Embedder, text: str) -> int:
    """Tokens a model run on ``text`` sees: its own and [CLS]/[SEP], truncated at the embedder's ``max_tokens``."""
    return min(embedder.count_tokens(text) + 2, embedder.max_tokens)


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

    async def aclose(self) -> None:
        """Release what the adapter owns (its own HTTP client); nothing when it borrows the backend's."""
        ...


@runtime_checkable
class Reranker(Protocol):
    """Scores (query, passage) pairs; higher is more relevant."""

    model_id: str

    async def rerank(self, query: str, passages: Sequence[str]) -> list[float]:
        """One score per passage, in the passages' order."""
        ...

    async def aclose(self) -> None:
        """Release what the adapter owns; nothing when it borrows the backend's HTTP client."""
        ...


T = TypeVar("T")


def missing_members(obj: object, protocol: type) -> list[str]:
    """The members of the runtime-checkable ``protocol`` that ``obj`` lacks (sorted; empty: it implements it)."""
    if isinstance(obj, protocol):
        return []
    # the member list isinstance itself checks (typing keeps no public accessor for it)
    attrs = typing._get_protocol_attrs(protocol)  # type: ignore[attr-defined]
    return sorted(name for name in attrs if not hasattr(obj, name))


def require(obj: T, protocol: type, what: str, *, error: type[MemexError] = InvalidInput) -> T:
    """``obj`` when it implements every member of ``protocol``; else raises ``error`` naming ``what`` (the
    adapter) and the missing members. The composition root calls it on each adapter it builds (with
    ``error=SettingsError``)."""
    missing = missing_members(obj, protocol)
    if missing:
        raise error(
            f"{what} does not implement the {protocol.__name__} port: missing {', '.join(missing)}",
            details={"adapter": what, "port": protocol.__name__, "missing": missing},
        )
    return obj


async def wait_searchable(index: VectorIndex, mutation_id: str | None, timeout: float = 30.0, *,
                          issued_at: float | None = None) -> bool:
    """Poll ``index.searchable`` with backoff until ``mutation_id`` is applied; False when ``timeout`` seconds
    pass first (at once True for an index that applies writes synchronously)."""
    deadline = time.monotonic() + timeout
    delay = 0.1
    while True:
        if await index.searchable(mutation_id, issued_at=issued_at):
            return True
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        await asyncio.sleep(min(delay, left))
        delay = min(delay * 1.6, 2.0)
