"""Retrieval quality on BEIR SciFact, measured end to end through the REST API.

Loads the SciFact corpus (5,183 abstracts) into a running Memex through ``POST /v1/thoughts`` (one thought per
abstract: title, a blank line, the abstract; ``metadata = {"doc_id": _id}``, ``source = "scifact"``), waits
until every chunk is vector-indexed, runs the 300 test claims through ``POST /v1/search``, maps the results
back to corpus ids through their metadata and prints:

* nDCG@10, Recall@10 and Recall@100, with the standard BEIR / pytrec_eval (trec_eval) definitions: the mean
  over the queries of the qrels file; nDCG with the qrels' graded relevance as linear gain, discount
  ``1/log2(rank+1)``, the ideal DCG from the judged relevant documents; recall = relevant documents retrieved
  in the top k / relevant documents judged;
* search latency p50 / p95 (one client, sequential requests, the HTTP round trip as a client sees it).

Recall@100 needs 100 results per query. The API returns at most ``MAX_TOP_K`` (``services.search.search``) per
call; when the server refuses ``--top-k`` (400/422), the bench falls back to the largest top_k the service
accepts and labels the figure "Recall@<that>" instead of pretending it is Recall@100.

The service is started in a subprocess (``python -m api.cli serve``, the embedded default: SQLite, the local
vector index, MiniLM int8 ONNX) on ``--data-dir`` (a fresh temp dir without it), or the one at ``--url`` is
used. Loading embeds ~10k chunks: a few minutes on 2 cores. Keep the data dir to iterate on ranking without
re-embedding::

    # first run: load and measure, keep the data
    /work/venv/bin/python bench/bench_scifact.py --data-dir /tmp/scifact-data
    # later runs: same data, a new server process running the current code
    /work/venv/bin/python bench/bench_scifact.py --data-dir /tmp/scifact-data --skip-load

The organization's key is kept in ``<data-dir>/bench_scifact.json``. Loading is resumable: documents whose
``doc_id`` is already stored are not sent again. With ``--url`` pass ``--key`` (and ``--skip-load``) to reuse
a loaded organization. Query embeddings are cached by the server (LRU): latencies are honest only on the
first pass over the queries in a server process, which is what a bench-started server gives.

The last line printed is a one-line JSON summary.
"""

from __future__ import annotations

