"""Knowledge bases end to end over HTTP: a full sync of a generated vault, the embedding behind it against the raw
embedder on the same texts, an incremental sync of a few changed files, and public search latency.

Starts ``python -m api.cli serve`` in a separate process (its own GIL and CPU, as deployed) on a fresh data
directory with the product's defaults (SQLite, the local vector index, the local MiniLM int8 ONNX embedder), then:

1. **full sync**: a vault of ``--files`` notes (``tests.kb_vault.generated_vault``: the seed's folders and types,
   ~3% malformed YAML, ~5% unpublished, wikilinks) committed to a local git repository (dulwich), an organization
   signed up, ``POST /v1/knowledge-bases`` with that path as its git source (open visibility; the first sync is
   queued at creation). ``GET /v1/knowledge-bases/{kb}`` is polled: the time to "sync succeeded" (every entry
   written and keyword-searchable: chunks are searchable by keyword as their batch commits) in files/s, and the
   time until every chunk is vector-indexed (``chunks == chunks_searchable``). The embedding throughput is read
   from the server's own timestamps (``indexed_at`` in the SQLite file: one per embedding call) from the end of
   the first call (whose time includes loading the model, on a fresh server) to the last, and also over the whole
   window from the sync's ``finished_at`` (the worker runs one job at a time: embedding starts after the sync);
2. **raw embedder**: the same chunk texts, read from the organization's SQLite file, embedded in this process by
   the class the service uses (``services.adapters.onnx_embedder.OnnxMiniLMEmbedder``, its defaults) the way that
   is fastest for it: sorted by token count, 64 per call (``embed_sync``). The service's embedding throughput over
   the raw one is the ratio printed (target >= 80%);
3. **incremental sync**: ``--changed`` files (default 10) of the vault get a paragraph with a new word, one commit,
   ``POST .../sync``: the time to "sync succeeded", and to "searchable by meaning" (``chunks ==
   chunks_searchable`` and a public search for the new word returns every changed entry); the chunks whose
   ``indexed_at`` changed or that are new, from the SQLite file before and after: all of them must belong to the
   changed files (no other file re-embedded);
4. **public search**: ``--queries`` (default 200) queries of 2-4 consecutive words drawn from the vault's notes,
   each distinct (the server caches query embeddings), sequential over one keep-alive client, ``GET
   /kb/{org}/{kb}/api/v1/search?q=...`` with no credential (an open knowledge base; no reranker is configured by
   default): p50 / p95 (target p50 <= 20 ms).

Settings changed from the product's defaults (printed at start, with why): the rate limits bench_foundation lifts,
``MEMEX_KB_PUBLIC_RATE_PER_MINUTE`` (the anonymous search limit per address: the bench is one address sending
hundreds of searches a minute), and ``MEMEX_KB_LOCAL_ROOTS`` (the vault is a local git repository; a tenant may
name local paths only inside these folders). The machine's load average is printed at start and end: the machine
is shared.

    .venv/bin/python bench/bench_kb.py                           # 2,000 files, 200 queries (~15 min on 2 cores)
    .venv/bin/python bench/bench_kb.py --files 200 --queries 50  # a quick run (~1.5 min)

The last line printed is a one-line JSON summary.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import sqlite3
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_foundation import bench_data_dir, code_revision, cpu_seconds, log, pct, rss_mb, serve_subprocess  # noqa: E402

TARGETS = {"embedding_ratio": 0.80, "search_p50_ms": 20.0}
#: A word the generated vaults cannot hold (their invented words have no z, q or x onset).
NEW_WORD = "zanquoxite"
KB_SLUG = "vault"


# -- the vault ---------------------------------------------------------------------------------------------


def build_vault(root: Path, n_files: int, seed: int):
    """A git repository of ``generated_vault(n_files, seed)`` (one commit); (GitVault, files, seconds)."""
    from tests.kb_vault import GitVault, generated_vault

    t0 = time.perf_counter()
    files = generated_vault(n_files, seed=seed)
    vault = GitVault(root / "vault")
    vault.write(files)
    vault.commit(f"{n_files} generated notes")
    return vault, files, time.perf_counter() - t0


def body_words(files: dict[str, bytes]) -> list[list[str]]:
    """Each note's body (after the frontmatter) as lower-case words."""
    out = []
    for data in files.values():
        text = data.decode("utf-8", "replace")
        if text.startswith("---"):
            text = text.split("\n---", 1)[-1]
        out.append(re.findall(r"[a-z]+", text.lower()))
    return [w for w in out if len(w) >= 8]


