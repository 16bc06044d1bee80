"""One namespace of the embedded vector index in memory (``Namespace``): unit rows in a contiguous float32
matrix (capacity doubling; deletes swap-remove), ids and lazily parsed metadata alongside, and the exact cosine
search over it (one matrix-vector product; under a filter, candidates are walked in score order through a
window that widens until ``top_k`` pass). ``unit_rows`` and ``unit_query`` check and normalise what goes in.

Thread-safety: the caller holds ``Namespace.lock`` (``search_locked`` takes it for a search).
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from services.errors import InvalidInput
from services.ports import VectorMatch

__all__ = ["Namespace", "search_locked", "unit_rows", "unit_query", "MIN_CAPACITY"]

#: OpenBLAS runs gemv on one thread below 115200 * 4 elements; above it we use einsum (see Namespace.search).
_BLAS_MAX_FLOATS = 460_800
#: The fewest rows a namespace's matrix holds room for.
MIN_CAPACITY = 16


class Namespace:
    """Unit rows of one namespace in a contiguous matrix, with ids and (lazily parsed) metadata alongside."""

    __slots__ = ("name", "lock", "mat", "n", "ids", "metas", "pos")

    def __init__(self, name: str, dims: int, mat: np.ndarray | None = None, ids=None, metas=None) -> None:
        self.name = name
        self.lock = threading.Lock()
        self.ids: list[str] = ids or []
        self.metas: list[dict[str, Any] | str] = metas or []  # str = JSON not parsed yet
        self.n = len(self.ids)
        if mat is None:
            mat = np.empty((MIN_CAPACITY, dims), dtype=np.float32)
        self.mat = mat
        self.pos: dict[str, int] = {vid: i for i, vid in enumerate(self.ids)}

    # all methods below: caller holds self.lock

    def meta(self, i: int) -> dict[str, Any]:
        m = self.metas[i]
        if isinstance(m, str):
            m = json.loads(m)
            self.metas[i] = m
        return m

    def put(self, vid: str, row: np.ndarray, meta: dict[str, Any]) -> None:
        i = self.pos.get(vid)
        if i is None:
            if self.n == self.mat.shape[0]:
                grown = np.empty((max(MIN_CAPACITY, 2 * self.mat.shape[0]), self.mat.shape[1]), dtype=np.float32)
                grown[: self.n] = self.mat[: self.n]
                self.mat = grown
            i = self.n
            self.n += 1
            self.ids.append(vid)
            self.metas.append(meta)
            self.pos[vid] = i
        else:
            self.metas[i] = meta
        self.mat[i] = row

    def remove(self, vid: str) -> None:
        i = self.pos.pop(vid, None)
        if i is None:
            return
        last = self.n - 1
        if i != last:
            self.mat[i] = self.mat[last]
            moved = self.ids[last]
            self.ids[i] = moved
            self.metas[i] = self.metas[last]
            self.pos[moved] = i
        self.ids.pop()
        self.metas.pop()
        self.n = last
        cap = self.mat.shape[0]
        if cap > 4 * MIN_CAPACITY and self.n < cap // 4:  # give memory back after mass deletes
            self.mat = self.mat[: max(MIN_CAPACITY, cap // 2)].copy()

    def clear(self) -> None:
        self.ids, self.metas, self.pos, self.n = [], [], {}, 0
        self.mat = np.empty((MIN_CAPACITY, self.mat.shape[1]), dtype=np.float32)

    def search(
        self,
        q: np.ndarray,
        top_k: int,
        predicate: Callable[[Mapping[str, Any]], bool] | None,
        return_metadata: bool,
        return_values: bool,
    ) -> list[VectorMatch]:
        n = self.n
        if n == 0:
            return []
        mat = self.mat[:n]
        # small: BLAS (single-threaded at this size, fastest). Large: numpy's own single-threaded SIMD loop,
        # because OpenBLAS splits bigger gemv calls across threads, and on a busy machine (the embedding worker,
        # other requests) a descheduled BLAS thread stalls the product for a whole scheduler slice: measured
        # 10k x 384 at 0.7 ms -> 12 ms median, 100k at ~10 ms -> 44 ms. einsum stays memory-bound and steady.
        scores = mat @ q if mat.size <= _BLAS_MAX_FLOATS else np.einsum("ij,j->i", mat, q)
        picked: list[int] = []
        if predicate is None:
            if top_k >= n:
                picked = np.argsort(-scores, kind="stable").tolist()
            else:
                part = np.argpartition(scores, n - top_k)[n - top_k :]
                picked = part[np.argsort(-scores[part], kind="stable")].tolist()
        else:
            # walk candidates in score order, widening the window until top_k pass the filter
            window = min(n, max(4 * top_k, 64))
            verdicts: dict[int, bool] = {}  # the filter runs at most once per vector
            while True:
                if window >= n:
                    order = np.argsort(-scores, kind="stable")
                else:
                    part = np.argpartition(scores, n - window)[n - window :]
                    order = part[np.lexsort((part, -scores[part]))]
                metas = self.metas
                for i in order.tolist():
                    ok = verdicts.get(i)
                    if ok is None:
                        m = metas[i]
                        if type(m) is str:
                            m = metas[i] = json.loads(m)
                        ok = verdicts[i] = predicate(m)
                    if ok:
                        picked.append(i)
                        if len(picked) == top_k:
                            break
                if len(picked) == top_k or window >= n:
                    break
                # widen and walk again from the top (cheap: verdicts are remembered); walking again rather
                # than resuming keeps the order exact when ties straddle the old window's edge
                window = min(n, window * 8)
                picked = []
        if not picked:
            return []
        sel = [min(1.0, max(-1.0, x)) for x in scores[picked].tolist()]
        ids, name = self.ids, self.name
        if not (return_metadata or return_values):
            return [VectorMatch(ids[i], s, name) for i, s in zip(picked, sel, strict=True)]
        return [
            VectorMatch(
                ids[i],
                s,
                name,
                _copy_json(self.meta(i)) if return_metadata else None,
                self.mat[i].tolist() if return_values else None,
            )
            for i, s in zip(picked, sel, strict=True)
        ]


def _copy_json(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: _copy_json(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_copy_json(x) for x in v]
    return v


def unit_rows(values: Sequence[Any], dims: int, what: str) -> np.ndarray:
    try:
        mat = np.asarray(values, dtype=np.float32)
    except (TypeError, ValueError) as exc:
        raise InvalidInput(f"{what}: values must be numbers") from exc
    if mat.ndim != 2 or mat.shape[1] != dims:
        got = mat.shape[-1] if mat.ndim >= 1 else 0
        raise InvalidInput(f"{what}: expected {dims} dimensions, got {got}", details={"dimensions": dims, "got": got})
    if not np.isfinite(mat).all():
        raise InvalidInput(f"{what}: values must be finite")
    norms = np.linalg.norm(mat.astype(np.float64), axis=1)
    if (norms == 0).any():
        raise InvalidInput(f"{what}: the zero vector has no direction")
    return (mat / norms[:, None]).astype(np.float32)


def unit_query(vector: Any, dims: int) -> np.ndarray:
    try:
        q = np.asarray(vector, dtype=np.float32)
    except (TypeError, ValueError) as exc:
        raise InvalidInput("query vector: values must be numbers") from exc
    if q.shape != (dims,):
        raise InvalidInput(f"query vector: expected {dims} dimensions, got shape {q.shape}", details={"dimensions": dims})
    norm = math.sqrt(float(np.dot(q, q)))  # NaN or inf anywhere makes this non-finite
    if not math.isfinite(norm) or norm == 0.0:
        raise InvalidInput("query vector: values must be finite and not all zero")
    return q / np.float32(norm)


def search_locked(space: Namespace, args: tuple) -> list[VectorMatch]:
    with space.lock:
        return space.search(*args)
