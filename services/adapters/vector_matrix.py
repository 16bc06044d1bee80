"""One namespace of the embedded vector index in memory (``Namespace``): unit rows in a contiguous float32
matrix (capacity doubling; deletes swap-remove), an int8 copy of each row with its scale, ids and lazily parsed
metadata alongside, and the cosine search over it. Scores are always the exact float32 cosine. Below
``QUANTIZED_MIN_ROWS`` scored rows, one float32 matrix-vector product ranks them all; from there, a first pass
over the int8 rows (SimSIMD's int8 dot product: a quarter of the memory to read, the scan's real cost) picks
``2 * depth + 100`` candidates and the float32 rows of those alone are scored and ranked. The int8 pass
decides only which rows are rescored: recall@100 against the float32 scan was 1.000 on 100k clustered and
random unit vectors (bench/bench_vector_libs.py), at a third of the time. Under a filter, the best candidates
are walked in score order first (a window of ``4 * top_k``, at least 64): a filter most rows pass is done there.
The filter's verdicts are remembered per row (an int8 array: 1 passes, 0 fails, -1 not asked yet), per namespace
for its ``MASKS`` most recently used filters, and maintained on every write (one predicate call per filter per
written row): a walk asks the predicate only of rows it has not judged before. A filtered search ranks the best
``top_k`` first and widens to the window only when one of them fails (at 100k rows the thoughts' filter, ``kind`` and
organization, made every search rescore 900 candidates instead of 300 and ask the predicate of ~100 rows in
Python: ~0.4 ms of a ~3 ms search; bench/README.md). When too few pass, every row gets a verdict, the filter is
marked selective, and its searches score only the rows that pass: a 1% filter over 10k rows went from 17 ms
(walking every row in Python) to about 1 ms (bench/bench_vector_libs.py). ``unit_rows`` and ``unit_query`` check
and normalise what goes in.

Thread-safety: the caller holds ``Namespace.lock`` (``search_locked`` takes it for a search).
"""

from __future__ import annotations

import json
import math
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import simsimd

from services.errors import InvalidInput
from services.ports import VectorMatch

__all__ = ["Namespace", "search_locked", "unit_rows", "unit_query", "MIN_CAPACITY"]

#: OpenBLAS runs gemv on one thread below 115200 * 4 elements; above it we use einsum (see Namespace.search).
_BLAS_MAX_FLOATS = 460_800
#: The fewest rows a namespace's matrix holds room for.
MIN_CAPACITY = 16
#: Filters whose per-row verdicts (a boolean mask) a namespace keeps, most recently used first.
MASKS = 8
#: Searches scoring at least this many rows take the int8 first pass (module docstring).
QUANTIZED_MIN_ROWS = 20_000
#: Rows loaded per step when a namespace's int8 copy is made at load (bounds the temporary float arrays).
_QUANTIZE_STEP = 50_000
#: One value in this many is read to set the threshold of the int8 pass's candidates (``_best``).
_SAMPLE_STEP = 64


