"""How much of the exact top 100 a cheaper first pass of the vector index keeps, on real MiniLM vectors.

The local vector index (services.adapters.vector_matrix) scores every row with an int8 pass, then rescores its best
``rescored(depth)`` rows (300 for a search's depth of 100) in float32. That pass is a memory-bound scan of the int8
matrix (bench/README.md, "Where the pass's time goes"). A sign-bit pass would read 8x fewer bytes. This bench
measures what it would lose: SciFact's abstracts, chunked as the service chunks them, and its queries, embedded with
the service's MiniLM graph (the embedder and cache `memex serve` uses); for each first pass and candidate count, the
share of the exact float32 top 100 (R@100) and top 10 (R@10) that rescoring the candidates in float32 gives back.

    .venv/bin/python bench/bench_first_stage.py --cache /tmp/first-stage     # ~10-20 min to embed on 2 cores, once
    .venv/bin/python bench/bench_first_stage.py --index DIR                  # the vectors of a kept search-scale set

The embeddings are kept in ``--cache`` (``chunks.npy``, ``queries.npy``; ``chunks-N.npy`` with ``--docs N``) and
reused when present. Product defaults: the local MiniLM embedder, the service's chunk size and overlap. Nothing here
changes a setting.

``--index DIR`` reads the vectors instead from a data directory kept by ``bench_search_scale.py --embedder local
--keep`` (~100,000 MiniLM chunks of bench_foundation's notes, as the service stored them: its largest namespace)
and embeds that bench's queries (``--queries``, the same seed), so the candidate share can be read at 10x SciFact's
size. Such a set is only meaningful when it was loaded with MiniLM (``--embedder local``); a hash-embedded set is
refused.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_scifact import DEFAULT_DATA, content_of, load_corpus, load_queries  # noqa: E402

from services.adapters.onnx_embedder import OnnxMiniLMEmbedder, user_cache_dir  # noqa: E402
from services.adapters.vector_matrix import quantize, rescored  # noqa: E402
from services.search.fusion import VECTOR_DEPTH as DEPTH  # noqa: E402
from services.text.chunking import chunk_text, default_chunk_params  # noqa: E402


def embeddings(dataset: Path, cache: Path, docs: int | None) -> tuple[np.ndarray, np.ndarray]:
    """(chunks x 384, queries x 384), unit rows; embedded once and kept in ``cache`` (``docs``: the first that many
    abstracts only, for a quick look, cached apart from the whole corpus's)."""
    cache.mkdir(parents=True, exist_ok=True)
    xs, qs = cache / ("chunks.npy" if docs is None else f"chunks-{docs}.npy"), cache / "queries.npy"
    if not (xs.exists() and qs.exists()):
        emb = OnnxMiniLMEmbedder(optimized_cache_dir=user_cache_dir())
        max_tokens, overlap = default_chunk_params(emb)
        chunks = [c for d in load_corpus(dataset)[:docs]
                  for c in chunk_text(content_of(d), count_tokens=emb.count_tokens, max_tokens=max_tokens,
                                      overlap_tokens=overlap)]
        queries = list(load_queries(dataset).values())
        print(f"embedding {len(chunks)} chunks and {len(queries)} queries", flush=True)
        t0 = time.perf_counter()
        np.save(qs, emb.embed_sync(queries))
        parts = []
        for i in range(0, len(chunks), 64):
            parts.append(emb.embed_sync(chunks[i:i + 64]))
            if i % 1280 == 0:
                print(f"  {i}/{len(chunks)} chunks, {time.perf_counter() - t0:.0f} s", flush=True)
        np.save(xs, np.vstack(parts))
        print(f"embedded in {time.perf_counter() - t0:.0f} s with the {emb.graph_in_use} graph", flush=True)
    return unit(np.load(xs)), unit(np.load(qs))


def unit(m: np.ndarray) -> np.ndarray:
    """``m``'s rows as float32 unit vectors (a copy)."""
    m = m.astype(np.float32)
    return m / np.linalg.norm(m, axis=1, keepdims=True)


def kept_index(data_dir: Path, count: int) -> tuple[np.ndarray, np.ndarray]:
    """(chunks x 384, queries x 384), unit rows: the largest namespace of the organization's vector file in a kept
    bench_search_scale.py data directory, and that bench's first ``count`` distinct queries, embedded as the service
    embeds a query."""
    import sqlite3

    from bench_search_scale import search_queries

    (path,) = list((data_dir / "orgs").glob("*/vectors.sqlite3"))
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
        model = dict(db.execute("SELECT key, value FROM meta").fetchall()).get("model")
        emb = OnnxMiniLMEmbedder(optimized_cache_dir=user_cache_dir())
        if model != emb.model_id:
            raise SystemExit(f"{path} holds {model} vectors, not {emb.model_id}: load it with --embedder local")
        (ns,) = db.execute("SELECT namespace FROM vectors GROUP BY namespace ORDER BY COUNT(*) DESC LIMIT 1").fetchone()
        blobs = [b for (b,) in db.execute('SELECT "values" FROM vectors WHERE namespace = ?', (ns,))]
    x = np.frombuffer(b"".join(blobs), dtype=np.float32).reshape(len(blobs), -1)
    return unit(x), unit(emb.embed_sync(search_queries(count)))


def best(scores: np.ndarray, k: int) -> np.ndarray:
    """Per row of ``scores``, the columns of its ``k`` largest (any order)."""
    return np.argpartition(-scores, k - 1, axis=1)[:, :k]


def recall(first: np.ndarray, exact: np.ndarray, top100: np.ndarray, top10: np.ndarray,
           candidates: int) -> tuple[float, float]:
    """R@100 and R@10 of rescoring each query's ``candidates`` best rows by ``first`` with the ``exact`` scores
    (``top100`` / ``top10``: each query's exact best, ``best(exact, ...)``)."""
    cand = best(first, candidates)
    r100 = r10 = 0.0
    for i in range(len(exact)):
        ranked = cand[i][np.argsort(-exact[i, cand[i]], kind="stable")]
        r100 += len(set(top100[i]) & set(ranked[:DEPTH])) / DEPTH
        r10 += len(set(top10[i]) & set(ranked[:10])) / 10
    return r100 / len(exact), r10 / len(exact)


def signs(m: np.ndarray) -> np.ndarray:
    s = np.sign(m)
    s[s == 0] = 1
    return s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dataset", default=str(DEFAULT_DATA), help="BEIR SciFact directory")
    source = ap.add_mutually_exclusive_group(required=True)
    source.add_argument("--cache", help="directory for the SciFact embeddings (reused when present)")
    source.add_argument("--index", help="a data directory kept by bench_search_scale.py --embedder local --keep")
    ap.add_argument("--docs", type=int, help="embed only the first N abstracts (a quick look; default: all 5,183)")
    ap.add_argument("--queries", type=int, default=200, help="with --index: distinct queries (default 200, as there)")
    args = ap.parse_args()
    if args.index:
        x, q = kept_index(Path(args.index), args.queries)
    else:
        x, q = embeddings(Path(args.dataset), Path(args.cache), args.docs)
    n = len(x)
    print(f"{n} chunks, {len(q)} queries; exact = float32 cosine, top {DEPTH}")
    exact = q @ x.T
    top100, top10 = best(exact, DEPTH), best(exact, 10)
    q8, inv = quantize(x)
    qq, _ = quantize(q)
    # int8 products summed over 384 dimensions stay below 2**24, so a float32 product of the int8 values is exact
    int8 = (qq.astype(np.float32) @ q8.astype(np.float32).T) * inv[None, :]
    rows = [("int8 (today)", int8, [rescored(DEPTH)])]
    mean = x.mean(axis=0)
    shares = [300, 500, 1000, 2000, 4000] if n < 50_000 else [1000, 2000, 4000, 8000, 16000, 20000]
    rows.append(("sign bits", signs(q) @ signs(x).T, shares))
    rows.append(("sign bits, centred", signs(q - mean) @ signs(x - mean).T, shares[2:4]))
    print("| first pass | candidates | share of rows | R@100 | R@10 |\n|---|---|---|---|---|")
    for name, first, counts in rows:
        for c in counts:
            if c <= n:
                r100, r10 = recall(first, exact, top100, top10, c)
                print(f"| {name} | {c:,} | {100 * c / n:.1f}% | {r100:.4f} | {r10:.4f} |", flush=True)


if __name__ == "__main__":
    main()
