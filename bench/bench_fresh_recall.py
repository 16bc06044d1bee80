"""Recall right after capture: is what an agent has just remembered found when it asks at once?

The service runs with the product's defaults (MiniLM, the job worker on). After a background of ``--background``
notes is loaded and indexed, each of ``--captures`` new notes is captured (``POST /v1/thoughts``) and searched for at
once by its own title (``POST /v1/search``, top_k 10), before the worker has necessarily embedded it; once every
capture is indexed, the same queries are asked again ("settled"). Two phases:

* **sequential**: capture, search, next (the worker is idle between captures);
* **behind an import**: the same while another client imports ``--import-size`` notes through
  ``POST /v1/thoughts:batch`` (the worker has a backlog, so the captures wait minutes for their vectors).

``--words N`` captures each note's first N words instead (a short memory, as agents usually store them).

Prints, per phase: the share of captures found at rank 1 / in the top 5 at once and settled, the share still
waiting for its vector right after its search, and the search p50 / p95 at once::

    .venv/bin/python bench/bench_fresh_recall.py                        # defaults: 300 background, 60 captures
    .venv/bin/python bench/bench_fresh_recall.py --words 40             # short memories
    .venv/bin/python bench/bench_fresh_recall.py --url URL --key KEY    # a running service (nothing loaded)
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_foundation import (  # noqa: E402
    Api, NoteGenerator, code_revision, indexing_state, log, ms, service, signup, wait_all_indexed,
)


def title(text: str) -> str:
    return text.split("\n", 1)[0].lstrip("# ").strip()


def import_batches(base: str, key: str, gen: NoteGenerator, start: int, n: int) -> list[str]:
    ids: list[str] = []
    with Api(base, key) as api:
        for i in range(start, start + n, 100):
            items = [{"content": gen.note(j)[1]} for j in range(i, min(i + 100, start + n))]
            r, _ = api.request("POST", "/v1/thoughts:batch", json={"items": items})
            assert r.status_code in (200, 201, 207), r.text
            ids += [it["result"]["id"] for it in r.json()["results"]]
    return ids


def rank(results: list[dict], tid: str) -> int | None:
    ids = [h["document_id"] for h in results]
    return ids.index(tid) + 1 if tid in ids else None


def memory(gen: NoteGenerator, i: int, words: int) -> str:
    """Note ``i``, or its first ``words`` words (its title and opening: a short memory, as agents store them)."""
    text = gen.note(i)[1]
    return " ".join(text.split()[:words]) if words else text


def phase(base: str, key: str, gen: NoteGenerator, start: int, n: int, words: int) -> dict:
    out = []
    with Api(base, key) as api:
        for i in range(start, start + n):
            text = memory(gen, i, words)
            r, _ = api.request("POST", "/v1/thoughts", json={"content": text})
            assert r.status_code == 201, r.text
            tid = r.json()["id"]
            r, dt = api.request("POST", "/v1/search", json={"query": title(text), "top_k": 10})
            assert r.status_code == 200, r.text
            waiting = indexing_state(api, tid) != "indexed"  # still waiting after its search: it was during it
            out.append({"id": tid, "query": title(text), "rank": rank(r.json()["results"], tid),
                        "s": dt, "waiting": waiting})
    return {"captures": out}


def settle(base: str, key: str, rows: list[dict]) -> None:
    wait_all_indexed(base, key, [r["id"] for r in rows], timeout=3600)
    with Api(base, key) as api:
        for row in rows:
            r, _ = api.request("POST", "/v1/search", json={"query": row["query"], "top_k": 10})
            row["settled"] = rank(r.json()["results"], row["id"])


def summary(rows: list[dict]) -> dict:
    n = len(rows)

    def share(key: str, k: int) -> float:
        return round(100 * sum(1 for r in rows if r[key] is not None and r[key] <= k) / n, 1)

    return {"n": n, "waiting_pct": round(100 * sum(r["waiting"] for r in rows) / n, 1),
            "at_once_top1_pct": share("rank", 1), "at_once_top5_pct": share("rank", 5),
            "settled_top1_pct": share("settled", 1), "settled_top5_pct": share("settled", 5),
            "search_ms": ms([r["s"] for r in rows])}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="a running service (else one is started with the product's defaults)")
    ap.add_argument("--key", help="with --url: an API key of an organization to write to")
    ap.add_argument("--data-dir")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--embedder", default="local", help="local (the default, MiniLM) or hash")
    ap.add_argument("--background", type=int, default=300, help="notes loaded and indexed first")
    ap.add_argument("--captures", type=int, default=60, help="captures searched at once, per phase")
    ap.add_argument("--import-size", type=int, default=1000, help="notes imported during the second phase")
    ap.add_argument("--words", type=int, default=0,
                    help="captures are the notes' first N words (short memories); 0: whole notes (100-400 words)")
    ap.add_argument("--json", help="write the figures here too")
    args = ap.parse_args()

    gen = NoteGenerator()
    with service(args) as (base, info):
        key = args.key if args.url else signup(base)["key"]
        log(f"loading {args.background} background notes")
        wait_all_indexed(base, key, import_batches(base, key, gen, 0, args.background), timeout=3600)
        start = args.background
        log(f"sequential: {args.captures} captures, each searched at once")
        seq = phase(base, key, gen, start, args.captures, args.words)
        start += args.captures
        log(f"behind an import of {args.import_size} notes")
        imported: list[str] = []
        importer = threading.Thread(target=lambda s=start: imported.extend(
            import_batches(base, key, gen, s, args.import_size)))
        start += args.import_size
        t_import = time.perf_counter()
        importer.start()
        time.sleep(1.0)  # the import under way: the worker has a backlog
        busy = phase(base, key, gen, start, args.captures, args.words)
        importer.join()
        import_s = wait_all_indexed(base, key, imported, timeout=3600) - t_import
        log("waiting until everything is indexed, then asking again")
        settle(base, key, seq["captures"] + busy["captures"])
    figures = {"revision": code_revision(), "embedder": args.embedder, "background": args.background,
               "capture_words": args.words or "whole notes",
               "import_size": args.import_size, "service": info,
               "sequential": summary(seq["captures"]), "behind_import": summary(busy["captures"]),
               "import_to_searchable_s": round(import_s, 1)}
    print(f"\nRecall right after capture ({figures['revision']}, embedder {args.embedder}, "
          f"{args.background} notes first, captures: {figures['capture_words']} words):")
    print("  phase             waiting  top1 at once / settled   top5 at once / settled   search p50 / p95")
    for label, key_ in (("sequential", "sequential"), ("behind an import", "behind_import")):
        s = figures[key_]
        print(f"  {label:<17} {s['waiting_pct']:5.1f}%   {s['at_once_top1_pct']:5.1f}% / {s['settled_top1_pct']:5.1f}%"
              f"          {s['at_once_top5_pct']:5.1f}% / {s['settled_top5_pct']:5.1f}%"
              f"          {s['search_ms']['p50']:.1f} / {s['search_ms']['p95']:.1f} ms")
    print(f"  the import: {args.import_size} notes searchable {figures['import_to_searchable_s']} s after it started"
          f" ({args.import_size / import_s:.1f} notes/s, with the second phase's captures and searches beside it)")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
