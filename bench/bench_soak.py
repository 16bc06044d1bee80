"""Soak: many clients, many organizations, a mixed workload for a long time; errors, latency and memory.

Starts ``python -m api.cli serve`` in a separate process with the product's defaults (only the rate limits
lifted, printed at start; ``bench_foundation.serve_subprocess``) on a fresh data directory, signs up
``--orgs`` organizations (default 20), then runs ``--clients`` concurrent clients (default 8) for
``--minutes`` (default 30), each in a closed loop over a realistic mix, every request to a random
organization:

* REST: capture thoughts (varied 100-400-word markdown notes), search thoughts, search conversations,
  append messages to conversations (2 per append, creating a conversation when the client has none or its
  current one reached 40 messages), get a thought by id, get a conversation, list recent thoughts, list
  conversations, delete thoughts and conversations;
* MCP: ``semantic_search``, ``list_recent`` and ``capture_thought`` as JSON-RPC POSTs, and now and then a
  whole ``mcp`` SDK ``ClientSession`` (initialize, ``semantic_search``, ``list_recent``).

Two phases, so data growth is told apart from leaks: in the **grow** phase (the first half) deletes run at
about a quarter of the creates, so the data (rows, keyword index, vectors) grows; in the **steady** phase
(the second half) every capture past the client's live count in that organization at the switch deletes
its oldest thought, and every append that takes the client's messages there past their count at the switch
(at least one full conversation) deletes its oldest conversations: the live data stays about constant, and
memory that still grows then is not data (the indexing backlog, ``pending jobs``, still lands in the index).
``--steady-from 0`` balances from the start.

Each client only deletes what it created (no two clients delete the same id); a 404 on a get or delete of a
thought that a write-time decision of another capture replaced or merged meanwhile is counted apart
("gone"), not as an error. Every other non-2xx answer, transport error or MCP tool error is an error.

The server's RSS (/proc/<pid>/status VmRSS, bench_foundation.rss_mb) and its pending indexing jobs
(``/health``) are sampled every ``--sample-every`` seconds (default 10). Printed: per operation count,
errors, p50/p95/p99; total requests per second; RSS at start (after sign-up, before load), after warm-up
(``--warmup`` minutes, default a tenth of the run, at most 3) and at the end; the RSS slope (least squares,
MB per minute) over each half; and, last, a one-line JSON summary.

    .venv/bin/python bench/bench_soak.py [--minutes 30] [--clients 8] [--orgs 20] [--embedder local|hash]

Only loopback traffic. Loops stop by themselves at the deadline (every request has a timeout).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import secrets
import sys
import threading
import time
from collections import defaultdict, deque
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_foundation import (  # noqa: E402
    NoteGenerator, bench_data_dir, code_revision, rss_mb, cpu_seconds, log, pct, queries, serve_subprocess,
)
import conversation_data  # noqa: E402

#: Operation -> weight in the grow phase (relative frequencies of a read-heavy agent workload).
MIX = {
    "search": 22, "search_conv": 8, "get_thought": 12, "list_thoughts": 7, "list_conversations": 2,
    "get_conversation": 4, "capture": 9, "append": 10, "delete_thought": 2.5, "delete_conversation": 0.4,
    "mcp_search": 4, "mcp_list_recent": 2, "mcp_capture": 1, "mcp_sdk_session": 0.5,
}
#: In the steady phase explicit deletes stop: captures and new conversations delete the oldest instead.
STEADY_OFF = {"delete_thought", "delete_conversation"}
MESSAGES_PER_CONVERSATION = 40
PROTOCOL = "2025-06-18"


def slope_mb_per_min(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (seconds, MB) points, in MB per minute."""
    if len(points) < 3:
        return None
    n = len(points)
    mx = sum(t for t, _ in points) / n
    my = sum(v for _, v in points) / n
    den = sum((t - mx) ** 2 for t, _ in points)
    if den == 0:
        return None
    return round(sum((t - mx) * (v - my) for t, v in points) / den * 60, 2)