def make_queries(files: dict[str, bytes], n: int, seed: int) -> list[str]:
    """``n`` distinct queries of 2-4 consecutive words of the notes (not only function words)."""
    from tests.kb_vault import _FUNCTION_WORDS

    rng = random.Random(seed)
    notes = body_words(files)
    seen: dict[str, None] = {}
    while len(seen) < n:
        words = rng.choice(notes)
        k = rng.randint(2, 4)
        start = rng.randrange(0, len(words) - k)
        phrase = words[start:start + k]
        if all(w in _FUNCTION_WORDS for w in phrase):
            continue
        seen[" ".join(phrase)] = None
    return list(seen)


# -- the service's files (an independent look at what it stored) -------------------------------------------


def org_db(data_dir: Path, org_id: str) -> Path:
    with sqlite3.connect(data_dir / "control.sqlite3") as conn:
        (location,) = conn.execute("SELECT location FROM org_databases WHERE organization_id = ?", (org_id,)).fetchone()
    return data_dir / "orgs" / location / "memex.sqlite3"


def read_db(path: Path, query: str, params: tuple = ()) -> list[tuple]:
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=30)
    try:
        return conn.execute(query, params).fetchall()
    finally:
        conn.close()


CHUNKS = ("SELECT c.id, c.indexed_at, e.path, c.token_count, c.content FROM chunks c JOIN knowledge_entries e "
          "ON e.organization_id = c.organization_id AND e.uid = c.parent_id WHERE c.kind = 'knowledge'")


def chunk_snapshot(db: Path) -> dict[str, tuple[int | None, str]]:
    """chunk id -> (indexed_at, the entry's path)."""
    return {cid: (at, path) for cid, at, path, _, _ in read_db(db, CHUNKS)}


# -- HTTP ------------------------------------------------------------------------------------------------------


class Service:
    """The service under test: an admin client (the organization's key) and an anonymous one."""

    def __init__(self, base: str) -> None:
        self.base = base
        self.anon = httpx.Client(base_url=base, timeout=120)
        r = self.anon.post("/v1/signup", json={"name": "KB Bench", "slug": f"kb-bench-{os.getpid() % 100000}"})
        r.raise_for_status()
        body = r.json()
        self.org_id, self.org_slug = body["organization"]["id"], body["organization"]["slug"]
        self.admin = httpx.Client(base_url=base, timeout=120,
                                  headers={"authorization": f"Bearer {body['api_key']['key']}"})

    def kb(self) -> dict:
        r = self.admin.get(f"/v1/knowledge-bases/{KB_SLUG}")
        r.raise_for_status()
        return r.json()

    def search(self, q: str, limit: int = 5) -> tuple[dict, float]:
        t0 = time.perf_counter()
        r = self.anon.get(f"/kb/{self.org_slug}/{KB_SLUG}/api/v1/search", params={"q": q, "limit": limit})
        dt = time.perf_counter() - t0
        r.raise_for_status()
        return r.json(), dt

    def close(self) -> None:
        self.anon.close()
        self.admin.close()


def wait_until(svc: Service, done, poll: float, timeout: float, what: str) -> tuple[dict, float]:
    """Poll the knowledge base until ``done(kb)``; (the knowledge base, seconds waited)."""
    t0 = time.perf_counter()
    last_log = t0
    while True:
        kb = svc.kb()
        if done(kb):
            return kb, time.perf_counter() - t0
        sync = kb["last_sync"] or {}
        if sync.get("state") == "failed":
            raise RuntimeError(f"sync failed: {sync.get('error')}")
        if time.perf_counter() - last_log > 30:
            last_log = time.perf_counter()
            log(f"{what}: sync {sync.get('state')} {sync.get('files_done')}/{sync.get('files_total')} files, "
                f"{kb['chunks_searchable']}/{kb['chunks']} chunks searchable")
        if time.perf_counter() - t0 > timeout:
            raise TimeoutError(f"{what} not done in {timeout} s")
        time.sleep(poll)


