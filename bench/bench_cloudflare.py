"""Cloudflare API requests per capture, per bulk-imported document and per search, counted by the emulator.

Starts the Cloudflare REST emulator (``python -m tests.cloudflare_emulator``, a subprocess on a temp data
dir, rate limit lifted), provisions the Vectorize index (768 dims, cosine) and its metadata indexes as the
README's wrangler steps do, then starts ``python -m api.cli serve`` (a subprocess) on D1 + Vectorize +
Workers AI pointed at it, signs up, and measures with the emulator's request counters
(``/__emulator/counters``), reset before each phase and read after the job queue has drained
(``/health`` pending_jobs == 0, twice, plus a short settle), so the background worker's requests count too:

1. per capture: K thoughts captured one by one (one client, waiting for the drain after each, so no batching
   across captures): requests per capture, by kind and op, split into "before the ack" (counters read right
   after the response: the request path, plus whatever the worker had already done by then) and the total;
2. bulk import: B thoughts from C concurrent clients, drained once: requests per document;
3. per search: S searches (POST /v1/search, top_k 10): requests per search;
4. optionally (--decisions-off) phase 1 again on a second service with MEMEX_DECISIONS=off;
5. bench_foundation.py --url against the same service at a small N (capture / search latency on the
   Cloudflare backend over the emulator on loopback; the emulator's bge is a deterministic hash embedder).

    /work/venv/bin/python bench/bench_cloudflare.py [--k 50] [--bulk 500] [--clients 4] [--searches 50]
                                                    [--foundation-n 200] [--decisions-off] [--vector-lag-ms 0]

The last line printed is a one-line JSON summary.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_foundation import (  # noqa: E402
    NoteGenerator, free_port, log, ms, queries, serve_subprocess, signup, stop, wait_healthy,
)
from services.adapters.cloudflare.vectorize import INDEXED_PROPERTIES  # noqa: E402

ACCOUNT, TOKEN = "bench-account", "bench-token"
DB, INDEX = "memex-bench-db", "memex-bench-index"
MODEL, DIMS = "@cf/baai/bge-base-en-v1.5:mean", 768  # the id the service records (model:pooling)


# -- processes --------------------------------------------------------------------------------------------

@contextmanager
def emulator_process(tmp: Path, *, vector_lag_ms: int = 0, rate_limit: int = 1_000_000):
    """The REST emulator in a subprocess (the rate limit raised: benches count requests, they are not paced);
    yields (root URL, pid, its data dir)."""
    port = free_port()
    data = tmp / "emulator"
    logpath = tmp / "emulator.log"
    with open(logpath, "w") as logf:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.cloudflare_emulator", "--port", str(port), "--data-dir", str(data),
             "--account", ACCOUNT, "--token", TOKEN, "--rate-limit", str(rate_limit),
             "--vector-lag-ms", str(vector_lag_ms)],
            cwd=ROOT, stdout=logf, stderr=subprocess.STDOUT)
        try:
            root = f"http://127.0.0.1:{port}"
            wait_healthy(f"{root}/__emulator/health", proc, logpath, timeout=120)
            yield root, proc.pid, data
        finally:
            stop(proc)


@contextmanager
def emulator(tmp: Path, vector_lag_ms: int):
    with emulator_process(tmp, vector_lag_ms=vector_lag_ms) as (root, _, _):
        yield root


def provision(root: str) -> None:
    """The index, then its metadata indexes, before any vector is written (as tests/conftest.py does)."""
    headers = {"Authorization": f"Bearer {TOKEN}"}
    base = f"{root}/client/v4/accounts/{ACCOUNT}/vectorize/v2/indexes"
    with httpx.Client(headers=headers, timeout=30) as c:
        r = c.post(base, json={"name": INDEX, "description": f"memex:model={MODEL} dims={DIMS}",
                               "config": {"dimensions": DIMS, "metric": "cosine"}})
        assert r.status_code in (200, 201), r.text
        for prop, kind in INDEXED_PROPERTIES.items():
            r = c.post(f"{base}/{INDEX}/metadata_index/create", json={"propertyName": prop, "indexType": kind})
            assert r.status_code in (200, 201), r.text
        c.post(f"{root}/__emulator/vectorize/flush")


@contextmanager
def memex_service(tmp: Path, emu_root: str, name: str, extra_env: dict | None = None):
    data_dir = tmp / name
    data_dir.mkdir(parents=True, exist_ok=True)
    env = {
        "MEMEX_SQL": "d1", "MEMEX_VECTORS": "vectorize", "MEMEX_EMBEDDER": "workers-ai",
        "CLOUDFLARE_ACCOUNT_ID": ACCOUNT, "CLOUDFLARE_API_TOKEN": TOKEN,
        "CLOUDFLARE_D1_DATABASE_ID": DB, "CLOUDFLARE_VECTORIZE_INDEX": INDEX,
        "CLOUDFLARE_API_BASE_URL": f"{emu_root}/client/v4", "MEMEX_CLOUDFLARE_BUDGET": "100000000",
        "MEMEX_DECISIONS": "on",  # the default, whatever the caller's environment says
        **(extra_env or {}),
    }
    why = {"MEMEX_SQL": "the Cloudflare path is what this bench counts (D1 on the local emulator)",
           "MEMEX_VECTORS": "Vectorize on the local emulator", "MEMEX_EMBEDDER": "Workers AI on the local emulator",
           "MEMEX_CLOUDFLARE_BUDGET": "the client-side request budget would pace the bench; it counts requests, "
                                      "not time",
           "MEMEX_DECISIONS": "the default value, set so the caller's environment cannot change it"}
    with serve_subprocess(data_dir, env, log_name="server.log", why=why) as (base, proc, _ready, _cmd):
        log(f"service {name} pid {proc.pid} on {base}")
        yield base


# -- counting ---------------------------------------------------------------------------------------------

class Counters:
    def __init__(self, emu_root: str) -> None:
        self.c = httpx.Client(base_url=f"{emu_root}/__emulator", timeout=30)

    def reset(self) -> None:
        self.c.post("/counters/reset").raise_for_status()

    def get(self) -> dict:
        r = self.c.get("/counters")
        r.raise_for_status()
        return r.json()


D1_FILE: Path | None = None  # the emulator's SQLite file for our database: read directly, so polling costs no request


def queue_state() -> tuple[int, int]:
    """(pending jobs, chunks whose vector write is not yet confirmed searchable), read from the D1 files: the
    control database routes each organization to its own D1 database, whose emulator file sits beside it."""
    import sqlite3

    def ro(path: Path) -> sqlite3.Connection:
        return sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=30)

    con = ro(D1_FILE)
    try:
        locations = [r[0] for r in con.execute("SELECT location FROM org_databases")]
    finally:
        con.close()
    jobs = muts = 0
    for loc in locations:
        con = ro(D1_FILE.with_name(f"{loc}.sqlite3"))
        try:
            jobs += con.execute("SELECT COUNT(*) FROM jobs WHERE state = 'pending'").fetchone()[0]
            muts += con.execute("SELECT COUNT(*) FROM chunks WHERE vector_mutation IS NOT NULL").fetchone()[0]
        finally:
            con.close()
    return jobs, muts


def drain(base: str, settle: float = 0.3, timeout: float = 600) -> None:
    """Until no job is pending and every vector write is confirmed, twice in a row, then a short settle.
    Polls the emulator's SQLite file, not /health: a /health call is itself a D1 request."""
    deadline = time.monotonic() + timeout
    zeros = 0
    while zeros < 2:
        if time.monotonic() > deadline:
            raise TimeoutError(f"job queue did not drain: {queue_state()}")
        zeros = zeros + 1 if queue_state() == (0, 0) else 0
        time.sleep(0.05)
    time.sleep(settle)