class Org:
    """One organization and, per client, the ids that client created and may delete (oldest first)."""

    def __init__(self, info: dict, clients: int) -> None:
        self.slug, self.key, self.mcp_url = info["slug"], info["key"], info["mcp_url"]
        self.headers = {"authorization": f"Bearer {self.key}"}
        self.mcp_headers = {**self.headers, "accept": "application/json, text/event-stream",
                            "content-type": "application/json", "mcp-protocol-version": PROTOCOL}
        self.lock = threading.Lock()
        self.thoughts: list[deque[str]] = [deque() for _ in range(clients)]
        self.convs: list[deque[list]] = [deque() for _ in range(clients)]  # [id, messages]
        self.gone: set[str] = set()  # replaced / merged by a write-time decision
        self.thought_cap: list[int] | None = None  # steady phase: each client's live thoughts kept at this
        self.msg_cap: list[int] | None = None  # and its messages at this (whole conversations deleted)

    def live(self) -> tuple[int, int, int]:
        with self.lock:
            return (sum(len(d) for d in self.thoughts), sum(len(d) for d in self.convs),
                    sum(c[1] for d in self.convs for c in d))


class Stats:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.lat: dict[str, list[float]] = defaultdict(list)
        self.errors: dict[str, int] = defaultdict(int)
        self.gone: dict[str, int] = defaultdict(int)
        self.examples: list[str] = []

    def ok(self, op: str, dt: float) -> None:
        with self.lock:
            self.lat[op].append(dt)

    def error(self, op: str, dt: float | None, what: str) -> None:
        with self.lock:
            self.errors[op] += 1
            if dt is not None:
                self.lat[op].append(dt)
            if len(self.examples) < 20:
                self.examples.append(f"{op}: {what[:300]}")

    def went(self, op: str) -> None:
        with self.lock:
            self.gone[op] += 1


