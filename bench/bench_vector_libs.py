"""Vector index options for the embedded backend: the hand-written LocalVectorIndex against plain numpy, usearch,
hnswlib, faiss and sqlite-vec, on one namespace (one organization) of 10k, 100k and 1M 384-dim unit vectors.

    python3 -m venv /work/vecbench-venv
    /work/vecbench-venv/bin/pip install -e . numpy usearch hnswlib faiss-cpu sqlite-vec
    /work/vecbench-venv/bin/pip install pysqlite3-binary   # only if this Python's sqlite3 cannot load extensions
    /work/vecbench-venv/bin/python bench/bench_vector_libs.py [--sizes 10000,100000,1000000] [--skip-1m]
        [--queries 200] [--datasets random,clustered] [--libs ...] [--libs-1m ...] [--json out.json]

Not a dependency of the project: run it from a throwaway virtualenv (the libraries are not in pyproject.toml).

Data: ``random`` (uniform unit vectors: every neighbour at cosine ~0, the worst case for HNSW) and ``clustered``
(1,000 gaussian clusters of uneven size and spread, cosine to the centre ~0.7-0.85, like sentence embeddings of
related texts), 200 queries drawn the same way. Each vector has a ``kind``: thought 60%, conversation_window
25%, conversation_turn 14%, knowledge 1%; the filters are the search's ``kind $in`` at 60% (["thought"]) and at
1% (["knowledge"]). Ground truth is the exact top-100 by cosine (float32 matrix product) after the filter.

Each (dataset, size, library) runs in a fresh subprocess, so the resident-memory delta (RSS after building,
source vectors freed, minus RSS before loading them) is the index's alone; figures are per 100k vectors. Queries
are single (one vector), top-100 (VECTOR_DEPTH), timed one by one on one thread (OpenBLAS/OpenMP limited to 1
thread, usearch/hnswlib/faiss told 1 thread) -- except LocalVectorIndex, which runs as deployed (default
threads, einsum above 460,800 floats) -- and HNSW builds use 2 threads (the machine's cores). A row stops after
``--queries`` queries or ``--row-seconds`` (at least 20 queries). Latency is p50 / p95 of the call alone (the
libraries' rows exclude mapping labels back to string ids and metadata; LocalVectorIndex's row is its public
async API with ``return_metadata=True``, as the search calls it, thread hop included at 100k+).

HNSW parameters: M (connectivity) 16, efConstruction 128, efSearch from ``--ef`` (top-100 needs ef >= 100).
HNSW libraries filter by over-fetching then post-filtering (k' = 1.5 x 100 / selectivity, and a cheap 10x),
or inside the graph walk where the library can (hnswlib ``filter=`` callable, faiss ``IDSelectorBitmap``).
Exact methods filter with a mask (numpy, faiss ``IDSelectorBitmap``) or, in sqlite-vec, a metadata column.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

DIMS = 384
TOP_K = 100
KINDS = ("thought", "conversation_window", "conversation_turn", "knowledge")
KIND_P = (0.60, 0.25, 0.14, 0.01)
#: filter name -> the kinds it keeps (None: no filter besides the organization)
FILTERS: dict[str, tuple[str, ...] | None] = {"none": None, "60%": ("thought",), "1%": ("knowledge",)}
N_CLUSTERS = 1_000
WARMUP = 5
ALL_LIBS = ("local", "numpy", "numpy-2t", "numpy-ivf", "faiss-flat", "faiss-sq8", "faiss-hnsw", "usearch-f32", "usearch-i8",
            "hnswlib", "sqlite-vec")
DEFAULT_LIBS_1M = "local,numpy,faiss-flat,usearch-f32,usearch-i8,hnswlib"
NS = "org-bench"

#: What each option offers beyond speed (printed after the table; see bench/README.md for the discussion).
DURABILITY = {
    "local": "SQLite (WAL, synchronous=FULL) is the truth; every upsert/delete committed before it returns; "
             "matrix rebuilt at open. Deletes: row delete + swap-remove. Filters: all of Vectorize's, exact.",
    "numpy": "In memory only: durability is whatever store feeds it (today: LocalVectorIndex's SQLite).",
    "faiss-flat": "write_index/read_index of the whole index; no incremental persistence (a crash loses "
                  "everything since the last write). remove_ids is O(n). Filters: IDSelector (bitmap) exact.",
    "faiss-hnsw": "Whole-index write_index only; IndexHNSWFlat cannot remove vectors (rebuild). Filters: "
                  "IDSelector checked during the graph walk (results may fall short at low selectivity).",
    "usearch": "save()/load()/view() of the whole index (view = mmap, read-only); no WAL: a crash loses "
               "everything since the last save. remove() marks tombstones. Python search() has no filter.",
    "hnswlib": "save_index/load_index of the whole index; mark_deleted tombstones (replace_deleted to reuse); "
               "knn_query(filter=callable) runs a Python call per visited node. sdist only on PyPI.",
    "sqlite-vec": "A SQLite virtual table: incremental, transactional, WAL durability like today. Deletes are "
                  "SQL deletes. Filters: metadata columns (=, !=, <, >, IN) in the KNN query; no lists.",
}


# -- helpers ---------------------------------------------------------------------------------------------------


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def settle() -> int:
    gc.collect()
    time.sleep(0.05)
    return rss()


def load_avg() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def unit(m: np.ndarray) -> np.ndarray:
    return (m / np.linalg.norm(m, axis=1, keepdims=True)).astype(np.float32)


def pct(samples: list[float], p: float) -> float:
    ms = sorted(s * 1000 for s in samples)
    return ms[min(len(ms) - 1, int(round(p * (len(ms) - 1))))]


def dir_size(paths: list[Path]) -> int:
    return sum(p.stat().st_size for p in paths if p.exists())


# -- data (main process) ---------------------------------------------------------------------------------------


def make_dataset(name: str, n: int, nq: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """n base vectors, nq + WARMUP queries (unit float32) and n kind codes (int8)."""
    rng = np.random.default_rng(seed)
    kinds = rng.choice(len(KINDS), size=n, p=KIND_P).astype(np.int8)
    chunk = 100_000
    if name == "random":
        base = np.empty((n, DIMS), dtype=np.float32)
        for s in range(0, n, chunk):
            base[s : s + chunk] = unit(rng.standard_normal((min(chunk, n - s), DIMS), dtype=np.float32))
        queries = unit(rng.standard_normal((nq + WARMUP, DIMS), dtype=np.float32))
        return base, queries, kinds
    if name != "clustered":
        raise SystemExit(f"unknown dataset {name!r}")
    centres = unit(rng.standard_normal((N_CLUSTERS, DIMS), dtype=np.float32))
    weights = rng.dirichlet(np.ones(N_CLUSTERS))  # uneven cluster sizes
    # noise per dimension: |noise| ~ sigma * sqrt(384), so cosine to the centre ~ 1 / sqrt(1 + 384 sigma^2)
    sigma = rng.uniform(0.03, 0.05, size=N_CLUSTERS).astype(np.float32)

    def draw(m: int) -> np.ndarray:
        a = rng.choice(N_CLUSTERS, size=m, p=weights)
        return unit(centres[a] + sigma[a, None] * rng.standard_normal((m, DIMS), dtype=np.float32))

    base = np.empty((n, DIMS), dtype=np.float32)
    for s in range(0, n, chunk):
        base[s : s + chunk] = draw(min(chunk, n - s))
    return base, draw(nq + WARMUP), kinds


def ground_truth(base: np.ndarray, queries: np.ndarray, kinds: np.ndarray, n: int) -> dict[str, np.ndarray]:
    """Exact top-100 row indices per query and filter (-1 pads when fewer rows pass)."""
    out = {f: np.full((len(queries), TOP_K), -1, dtype=np.int64) for f in FILTERS}
    masks = {f: None if ks is None else np.isin(kinds[:n], [KINDS.index(k) for k in ks]) for f, ks in FILTERS.items()}
    mat = base[:n]
    for s in range(0, len(queries), 25):
        scores = queries[s : s + 25] @ mat.T
        for f, mask in masks.items():
            sc = scores if mask is None else np.where(mask[None, :], scores, -np.inf)
            k = min(TOP_K, n if mask is None else int(mask.sum()))
            for j in range(sc.shape[0]):
                row = sc[j]
                part = np.argpartition(-row, k - 1)[:k]
                out[f][s + j, :k] = part[np.argsort(-row[part], kind="stable")]
    return out


# -- measuring (workers) ---------------------------------------------------------------------------------------


class Ctx:
    """What a worker gets: queries, kinds, ground truth, parameters; and the rows it reports."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.data = Path(args.data)
        self.ds = args.dataset
        self.n = args.n
        self.params = json.loads(args.params)
        nq = self.params["queries"]
        q = np.load(self.data / f"{self.ds}-queries.npy")
        self.warm = q[:WARMUP].copy()
        self.queries = q[WARMUP : WARMUP + nq].copy()
        self.kinds = np.load(self.data / f"{self.ds}-kinds.npy")[: self.n].copy()
        self.gt = {f: np.load(self.data / f"{self.ds}-{self.n}-gt-{f}.npy")[:nq] for f in FILTERS}
        self.codes = {f: None if ks is None else np.array([KINDS.index(k) for k in ks], dtype=np.int8) for f, ks in
                      FILTERS.items()}
        self.tmp = Path(args.tmp)
        self.rows: list[dict[str, Any]] = []
        self.common: dict[str, Any] = {}

    def base(self) -> np.ndarray:
        mm = np.load(self.data / f"{self.ds}-base.npy", mmap_mode="r")
        out = np.array(mm[: self.n])
        del mm
        return out

    def mask(self, f: str) -> np.ndarray:
        codes = self.codes[f]
        return np.ones(self.n, dtype=bool) if codes is None else np.isin(self.kinds, codes)

    def selectivity(self, f: str) -> float:
        return float(self.mask(f).mean())

    def save_and_reload(self, path: Path, save: Callable[[str], Any], load: Callable[[str], Any]) -> None:
        """Time a whole-index save to ``path`` and a load of it (save_s, load_s, file_mb), then delete the file."""
        t0 = time.perf_counter()
        save(str(path))
        self.common["save_s"] = time.perf_counter() - t0
        self.common["file_mb"] = path.stat().st_size / 2**20
        t0 = time.perf_counter()
        load(str(path))
        self.common["load_s"] = time.perf_counter() - t0
        path.unlink()

    def row(self, variant: str, filt: str, lat: list[float], res: list[np.ndarray], **extra: Any) -> None:
        gt = self.gt[filt]
        r10, r100, fill = [], [], []
        for r, g in zip(res, gt, strict=False):
            g = g[g >= 0]
            r = np.asarray(r, dtype=np.int64)
            r = r[r >= 0][:TOP_K]
            if len(g) == 0:
                continue
            fill.append(len(r) / len(g))
            r10.append(len(set(r[:10].tolist()) & set(g[:10].tolist())) / min(10, len(g)))
            r100.append(len(set(r.tolist()) & set(g.tolist())) / len(g))
        self.rows.append({
            **self.common, "variant": variant, "filter": filt, "queries": len(lat),
            "p50_ms": pct(lat, 0.5), "p95_ms": pct(lat, 0.95),
            "recall10": statistics.fmean(r10) if r10 else None, "recall100": statistics.fmean(r100) if r100 else None,
            "fill": statistics.fmean(fill) if fill else None, **extra,
        })

    def timed(self, fn: Callable[[np.ndarray], Any]) -> tuple[list[float], list[Any]]:
        for q in self.warm:
            fn(q)
        lat, res = [], []
        budget = self.params["row_seconds"]
        start = time.perf_counter()
        for i, q in enumerate(self.queries):
            t0 = time.perf_counter()
            r = fn(q)
            lat.append(time.perf_counter() - t0)
            res.append(r)
            if i >= 19 and time.perf_counter() - start > budget:
                break
        return lat, res

    def memory(self, before: int, after: int, lib_bytes: int | None = None) -> None:
        per = 100_000 / self.n / 2**20
        self.common["mem_mb_100k"] = (after - before) * per
        self.common["lib_mem_mb_100k"] = None if lib_bytes is None else lib_bytes * per

    def postfilter_k(self, f: str) -> int:
        return min(self.n, math.ceil(1.5 * TOP_K / max(self.selectivity(f), 1e-9)))