def succeeded(sync_id: str):
    return lambda kb: (kb["last_sync"] or {}).get("id") == sync_id and kb["last_sync"]["state"] == "succeeded"


def all_searchable(kb: dict) -> bool:
    return kb["chunks"] > 0 and kb["chunks"] == kb["chunks_searchable"]


# -- 1. full sync ------------------------------------------------------------------------------------------------


def full_sync(svc: Service, vault_path: Path, data_dir: Path, pid: int, args: argparse.Namespace) -> dict:
    cpu0 = cpu_seconds(pid)
    t0 = time.perf_counter()
    r = svc.admin.post("/v1/knowledge-bases", json={"slug": KB_SLUG, "visibility": "open",
                                                    "source": {"type": "git", "url": str(vault_path)}})
    r.raise_for_status()
    sync_id = r.json()["sync"]["id"]
    kb, _ = wait_until(svc, succeeded(sync_id), args.poll, args.timeout, "full sync")
    to_sync = time.perf_counter() - t0
    cpu_sync = cpu_seconds(pid)
    searchable_at_sync = kb["chunks_searchable"]
    # polled less often while embedding: each look costs the server ~30 ms of CPU (the counts), and the times
    # below come from the server's own timestamps anyway
    kb, _ = wait_until(svc, all_searchable, args.embed_poll, args.timeout, "embedding")
    cpu_end = cpu_seconds(pid)
    sync = svc.admin.get(f"/v1/knowledge-bases/{KB_SLUG}/syncs/{sync_id}").json()
    db = org_db(data_dir, svc.org_id)
    first_at, last_at = read_db(db, "SELECT MIN(indexed_at), MAX(indexed_at) FROM chunks WHERE kind = 'knowledge'")[0]
    # one embedding call marks its chunks with one indexed_at: the first call's chunks (and the model's loading,
    # on a fresh server) are left out of the steady rate
    (first_batch,) = read_db(db, "SELECT COUNT(*) FROM chunks WHERE kind = 'knowledge' AND indexed_at = ?", (first_at,))[0]
    steady_s = (last_at - first_at) / 1000
    # the client's view is the truth: the sync's own record ends at its last statement, before the poll that sees it
    embed_s = (last_at - sync["created_at"]) / 1000 - to_sync
    return {
        "files": sync["files_total"], "counts": sync["counts"], "errors": len(sync["errors"]),
        "skipped": len(sync["skipped"]), "unresolved_links": len(sync["unresolved_links"]),
        "entries": kb["entries"], "chunks": kb["chunks"], "commit": sync["commit"],
        "post_to_succeeded_s": round(to_sync, 2), "files_per_s": round(sync["files_total"] / to_sync, 1),
        "sync_record_s": round((sync["finished_at"] - sync["started_at"]) / 1000, 2),
        "chunks_searchable_at_sync_end": searchable_at_sync,
        "first_call_chunks": first_batch, "first_call_done_after_post_s": round((first_at - sync["created_at"]) / 1000, 2),
        "post_to_all_indexed_s": round((last_at - sync["created_at"]) / 1000, 2), "embed_window_s": round(embed_s, 2),
        "service_chunks_per_s": round((kb["chunks"] - first_batch) / steady_s, 2),
        "service_chunks_per_s_whole_window": round(kb["chunks"] / embed_s, 2),
        "server_cpu_s_sync": round(cpu_sync - cpu0, 1) if cpu0 is not None and cpu_sync is not None else None,
        "server_cpu_s_embed": round(cpu_end - cpu_sync, 1) if cpu_end is not None and cpu_sync is not None else None,
    }


# -- 2. the raw embedder on the same texts ---------------------------------------------------------------------