class Client:
    def __init__(self, idx: int, base: str, orgs: list[Org], stats: Stats, args, state: dict) -> None:
        self.idx, self.orgs, self.stats, self.args, self.state = idx, orgs, stats, args, state
        self.rng = random.Random(1000 + idx)
        self.http = httpx.Client(base_url=base, timeout=60)
        self.gen = NoteGenerator(seed=7 + idx)
        self.n_notes = 0
        self.qs = queries(2000, seed=500 + idx)
        self.turns = [t for conv in state["conversations"] for t in conv]
        self.turn_i = self.rng.randrange(len(self.turns))
        self.conv_qs = [c for r, c in self.turns if r == "user" and len(c) > 20]

    # -- plumbing

    def call(self, op: str, method: str, path: str, org: Org, *, ok=(200, 201, 204), gone_ok: bool = False, **kw):
        t0 = time.perf_counter()
        try:
            r = self.http.request(method, path, headers=org.headers, **kw)
        except httpx.HTTPError as exc:
            self.stats.error(op, None, f"{type(exc).__name__}: {exc}")
            return None
        dt = time.perf_counter() - t0
        if r.status_code in ok:
            self.stats.ok(op, dt)
            return r
        if gone_ok and r.status_code == 404:
            self.stats.went(op)
            return None
        self.stats.error(op, dt, f"{method} {path} -> {r.status_code} {r.text[:200]}")
        return None

    def mcp(self, op: str, org: Org, tool: str, arguments: dict):
        body = {"jsonrpc": "2.0", "id": self.rng.randrange(1 << 30), "method": "tools/call",
                "params": {"name": tool, "arguments": arguments}}
        t0 = time.perf_counter()
        try:
            r = self.http.post(org.mcp_url, json=body, headers=org.mcp_headers)
        except httpx.HTTPError as exc:
            self.stats.error(op, None, f"{type(exc).__name__}: {exc}")
            return None
        dt = time.perf_counter() - t0
        try:
            res = r.json()["result"] if r.status_code == 200 else None
        except (ValueError, KeyError):
            res = None
        if res is None or res.get("isError"):
            self.stats.error(op, dt, f"{tool} -> {r.status_code} {r.text[:200]}")
            return None
        self.stats.ok(op, dt)
        return res.get("structuredContent") or {}

    def steady(self) -> bool:
        return self.state["steady"].is_set()

    def note(self) -> tuple[str, str]:
        self.n_notes += 1
        kind, text = self.gen.note(self.n_notes)
        return kind, f"{text}\n\n(soak client {self.idx}, note {self.n_notes}, {secrets.token_hex(4)})"

    def remember_capture(self, org: Org, body: dict) -> None:
        decision = body.get("decision") or {}
        with org.lock:
            if decision.get("action") in ("replaced", "merged") and decision.get("related_id"):
                rid = decision["related_id"]
                org.gone.add(rid)
                for d in org.thoughts:
                    if rid in d:
                        d.remove(rid)
            if body.get("created", True) and body["id"] not in org.gone:
                mine = org.thoughts[self.idx]
                if body["id"] not in mine:
                    mine.append(body["id"])

    def after_capture(self, org: Org) -> None:
        """Steady phase: keep the client's live thoughts in this org at the cap (delete the oldest)."""
        if not self.steady() or org.thought_cap is None:
            return
        while True:
            with org.lock:
                mine = org.thoughts[self.idx]
                victim = mine.popleft() if len(mine) > org.thought_cap[self.idx] else None
            if victim is None:
                return
            self.call("delete_thought", "DELETE", f"/v1/thoughts/{victim}", org, gone_ok=True)

    # -- operations

    def op_capture(self, org: Org) -> None:
        kind, text = self.note()
        r = self.call("capture", "POST", "/v1/thoughts", org, json={"content": text, "source": f"soak:{kind}",
                                                                    "metadata": {"client": self.idx}})
        if r is not None:
            self.remember_capture(org, r.json())
            self.after_capture(org)

    def op_mcp_capture(self, org: Org) -> None:
        kind, text = self.note()
        res = self.mcp("mcp_capture", org, "capture_thought", {"content": text, "source": f"soak-mcp:{kind}"})
        if res and "id" in res:
            self.remember_capture(org, res)
            self.after_capture(org)

    def op_search(self, org: Org) -> None:
        self.call("search", "POST", "/v1/search", org, json={"query": self.rng.choice(self.qs), "top_k": 10})

    def op_search_conv(self, org: Org) -> None:
        body = {"query": self.rng.choice(self.conv_qs), "top_k": 10, "kinds": ["conversation"]}
        if self.rng.random() < 0.3:
            body["kinds"] = ["thought", "conversation"]
        self.call("search_conv", "POST", "/v1/search", org, json=body)

    def pick_thought(self, org: Org) -> str | None:
        with org.lock:
            owners = [d for d in org.thoughts if d]
            return self.rng.choice(self.rng.choice(owners)) if owners else None

    def op_get_thought(self, org: Org) -> None:
        tid = self.pick_thought(org)
        if tid is None:
            return self.op_list_thoughts(org)
        self.call("get_thought", "GET", f"/v1/thoughts/{tid}", org, gone_ok=True)

    def op_list_thoughts(self, org: Org) -> None:
        self.call("list_thoughts", "GET", "/v1/thoughts", org, params={"limit": self.rng.choice([10, 20, 50])})

    def op_list_conversations(self, org: Org) -> None:
        self.call("list_conversations", "GET", "/v1/conversations", org, params={"limit": 20})

    def op_get_conversation(self, org: Org) -> None:
        with org.lock:
            owners = [d for d in org.convs if d]
            cid = self.rng.choice(self.rng.choice(owners))[0] if owners else None
        if cid is None:
            return self.op_list_conversations(org)
        # another client may delete it meanwhile (steady phase): a 404 is then a race, not an error
        self.call("get_conversation", "GET", f"/v1/conversations/{cid}", org, gone_ok=True, params={"limit": 50})

    def op_append(self, org: Org) -> None:
        with org.lock:
            mine = org.convs[self.idx]
            cur = mine[-1] if mine and mine[-1][1] < MESSAGES_PER_CONVERSATION else None
        if cur is None:
            r = self.call("create_conversation", "POST", "/v1/conversations", org,
                          json={"title": f"soak {self.idx} {secrets.token_hex(3)}", "metadata": {"client": self.idx}})
            if r is None:
                return
            cur = [r.json()["id"], 0]
            with org.lock:
                org.convs[self.idx].append(cur)
        msgs = []
        for _ in range(2):
            role, content = self.turns[self.turn_i % len(self.turns)]
            self.turn_i += 1
            msgs.append({"role": role, "content": content})
        r = self.call("append", "POST", f"/v1/conversations/{cur[0]}/messages", org, json={"messages": msgs})
        if r is None:
            return
        victims = []
        with org.lock:
            cur[1] += 2
            mine = org.convs[self.idx]
            if self.steady() and org.msg_cap is not None:  # hold the client's messages here at the cap
                while len(mine) > 1 and sum(c[1] for c in mine) > org.msg_cap[self.idx]:
                    victims.append(mine.popleft()[0])
        for cid in victims:
            self.call("delete_conversation", "DELETE", f"/v1/conversations/{cid}", org, gone_ok=True)

    def op_delete_thought(self, org: Org) -> None:
        with org.lock:
            mine = org.thoughts[self.idx]
            victim = mine.popleft() if len(mine) > 3 else None
        if victim is not None:
            self.call("delete_thought", "DELETE", f"/v1/thoughts/{victim}", org, gone_ok=True)

    def op_delete_conversation(self, org: Org) -> None:
        with org.lock:
            mine = org.convs[self.idx]
            victim = mine.popleft()[0] if len(mine) > 1 else None
        if victim is not None:
            self.call("delete_conversation", "DELETE", f"/v1/conversations/{victim}", org, gone_ok=True)

    def op_mcp_search(self, org: Org) -> None:
        self.mcp("mcp_search", org, "semantic_search", {"query": self.rng.choice(self.qs), "top_k": 10})

    def op_mcp_list_recent(self, org: Org) -> None:
        self.mcp("mcp_list_recent", org, "list_recent", {"limit": 20})

    def op_mcp_sdk_session(self, org: Org) -> None:
        from mcp import ClientSession
        from mcp.client.streamable_http import streamable_http_client

        q = self.rng.choice(self.qs)

        async def session() -> bool:
            async with httpx.AsyncClient(headers=org.headers, timeout=60) as http:
                async with streamable_http_client(org.mcp_url, http_client=http) as (read, write, _):
                    async with ClientSession(read, write) as s:
                        await s.initialize()
                        a = await s.call_tool("semantic_search", {"query": q, "top_k": 10})
                        b = await s.call_tool("list_recent", {"limit": 10})
                        return not (a.isError or b.isError)

        t0 = time.perf_counter()
        try:
            good = asyncio.run(asyncio.wait_for(session(), 120))
        except Exception as exc:  # the SDK wraps transport errors in task groups
            self.stats.error("mcp_sdk_session", time.perf_counter() - t0, f"{type(exc).__name__}: {exc}")
            return
        if good:
            self.stats.ok("mcp_sdk_session", time.perf_counter() - t0)
        else:
            self.stats.error("mcp_sdk_session", time.perf_counter() - t0, "tool error")

    # -- the loop

    def run(self, deadline: float) -> None:
        names = list(MIX)
        grow_w = [MIX[n] for n in names]
        steady_w = [0 if n in STEADY_OFF else MIX[n] for n in names]
        try:
            while time.monotonic() < deadline:
                op = self.rng.choices(names, steady_w if self.steady() else grow_w)[0]
                org = self.rng.choice(self.orgs)
                try:
                    getattr(self, f"op_{op}")(org)
                except Exception as exc:  # a bench bug must not silently stop a client
                    self.stats.error(op, None, f"client exception {type(exc).__name__}: {exc}")
        finally:
            self.http.close()


