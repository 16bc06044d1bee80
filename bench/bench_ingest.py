"""Ingest throughput and capture latency, with the product's defaults, against the raw embedder in the same run.

    .venv/bin/python bench/bench_ingest.py                      # SciFact (5,183 abstracts): ~10 minutes on 2 cores
    .venv/bin/python bench/bench_ingest.py --docs 1000          # a quick run
    .venv/bin/python bench/bench_ingest.py --scale 100000       # also: capture rate into an empty organization and
                                                                # into one holding 100k thoughts (in process)

Parts (the service a subprocess, ``python -m api.cli serve``, the embedded default: SQLite, the local vector index,
MiniLM int8 ONNX; no setting changed but the rate limits bench_foundation lifts):

1. **capture latency**: ``--single`` captures (SciFact abstracts), one client, sequential, ``POST /v1/thoughts`` with
   the defaults: acknowledged p50 / p95 (the write-time decision is made by the worker: "pending").
2. **bulk import**: the rest of the corpus through ``POST /v1/thoughts:batch`` (1,000 per request): time to
   acknowledged, then until every chunk is vector-indexed (``/health`` pending_jobs 0 and the organization's chunks
   all indexed, read from its SQLite file). Documents/s end to end, and the worker's embedding rate in chunks/s over
   its window (the server's own ``indexed_at`` stamps).
3. **raw embedder**: the same chunk texts, read from the organization's database, embedded in this process by the
   embedder the service builds (``OnnxMiniLMEmbedder`` on the graph recorded for this machine), sorted by length,
   64 per call, while the service is idle. The ratio of 2 to 3 is the figure (aim >= 85%).
4. with ``--scale N``: in process (no worker, the hash embedder: the write path alone is timed), sequential capture
   rate into an empty organization (3 rounds of 1,000 captures, the median), then ``N`` thoughts added with
   ``capture_many`` (timed), then the capture rate again (aim: within 20%). ``--scale-only``: this part alone.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_foundation import bench_data_dir, cpu_seconds, rss_mb, serve_subprocess  # noqa: E402

SCIFACT = ROOT.parent / "shared" / "data" / "scifact" / "corpus.jsonl"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def pct(samples: list[float], q: float) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


def corpus(limit: int | None) -> list[str]:
    with open(SCIFACT, encoding="utf-8") as f:
        docs = [json.loads(line) for line in f if line.strip()]
    return [f"{d['title']}\n\n{d['text']}" for d in docs[:limit]]


def org_db(data_dir: Path) -> Path:
    (db,) = list((data_dir / "orgs").glob("*/memex.sqlite3"))
    return db


def chunk_stats(db: Path, since_ms: int = 0) -> tuple[int, int, int | None, int | None]:
    """(chunks, indexed, first indexed_at, last indexed_at) of the organization's thought chunks (the stamps: of the
    chunks indexed since ``since_ms``)."""
    with sqlite3.connect(db) as conn:
        total, indexed = conn.execute("SELECT COUNT(*), COUNT(indexed_at) FROM chunks WHERE kind = 'thought'").fetchone()
        first, last = conn.execute("SELECT MIN(indexed_at), MAX(indexed_at) FROM chunks WHERE kind = 'thought' "
                                   "AND indexed_at >= ?", (since_ms,)).fetchone()
        return total, indexed, first, last


def service_part(texts: list[str], single: int) -> dict:
    out: dict = {"docs": len(texts), "single_captures": single}
    with bench_data_dir(None, "memex-ingest-") as data_dir:
        with serve_subprocess(data_dir, {}) as (base, proc, _ready, _cmd):
            with httpx.Client(base_url=base, timeout=600) as c:
                key = c.post("/v1/signup", json={"name": "Ingest", "slug": "ingest-bench"}).json()["api_key"]["key"]
                c.headers["authorization"] = f"Bearer {key}"
                lat = []
                for text in texts[:single]:
                    t0 = time.perf_counter()
                    r = c.post("/v1/thoughts", json={"content": text, "source": "scifact"})
                    lat.append((time.perf_counter() - t0) * 1000)
                    assert r.status_code == 201, r.text
                out["capture_ms"] = {"p50": round(pct(lat, 50), 2), "p95": round(pct(lat, 95), 2),
                                     "mean": round(statistics.fmean(lat), 2)}
                log(f"single captures: p50 {out['capture_ms']['p50']} ms, p95 {out['capture_ms']['p95']} ms")
                rest = texts[single:]
                t0, t0_ms = time.monotonic(), int(time.time() * 1000)
                cpu0 = cpu_seconds(proc.pid)
                for start in range(0, len(rest), 1000):
                    r = c.post("/v1/thoughts:batch", json={"items": [{"content": t, "source": "scifact"}
                                                                     for t in rest[start:start + 1000]]})
                    assert r.status_code == 200 and r.json()["failed"] == 0, r.text[:300]
                acked = time.monotonic() - t0
                log(f"bulk: {len(rest)} acknowledged in {acked:.1f} s")
                db = org_db(data_dir)
                while True:
                    total, indexed, _, _ = chunk_stats(db)
                    if total and indexed == total and c.get("/health").json()["pending_jobs"] == 0:
                        break
                    time.sleep(1.0)
                done = time.monotonic() - t0
                total, _, first, last = chunk_stats(db, t0_ms)
                with sqlite3.connect(db) as conn:
                    bulk_chunks = conn.execute("SELECT COUNT(*) FROM chunks WHERE kind = 'thought' AND indexed_at >= ?",
                                               (t0_ms,)).fetchone()[0]
                    texts_db = [r[0] for r in conn.execute("SELECT content FROM chunks WHERE kind = 'thought'")]
                    decisions = dict(conn.execute("SELECT json_extract(decision, '$.action'), COUNT(*) FROM documents "
                                                  "GROUP BY 1").fetchall())
                # the worker's embedding rate: the bulk's chunks over the window of their indexed_at stamps
                window = (last - first) / 1000 if last and first and last > first else done
                out.update({
                    "bulk_docs": len(rest), "bulk_acked_s": round(acked, 1), "bulk_to_searchable_s": round(done, 1),
                    "docs_per_s_end_to_end": round(len(rest) / done, 2), "chunks": total,
                    "service_chunks_per_s": round(bulk_chunks / window, 2), "embed_window_s": round(window, 1),
                    "server_cpu_s": round((cpu_seconds(proc.pid) or 0) - (cpu0 or 0), 1),
                    "server_rss_mb": rss_mb(proc.pid), "decisions": decisions,
                })
                log(f"bulk: searchable after {done:.1f} s ({out['docs_per_s_end_to_end']} docs/s), "
                    f"{out['service_chunks_per_s']} chunks/s")
    out["chunk_texts"] = texts_db
    return out


def raw_part(texts: list[str]) -> dict:
    from api.composition.backend import embedder_for
    from api.settings import Settings

    # The embedder the service builds, with its cache: the graph recorded for this machine (the service's own
    # choice), not a new timing's pick. On this shared machine the two graphs' speeds move from day to day, and a
    # raw run on the other graph would measure a ceiling the service was never running.
    emb = embedder_for(Settings(embedder="local"), None)
    emb.embed_sync(texts[:8])  # load the model
    ordered = sorted(texts, key=emb.count_tokens)
    t0, c0 = time.monotonic(), time.process_time()
    for start in range(0, len(ordered), 64):
        emb.embed_sync(ordered[start:start + 64])
    seconds = time.monotonic() - t0
    return {"chunks": len(texts), "seconds": round(seconds, 1), "chunks_per_s": round(len(texts) / seconds, 2),
            "cpu_s": round(time.process_time() - c0, 1), "graph": emb.graph_in_use}


async def scale_part(n: int, probes: int = 1000, rounds: int = 3) -> dict:
    from api.settings import Settings
    from api.wiring import Memex
    from tenancy.models import AuthContext

    with tempfile.TemporaryDirectory(prefix="memex-scale-") as tmp:
        memex = Memex(Settings(data_dir=Path(tmp), embedder="hash", run_worker=False))
        await memex.start(worker=False)
        try:
            org, _ = await memex.orgs.create(name="Scale", slug="scale-bench")
            thoughts = (await memex.for_org(AuthContext(org.id, org.slug, "bench", frozenset({"admin"})))).thoughts

            async def rate(tag: str) -> float:
                t0 = time.perf_counter()
                for i in range(probes):
                    await thoughts.capture(f"{tag} probe note {i}: the shed key hangs by the door {i * 13}.")
                return probes / (time.perf_counter() - t0)

            # rounds of `probes` captures each side, the median round: one short round is at the mercy of the machine
            empties = [await rate(f"empty{k}") for k in range(rounds)]
            empty = statistics.median(empties)
            log(f"scale: {empty:.0f} captures/s into an empty organization (rounds: {[round(x) for x in empties]}); "
                f"adding {n} thoughts")
            t0 = time.perf_counter()
            for start in range(0, n, 1000):
                await thoughts.capture_many([{"content": f"Scale note {i}: lot {i % 977} holds {i} crates of pears."}
                                             for i in range(start, min(n, start + 1000))])
            added = time.perf_counter() - t0
            fulls = [await rate(f"full{k}") for k in range(rounds)]
            full = statistics.median(fulls)
            log(f"scale: {full:.0f} captures/s at {n} thoughts (rounds: {[round(x) for x in fulls]}); the {n} were added "
                f"in {added:.1f} s ({n / added:.0f}/s, capture_many of 1,000)")
            return {"thoughts": n, "empty_captures_per_s": round(empty, 1), "full_captures_per_s": round(full, 1),
                    "ratio": round(full / empty, 3), "rounds": rounds, "probes": probes,
                    "added_per_s": round(n / added, 1)}
        finally:
            await memex.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--docs", type=int, default=None, help="SciFact documents (default: all 5,183)")
    ap.add_argument("--single", type=int, default=200, help="single captures timed before the bulk import")
    ap.add_argument("--scale", type=int, default=0, help="thoughts for the capture-rate-at-scale part (0: skip)")
    ap.add_argument("--scale-only", action="store_true", help="only the capture-rate-at-scale part")
    args = ap.parse_args()
    if args.scale_only:
        print(json.dumps({"scale": asyncio.run(scale_part(args.scale or 100_000))}, indent=1))
        return
    log(f"machine: {os.cpu_count()} cores; load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    texts = corpus(args.docs)
    svc = service_part(texts, args.single)
    chunk_texts = svc.pop("chunk_texts")
    log("raw embedder on the same chunks (the service has stopped)")
    raw = raw_part(chunk_texts)
    result = {"service": svc, "raw": raw, "ratio": round(svc["service_chunks_per_s"] / raw["chunks_per_s"], 3)}
    log(f"raw embedder ({raw['graph']} graph, the one recorded for the service): {raw['chunks_per_s']} chunks/s; "
        f"service/raw = {result['ratio']:.0%}")
    if args.scale:
        result["scale"] = asyncio.run(scale_part(args.scale))
    result["load_end"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
