"""Query latency of LocalVectorIndex for one organization of 1k, 10k and 100k random 384-dim vectors.

A second, busy namespace (100k vectors, loaded in memory) sits beside them to show that a query scans only
its own namespace. Every query carries the organization filter OrgVectors adds (``organization_id $eq``,
non-selective); extra rows show a selective filter (~1% of the namespace) and the in-memory scan alone.

    /work/venv/bin/python bench/bench_vectors.py [--memory] [--queries N]

``--memory`` keeps the SQLite store in memory instead of a temporary file (no disk I/O in the load phase).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.adapters.local_vectors import LocalVectorIndex  # noqa: E402
from services.adapters.vector_filters import compile_filter  # noqa: E402
from services.adapters.vector_matrix import search_locked  # noqa: E402
from services.ports import Vector  # noqa: E402

DIMS = 384
SIZES = (1_000, 10_000, 100_000)
BUSY = ("busy-org", 100_000)
BATCH = 5_000


def fmt(samples: list[float]) -> str:
    ms = sorted(s * 1000 for s in samples)
    p95 = ms[min(len(ms) - 1, int(round(0.95 * (len(ms) - 1))))]
    return f"median {statistics.median(ms):8.3f} ms   p95 {p95:8.3f} ms"


async def fill(idx: LocalVectorIndex, ns: str, n: int, rng: np.random.Generator) -> float:
    t0 = time.perf_counter()
    for start in range(0, n, BATCH):
        m = min(BATCH, n - start)
        vals = rng.standard_normal((m, DIMS), dtype=np.float32)
        bucket = rng.integers(0, 100, size=m)
        await idx.upsert(
            [
                Vector(
                    f"{ns}:{start + i}",
                    vals[i],
                    ns,
                    {"organization_id": ns, "kind": "note", "bucket": int(bucket[i]), "tags": ["a", f"t{bucket[i] % 7}"]},
                )
                for i in range(m)
            ]
        )
    return time.perf_counter() - t0


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--memory", action="store_true", help="in-memory SQLite instead of a temp file")
    ap.add_argument("--queries", type=int, default=200, help="queries per row (a quarter of it at 100k)")
    args = ap.parse_args()
    rng = np.random.default_rng(42)
    started = time.perf_counter()

    with tempfile.TemporaryDirectory() as tmp:
        path = None if args.memory else Path(tmp) / "vectors.sqlite3"
        idx = LocalVectorIndex(path, dimensions=DIMS, model="bench-384")
        print(f"store: {path or ':memory:'}; {DIMS} dims; {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")

        namespaces = [(f"org-{n // 1000}k", n) for n in SIZES] + [BUSY]
        for ns, n in namespaces:
            secs = await fill(idx, ns, n, rng)
            print(f"upsert {ns:>10}: {n:>7} vectors in {secs:6.2f} s ({n / secs:,.0f}/s, batches of {BATCH})")

        single = []
        for i in range(50):
            t0 = time.perf_counter()
            await idx.upsert([Vector(f"single:{i}", rng.standard_normal(DIMS), "org-1k", {"organization_id": "org-1k"})])
            single.append(time.perf_counter() - t0)
        print(f"upsert one vector (durable):   {fmt(single)}")

        for ns, _ in namespaces:  # load every namespace, busy one included, before timing
            t0 = time.perf_counter()
            await idx.query(rng.standard_normal(DIMS), top_k=1, namespace=ns)
            print(f"first query (lazy load) {ns:>10}: {(time.perf_counter() - t0) * 1000:8.1f} ms")

        print()
        for ns, n in namespaces[:-1]:
            count = args.queries if n <= 10_000 else max(20, args.queries // 4)
            queries = rng.standard_normal((count, DIMS), dtype=np.float32)
            org = {"organization_id": {"$eq": ns}}
            rows = {
                "query(top_k=10, org filter)": dict(top_k=10, filter=org),
                "query(top_k=10, no filter)": dict(top_k=10),
                "query(top_k=10, org + 1% filter)": dict(top_k=10, filter={**org, "bucket": 7}),
                "query(top_k=50, metadata)": dict(top_k=50, filter=org, return_metadata=True),
            }
            print(f"namespace {ns} ({n:,} vectors; {BUSY[0]} holds {BUSY[1]:,} more), {count} queries per row")
            for label, kw in rows.items():
                samples = []
                for q in queries:
                    t0 = time.perf_counter()
                    await idx.query(q, namespace=ns, **kw)
                    samples.append(time.perf_counter() - t0)
                print(f"  {label:<34} {fmt(samples)}")
            space = idx._spaces[ns]
            pred = compile_filter({"organization_id": {"$eq": ns}})
            samples = []
            for q in queries:
                qn = q / np.linalg.norm(q)
                t0 = time.perf_counter()
                search_locked(space, (qn, 10, pred, False, False))
                samples.append(time.perf_counter() - t0)
            print(f"  {'scan only (no async, no validation)':<34} {fmt(samples)}")

        # isolation check: the busy namespace's own vector is never returned elsewhere
        (probe,) = await idx.get_by_ids([f"{BUSY[0]}:0"])
        hits = await idx.query(probe.values, top_k=100, namespace="org-1k")
        assert all(h.namespace == "org-1k" for h in hits), "namespace leak"
        print(f"\nisolation: busy namespace's exact vector queried in org-1k -> best {hits[0].score:.3f}, none leaked")
        await idx.close()
    print(f"total {time.perf_counter() - started:.1f} s; load average now {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    asyncio.run(main())