def raw_embedder(db: Path, batch: int = 64) -> dict:
    """The service's embedder class, in this process, on the knowledge base's chunk texts: sorted by token count
    (as the embedding job reads them), ``batch`` per call."""
    from api.composition.backend import embedder_for
    from api.settings import Settings

    rows = sorted(((tokens, content) for _, _, _, tokens, content in read_db(db, CHUNKS)), key=lambda r: r[0])
    texts = [content for _, content in rows]
    # The embedder the service builds, with its cache: the graph recorded for this machine, the one the service
    # indexes with, not a new timing's pick.
    embedder = embedder_for(Settings(embedder="local"), None)
    embedder.warm_up()
    cpu0, t0 = time.process_time(), time.perf_counter()
    for i in range(0, len(texts), batch):
        embedder.embed_sync(texts[i:i + batch])
    seconds = time.perf_counter() - t0
    return {"chunks": len(texts), "seconds": round(seconds, 2), "chunks_per_s": round(len(texts) / seconds, 2),
            "cpu_s": round(time.process_time() - cpu0, 1), "mean_tokens": round(sum(r[0] for r in rows) / len(rows), 1),
            "threads": embedder.intra_op_num_threads, "model_batch": embedder.batch_size, "call_batch": batch,
            "graph": embedder.graph_in_use}


# -- 3. incremental sync ---------------------------------------------------------------------------------------


def pick_changed(db: Path, n: int, seed: int) -> list[tuple[str, str]]:
    """(path, entry id) of ``n`` entries of the knowledge base."""
    rows = read_db(db, "SELECT path, id FROM knowledge_entries ORDER BY path")
    return random.Random(seed).sample(rows, n)


def incremental(svc: Service, vault, files: dict[str, bytes], data_dir: Path, args: argparse.Namespace) -> dict:
    db = org_db(data_dir, svc.org_id)
    changed = pick_changed(db, args.changed, args.seed)
    before = chunk_snapshot(db)
    vault.write({path: files[path] + f"\n\nThe {NEW_WORD} survey of this note was redone by the stewards.\n".encode()
                 for path, _ in changed})
    head = vault.commit(f"{args.changed} notes revised")
    t0 = time.perf_counter()
    r = svc.admin.post(f"/v1/knowledge-bases/{KB_SLUG}/sync", json={})
    r.raise_for_status()
    sync_id = r.json()["id"]
    wait_until(svc, succeeded(sync_id), 0.1, args.timeout, "incremental sync")
    to_sync = time.perf_counter() - t0
    wait_until(svc, all_searchable, 0.1, args.timeout, "incremental embedding")
    to_vectors = time.perf_counter() - t0
    found, to_found = search_until_found(svc, {eid for _, eid in changed}, deadline=time.perf_counter() + 10)
    sync = svc.admin.get(f"/v1/knowledge-bases/{KB_SLUG}/syncs/{sync_id}").json()
    after = chunk_snapshot(db)
    paths = {p for p, _ in changed}
    embedded = {cid: path for cid, (at, path) in after.items() if cid not in before or before[cid][0] != at}
    return {
        "changed_files": args.changed, "mode": sync["mode"], "commit_is_head": sync["commit"] == head,
        "files_total": sync["files_total"], "counts": sync["counts"], "post_to_succeeded_s": round(to_sync, 3),
        "sync_record_s": round((sync["finished_at"] - sync["started_at"]) / 1000, 3),
        "post_to_vectors_s": round(to_vectors, 3),
        "post_to_found_by_search_s": round(to_found - t0, 3) if to_found else None,
        "found_by_search": len(found & {eid for _, eid in changed}),
        "missed_by_search": sorted({eid for _, eid in changed} - found),
        "chunks_embedded": len(embedded), "chunks_embedded_of_changed_files": sum(p in paths for p in embedded.values()),
        "chunks_embedded_of_other_files": sum(p not in paths for p in embedded.values()),
        "chunks_removed": len(set(before) - set(after)), "chunks_total": len(after),
    }