import argparse
import json
import math
import secrets
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from bench_foundation import bench_data_dir, serve_subprocess  # noqa: E402
DEFAULT_DATA = ROOT.parent / "shared" / "data" / "scifact"
STATE_FILE = "bench_scifact.json"
REFERENCE = {"BM25": 66.5, "all-MiniLM-L6-v2": 64.5, "bge-small-en-v1.5": 71.3, "bge-base-en-v1.5": 74.3,
             "BM25+MiniLM RRF, in-process (measured here)": 71.5}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def pct(samples: list[float], q: float) -> float:
    """Percentile q (0-100), linear interpolation; NaN for no samples."""
    if not samples:
        return float("nan")
    s = sorted(samples)
    k = (len(s) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


# -- data --------------------------------------------------------------------------------------------------

def load_corpus(root: Path) -> list[dict]:
    with open(root / "corpus.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def load_queries(root: Path) -> dict[str, str]:
    with open(root / "queries.jsonl", encoding="utf-8") as f:
        return {q["_id"]: q["text"] for q in map(json.loads, filter(str.strip, f))}


def load_qrels(root: Path, split: str) -> dict[str, dict[str, int]]:
    qrels: dict[str, dict[str, int]] = {}
    with open(root / "qrels" / f"{split}.tsv", encoding="utf-8") as f:
        next(f)  # header
        for line in f:
            if line.strip():
                qid, did, score = line.rstrip("\n").split("\t")
                qrels.setdefault(qid, {})[did] = int(score)
    return qrels


def content_of(doc: dict) -> str:
    return f"{doc['title']}\n\n{doc['text']}"


# -- metrics (trec_eval / pytrec_eval definitions, as BEIR reports them) -------------------------------------

def ndcg_at(ranked: list[str], rels: dict[str, int], k: int) -> float:
    """trec_eval ``ndcg_cut.k``: gain = the judged relevance (linear), discount 1/log2(rank + 1)."""
    dcg = sum(rels.get(d, 0) / math.log2(i + 2) for i, d in enumerate(ranked[:k]))
    ideal = sorted((g for g in rels.values() if g > 0), reverse=True)[:k]
    idcg = sum(g / math.log2(i + 2) for i, g in enumerate(ideal))
    return dcg / idcg if idcg > 0 else 0.0


def recall_at(ranked: list[str], rels: dict[str, int], k: int) -> float:
    """trec_eval ``recall.k``: relevant (relevance > 0) documents in the top k / relevant documents judged."""
    relevant = {d for d, g in rels.items() if g > 0}
    return len(relevant.intersection(ranked[:k])) / len(relevant) if relevant else 0.0


def evaluate(run: dict[str, list[str]], qrels: dict[str, dict[str, int]], depth: int) -> dict[str, float]:
    """Means over every query of the qrels (a query with no results scores 0), as percentages."""
    qids = sorted(qrels)
    rows = {
        "ndcg@10": [ndcg_at(run.get(q, []), qrels[q], 10) for q in qids],
        "recall@10": [recall_at(run.get(q, []), qrels[q], 10) for q in qids],
        f"recall@{depth}": [recall_at(run.get(q, []), qrels[q], depth) for q in qids],
    }
    return {k: round(100 * statistics.fmean(v), 2) for k, v in rows.items()}


# -- the service under test ------------------------------------------------------------------------------------

@contextmanager
def service(args):
    """Yield (base_url, data_dir or None, info): a server started here, or the one at --url."""
    if args.url:
        yield args.url.rstrip("/"), (Path(args.data_dir) if args.data_dir else None), {"started_by_bench": False}
        return
    env: dict[str, str] = {}  # the product's defaults (embedded: SQLite, local vectors, local MiniLM)
    with bench_data_dir(args.data_dir, "memex-scifact-") as data_dir:
        with serve_subprocess(data_dir, env, log_mode="a") as (base, proc, _ready, _cmd):
            log(f"server pid {proc.pid} on {base} (data {data_dir})")
            yield base, data_dir, {"started_by_bench": True, "pid": proc.pid, "data_dir": str(data_dir)}


class Api:
    """A keep-alive client that waits out 429s, so a rate-limited --url target still completes."""

    def __init__(self, base: str, key: str | None = None) -> None:
        headers = {"authorization": f"Bearer {key}"} if key else {}
        self.c = httpx.Client(base_url=base, headers=headers, timeout=300)

    def request(self, method: str, path: str, **kw) -> tuple[httpx.Response, float]:
        for attempt in range(1000):
            t0 = time.perf_counter()
            try:
                r = self.c.request(method, path, **kw)
            except httpx.TransportError:
                if attempt >= 5:
                    raise
                time.sleep(1)
                continue
            dt = time.perf_counter() - t0
            if r.status_code not in (429, 503):
                return r, dt
            time.sleep(float(r.headers.get("retry-after", "1") or 1))
        raise RuntimeError(f"{method} {path}: still throttled")

    def close(self) -> None:
        self.c.close()


def organization(base: str, data_dir: Path | None, key: str | None) -> str:
    """The bench organization's key: --key, the one kept in the data dir, or a new sign-up (then kept)."""
    if key:
        return key
    state = data_dir / STATE_FILE if data_dir else None
    if state and state.exists():
        return json.loads(state.read_text())["key"]
    slug = f"scifact-{secrets.token_hex(4)}"
    with httpx.Client(base_url=base, timeout=60) as c:
        r = c.post("/v1/signup", json={"name": "SciFact bench", "slug": slug})
        r.raise_for_status()
        body = r.json()
    if state:
        state.write_text(json.dumps({"slug": slug, "key": body["api_key"]["key"], "org_id": body["organization"]["id"]}))
    return body["api_key"]["key"]


def stored_doc_ids(base: str, key: str) -> dict[str, str]:
    """corpus id -> thought id for every SciFact thought already stored (paging GET /v1/thoughts)."""
    api = Api(base, key)
    out: dict[str, str] = {}
    params: dict = {"limit": 100}
    try:
        while True:
            r, _ = api.request("GET", "/v1/thoughts", params=params)
            r.raise_for_status()
            page = r.json()
            for t in page["thoughts"]:
                did = (t.get("metadata") or {}).get("doc_id")
                if did is not None and t.get("source") == "scifact":
                    out[str(did)] = t["id"]
            if not page.get("next_before"):
                return out
            params = {"limit": 100, "before": page["next_before"], "before_id": page["next_before_id"]}
    finally:
        api.close()


def load(base: str, key: str, corpus: list[dict], clients: int) -> dict:
    have = stored_doc_ids(base, key)
    todo = [d for d in corpus if d["_id"] not in have]
    log(f"corpus {len(corpus)} documents, {len(have)} already stored, {len(todo)} to capture with {clients} clients")
    if not todo:
        return {"captured": 0, "already_stored": len(have)}
    lock = threading.Lock()
    done = [0]
    lat: list[float] = []
    decisions: dict[str, int] = {}  # the write-time decision of each capture (created, duplicate, flagged...)
    t0 = time.perf_counter()
    last = [t0]

    def worker(part: list[dict]) -> None:
        api = Api(base, key)
        try:
            for d in part:
                r, dt = api.request("POST", "/v1/thoughts", json={
                    "content": content_of(d), "source": "scifact", "metadata": {"doc_id": d["_id"]}})
                if r.status_code not in (200, 201):
                    raise RuntimeError(f"capture of {d['_id']} failed: {r.status_code} {r.text[:300]}")
                action = ((r.json().get("decision") or {}).get("action")) or ("created" if r.status_code == 201 else "existing")
                with lock:
                    lat.append(dt)
                    decisions[action] = decisions.get(action, 0) + 1
                    done[0] += 1
                    now = time.perf_counter()
                    if now - last[0] > 15:
                        last[0] = now
                        log(f"  captured {done[0]}/{len(todo)} ({done[0] / (now - t0):.0f}/s)")
        finally:
            api.close()

    with ThreadPoolExecutor(clients) as pool:
        for f in [pool.submit(worker, todo[i::clients]) for i in range(clients)]:
            f.result()
    elapsed = time.perf_counter() - t0
    log(f"captured {len(todo)} in {elapsed:.1f} s; capture p50 {pct(lat, 50) * 1000:.1f} ms; decisions {decisions}")
    return {"captured": len(todo), "capture_s": round(elapsed, 1), "capture_p50_ms": round(pct(lat, 50) * 1000, 2),
            "decisions": decisions}


def wait_indexed(base: str, key: str, ids: list[str], timeout: float) -> float:
    """Until /health shows no pending job, then until every thought shows all its chunks indexed."""
    t0 = time.perf_counter()
    deadline = time.monotonic() + timeout
    last = 0.0
    with httpx.Client(base_url=base, timeout=60) as c:
        while True:
            pending = c.get("/health").json().get("pending_jobs", 0)
            if not pending:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"{pending} jobs still pending after {timeout} s")
            if time.perf_counter() - last > 20:
                last = time.perf_counter()
                log(f"  {pending} embedding jobs pending")
            time.sleep(1)
    # Every chunk of every thought: the jobs are drained, but a chunk counts only once its vector is applied.
    lock = threading.Lock()
    waiting = list(ids)

    def check(part: list[str]) -> list[str]:
        api = Api(base, key)
        left = []
        try:
            for tid in part:
                r, _ = api.request("GET", f"/v1/thoughts/{tid}")
                r.raise_for_status()
                if r.json()["indexing"]["state"] != "indexed":
                    left.append(tid)
        finally:
            api.close()
        return left

    while waiting:
        with ThreadPoolExecutor(4) as pool:
            parts = list(pool.map(check, [waiting[i::4] for i in range(4)]))
        with lock:
            waiting = [t for p in parts for t in p]
        if not waiting:
            break
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(waiting)} thoughts still not indexed after {timeout} s")
        log(f"  {len(waiting)} thoughts not indexed yet")
        time.sleep(2)
    return time.perf_counter() - t0