def quantize(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Unit float32 rows -> (int8 rows, the float32 factor that turns each row's int8 dot products back into
    its cosine scale): symmetric per-row scaling, the largest component to 127."""
    amax = np.abs(rows).max(axis=1)
    amax[amax == 0] = 1.0
    q8 = np.rint(rows * (127.0 / amax)[:, None]).astype(np.int8)
    return q8, (amax / 127.0).astype(np.float32)


class Namespace:
    """Unit rows of one namespace in a contiguous matrix, with ids and (lazily parsed) metadata alongside."""

    __slots__ = ("name", "lock", "mat", "q8", "inv", "n", "ids", "metas", "pos", "masks")

    def __init__(self, name: str, dims: int, mat: np.ndarray | None = None, ids=None, metas=None) -> None:
        self.name = name
        self.lock = threading.Lock()
        self.ids: list[str] = ids or []
        self.metas: list[dict[str, Any] | str] = metas or []  # str = JSON not parsed yet
        self.n = len(self.ids)
        if mat is None:
            mat = np.empty((MIN_CAPACITY, dims), dtype=np.float32)
        self.mat = mat
        self.q8 = np.empty(mat.shape, dtype=np.int8)
        self.inv = np.empty(mat.shape[0], dtype=np.float32)
        for s in range(0, self.n, _QUANTIZE_STEP):
            e = min(self.n, s + _QUANTIZE_STEP)
            self.q8[s:e], self.inv[s:e] = quantize(mat[s:e])
        self.pos: dict[str, int] = {vid: i for i, vid in enumerate(self.ids)}
        #: filter key -> (predicate, verdict per row: an int8 array as long as ``mat``, 1 passes, 0 fails, -1 not
        #: asked yet; selective: every row has its verdict and searches score only those that pass), most recently
        #: used last
        self.masks: OrderedDict[str, tuple[Callable[[Mapping[str, Any]], bool], np.ndarray, bool]] = OrderedDict()

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
                q8 = np.empty(grown.shape, dtype=np.int8)
                q8[: self.n] = self.q8[: self.n]
                inv = np.empty(grown.shape[0], dtype=np.float32)
                inv[: self.n] = self.inv[: self.n]
                self.q8, self.inv = q8, inv
                for key, (pred, mask, selective) in list(self.masks.items()):
                    bigger = np.full(grown.shape[0], -1, dtype=np.int8)
                    bigger[: self.n] = mask[: self.n]
                    self.masks[key] = (pred, bigger, selective)
            i = self.n
            self.n += 1
            self.ids.append(vid)
            self.metas.append(meta)
            self.pos[vid] = i
        else:
            self.metas[i] = meta
        self.mat[i] = row
        q8, inv = quantize(np.asarray(row, dtype=np.float32)[None, :])
        self.q8[i], self.inv[i] = q8[0], inv[0]
        for pred, mask, _ in self.masks.values():
            mask[i] = bool(pred(meta))

    def remove(self, vid: str) -> None:
        i = self.pos.pop(vid, None)
        if i is None:
            return
        last = self.n - 1
        if i != last:
            self.mat[i] = self.mat[last]
            self.q8[i] = self.q8[last]
            self.inv[i] = self.inv[last]
            moved = self.ids[last]
            self.ids[i] = moved
            self.metas[i] = self.metas[last]
            self.pos[moved] = i
            for _, mask, _ in self.masks.values():
                mask[i] = mask[last]
        self.ids.pop()
        self.metas.pop()
        self.n = last
        cap = self.mat.shape[0]
        if cap > 4 * MIN_CAPACITY and self.n < cap // 4:  # give memory back after mass deletes
            keep = max(MIN_CAPACITY, cap // 2)
            self.mat = self.mat[:keep].copy()
            self.q8 = self.q8[:keep].copy()
            self.inv = self.inv[:keep].copy()
            for key, (pred, mask, selective) in list(self.masks.items()):
                self.masks[key] = (pred, mask[:keep].copy(), selective)

    def clear(self) -> None:
        self.ids, self.metas, self.pos, self.n = [], [], {}, 0
        self.masks.clear()
        self.mat = np.empty((MIN_CAPACITY, self.mat.shape[1]), dtype=np.float32)
        self.q8 = np.empty(self.mat.shape, dtype=np.int8)
        self.inv = np.empty(MIN_CAPACITY, dtype=np.float32)

    def search(
        self,
        q: np.ndarray,
        top_k: int,
        predicate: Callable[[Mapping[str, Any]], bool] | None,
        return_metadata: bool,
        return_values: bool,
        filter_key: str | None = None,
    ) -> list[VectorMatch]:
        """The ``top_k`` best rows for ``q`` that ``predicate`` passes (best first; ties by row order).
        ``filter_key`` names the filter (its canonical JSON) so that its verdicts can be kept (``MASKS``)."""
        n = self.n
        if n == 0:
            return []
        cached = self.masks.get(filter_key) if filter_key is not None and predicate is not None else None
        if cached is not None:
            self.masks.move_to_end(filter_key)
        if cached is not None and cached[2]:
            rows, scores = self._ranked(q, top_k, np.flatnonzero(cached[1][:n] == 1))
        elif predicate is None:
            rows, scores = self._ranked(q, top_k)
        else:
            if cached is not None:
                verdicts = cached[1]
            else:
                verdicts = np.full(self.mat.shape[0], -1, dtype=np.int8)
                if filter_key is not None:
                    self._keep(filter_key, predicate, verdicts, False)
            # The best top_k rows, when all pass (a filter most rows pass: the common case), else the best rows of a
            # wider window walked in score order (the int8 pass's scores serve both); when too few pass, score only
            # the rows that pass.
            # (Below QUANTIZED_MIN_ROWS every row is scored whatever the depth: the window at once.)
            window = min(n, max(4 * top_k, 64))
            approx = self._approx(q) if n >= QUANTIZED_MIN_ROWS else None
            rows, scores = self._ranked(q, top_k if approx is not None else window, approx=approx)
            passed = self._walk(rows, top_k, predicate, verdicts)
            if len(passed) < top_k and len(rows) < window:
                rows, scores = self._ranked(q, window, approx=approx)
                passed = self._walk(rows, top_k, predicate, verdicts)
            if len(passed) == top_k or window >= n:
                rows, scores = rows[passed], scores[passed]
            else:
                self._judge_all(predicate, verdicts)
                if filter_key is not None:
                    self._keep(filter_key, predicate, verdicts, True)
                rows, scores = self._ranked(q, top_k, np.flatnonzero(verdicts[:n] == 1))
        if len(rows) == 0:
            return []
        picked = rows.tolist()
        sel = [min(1.0, max(-1.0, x)) for x in scores.tolist()]
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

    def _approx(self, q: np.ndarray, subset: np.ndarray | None = None) -> np.ndarray:
        """The int8 pass: every row's (or ``subset``'s) approximate score, the int8 dot product scaled back."""
        q8 = self.q8[: self.n] if subset is None else self.q8[subset]
        inv = self.inv[: self.n] if subset is None else self.inv[subset]
        qq, _ = quantize(q[None, :])
        # The int8 dot products are integers below 2**24 (384 x 127 x 127), exact in float32: written straight
        # into a float32 row (SimSIMD's default is a float64 matrix, and the scaling then doubles its cost).
        approx = np.empty((1, len(q8)), dtype=np.float32)
        simsimd.cdist(qq, q8, metric="dot", threads=1, out=approx)
        return np.multiply(approx[0], inv, out=approx[0])

    def _ranked(self, q: np.ndarray, depth: int, subset: np.ndarray | None = None,
                approx: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The best ``depth`` rows (of ``subset``, else all), best first (ties by row), and their exact scores.
        ``approx``: the int8 pass's scores of the same rows, when the caller has them already."""
        n = self.n
        m = n if subset is None else len(subset)
        if m == 0:
            return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.float32)
        if m < QUANTIZED_MIN_ROWS:
            mat = self.mat[:n] if subset is None else self.mat[subset]
            # BLAS while it runs on one thread; above that numpy's own single-threaded SIMD loop, because
            # OpenBLAS splits bigger gemv calls across threads, and on a busy machine a descheduled BLAS thread
            # stalls the product for a whole scheduler slice (10k x 384: 0.7 ms -> 12 ms median).
            scores = mat @ q if mat.size <= _BLAS_MAX_FLOATS else np.einsum("ij,j->i", mat, q)
            rows = np.arange(n) if subset is None else subset
        else:
            if approx is None:
                approx = self._approx(q, subset)
            cand = _best(approx, min(m, rescored(depth)))
            rows = cand if subset is None else subset[cand]
            scores = self.mat[rows] @ q
        take = min(depth, len(rows))
        if take < len(rows):
            best = np.argpartition(scores, len(rows) - take)[len(rows) - take :]
            rows, scores = rows[best], scores[best]
        order = np.lexsort((rows, -scores))
        return rows[order], scores[order]

    def _keep(self, key: str, predicate: Callable[[Mapping[str, Any]], bool], verdicts: np.ndarray,
              selective: bool) -> None:
        """Remember a filter's verdicts (most recently used last; the oldest past ``MASKS`` are dropped)."""
        self.masks[key] = (predicate, verdicts, selective)
        self.masks.move_to_end(key)
        while len(self.masks) > MASKS:
            self.masks.popitem(last=False)

    def _walk(self, rows: np.ndarray, top_k: int, predicate: Callable[[Mapping[str, Any]], bool],
              verdicts: np.ndarray) -> list[int]:
        """Positions in ``rows`` (best first) of the first ``top_k`` rows that pass (fewer when fewer do). The
        predicate is asked only of rows without a verdict in ``verdicts``, which keeps its answers."""
        known = verdicts[rows]
        if known.size == 0 or known.min() >= 0:  # every row judged before: no Python per row
            return np.flatnonzero(known == 1)[:top_k].tolist()
        passed: list[int] = []
        for j, (i, verdict) in enumerate(zip(rows.tolist(), known.tolist(), strict=True)):
            if verdict < 0:
                verdict = verdicts[i] = bool(predicate(self.meta(i)))
            if verdict:
                passed.append(j)
                if len(passed) == top_k:
                    break
        return passed

    def _judge_all(self, predicate: Callable[[Mapping[str, Any]], bool], verdicts: np.ndarray) -> None:
        """A verdict for every row that has none (metadata not parsed yet is parsed for the verdict and not kept,
        so remembered verdicts cost one byte per row, not a parsed dict)."""
        loads, metas = json.loads, self.metas
        for i in np.flatnonzero(verdicts[: self.n] < 0).tolist():
            m = metas[i]
            verdicts[i] = bool(predicate(loads(m) if type(m) is str else m))


