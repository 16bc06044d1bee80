"""Many organizations: sign-up, capture and search across N organizations, with the server's memory, open
files and disk watched as they accumulate (one database per organization, at most MEMEX_MAX_OPEN_ORGS open).

Starts ``python -m api.cli serve`` in a separate process with the product's defaults
(``bench_foundation.serve_subprocess``: only the rate limits are lifted, every changed setting is printed with
its reason) on a fresh data directory, then, over HTTP:

1. **first pass, sequential** (one keep-alive client): for each of ``--orgs`` organizations, sign up
   (``POST /v1/signup``), capture ``--notes`` notes (``POST /v1/thoughts``, 100-400-word markdown from
   ``bench_foundation.NoteGenerator``, different in every organization) and run one search
   (``POST /v1/search``, top_k 10);
2. **first pass, concurrent**: ``--concurrent-orgs`` more organizations, same steps, from ``--clients``
   concurrent clients (sign-up latency and throughput under concurrency);
3. waits until ``/health`` shows no pending job (every note vector-indexed; checked thought by thought at
   the end);
4. **second pass**: in every organization again, in sign-up order: ``GET /v1/org`` (authenticated but opens
   no handle of the organization; its key's 60-second verification cache has expired by then, so this is
   the argon2id verification a long-idle key pays), then a search (with N far above the open-handle bound the
   organization was evicted long ago, so this search reopens its database and vector file), then the same
   search again (handles open): the difference of the two searches is the reopening.

Searches use a pool of ``--query-pool`` (default 50) distinct queries, so the model's query embedding is cached
for nearly all of them in both passes: the pass-1 / pass-2 difference is the organization's handles, not the
model. Pass-1 searches also compete with the indexing backlog.

Printed: sign-up p50/p95 overall and for the first and last 100 sign-ups, and for ``--signup-probes`` (20)
sign-ups on the idle service (no indexing backlog) before the first pass and after the second (so growth with
the number of organizations is told apart from the backlog's load); capture p50 (an organization's first
capture, which opens its store, apart); search p50 in each pass; how long ``GET /health`` took while the
backlog drained; the server's RSS, threads and open file descriptors (``/proc/<pid>/status``,
``/proc/<pid>/fd``, by kind, and how many organizations have a file open) every ``--sample-every``
organizations and at the end; files under ``data_dir/orgs`` and the data directory's size. On Cloudflare
(``--backend cloudflare``: D1 + Vectorize + Workers AI on the local emulator, ``tests/cloudflare_emulator``)
also the D1 databases the emulator holds, the REST requests per sign-up (emulator counters read around each
probe sign-up) and per organization over the whole sequential first pass.

``--code REV`` runs the same bench against another revision (e.g. 12ab7a1, the single-database release): a
``git worktree`` of it in /tmp, its server started from there (cwd and ``PYTHONPATH`` the worktree,
``MEMEX_MIGRATIONS_DIR`` its migrations: the installed package points at this checkout), removed afterwards.

    .venv/bin/python bench/bench_orgs.py [--orgs 1000] [--notes 3] [--backend embedded|cloudflare|both]
                                         [--concurrent-orgs 100] [--clients 4] [--code REV]

The last line printed is a one-line JSON summary (one per backend run).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import bench_foundation as bf
from bench_foundation import (
    NoteGenerator,
    bench_data_dir,
    code_revision,
    log,
    pct,
    queries,
    serve_subprocess,
)

from bench_cloudflare import ACCOUNT, INDEX, TOKEN, emulator_process, provision

CONTROL_DB = "memex-bench-control"


# -- the server's process --------------------------------------------------------------------------------

def proc_stats(pid: int) -> dict:
    """RSS, peak RSS, threads and open file descriptors (by kind) of a process, from /proc."""
    out: dict = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            k, _, v = line.partition(":")
            if k in ("VmRSS", "VmHWM"):
                out[k] = round(int(v.split()[0]) / 1024, 1)
            elif k == "Threads":
                out["threads"] = int(v)
    except OSError:
        return {}
    fds = sqlite = sockets = other = 0
    orgs: set[str] = set()
    fd_dir = Path(f"/proc/{pid}/fd")
    try:
        names = os.listdir(fd_dir)
    except OSError:
        names = []
    for name in names:
        try:
            target = os.readlink(fd_dir / name)
        except OSError:
            continue
        fds += 1
        if ".sqlite3" in target:
            sqlite += 1
            if "/orgs/" in target:
                orgs.add(target.split("/orgs/", 1)[1].split("/", 1)[0])
        elif target.startswith("socket:"):
            sockets += 1
        else:
            other += 1
    return {"rss_mb": out.get("VmRSS"), "peak_rss_mb": out.get("VmHWM"), "threads": out.get("threads"), "fds": fds,
            "fds_sqlite": sqlite, "fds_socket": sockets, "fds_other": other, "orgs_with_open_files": len(orgs)}


def disk(path: Path) -> dict:
    """Files and bytes under ``path`` (apparent size and allocated blocks), and files under ``path/orgs``."""
    files = org_files = 0
    apparent = allocated = 0
    for dirpath, _dirs, filenames in os.walk(path):
        for f in filenames:
            try:
                st = os.stat(os.path.join(dirpath, f))
            except OSError:
                continue
            files += 1
            apparent += st.st_size
            allocated += st.st_blocks * 512
            if f"{os.sep}orgs" in dirpath[len(str(path)):]:
                org_files += 1
    return {"files": files, "files_under_orgs": org_files, "apparent_mb": round(apparent / 2**20, 1),
            "allocated_mb": round(allocated / 2**20, 1)}


# -- the workload -----------------------------------------------------------------------------------------

class Run:
    """Everything measured during one backend's run (lists of seconds unless named otherwise)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.orgs: list[dict] = []  # index -> {slug, key, query, ids}
        self.signup: list[float] = []  # sequential, in order
        self.signup_conc: list[float] = []
        self.capture_first: list[float] = []  # each organization's first capture (opens its store)
        self.capture_rest: list[float] = []
        self.capture_by_org: list[float] = []  # sequential: median capture per organization, in order
        self.capture_conc: list[float] = []
        self.search1: list[float] = []
        self.search1_conc: list[float] = []
        self.idle2: list[float] = []  # second pass: seconds since the organization's last request
        self.auth2: list[float] = []  # second pass: GET /v1/org (the key cache, 60 s, has expired: argon2id)
        self.search2_reopen: list[float] = []
        self.search2_open: list[float] = []
        self.hits1: list[int] = []
        self.hits2: list[int] = []
        self.samples: list[dict] = []
        self.errors: list[str] = []


