"""``VectorIndex`` through the data-plane Worker's Vectorize binding (``vec.*`` ops), with the REST adapter's rules.

* One index shared by every organization, one namespace per organization (``services.storage.scoped`` adds the
  ``organization_id`` metadata filter and the id prefix), as on the REST path (``vectorize.py``).
* ``upsert``/``delete_by_ids`` send at most 1,000 vectors or ids per op and return the last ``mutation_id``;
  writes apply later (``applies_writes_later``); ``searchable`` reads ``vec.info``'s
  ``processed_up_to_mutation`` (cached ``info_max_age`` seconds) and orders ids with the REST adapter's
  ``MutationLog``.
* ``query`` plans like the REST adapter: ``top_k`` <= 100; above 20 with metadata it asks for ``"indexed"``
  metadata and fetches, with ``vec.get``, only the matches whose indexed strings may have been cut at 64 bytes.
  ``get_by_ids`` sends its ids 100 per op, every op in one request.
* A call of one op goes through ``WorkerClient.run``: in the job worker's rounds (``services.background``) it shares
  a request with the round's other ops (the decisions' queries of a round: ``query_concurrency`` at once).
* The index's dimensions are checked once, on first use, against the embedder's (``EmbeddingModelMismatch``); the
  Worker does not expose the index's description, so the model recorded there is not checked on this path
  (``memex cloudflare check`` reads it over the REST API, which remains for setup).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from services.errors import BackendError, EmbeddingModelMismatch, InvalidInput
from services.ports import Vector, VectorIndexInfo, VectorMatch

from .mutations import AsyncWrites
from .vectorize import (
    check_query,
    MAX_ID_BYTES,
    MAX_METADATA_BYTES,
    MAX_NAMESPACE_BYTES,
    MAX_TOP_K_WITH_DATA,
    _check_name,
    _maybe_cut,
    _unit_rows,
)
from .worker_client import WorkerClient, WorkerOpError

__all__ = ["WorkerVectorIndex", "WRITE_BATCH", "GET_BATCH"]

WRITE_BATCH = 1000
GET_BATCH = 100
#: Vector ops per request when one call needs several (each op <= 1,000 vectors of 768 floats: ~10 MB of JSON).
OPS_PER_REQUEST = 2


def _mutation_ids(results: list[dict[str, Any]]) -> list[str | None]:
    """The mutation ids of a request's ``vec.*`` write ops, in order (``AsyncWrites._write``)."""
    return [r.get("mutation_id") for r in results]


def _values(rows: np.ndarray) -> list[list[float]]:
    # 8 decimals: finer than float32 for unit vectors, and about half the JSON of a float's full repr
    return np.round(rows.astype(np.float64), 8).tolist()