def run_queries(base: str, key: str, queries: dict[str, str], top_k: int) -> tuple[dict[str, list[str]], list[float], int]:
    """(run, latencies in s, top_k used). Sequential, one keep-alive client."""
    api = Api(base, key)
    try:
        r, _ = api.request("POST", "/v1/search", json={"query": "warm up the model and the connection", "top_k": top_k})
        if r.status_code in (400, 422):
            log(f"the API refuses top_k={top_k} ({r.status_code}); falling back to 50")
            top_k = 50
            r, _ = api.request("POST", "/v1/search", json={"query": "warm up the model and the connection", "top_k": top_k})
        r.raise_for_status()
        run: dict[str, list[str]] = {}
        lat: list[float] = []
        for qid, text in queries.items():
            r, dt = api.request("POST", "/v1/search", json={"query": text, "top_k": top_k})
            r.raise_for_status()
            lat.append(dt)
            ranked: list[str] = []
            for hit in r.json()["results"]:
                did = (hit.get("metadata") or {}).get("doc_id")
                if did is not None and str(did) not in ranked:
                    ranked.append(str(did))
            run[qid] = ranked
        return run, lat, top_k
    finally:
        api.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", help="measure the service at this URL instead of starting one")
    ap.add_argument("--key", help="API key of an organization holding SciFact (with --url)")
    ap.add_argument("--data-dir", help="server data directory to create or reuse (default: a fresh temp dir)")
    ap.add_argument("--skip-load", action="store_true", help="do not capture; the organization already holds the corpus")
    ap.add_argument("--dataset", default=str(DEFAULT_DATA), help="BEIR SciFact directory")
    ap.add_argument("--split", default="test")
    ap.add_argument("--top-k", type=int, default=100, help="results per query (Recall@top_k); 100 for Recall@100")
    ap.add_argument("--clients", type=int, default=4, help="concurrent capture clients")
    ap.add_argument("--index-timeout", type=float, default=3600)
    ap.add_argument("--runs-out", help="write the run (query id -> ranked doc ids) to this JSON file")
    ap.add_argument("--label", default="", help="a name for this configuration, echoed in the summary")
    args = ap.parse_args()

    root = Path(args.dataset)
    corpus = load_corpus(root)
    queries_all = load_queries(root)
    qrels = load_qrels(root, args.split)
    queries = {q: queries_all[q] for q in sorted(qrels, key=lambda x: int(x) if x.isdigit() else x)}

    summary: dict = {"bench": "scifact", "label": args.label, "split": args.split, "queries": len(queries)}
    with service(args) as (base, data_dir, info):
        summary["service"] = info
        key = organization(base, data_dir, args.key)
        if not args.skip_load:
            summary["load"] = load(base, key, corpus, args.clients)
        ids = list(stored_doc_ids(base, key).values())
        missing = len(corpus) - len(ids)
        if missing:
            log(f"WARNING: {missing} corpus documents are not stored (run without --skip-load to finish loading)")
        summary["documents"] = len(ids)
        waited = wait_indexed(base, key, ids, args.index_timeout)
        log(f"all {len(ids)} thoughts indexed ({waited:.1f} s of waiting)")
        summary["index_wait_s"] = round(waited, 1)
        health = httpx.get(f"{base}/health", timeout=30).json()
        summary["embedding_model"] = health.get("embedding_model")
        t0 = time.perf_counter()
        run, lat, top_k = run_queries(base, key, queries, args.top_k)
        summary["search_wall_s"] = round(time.perf_counter() - t0, 1)

    metrics = evaluate(run, qrels, top_k)
    summary.update(metrics)
    summary["top_k"] = top_k
    summary["search_p50_ms"] = round(pct(lat, 50) * 1000, 1)
    summary["search_p95_ms"] = round(pct(lat, 95) * 1000, 1)
    if args.runs_out:
        Path(args.runs_out).write_text(json.dumps(run))

    print(f"\nBEIR SciFact ({args.split}, {len(queries)} queries) through POST /v1/search, "
          f"{summary['embedding_model']}, {summary['documents']} documents")
    print(f"  nDCG@10      {metrics['ndcg@10']:6.2f}")
    print(f"  Recall@10    {metrics['recall@10']:6.2f}")
    label = f"Recall@{top_k}" + ("" if top_k >= 100 else "  (the API's top_k limit; not Recall@100)")
    print(f"  {label:<12} {metrics[f'recall@{top_k}']:6.2f}")
    print(f"  search p50 {summary['search_p50_ms']} ms, p95 {summary['search_p95_ms']} ms (top_k {top_k}, sequential)")
    print("  reference nDCG@10: " + ", ".join(f"{k} {v}" for k, v in REFERENCE.items()))
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
