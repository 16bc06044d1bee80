"""The Vectorize v2 adapter: the ``VectorIndex`` port over ``/accounts/{a}/vectorize/v2/indexes/{name}``.

Writes
    ``upsert`` sends NDJSON (``Content-Type: application/x-ndjson``, one vector per line) in requests of at
    most 5,000 vectors and 50 MB; repeated ids keep their last occurrence. Vectors are L2-normalised before
    sending (the index is cosine: same ranking, and ``get_by_ids`` returns unit rows like the embedded
    index) and written as integer-mantissa JSON numbers (``123456789e-9``: valid JSON, 1e-9 precision,
    fast to format; big upserts are formatted off the event loop). Ids (<= 64 bytes), namespaces (<= 64
    bytes) and metadata (<= 10 KiB) are checked before sending. ``delete_by_ids`` sends at most 1,000 ids
    a request. Both return the *last* ``mutationId``: Vectorize applies mutations in order, so once that
    one is processed, all of the call's are.

Asynchronous writes
    Every ``mutationId`` this process receives is recorded with when its request was sent and when its
    response came (``MutationLog``, in ``services.adapters.cloudflare.mutations``). ``searchable(mutation_id)``
    reads ``/info`` (cached for ``info_max_age`` seconds, so many callers cost one request) and answers whether
    ``processedUpToMutation`` has passed that mutation: equal to it, or a mutation this process sent after this
    one's response came back, or — for writes that were in flight together, ids of other instances or of a
    previous run — a later UUIDv7 (ids of that version sort by time).
    Opaque foreign ids cannot be ordered; for those, ``issued_at`` (epoch seconds, e.g. stored by the
    worker) lets the answer become True once ``processedUpToMutation`` has moved and ``settle_seconds``
    have passed (Vectorize applies writes "typically within a few seconds"). ``wait_for(mutation_id,
    timeout)`` polls with backoff until ``searchable``.

Queries
    ``topK`` is at most 100, and at most 20 when values or full metadata are returned. ``query`` picks the
    cheapest plan for what the caller asked:

    * no metadata, no values: one request, ``returnMetadata: "none"``, top_k <= 100;
    * metadata, top_k <= 20: one request, ``returnMetadata: "all"``;
    * metadata, top_k > 20 (hybrid search asks for up to 100): one request with ``returnMetadata:
      "indexed"`` — the fields we filter on (organization_id, kind, parent_id) are metadata-indexed, and
      those are what search reads; the other fields (ordinal, start_sequence, ...) are not returned. Indexed
      strings are cut at 64 bytes: a match whose indexed string is 64 bytes or longer (possibly cut) has its
      full metadata fetched with ``get_by_ids`` (one more request, only then). ``wide_metadata="fetch"``
      instead always fetches full metadata with ``get_by_ids`` (two requests). The alternative — paging
      topK 20 with ``"all"`` — cannot page (there is no offset), so it could never return more than 20;
    * values: top_k <= 20 in one request; above, one ``"none"`` query plus one ``get_by_ids``.

Model record
    Vectorize keeps no free-form index metadata except the ``description`` given at creation (immutable).
    Memex writes ``memex:model=<embedder model id>`` there (``create_index`` / ``memex cloudflare check
    --fix``; ``wrangler vectorize create ... --description "memex:model=@cf/baai/bge-base-en-v1.5:mean"``).
    On first use the adapter reads the index once: other dimensions, a non-cosine metric or another
    recorded model raise ``EmbeddingModelMismatch`` before any vector is written or queried. An index
    without the tag (created by hand) is accepted on dimensions alone, with a warning, and ``info().model``
    is None.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import quote

import numpy as np

from services.errors import BackendError, EmbeddingModelMismatch, InvalidInput
from services.ports import Vector, VectorIndexInfo, VectorMatch

from .client import CloudflareApi, CloudflareNotFound
from .mutations import AsyncWrites

__all__ = [
    "VectorizeIndex",
    "MetadataIndexReport",
    "INDEXED_PROPERTIES",
    "MAX_VECTORS_PER_WRITE",
    "MAX_TOP_K",
    "MAX_TOP_K_WITH_DATA",
    "model_description",
    "model_from_description",
]

log = logging.getLogger("memex.cloudflare.vectorize")

MAX_VECTORS_PER_WRITE = 5000
MAX_WRITE_BYTES = 50 * 1024 * 1024  # the API takes 100 MB: stay well inside it
MAX_TOP_K = 100
MAX_TOP_K_WITH_DATA = 20
MAX_ID_BYTES = 64
MAX_NAMESPACE_BYTES = 64
MAX_METADATA_BYTES = 10 * 1024
INDEXED_STRING_BYTES = 64
GET_BATCH = 100
DELETE_BATCH = 1000
#: Metadata properties Memex queries filter on, created before any write (``memex cloudflare check --fix``): every
#: query's organization, chunk kind and parent; a knowledge entry's knowledge base and the seed's filterable fields
#: (services.search.indexing.KNOWLEDGE_FIELDS; tests/test_kb_sync.py checks the two agree). 9 of Vectorize's 10.
INDEXED_PROPERTIES: dict[str, str] = {"organization_id": "string", "kind": "string", "parent_id": "string",
                                      "kb": "string", "contentType": "string", "group": "string", "release": "string",
                                      "status": "string", "date": "number"}

_MODEL_TAG = re.compile(r"memex:model=(\S+)")


def model_description(model_id: str, dimensions: int) -> str:
    return f"memex:model={model_id} dims={dimensions}"


def model_from_description(description: str | None) -> str | None:
    m = _MODEL_TAG.search(description or "")
    return m.group(1) if m else None


class MetadataIndexReport(dict):
    """``{"present": [...], "created": [...], "wrong_type": {...}, "mutation_id": str | None}``"""


def _mutation_id(response: Any) -> list[str | None]:
    """The mutation id a REST write's result carries (``AsyncWrites._write``)."""
    return [(response or {}).get("mutationId")]