def search_until_found(svc: Service, wanted: set[str], deadline: float) -> tuple[set[str], float | None]:
    """Search the new word (public API) until every changed entry is among the hits or the deadline passes: (the
    ids found, when all were)."""
    found: set[str] = set()
    while True:
        hits, _ = svc.search(NEW_WORD, limit=20)
        found = {h["id"] for h in hits["results"]}
        if wanted <= found:
            return found, time.perf_counter()
        if time.perf_counter() > deadline:
            return found, None
        time.sleep(0.1)


# -- 4. public search --------------------------------------------------------------------------------------------


def public_search(svc: Service, queries: list[str], warmup: int = 5) -> dict:
    for q in queries[:warmup]:
        svc.search(q + " warm")
    times, hits = [], []
    for q in queries:
        body, dt = svc.search(q)
        times.append(dt)
        hits.append(len(body["results"]))
    return {"queries": len(queries), "p50_ms": round(pct(times, 50) * 1000, 2), "p95_ms": round(pct(times, 95) * 1000, 2),
            "p99_ms": round(pct(times, 99) * 1000, 2), "max_ms": round(max(times) * 1000, 2),
            "mean_hits": round(sum(hits) / len(hits), 2), "queries_with_hits": sum(1 for h in hits if h)}


# -- the run ---------------------------------------------------------------------------------------------------------


def loadavg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _per_chunk(cpu_s: float | None, chunks: int) -> str:
    return "?" if cpu_s is None else f"{1000 * cpu_s / chunks:.1f}"


def report(out: dict) -> None:
    f, raw, inc, s = out["full_sync"], out["raw_embedder"], out["incremental"], out["search"]
    ratio = out["embedding_ratio"]
    lines = [
        f"machine: {os.cpu_count()} cores; load average at start {out['load_start']}, at end {out['load_end']}",
        f"code: {out['code']}; vault: {out['files']} generated files (seed {out['seed']}), built in {out['vault_build_s']} s",
        f"full sync: {f['files']} files -> {f['entries']} entries, {f['chunks']} chunks; counts {f['counts']}; "
        f"{f['errors']} errors, {f['skipped']} skipped, {f['unresolved_links']} unresolved links",
        f"  POST -> sync succeeded (entries written, keyword-searchable): {f['post_to_succeeded_s']} s = "
        f"{f['files_per_s']} files/s (the sync's own record: {f['sync_record_s']} s; "
        f"server CPU {f['server_cpu_s_sync']} s)",
        f"  POST -> every chunk vector-indexed: {f['post_to_all_indexed_s']} s; embedding after the sync: "
        f"{f['embed_window_s']} s, server CPU {f['server_cpu_s_embed']} s; chunks searchable by meaning when the sync "
        f"succeeded: {f['chunks_searchable_at_sync_end']}",
        f"  service embedding: {f['service_chunks_per_s']} chunks/s after the first call ({f['first_call_chunks']} "
        f"chunks, done {f['first_call_done_after_post_s']} s after the POST); {f['service_chunks_per_s_whole_window']} "
        f"over the whole window after the sync",
        f"  raw embedder, same {raw['chunks']} chunks (mean {raw['mean_tokens']} tokens), sorted, {raw['call_batch']} "
        f"per call: {raw['seconds']} s = {raw['chunks_per_s']} chunks/s (CPU {raw['cpu_s']} s, "
        f"{raw['threads']} threads, {raw['graph']} graph)",
        f"  ratio service / raw: {ratio:.0%} (target >= {TARGETS['embedding_ratio']:.0%}: "
        f"{'MET' if ratio >= TARGETS['embedding_ratio'] else 'MISSED'}); CPU per chunk: service "
        f"{_per_chunk(f['server_cpu_s_embed'], f['chunks'])} ms, raw {_per_chunk(raw['cpu_s'], raw['chunks'])} ms "
        "(less sensitive to the machine's other load)",
        f"incremental sync of {inc['changed_files']} changed files ({inc['mode']}, {inc['files_total']} files read, counts "
        f"{inc['counts']}): POST -> succeeded {inc['post_to_succeeded_s']} s (the sync's record {inc['sync_record_s']} s);"
        f" -> every chunk vector-indexed {inc['post_to_vectors_s']} s; -> a search for the new word returns all of them: "
        + (f"{inc['post_to_found_by_search_s']} s" if inc["post_to_found_by_search_s"] is not None else
           f"never ({inc['found_by_search']} of {inc['changed_files']}; missing {inc['missed_by_search']})"),
        f"  chunks embedded: {inc['chunks_embedded']} (of the changed files {inc['chunks_embedded_of_changed_files']}, "
        f"of other files {inc['chunks_embedded_of_other_files']}); removed {inc['chunks_removed']} of the old versions",
        f"public search (GET /kb/.../api/v1/search, open, no reranker), {s['queries']} queries at {f['entries']} entries: "
        f"p50 {s['p50_ms']} ms, p95 {s['p95_ms']} ms, p99 {s['p99_ms']} ms (target p50 <= {TARGETS['search_p50_ms']:.0f} "
        f"ms: {'MET' if s['p50_ms'] <= TARGETS['search_p50_ms'] else 'MISSED'}); {s['queries_with_hits']} with hits, "
        f"{s['mean_hits']} hits on average",
        f"server RSS at end: {out['server_rss_mb']} MB",
    ]
    print("\n".join(lines))


