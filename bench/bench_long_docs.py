"""Search over long thoughts: what a hit costs when its document is long (tens of thousands of words).

    .venv/bin/python bench/bench_long_docs.py                      # 60 thoughts of 40,000 words, then of 300
    .venv/bin/python bench/bench_long_docs.py --words 40000 --root OTHER_CHECKOUT   # another checkout's code

One organization on the embedded backend (a subprocess, ``python -m api.cli serve`` of ``--root``), ``--docs``
thoughts of ``--words`` words each, every one holding the query's two words, so that each search hydrates 30 of
them (top_k 10, over-fetched 3x). Then ``--searches`` searches without and with ``include_content``, alternated
twice, p50 over HTTP and the response's size. One setting is changed, printed: ``MEMEX_EMBEDDER=hash``, because what
this measures is reading the documents, not embedding them (MiniLM would take ~20 minutes to embed 2.4M words).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

WHY = {"MEMEX_EMBEDDER": "hash: the cost measured is reading long documents, not embedding them"}


def note(rng: random.Random, vocab: list[str], words: int, i: int) -> str:
    return f"# note {i} zebra\n\n" + " ".join(rng.choice(vocab) for _ in range(words)) + " zebra giraffe"


def measure(root: Path, words: int, docs: int, searches: int) -> dict:
    sys.path.insert(0, str(root / "bench"))
    from bench_foundation import serve_subprocess  # the checkout's own (it starts that checkout's service)

    rng = random.Random(5)
    vocab = [f"w{i}" for i in range(5000)]
    out: dict = {"words": words, "docs": docs}
    with tempfile.TemporaryDirectory() as d, \
            serve_subprocess(Path(d), {"MEMEX_EMBEDDER": "hash"}, why=WHY) as (base, _proc, _r, _c), \
            httpx.Client(base_url=base, timeout=600) as c:
        key = c.post("/v1/signup", json={"name": "Long", "slug": "long-docs"}).json()["api_key"]["key"]
        c.headers["authorization"] = f"Bearer {key}"
        items = [{"content": note(rng, vocab, words, i)} for i in range(docs)]
        for k in range(0, docs, 10):
            c.post("/v1/thoughts:batch", json={"items": items[k:k + 10]}).raise_for_status()
        while c.get("/health").json().get("pending_jobs"):
            time.sleep(0.5)
        lat: dict[bool, list[float]] = {False: [], True: []}
        size: dict[bool, int] = {}
        for include in (False, True, False, True):
            for _ in range(searches):
                t0 = time.perf_counter()
                r = c.post("/v1/search", json={"query": "zebra giraffe", "top_k": 10, "include_content": include})
                lat[include].append((time.perf_counter() - t0) * 1000)
                assert r.status_code == 200 and len(r.json()["results"]) == 10, r.text[:300]
                size[include] = len(r.content)
        for include in (False, True):
            out["with_content" if include else "without_content"] = {
                "p50_ms": round(statistics.median(lat[include]), 2), "response_kb": round(size[include] / 1e3, 1)}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--words", type=int, action="append", help="words a thought (default: 40,000, then 300)")
    ap.add_argument("--docs", type=int, default=60)
    ap.add_argument("--searches", type=int, default=40, help="searches per round (two rounds each way)")
    ap.add_argument("--root", type=Path, default=HERE.parent, help="checkout whose service to measure")
    args = ap.parse_args()
    results = [measure(args.root.resolve(), w, args.docs, args.searches) for w in (args.words or [40_000, 300])]
    for r in results:
        a, b = r["without_content"], r["with_content"]
        print(f"{r['docs']} thoughts of {r['words']:,} words: search p50 {a['p50_ms']:.2f} ms ({a['response_kb']} kB); "
              f"with include_content {b['p50_ms']:.2f} ms ({b['response_kb']} kB)")
    print(json.dumps({"bench": "long_docs", "root": str(args.root), "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
