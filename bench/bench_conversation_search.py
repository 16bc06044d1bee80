"""Conversation search at 1,000 conversations, in process, stage by stage (issue 13, item 4).

    .venv/bin/python bench/bench_conversation_search.py --data /tmp/convdata --build   # once: ~30-60 min
    .venv/bin/python bench/bench_conversation_search.py --data /tmp/convdata           # each measurement: ~1 min
    .venv/bin/python bench/bench_conversation_search.py --data /tmp/convdata --root ../before   # another checkout

``--build`` fills ``--data`` with bench_conversations.py's scale set (1,000 conversations x 100 messages of English
prose: 100,000 messages, 134,000 chunks, hash embedder) and its 200 queries (``meta.json``). A measurement opens it
(no worker: the data never changes), warms up with 5 searches, then times, for the first ``--queries`` queries:
the keyword side and the vector side alone (``Search._keyword`` / ``Search._vector``, one after the other),
the whole search once per query (``search_first``: the analysed-message cache then holds only what earlier
queries left) and the best of 3 per query (``search_best3``, what bench/README.md's earlier figures quote), and
the conversation hydrator within those searches. ``--root`` measures another checkout's product code on the
same data (a before/after pair: alternate them, the machine is shared).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


async def build(data: Path) -> None:
    import bench_conversations as bc
    from conversation_data import build_prose

    data.mkdir(parents=True, exist_ok=True)
    convs = build_prose(1000, 100, bc.scifact_sentences(), seed=20261122 + 1)
    memex, svc, key = await bc.open_org(data, "hash", "bench-scale")
    try:
        ids, took = await bc.load(svc, convs.conversations, 100)
        print(f"loaded in {took:.0f} s; embedding (hash) ...", flush=True)
        await memex.worker.drain(timeout=7200)
    finally:
        await memex.stop()
    rng = random.Random(20261122)
    queries = bc.english_queries(rng, 100) + bc.english_queries_from(rng, convs, 100)
    (data / "meta.json").write_text(json.dumps({"key": key, "ids": ids, "queries": queries}))


async def measure(data: Path, n: int) -> None:
    from bench_foundation import stored_org_search
    from services.search.search import SearchOptions

    queries = json.loads((data / "meta.json").read_text())["queries"][:n]
    async with stored_org_search(data) as search:
        kinds = list(search.hydrators["conversation"].chunk_kinds)
        for q in queries[:5]:
            await search.search(SearchOptions(query=q, kinds=("conversation",)))
        t: dict[str, list[float]] = {k: [] for k in ("keyword", "vector", "search_first", "search_best3", "hydrate")}
        hydrator = search.hydrators["conversation"]
        cls = type(hydrator)
        plain = cls.__call__

        async def timed(self, sql, group, opts):  # type: ignore[no-untyped-def]
            t0 = time.perf_counter()
            try:
                return await plain(self, sql, group, opts)
            finally:
                t["hydrate"].append(time.perf_counter() - t0)

        cls.__call__ = timed  # type: ignore[method-assign]
        for q in queries:
            t0 = time.perf_counter()
            await search._keyword(q, kinds, None, 100)
            t["keyword"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            await search._vector(q, kinds, None, 100)
            t["vector"].append(time.perf_counter() - t0)
        cpu = time.process_time()
        for q in queries:
            t0 = time.perf_counter()
            await search.search(SearchOptions(query=q, top_k=10, kinds=("conversation",)))
            t["search_first"].append(time.perf_counter() - t0)
        cpu = time.process_time() - cpu
        for q in queries:
            best = float("inf")
            for _ in range(3):
                t0 = time.perf_counter()
                await search.search(SearchOptions(query=q, top_k=10, kinds=("conversation",)))
                best = min(best, time.perf_counter() - t0)
            t["search_best3"].append(best)
        cls.__call__ = plain  # type: ignore[method-assign]
        summary: dict = {"queries": len(queries)}
        for name, v in t.items():
            v.sort()
            p50, p90, mean = (round(x * 1000, 2) for x in (statistics.median(v), v[int(0.9 * len(v))], statistics.mean(v)))
            print(f"{name:13s} p50 {p50:7.2f}  p90 {p90:7.2f}  mean {mean:7.2f} ms  (n={len(v)})")
            summary[name] = {"p50": p50, "p90": p90, "mean": mean}
        summary["cpu_ms_per_search"] = round(cpu * 1000 / len(queries), 1)
        summary["load_avg"] = round(os.getloadavg()[0], 2)
        print(f"CPU per search (search_first, all threads): {summary['cpu_ms_per_search']} ms; "
              f"load average {summary['load_avg']}")
        print(json.dumps(summary))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, required=True, help="the data directory (made by --build)")
    p.add_argument("--build", action="store_true", help="fill --data with the 1,000-conversation set first")
    p.add_argument("--queries", type=int, default=100)
    p.add_argument("--root", type=Path, default=HERE.parent, help="checkout whose product code to measure")
    args = p.parse_args()
    sys.path[:0] = [str(args.root.resolve()), str(HERE)]
    if args.build:
        asyncio.run(build(args.data))
    asyncio.run(measure(args.data, args.queries))


if __name__ == "__main__":
    main()