def run(args: argparse.Namespace) -> dict:
    out: dict = {"load_start": loadavg(), "code": code_revision(), "files": args.files, "seed": args.seed}
    with tempfile.TemporaryDirectory(prefix="memex-kb-vault-") as vault_root, \
            bench_data_dir(args.data_dir, "memex-kb-bench-", args.keep) as data_dir:
        log(f"building a {args.files}-file vault in {vault_root}")
        vault, files, built = build_vault(Path(vault_root), args.files, args.seed)
        out["vault_build_s"] = round(built, 1)
        env = {"MEMEX_KB_LOCAL_ROOTS": vault_root, "MEMEX_KB_PUBLIC_RATE_PER_MINUTE": "100000000"}
        why = {"MEMEX_KB_LOCAL_ROOTS": "the vault is a local git repository: tenants may name local paths only inside "
                                       "these folders",
               "MEMEX_KB_PUBLIC_RATE_PER_MINUTE": "a rate limit: the bench is one address sending hundreds of anonymous "
                                                  "searches a minute"}
        with serve_subprocess(data_dir, env, why=why) as (base, proc, ready, _):
            log(f"server pid {proc.pid} on {base} ready in {ready:.1f} s (data {data_dir})")
            svc = Service(base)
            try:
                log("full sync")
                out["full_sync"] = full_sync(svc, vault.path, data_dir, proc.pid, args)
                log(f"full sync done: {json.dumps(out['full_sync'])}")
                log("raw embedder on the same chunks (the service is idle)")
                out["raw_embedder"] = raw_embedder(org_db(data_dir, svc.org_id))
                out["embedding_ratio"] = round(out["full_sync"]["service_chunks_per_s"]
                                               / out["raw_embedder"]["chunks_per_s"], 3)
                log(f"raw embedder done: {json.dumps(out['raw_embedder'])}")
                log("incremental sync")
                out["incremental"] = incremental(svc, vault, files, data_dir, args)
                log(f"incremental sync done: {json.dumps(out['incremental'])}")
                log("public search")
                out["search"] = public_search(svc, make_queries(files, args.queries, args.seed))
                out["server_rss_mb"] = rss_mb(proc.pid)
            finally:
                svc.close()
                vault.close()
    out["load_end"] = loadavg()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--files", type=int, default=2000, help="notes in the generated vault")
    p.add_argument("--queries", type=int, default=200, help="public searches timed")
    p.add_argument("--changed", type=int, default=10, help="files changed for the incremental sync")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--poll", type=float, default=0.5, help="seconds between looks at the knowledge base (full sync)")
    p.add_argument("--embed-poll", type=float, default=2.0, help="the same while its chunks are being embedded")
    p.add_argument("--timeout", type=float, default=3600.0)
    p.add_argument("--data-dir", default=None, help="the service's data directory (default: a fresh temporary one)")
    p.add_argument("--keep", action="store_true", help="keep the temporary data directory")
    args = p.parse_args()
    out = run(args)
    report(out)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
