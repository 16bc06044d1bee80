"""Vectorize v2: indexes, asynchronous (lagged, ordered) mutations, exact brute-force queries."""

from __future__ import annotations

import json
import math
import os
import re
import secrets
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

import numpy as np

from .errors import VEC_BAD_REQUEST, VEC_CONFLICT, VEC_NOT_FOUND, CFError

MAX_DIMS = 1536
MAX_ID_BYTES = 64
MAX_NAMESPACE_BYTES = 64
MAX_NAME_BYTES = 64
MAX_METADATA_BYTES = 10 * 1024
MAX_VECTORS_PER_WRITE = 5000
MAX_METADATA_INDEXES = 10
MAX_TOPK = 100
MAX_TOPK_WITH_VALUES_OR_ALL_METADATA = 20
MAX_FILTER_BYTES = 2048
MAX_FILTER_KEY_CHARS = 512
INDEXED_STRING_BYTES = 64
METRICS = ("cosine", "euclidean", "dot-product")
INDEX_TYPES = ("string", "number", "boolean")
PRESETS = {
    "@cf/baai/bge-small-en-v1.5": (384, "cosine"),
    "@cf/baai/bge-base-en-v1.5": (768, "cosine"),
    "@cf/baai/bge-large-en-v1.5": (1024, "cosine"),
}
_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_-]*$")
_OPS = {"$eq", "$ne", "$in", "$nin", "$lt", "$lte", "$gt", "$gte"}


try:  # msgspec (a litestar dependency) parses big NDJSON bodies ~10x faster than json
    import msgspec as _msgspec

    _decoder = _msgspec.json.Decoder()

    def _loads(text: str) -> Any:
        try:
            return _decoder.decode(text)
        except _msgspec.DecodeError as e:
            raise ValueError(str(e)) from None
except ImportError:  # pragma: no cover
    _loads = json.loads


def bad(msg: str) -> CFError:
    return CFError(400, VEC_BAD_REQUEST, msg)


def _now_iso() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _truncate_utf8(s: str, n: int = INDEXED_STRING_BYTES) -> str:
    b = s.encode("utf-8")
    if len(b) <= n:
        return s
    return b[:n].decode("utf-8", errors="ignore")