def idle_rate(ctr: "Counters", seconds: float = 10.0) -> dict:
    """Requests per second the service makes with nothing to do (the worker's job-table and mutation polls)."""
    ctr.reset()
    time.sleep(seconds)
    c = ctr.get()
    return {"per_s": round(c.get("total", 0) / seconds, 3),
            "by_op_per_s": {o: round(v / seconds, 3) for o, v in c.get("by_op", {}).items()}}


def per_unit(counts: dict, n: int) -> dict:
    return {
        "total": round(counts.get("total", 0) / n, 3),
        **{k: round(counts.get(k, 0) / n, 3) for k in ("d1", "vectorize", "ai", "other")},
        "by_op": {op: round(v / n, 3) for op, v in sorted(counts.get("by_op", {}).items())},
        "raw_total": counts.get("total", 0),
        # D1 requests to the control database (keys, organizations, the routing table) against every
        # organization's own: a cached key's revocation look (tenancy/keys.py) is one control request per 0.5 s
        # per process while requests arrive, however many arrive, so it is a per-process cost, not a per-unit one.
        "control_d1": round(counts.get("by_database", {}).get(DB, 0) / n, 3),
        "non_200": {s: v for s, v in counts.get("by_status", {}).items() if s != "200"},
    }


def sub(a: dict, b: dict) -> dict:
    """a - b for counter snapshots."""
    out = {k: a.get(k, 0) - b.get(k, 0) for k in ("d1", "vectorize", "ai", "other", "total")}
    ops = set(a.get("by_op", {})) | set(b.get("by_op", {}))
    out["by_op"] = {o: a.get("by_op", {}).get(o, 0) - b.get("by_op", {}).get(o, 0) for o in ops}
    out["by_op"] = {o: v for o, v in out["by_op"].items() if v}
    return out