def _check_name(kind: str, value: Any, limit: int) -> str:
    if not isinstance(value, str) or not value:
        raise InvalidInput(f"vector {kind} must be a non-empty string")
    if len(value.encode()) > limit:
        raise InvalidInput(f"vector {kind} is longer than {limit} bytes", details={kind: value[:80]})
    return value


def _ndjson_lines(vectors: Sequence[Vector], rows: np.ndarray) -> list[bytes]:
    """One NDJSON line per vector. Values are written as integers with a ``e-9`` exponent (valid JSON
    numbers, 1e-9 absolute precision: finer than float32 for unit vectors), about 3x faster than
    formatting floats and ~40% smaller than Python's float repr."""
    scaled = np.rint(rows.astype(np.float64) * 1e9).astype(np.int64)
    lines: list[bytes] = []
    for v, ints in zip(vectors, scaled, strict=True):
        try:
            meta_json = json.dumps(dict(v.metadata or {}), separators=(",", ":"), ensure_ascii=False, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise InvalidInput(f"vector metadata is not JSON: {exc}", details={"id": v.id}) from exc
        if len(meta_json.encode()) > MAX_METADATA_BYTES:
            raise InvalidInput(f"vector metadata is over {MAX_METADATA_BYTES} bytes", details={"id": v.id})
        line = (
            '{"id":' + json.dumps(v.id, ensure_ascii=False)
            + ',"namespace":' + json.dumps(v.namespace, ensure_ascii=False)
            + ',"values":[' + "e-9,".join(map(str, ints.tolist())) + "e-9]"
            + ',"metadata":' + meta_json + "}"
        )
        lines.append(line.encode())
    return lines


def _unit_rows(values: Sequence[Any], dims: int) -> np.ndarray:
    try:
        mat = np.asarray(values, dtype=np.float32)
    except (TypeError, ValueError) as exc:
        raise InvalidInput("vector values must be numbers") from exc
    if mat.ndim != 2 or mat.shape[1] != dims:
        got = mat.shape[-1] if mat.ndim >= 1 else 0
        raise InvalidInput(f"vectors: expected {dims} dimensions, got {got}", details={"dimensions": dims, "got": got})
    if not np.isfinite(mat).all():
        raise InvalidInput("vectors: values must be finite")
    norms = np.linalg.norm(mat.astype(np.float64), axis=1)
    if (norms == 0).any():
        raise InvalidInput("vectors: the zero vector has no direction")
    return (mat / norms[:, None]).astype(np.float32)


def check_query(top_k: Any, namespace: Any) -> None:
    """A Vectorize query's ``top_k`` (1 to MAX_TOP_K) and namespace (non-empty), over REST or through the Worker."""
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= MAX_TOP_K:
        raise InvalidInput(f"top_k must be an integer from 1 to {MAX_TOP_K}", details={"top_k": str(top_k)})
    if not isinstance(namespace, str) or not namespace:
        raise InvalidInput("query namespace must be a non-empty string")


class VectorizeIndex(AsyncWrites):
    """``VectorIndex`` over one Vectorize v2 index (cosine; namespace = organization).

    Writes apply later (``applies_writes_later``; ``searchable`` tells when). Vectorize cannot list one
    namespace (``ids_in_namespace`` is None; ``list_ids`` pages through the whole index), and it has no local
    log or disk (``checkpoint`` does nothing, ``free_bytes`` is None).
    """

    #: Vectorize applies mutations asynchronously, "typically within a few seconds".
    applies_writes_later = True

    def __init__(
        self,
        api: CloudflareApi,
        name: str,
        *,
        dimensions: int,
        model: str,
        wide_metadata: str = "indexed",
        info_max_age: float = 1.0,
        settle_seconds: float = 30.0,
    ) -> None:
        if not name:
            raise InvalidInput("CLOUDFLARE_VECTORIZE_INDEX is required for MEMEX_VECTORS=vectorize")
        if wide_metadata not in ("indexed", "fetch"):
            raise ValueError("wide_metadata must be 'indexed' or 'fetch'")
        self.api = api
        self.name = name
        self.dimensions = dimensions
        self.model = model
        self.wide_metadata = wide_metadata
        self._init_writes(info_max_age=info_max_age, settle_seconds=settle_seconds)
        self._base = f"vectorize/v2/indexes/{quote(name, safe='')}"
        self._described: dict[str, Any] | None = None
        self.recorded_model: str | None = None
        self._verified = False
        self._describe_lock = asyncio.Lock()

    # -- the index itself ----------------------------------------------------------------------------

    async def describe(self, *, refresh: bool = False) -> dict[str, Any]:
        """``GET /indexes/{name}`` (cached): name, description, config {dimensions, metric}."""
        if self._described is not None and not refresh:
            return self._described
        async with self._describe_lock:
            if self._described is None or refresh:
                try:
                    res = await self.api.call("vectorize", "GET", self._base, idempotent=True)
                except CloudflareNotFound as exc:
                    raise BackendError(
                        f"Vectorize index {self.name!r} does not exist: create it with "
                        f"`wrangler vectorize create {self.name} --dimensions={self.dimensions} --metric=cosine "
                        f"--description \"{model_description(self.model, self.dimensions)}\"` "
                        "(or `memex cloudflare check --fix`)",
                        details={"index": self.name},
                    ) from exc
                self._described = res if isinstance(res, dict) else {}
        return self._described

    async def verify(self) -> None:
        """Refuse an index made for another model (dimensions, metric, or the recorded model id)."""
        if self._verified:
            return
        desc = await self.describe()
        config = desc.get("config") or {}
        dims, metric = config.get("dimensions"), config.get("metric")
        recorded = model_from_description(desc.get("description"))
        details = {
            "index": self.name,
            "index_dimensions": dims,
            "index_metric": metric,
            "index_model": recorded,
            "model": self.model,
            "dimensions": self.dimensions,
        }
        if dims is not None and dims != self.dimensions:
            raise EmbeddingModelMismatch(
                f"Vectorize index {self.name!r} holds {dims}-dimensional vectors; the embedder "
                f"{self.model} makes {self.dimensions}: use another index (and `memex reindex`)",
                details=details,
            )
        if metric is not None and metric != "cosine":
            raise EmbeddingModelMismatch(
                f"Vectorize index {self.name!r} uses the {metric} metric; Memex needs cosine", details=details
            )
        if recorded is not None and recorded != self.model:
            raise EmbeddingModelMismatch(
                f"Vectorize index {self.name!r} was made for {recorded}, not {self.model}: use another index "
                "(and `memex reindex`)",
                details=details,
            )
        if recorded is None:
            log.warning(
                "Vectorize index %r does not record its embedding model (description %r); only its dimensions "
                "were checked", self.name, desc.get("description"),
            )
        self.recorded_model = recorded
        self._verified = True

    async def create_index(self, *, description: str | None = None) -> dict[str, Any]:
        """Create the index (cosine, our dimensions, the model recorded in its description)."""
        body = {
            "name": self.name,
            "description": description or model_description(self.model, self.dimensions),
            "config": {"dimensions": self.dimensions, "metric": "cosine"},
        }
        res = await self.api.call("vectorize", "POST", "vectorize/v2/indexes", json=body, idempotent=False)
        self._described = None
        self.recorded_model = None
        self._verified = False
        return res if isinstance(res, dict) else {}

    async def metadata_indexes(self) -> dict[str, str]:
        res = await self.api.call("vectorize", "GET", f"{self._base}/metadata_index/list", idempotent=True)
        items = (res or {}).get("metadataIndexes") or []
        return {i["propertyName"]: i.get("indexType", "") for i in items if isinstance(i, dict) and "propertyName" in i}

    async def ensure_metadata_indexes(
        self, properties: Mapping[str, str] | None = None, *, wait: float | None = 60.0
    ) -> MetadataIndexReport:
        """Create the string metadata indexes Memex filters on (organization_id, kind, parent_id) where
        missing, and wait (up to ``wait`` s) until Vectorize has applied them: vectors written before a
        metadata index exists are not filterable on it (they need re-upserting: ``memex reindex``)."""
        wanted = dict(properties or INDEXED_PROPERTIES)
        have = await self.metadata_indexes()
        report = MetadataIndexReport(present=[], created=[], wrong_type={}, mutation_id=None)
        for prop, typ in wanted.items():
            if prop in have:
                if have[prop] != typ:
                    report["wrong_type"][prop] = have[prop]
                else:
                    report["present"].append(prop)
                continue
            mid = await self._write(self.api.call(
                "vectorize", "POST", f"{self._base}/metadata_index/create",
                json={"propertyName": prop, "indexType": typ}, idempotent=False,
            ), _mutation_id)
            if mid:
                report["mutation_id"] = mid
            report["created"].append(prop)
        if report["mutation_id"] and wait:
            await self.wait_for(report["mutation_id"], timeout=wait)
        return report

    # -- writes --------------------------------------------------------------------------------------

    async def upsert(self, vectors: Sequence[Vector]) -> str | None:
        """Insert or replace whole vectors; returns the last mutation id (writes apply asynchronously)."""
        if not vectors:
            return None
        last: dict[str, int] = {}
        for i, v in enumerate(vectors):
            _check_name("id", v.id, MAX_ID_BYTES)
            _check_name("namespace", v.namespace, MAX_NAMESPACE_BYTES)
            last[v.id] = i
        keep = [vectors[i] for i in sorted(last.values())]
        rows = _unit_rows([v.values for v in keep], self.dimensions)
        if len(keep) > 256:  # formatting thousands of vectors takes a while: not on the event loop
            lines = await asyncio.to_thread(_ndjson_lines, keep, rows)
        else:
            lines = _ndjson_lines(keep, rows)
        await self.verify()
        mutation: str | None = None
        for chunk in _split_lines(lines, MAX_VECTORS_PER_WRITE, MAX_WRITE_BYTES):
            mutation = await self._write(self.api.call(
                "vectorize", "POST", f"{self._base}/upsert",
                content=b"\n".join(chunk) + b"\n",
                headers={"Content-Type": "application/x-ndjson"},
                idempotent=True,
            ), _mutation_id) or mutation
        return mutation

    async def delete_by_ids(self, ids: Sequence[str]) -> str | None:
        """Delete by (index-global) id; unknown ids are ignored. Returns the last mutation id."""
        ids = list(dict.fromkeys(i for i in ids if isinstance(i, str) and i))
        mutation: str | None = None
        for start in range(0, len(ids), DELETE_BATCH):
            mutation = await self._write(self.api.call(
                "vectorize", "POST", f"{self._base}/delete_by_ids",
                json={"ids": ids[start : start + DELETE_BATCH]}, idempotent=True,
            ), _mutation_id) or mutation
        return mutation

    # -- reads ---------------------------------------------------------------------------------------

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
        q = _unit_rows([vector], self.dimensions)[0]
        await self.verify()
        wide = top_k > MAX_TOP_K_WITH_DATA
        if return_values and wide:
            mode, values_in_query, fetch = "none", False, "all"
        elif return_metadata and wide:
            if self.wide_metadata == "indexed":
                mode, values_in_query, fetch = "indexed", False, "cut"
            else:
                mode, values_in_query, fetch = "none", False, "all"
        else:
            mode = "all" if return_metadata else "none"
            values_in_query, fetch = return_values, None
        body: dict[str, Any] = {
            "vector": [float(x) for x in q.tolist()],
            "topK": top_k,
            "namespace": namespace,
            "returnValues": values_in_query,
            "returnMetadata": mode,
        }
        if filter:
            body["filter"] = dict(filter)
        res = await self.api.call("vectorize", "POST", f"{self._base}/query", json=body, idempotent=True)
        raw = [m for m in (res or {}).get("matches") or [] if isinstance(m, dict) and "id" in m]
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
            meta = m.get("metadata")
            values = m.get("values")
            if got is not None:
                meta = dict(got.metadata)
                values = got.values if return_values else None
            out.append(
                VectorMatch(
                    id=m["id"],
                    score=float(m.get("score", 0.0)),
                    namespace=m["namespace"] if m.get("namespace") is not None else (got.namespace if got else None),
                    metadata=(meta if meta is not None else {}) if return_metadata else None,
                    values=list(values) if (return_values and values is not None) else None,
                )
            )
        return out

    async def get_by_ids(self, ids: Sequence[str]) -> list[Vector]:
        """Stored vectors, in the order asked; unknown ids are omitted."""
        ids = list(dict.fromkeys(i for i in ids if isinstance(i, str) and i))
        found: dict[str, Vector] = {}
        for start in range(0, len(ids), GET_BATCH):
            res = await self.api.call(
                "vectorize", "POST", f"{self._base}/get_by_ids", json={"ids": ids[start : start + GET_BATCH]},
                idempotent=True,
            )
            for item in res or []:
                if not isinstance(item, dict) or "id" not in item:
                    continue
                found[item["id"]] = Vector(
                    id=item["id"],
                    values=np.asarray(item.get("values") or [], dtype=np.float32),
                    namespace=item.get("namespace"),
                    metadata=item.get("metadata") or {},
                )
        return [found[i] for i in ids if i in found]

    async def list_ids(self, *, page_size: int = 1000):
        """Every vector id in the index (index-global), page by page: ``async for ids in index.list_ids()``.
        Costs one request per ``page_size`` ids — for maintenance (``memex reindex --prune``) only."""
        cursor: str | None = None
        while True:
            params: dict[str, Any] = {"count": page_size}
            if cursor:
                params["cursor"] = cursor
            res = await self.api.call("vectorize", "GET", f"{self._base}/list", params=params, idempotent=True) or {}
            ids = [v["id"] for v in res.get("vectors") or [] if isinstance(v, dict) and "id" in v]
            if ids:
                yield ids
            cursor = res.get("nextCursor")
            if not res.get("isTruncated") or not cursor:
                return

    async def info(self) -> VectorIndexInfo:
        """``/info``: dimensions, vector count, processedUpToMutation; the model recorded in the description."""
        res = await self.api.call("vectorize", "GET", f"{self._base}/info", idempotent=True) or {}
        processed = res.get("processedUpToMutation")
        if self._described is None:
            try:
                await self.describe()
            except BackendError:
                pass
        model = model_from_description((self._described or {}).get("description"))
        return self._fresh(VectorIndexInfo(
            dimensions=int(res.get("dimensions") or self.dimensions),
            vector_count=int(res.get("vectorCount") or 0),
            model=model,
            processed_up_to_mutation=processed,
        ))

    async def ids_in_namespace(self, namespace: str) -> None:
        """None: Vectorize cannot list the ids of one namespace (``list_ids`` pages through the whole index)."""

    async def checkpoint(self) -> None:
        """Nothing to do: there is no local write-ahead log."""

    def free_bytes(self) -> int | None:
        """None: the index is not on a local file system."""
        return None

    async def close(self) -> None:
        """Nothing to release: the shared HTTP client belongs to the backend."""


def _maybe_cut(meta: Any) -> bool:
    if not isinstance(meta, dict):
        return False
    for v in meta.values():
        if isinstance(v, str) and len(v.encode()) >= INDEXED_STRING_BYTES:
            return True
        if isinstance(v, dict) and _maybe_cut(v):
            return True
    return False


def _split_lines(lines: list[bytes], max_count: int, max_bytes: int):
    chunk: list[bytes] = []
    size = 0
    for line in lines:
        if chunk and (len(chunk) >= max_count or size + len(line) + 1 > max_bytes):
            yield chunk
            chunk, size = [], 0
        chunk.append(line)
        size += len(line) + 1
    if chunk:
        yield chunk
