"""Conversations: retrieval quality, append and search latency at scale, storage before/after compression.

    /work/venv/bin/python bench/bench_conversations.py                       # the default run (a few minutes)
    /work/venv/bin/python bench/bench_conversations.py --convs 60 --msgs 120 --scale-convs 200

Three parts, each through the real services (SQLite, local vector index):

1. quality: a long multi-session set (``bench/conversation_data.py``, deterministic): facts stated once,
   deep inside long conversations, asked about later in other words. Loaded with appends of 20 messages,
   embedded by the real local model (MiniLM, ``--embedder local``). Reported as message-level recall@10:
   the top-10 distinct messages in rank order, where each hit contributes its ``best_sequence`` first (and
   the rest of its window after every hit's best message). Compared with plain BM25 over single messages
   (SQLite FTS5, porter tokenizer, the same OR-of-terms query the service builds).
2. scale: an organization holding ``--scale-convs`` conversations of ``--scale-msgs`` messages (default
   1,000 x 100). Embedding 100k messages with the real model takes ~40 min on this machine, so this part
   uses the hash embedder (deterministic feature hashing, same dimensions) to fill the vector index; the
   keyword index, the SQL rows and the search code are the real ones. Append of 20 messages and search
   p50/p95, through the service and through HTTP on loopback (uvicorn, the whole app).
3. storage: bytes per message of the stored content before and after compression, on the generated set
   and on real English prose (the SciFact abstracts in shared/data, one abstract = one message).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import json
import random
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path

import msgspec

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from conversation_data import FACTS, build, build_prose  # noqa: E402

from api.settings import Settings  # noqa: E402
from api.wiring import Memex  # noqa: E402
from services.conversations.compression import encode_content  # noqa: E402
from services.conversations.models import MessageIn  # noqa: E402
from services.search.fusion import fts_query  # noqa: E402
from services.search.search import SearchOptions  # noqa: E402
from tenancy.models import AuthContext  # noqa: E402

SCIFACT = ROOT.parent / "shared" / "data" / "scifact" / "corpus.jsonl"


def pct(samples: list[float], p: float) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, int(round(p * (len(s) - 1))))]


def fmt_ms(samples: list[float]) -> str:
    ms = [x * 1000 for x in samples]
    return f"p50 {statistics.median(ms):7.2f} ms   p95 {pct(ms, 0.95):7.2f} ms   (n={len(ms)})"


async def open_org(data_dir: Path, embedder: str, slug: str):
    settings = Settings(data_dir=data_dir, embedder=embedder, run_worker=False, key_rate_per_minute=10**9)
    memex = Memex(settings)
    await memex.start(worker=False)
    org, issued = await memex.orgs.create(name=slug, slug=slug)
    ctx = AuthContext(org_id=org.id, org_slug=org.slug, principal="bench", scopes=frozenset({"read", "write", "admin"}))
    return memex, await memex.for_org(ctx), issued.raw


async def load(svc, conversations: list[list[tuple[str, str]]], per_call: int) -> tuple[list[str], float]:
    ids, t0 = [], time.perf_counter()
    for turns in conversations:
        conv = await svc.conversations.create(title=None)
        ids.append(conv.id)
        for i in range(0, len(turns), per_call):
            await svc.conversations.append(conv.id, [MessageIn(role=r, content=c) for r, c in turns[i : i + per_call]])
    return ids, time.perf_counter() - t0


def ranked_messages(hits: list[dict]) -> list[tuple[str, int]]:
    """Top distinct messages in rank order: every hit's best message first, then the rest of the windows."""
    out: list[tuple[str, int]] = []
    for h in hits:
        out.append((h["conversation_id"], h["best_sequence"]))
    for h in hits:
        out.extend((h["conversation_id"], m["sequence"]) for m in h["messages"])
    return list(dict.fromkeys(out))


# -- 1. quality ------------------------------------------------------------------------------------------


def bm25_baseline(conversations: list[list[tuple[str, str]]]):
    db = sqlite3.connect(":memory:")
    db.execute("CREATE VIRTUAL TABLE m USING fts5(content, tokenize = 'porter unicode61')")
    keys = []
    for ci, turns in enumerate(conversations):
        for seq, (_role, content) in enumerate(turns, start=1):
            keys.append((ci, seq))
            db.execute("INSERT INTO m (rowid, content) VALUES (?, ?)", (len(keys), content))

    def search(query: str, k: int = 10) -> list[tuple[int, int]]:
        match = fts_query(query)
        rows = db.execute("SELECT rowid FROM m WHERE m MATCH ? ORDER BY bm25(m) LIMIT ?", (match, k)).fetchall() if match else []
        return [keys[r[0] - 1] for r in rows]

    return search