def top(scores: np.ndarray, k: int = TOP_K) -> np.ndarray:
    if k >= len(scores):
        return np.argsort(-scores, kind="stable")
    part = np.argpartition(scores, len(scores) - k)[len(scores) - k :]
    return part[np.argsort(-scores[part], kind="stable")]


def post_filter(labels: np.ndarray, kinds: np.ndarray, codes: np.ndarray | None) -> np.ndarray:
    labels = labels[labels >= 0]
    if codes is None:
        return labels[:TOP_K]
    return labels[np.isin(kinds[labels], codes)][:TOP_K]


# -- the contenders ----------------------------------------------------------------------------------------------


def run_numpy(ctx: Ctx) -> None:
    before = settle()
    base = ctx.base()
    t0 = time.perf_counter()
    mat = np.ascontiguousarray(base, dtype=np.float32).copy()  # what a store keeps: one contiguous matrix
    ctx.common["build_s"] = time.perf_counter() - t0
    del base
    ctx.memory(before, settle())
    threads = ctx.params.get("blas_threads", 1)
    if threads > 1:  # only the BLAS product differs
        ctx.row(f"matmul (BLAS, {threads} threads)", "none", *ctx.timed(lambda q: top(mat @ q)))
        return
    ctx.row("matmul (BLAS gemv)", "none", *ctx.timed(lambda q: top(mat @ q)))
    ctx.row("einsum (as LocalVectorIndex)", "none", *ctx.timed(lambda q: top(np.einsum("ij,j->i", mat, q))))
    kinds, codes = ctx.kinds, ctx.codes

    def masked(q: np.ndarray, f: str) -> np.ndarray:
        s = np.einsum("ij,j->i", mat, q)
        s[~np.isin(kinds, codes[f])] = -np.inf
        return top(s)[: int(np.count_nonzero(s > -np.inf))]

    def subset(q: np.ndarray, f: str) -> np.ndarray:
        idx = np.flatnonzero(np.isin(kinds, codes[f]))
        return idx[top(mat[idx] @ q)]

    ctx.row("einsum + column mask (-inf)", "60%", *ctx.timed(lambda q: masked(q, "60%")))
    ctx.row("einsum + column mask (-inf)", "1%", *ctx.timed(lambda q: masked(q, "1%")))
    ctx.row("column mask -> gather subset -> matmul", "1%", *ctx.timed(lambda q: subset(q, "1%")))


