"""The keyword side's engine at ~100,000 chunks: SQLite FTS5's bm25 (what the service runs) against tantivy (a
maintained Rust search library with Python bindings, BM25 with block-max WAND top-k), on the documents of a kept
``bench_search_scale.py`` set and its 200 queries. Not a dependency of the service: it runs from its own
virtualenv, with the repository on the path::

    python3 -m venv /work/kw-venv && /work/kw-venv/bin/pip install tantivy msgspec httpx
    /work/kw-venv/bin/python bench/bench_keyword_engines.py --data-dir DIR    # DIR: bench_search_scale.py --keep

Why: at 100k chunks, FTS5 scores every row a query matches before it sorts them, and that is most of a search's
CPU (bench/README.md, "Where a search's CPU goes at 100k chunks"). Measured, each on one thread, each query
three times (the best kept, then the median over queries):

1. FTS5 as the service runs it: the selective words (``services.search.selective``: common words left out, or the
   match anchored on the rarest), ``ORDER BY rank LIMIT 100``;
2. FTS5 over every query word ORed: BM25 over the whole query, the reference ranking;
3. tantivy over every query word ORed (``en_stem``), top 100;
4. tantivy with the service's selective words (the same words as 1, the anchor as a required term).

For each: latency p50 / mean, and the top-100 overlap with 2 (the documents both return in their first 100; the
tokenizers differ: FTS5's porter, tantivy's Snowball English). Also tantivy's index build time, size on disk and the
process's RSS growth while it is open.

Then quality, on a corpus with judgements: SciFact (5,183 abstracts, its 300 test queries; ``../shared/data``), BM25
alone, every query word ORed, in an FTS5 table made as the service makes ``documents_fts`` (``porter unicode61``)
and in a tantivy index: nDCG@10 of each (the synthetic 100k set has no judgements).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import resource
import shutil
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from api.heap import resident_mb  # noqa: E402
from bench_foundation import queries  # noqa: E402
from bench_scifact import DEFAULT_DATA, content_of, evaluate, load_corpus, load_qrels, load_queries  # noqa: E402

from services.search.fusion import fts_phrases, query_terms  # noqa: E402
from services.search.selective import COMMON_MIN_ROWS, COMMON_SHARE  # noqa: E402


def best_of(fn, *args, times: int = 3) -> tuple[float, list]:
    best, out = float("inf"), []
    for _ in range(times):
        t0 = time.perf_counter()
        out = fn(*args)
        best = min(best, time.perf_counter() - t0)
    return best * 1000, out


def summary(ms: list[float]) -> str:
    return f"p50 {statistics.median(ms):6.2f}  mean {statistics.mean(ms):6.2f} ms"


def scifact_quality(tantivy) -> dict:
    """nDCG@10 of BM25 alone on SciFact's test queries: FTS5 (porter unicode61, bm25()) and tantivy (en_stem)."""
    corpus = load_corpus(DEFAULT_DATA)
    qrels = load_qrels(DEFAULT_DATA, "test")
    qtext = load_queries(DEFAULT_DATA)
    qids = sorted(qrels, key=lambda x: int(x) if x.isdigit() else x)
    db = sqlite3.connect(":memory:")
    db.execute("CREATE VIRTUAL TABLE t USING fts5(content, doc UNINDEXED, tokenize = 'porter unicode61')")
    db.executemany("INSERT INTO t (content, doc) VALUES (?, ?)", [(content_of(d), d["_id"]) for d in corpus])
    sb = tantivy.SchemaBuilder()
    sb.add_text_field("doc", stored=True, tokenizer_name="raw")
    sb.add_text_field("content", stored=False, tokenizer_name="en_stem")
    tmp = Path(tempfile.mkdtemp(prefix="kwbench-scifact-"))
    try:
        index = tantivy.Index(sb.build(), path=str(tmp))
        writer = index.writer(heap_size=64_000_000, num_threads=1)
        for d in corpus:
            writer.add_document(tantivy.Document(doc=d["_id"], content=content_of(d)))
        writer.commit()
        writer.wait_merging_threads()
        index.reload()
        searcher = index.searcher()
        runs: dict[str, dict[str, list[str]]] = {"fts5": {}, "tantivy": {}}
        for q in qids:
            words = query_terms(qtext[q])
            runs["fts5"][q] = [r[0] for r in db.execute(
                "SELECT doc FROM t WHERE t MATCH ? ORDER BY rank LIMIT 100", (fts_phrases(words),))] if words else []
            query = tantivy.Query.boolean_query([(tantivy.Occur.Should, index.parse_query(w, ["content"]))
                                                 for w in words])
            runs["tantivy"][q] = [searcher.doc(a)["doc"][0] for _, a in searcher.search(query, 100).hits]
        return {name: round(evaluate(run, {q: qrels[q] for q in qids}, 100)["ndcg@10"], 2)
                for name, run in runs.items()} | {"queries": len(qids)}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data-dir", type=Path, required=True, help="a bench_search_scale.py --keep data directory")
    ap.add_argument("--queries", type=int, default=200)
    args = ap.parse_args()
    import tantivy

    path = glob.glob(str(args.data_dir / "orgs" / "*" / "memex.sqlite3"))[0]
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    n_rows = db.execute("SELECT max(rowid) FROM documents_fts").fetchone()[0]
    cap = max(COMMON_MIN_ROWS, int(n_rows * COMMON_SHARE))
    counts: dict[str, int] = {}

    def count(w: str) -> int:
        if w not in counts:
            counts[w] = db.execute("SELECT COUNT(*) FROM documents_fts WHERE documents_fts MATCH ?",
                                   (f'"{w}"',)).fetchone()[0]
        return counts[w]

    qs = queries(args.queries)
    plans = []  # (all words, selective words, anchor or None): the service's rule (services.search.selective)
    for q in qs:
        words = query_terms(q)
        held = sorted((w for w in words if count(w)), key=lambda w: (counts[w], w))
        rare = [w for w in held if counts[w] < cap]
        if rare:
            plans.append((words, rare, None))
        elif len(held) >= 2:
            plans.append((words, held[1:], held[0]))
        else:
            plans.append((words, held or words, None))

    # tantivy: the documents' text, keyed by the FTS rowid
    tmp = Path(tempfile.mkdtemp(prefix="kwbench-"))
    try:
        rss0 = resident_mb()
        t0 = time.perf_counter()
        sb = tantivy.SchemaBuilder()
        sb.add_integer_field("pk", stored=True, indexed=True, fast=True)
        sb.add_text_field("content", stored=False, tokenizer_name="en_stem")
        schema = sb.build()
        index = tantivy.Index(schema, path=str(tmp))
        writer = index.writer(heap_size=128_000_000, num_threads=1)
        docs = 0
        for pk, content in db.execute("SELECT rowid, content FROM documents_fts"):
            writer.add_document(tantivy.Document(pk=pk, content=content))
            docs += 1
        writer.commit()
        writer.wait_merging_threads()
        index.reload()
        build_s = time.perf_counter() - t0
        searcher = index.searcher()
        size_mb = sum(p.stat().st_size for p in tmp.rglob("*") if p.is_file()) / 1e6
        rss_open = resident_mb() - rss0

        def fts(match: str) -> list[int]:
            return [r[0] for r in db.execute(
                "SELECT rowid FROM documents_fts WHERE documents_fts MATCH ? ORDER BY rank LIMIT 100", (match,))]

        def tan(words: list[str], anchor: str | None) -> list[int]:
            should = [(tantivy.Occur.Should, index.parse_query(w, ["content"])) for w in words]
            if anchor is not None:
                should.append((tantivy.Occur.Must, index.parse_query(anchor, ["content"])))
            hits = searcher.search(tantivy.Query.boolean_query(should), 100).hits
            return [searcher.doc(addr)["pk"][0] for _, addr in hits]

        runs: dict[str, list[float]] = {k: [] for k in ("fts_service", "fts_all", "tantivy_all", "tantivy_service")}
        overlap: dict[str, list[float]] = {k: [] for k in runs}
        for words, sel, anchor in plans:
            service_match = (f'"{anchor}" AND ({fts_phrases(sel)})' if anchor else fts_phrases(sel))
            t, ref = best_of(fts, fts_phrases(words))
            runs["fts_all"].append(t)
            for name, fn, fn_args in (("fts_service", fts, (service_match,)),
                                      ("tantivy_all", tan, (words, None)),
                                      ("tantivy_service", tan, (sel, anchor))):
                t, got = best_of(fn, *fn_args)
                runs[name].append(t)
                overlap[name].append(len(set(got) & set(ref)) / max(1, len(ref)))
            overlap["fts_all"].append(1.0)
        quality = scifact_quality(tantivy)
        cpu = resource.getrusage(resource.RUSAGE_SELF)
        print(f"\nKeyword engines over {docs:,} documents ({n_rows:,} FTS rows), {len(plans)} queries, best of 3 each")
        for name, label in (("fts_service", "FTS5, the service's selective match"),
                            ("fts_all", "FTS5, every query word (reference)"),
                            ("tantivy_all", "tantivy, every query word"),
                            ("tantivy_service", "tantivy, the selective words")):
            print(f"  {label:40s} {summary(runs[name])}   top-100 overlap with the reference "
                  f"{statistics.mean(overlap[name]):.3f}")
        print(f"  tantivy index: built in {build_s:.1f} s (one thread), {size_mb:.1f} MB on disk, "
              f"RSS +{rss_open:.1f} MB while open")
        print(f"  SciFact, BM25 alone, {quality['queries']} queries: nDCG@10 FTS5 {quality['fts5']}, "
              f"tantivy {quality['tantivy']}")
        print(json.dumps({
            "bench": "keyword_engines", "documents": docs, "queries": len(plans),
            "ms": {k: {"p50": round(statistics.median(v), 2), "mean": round(statistics.mean(v), 2)} for k, v in runs.items()},
            "overlap_with_fts_all": {k: round(statistics.mean(v), 3) for k, v in overlap.items()},
            "tantivy": {"build_s": round(build_s, 1), "size_mb": round(size_mb, 1), "rss_mb": round(rss_open, 1)},
            "scifact_ndcg10": quality,
            "cpu_s": round(cpu.ru_utime + cpu.ru_stime, 1), "load_avg": round(os.getloadavg()[0], 2),
        }))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