async def quality(args) -> None:
    data = build(args.convs, args.msgs, seed=args.seed)
    n_msgs = sum(len(c) for c in data.conversations)
    print(f"\n== quality: {args.convs} conversations x {args.msgs} messages ({n_msgs} messages), "
          f"{len(data.placements)} facts, embedder={args.embedder}")
    with tempfile.TemporaryDirectory() as tmp:
        memex, svc, _ = await open_org(Path(tmp), args.embedder, "bench-quality")
        try:
            ids, took = await load(svc, data.conversations, 20)
            print(f"loaded in {took:.1f} s (appends of 20)")
            t0 = time.perf_counter()
            await memex.worker.drain(timeout=7200)
            chunks = (await memex.backend.db.execute(
                "SELECT COUNT(*) AS n, SUM(token_count > ?) AS over, AVG(token_count) AS avg FROM chunks",
                (memex.backend.embedder.max_tokens - 2,))).rows[0]
            print(f"embedded {chunks['n']} windows in {time.perf_counter() - t0:.1f} s; mean {chunks['avg']:.0f} tokens; "
                  f"{chunks['over']} ({100 * chunks['over'] / max(1, chunks['n']):.0f}%) longer than the model's "
                  f"{memex.backend.embedder.max_tokens} tokens (embedded truncated)")

            bm25 = bm25_baseline(data.conversations)
            ours = {"best-first": 0, "best only": 0, "window": 0, "pinpointed": 0}
            base, lat = 0, []
            rr_ours, rr_base = [], []
            for fi, ci, seq in data.placements:
                q = FACTS[fi].question
                t0 = time.perf_counter()
                res = await svc.search.search(SearchOptions(query=q, top_k=10, kinds=("conversation",)))
                lat.append(time.perf_counter() - t0)
                hits = [msgspec.to_builtins(h) for h in res.results]
                target = (ids[ci], seq)
                ranking = ranked_messages(hits)[:10]
                ours["best-first"] += target in ranking
                ours["best only"] += target in [(h["conversation_id"], h["best_sequence"]) for h in hits][:10]
                in_window = [h for h in hits
                             if h["conversation_id"] == ids[ci] and h["start_sequence"] <= seq <= h["end_sequence"]]
                ours["window"] += bool(in_window)
                ours["pinpointed"] += any(h["best_sequence"] == seq for h in in_window)
                rr_ours.append(1 / (ranking.index(target) + 1) if target in ranking else 0.0)
                top = bm25(q)
                base += (ci, seq) in top
                rr_base.append(1 / (top.index((ci, seq)) + 1) if (ci, seq) in top else 0.0)
            n = len(data.placements)
            print(f"message-level recall@10   memex (hybrid windows + best_sequence): {ours['best-first'] / n:.3f}   "
                  f"MRR@10 {statistics.mean(rr_ours):.3f}")
            print(f"message-level recall@10   BM25 over single messages (FTS5):       {base / n:.3f}   "
                  f"MRR@10 {statistics.mean(rr_base):.3f}")
            print(f"  memex, one message per hit (best_sequence of the top 10 hits): {ours['best only'] / n:.3f}")
            print(f"  memex, fact inside one of the top-10 windows:                  {ours['window'] / n:.3f}; "
                  f"best_sequence right when it is: {ours['pinpointed'] / max(1, ours['window']):.3f}")
            print(f"search latency with the {args.embedder} embedder (query embedding included): {fmt_ms(lat)}")
        finally:
            await memex.stop()


# -- 2. scale -------------------------------------------------------------------------------------------


def english_queries(rng: random.Random, n: int) -> list[str]:
    pool = [f.question for f in FACTS] + [
        "how do I fix a dripping tap", "best time to plant garlic", "beginner plan for weight training",
        "rail pass for Kyoto", "emergency fund size", "feedback to a colleague who misses deadlines",
        "roast pumpkin at 200 degrees", "parse log lines in Go", "retirement savings percentage",
        "possums in the vegetable patch",
    ]
    return [rng.choice(pool) for _ in range(n)]


