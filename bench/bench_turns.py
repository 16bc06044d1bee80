"""Turn-level conversation retrieval: recall@10 of evidence turns, the product against BM25 over 3-turn windows.

    .venv/bin/python bench/bench_turns.py                   # the default run (~3-5 minutes on 2 cores)
    .venv/bin/python bench/bench_turns.py --convs 4 --sessions 6   # a quick look

Data (``bench/turn_data.py``, deterministic): LoCoMo-like two-person conversations over dated sessions, stored
one conversation per conversation, each session appended with its date (``created_at``) and label
(``session``); questions annotated with evidence turns: single-hop, temporal (incl. relative ones asked
from a later ``reference_time``), multi-hop (evidence in 2-3 sessions) and open-domain (an inference).

Turn-level recall@10. For one question with evidence turns E (each a (conversation, sequence) pair) and a
system's ranked list of distinct turns L (first 10), recall@10 = |E ∩ L[:10]| / |E|. The figure per type and
overall is the mean over the questions. The ranked turns of each system:

* product: ``POST /v1/search``'s service (``Search.search``, kinds ["conversation"], top_k 10, the product
  defaults, the real local MiniLM embedder ``OnnxMiniLMEmbedder``): each hit's message (``best_sequence``) in
  hit order; were there fewer than 10 hits, the other messages of their windows follow in hit order. Relative
  temporal questions pass their ``reference_time`` (the API field of that name), as a client asking "last
  week" at that time would.
* BM25 over 3-turn windows (the baseline): SQLite FTS5 (porter unicode61) over windows of 3 consecutive turns
  of one conversation (``--baseline-stride 3``: non-overlapping; 1: sliding), queried with the service's own
  OR-of-terms expression (``fts_query``); windows best first, each contributes its 3 turns in order,
  duplicates dropped, first 10.

``--root`` runs the product side from another checkout (e.g. a ``git worktree`` of an older commit, to measure
"before"): a version without ``created_at`` on append gets the messages without times (and no reference time).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sqlite3
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from turn_data import TurnSet, build  # noqa: E402

KINDS = ("single-hop", "temporal", "multi-hop", "open-domain")


def recall(evidence: list[tuple[int, int]], ranked: list[tuple[int, int]]) -> float:
    top = set(ranked[:10])
    return sum(e in top for e in evidence) / len(evidence)


def report(name: str, per_q: list[tuple[str, float]]) -> dict[str, float]:
    by: dict[str, list[float]] = defaultdict(list)
    for kind, r in per_q:
        by[kind].append(r)
    out = {k: 100 * statistics.mean(by[k]) for k in KINDS if by[k]}
    out["overall"] = 100 * statistics.mean(r for _, r in per_q)
    print(f"{name:<44}" + "".join(f"{out.get(k, float('nan')):>13.1f}" for k in (*KINDS, "overall")))
    return out


def bm25_windows(data: TurnSet, fts_query, stride: int):
    db = sqlite3.connect(":memory:")
    db.execute("CREATE VIRTUAL TABLE w USING fts5(content, tokenize = 'porter unicode61')")
    spans: list[list[tuple[int, int]]] = []
    for ci in range(len(data.conversations)):
        turns = data.turns(ci)
        for i in range(0, len(turns), stride):
            part = turns[i : i + 3]
            if not part:
                break
            spans.append([(ci, i + j + 1) for j in range(len(part))])
            db.execute("INSERT INTO w (rowid, content) VALUES (?, ?)", (len(spans), "\n".join(t[2] for t in part)))
            if i + 3 >= len(turns):
                break

    def search(query: str) -> list[tuple[int, int]]:
        match = fts_query(query)
        rows = db.execute("SELECT rowid FROM w WHERE w MATCH ? ORDER BY bm25(w) LIMIT 40", (match,)).fetchall() if match else []
        out: list[tuple[int, int]] = []
        for (rowid,) in rows:
            for t in spans[rowid - 1]:
                if t not in out:
                    out.append(t)
            if len(out) >= 10:
                break
        return out[:10]

    return search


async def product(data: TurnSet, args) -> list[tuple[str, float]]:
    import msgspec

    from api.settings import Settings
    from api.wiring import Memex
    from services.conversations.models import MessageIn
    from services.search.search import SearchOptions
    from tenancy.models import AuthContext

    timed = "created_at" in MessageIn.__struct_fields__
    relative = "reference_time" in SearchOptions.__dataclass_fields__
    with tempfile.TemporaryDirectory() as tmp:
        extra_settings = {} if args.keyword_index_from is None else {"keyword_index_from": args.keyword_index_from}
        settings = Settings(data_dir=Path(tmp), embedder="local", run_worker=False, key_rate_per_minute=10**9,
                            **extra_settings)
        memex = Memex(settings)
        await memex.start(worker=False)
        try:
            org, _ = await memex.orgs.create(name="bench turns", slug="bench-turns")
            ctx = AuthContext(org_id=org.id, org_slug=org.slug, principal="bench", scopes=frozenset({"read", "write"}))
            svc = await memex.for_org(ctx)
            print(f"product: embedder {type(memex.backend.embedder).__name__} ({memex.backend.embedder.model_id}); "
                  f"message times {'given (created_at, session)' if timed else 'not supported by this version'}")
            if args.keyword_index_from is not None:
                print(f"setting changed: MEMEX_KEYWORD_INDEX_FROM={args.keyword_index_from} (default 10,000), so that this "
                      "small set's keyword side is ranked by the tantivy indexes a large organization gets")
            print("knobs: none (product defaults; the worker is drained in-process instead of polling); the "
                  f"{sum(1 for q in data.questions if q.reference_time)} relative questions pass reference_time"
                  f"{'' if relative else ' (not supported by this version: not passed)'}")
            t0 = time.perf_counter()
            ids: list[str] = []
            for ci, sessions in enumerate(data.conversations):
                conv = await svc.conversations.create(title=f"conversation {ci}")
                ids.append(conv.id)
                for si, s in enumerate(sessions):
                    msgs = []
                    for role, speaker, text in s.turns:
                        extra = {"metadata": {"speaker": speaker}}
                        msgs.append(MessageIn(role=role, content=f"{speaker}: {text}", **extra))
                    kw = {"created_at": s.date.strftime("%Y-%m-%dT%H:%M:%SZ"), "session": f"session {si + 1}"} if timed else {}
                    await svc.conversations.append(conv.id, msgs, **kw)
            loaded = time.perf_counter() - t0
            t0 = time.perf_counter()
            await memex.worker.drain(timeout=7200)
            if args.keyword_index_from:
                db = (await memex.stores.open(org.id)).db
                print(f"keyword indexes current: thoughts {await db.keyword_sync()}, "
                      f"conversations {await db.keyword_sync(chunks=True)}")
            n = await svc.search.sql.rows("SELECT kind, COUNT(*) AS n FROM chunks WHERE organization_id = ?1 GROUP BY kind")
            print(f"loaded in {loaded:.1f} s; embedded {', '.join(str(r['n']) + ' ' + r['kind'] for r in n)} chunks in "
                  f"{time.perf_counter() - t0:.1f} s")
            back = {cid: ci for ci, cid in enumerate(ids)}
            out, lat = [], []
            for q in data.questions:
                extra = {"reference_time": q.reference_time} if relative and q.reference_time else {}
                t0 = time.perf_counter()
                res = await svc.search.search(SearchOptions(query=q.text, top_k=10, kinds=("conversation",), **extra))
                lat.append(time.perf_counter() - t0)
                hits = [msgspec.to_builtins(h) for h in res.results]
                ranked = [(back[h["conversation_id"]], h["best_sequence"]) for h in hits]
                for h in hits:
                    ranked += [(back[h["conversation_id"]], m["sequence"]) for m in h["messages"]]
                out.append((q.kind, recall(q.evidence, list(dict.fromkeys(ranked)))))
            lat.sort()
            print(f"product search latency: p50 {1000 * statistics.median(lat):.1f} ms, "
                  f"p95 {1000 * lat[int(0.95 * (len(lat) - 1))]:.1f} ms")
            return out
        finally:
            await memex.stop()


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--convs", type=int, default=8)
    p.add_argument("--sessions", type=int, default=10)
    p.add_argument("--turns", type=int, default=24, help="turns per session")
    p.add_argument("--seed", type=int, default=20240607)
    p.add_argument("--root", type=Path, default=HERE.parent, help="checkout whose product code to measure")
    p.add_argument("--skip-product", action="store_true")
    p.add_argument("--keyword-index-from", type=int, default=None,
                   help="MEMEX_KEYWORD_INDEX_FROM for the product side (default: the product's, 10,000)")
    args = p.parse_args()
    sys.path.insert(0, str(args.root.resolve()))
    from services.search.fusion import fts_query

    data = build(args.convs, args.sessions, args.turns, seed=args.seed)
    n_turns = sum(len(data.turns(i)) for i in range(len(data.conversations)))
    counts = {k: sum(q.kind == k for q in data.questions) for k in KINDS}
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} CPUs; product code: {args.root}")
    print(f"data: {args.convs} conversations x {args.sessions} sessions x {args.turns} turns = {n_turns} turns; "
          f"{len(data.questions)} questions {counts}")
    results = {}
    if not args.skip_product:
        results["product"] = await product(data, args)
    print("\nturn-level recall@10 (%)                    " + "".join(f"{k:>13}" for k in (*KINDS, "overall")))
    if "product" in results:
        report("memex (product defaults)", results["product"])
    for stride in (3, 1):
        search = bm25_windows(data, fts_query, stride)
        label = "non-overlapping" if stride == 3 else "sliding, stride 1"
        report(f"BM25 over 3-turn windows ({label})", [(q.kind, recall(q.evidence, search(q.text))) for q in data.questions])


if __name__ == "__main__":
    asyncio.run(main())