def rescored(depth: int) -> int:
    """How many of the int8 pass's best rows are rescored in float32 for the best ``depth`` (the module docstring)."""
    return 2 * depth + 100


def _best(values: np.ndarray, c: int) -> np.ndarray:
    """Positions of the ``c`` largest ``values`` (any order; ties broken arbitrarily, as ``np.argpartition``).

    A partition of the whole array costs ~0.7 ms at 100k rows. Instead, a threshold is read off every
    ``_SAMPLE_STEP``-th value, set so that about ``2 * c`` rows reach it; when at least ``c`` do, they hold every one
    of the ``c`` largest (each is at or above the ``c``-th largest, which is at or above the threshold), and only
    they are partitioned. When fewer reach it (an unlucky sample), the whole array is partitioned as before."""
    m = len(values)
    if c >= m:
        return np.arange(m)
    sample = values[::_SAMPLE_STEP]
    if len(sample) > 1:
        k = min(len(sample), 2 * c // _SAMPLE_STEP + 1)
        threshold = np.partition(sample, len(sample) - k)[len(sample) - k]
        above = np.flatnonzero(values >= threshold)
        if len(above) >= c:
            return above[np.argpartition(values[above], len(above) - c)[len(above) - c :]]
    return np.argpartition(values, m - c)[m - c :]


_JSON_ATOMS = frozenset({str, int, float, bool, type(None)})


def _copy_json(v: Any) -> Any:
    """A copy of metadata that shares nothing mutable with ``v``: it is parsed JSON (``json.loads``: plain dicts,
    lists, strings, numbers, booleans, None), and only its dicts and lists are mutable."""
    t = type(v)
    if t is dict:
        return {k: x if type(x) in _JSON_ATOMS else _copy_json(x) for k, x in v.items()}
    if t is list:
        return [x if type(x) in _JSON_ATOMS else _copy_json(x) for x in v]
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
