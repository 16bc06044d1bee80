"""Issue 13's figures, from one run on one machine: each benchmark in turn, then one table against the aims.

    .venv/bin/python bench/bench_issue13.py --data-root DIR                # ~1-2 h the first time (loads), then less
    .venv/bin/python bench/bench_issue13.py --data-root DIR --quick        # smaller corpora: ~20-30 min once loaded

Runs, one after the other (2 cores: nothing else at the same time), each as a subprocess whose last line is its
JSON summary, and prints what each printed:

1. ``bench_ingest.py``: the raw embedder (MiniLM int8, batches of 64, length-sorted) and Memex's bulk import to
   searchable on the same SciFact chunks, their ratio; the capture acknowledgement p50 (one client, HTTP);
   the capture rate into an empty organization and into one of ``--scale`` thoughts (in process);
2. ``bench_search_scale.py``: search over HTTP at ~100,000 chunks in one organization, one client and 8, with the
   product's defaults (MiniLM embeds every chunk and the query; its data kept in ``DIR/search-scale-minilm``,
   loaded once, ~60 min, unless ``--search-data`` names one). ``--search-embedder hash`` loads with the hash
   embedder instead (``DIR/search-scale``, ~10 min) and adds MiniLM's query cost, measured apart: an upper bound;
3. ``bench_conversation_search.py``: conversation search at 1,000 conversations (in process; its data set in
   ``DIR/conversations``, built once, ~30-60 min, unless ``--conversations-data`` names one);
4. ``bench_cloudflare.py``: Cloudflare REST requests per captured thought (bulk import, amortised) and per
   search, counted by the local emulator;
5. ``bench_vs_mem0.py``: Memex and mem0 OSS on SciFact (run with ``--mem0-python``, mem0's own virtualenv;
   left out, and said so, when that interpreter is missing).

The settings each benchmark changes are its own and it prints them (bench_search_scale.py with
``--search-embedder hash``: the hash embedder for loading, MiniLM's query cost measured apart and added;
bench_conversation_search.py: the hash embedder's data set). ``--quick`` shrinks the corpora (printed); the aims
are for the full sizes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def log(msg: str) -> None:
    print(f"[issue13 {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run(name: str, cmd: list[str], timeout: float) -> dict[str, Any] | None:
    """Run one benchmark, echo its output, return its last line's JSON (None when it failed)."""
    log(f"{name}: {' '.join(cmd)}  (load average {os.getloadavg()[0]:.2f})")
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        log(f"{name}: timed out after {timeout:.0f} s")
        return None
    out = proc.stdout or ""
    print(out, end="" if out.endswith("\n") else "\n", flush=True)
    log(f"{name}: exit {proc.returncode} after {time.monotonic() - t0:.0f} s")
    lines = [line for line in out.splitlines() if line.strip()]
    if proc.returncode != 0 or not lines:
        return None
    try:
        summary: dict[str, Any] = json.loads(lines[-1])
    except ValueError:  # a summary printed over several lines (indented JSON): the last '{' at a line's start
        start = max(i for i, line in enumerate(lines) if line.startswith("{"))
        summary = json.loads("\n".join(lines[start:]))
    return summary