def run_numpy_ivf(ctx: Ctx) -> None:
    """A numpy-only inverted file (what the hand-written index could grow into): spherical k-means centroids
    (4 x sqrt(n) lists, trained on a sample), one contiguous matrix per list (as today's Namespace), a query
    scores the centroids and scans the ``nprobe`` best lists; a filter is a mask over the scanned rows."""
    before = settle()
    base = ctx.base()
    n = ctx.n
    nlist = max(16, int(round(4 * math.sqrt(n))))
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    sample = base[np.sort(rng.choice(n, size=min(n, 32 * nlist), replace=False))]
    cent = sample[rng.choice(len(sample), size=nlist, replace=False)].copy()

    def assign(rows: np.ndarray) -> np.ndarray:
        out = np.empty(len(rows), dtype=np.int64)
        for s in range(0, len(rows), 20_000):
            out[s : s + 20_000] = np.argmax(rows[s : s + 20_000] @ cent.T, axis=1)
        return out

    for _ in range(8):
        a = assign(sample)
        order = np.argsort(a, kind="stable")
        counts = np.bincount(a, minlength=nlist)
        present = np.flatnonzero(counts)
        starts = np.concatenate(([0], np.cumsum(counts[present])[:-1]))
        sums = np.add.reduceat(sample[order], starts, axis=0)
        cent[present] = unit(sums)
        empty = np.flatnonzero(counts == 0)
        cent[empty] = sample[rng.choice(len(sample), size=len(empty), replace=False)]
    a = assign(base)
    order = np.argsort(a, kind="stable")
    bounds = np.concatenate(([0], np.cumsum(np.bincount(a, minlength=nlist))))
    lists = [base[order[bounds[i] : bounds[i + 1]]] for i in range(nlist)]
    ids = [order[bounds[i] : bounds[i + 1]] for i in range(nlist)]
    kinds = [ctx.kinds[x] for x in ids]
    ctx.common["build_s"] = time.perf_counter() - t0
    del base, sample, order, a
    ctx.memory(before, settle())
    codes = ctx.codes

    def search(q: np.ndarray, nprobe: int, f: str = "none") -> np.ndarray:
        cs = cent @ q
        probe = np.argpartition(cs, nlist - nprobe)[nlist - nprobe :] if nprobe < nlist else range(nlist)
        s = np.concatenate([lists[li] @ q for li in probe])
        lab = np.concatenate([ids[li] for li in probe])
        if codes[f] is not None:
            keep = np.isin(np.concatenate([kinds[li] for li in probe]), codes[f])
            s, lab = s[keep], lab[keep]
        return lab[top(s)] if len(s) else lab

    for nprobe in (16, 32, 64):
        p = min(nprobe, nlist)
        ctx.row(f"nlist={nlist} nprobe={p} (~{p / nlist:.0%} scanned)", "none", *ctx.timed(lambda q, p=p: search(q, p)))
    p = min(nlist, math.ceil(32 / ctx.selectivity("60%")))
    ctx.row(f"nprobe={p} + column mask", "60%", *ctx.timed(lambda q: search(q, p, "60%")))