def one_org(c: httpx.Client, i: int, notes: int, gen: NoteGenerator, qs: list[str], run_id: str) -> dict:
    """Sign up organization ``i``, capture its notes, search once. Returns its record and latencies."""
    slug = f"o{i}-{run_id}"
    t0 = time.perf_counter()
    r = c.post("/v1/signup", json={"name": f"Bench org {i}", "slug": slug})
    t_signup = time.perf_counter() - t0
    if r.status_code != 201:
        raise RuntimeError(f"sign-up {i}: {r.status_code} {r.text[:300]}")
    body = r.json()
    key = body["api_key"]["key"]
    headers = {"authorization": f"Bearer {key}"}
    caps, ids, chunks = [], [], 0
    for j in range(notes):
        kind, text = gen.note(i * notes + j)
        t0 = time.perf_counter()
        r = c.post("/v1/thoughts", headers=headers, json={"content": text, "source": f"bench-{kind}"})
        caps.append(time.perf_counter() - t0)
        if r.status_code not in (200, 201):
            raise RuntimeError(f"capture {i}/{j}: {r.status_code} {r.text[:300]}")
        ids.append(r.json()["id"])
        chunks += r.json().get("chunks") or 0
    q = qs[i % len(qs)]
    t0 = time.perf_counter()
    r = c.post("/v1/search", headers=headers, json={"query": q, "top_k": 10})
    t_search = time.perf_counter() - t0
    if r.status_code != 200:
        raise RuntimeError(f"search {i}: {r.status_code} {r.text[:300]}")
    org = {"i": i, "slug": slug, "key": key, "query": q, "ids": ids, "chunks": chunks, "last": time.perf_counter()}
    return {"org": org, "signup": t_signup,
            "captures": caps,
            "search": t_search, "hits": len(r.json()["results"])}


def whoami(c: httpx.Client, org: dict) -> float:
    """GET /v1/org: authenticated, but opens none of the organization's handles (its store object is cached;
    its database and vector file open on their first statement)."""
    t0 = time.perf_counter()
    r = c.get("/v1/org", headers={"authorization": f"Bearer {org['key']}"})
    dt = time.perf_counter() - t0
    if r.status_code != 200:
        raise RuntimeError(f"whoami {org['i']}: {r.status_code} {r.text[:300]}")
    return dt


def search_once(c: httpx.Client, org: dict) -> tuple[float, int]:
    t0 = time.perf_counter()
    r = c.post("/v1/search", headers={"authorization": f"Bearer {org['key']}"}, json={"query": org["query"], "top_k": 10})
    dt = time.perf_counter() - t0
    if r.status_code != 200:
        raise RuntimeError(f"search {org['i']}: {r.status_code} {r.text[:300]}")
    return dt, len(r.json()["results"])