def dig(d: dict[str, Any] | None, *path: str) -> Any:
    for key in path:
        if not isinstance(d, dict) or key not in d:
            return None
        d = d[key]
    return d


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data-root", type=Path, required=True, help="where the kept data sets live (made if missing)")
    ap.add_argument("--quick", action="store_true", help="smaller corpora (printed); the aims are for the full sizes")
    ap.add_argument("--search-data", type=Path, help="an existing bench_search_scale.py --keep data directory, loaded "
                                                     "with --search-embedder's embedder")
    ap.add_argument("--search-embedder", choices=("local", "hash"), default="local",
                    help="local (default: the product's defaults, measured as a user gets them) or hash (a quicker "
                         "load; MiniLM's query cost added: an upper bound)")
    ap.add_argument("--conversations-data", type=Path, help="an existing bench_conversation_search.py --build set")
    ap.add_argument("--mem0-python", default="/work/mem0-venv/bin/python", help="the interpreter of mem0's virtualenv")
    ap.add_argument("--skip", action="append", default=[],
                    choices=["ingest", "search", "conversations", "cloudflare", "mem0"], help="leave a part out")
    args = ap.parse_args()
    py = sys.executable
    root = args.data_root.resolve()
    root.mkdir(parents=True, exist_ok=True)
    sizes = {"ingest_docs": 1000 if args.quick else None, "scale": 20_000 if args.quick else 100_000,
             "chunks": 100_000, "cloudflare_bulk": 200 if args.quick else 500,
             "mem0_docs": 500 if args.quick else None, "mem0_queries": 100 if args.quick else None}
    log(f"{os.cpu_count()} cores, load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}; sizes {sizes}"
        + ("  (--quick: smaller than the aims' sizes)" if args.quick else ""))
    t_all = time.monotonic()
    res: dict[str, dict[str, Any] | None] = {}

    if "ingest" not in args.skip:
        cmd = [py, "bench/bench_ingest.py", "--single", "300", "--scale", str(sizes["scale"])]
        if sizes["ingest_docs"]:
            cmd += ["--docs", str(sizes["ingest_docs"])]
        res["ingest"] = run("ingest", cmd, 4 * 3600)
    if "search" not in args.skip:
        data = args.search_data or root / ("search-scale-minilm" if args.search_embedder == "local" else "search-scale")
        res["search"] = run("search at 100k chunks", [py, "bench/bench_search_scale.py", "--chunks", str(sizes["chunks"]),
                                                       "--data-dir", str(data), "--keep",
                                                       "--embedder", args.search_embedder], 4 * 3600)
    if "conversations" not in args.skip:
        data = args.conversations_data or root / "conversations"
        cmd = [py, "bench/bench_conversation_search.py", "--data", str(data)]
        if not (data / "meta.json").exists():
            cmd.append("--build")
        res["conversations"] = run("conversation search", cmd, 4 * 3600)
    if "cloudflare" not in args.skip:
        res["cloudflare"] = run("Cloudflare requests", [py, "bench/bench_cloudflare.py", "--bulk", str(sizes["cloudflare_bulk"]),
                                                        "--foundation-n", "0"], 3600)
    if "mem0" not in args.skip:
        if Path(args.mem0_python).exists():
            cmd = [args.mem0_python, "bench/bench_vs_mem0.py", "--memex-python", py]
            if sizes["mem0_docs"]:
                cmd += ["--docs", str(sizes["mem0_docs"]), "--queries", str(sizes["mem0_queries"])]
            res["mem0"] = run("Memex vs mem0", cmd, 4 * 3600)
        else:
            log(f"mem0: {args.mem0_python} is missing: left out (bench_vs_mem0.py's docstring says how to install it)")

    rows = table(res)
    print(f"\nIssue 13, one run ({time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} cores, "
          f"{(time.monotonic() - t_all) / 60:.0f} min, load average at the end {os.getloadavg()[0]:.2f})"
          + ("  --quick" if args.quick else ""))
    print(f"{'figure':<62} {'measured':>14} {'aim':>10}  met")
    for label, value, aim, met in rows:
        shown = "-" if value is None else f"{value:,.2f}" if isinstance(value, float) else str(value)
        print(f"{label:<62} {shown:>14} {aim:>10}  {'' if met is None else 'yes' if met else 'NO'}")
    print(json.dumps({"sizes": sizes, "results": res, "table": rows}, default=str))
    return 0