def _faiss_common(ctx: Ctx, build: Callable[[np.ndarray], Any], name: str, lib_bytes: bool = False) -> Any:
    import faiss

    before = settle()
    base = ctx.base()
    faiss.omp_set_num_threads(2)
    t0 = time.perf_counter()
    index = build(base)
    ctx.common["build_s"] = time.perf_counter() - t0
    faiss.omp_set_num_threads(1)
    del base
    ctx.memory(before, settle())
    ctx.save_and_reload(ctx.tmp / f"{name}.faiss", lambda p: faiss.write_index(index, p), faiss.read_index)
    return index


def _bitmap_selector(ctx: Ctx, f: str) -> tuple[Any, np.ndarray]:
    import faiss

    bits = np.packbits(np.isin(ctx.kinds, ctx.codes[f]), bitorder="little")
    return faiss.IDSelectorBitmap(ctx.n, faiss.swig_ptr(bits)), bits  # keep bits alive with the selector


def run_faiss_exact(ctx: Ctx, kind: str) -> None:
    import faiss

    if kind == "flat":
        def build(base: np.ndarray) -> Any:
            index = faiss.IndexFlatIP(DIMS)
            index.add(base)
            return index
    else:
        def build(base: np.ndarray) -> Any:
            index = faiss.IndexScalarQuantizer(DIMS, faiss.ScalarQuantizer.QT_8bit, faiss.METRIC_INNER_PRODUCT)
            index.train(base[: min(len(base), 100_000)])
            index.add(base)
            return index

    index = _faiss_common(ctx, build, kind)
    ctx.row("search k=100", "none", *ctx.timed(lambda q: index.search(q[None, :], TOP_K)[1][0]))
    for f in ("60%", "1%"):
        def sel_search(q: np.ndarray, f: str = f) -> np.ndarray:
            sel, bits = _bitmap_selector(ctx, f)  # built per query: arbitrary filters
            labels = index.search(q[None, :], TOP_K, params=faiss.SearchParameters(sel=sel))[1][0]
            del bits
            return labels

        ctx.row("IDSelectorBitmap (mask per query)", f, *ctx.timed(sel_search))