def wait_drained(base: str, timeout: float, health: list, quiet_polls: int = 3, every: float = 2.0) -> float:
    """Until ``/health`` shows no pending job ``quiet_polls`` times in a row (polled every ``every`` s); returns
    when it first did. Appends (pending jobs, seconds the /health call took) to ``health``."""
    deadline = time.monotonic() + timeout
    zeros, first_zero, last_log = 0, None, time.monotonic()
    with httpx.Client(base_url=base, timeout=120) as c:
        while zeros < quiet_polls:
            t0 = time.perf_counter()
            pending = c.get("/health").json()["pending_jobs"]
            health.append((pending, time.perf_counter() - t0))
            if pending == 0:
                zeros += 1
                first_zero = first_zero or time.perf_counter()
            else:
                zeros, first_zero = 0, None
            if time.monotonic() > deadline:
                raise TimeoutError(f"{pending} jobs still pending after {timeout} s")
            if time.monotonic() - last_log > 15:
                last_log = time.monotonic()
                log(f"waiting for the index: {pending} jobs pending (/health took {health[-1][1] * 1000:.0f} ms)")
            time.sleep(every)
    return first_zero


def not_indexed(base: str, orgs: list[dict]) -> int:
    """Thoughts whose ``GET /v1/thoughts/{id}`` does not show them indexed (run after the second pass: it
    touches every organization)."""
    missing = 0
    with httpx.Client(base_url=base, timeout=120) as c:
        for org in orgs:
            for tid in org["ids"]:
                r = c.get(f"/v1/thoughts/{tid}", headers={"authorization": f"Bearer {org['key']}"})
                if r.status_code != 200 or r.json()["indexing"]["state"] != "indexed":
                    missing += 1
    return missing


# -- Cloudflare: the emulator ------------------------------------------------------------------------------

def d1_databases(root: str) -> int:
    r = httpx.get(f"{root}/client/v4/accounts/{ACCOUNT}/d1/database", params={"per_page": 10},
                  headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60)
    r.raise_for_status()
    return int(r.json()["result_info"]["total_count"])


def counters(root: str, reset: bool = False) -> dict:
    r = httpx.post(f"{root}/__emulator/counters/reset", timeout=30) if reset else \
        httpx.get(f"{root}/__emulator/counters", timeout=30)
    r.raise_for_status()
    return r.json()


