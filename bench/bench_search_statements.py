"""Where a search's time goes, statement by statement: ``Search.search`` in process over a kept
``bench_search_scale.py`` set, each SQL statement timed (wall time in its thread, grouped by its first 150
characters), for the same queries asked several rounds (round 0: each query the first time; later rounds: repeats)::

    .venv/bin/python bench/bench_search_statements.py --data-dir DIR             # DIR: bench_search_scale.py --keep
    .venv/bin/python bench/bench_search_statements.py --data-dir DIR --rounds 3

The service is built as ``memex serve`` builds it (``api.wiring.Memex``), with one setting changed, printed:
``embedder="hash"`` (the set was loaded with it; the query's MiniLM embedding is not what this measures). Prints, per
round, the search's p50 / mean and the process's CPU per search, then the statements that took the most time.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import re
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_foundation import queries, stored_org_search  # noqa: E402


async def measure(data_dir: Path, n_queries: int, rounds: int, top: int) -> dict:
    from services.adapters import sqlite as sqlite_adapter
    from services.search.search import SearchOptions

    spent: dict[str, list[float]] = collections.defaultdict(list)
    plain = sqlite_adapter.SqliteDatabase._run_one

    def timed(self, sql, params):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        try:
            return plain(self, sql, params)
        finally:
            spent[re.sub(r"\s+", " ", sql)[:150]].append(time.perf_counter() - t0)

    sqlite_adapter.SqliteDatabase._run_one = timed  # type: ignore[method-assign]
    print("settings changed: embedder=hash (the set was loaded with it; the query's embedding is not measured)")
    out: dict = {"bench": "search_statements", "queries": n_queries, "rounds": []}
    qs = queries(n_queries)
    try:
        async with stored_org_search(data_dir) as search:
            for rnd in range(rounds):
                spent.clear()
                lat: list[float] = []
                cpu = time.process_time()
                for q in qs:
                    t0 = time.perf_counter()
                    await search.search(SearchOptions(query=q, top_k=10))
                    lat.append((time.perf_counter() - t0) * 1000)
                cpu_ms = (time.process_time() - cpu) * 1000 / len(qs)
                p50, mean = statistics.median(lat), statistics.mean(lat)
                print(f"round {rnd} ({'first time' if rnd == 0 else 'repeats'}): p50 {p50:.2f} ms, "
                      f"mean {mean:.2f} ms, CPU {cpu_ms:.2f} ms a search")
                stmts = sorted(spent.items(), key=lambda kv: -sum(kv[1]))[:top]
                for sql, times in stmts:
                    print(f"  {len(times):4d} x {statistics.mean(times) * 1000:6.2f} ms = "
                          f"{sum(times) * 1000 / len(qs):6.2f} ms a search  {sql}")
                out["rounds"].append({
                    "p50": round(p50, 2), "mean": round(mean, 2), "cpu_ms": round(cpu_ms, 2),
                    "statements": [{"sql": s, "n": len(t), "ms_per_search": round(sum(t) * 1000 / len(qs), 2)}
                                   for s, t in stmts],
                })
    finally:
        sqlite_adapter.SqliteDatabase._run_one = plain  # type: ignore[method-assign]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data-dir", type=Path, required=True, help="a bench_search_scale.py --keep data directory")
    ap.add_argument("--queries", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--top", type=int, default=6, help="statements printed per round")
    args = ap.parse_args()
    print(json.dumps(asyncio.run(measure(args.data_dir, args.queries, args.rounds, args.top))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