def table(res: dict[str, dict[str, Any] | None]) -> list[tuple[str, Any, str, bool | None]]:
    """(figure, measured, aim, met) rows; met is None where the issue sets no aim or nothing was measured."""
    rows: list[tuple[str, Any, str, bool | None]] = []

    def add(label: str, value: Any, aim: str = "", ok: Any = None) -> None:
        rows.append((label, value, aim, None if value is None or ok is None else bool(ok(value))))

    ing = res.get("ingest")
    add("raw embedder, SciFact chunks/s (batches of 64)", dig(ing, "raw", "chunks_per_s"))
    add("Memex bulk import to searchable, chunks/s", dig(ing, "service", "service_chunks_per_s"))
    add("  Memex / raw embedder", dig(ing, "ratio"), ">= 0.85", lambda v: v >= 0.85)
    add("  documents/s end to end (acknowledged and searchable)", dig(ing, "service", "docs_per_s_end_to_end"))
    add("capture acknowledged p50, ms (MiniLM, defaults, HTTP)", dig(ing, "service", "capture_ms", "p50"), "<= 10",
        lambda v: v <= 10)
    thoughts = dig(ing, "scale", "thoughts")
    add(f"capture rate at {thoughts or 'N'} thoughts / into an empty org", dig(ing, "scale", "ratio"), ">= 0.80",
        lambda v: v >= 0.8)
    s = res.get("search")
    chunks = dig(s, "load", "chunks")
    if dig(s, "http") is not None:  # the product's defaults: MiniLM in every figure, as a user gets it
        how, first, again, clients = ("defaults", dig(s, "http", "first", "p50"), dig(s, "http", "again", "p50"),
                                      dig(s, "http", "clients_8", "p95"))
    else:  # a hash-loaded set: MiniLM's query cost measured apart and added (an upper bound)
        how, first, again, clients = ("hash set + MiniLM query", *(dig(s, "with_minilm_estimate", k) for k in (
            "first_p50", "repeat_p50", "clients_p95_first")))
    add(f"search p50 at {chunks or '100k'} chunks, HTTP, MiniLM query included ({how}), ms", first, "<= 15",
        lambda v: v <= 15)
    add("  the same, queries asked before (embedding cached), ms", again)
    add("  8 clients, p95, MiniLM query included, ms", clients, "<= 40", lambda v: v <= 40)
    add("  server RSS loaded, MB", dig(s, "server", "rss_mb_loaded"))
    c = res.get("conversations")
    add("conversation search p50 at 1,000 conversations, first time, ms", dig(c, "search_first", "p50"), "<= 25",
        lambda v: v <= 25)
    add("  best of 3 per query, ms", dig(c, "search_best3", "p50"), "<= 25", lambda v: v <= 25)
    cf = res.get("cloudflare")
    add("Cloudflare requests per captured thought (bulk, amortised)", dig(cf, "bulk", "net_of_idle_per_unit"), "<= 3",
        lambda v: v <= 3)
    add("Cloudflare requests per single capture", dig(cf, "capture", "net_of_idle_per_unit"))
    add("Cloudflare requests per search", dig(cf, "search", "net_of_idle_per_unit"), "<= 3", lambda v: v <= 3)
    add("  of which D1 to the control database (key revocation looks: a rate per process, not per search)",
        dig(cf, "search", "total", "control_d1"))
    m = res.get("mem0")
    ratios = dig(m, "ratios_memex_over_mem0") or {}
    for key, label, higher in (("searchable_docs_per_s", "ingest to searchable, docs/s", True),
                               ("ack_docs_per_s", "ingest acknowledged, docs/s", True),
                               ("search_p50_ms", "search p50", False), ("search_p95_ms", "search p95", False),
                               ("peak_rss_mb", "peak RSS", False), ("install", "install size", False)):
        add(f"Memex / mem0: {label}", ratios.get(key) if m else None, "> 1" if higher else "< 1",
            (lambda v: v > 1) if higher else (lambda v: v < 1))
    add("Memex / mem0: nDCG@10 (at least as accurate)", ratios.get("ndcg@10") if m else None, ">= 1", lambda v: v >= 1)
    return rows


if __name__ == "__main__":
    sys.exit(main())