def wait_idle(root: str, quiet_s: float = 2.0, timeout: float = 120.0) -> float:
    """Until the service makes no Cloudflare request for ``quiet_s`` (the worker's last confirmations, the
    use recorder's flush); returns the seconds waited."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        counters(root, reset=True)
        time.sleep(quiet_s)
        if counters(root).get("total", 0) == 0:
            break
    return round(time.monotonic() - t0, 1)


def signup_probe(base: str, root: str | None, n: int, run_id: str, tag: str) -> dict:
    """n sign-ups on an idle service (no indexing backlog), one at a time; on Cloudflare (``root``, the
    emulator) with its request counters read around each (by op)."""
    waited = wait_idle(root) if root else 0.0
    total, ops, lat = 0, {}, []
    with httpx.Client(base_url=base, timeout=120) as c:
        for k in range(n):
            if root:
                counters(root, reset=True)
            t0 = time.perf_counter()
            r = c.post("/v1/signup", json={"name": f"Probe {tag} {k}", "slug": f"p{tag}{k}-{run_id}"})
            lat.append(time.perf_counter() - t0)
            snap = counters(root) if root else {}
            assert r.status_code == 201, r.text
            total += snap.get("total", 0)
            for op, v in snap.get("by_op", {}).items():
                ops[op] = ops.get(op, 0) + v
    return {"n": n, "per_signup": round(total / n, 2), "by_op": {o: round(v / n, 2) for o, v in sorted(ops.items())},
            "signup_p50_ms": round(pct(lat, 50) * 1000, 1), "signup_p95_ms": round(pct(lat, 95) * 1000, 1),
            "idle_wait_s": waited}


# -- one backend's run ------------------------------------------------------------------------------------

@contextmanager
def code_tree(rev: str | None):
    """None: this checkout. A revision: a temporary git worktree of it (removed afterwards)."""
    if not rev:
        yield None
        return
    path = Path(tempfile.gettempdir()) / f"bench-orgs-{rev}"
    if path.exists():
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(path)], check=False)
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), rev], check=True,
                   capture_output=True)
    log(f"worktree of {rev} at {path}")
    try:
        yield path
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(path)], check=False)
        log(f"worktree {path} removed")


@contextmanager
def server(data_dir: Path, env: dict, why: dict, tree: Path | None):
    """serve_subprocess, from ``tree`` (another revision's worktree) when given: bench_foundation starts the
    server with ``cwd=bench_foundation.ROOT``, so that is pointed at the worktree for the start only."""
    if tree is not None:
        env = {**env, "PYTHONPATH": str(tree), "MEMEX_MIGRATIONS_DIR": str(tree / "migrations")}
        why = {**why, "PYTHONPATH": "--code: the server runs that revision's code (worktree; the installed package "
                                    "points at this checkout)",
               "MEMEX_MIGRATIONS_DIR": "--code: that revision's migrations"}
    saved = bf.ROOT
    with ExitStack() as stack:
        try:
            if tree is not None:
                bf.ROOT = tree
            base, proc, ready, _cmd = stack.enter_context(serve_subprocess(data_dir, env, why=why))
        finally:
            bf.ROOT = saved
        yield base, proc, ready


def run_backend(args, backend: str, tree: Path | None, rev_label: str) -> dict:
    gen = NoteGenerator(seed=4321)
    qs = list(dict.fromkeys(queries(args.query_pool * 4, seed=77)))[: args.query_pool]
    run_id = os.urandom(3).hex()
    R = Run()
    result: dict = {"bench": "orgs", "backend": backend, "code": rev_label, "orgs": args.orgs,
                    "concurrent_orgs": args.concurrent_orgs, "clients": args.clients, "notes": args.notes,
                    "query_pool": len(qs), "cores": os.cpu_count(), "load_avg_start": round(os.getloadavg()[0], 1)}
    t_bench = time.perf_counter()
    with ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="memex-orgs-")))
        data_dir = stack.enter_context(bench_data_dir(args.data_dir and f"{args.data_dir}/{backend}", "memex-orgs-data-",
                                                      args.keep))
        emu_root = emu_pid = emu_data = None
        env: dict = {}
        why: dict = {}
        if backend == "cloudflare":
            emu_root, emu_pid, emu_data = stack.enter_context(emulator_process(tmp, rate_limit=100_000_000))
            provision(emu_root)
            env = {"MEMEX_SQL": "d1", "MEMEX_VECTORS": "vectorize", "MEMEX_EMBEDDER": "workers-ai",
                   "CLOUDFLARE_ACCOUNT_ID": ACCOUNT, "CLOUDFLARE_API_TOKEN": TOKEN,
                   "CLOUDFLARE_D1_DATABASE_ID": CONTROL_DB, "CLOUDFLARE_VECTORIZE_INDEX": INDEX,
                   "CLOUDFLARE_API_BASE_URL": f"{emu_root}/client/v4", "MEMEX_CLOUDFLARE_BUDGET": "100000000"}
            why = {"MEMEX_SQL": "the Cloudflare backend: D1 on the local emulator (tests/cloudflare_emulator)",
                   "MEMEX_VECTORS": "Vectorize on the local emulator", "MEMEX_EMBEDDER": "Workers AI on the local "
                   "emulator (its bge is a hash embedder: latencies are loopback, counts are real)",
                   "MEMEX_CLOUDFLARE_BUDGET": "the client-side request budget (1,200 per 5 min) would pace the bench; "
                                              "it counts requests, not time"}
        base, proc, ready = stack.enter_context(server(data_dir, env, why, tree))
        pid = proc.pid
        with httpx.Client(base_url=base, timeout=30) as c:
            h = c.get("/health").json()
        result["embedder"] = f"{h.get('embedder')} ({h.get('embedding_model')})"
        log(f"{backend}: server pid {pid} on {base} ready in {ready:.1f} s (data {data_dir}); {result['embedder']}")

        def sample(label: str, orgs_done: int) -> None:
            s = {"at": label, "orgs": orgs_done, "t_s": round(time.perf_counter() - t_bench, 1), **proc_stats(pid)}
            s["files_under_orgs"] = disk(data_dir)["files_under_orgs"]
            if emu_pid:
                e = proc_stats(emu_pid)
                s["emulator_rss_mb"], s["emulator_fds"] = e.get("rss_mb"), e.get("fds")
            R.samples.append(s)

        sample("start", 0)
        time.sleep(2)
        result["signup_probe_empty"] = signup_probe(base, emu_root, args.signup_probes, run_id, "a")
        log(f"sign-ups on the empty, idle service: {result['signup_probe_empty']}")
        if emu_root:
            counters(emu_root, reset=True)

        # 1. first pass, sequential
        log(f"first pass: {args.orgs} organizations, one client: sign up, {args.notes} notes, a search")
        t1 = time.perf_counter()
        last_log = t1
        with httpx.Client(base_url=base, timeout=120) as c:
            for i in range(args.orgs):
                o = one_org(c, i, args.notes, gen, qs, run_id)
                R.orgs.append(o["org"])
                R.signup.append(o["signup"])
                if o["captures"]:
                    R.capture_first.append(o["captures"][0])
                    R.capture_rest += o["captures"][1:]
                    R.capture_by_org.append(pct(o["captures"], 50))
                R.search1.append(o["search"])
                R.hits1.append(o["hits"])
                if (i + 1) % args.sample_every == 0:
                    sample("pass 1", i + 1)
                if time.perf_counter() - last_log > 30:
                    last_log = time.perf_counter()
                    s = R.samples[-1]
                    log(f"  {i + 1}/{args.orgs} organizations; sign-up p50 so far {pct(R.signup, 50) * 1000:.0f} ms; "
                        f"last sample: RSS {s.get('rss_mb')} MB, {s.get('fds')} fds")
        t_seq = time.perf_counter() - t1
        result["pass1_sequential_s"] = round(t_seq, 1)
        if emu_root:
            ctr = counters(emu_root)
            result["requests_pass1_sequential"] = {"total": ctr.get("total", 0),
                                                   "per_org": round(ctr.get("total", 0) / args.orgs, 1),
                                                   "by_op_per_org": {o: round(v / args.orgs, 2) for o, v in
                                                                     sorted(ctr.get("by_op", {}).items())}}

        # 2. first pass, concurrent
        if args.concurrent_orgs:
            log(f"first pass: {args.concurrent_orgs} more organizations from {args.clients} concurrent clients")
            start = args.orgs
            conc_orgs: list[dict] = []

            def work(w: int) -> None:
                try:
                    with httpx.Client(base_url=base, timeout=120) as c:
                        for i in range(start + w, start + args.concurrent_orgs, args.clients):
                            o = one_org(c, i, args.notes, gen, qs, run_id)
                            with R.lock:
                                conc_orgs.append(o["org"])
                                R.signup_conc.append(o["signup"])
                                R.capture_conc += o["captures"]
                                R.search1_conc.append(o["search"])
                except Exception as exc:  # noqa: BLE001 - reported, and the run fails below
                    with R.lock:
                        R.errors.append(f"client {w}: {exc}")

            t2 = time.perf_counter()
            threads = [threading.Thread(target=work, args=(w,)) for w in range(args.clients)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            result["pass1_concurrent_s"] = round(time.perf_counter() - t2, 1)
            if R.errors:
                raise RuntimeError("; ".join(R.errors[:3]))
            R.orgs += sorted(conc_orgs, key=lambda o: o["i"])
        t_captured = time.perf_counter()
        with httpx.Client(base_url=base, timeout=120) as c:
            result["pending_jobs_after_capture"] = c.get("/health").json()["pending_jobs"]
        sample("pass 1 done", len(R.orgs))

        # 3. indexing
        log("waiting until every note is indexed")
        health: list = []
        t_zero = wait_drained(base, args.index_timeout, health)
        result["health_during_drain"] = {
            "polls": len(health), "first_pending": health[0][0], "first_ms": round(health[0][1] * 1000, 1),
            "p50_ms": round(pct([h for _, h in health], 50) * 1000, 1),
            "max_ms": round(max(h for _, h in health) * 1000, 1),
            "idle_p50_ms": round(pct([h for p, h in health if p == 0], 50) * 1000, 1)}
        result["indexed_after_last_capture_s"] = round(t_zero - t_captured, 1)
        result["first_capture_to_all_indexed_s"] = round(t_zero - t1, 1)
        time.sleep(2)  # Cloudflare: the worker confirms the last vector mutations (once a second)
        sample("indexed", len(R.orgs))

        # 4. second pass
        log(f"second pass: a search in each of {len(R.orgs)} organizations (evicted ones reopen), then a repeat")
        t3 = time.perf_counter()
        with httpx.Client(base_url=base, timeout=120) as c:
            for n, org in enumerate(R.orgs):
                R.idle2.append(time.perf_counter() - org["last"])
                R.auth2.append(whoami(c, org))
                dt, hits = search_once(c, org)
                R.search2_reopen.append(dt)
                R.hits2.append(hits)
                dt, _ = search_once(c, org)
                R.search2_open.append(dt)
                if (n + 1) % args.sample_every == 0:
                    sample("pass 2", n + 1)
        result["pass2_s"] = round(time.perf_counter() - t3, 1)
        sample("end", len(R.orgs))
        result["signup_probe_full"] = signup_probe(base, emu_root, args.signup_probes, run_id, "b")
        log(f"sign-ups on the idle service with {len(R.orgs) + args.signup_probes} organizations: "
            f"{result['signup_probe_full']}")
        log("checking every thought shows indexed")
        result["thoughts"] = sum(len(o["ids"]) for o in R.orgs)
        result["chunks"] = sum(o["chunks"] for o in R.orgs)
        drain_s = t_zero - t_captured
        result["jobs_per_s_drain"] = round(result["pending_jobs_after_capture"] / drain_s, 1) if drain_s > 1 else None
        result["thoughts_per_s_overall"] = round(result["thoughts"] / (t_zero - t1), 1)
        result["thoughts_not_indexed"] = not_indexed(base, R.orgs)
        if emu_root:
            result["d1_databases"] = d1_databases(emu_root)
            result["emulator_disk"] = disk(emu_data)
        result["disk"] = disk(data_dir)
        result["data_dir"] = str(data_dir)
    result["load_avg_end"] = round(os.getloadavg()[0], 1)
    result["wall_s"] = round(time.perf_counter() - t_bench, 1)

    def m(xs: list[float]) -> dict:
        if not xs:
            return {"n": 0, "p50": None, "p95": None}
        return {"n": len(xs), "p50": round(pct(xs, 50) * 1000, 1), "p95": round(pct(xs, 95) * 1000, 1)}

    k = min(100, max(1, args.orgs // 2))
    result.update({
        "signup_ms": m(R.signup), "signup_first_ms": m(R.signup[:k]), "signup_last_ms": m(R.signup[-k:]),
        "signup_concurrent_ms": m(R.signup_conc), "window": k,
        "signups_per_s_sequential": None, "signups_per_s_concurrent": None,
        "capture_ms": m(R.capture_first + R.capture_rest), "capture_first_in_org_ms": m(R.capture_first),
        "capture_later_ms": m(R.capture_rest),
        "capture_first_orgs_ms": m(R.capture_by_org[:k]), "capture_last_orgs_ms": m(R.capture_by_org[-k:]),
        "capture_concurrent_ms": m(R.capture_conc),
        "search_pass1_ms": m(R.search1), "search_pass1_first_orgs_ms": m(R.search1[:k]),
        "search_pass1_last_orgs_ms": m(R.search1[-k:]), "search_pass1_concurrent_ms": m(R.search1_conc),
        "auth_pass2_ms": m(R.auth2), "idle_before_pass2_s_p50": round(pct(R.idle2, 50), 1),
        "idle_before_pass2_over_60s": sum(x > 60 for x in R.idle2), "search_pass2_reopen_ms": m(R.search2_reopen),
        "search_pass2_open_ms": m(R.search2_open),
        "hits_pass1_mean": round(sum(R.hits1) / max(1, len(R.hits1)), 2),
        "hits_pass2_mean": round(sum(R.hits2) / max(1, len(R.hits2)), 2),
        "samples": R.samples,
    })
    if R.signup_conc and result.get("pass1_concurrent_s"):
        result["orgs_per_s_concurrent"] = round(len(R.signup_conc) / result["pass1_concurrent_s"], 2)
    result["orgs_per_s_sequential"] = round(args.orgs / t_seq, 2)
    result.pop("signups_per_s_sequential")
    result.pop("signups_per_s_concurrent")
    return result


# -- report -----------------------------------------------------------------------------------------------

def row(label: str, value: str) -> str:
    return f"  {label:<72} {value}"


def slope_per_100(samples: list[dict], field: str) -> float | None:
    pts = [(s["orgs"], s[field]) for s in samples if s.get(field) is not None and s["at"] == "pass 1"]
    pts = pts[len(pts) // 2:]  # the second half: past warm-up (the model's arena, the first 64 organizations)
    if len(pts) < 3:
        return None
    n = len(pts)
    mx = sum(x for x, _ in pts) / n
    my = sum(y for _, y in pts) / n
    den = sum((x - mx) ** 2 for x, _ in pts)
    return round(sum((x - mx) * (y - my) for x, y in pts) / den * 100, 2) if den else None


def report(r: dict) -> None:
    def f(d: dict) -> str:
        return f"p50 {d['p50']:.1f}  p95 {d['p95']:.1f} ms  (n={d['n']})" if d["n"] else "-"

    k = r["window"]
    print()
    print(f"Memex many-organizations benchmark: backend {r['backend']}, code {r['code']}")
    print(f"  machine: {r['cores']} cores, load average {r['load_avg_start']} at start, {r['load_avg_end']} at end; "
          f"embedder {r['embedder']}")
    print(f"  {r['orgs']:,} organizations sequentially + {r['concurrent_orgs']:,} from {r['clients']} concurrent "
          f"clients; {r['notes']} notes and one search each; {r['query_pool']} distinct queries (model's query "
          f"cache warm)")
    print()
    print(row("sign-up, sequential", f(r["signup_ms"])))
    print(row(f"  first {k} sign-ups", f(r["signup_first_ms"])))
    print(row(f"  last {k} sign-ups", f(r["signup_last_ms"]) +
              f"  ratio of p50s {r['signup_last_ms']['p50'] / r['signup_first_ms']['p50']:.2f}"))
    for tag, label in (("signup_probe_empty", "empty"), ("signup_probe_full", "after the run")):
        p = r[tag]
        print(row(f"sign-up on the idle service ({label}; x{p['n']}, no indexing backlog)",
                  f"p50 {p['signup_p50_ms']:.1f}  p95 {p['signup_p95_ms']:.1f} ms"))
    print(row(f"sign-up, {r['clients']} concurrent clients", f(r["signup_concurrent_ms"])))
    print(row("organizations per second (sign-up + notes + search), 1 client / concurrent",
              f"{r['orgs_per_s_sequential']} / {r.get('orgs_per_s_concurrent', '-')}"))
    print(row("capture, sequential, all", f(r["capture_ms"])))
    print(row("  each organization's first capture (opens its store)", f(r["capture_first_in_org_ms"])))
    print(row("  its later captures", f(r["capture_later_ms"])))
    print(row(f"  per-organization median, first {k} / last {k} organizations",
              f"p50 {r['capture_first_orgs_ms']['p50']:.1f} / {r['capture_last_orgs_ms']['p50']:.1f} ms"))
    print(row(f"capture, {r['clients']} concurrent clients", f(r["capture_concurrent_ms"])))
    print(row("search, first pass (store open, indexing backlog running)", f(r["search_pass1_ms"])))
    print(row(f"  first {k} / last {k} organizations",
              f"p50 {r['search_pass1_first_orgs_ms']['p50']:.1f} / {r['search_pass1_last_orgs_ms']['p50']:.1f} ms"))
    print(row(f"second pass, after p50 {r['idle_before_pass2_s_p50']:.0f} s idle "
              f"({r['idle_before_pass2_over_60s']} of {r['auth_pass2_ms']['n']} over the key cache's 60 s)", ""))
    print(row("  GET /v1/org first (no handle opened; argon2id if the key cache expired)", f(r["auth_pass2_ms"])))
    print(row("  then a search, evicted organization (reopens)", f(r["search_pass2_reopen_ms"])))
    print(row("  then the same search again (store open)", f(r["search_pass2_open_ms"])))
    print(row("  mean hits, first / second pass", f"{r['hits_pass1_mean']} / {r['hits_pass2_mean']}"))
    print(row("all indexed after the last capture", f"{r['indexed_after_last_capture_s']} s "
              f"(first pass took {r['pass1_sequential_s']} s + {r.get('pass1_concurrent_s', 0)} s)"))
    print(row("  jobs pending after the last capture; drained at", f"{r['pending_jobs_after_capture']:,}; "
              f"{r['jobs_per_s_drain']} jobs/s (overall {r['thoughts_per_s_overall']} thoughts/s from the first "
              f"capture, {r['chunks'] / max(1, r['thoughts']):.2f} chunks each)"))
    hd = r["health_during_drain"]
    print(row("  GET /health while draining (it counts each queued organization's jobs)",
              f"first {hd['first_ms']:.0f} ms at {hd['first_pending']:,} jobs pending; p50 {hd['p50_ms']:.0f}, max "
              f"{hd['max_ms']:.0f} ms; {hd['idle_p50_ms']} ms once drained ({hd['polls']} polls)"))
    print(row("thoughts not indexed at the end (GET each)", f"{r['thoughts_not_indexed']} of {r['thoughts']:,}"))
    d = r["disk"]
    print(row("data directory", f"{d['files']:,} files ({d['files_under_orgs']:,} under orgs/), "
              f"{d['allocated_mb']:,.1f} MB allocated ({d['apparent_mb']:,.1f} MB apparent)"))
    n_orgs = r["orgs"] + r["concurrent_orgs"] + 2 * r["signup_probe_full"]["n"]
    print(row("  per organization", f"{d['allocated_mb'] * 1024 / max(1, n_orgs):,.0f} KB allocated"))
    if "d1_databases" in r:
        print(row("D1 databases in the emulator", f"{r['d1_databases']:,} (control included)"))
        e = r["emulator_disk"]
        print(row("  emulator's data", f"{e['files']:,} files, {e['allocated_mb']:,.1f} MB allocated"))
        for tag, label in (("signup_probe_empty", "empty service"), ("signup_probe_full", "after the run")):
            p = r[tag]
            print(row(f"REST requests per sign-up, {label} (x{p['n']}, idle service)",
                      f"{p['per_signup']}: " + ", ".join(f"{o} {v:g}" for o, v in p["by_op"].items())))
        q = r["requests_pass1_sequential"]
        print(row("REST requests per organization over the sequential first pass", f"{q['per_org']} (sign-up, "
                  f"{r['notes']} captures and their indexing, a search)"))
    print()
    print("  server process (and, on Cloudflare, the emulator's), sampled:")
    hdr = f"  {'at':<12} {'orgs':>6} {'t s':>7} {'RSS MB':>8} {'peak':>7} {'thr':>4} {'fds':>5} {'sqlite':>6} " \
          f"{'sock':>5} {'orgs open':>9} {'files':>6}"
    emu = any("emulator_fds" in s for s in r["samples"])
    print(hdr + (f" {'emu RSS':>8} {'emu fds':>7}" if emu else ""))
    for s in r["samples"]:
        line = (f"  {s['at']:<12} {s['orgs']:>6} {s['t_s']:>7} {s.get('rss_mb') or 0:>8.0f} {s.get('peak_rss_mb') or 0:>7.0f} "
                f"{s.get('threads') or 0:>4} {s.get('fds') or 0:>5} {s.get('fds_sqlite') or 0:>6} "
                f"{s.get('fds_socket') or 0:>5} {s.get('orgs_with_open_files') or 0:>9} {s.get('files_under_orgs') or 0:>6}")
        if emu:
            line += f" {s.get('emulator_rss_mb') or 0:>8.0f} {s.get('emulator_fds') or 0:>7}"
        print(line)
    fd_max = max((s.get("fds") or 0) for s in r["samples"])
    open_max = max((s.get("orgs_with_open_files") or 0) for s in r["samples"])
    print(row("open fds, max over the run / at the end", f"{fd_max} / {r['samples'][-1].get('fds')}; organizations "
              f"with a file open, max {open_max}"))
    sl = slope_per_100(r["samples"], "rss_mb")
    if sl is not None:
        print(row("RSS slope over the first pass's second half", f"{sl:+.1f} MB per 100 organizations"))
    sf = slope_per_100(r["samples"], "fds")
    if sf is not None:
        print(row("fd slope over the first pass's second half", f"{sf:+.1f} per 100 organizations"))
    print(f"  bench wall time {r['wall_s']:,.0f} s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--orgs", type=int, default=1000, help="organizations signed up sequentially (default 1000)")
    ap.add_argument("--notes", type=int, default=3, help="notes captured per organization (default 3)")
    ap.add_argument("--concurrent-orgs", type=int, default=None,
                    help="more organizations from --clients concurrent clients (default min(200, orgs / 10); 0 skips)")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--backend", choices=["embedded", "cloudflare", "both"], default="embedded")
    ap.add_argument("--code", default=None, help="run against this revision (a temporary git worktree), e.g. 12ab7a1")
    ap.add_argument("--query-pool", type=int, default=50, help="distinct search queries (default 50)")
    ap.add_argument("--sample-every", type=int, default=100, help="sample the server every N organizations")
    ap.add_argument("--signup-probes", type=int, default=20,
                    help="sign-ups on the idle service before the first pass and after the second (Cloudflare: "
                         "requests counted around each)")
    ap.add_argument("--index-timeout", type=float, default=3 * 3600)
    ap.add_argument("--data-dir", default=None, help="keep the data here (<dir>/<backend>) instead of a temp dir")
    ap.add_argument("--keep", action="store_true", help="keep the temporary data directory")
    args = ap.parse_args()
    if args.orgs < 2:
        ap.error("--orgs must be at least 2")
    if args.concurrent_orgs is None:
        args.concurrent_orgs = min(200, args.orgs // 10)
    backends = ["embedded", "cloudflare"] if args.backend == "both" else [args.backend]
    results = []
    with code_tree(args.code) as tree:
        label = code_revision() if tree is None else subprocess.run(
            ["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], check=False, capture_output=True, text=True).stdout.strip()
        for backend in backends:
            r = run_backend(args, backend, tree, label)
            report(r)
            results.append(r)
            print(json.dumps(r, separators=(",", ":")), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