def add(a: dict, b: dict) -> dict:
    out = {k: a.get(k, 0) + b.get(k, 0) for k in ("d1", "vectorize", "ai", "other", "total")}
    ops = set(a.get("by_op", {})) | set(b.get("by_op", {}))
    out["by_op"] = {o: a.get("by_op", {}).get(o, 0) + b.get("by_op", {}).get(o, 0) for o in ops}
    return out


# -- phases -----------------------------------------------------------------------------------------------

def phase_single(base: str, key: str, ctr: Counters, gen: NoteGenerator, start: int, k: int) -> dict:
    """K captures, one at a time, draining after each: counters right after the ack, then after the drain."""
    drain(base)
    at_ack: dict = {}
    total: dict = {}
    lat = []
    elapsed = 0.0
    with httpx.Client(base_url=base, headers={"authorization": f"Bearer {key}"}, timeout=120) as c:
        for i in range(start, start + k):
            ctr.reset()
            t_reset = time.perf_counter()
            kind, text = gen.note(i)
            t0 = time.perf_counter()
            r = c.post("/v1/thoughts", json={"content": text, "source": f"bench-{kind}"})
            lat.append(time.perf_counter() - t0)
            assert r.status_code in (200, 201), r.text
            snap_ack = ctr.get()
            drain(base, settle=0.3)
            snap_all = ctr.get()
            elapsed += time.perf_counter() - t_reset
            at_ack = add(at_ack, snap_ack)
            total = add(total, snap_all)
    return {"n": k, "before_ack": per_unit(at_ack, k), "total": per_unit(total, k), "ack_ms": ms(lat),
            "seconds": round(elapsed, 2)}