class _MutationIds:
    """UUID-shaped ids (version-7 layout) that sort lexicographically in creation (= apply) order."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last_ms = 0
        self._seq = 0

    def next(self) -> str:
        with self._lock:
            ms = int(time.time() * 1000)
            if ms <= self._last_ms:
                ms = self._last_ms
                self._seq += 1
                if self._seq > 0xFFF:
                    ms += 1
                    self._seq = 0
            else:
                self._seq = 0
            self._last_ms = ms
            n = (ms & ((1 << 48) - 1)) << 80 | 0x7 << 76 | self._seq << 64 | 0b10 << 62 | secrets.randbits(62)
            h = f"{n:032x}"
            return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


MUTATION_IDS = _MutationIds()


@dataclass
class Vec:
    id: str
    values: np.ndarray
    namespace: str | None
    metadata: dict | None
    indexed: dict[str, Any]  # propertyName -> value, captured at write (apply) time


@dataclass
class Index:
    account: str
    name: str
    description: str
    dims: int
    metric: str
    created_on: str
    modified_on: str
    log_path: Path | None = None
    vectors: dict[str, Vec] = field(default_factory=dict)
    meta_indexes: dict[str, str] = field(default_factory=dict)    # applied
    declared_meta: dict[str, str] = field(default_factory=dict)   # applied + pending (for validation)
    pending: deque = field(default_factory=deque)                 # (mutation_id, apply_at, op)
    last_mutation: str | None = None
    last_applied_at: str | None = None
    version: int = 0
    _cache_version: int = -1
    _cache: tuple | None = None

    def describe(self) -> dict:
        return {
            "name": self.name,
            "description": self.description,
            "config": {"dimensions": self.dims, "metric": self.metric},
            "created_on": self.created_on,
            "modified_on": self.modified_on,
        }

    # -- applying mutations --------------------------------------------------------------------------
    def apply(self, mid: str, op: dict) -> None:
        kind = op["op"]
        if kind in ("insert", "upsert"):
            for raw in op["vectors"]:
                if kind == "insert" and raw["id"] in self.vectors:
                    continue  # insert keeps the existing vector
                md = raw.get("metadata")
                self.vectors[raw["id"]] = Vec(
                    id=raw["id"],
                    values=np.asarray(raw["values"], dtype=np.float64),
                    namespace=raw.get("namespace"),
                    metadata=md,
                    indexed=self._indexed_values(md),
                )
        elif kind == "delete":
            for vid in op["ids"]:
                self.vectors.pop(vid, None)
        elif kind == "mi_create":
            self.meta_indexes[op["propertyName"]] = op["indexType"]
        elif kind == "mi_delete":
            prop = op["propertyName"]
            self.meta_indexes.pop(prop, None)
            for v in self.vectors.values():
                v.indexed.pop(prop, None)
        self.last_mutation = mid
        self.last_applied_at = _now_iso()
        self.version += 1

    def _indexed_values(self, md: dict | None) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if not md:
            return out
        for prop, typ in self.meta_indexes.items():
            cur: Any = md
            found = True
            for part in prop.split("."):
                if isinstance(cur, dict) and part in cur:
                    cur = cur[part]
                else:
                    found = False
                    break
            if not found:
                continue
            if typ == "string" and isinstance(cur, str):
                out[prop] = _truncate_utf8(cur)
            elif typ == "number" and _is_number(cur):
                out[prop] = cur
            elif typ == "boolean" and isinstance(cur, bool):
                out[prop] = cur
        return out

    def catch_up(self, now: float | None = None, everything: bool = False) -> None:
        now = time.monotonic() if now is None else now
        while self.pending and (everything or self.pending[0][1] <= now):
            mid, _, op = self.pending.popleft()
            self.apply(mid, op)

    def matrix(self) -> tuple[list[Vec], np.ndarray, np.ndarray]:
        if self._cache_version != self.version or self._cache is None:
            order = [self.vectors[k] for k in sorted(self.vectors)]
            if order:
                mat = np.vstack([v.values for v in order])
            else:
                mat = np.zeros((0, self.dims))
            norms = np.linalg.norm(mat, axis=1) if len(order) else np.zeros(0)
            self._cache = (order, mat, norms)
            self._cache_version = self.version
        return self._cache  # type: ignore[return-value]


# ---------------------------------------------------------------------------------------------------------
# Filters
# ---------------------------------------------------------------------------------------------------------

def validate_filter(flt: Any) -> dict:
    if flt is None:
        return {}
    if not isinstance(flt, dict):
        raise bad("filter must be a JSON object")
    if len(json.dumps(flt, separators=(",", ":")).encode()) >= MAX_FILTER_BYTES:
        raise bad(f"filter must be smaller than {MAX_FILTER_BYTES} bytes as compact JSON")
    for key, cond in flt.items():
        if not key or len(key) > MAX_FILTER_KEY_CHARS or '"' in key or key.startswith("$"):
            raise bad(f"invalid filter key {key!r}")
        if isinstance(cond, dict):
            if not cond:
                raise bad(f"empty operator object for filter key {key!r}")
            lower = [op for op in cond if op in ("$gt", "$gte")]
            upper = [op for op in cond if op in ("$lt", "$lte")]
            if len(lower) > 1 or len(upper) > 1:
                raise bad(f"at most one lower and one upper bound per key ({key!r})")
            for op, val in cond.items():
                if op not in _OPS:
                    raise bad(f"unsupported filter operator {op!r}")
                if op in ("$in", "$nin"):
                    if not isinstance(val, list) or not all(_scalar(x) for x in val):
                        raise bad(f"{op} expects an array of strings, numbers or booleans")
                elif op in ("$lt", "$lte", "$gt", "$gte"):
                    if not (isinstance(val, str) or _is_number(val)):
                        raise bad(f"{op} expects a number or a string")
                elif not _scalar(val):
                    raise bad(f"{op} expects a string, number or boolean")
        elif not _scalar(cond):
            raise bad(f"invalid filter value for key {key!r}")
    return flt


def _scalar(v: Any) -> bool:
    return isinstance(v, (str, bool)) or _is_number(v)


def _norm(v: Any) -> Any:
    return _truncate_utf8(v) if isinstance(v, str) else v


def _eq(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, str) or isinstance(b, str):
        return isinstance(a, str) and isinstance(b, str) and a == _norm(b)
    return a == b


def _cmp_ok(a: Any, b: Any) -> bool:
    return (_is_number(a) and _is_number(b)) or (isinstance(a, str) and isinstance(b, str))


def matches_filter(vec: Vec, flt: dict) -> bool:
    for key, cond in flt.items():
        if key not in vec.indexed:
            return False  # not indexed when this vector was written (or wrong type / absent)
        val = vec.indexed[key]
        if not isinstance(cond, dict):
            cond = {"$eq": cond}
        for op, arg in cond.items():
            if op == "$eq":
                ok = _eq(val, arg)
            elif op == "$ne":
                ok = not _eq(val, arg)
            elif op == "$in":
                ok = any(_eq(val, x) for x in arg)
            elif op == "$nin":
                ok = not any(_eq(val, x) for x in arg)
            else:
                if not _cmp_ok(val, arg):
                    return False
                arg = _norm(arg)
                ok = {"$lt": val < arg, "$lte": val <= arg, "$gt": val > arg, "$gte": val >= arg}[op]
            if not ok:
                return False
    return True


def _nest(flat: dict[str, Any]) -> dict:
    out: dict = {}
    for key, val in flat.items():
        parts = key.split(".")
        cur = out
        for p in parts[:-1]:
            nxt = cur.get(p)
            if not isinstance(nxt, dict):
                nxt = cur[p] = {}
            cur = nxt
        cur[parts[-1]] = val
    return out


# ---------------------------------------------------------------------------------------------------------
# Store
# ---------------------------------------------------------------------------------------------------------

class VectorizeStore:
    def __init__(self, root: Path | None, lag_ms: Callable[[], float]):
        self.root = root
        self._lag_ms = lag_ms
        self.lock = threading.RLock()
        self.indexes: dict[tuple[str, str], Index] = {}
        if root is not None:
            self._load()

    # -- persistence (append-only mutation log per index; replayed on start) --------------------------
    def _log_path(self, account: str, name: str) -> Path | None:
        if self.root is None:
            return None
        return self.root / "vectorize" / account / f"{name}.jsonl"

    def _append(self, idx: Index, entry: dict) -> None:
        if idx.log_path is None:
            return
        idx.log_path.parent.mkdir(parents=True, exist_ok=True)
        line = json.dumps(entry, separators=(",", ":"),
                          default=lambda o: o.tolist() if isinstance(o, np.ndarray) else str(o))
        with open(idx.log_path, "a", encoding="utf-8") as f:
            f.write(line + "\n")

    def _load(self) -> None:
        base = self.root / "vectorize"  # type: ignore[operator]
        if not base.is_dir():
            return
        for acc_dir in base.iterdir():
            for log in sorted(acc_dir.glob("*.jsonl")):
                idx: Index | None = None
                with open(log, encoding="utf-8") as f:
                    for line in f:
                        if not line.strip():
                            continue
                        entry = json.loads(line)
                        if entry["op"] == "create":
                            idx = Index(account=acc_dir.name, name=entry["name"],
                                        description=entry.get("description", ""), dims=entry["dims"],
                                        metric=entry["metric"], created_on=entry["created_on"],
                                        modified_on=entry["created_on"], log_path=log)
                        elif idx is not None:
                            mid = entry.pop("mid")
                            if entry["op"] == "mi_create":
                                idx.declared_meta[entry["propertyName"]] = entry["indexType"]
                            elif entry["op"] == "mi_delete":
                                idx.declared_meta.pop(entry["propertyName"], None)
                            idx.apply(mid, entry)
                if idx is not None:
                    self.indexes[(acc_dir.name, idx.name)] = idx

    # -- helpers -------------------------------------------------------------------------------------
    def _get(self, account: str, name: str, catch_up: bool = True) -> Index:
        idx = self.indexes.get((account, name))
        if idx is None:
            raise CFError(404, VEC_NOT_FOUND, f"vectorize.index.not_found: index '{name}' does not exist")
        if catch_up:
            idx.catch_up()
        return idx

    def _enqueue(self, idx: Index, op: dict) -> str:
        mid = MUTATION_IDS.next()
        now = time.monotonic()
        lag = max(0.0, float(self._lag_ms())) / 1000.0
        apply_at = now + lag
        if idx.pending:
            apply_at = max(apply_at, idx.pending[-1][1])  # mutations apply in order
        self._append(idx, {"mid": mid, **op})
        idx.pending.append((mid, apply_at, op))
        idx.catch_up(now)
        return mid

    def flush(self) -> None:
        with self.lock:
            for idx in self.indexes.values():
                idx.catch_up(everything=True)

    def pending_count(self) -> int:
        with self.lock:
            return sum(len(i.pending) for i in self.indexes.values())

    # -- index CRUD ----------------------------------------------------------------------------------
    def create_index(self, account: str, body: Any) -> dict:
        if not isinstance(body, dict):
            raise bad("body must be a JSON object")
        name = body.get("name")
        if not isinstance(name, str) or not name or len(name.encode()) > MAX_NAME_BYTES or not _NAME_RE.match(name):
            raise bad("name must be 1-64 bytes of lowercase letters, digits, '-' or '_'")
        desc = body.get("description") or ""
        if not isinstance(desc, str):
            raise bad("description must be a string")
        config = body.get("config")
        if not isinstance(config, dict):
            raise bad("config is required: {dimensions, metric} or {preset}")
        if "preset" in config:
            if config["preset"] not in PRESETS:
                raise bad(f"unknown preset {config['preset']!r}")
            dims, metric = PRESETS[config["preset"]]
        else:
            dims, metric = config.get("dimensions"), config.get("metric")
            if not isinstance(dims, int) or isinstance(dims, bool) or not 1 <= dims <= MAX_DIMS:
                raise bad(f"config.dimensions must be an integer in 1..{MAX_DIMS}")
            if metric not in METRICS:
                raise bad(f"config.metric must be one of {', '.join(METRICS)}")
        with self.lock:
            if (account, name) in self.indexes:
                raise CFError(409, VEC_CONFLICT, f"vectorize.index.duplicate_name: index '{name}' already exists")
            now = _now_iso()
            idx = Index(account=account, name=name, description=desc, dims=dims, metric=metric,
                        created_on=now, modified_on=now, log_path=self._log_path(account, name))
            if idx.log_path is not None and idx.log_path.exists():
                idx.log_path.unlink()
            self._append(idx, {"op": "create", "name": name, "description": desc, "dims": dims,
                               "metric": metric, "created_on": now})
            self.indexes[(account, name)] = idx
            return idx.describe()

    def list_indexes(self, account: str) -> list[dict]:
        with self.lock:
            return [i.describe() for (a, _), i in sorted(self.indexes.items()) if a == account]

    def get_index(self, account: str, name: str) -> dict:
        with self.lock:
            return self._get(account, name, catch_up=False).describe()

    def delete_index(self, account: str, name: str) -> None:
        with self.lock:
            idx = self._get(account, name, catch_up=False)
            del self.indexes[(account, name)]
            if idx.log_path is not None and idx.log_path.exists():
                os.unlink(idx.log_path)

    def info(self, account: str, name: str) -> dict:
        with self.lock:
            idx = self._get(account, name)
            return {
                "dimensions": idx.dims,
                "vectorCount": len(idx.vectors),
                "processedUpToDatetime": idx.last_applied_at,
                "processedUpToMutation": idx.last_mutation,
            }

    # -- writes --------------------------------------------------------------------------------------
    def write(self, account: str, name: str, kind: str, payload: bytes, unparsable: str) -> dict:
        with self.lock:
            idx = self._get(account, name, catch_up=False)
            vectors = self._parse_ndjson(idx, payload, unparsable)
            return {"mutationId": self._enqueue(idx, {"op": kind, "vectors": vectors})}

    def _parse_ndjson(self, idx: Index, payload: bytes, unparsable: str) -> list[dict]:
        if unparsable not in ("error", "discard"):
            raise bad("unparsable-behavior must be 'error' or 'discard'")
        try:
            text = payload.decode("utf-8")
        except UnicodeDecodeError:
            raise bad("body is not valid UTF-8") from None
        out: dict[str, dict] = {}
        n = 0
        for lineno, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = _loads(line)
                if not isinstance(obj, dict):
                    raise ValueError("not an object")
            except ValueError:
                if unparsable == "discard":
                    continue
                raise bad(f"vectorize.invalid_ndjson: line {lineno} is not a JSON object") from None
            n += 1
            if n > MAX_VECTORS_PER_WRITE:
                raise bad(f"vectorize.too_many_vectors: at most {MAX_VECTORS_PER_WRITE} vectors per request")
            out[self._check_vector(idx, obj, lineno)["id"]] = obj  # duplicate ids: last one wins
        if not out:
            raise bad("vectorize.no_vectors: the body contains no vectors")
        return [self._clean(o) for o in out.values()]

    @staticmethod
    def _clean(o: dict) -> dict:
        c = {"id": o["id"], "values": o["values"]}  # a float64 array (lists in the replayed log)
        if o.get("namespace") is not None:
            c["namespace"] = o["namespace"]
        if o.get("metadata") is not None:
            c["metadata"] = o["metadata"]
        return c

    @staticmethod
    def _check_vector(idx: Index, o: dict, lineno: int) -> dict:
        vid = o.get("id")
        if not isinstance(vid, str) or not vid:
            raise bad(f"line {lineno}: id must be a non-empty string")
        if len(vid.encode("utf-8")) > MAX_ID_BYTES:
            raise bad(f"line {lineno}: id {vid[:20]!r}... is longer than {MAX_ID_BYTES} bytes")
        vals = o.get("values")
        if not isinstance(vals, list) or not set(map(type, vals)) <= {int, float} \
                or not np.isfinite(arr := np.asarray(vals, dtype=np.float64)).all():
            raise bad(f"line {lineno}: values must be an array of finite numbers")
        o["values"] = arr
        if len(vals) != idx.dims:
            raise bad(f"vectorize.dimension_mismatch: line {lineno}: vector has {len(vals)} dimensions, "
                      f"index '{idx.name}' expects {idx.dims}")
        ns = o.get("namespace")
        if ns is not None and (not isinstance(ns, str) or not ns or len(ns.encode()) > MAX_NAMESPACE_BYTES):
            raise bad(f"line {lineno}: namespace must be a non-empty string of at most {MAX_NAMESPACE_BYTES} bytes")
        md = o.get("metadata")
        if md is not None:
            if not isinstance(md, dict):
                raise bad(f"line {lineno}: metadata must be a JSON object")
            if len(json.dumps(md, separators=(",", ":"), ensure_ascii=False).encode()) > MAX_METADATA_BYTES:
                raise bad(f"line {lineno}: metadata is larger than {MAX_METADATA_BYTES} bytes")
        return o

    def delete_by_ids(self, account: str, name: str, body: Any) -> dict:
        ids = _ids(body)
        with self.lock:
            idx = self._get(account, name, catch_up=False)
            return {"mutationId": self._enqueue(idx, {"op": "delete", "ids": ids})}

    # -- metadata indexes ----------------------------------------------------------------------------
    def create_metadata_index(self, account: str, name: str, body: Any) -> dict:
        if not isinstance(body, dict):
            raise bad("body must be a JSON object")
        prop, typ = body.get("propertyName"), body.get("indexType")
        if not isinstance(prop, str) or not prop or len(prop) > MAX_FILTER_KEY_CHARS or prop.startswith("$") \
                or '"' in prop:
            raise bad("propertyName must be a non-empty string")
        if typ not in INDEX_TYPES:
            raise bad(f"indexType must be one of {', '.join(INDEX_TYPES)}")
        with self.lock:
            idx = self._get(account, name, catch_up=False)
            if prop in idx.declared_meta:
                raise CFError(409, VEC_CONFLICT, f"metadata index for '{prop}' already exists")
            if len(idx.declared_meta) >= MAX_METADATA_INDEXES:
                raise bad(f"an index can have at most {MAX_METADATA_INDEXES} metadata indexes")
            idx.declared_meta[prop] = typ
            return {"mutationId": self._enqueue(idx, {"op": "mi_create", "propertyName": prop, "indexType": typ})}

    def list_metadata_indexes(self, account: str, name: str) -> dict:
        with self.lock:
            idx = self._get(account, name)
            return {"metadataIndexes": [{"propertyName": p, "indexType": t} for p, t in idx.meta_indexes.items()]}

    def delete_metadata_index(self, account: str, name: str, body: Any) -> dict:
        prop = body.get("propertyName") if isinstance(body, dict) else None
        if not isinstance(prop, str) or not prop:
            raise bad("propertyName is required")
        with self.lock:
            idx = self._get(account, name, catch_up=False)
            if prop not in idx.declared_meta:
                raise CFError(404, VEC_NOT_FOUND, f"no metadata index for '{prop}'")
            del idx.declared_meta[prop]
            return {"mutationId": self._enqueue(idx, {"op": "mi_delete", "propertyName": prop})}

    # -- reads ---------------------------------------------------------------------------------------
    def get_by_ids(self, account: str, name: str, body: Any) -> list[dict]:
        ids = _ids(body)
        with self.lock:
            idx = self._get(account, name)
            out = []
            for vid in dict.fromkeys(ids):
                v = idx.vectors.get(vid)
                if v is None:
                    continue
                out.append({"id": v.id, "values": v.values.tolist(), "metadata": v.metadata or {},
                            "namespace": v.namespace})
            return out

    def list_vectors(self, account: str, name: str, count: str | None, cursor: str | None) -> dict:
        try:
            n = 100 if count in (None, "") else int(count)
        except ValueError:
            raise bad("count must be an integer") from None
        if not 1 <= n <= 1000:
            raise bad("count must be between 1 and 1000")
        with self.lock:
            idx = self._get(account, name)
            ids = sorted(idx.vectors)
            if cursor:
                ids = [i for i in ids if i > cursor]
            page = ids[:n]
            truncated = len(ids) > n
            return {
                "count": len(page),
                "totalCount": len(idx.vectors),
                "isTruncated": truncated,
                "nextCursor": page[-1] if truncated else None,
                "vectors": [{"id": i} for i in page],
            }

    def query(self, account: str, name: str, body: Any) -> dict:
        if not isinstance(body, dict):
            raise bad("body must be a JSON object")
        top_k = body.get("topK", 5)
        rv = body.get("returnValues", False)
        rm = body.get("returnMetadata", "none")
        if not isinstance(rv, bool):
            raise bad("returnValues must be a boolean")
        if rm not in ("none", "indexed", "all"):
            raise bad("returnMetadata must be 'none', 'indexed' or 'all'")
        if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1:
            raise bad("topK must be a positive integer")
        limit = MAX_TOPK_WITH_VALUES_OR_ALL_METADATA if (rv or rm == "all") else MAX_TOPK
        if top_k > limit:
            raise bad(f"vectorize.invalid_topk: topK must be <= {limit}"
                      + (" when returnValues is true or returnMetadata is 'all'" if limit < MAX_TOPK else ""))
        ns = body.get("namespace")
        if ns is not None and not isinstance(ns, str):
            raise bad("namespace must be a string")
        flt = validate_filter(body.get("filter"))
        with self.lock:
            idx = self._get(account, name)
            if "vector" in body and body["vector"] is not None:
                q = body["vector"]
                if not isinstance(q, list) or not all(_is_number(x) and math.isfinite(x) for x in q):
                    raise bad("vector must be an array of finite numbers")
                if len(q) != idx.dims:
                    raise bad(f"vectorize.dimension_mismatch: query vector has {len(q)} dimensions, "
                              f"index expects {idx.dims}")
                qv = np.asarray(q, dtype=np.float64)
            elif isinstance(body.get("vectorId"), str):
                src = idx.vectors.get(body["vectorId"])
                if src is None:
                    raise CFError(404, VEC_NOT_FOUND, f"vector '{body['vectorId']}' not found")
                qv = src.values
            else:
                raise bad("query needs 'vector' or 'vectorId'")
            order, mat, norms = idx.matrix()
            sel = [i for i, v in enumerate(order)
                   if (ns is None or v.namespace == ns) and (not flt or matches_filter(v, flt))]
            if not sel:
                return {"count": 0, "matches": []}
            sub = mat[sel]
            if idx.metric == "cosine":
                qn = float(np.linalg.norm(qv))
                denom = norms[sel] * qn
                dots = sub @ qv
                scores = np.divide(dots, denom, out=np.zeros_like(dots), where=denom > 0)
                rank = np.argsort(-scores, kind="stable")
            elif idx.metric == "dot-product":
                scores = sub @ qv
                rank = np.argsort(-scores, kind="stable")
            else:  # euclidean: distance, smaller is closer
                scores = np.linalg.norm(sub - qv, axis=1)
                rank = np.argsort(scores, kind="stable")
            matches = []
            cur_meta = idx.meta_indexes
            for r in rank[:top_k]:
                v = order[sel[int(r)]]
                m: dict[str, Any] = {"id": v.id, "score": float(scores[int(r)])}
                if rv:
                    m["values"] = v.values.tolist()
                if rm == "all":
                    m["metadata"] = v.metadata or {}
                elif rm == "indexed":
                    m["metadata"] = _nest({k: val for k, val in v.indexed.items() if k in cur_meta})
                if v.namespace is not None:
                    m["namespace"] = v.namespace
                matches.append(m)
            return {"count": len(matches), "matches": matches}


def _ids(body: Any) -> list[str]:
    ids = body.get("ids") if isinstance(body, dict) else None
    if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
        raise bad("ids must be an array of strings")
    return ids