def scifact_sentences() -> list[str]:
    out = []
    with SCIFACT.open(encoding="utf-8") as f:
        for line in f:
            out += [s.strip() + "." for s in json.loads(line)["text"].split(". ") if len(s) > 20]
    return out


def english_queries_from(rng: random.Random, data, n: int) -> list[str]:
    """Questions made of 4-8 consecutive words of a random message (each finds something)."""
    out = []
    while len(out) < n:
        words = rng.choice(rng.choice(data.conversations))[1].split()
        if len(words) >= 8:
            i = rng.randrange(len(words) - 7)
            out.append(" ".join(words[i : i + rng.randint(4, 8)]).strip(".,;:"))
    return out


async def scale(args) -> None:
    prose = args.scale_text == "prose" and SCIFACT.exists()
    if prose:
        data = build_prose(args.scale_convs, args.scale_msgs, scifact_sentences(), seed=args.seed + 1)
    else:
        data = build(args.scale_convs, args.scale_msgs, seed=args.seed + 1)
    n_msgs = sum(len(c) for c in data.conversations)
    print(f"\n== scale: {args.scale_convs} conversations x {args.scale_msgs} messages ({n_msgs:,} messages), "
          f"{'assistant turns of real English prose (SciFact sentences)' if prose else 'template text'}, hash embedder")
    print("setting changed from the defaults: MEMEX_EMBEDDER=hash (the local model needs ~40 min to embed 100k "
          "messages on 2 cores; this part times storage, keyword and vector search, not the model), "
          "MEMEX_KEY_RATE_PER_MINUTE raised (the bench sends more than a user's key may)")
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        memex, svc, key = await open_org(tmp, "hash", "bench-scale")
        try:
            ids, took = await load(svc, data.conversations, 100)
            print(f"loaded in {took:.1f} s ({n_msgs / took:,.0f} messages/s, appends of 100)")
            t0 = time.perf_counter()
            await memex.worker.drain(timeout=7200)
            info = await memex.backend.index.info()
            print(f"embedded and indexed {info.vector_count:,} windows in {time.perf_counter() - t0:.1f} s")
            storage(memex, n_msgs, data.conversations, tmp)
            await storage_scifact()

            appends = []
            for _ in range(args.samples):
                cid = rng.choice(ids)
                batch = [MessageIn(role="user" if j % 2 == 0 else "assistant", content=c)
                         for j, (_, c) in enumerate(data.conversations[rng.randrange(len(ids))][:20])]
                t0 = time.perf_counter()
                await svc.conversations.append(cid, batch)
                appends.append(time.perf_counter() - t0)
            print(f"append 20 messages (service):            {fmt_ms(appends)}")
            await memex.worker.drain(timeout=600)
            queries = english_queries(rng, args.samples // 2) + english_queries_from(rng, data, args.samples - args.samples // 2)
            rng.shuffle(queries)
            searches, scoped = [], []
            for q in queries[:5]:  # warm the namespace and the page cache
                await svc.search.search(SearchOptions(query=q, kinds=("conversation",)))
            for q in queries:
                t0 = time.perf_counter()
                await svc.search.search(SearchOptions(query=q, top_k=10, kinds=("conversation",)))
                searches.append(time.perf_counter() - t0)
            for q in queries:
                cid = rng.choice(ids)
                t0 = time.perf_counter()
                await svc.search.search(SearchOptions(query=q, top_k=10, kinds=("conversation",), parent_id=cid))
                scoped.append(time.perf_counter() - t0)
            print(f"search top 10, whole org (service):      {fmt_ms(searches)}")
            print(f"search top 10, one conversation (service): {fmt_ms(scoped)}")
        finally:
            await memex.stop()
        await http_latency(args, tmp, key, ids, data, rng)


async def http_latency(args, data_dir: Path, key: str, ids: list[str], data, rng: random.Random) -> None:
    import httpx

    from api.app import create_app
    from tests.live import serve

    memex = Memex(Settings(data_dir=data_dir, embedder="hash", key_rate_per_minute=10**9, org_rate_per_minute=10**9,
                           worker_poll_seconds=0.2))
    headers = {"authorization": f"Bearer {key}"}
    with serve(create_app(memex=memex)) as base, httpx.Client(base_url=base, headers=headers, timeout=60) as c:
        queries = english_queries(rng, args.samples // 2) + english_queries_from(rng, data, args.samples - args.samples // 2)
        for q in queries[:5]:
            c.post("/v1/search", json={"query": q, "kinds": ["conversation"]})
        appends, searches = [], []
        for _ in range(args.samples):
            body = {"messages": [{"role": r, "content": m} for r, m in data.conversations[rng.randrange(len(ids))][:20]]}
            t0 = time.perf_counter()
            r = c.post(f"/v1/conversations/{rng.choice(ids)}/messages", json=body)
            appends.append(time.perf_counter() - t0)
            assert r.status_code == 201, r.text
        time.sleep(1.0)
        for q in queries:
            t0 = time.perf_counter()
            r = c.post("/v1/search", json={"query": q, "kinds": ["conversation"], "top_k": 10})
            searches.append(time.perf_counter() - t0)
            assert r.status_code == 200, r.text
        print(f"append 20 messages (HTTP, acknowledged): {fmt_ms(appends)}")
        print(f"search top 10, whole org (HTTP):         {fmt_ms(searches)}")


# -- 3. storage -----------------------------------------------------------------------------------------


def storage(memex: Memex, n_msgs: int, conversations, data_dir: Path) -> None:
    raw = sum(len(c.encode("utf-8")) for turns in conversations for _, c in turns)
    org_db = next((data_dir / "orgs").glob("*/memex.sqlite3"))  # the organization's own database
    with sqlite3.connect(org_db) as db:
        stored, by_enc = 0, {}
        for enc, n, size in db.execute(
            "SELECT content_encoding, COUNT(*), SUM(LENGTH(CAST(content AS BLOB))) FROM messages GROUP BY 1"
        ):
            by_enc[enc] = n
            stored += size
        chunk_bytes = db.execute("SELECT SUM(LENGTH(CAST(content AS BLOB))) FROM chunks").fetchone()[0]
    file_bytes = org_db.stat().st_size
    print(f"storage, scale set: content {raw / n_msgs:,.0f} B/message before, {stored / n_msgs:,.0f} B/message after "
          f"({raw / stored:.2f}x; encodings {by_enc})")
    print(f"  for context: window text {chunk_bytes / n_msgs:,.0f} B/message (uncompressed, as the seed), "
          f"whole SQLite file {file_bytes / n_msgs:,.0f} B/message (rows, indexes, keyword index)")
    buckets: dict[str, list[int]] = {}
    for turns in conversations:
        for _, c in turns:
            size = len(c.encode())
            name = "<128 B" if size < 128 else "128-511 B" if size < 512 else "512 B-2 KiB" if size < 2048 else ">=2 KiB"
            buckets.setdefault(name, [0, 0, 0])
            b = buckets[name]
            b[0] += 1
            b[1] += size
            b[2] += len(encode_content(c)[0])
    print("  by size: " + "; ".join(f"{k}: {v[0]:,} msgs {v[1] / max(1, v[2]):.2f}x" for k, v in buckets.items()))


async def storage_scifact() -> None:
    if not SCIFACT.exists():
        print("storage, real English prose: shared/data/scifact not found, skipped")
        return
    before = after = n = 0
    with SCIFACT.open(encoding="utf-8") as f:
        for line in f:
            text = json.loads(line)["text"]
            if not text:
                continue
            n += 1
            before += len(text.encode())
            after += len(encode_content(text)[0])
    print(f"storage, real English prose (SciFact abstracts as messages, {n:,}): {before / n:,.0f} B/message before, "
          f"{after / n:,.0f} after ({before / after:.2f}x)")


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--convs", type=int, default=30, help="quality set: conversations")
    p.add_argument("--msgs", type=int, default=80, help="quality set: messages per conversation")
    p.add_argument("--embedder", default="local", choices=["local", "hash"], help="quality set: embedder")
    p.add_argument("--scale-convs", type=int, default=1000)
    p.add_argument("--scale-msgs", type=int, default=100)
    p.add_argument("--scale-text", default="prose", choices=["prose", "templates"],
                   help="scale set: assistant turns of real prose (SciFact sentences) or of the quality set's templates")
    p.add_argument("--samples", type=int, default=200, help="timed appends / searches per figure")
    p.add_argument("--seed", type=int, default=20261122)
    p.add_argument("--skip-quality", action="store_true")
    p.add_argument("--skip-scale", action="store_true")
    args = p.parse_args()
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} CPUs "
          "(latencies below are wall-clock on a shared machine)")
    if not args.skip_quality:
        await quality(args)
    if not args.skip_scale:
        await scale(args)


if __name__ == "__main__":
    asyncio.run(main())