def phase_bulk(base: str, key: str, ctr: Counters, gen: NoteGenerator, start: int, n: int, clients: int) -> dict:
    drain(base)
    ctr.reset()
    t_reset = time.perf_counter()
    errors: list[str] = []

    def work(w: int) -> None:
        with httpx.Client(base_url=base, headers={"authorization": f"Bearer {key}"}, timeout=120) as c:
            for i in range(start + w, start + n, clients):
                kind, text = gen.note(i)
                r = c.post("/v1/thoughts", json={"content": text, "source": f"bench-{kind}"})
                if r.status_code not in (200, 201):
                    errors.append(r.text[:200])

    t0 = time.perf_counter()
    threads = [threading.Thread(target=work, args=(w,)) for w in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    acked = time.perf_counter() - t0
    at_ack = ctr.get()
    drain(base)
    total = ctr.get()
    assert not errors, errors[:3]
    return {"n": n, "clients": clients, "acked_s": round(acked, 2), "drained_s": round(time.perf_counter() - t0, 2),
            "before_drain": per_unit(at_ack, n), "total": per_unit(total, n),
            "seconds": round(time.perf_counter() - t_reset, 2)}


def phase_search(base: str, key: str, ctr: Counters, s: int) -> dict:
    qs = queries(s, seed=4242)
    drain(base)
    lat, hits = [], []
    with httpx.Client(base_url=base, headers={"authorization": f"Bearer {key}"}, timeout=120) as c:
        c.post("/v1/search", json={"query": "warm up", "top_k": 10})
        drain(base, settle=0.2)
        ctr.reset()
        t_reset = time.perf_counter()
        for q in qs:
            t0 = time.perf_counter()
            r = c.post("/v1/search", json={"query": q, "top_k": 10})
            lat.append(time.perf_counter() - t0)
            assert r.status_code == 200, r.text
            hits.append(len(r.json()["results"]))
    drain(base, settle=0.3)
    return {"n": s, "total": per_unit(ctr.get(), s), "seconds": round(time.perf_counter() - t_reset, 2),
            "latency_ms": ms(lat), "mean_hits": sum(hits) / len(hits)}


def phase_foundation(base: str, n: int, searches: int) -> dict:
    cmd = [sys.executable, str(ROOT / "bench" / "bench_foundation.py"), "--url", base, "--n", str(n),
           "--searches", str(searches), "--paced", "20", "--isolated", "5", "--mcp-fresh", "10",
           "--auth-samples", "100", "--fresh-keys", "3", "--index-timeout", "900"]
    log("running " + " ".join(cmd))
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3600)
    if p.returncode != 0:
        return {"error": p.returncode, "stderr": p.stderr[-2000:], "command": " ".join(cmd)}
    lines = p.stdout.strip().splitlines()
    return {"command": " ".join(cmd), "table": "\n".join(lines[:-1]), "summary": json.loads(lines[-1])}


# -- output -----------------------------------------------------------------------------------------------