def signup_all(base: str, n: int, clients: int) -> list[Org]:
    orgs = []
    with httpx.Client(base_url=base, timeout=60) as c:
        for i in range(n):
            slug = f"soak-{i}-{secrets.token_hex(3)}"
            r = c.post("/v1/signup", json={"name": f"Soak Org {i}", "slug": slug})
            r.raise_for_status()
            body = r.json()
            orgs.append(Org({"slug": slug, "key": body["api_key"]["key"], "mcp_url": body["mcp_url"]}, clients))
    return orgs


def sampler(base: str, pid: int, orgs: list[Org], t0: float, every: float, stop: threading.Event, out: list,
            stats: Stats) -> None:
    with httpx.Client(base_url=base, timeout=30) as c:
        while True:
            try:
                pending = c.get("/health").json().get("pending_jobs")
            except (httpx.HTTPError, ValueError):
                pending = None
            lives = [o.live() for o in orgs]
            with stats.lock:
                done = sum(len(v) for v in stats.lat.values())
            s = {"t": round(time.monotonic() - t0, 1), "rss_mb": rss_mb(pid), "pending_jobs": pending,
                 "thoughts": sum(x[0] for x in lives), "conversations": sum(x[1] for x in lives),
                 "messages": sum(x[2] for x in lives), "requests": done, "cpu_s": cpu_seconds(pid)}
            out.append(s)
            log(f"t={s['t']:7.1f}s rss={s['rss_mb']} MB pending={pending} thoughts={s['thoughts']} "
                f"convs={s['conversations']} msgs={s['messages']} requests={done}")
            if stop.wait(every):
                return


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=30.0, help="duration of the load (default 30)")
    ap.add_argument("--clients", type=int, default=8, help="concurrent clients (default 8)")
    ap.add_argument("--orgs", type=int, default=20, help="organizations (default 20)")
    ap.add_argument("--warmup", type=float, default=None,
                    help="minutes counted as warm-up (default a tenth of the run, at most 3)")
    ap.add_argument("--steady-from", type=float, default=0.5,
                    help="fraction of the run after which deletes balance creates (default 0.5; 1 never)")
    ap.add_argument("--sample-every", type=float, default=10.0, help="seconds between RSS samples (default 10)")
    ap.add_argument("--embedder", choices=["local", "hash"], default="local",
                    help="embedder of the started service (default: the product's, the local model)")
    ap.add_argument("--flat-mb-per-min", type=float, default=1.0,
                    help="RSS slope over the last half below which memory counts as levelled off (default 1.0)")
    ap.add_argument("--server-env", action="append", default=[], metavar="KEY=VALUE",
                    help="an extra environment variable for the server (diagnostics, e.g. MALLOC_ARENA_MAX=2; printed)")
    ap.add_argument("--data-dir", default=None, help="data directory (default: a fresh temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the temp data dir")
    args = ap.parse_args()
    warmup_min = args.warmup if args.warmup is not None else min(3.0, args.minutes / 10)

    env = {} if args.embedder == "local" else {"MEMEX_EMBEDDER": args.embedder}
    why = {"MEMEX_EMBEDDER": "--embedder hash: a free embedding, for short diagnostic runs"}
    for kv in args.server_env:
        k, _, v = kv.partition("=")
        env[k] = v
        why[k] = "--server-env (diagnostic)"
    revision = code_revision()
    load0 = os.getloadavg()[0]
    state = {"steady": threading.Event(), "conversations": conversation_data.build(24, 80, seed=4242).conversations}
    stats = Stats()
    samples: list[dict] = []
    with bench_data_dir(args.data_dir, "memex-soak-", args.keep) as data_dir:
        with serve_subprocess(data_dir, env, log_name="soak-server.log", why=why) as (base, proc, ready, cmd):
            pid = proc.pid
            log(f"server pid {pid} on {base} ready in {ready:.1f} s (data {data_dir}); revision {revision}")
            with httpx.Client(base_url=base, timeout=30) as c:
                h = c.get("/health").json()
            orgs = signup_all(base, args.orgs, args.clients)
            log(f"signed up {len(orgs)} organizations; {args.clients} clients for {args.minutes:g} min")
            stop = threading.Event()
            t0 = time.monotonic()
            duration = args.minutes * 60
            deadline = t0 + duration
            smp = threading.Thread(target=sampler, args=(base, pid, orgs, t0, args.sample_every, stop, samples, stats),
                                   daemon=True)
            smp.start()
            clients = [Client(i, base, orgs, stats, args, state) for i in range(args.clients)]
            threads = [threading.Thread(target=c.run, args=(deadline,), daemon=True) for c in clients]
            for th in threads:
                th.start()
            if args.steady_from < 1:
                time.sleep(max(0.0, t0 + duration * args.steady_from - time.monotonic()))
                for o in orgs:
                    with o.lock:
                        o.thought_cap = [max(1, len(d)) for d in o.thoughts]
                        o.msg_cap = [max(MESSAGES_PER_CONVERSATION, sum(c[1] for c in d)) for d in o.convs]
                state["steady"].set()
                log("steady phase: every further create deletes the oldest (live data held constant)")
            for th in threads:
                th.join(timeout=max(1.0, deadline - time.monotonic() + 180))
            elapsed = time.monotonic() - t0
            stuck = sum(th.is_alive() for th in threads)
            stop.set()
            smp.join(timeout=60)
            samples.append({"t": round(time.monotonic() - t0, 1), "rss_mb": rss_mb(pid), "pending_jobs": None,
                            "thoughts": sum(o.live()[0] for o in orgs), "conversations": sum(o.live()[1] for o in orgs),
                            "messages": sum(o.live()[2] for o in orgs), "requests": None, "cpu_s": cpu_seconds(pid)})
            server_log = (data_dir / "soak-server.log").read_text(errors="replace")

    tracebacks = server_log.count("Traceback")
    good = [s for s in samples if s["rss_mb"] is not None]
    rss_start = good[0]["rss_mb"] if good else None
    after_warm = next((s for s in good if s["t"] >= warmup_min * 60), good[-1] if good else None)
    rss_end = good[-1]["rss_mb"] if good else None
    rss_max = max((s["rss_mb"] for s in good), default=None)
    half = duration / 2
    first_half = [(s["t"], s["rss_mb"]) for s in good if warmup_min * 60 <= s["t"] <= half]
    last_half = [(s["t"], s["rss_mb"]) for s in good if s["t"] >= half]
    slope_first, slope_last = slope_mb_per_min(first_half), slope_mb_per_min(last_half)
    # RSS taken mid-run includes the model's in-flight activations: the medians of whole stretches are steadier.
    med_first = pct([v for t, v in first_half], 50) if first_half else None
    last_quarter = [v for s in good for t, v in [(s["t"], s["rss_mb"])] if t >= duration * 0.75]
    med_last = pct(last_quarter, 50) if last_quarter else None
    total_req = sum(len(v) for v in stats.lat.values())
    total_err = sum(stats.errors.values())
    levelled = slope_last is not None and slope_last <= args.flat_mb_per_min

    print()
    print(f"Soak: {args.clients} clients x {args.orgs} organizations for {elapsed / 60:.1f} min; "
          f"embedder {h['embedder']} ({h['embedding_model']}); revision {revision}")
    print(f"  cores {os.cpu_count()}, load average {load0:.2f} at start, {os.getloadavg()[0]:.2f} at end; "
          f"steady phase from {args.steady_from:.0%} of the run; warm-up {warmup_min:g} min")
    print(f"  {'operation':<22}{'count':>8}{'errors':>8}{'gone':>6}{'p50 ms':>10}{'p95 ms':>10}{'p99 ms':>10}")
    ops = {}
    for op in sorted(set(stats.lat) | set(stats.errors), key=lambda o: -len(stats.lat.get(o, []))):
        lat = stats.lat.get(op, [])
        ops[op] = {"n": len(lat), "errors": stats.errors.get(op, 0), "gone": stats.gone.get(op, 0),
                   "p50_ms": round(pct(lat, 50) * 1000, 1), "p95_ms": round(pct(lat, 95) * 1000, 1),
                   "p99_ms": round(pct(lat, 99) * 1000, 1)}
        o = ops[op]
        print(f"  {op:<22}{o['n']:>8}{o['errors']:>8}{o['gone']:>6}{o['p50_ms']:>10}{o['p95_ms']:>10}{o['p99_ms']:>10}")
    print(f"  total: {total_req} requests, {total_err} errors, {total_req / elapsed:.1f} req/s; "
          f"server tracebacks in its log: {tracebacks}; clients still running at the end: {stuck}")
    for ex in stats.examples[:5]:
        print(f"    error: {ex}")
    print(f"  RSS start {rss_start} MB, after warm-up ({after_warm['t'] if after_warm else '-'} s) "
          f"{after_warm['rss_mb'] if after_warm else '-'} MB, end {rss_end} MB, max {rss_max} MB")
    print(f"  RSS slope: first half (after warm-up) {slope_first} MB/min, last half {slope_last} MB/min "
          f"-> {'LEVELS OFF' if levelled else 'STILL GROWING'} (threshold {args.flat_mb_per_min:g} MB/min)")
    print(f"  RSS median: first half after warm-up {med_first and round(med_first, 1)} MB, "
          f"last quarter {med_last and round(med_last, 1)} MB")
    if good:
        mid = min(good, key=lambda s: abs(s["t"] - half))
        for label, s in (("start", good[0]), ("half", mid), ("end", good[-1])):
            print(f"  live data at {label:<5}: {s['thoughts']} thoughts, {s['conversations']} conversations, "
                  f"{s['messages']} messages; pending jobs {s['pending_jobs']}")
    summary = {
        "bench": "soak", "minutes": round(elapsed / 60, 2), "clients": args.clients, "orgs": args.orgs,
        "embedder": h["embedder"], "revision": revision, "steady_from": args.steady_from,
        "requests": total_req, "errors": total_err, "req_per_s": round(total_req / elapsed, 1),
        "server_tracebacks": tracebacks, "ops": ops,
        "rss_mb": {"start": rss_start, "after_warmup": after_warm["rss_mb"] if after_warm else None, "end": rss_end,
                   "max": rss_max, "median_first_half": med_first and round(med_first, 1),
                   "median_last_quarter": med_last and round(med_last, 1), "slope_first_half_mb_per_min": slope_first,
                   "slope_last_half_mb_per_min": slope_last, "levels_off": levelled},
        "samples": [[s["t"], s["rss_mb"], s["thoughts"], s["messages"], s["pending_jobs"]] for s in samples],
        "load_avg": [round(load0, 2), round(os.getloadavg()[0], 2)],
    }
    print(json.dumps(summary, separators=(",", ":")))
    return 0 if total_err == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