class WorkerVectorIndex(AsyncWrites):
    """One Vectorize index reached through the Worker (cosine; namespace = organization)."""

    applies_writes_later = True
    #: Queries a round of the job worker may have in flight at once (services.thoughts.deferred): the client
    #: coalesces a background round's concurrent ops, so they share requests.
    query_concurrency = 32

    def __init__(self, client: WorkerClient, name: str, *, dimensions: int, model: str, info_max_age: float = 1.0,
                 settle_seconds: float = 30.0) -> None:
        if not name:
            raise InvalidInput("a Vectorize index name is required for the Worker backend")
        self.client = client
        self.name = name
        self.dimensions = dimensions
        self.model = model
        self._init_writes(info_max_age=info_max_age, settle_seconds=settle_seconds)
        self._verified = False

    def __repr__(self) -> str:
        return f"WorkerVectorIndex({self.name!r})"

    # -- plumbing ------------------------------------------------------------------------------------------------

    async def _send(self, ops: list[dict[str, Any]], *, idempotent: bool = True) -> list[dict]:
        out: list[dict] = []
        try:
            if len(ops) == 1:  # one op: ``run`` (it may share a request with other ops of a background round)
                return [await self.client.run(ops[0], idempotent=idempotent)]
            for start in range(0, len(ops), OPS_PER_REQUEST):
                group = ops[start:start + OPS_PER_REQUEST]
                results = await self.client.send(group, idempotent=idempotent)
                for i, (op, res) in enumerate(zip(group, results, strict=True)):
                    out.append(self.client.raise_for(op["op"], res, start + i))
        except WorkerOpError as err:
            if err.op_code == "unknown_index":
                raise BackendError(
                    f"the Worker has no Vectorize binding for the index {self.name!r}: bind it in wrangler.toml "
                    "(or set CLOUDFLARE_VECTORIZE_INDEX to the index the Worker binds)",
                    details={"index": self.name}) from err
            raise
        return out

    async def verify(self) -> None:
        """Refuse an index of other dimensions than the embedder's (once per process)."""
        if self._verified:
            return
        info = await self.info()
        if info.dimensions and info.dimensions != self.dimensions:
            raise EmbeddingModelMismatch(
                f"Vectorize index {self.name!r} holds {info.dimensions}-dimensional vectors; the embedder {self.model} "
                f"makes {self.dimensions}: use another index (and `memex reindex`)",
                details={"index": self.name, "index_dimensions": info.dimensions, "dimensions": self.dimensions,
                         "model": self.model})
        self._verified = True

    # -- writes --------------------------------------------------------------------------------------------------

    async def upsert(self, vectors: Sequence[Vector]) -> str | None:
        """Insert or replace whole vectors; the last mutation id (writes apply asynchronously)."""
        if not vectors:
            return None
        last: dict[str, int] = {}
        for i, v in enumerate(vectors):
            _check_name("id", v.id, MAX_ID_BYTES)
            _check_name("namespace", v.namespace, MAX_NAMESPACE_BYTES)
            last[v.id] = i
        keep = [vectors[i] for i in sorted(last.values())]
        rows = _values(_unit_rows([v.values for v in keep], self.dimensions))
        items = []
        for v, values in zip(keep, rows, strict=True):
            meta = dict(v.metadata or {})
            try:
                size = len(_json_size(meta))
            except (TypeError, ValueError) as exc:
                raise InvalidInput(f"vector metadata is not JSON: {exc}", details={"id": v.id}) from exc
            if size > MAX_METADATA_BYTES:
                raise InvalidInput(f"vector metadata is over {MAX_METADATA_BYTES} bytes", details={"id": v.id})
            items.append({"id": v.id, "values": values, "namespace": v.namespace, "metadata": meta})
        await self.verify()
        ops = [{"op": "vec.upsert", "index": self.name, "vectors": items[i:i + WRITE_BATCH]}
               for i in range(0, len(items), WRITE_BATCH)]
        return await self._write(self._send(ops), _mutation_ids)

    async def delete_by_ids(self, ids: Sequence[str]) -> str | None:
        """Delete by (index-global) id; unknown ids are ignored. The last mutation id."""
        ids = list(dict.fromkeys(i for i in ids if isinstance(i, str) and i))
        if not ids:
            return None
        ops = [{"op": "vec.delete", "index": self.name, "ids": ids[i:i + WRITE_BATCH]}
               for i in range(0, len(ids), WRITE_BATCH)]
        return await self._write(self._send(ops), _mutation_ids)

    # -- reads ---------------------------------------------------------------------------------------------------

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
        """Nearest vectors inside ``namespace`` (cosine, best first), filtered on indexed metadata."""
        check_query(top_k, namespace)
        q = _values(_unit_rows([vector], self.dimensions))[0]
        await self.verify()
        wide = top_k > MAX_TOP_K_WITH_DATA
        fetch: str | None
        if return_values and wide:
            mode, values_in_query, fetch = "none", False, "all"
        elif return_metadata and wide:
            mode, values_in_query, fetch = "indexed", False, "cut"
        else:
            mode, values_in_query, fetch = ("all" if return_metadata else "none"), return_values, None
        op: dict[str, Any] = {"op": "vec.query", "index": self.name, "vector": q, "top_k": top_k, "namespace": namespace,
                              "return_metadata": mode, "return_values": values_in_query}
        if filter:
            op["filter"] = dict(filter)
        (res,) = await self._send([op])
        raw = [m for m in res.get("matches") or [] if isinstance(m, dict) and "id" in m]
        full: dict[str, Vector] = {}
        if fetch == "all" and raw:
            full = {v.id: v for v in await self.get_by_ids([m["id"] for m in raw])}
        elif fetch == "cut":
            cut = [m["id"] for m in raw if _maybe_cut(m.get("metadata"))]
            if cut:
                full = {v.id: v for v in await self.get_by_ids(cut)}
        out = []
        for m in raw:
            got = full.get(m["id"])
            meta, values = m.get("metadata"), m.get("values")
            if got is not None:
                meta = dict(got.metadata)
                values = got.values if return_values else None
            out.append(VectorMatch(
                id=m["id"], score=float(m.get("score", 0.0)),
                namespace=m["namespace"] if m.get("namespace") is not None else (got.namespace if got else None),
                metadata=(meta if meta is not None else {}) if return_metadata else None,
                values=list(values) if (return_values and values is not None) else None,
            ))
        return out

    async def get_by_ids(self, ids: Sequence[str]) -> list[Vector]:
        """Stored vectors, in the order asked; unknown ids are omitted."""
        ids = list(dict.fromkeys(i for i in ids if isinstance(i, str) and i))
        if not ids:
            return []
        ops = [{"op": "vec.get", "index": self.name, "ids": ids[i:i + GET_BATCH]} for i in range(0, len(ids), GET_BATCH)]
        found: dict[str, Vector] = {}
        for res in await self._send(ops):
            for item in res.get("vectors") or []:
                if isinstance(item, dict) and "id" in item:
                    found[item["id"]] = Vector(id=item["id"], values=np.asarray(item.get("values") or [], dtype=np.float32),
                                               namespace=item.get("namespace"), metadata=item.get("metadata") or {})
        return [found[i] for i in ids if i in found]

    async def info(self) -> VectorIndexInfo:
        (res,) = await self._send([{"op": "vec.info", "index": self.name}])
        return self._fresh(VectorIndexInfo(dimensions=int(res.get("dimensions") or self.dimensions),
                                           vector_count=int(res.get("vector_count") or 0), model=None,
                                           processed_up_to_mutation=res.get("processed_up_to_mutation")))

    async def ids_in_namespace(self, namespace: str) -> None:
        """None: Vectorize cannot list one namespace."""

    async def checkpoint(self) -> None:
        """Nothing to do: no local write-ahead log."""

    def free_bytes(self) -> int | None:
        return None

    async def close(self) -> None:
        """Nothing to release: the client belongs to the backend."""


def _json_size(meta: dict[str, Any]) -> bytes:
    return json.dumps(meta, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()