def run_faiss_hnsw(ctx: Ctx) -> None:
    import faiss

    m, efc, efs = ctx.params["m"], ctx.params["ef_construction"], ctx.params["ef"]

    def build(base: np.ndarray) -> Any:
        index = faiss.IndexHNSWFlat(DIMS, m, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = efc
        index.add(base)
        return index

    index = _faiss_common(ctx, build, "hnsw")

    def search(q: np.ndarray, k: int, ef: int, sel: Any = None) -> np.ndarray:
        p = faiss.SearchParametersHNSW()
        p.efSearch = max(ef, k)
        if sel is not None:
            p.sel = sel
        return index.search(q[None, :], k, params=p)[1][0]

    for ef in efs:
        ctx.row(f"ef={ef}", "none", *ctx.timed(lambda q, ef=ef: search(q, TOP_K, ef)))
    _hnsw_filters(ctx, lambda q, k, ef: search(q, k, ef))
    ef = max(efs)
    for f in ("60%", "1%"):
        def in_graph(q: np.ndarray, f: str = f) -> np.ndarray:
            sel, bits = _bitmap_selector(ctx, f)
            out = search(q, TOP_K, ef, sel)
            del bits
            return out

        ctx.row(f"in-graph IDSelectorBitmap ef={ef}", f, *ctx.timed(in_graph))


def _hnsw_filters(ctx: Ctx, search: Callable[[np.ndarray, int, int], np.ndarray]) -> None:
    """Over-fetch + post-filter rows at the largest ef: k' = 1.5 x 100 / selectivity, and a cheap 10x at 1%."""
    ef = max(ctx.params["ef"])
    kinds, codes = ctx.kinds, ctx.codes
    plans = [("60%", ctx.postfilter_k("60%")), ("1%", min(ctx.n, 10 * TOP_K)), ("1%", ctx.postfilter_k("1%"))]
    for f, k in plans:
        ctx.row(f"post-filter k'={k} ef={max(ef, k)}", f,
                *ctx.timed(lambda q, f=f, k=k: post_filter(search(q, k, ef), kinds, codes[f])))


def run_usearch(ctx: Ctx, dtype: str) -> None:
    from usearch.index import Index

    m, efc, efs = ctx.params["m"], ctx.params["ef_construction"], ctx.params["ef"]
    before = settle()
    base = ctx.base()
    index = Index(ndim=DIMS, metric="cos", dtype=dtype, connectivity=m, expansion_add=efc, expansion_search=efs[0])
    t0 = time.perf_counter()
    index.add(np.arange(ctx.n, dtype=np.uint64), base, threads=2)
    ctx.common["build_s"] = time.perf_counter() - t0
    del base
    ctx.memory(before, settle(), index.memory_usage)
    ctx.save_and_reload(ctx.tmp / f"usearch-{dtype}.usearch", index.save, Index.restore)

    def search(q: np.ndarray, k: int, ef: int) -> np.ndarray:
        if index.expansion_search != ef:
            index.expansion_search = ef
        return np.asarray(index.search(q, count=k, threads=1).keys, dtype=np.int64)

    for ef in efs:
        ctx.row(f"ef={ef}", "none", *ctx.timed(lambda q, ef=ef: search(q, TOP_K, ef)))
    _hnsw_filters(ctx, search)


def run_hnswlib(ctx: Ctx) -> None:
    import hnswlib

    m, efc, efs = ctx.params["m"], ctx.params["ef_construction"], ctx.params["ef"]
    before = settle()
    base = ctx.base()
    index = hnswlib.Index(space="ip", dim=DIMS)
    t0 = time.perf_counter()
    index.init_index(max_elements=ctx.n, ef_construction=efc, M=m)
    index.set_num_threads(2)
    index.add_items(base, np.arange(ctx.n))
    ctx.common["build_s"] = time.perf_counter() - t0
    index.set_num_threads(1)
    del base
    ctx.memory(before, settle(), index.index_file_size())
    ctx.save_and_reload(ctx.tmp / "hnswlib.bin", index.save_index,
                        lambda p: hnswlib.Index(space="ip", dim=DIMS).load_index(p))

    def search(q: np.ndarray, k: int, ef: int, flt: Callable[[int], bool] | None = None) -> np.ndarray:
        index.set_ef(max(ef, k))
        try:
            return index.knn_query(q, k=k, num_threads=1, filter=flt)[0][0].astype(np.int64)
        except RuntimeError:  # fewer than k found (hnswlib refuses to return a short row)
            return np.empty(0, dtype=np.int64)

    for ef in efs:
        ctx.row(f"ef={ef}", "none", *ctx.timed(lambda q, ef=ef: search(q, TOP_K, ef)))
    _hnsw_filters(ctx, search)
    ef = max(efs)
    for f in ("60%", "1%"):
        allowed = set(np.flatnonzero(ctx.mask(f)).tolist())  # a maintained label set per filter value
        k = min(TOP_K, len(allowed))  # hnswlib raises rather than return fewer than k
        ctx.row(f"in-graph filter=set.__contains__ ef={ef}", f,
                *ctx.timed(lambda q, a=allowed, k=k: search(q, k, ef, a.__contains__)))


def _sqlite_module() -> Any:
    import sqlite3

    if hasattr(sqlite3.Connection, "enable_load_extension"):
        return sqlite3
    try:
        import pysqlite3.dbapi2 as sqlite3_ext  # type: ignore[import-not-found]
    except ImportError as exc:
        raise RuntimeError("this Python's sqlite3 cannot load extensions; pip install pysqlite3-binary") from exc
    return sqlite3_ext


def run_sqlite_vec(ctx: Ctx) -> None:
    import sqlite_vec

    sqlite = _sqlite_module()
    path = ctx.tmp / "vec.sqlite3"

    def connect() -> Any:
        db = sqlite.connect(str(path), isolation_level=None)
        db.enable_load_extension(True)
        sqlite_vec.load(db)
        db.enable_load_extension(False)
        db.execute("PRAGMA journal_mode = WAL")
        db.execute("PRAGMA synchronous = FULL")
        return db

    base = ctx.base()
    db = connect()
    db.execute("PRAGMA page_size = 16384")
    db.execute("CREATE VIRTUAL TABLE vec USING vec0(embedding float[384], kind text, +vid text, +meta text)")
    t0 = time.perf_counter()
    for s in range(0, ctx.n, 5_000):
        db.execute("BEGIN")
        db.executemany(
            "INSERT INTO vec (rowid, embedding, kind, vid, meta) VALUES (?, ?, ?, ?, ?)",
            [(i + 1, base[i].tobytes(), KINDS[ctx.kinds[i]], f"{NS}:{i}",
              json.dumps({"kind": KINDS[ctx.kinds[i]], "parent_id": f"p{i // 4}", "ordinal": i % 4}))
             for i in range(s, min(ctx.n, s + 5_000))],
        )
        db.execute("COMMIT")
    ctx.common["build_s"] = time.perf_counter() - t0
    single = []
    for i in range(20):
        t0 = time.perf_counter()
        db.execute("INSERT INTO vec (rowid, embedding, kind, vid, meta) VALUES (?, ?, ?, ?, ?)",
                   (ctx.n + 1 + i, base[i].tobytes(), "single", f"single:{i}", "{}"))
        single.append(time.perf_counter() - t0)
    db.execute("DELETE FROM vec WHERE kind = 'single'")
    ctx.common["upsert1_ms"] = statistics.median(single) * 1000
    db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    db.close()
    del base
    ctx.common["file_mb"] = dir_size([path, Path(f"{path}-wal")]) / 2**20
    before = settle()
    t0 = time.perf_counter()
    db = connect()
    ctx.common["load_s"] = time.perf_counter() - t0

    def knn(q: np.ndarray, f: str) -> np.ndarray:
        sql = "SELECT rowid FROM vec WHERE embedding MATCH ? AND k = ?"
        params: list[Any] = [q.tobytes(), TOP_K]
        kinds = FILTERS[f]
        if kinds:
            sql += f" AND kind IN ({','.join('?' * len(kinds))})"
            params += list(kinds)
        return np.array([r[0] - 1 for r in db.execute(sql, params)], dtype=np.int64)

    for f in FILTERS:
        ctx.row("vec0 KNN (exact)" + (" + kind IN" if FILTERS[f] else ""), f, *ctx.timed(lambda q, f=f: knn(q, f)))
    ctx.memory(before, settle())  # the connection's page cache; the file itself sits in the OS page cache
    for r in ctx.rows:
        r.update(mem_mb_100k=ctx.common["mem_mb_100k"], lib_mem_mb_100k=None)
    db.close()


def local_metadata(i: int, kind_code: int) -> dict[str, Any]:
    return {"organization_id": NS, "kind": KINDS[kind_code], "parent_id": f"p{i // 4}", "ordinal": i % 4}


async def run_local_build(ctx: Ctx) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from services.adapters.local_vectors import LocalVectorIndex
    from services.ports import Vector

    path = ctx.tmp / "local.sqlite3"
    base = ctx.base()
    idx = LocalVectorIndex(path, dimensions=DIMS, model="bench-384")
    t0 = time.perf_counter()
    for s in range(0, ctx.n, 5_000):
        await idx.upsert([Vector(f"{NS}:{i}", base[i], NS, local_metadata(i, int(ctx.kinds[i])))
                          for i in range(s, min(ctx.n, s + 5_000))])
    build = time.perf_counter() - t0
    single = []
    for i in range(20):
        t0 = time.perf_counter()
        await idx.upsert([Vector(f"single:{i}", base[i], "other-org", {"organization_id": "other-org"})])
        single.append(time.perf_counter() - t0)
    await idx.delete_by_ids([f"single:{i}" for i in range(20)])
    await idx.checkpoint()
    await idx.close()
    print(json.dumps({"build_s": build, "upsert1_ms": statistics.median(single) * 1000,
                      "file_mb": dir_size([path, Path(f"{path}-wal")]) / 2**20}))


async def run_local_query(ctx: Ctx) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from services.adapters.local_vectors import LocalVectorIndex

    before = settle()
    t0 = time.perf_counter()
    idx = LocalVectorIndex(ctx.tmp / "local.sqlite3", dimensions=DIMS, model="bench-384")
    await idx.preload(NS)
    ctx.common["load_s"] = time.perf_counter() - t0
    ctx.memory(before, settle())
    org = {"organization_id": {"$eq": NS}}
    for f, kinds in FILTERS.items():
        flt = org if kinds is None else {**org, "kind": {"$in": list(kinds)}}
        for q in ctx.warm:
            await idx.query(q, top_k=TOP_K, namespace=NS, filter=flt, return_metadata=True)
        lat, res = [], []
        start = time.perf_counter()
        for i, q in enumerate(ctx.queries):
            t0 = time.perf_counter()
            hits = await idx.query(q, top_k=TOP_K, namespace=NS, filter=flt, return_metadata=True)
            lat.append(time.perf_counter() - t0)
            res.append(np.array([int(h.id.rsplit(":", 1)[1]) for h in hits], dtype=np.int64))
            if i >= 19 and time.perf_counter() - start > ctx.params["row_seconds"]:
                break
        label = "query, org filter" + ("" if kinds is None else f" + kind $in {list(kinds)}")
        ctx.row(label, f, lat, res, mem_after_queries_mb_100k=(settle() - before) * 100_000 / ctx.n / 2**20)
    await idx.close()


def worker(args: argparse.Namespace) -> None:
    ctx = Ctx(args)
    ctx.common = {"lib": args.worker, "dataset": ctx.ds, "n": ctx.n, "load_avg": load_avg()}
    lib = args.worker
    if lib == "local-build":
        asyncio.run(run_local_build(ctx))
        return
    runners: dict[str, Callable[[], Any]] = {
        "local": lambda: asyncio.run(run_local_query(ctx)),
        "numpy": lambda: run_numpy(ctx),
        "numpy-2t": lambda: run_numpy(ctx),
        "numpy-ivf": lambda: run_numpy_ivf(ctx),
        "faiss-flat": lambda: run_faiss_exact(ctx, "flat"),
        "faiss-sq8": lambda: run_faiss_exact(ctx, "sq8"),
        "faiss-hnsw": lambda: run_faiss_hnsw(ctx),
        "usearch-f32": lambda: run_usearch(ctx, "f32"),
        "usearch-i8": lambda: run_usearch(ctx, "i8"),
        "hnswlib": lambda: run_hnswlib(ctx),
        "sqlite-vec": lambda: run_sqlite_vec(ctx),
    }
    runners[lib]()
    print(json.dumps(ctx.rows))


# -- orchestration ---------------------------------------------------------------------------------------------


def spawn(lib: str, ds: str, n: int, data: Path, tmp: Path, params: dict[str, Any]) -> Any:
    # a fixed mmap threshold: freed numpy buffers go back to the OS, so RSS deltas are the index's alone
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072")
    threads = "2" if lib == "numpy-2t" else "1"
    if lib != "local":  # LocalVectorIndex runs with the default thread pools, as deployed
        env.update(OMP_NUM_THREADS=threads, OPENBLAS_NUM_THREADS=threads, MKL_NUM_THREADS=threads)
    p = dict(params, blas_threads=int(threads))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", lib, "--data", str(data), "--dataset", ds,
           "--n", str(n), "--tmp", str(tmp), "--params", json.dumps(p)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def fmt(v: Any, spec: str) -> str:
    return "-" if v is None else format(v, spec)


HEADER = (f"{'data':<9} {'n':>9} {'library':<11} {'variant':<44} {'filter':>6} {'p50 ms':>8} {'p95 ms':>8} "
          f"{'R@10':>5} {'R@100':>5} {'fill':>5} {'q':>4} {'load':>5}")


def line(r: dict[str, Any]) -> str:
    return (f"{r['dataset']:<9} {r['n']:>9,} {r['lib']:<11} {r['variant'][:44]:<44} {r['filter']:>6} "
            f"{fmt(r['p50_ms'], '8.2f')} {fmt(r['p95_ms'], '8.2f')} {fmt(r['recall10'], '5.3f')} "
            f"{fmt(r['recall100'], '5.3f')} {fmt(r['fill'], '5.2f')} {r['queries']:>4} {r['load_avg'].split('/')[0]:>5}")


BUILD_HEADER = (f"{'data':<9} {'n':>9} {'library':<11} {'build s':>8} {'vec/s':>8} {'1 upsert':>8} {'save s':>7} "
                f"{'open s':>7} {'file MB':>8} {'RSS MB/100k':>11} {'lib MB/100k':>11} {'RSS after 1% q':>14}")


def build_line(r: dict[str, Any], after: float | None) -> str:
    rate = r["n"] / r["build_s"] if r.get("build_s") else None
    return (f"{r['dataset']:<9} {r['n']:>9,} {r['lib']:<11} {fmt(r.get('build_s'), '8.2f')} {fmt(rate, '8,.0f')} "
            f"{fmt(r.get('upsert1_ms'), '8.2f')} {fmt(r.get('save_s'), '7.2f')} {fmt(r.get('load_s'), '7.2f')} "
            f"{fmt(r.get('file_mb'), '8.1f')} {fmt(r.get('mem_mb_100k'), '11.1f')} "
            f"{fmt(r.get('lib_mem_mb_100k'), '11.1f')} {fmt(after, '14.1f')}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="10000,100000,1000000", help="namespace sizes (comma-separated)")
    ap.add_argument("--skip-1m", action="store_true", help="drop sizes of 1,000,000 and more")
    ap.add_argument("--queries", type=int, default=200, help="queries per row at most")
    ap.add_argument("--row-seconds", type=float, default=10.0, help="stop a row after this long (>= 20 queries)")
    ap.add_argument("--datasets", default="random,clustered")
    ap.add_argument("--datasets-1m", default="clustered", help="datasets at sizes >= 1M")
    ap.add_argument("--libs", default=",".join(ALL_LIBS), help=f"from {','.join(ALL_LIBS)}")
    ap.add_argument("--libs-1m", default=DEFAULT_LIBS_1M, help="libraries at sizes >= 1M")
    ap.add_argument("--ef", default="128,400", help="HNSW efSearch values (>= 100 for top-100)")
    ap.add_argument("--m", type=int, default=16, help="HNSW M / connectivity")
    ap.add_argument("--ef-construction", type=int, default=128)
    ap.add_argument("--json", help="write every row here")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--data", help=argparse.SUPPRESS)
    ap.add_argument("--dataset", help=argparse.SUPPRESS)
    ap.add_argument("--n", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--tmp", help=argparse.SUPPRESS)
    ap.add_argument("--params", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return

    sizes = sorted(int(s) for s in args.sizes.split(","))
    if args.skip_1m:
        sizes = [s for s in sizes if s < 1_000_000]
    libs = [x for x in args.libs.split(",") if x]
    libs_1m = [x for x in args.libs_1m.split(",") if x]
    for lib in set(libs) | set(libs_1m):
        if lib not in ALL_LIBS:
            raise SystemExit(f"unknown library {lib!r}; choose from {', '.join(ALL_LIBS)}")
    datasets = [x for x in args.datasets.split(",") if x]
    datasets_1m = [x for x in args.datasets_1m.split(",") if x]
    params = {"queries": args.queries, "row_seconds": args.row_seconds, "ef": [int(x) for x in args.ef.split(",")],
              "m": args.m, "ef_construction": args.ef_construction}
    versions = {}
    for mod in ("numpy", "usearch", "hnswlib", "faiss", "sqlite_vec"):
        try:
            versions[mod] = getattr(__import__(mod), "__version__", "?")
        except ImportError:
            versions[mod] = "missing"
    print(f"{os.cpu_count()} CPUs ({platform.processor() or platform.machine()}), load average {load_avg()}; "
          f"Python {platform.python_version()}; " + ", ".join(f"{k} {v}" for k, v in versions.items()))
    print(f"sizes {sizes}; datasets {datasets} (>=1M: {datasets_1m}); HNSW M={args.m} efC={args.ef_construction} "
          f"ef={params['ef']}; top-{TOP_K}; single-query latency on 1 thread, HNSW builds on 2")
    started = time.perf_counter()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="vecbench-") as tmpdir:
        data = Path(tmpdir)
        for ds in dict.fromkeys(datasets + (datasets_1m if sizes and sizes[-1] >= 1_000_000 else [])):
            top_n = max([s for s in sizes if s < 1_000_000 or ds in datasets_1m], default=0)
            if not top_n:
                continue
            t0 = time.perf_counter()
            base, queries, kinds = make_dataset(ds, top_n, args.queries, args.seed)
            np.save(data / f"{ds}-base.npy", base)
            np.save(data / f"{ds}-queries.npy", queries)
            np.save(data / f"{ds}-kinds.npy", kinds)
            for n in sizes:
                if n > top_n:
                    continue
                for f, gt in ground_truth(base, queries[WARMUP:], kinds, n).items():
                    np.save(data / f"{ds}-{n}-gt-{f}.npy", gt)
            sims = (queries[WARMUP:] @ base[: min(top_n, 100_000)].T)
            print(f"dataset {ds}: {top_n:,} vectors made in {time.perf_counter() - t0:.1f} s; query -> nearest cosine "
                  f"median {float(np.median(sims.max(axis=1))):.3f}, 100th "
                  f"{float(np.median(np.sort(sims, axis=1)[:, -100])):.3f} (first 100k)")
            del base, sims
        print("\n" + HEADER, flush=True)
        for n in sizes:
            for ds in datasets if n < 1_000_000 else datasets_1m:
                for lib in libs if n < 1_000_000 else [x for x in libs if x in libs_1m]:
                    with tempfile.TemporaryDirectory(prefix=f"vecbench-{lib}-", dir=tmpdir) as work:
                        t0 = time.perf_counter()
                        try:
                            extra = {}
                            if lib == "local":
                                extra = spawn("local-build", ds, n, data, Path(work), params)
                            got = spawn(lib, ds, n, data, Path(work), params)
                        except Exception as exc:  # report and carry on
                            print(f"{ds:<9} {n:>9,} {lib:<11} FAILED: {exc}", flush=True)
                            continue
                        for r in got:
                            r.update(extra)
                            r["wall_s"] = time.perf_counter() - t0
                            rows.append(r)
                            print(line(r), flush=True)
    print(f"\ntotal {time.perf_counter() - started:.0f} s; load average now {load_avg()}")
    print("\nbuild (HNSW: 2 threads; local and sqlite-vec: durable batches of 5,000), disk, memory "
          "(RSS delta per 100k vectors; lib = the library's own figure)\n" + BUILD_HEADER)
    seen: dict[tuple[str, int, str], dict[str, Any]] = {}
    after: dict[tuple[str, int, str], float] = {}
    for r in rows:
        key = (r["dataset"], r["n"], r["lib"])
        seen.setdefault(key, r)
        if r.get("mem_after_queries_mb_100k") is not None and r["filter"] == "1%":
            after[key] = r["mem_after_queries_mb_100k"]
    for key, r in seen.items():
        print(build_line(r, after.get(key)))
    print("\ndurability, deletes, filters:")
    for k, v in DURABILITY.items():
        print(f"  {k:<11} {v}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
