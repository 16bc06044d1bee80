"""Scale on the Worker backend (issue 15), against the local Worker (`memex cloudflare dev`'s stack: `wrangler dev
--local` running worker/, D1 and one SQLite Durable Object per organization simulated by miniflare, the Cloudflare
emulator standing in for Vectorize and Workers AI).

1. **Many organizations, no deploy step**: N organizations (default 10,000) each get their own Durable Object, created
   on first use by name, migrated (migrations/org, inside the object) and written to (one thought row, its keyword
   rows by trigger) by one signed protocol request each, C at a time. Prints organizations per second, first-write
   latency p50/p95, and checks a sample reads back its own row only.
2. **Through the service** (`memex serve`'s app with MEMEX_BACKEND=worker, in process, real HTTP on loopback), with
   Cloudflare REST credentials pointing at a second emulator that counts every call (the data path must make none):
   K organizations sign up; each captures T thoughts one by one, then B thoughts in one `POST /v1/thoughts:batch`;
   after the job queue drains (every vector written), Worker requests per capture (single captures, and amortised
   over the bulk import) from the service's own Worker client counters, and Cloudflare REST requests: 0.
3. **Keyword statistics per organization**: organization A's explain for a query is read, organization B then writes
   many documents full of the query's words, and A's explain is read again: the keyword scores are unchanged (each
   organization's bm25 statistics live in its own Durable Object).

    .venv/bin/python bench/bench_worker.py [--orgs 10000] [--concurrency 32] [--k 20] [--t 10] [--b 200]

Needs Node.js and `npm ci --prefix worker`. The last line printed is a one-line JSON summary.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from api.cloudflare_dev_cli import start_dev  # noqa: E402
from api.composition.worker import client_of  # noqa: E402
from services.adapters.cloudflare.worker_client import WorkerClient  # noqa: E402
from tests.cloudflare_emulator import running_emulator  # noqa: E402
from tests.conftest import signup, start_live  # noqa: E402


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))] if s else float("nan")


async def many_orgs(url: str, secret: str, n: int, concurrency: int) -> dict:
    latencies: list[float] = []
    sem = asyncio.Semaphore(concurrency)
    now = int(time.time() * 1000)
    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0),
                                 limits=httpx.Limits(max_connections=concurrency * 2)) as http:
        client = WorkerClient(http, url=url, secret=secret)

        async def one(i: int) -> None:
            org = f"org_bench{i:08d}"
            content = f"Organization {i} remembers the heron count at pond {i % 97}."
            stmt = {"sql": "INSERT INTO documents (organization_id, id, content, content_hash, created_at, updated_at) "
                           "VALUES (?, ?, ?, ?, ?, ?)",
                    "params": [org, f"doc{i}", content, hashlib.sha256(content.encode()).hexdigest(), now, now]}
            async with sem:
                t0 = time.perf_counter()
                (res,) = await client.send([{"op": "sql.batch", "db": f"org:{org}", "statements": [stmt]}],
                                           idempotent=False)
                latencies.append((time.perf_counter() - t0) * 1000)
            if not res.get("ok"):
                raise RuntimeError(f"{org}: {res}")

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(n)))
        elapsed = time.perf_counter() - t0
        # a sample reads back exactly its own row, and its keyword index finds it
        sample = sorted({0, n - 1, *range(0, n, max(1, n // 20))})
        for i in sample:
            org = f"org_bench{i:08d}"
            (res,) = await client.send([{"op": "sql.batch", "db": f"org:{org}", "statements": [
                {"sql": "SELECT organization_id, id FROM documents", "params": []},
                {"sql": "SELECT COUNT(*) AS n FROM documents_fts WHERE documents_fts MATCH 'heron'", "params": []}]}],
                idempotent=True)
            rows, fts = res["results"][0]["rows"], res["results"][1]["rows"]
            assert rows == [[org, f"doc{i}"]], (org, rows)
            assert fts == [[1]], (org, fts)
        return {"organizations": n, "seconds": round(elapsed, 1), "orgs_per_s": round(n / elapsed, 1),
                "first_write_p50_ms": round(pct(latencies, 0.5), 1), "first_write_p95_ms": round(pct(latencies, 0.95), 1),
                "requests": client.requests, "sample_checked": len(sample)}


def drain(server, timeout: float = 300.0) -> None:
    with server.client() as c:
        deadline = time.monotonic() + timeout
        quiet = 0
        while time.monotonic() < deadline:
            if c.get("/health").json().get("pending_jobs", 0) == 0:
                quiet += 1
                if quiet >= 3:
                    return
            else:
                quiet = 0
            time.sleep(0.2)
    raise TimeoutError("the job queue did not drain")


def through_service(stack, args) -> dict:
    with running_emulator() as trap, tempfile.TemporaryDirectory() as tmp:
        server, ctx = start_live(
            Path(tmp), embedder="workers-ai", backend="worker", worker_url=stack.url, worker_secret=stack.secret,
            cloudflare_vectorize_index=stack.index, cloudflare_account_id=trap.account,
            cloudflare_api_token=trap.token, cloudflare_api_base_url=trap.base_url)
        try:
            client = client_of(server.memex.backend.http)
            assert client is not None, "the service is not on the Worker backend"
            orgs = [signup(server, "wb") for _ in range(args.k)]
            drain(server)
            before = client.requests
            acks: list[float] = []
            with server.client() as c:
                for o in orgs:
                    for j in range(args.t):
                        t0 = time.perf_counter()
                        r = c.post("/v1/thoughts", headers=o.headers,
                                   json={"content": f"{o.slug} single capture {j}: the kiln fires at dawn on day {j}."})
                        acks.append((time.perf_counter() - t0) * 1000)
                        assert r.status_code == 201, r.text
            drain(server)
            singles = args.k * args.t
            per_single = (client.requests - before) / singles
            before = client.requests
            with server.client() as c:
                for o in orgs:
                    items = [{"content": f"{o.slug} bulk {j}: shipment {j} of copper wire left the depot."}
                             for j in range(args.b)]
                    r = c.post("/v1/thoughts:batch", headers=o.headers, json={"items": items})
                    assert r.status_code in (200, 201, 207), r.text
            drain(server)
            bulk = args.k * args.b
            per_bulk = (client.requests - before) / bulk

            # keyword statistics: A's explain before and after B floods the same words
            a, b = orgs[0], orgs[1]
            q = {"query": "kiln fires dawn", "explain": True, "top_k": 3, "kinds": ["thought"]}
            with server.client() as c:
                first = c.post("/v1/search", headers=a.headers, json=q).json()["results"]
                flood = [{"content": f"kiln fires at dawn and the kiln fires again, kiln number {j}"} for j in range(300)]
                r = c.post("/v1/thoughts:batch", headers=b.headers, json={"items": flood})
                assert r.status_code in (200, 201, 207), r.text
                drain(server)
                second = c.post("/v1/search", headers=a.headers, json=q).json()["results"]
                other = c.post("/v1/search", headers=b.headers, json=q).json()["results"]

            def keyword(results):
                return [(h["document_id"], h["explain"].get("keyword_rank"), h["explain"].get("keyword_score"))
                        for h in results]
            isolated = keyword(first) == keyword(second)
            rest = trap.counters_snapshot()
            return {
                "organizations": args.k, "single_captures": singles, "worker_requests_per_capture": round(per_single, 2),
                "capture_ack_p50_ms": round(pct(acks, 0.5), 1), "bulk_captures": bulk,
                "worker_requests_per_bulk_capture": round(per_bulk, 3),
                "rest_requests_on_data_path": rest["total"],
                "keyword_stats_isolated": isolated, "explain_before": keyword(first)[:1], "explain_after": keyword(second)[:1],
                "other_org_top": keyword(other)[:1], "worker_ops": client.snapshot().get("ops"),
            }
        finally:
            ctx.__exit__(None, None, None)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--orgs", type=int, default=10_000)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--k", type=int, default=20, help="organizations through the service")
    p.add_argument("--t", type=int, default=10, help="single captures per organization")
    p.add_argument("--b", type=int, default=200, help="bulk-imported thoughts per organization")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        stack = start_dev(ROOT, port=0, state_dir=Path(tmp) / "dev", say=lambda m: None)
        print(f"local Worker up in {time.perf_counter() - t0:.1f} s at {stack.url}", flush=True)
        with stack:
            one = asyncio.run(many_orgs(stack.url, stack.secret, args.orgs, args.concurrency))
            print("many organizations:", json.dumps(one), flush=True)
            two = through_service(stack, args)
            print("through the service:", json.dumps(two), flush=True)
    print(json.dumps({"many_orgs": one, "service": two}))


if __name__ == "__main__":
    main()