def fmt_ops(d: dict) -> str:
    return ", ".join(f"{op} {v:g}" for op, v in d["by_op"].items())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--k", type=int, default=50, help="single captures, drained one by one")
    ap.add_argument("--bulk", type=int, default=500, help="thoughts in the concurrent bulk import")
    ap.add_argument("--clients", type=int, default=4, help="concurrent clients in the bulk import")
    ap.add_argument("--searches", type=int, default=50)
    ap.add_argument("--foundation-n", type=int, default=200, help="bench_foundation --n (0 skips it)")
    ap.add_argument("--foundation-searches", type=int, default=100)
    ap.add_argument("--decisions-off", action="store_true", help="also count single captures with MEMEX_DECISIONS=off")
    ap.add_argument("--vector-lag-ms", type=int, default=0, help="emulator's Vectorize apply lag")
    args = ap.parse_args()

    gen = NoteGenerator(seed=777)
    t_all = time.perf_counter()
    result: dict = {"bench": "cloudflare", "embedder": "workers-ai (emulator: hash bge, 768 dims)",
                    "vector_lag_ms": args.vector_lag_ms}
    with tempfile.TemporaryDirectory(prefix="memex-cfbench-") as tmpname:
        tmp = Path(tmpname)
        with emulator(tmp, args.vector_lag_ms) as emu_root:
            provision(emu_root)
            ctr = Counters(emu_root)
            global D1_FILE
            D1_FILE = tmp / "emulator" / "d1" / ACCOUNT / f"{DB}.sqlite3"
            with memex_service(tmp, emu_root, "service") as base:
                org = signup(base)
                key = org["key"]
                drain(base)
                log("idle request rate (10 s)")
                result["idle"] = idle_rate(ctr)
                log(f"phase 1: {args.k} single captures")
                result["capture"] = phase_single(base, key, ctr, gen, 0, args.k)
                log(f"phase 2: bulk import of {args.bulk} from {args.clients} clients")
                result["bulk"] = phase_bulk(base, key, ctr, gen, 10_000, args.bulk, args.clients)
                log(f"phase 3: {args.searches} searches")
                result["search"] = phase_search(base, key, ctr, args.searches)
                if args.foundation_n:
                    log(f"phase 5: bench_foundation --url, n={args.foundation_n}")
                    ctr.reset()
                    f = phase_foundation(base, args.foundation_n, args.foundation_searches)
                    f["emulator_requests"] = ctr.get().get("total")
                    result["foundation"] = f
            if args.decisions_off:
                with memex_service(tmp, emu_root, "service-decisions-off", {"MEMEX_DECISIONS": "off"}) as base2:
                    org2 = signup(base2)
                    log(f"phase 4: {args.k} single captures, MEMEX_DECISIONS=off")
                    result["capture_decisions_off"] = phase_single(base2, org2["key"], ctr, gen, 20_000, args.k)

    idle_s = result["idle"]["per_s"]
    for name in ("capture", "capture_decisions_off", "bulk", "search"):
        ph = result.get(name)
        if ph:
            ph["net_of_idle_per_unit"] = round((ph["total"]["raw_total"] - idle_s * ph["seconds"]) / ph["n"], 3)

    # -- print
    print()
    print("Memex Cloudflare requests (D1 + Vectorize + Workers AI, on the emulator over loopback)")
    print()
    print(f"{'phase':<52} {'total':>7} {'d1':>6} {'vect':>6} {'ai':>6}")

    def line(label: str, d: dict) -> None:
        print(f"{label:<52} {d['total']:>7.2f} {d['d1']:>6.2f} {d['vectorize']:>6.2f} {d['ai']:>6.2f}")
        print(f"{'':<6}by op: {fmt_ops(d)}")

    cap = result["capture"]
    line(f"per capture, before the ack (x{cap['n']})", cap["before_ack"])
    line("per capture, total incl. worker (drained)", cap["total"])
    if "capture_decisions_off" in result:
        off = result["capture_decisions_off"]
        line("per capture, MEMEX_DECISIONS=off, before the ack", off["before_ack"])
        line("per capture, MEMEX_DECISIONS=off, total", off["total"])
    b = result["bulk"]
    line(f"per document, bulk {b['n']} from {b['clients']} clients, total", b["total"])
    s = result["search"]
    line(f"per search, top_k 10 (x{s['n']})", s["total"])
    print()
    print(f"idle (worker polls, nothing to do): {idle_s:g} requests/s "
          f"({', '.join(f'{o} {v:g}' for o, v in result['idle']['by_op_per_s'].items())}) = {idle_s * 300:,.0f} per 5 min")
    for name, label in (("capture", "per capture"), ("capture_decisions_off", "per capture, decisions off"),
                        ("bulk", "per bulk document"), ("search", "per search")):
        if name in result:
            ph = result[name]
            print(f"{label}, net of idle polling over the phase's {ph['seconds']} s: {ph['net_of_idle_per_unit']:g}")
    print(f"per search, D1 requests to the control database: {s['total']['control_d1']:g} (API-key revocation looks, at "
          f"most one per 0.5 s per process while requests arrive: {s['total']['control_d1'] * s['n'] / s['seconds']:.2f}/s "
          f"over this phase's {s['n'] / s['seconds']:.1f} searches/s); to the organization's database: "
          f"{s['total']['d1'] - s['total']['control_d1']:g}")
    print(f"single capture ack: p50 {cap['ack_ms']['p50']} ms, p95 {cap['ack_ms']['p95']} ms;  "
          f"search: p50 {s['latency_ms']['p50']} ms, p95 {s['latency_ms']['p95']} ms, {s['mean_hits']:.1f} hits")
    print(f"bulk: {b['n']} acked in {b['acked_s']} s, drained in {b['drained_s']} s")
    if "foundation" in result:
        f = result["foundation"]
        print()
        print("bench_foundation.py --url on this backend:")
        print(f.get("table") or f)
        print(f"  (Cloudflare requests during it: {f.get('emulator_requests')})")
    print(f"\nbench wall time {time.perf_counter() - t_all:,.0f} s")
    summary = dict(result)
    if "foundation" in summary:
        summary["foundation"] = {k: v for k, v in summary["foundation"].items() if k != "table"}
    print(json.dumps(summary, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
