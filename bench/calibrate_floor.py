"""Calibrates the relevance floor (services.search.relevance): which cosine / keyword-coverage cut-offs drop the hits of
queries about things the organization never wrote, and what they cost on real queries.

Runs in process against a data directory already holding BEIR SciFact (made by ``bench/bench_scifact.py
--data-dir D``): the 300 test claims (nDCG@10, Recall@10, Recall@100 with each setting) and OFF_TOPIC, everyday
questions with no answer in a corpus of scientific abstracts (hits returned per query; the goal is none).
This is a calibration tool, not a product figure: it sets the floor's constants to each grid value in turn
(printed); ``bench/bench_scifact.py`` measures the product as shipped.

    .venv/bin/python bench/calibrate_floor.py --data-dir /tmp/sf/data
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_scifact import DEFAULT_DATA, evaluate, load_qrels, load_queries  # noqa: E402

OFF_TOPIC = [
    "best pizza dough recipe for a home oven", "how do I renew my passport", "who won the football match last night",
    "cheap flights to Lisbon in May", "how to fix a leaking kitchen tap", "what time does the supermarket close",
    "lyrics of a famous pop song about summer", "how to train a puppy to sit", "best hiking trails near the lake",
    "how to change a car tyre", "recommended novels for a long train ride", "how much does a used bicycle cost",
    "tips for growing tomatoes on a balcony", "what is the capital of Australia", "how to knit a scarf for beginners",
    "when is the next public holiday", "how to make cold brew coffee", "which smartphone has the best camera",
    "how to write a cover letter for a job", "how to clean a cast iron pan", "the rules of chess castling",
    "where to watch the new superhero movie", "how to set up a home wifi router", "best beaches in Thailand",
    "how to bake chocolate chip cookies", "what to pack for a camping weekend", "how to tie a bow tie",
    "stock market opening hours", "how to play the guitar chord G major", "best board games for families",
    "meeting notes from the quarterly planning session", "the deploy pipeline failed on the staging cluster",
    "who is on call for the payments service this week", "rename the git branch and push it",
    "what did we decide about the office move", "budget for the marketing offsite",
    "customer asked for a refund on their subscription", "reset my password for the admin console",
    "the Redis cache eviction policy", "upgrade the Kubernetes cluster to the next version",
]


async def run(data_dir: Path, dataset: Path, grid: list[tuple[float | None, float]]) -> None:
    from api.settings import Settings
    from api.wiring import Memex
    import services.search.relevance as relevance
    from services.search.search import SearchOptions
    from tenancy.models import AuthContext

    state = json.loads((data_dir / "bench_scifact.json").read_text())
    memex = Memex(Settings(data_dir=data_dir))
    await memex.start(worker=False)
    org = await memex.for_org(AuthContext(org_id=state["org_id"], org_slug=state["slug"], principal="bench",
                                    scopes=frozenset({"read"})))
    queries_all = load_queries(dataset)
    qrels = load_qrels(dataset, "test")
    queries = {q: queries_all[q] for q in qrels}
    doc_of: dict[str, str] = {}
    emb = memex.backend.embedder
    print(f"{'cosine floor':>12} {'coverage':>8} {'nDCG@10':>8} {'R@10':>6} {'R@100':>6} "
          f"{'off-topic hits/q (mean, max, zero-hit share)':>46}")
    for cos_floor, cov_floor in grid:
        emb.relevance_floor = cos_floor
        relevance.KEYWORD_COVERAGE_FLOOR = cov_floor
        runs = {}
        for qid, text in queries.items():
            res = await org.search.search(SearchOptions(query=text, top_k=100))
            ranked = []
            for h in res.results:
                if h.document_id not in doc_of:
                    row = await org.thoughts.sql.one(
                        "SELECT metadata FROM documents WHERE organization_id = ?1 AND id = ?2", [h.document_id])
                    doc_of[h.document_id] = json.loads(row["metadata"]).get("doc_id")
                ranked.append(doc_of[h.document_id])
            runs[qid] = ranked
        m = evaluate(runs, qrels, 100)
        off = [len((await org.search.search(SearchOptions(query=q, top_k=10))).results) for q in OFF_TOPIC]
        zero = sum(1 for n in off if n == 0) / len(off)
        label = "off" if cos_floor is None else f"{cos_floor:.2f}"
        print(f"{label:>12} {cov_floor:8.2f} {m['ndcg@10']:8.2f} {m['recall@10']:6.2f} {m['recall@100']:6.2f} "
              f"{statistics.mean(off):>20.2f} {max(off):>6} {zero:>18.2f}", flush=True)
    await memex.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data-dir", required=True)
    ap.add_argument("--dataset", default=str(DEFAULT_DATA))
    ap.add_argument("--cosines", default="off,0.15,0.2,0.25,0.3")
    ap.add_argument("--coverages", default="0.5,0.67,1.0")
    args = ap.parse_args()
    cos = [None if c == "off" else float(c) for c in args.cosines.split(",")]
    covs = [float(c) for c in args.coverages.split(",")]
    grid = [(c, v) for c in cos for v in (covs if c is not None else covs[:1])]
    asyncio.run(run(Path(args.data_dir), Path(args.dataset), grid))
    return 0


if __name__ == "__main__":
    sys.exit(main())
