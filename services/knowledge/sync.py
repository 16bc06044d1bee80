"""A knowledge base's sync: its source's files into entries, chunks, links and (through the embedding job) vectors.

A sync is a row (``knowledge_syncs``) and a job (``kb_sync``, target: the sync id), run by the service's job worker.
It works out what changed, then applies it in batches, each one atomic (one ``sql.batch``: on D1 one request):

* **What changed.** A git source is fetched into a local mirror (services.knowledge.gitsource, dulwich: no git
  binary). When the last synced commit is an ancestor of the new head, and neither the ontology nor the globs
  changed since, the change set is ``git diff last..head`` (a rename is a delete plus an add): an *incremental*
  sync. Otherwise (the first sync, a force-push, a changed ontology, or a full sync asked for) every file of the
  head is compared with what the last sync made of it (``knowledge_files``: its blob), a *full* sync; an upload is
  always compared that way. A file whose blob did not change is not read again: a full sync of an unchanged
  repository embeds nothing.
* **Per file** (``prepare``): frontmatter and body (services.knowledge.markdown), skipped when unpublished or a
  draft (the knowledge base's ontology says whether), its content type and validated fields (services.knowledge
  .ontology), its release (the innermost folder holding an ``index.base``), its links and its chunks. A file that
  cannot be read is a per-file error: it never fails the sync, and an entry it had keeps its last synced version.
  An id already held by an entry at another path is a per-file error too (never a silent overwrite); such a file is
  tried again by the next sync, once the id may be free.
* **Applying.** Deletions first (so a rename frees its id), then the changed files, each batch recording every
  file's outcome in ``knowledge_sync_files``. A sync interrupted by a crash is claimed again by the worker and goes
  on from the files it has not recorded, with the same target commit: it converges to the same state.
* Chunks are keyword-searchable as soon as their batch commits; the embedding job (``KB_EMBED_JOB``, run by the
  worker's embedding stage, services.search.indexing.EmbedStage) embeds a knowledge base's pending chunks across
  entries, shortest first, with every other organization's chunks of the round in one model call. A removed chunk's
  vector is deleted after its row, through ``vector_gc`` (migration 0002): no vector outlives its rows.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import logging
import shutil
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.errors import InsufficientStorage
from services.ids import new_id, now_ms
from services.jobs.worker import Job, JobDeferred, renew_lease
from services.knowledge.bases import SYNC_JOB
from services.search.indexing import KB_EMBED_JOB
from services.knowledge.gitsource import GitSource, SourceError
from services.knowledge.markdown import MAX_FILE_BYTES, ParseError, entry_id, extract_links, first_heading, parse_markdown
from services.knowledge.ontology import Ontology
from services.knowledge.paths import excluded, is_marker, release_of, selected
from services.ports import Embedder, Statement
from services.storage.scoped import OrgSql, OrgVectors
from services.text.chunking import chunk_text, default_chunk_params

__all__ = ["Syncer", "Prepared", "prepare", "fingerprint", "flush_vector_gc",
           "enqueue_kb_embed", "cache_dir_for"]

log = logging.getLogger("memex.knowledge")

#: Files applied per batch (one atomic sql.batch), and the most text one batch carries.
BATCH_FILES = 25
BATCH_BYTES = 2 * 1024 * 1024
#: Source errors (unreachable, refused) are retried this many times before the sync fails.
SOURCE_ATTEMPTS = 3
#: Any other error: the job is retried (worker backoff) this many times before the sync is marked failed.
SYNC_ATTEMPTS = 5
UNRESOLVED_LIMIT = 1000
#: Network timeout of a git fetch (seconds).
GIT_TIMEOUT_SECONDS = 60.0
#: Every row a sync writes is conditional on its sync still existing (a knowledge base deleted mid-sync takes its
#: syncs with it, in one batch: the sync's later batches then write nothing), chunks and links on their entry.
SYNC_ALIVE = "EXISTS (SELECT 1 FROM knowledge_syncs WHERE organization_id = ?1 AND id = ?{n})"
ENTRY_ALIVE = "EXISTS (SELECT 1 FROM knowledge_entries WHERE organization_id = ?1 AND uid = ?3)"


def cache_dir_for(root: Path, org_id: str, kb_id: str) -> Path:
    """Where a git source's mirror lives (a cache: the SQL store holds the truth)."""
    return Path(root) / org_id / kb_id


def fingerprint(ontology: Ontology, source: dict[str, Any]) -> str:
    """What decides how files become entries besides the files themselves: a change means a full sync."""
    basis = json.dumps([ontology.fingerprint(), source.get("include"), source.get("exclude")], sort_keys=True)
    return hashlib.sha256(basis.encode()).hexdigest()


# -- one file ----------------------------------------------------------------------------------------------


@dataclass
class Prepared:
    """What one file becomes: an entry (``outcome == 'entry'``), a skip or a per-file error."""

    path: str
    blob: str
    outcome: str  # entry | skipped | failed
    reason: str | None = None
    warnings: list[tuple[str, str]] = field(default_factory=list)
    id: str | None = None
    content_type: str | None = None
    title: str | None = None
    description: str | None = None
    group: str | None = None
    release: str | None = None
    status: str | None = None
    tags: list[str] = field(default_factory=list)
    date: int | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    body: str = ""
    raw: str = ""
    links: list[tuple[str, str | None]] = field(default_factory=list)
    chunks: list[tuple[str, int]] = field(default_factory=list)
    content_hash: str = ""
    index_hash: str = ""


def prepare(path: str, blob: str, data: bytes, *, ontology: Ontology, releases: set[str], embedder: Embedder) -> Prepared:
    """Parse, validate and chunk one markdown file (pure; runs in a worker thread)."""
    try:
        eid = entry_id(path)
        parsed = parse_markdown(data)
    except ParseError as exc:
        return Prepared(path, blob, "failed", str(exc))
    fm = parsed.frontmatter
    fallback = first_heading(parsed.body) or eid
    v = ontology.resolve(path, fm, fallback_title=fallback)
    if ontology.require_publish and v.publish is not True:
        return Prepared(path, blob, "skipped", "unpublished: publish is not true" if "publish" in fm
                        else "unpublished: no 'publish: true' in the frontmatter")
    if ontology.skip_drafts and v.draft:
        return Prepared(path, blob, "skipped", "draft: true")
    release = v.release or _release_id(release_of(path, releases))
    text = "\n\n".join(p for p in (v.title, v.description, parsed.body.strip()) if p)
    max_tokens, overlap = default_chunk_params(embedder)
    pieces = chunk_text(text, count_tokens=embedder.count_tokens, max_tokens=max_tokens, overlap_tokens=overlap)
    chunks = [(p, embedder.count_tokens(p)) for p in pieces]
    links = list(dict.fromkeys((link.target, link.label) for link in extract_links(parsed.body, path=path)))
    raw = data.decode("utf-8-sig", errors="replace").replace("\r\n", "\n")
    indexed = [eid, v.content_type, text, v.group, release, v.status, v.tags, v.date]
    index_hash = _sha(json.dumps([indexed, [c for c, _ in chunks]], sort_keys=True, default=str))
    content_hash = _sha(json.dumps([index_hash, path, v.fields, parsed.body, links, v.issues], sort_keys=True, default=str))
    return Prepared(path, blob, "entry", warnings=list(v.issues), id=eid, content_type=v.content_type, title=v.title,
                    description=v.description, group=v.group, release=release, status=v.status, tags=list(v.tags),
                    date=v.date, metadata=v.fields, body=parsed.body, raw=raw, links=links, chunks=chunks,
                    content_hash=content_hash, index_hash=index_hash)


def _release_id(folder: str | None) -> str | None:
    return folder.rpartition("/")[2] if folder else None


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


# -- the sync job ------------------------------------------------------------------------------------------


@dataclass
class _Plan:
    mode: str
    head: str | None
    base: str | None
    changed: dict[str, tuple[str, int]]  # path -> (blob, size), to read and apply
    deleted: list[str]  # paths whose entries go
    markers: dict[str, str]  # release markers: path -> blob
    unchanged: int
    read: Callable[[list[str]], Awaitable[dict[str, bytes]]]  # blobs -> their bytes


class Syncer:
    """Runs ``kb_sync`` jobs for one organization (bound handles; the composition root makes one per job)."""

    def __init__(self, sql: OrgSql, vectors: OrgVectors, embedder: Embedder, *, cache_root: Path,
                 on_enqueue: Callable[[], None] = lambda: None) -> None:
        self.sql = sql
        self.vectors = vectors
        self.embedder = embedder
        self.cache_root = Path(cache_root)
        self.on_enqueue = on_enqueue
        self._opened: list[GitSource] = []
        self._job: Job | None = None

    async def run(self, job: Job) -> None:
        sync = await self.sql.one("SELECT * FROM knowledge_syncs WHERE organization_id = ?1 AND id = ?2", [job.target_id])
        if sync is None or sync["state"] in ("succeeded", "failed"):
            return
        kb = await self.sql.one("SELECT * FROM knowledge_bases WHERE organization_id = ?1 AND id = ?2", [sync["kb_id"]])
        if kb is None:
            return
        busy = await self.sql.one(  # another sync of this knowledge base holds a live lease (another process)
            "SELECT s.id FROM knowledge_syncs s JOIN jobs j ON j.organization_id = s.organization_id AND j.kind = ?4 "
            "AND j.target_id = s.id WHERE s.organization_id = ?1 AND s.kb_id = ?2 AND s.id != ?3 AND s.state = 'running' "
            "AND j.state = 'pending' AND j.locked_until > ?5 LIMIT 1", [kb["id"], sync["id"], SYNC_JOB, now_ms()])
        if busy is not None:
            raise JobDeferred(f"sync {busy['id']} of this knowledge base is running")
        self._job = job
        await flush_vector_gc(self.sql, self.vectors)
        await self.sql.execute("UPDATE knowledge_syncs SET state = 'running', started_at = COALESCE(started_at, ?3), "
                               "error = NULL WHERE organization_id = ?1 AND id = ?2", [sync["id"], now_ms()])
        try:
            await self._sync(kb, sync)
        except SourceError as exc:
            if job.attempts < SOURCE_ATTEMPTS:
                await self._note(sync["id"], f"{exc} (attempt {job.attempts} of {SOURCE_ATTEMPTS}; retrying)")
                raise
            await self._fail(sync["id"], str(exc))
        except InsufficientStorage:
            raise
        except Exception as exc:
            if job.attempts < SYNC_ATTEMPTS:
                raise
            log.exception("sync %s failed", sync["id"])
            await self._fail(sync["id"], f"internal error: {type(exc).__name__}")
        finally:
            for git in self._opened:
                git.close()
            if self._opened and await self.sql.one(
                    "SELECT 1 AS x FROM knowledge_bases WHERE organization_id = ?1 AND id = ?2", [kb["id"]]) is None:
                # deleted while this sync ran: the mirror it fetched goes too
                await asyncio.to_thread(shutil.rmtree, cache_dir_for(self.cache_root, self.sql.org_id, kb["id"]), True)
            self._opened.clear()

    async def _note(self, sync_id: str, error: str) -> None:
        await self.sql.execute("UPDATE knowledge_syncs SET error = ?3 WHERE organization_id = ?1 AND id = ?2",
                               [sync_id, error[:1000]])

    async def _fail(self, sync_id: str, error: str) -> None:
        await self.sql.batch([
            self.sql.stmt("UPDATE knowledge_syncs SET state = 'failed', error = ?3, finished_at = ?4 "
                          "WHERE organization_id = ?1 AND id = ?2", sync_id, error[:1000], now_ms()),
            self.sql.stmt("DELETE FROM knowledge_uploads WHERE organization_id = ?1 AND sync_id = ?2", sync_id),
        ])

    async def _sync(self, kb: dict[str, Any], sync: dict[str, Any]) -> None:
        source = json.loads(kb["source"])
        ontology = Ontology.from_json(json.loads(kb["ontology"] or "{}"))
        fp = fingerprint(ontology, source)
        plan = await self._plan(kb, sync, source, fp)
        done = {r["path"] for r in await self.sql.rows(
            "SELECT path FROM knowledge_sync_files WHERE organization_id = ?1 AND sync_id = ?2", [sync["id"]])}
        await self.sql.execute(
            "UPDATE knowledge_syncs SET mode = ?3, commit_sha = ?4, base_commit = ?5, files_total = ?6, unchanged = ?7 "
            "WHERE organization_id = ?1 AND id = ?2",
            [sync["id"], plan.mode, plan.head, plan.base, len(plan.changed) + len(plan.deleted), plan.unchanged])
        deleted = [p for p in plan.deleted if p not in done]
        for i in range(0, len(deleted), BATCH_FILES * 4):
            await self._delete(kb["id"], sync["id"], deleted[i:i + BATCH_FILES * 4])
        releases = {p.rpartition("/")[0] for p in plan.markers}
        todo = [(p, b, size) for p, (b, size) in sorted(plan.changed.items()) if p not in done]
        for batch in _batches(todo):
            await self._apply(kb["id"], sync["id"], batch, plan, ontology, releases)
        await self._finish(kb, sync["id"], plan, fp)

    # -- what changed ----------------------------------------------------------------------------------

    def _git(self, kb: dict[str, Any], source: dict[str, Any]) -> GitSource:
        """The knowledge base's git mirror, opened for this sync (closed by ``run``: it holds pack files)."""
        git = GitSource(cache_dir_for(self.cache_root, self.sql.org_id, kb["id"]), source["url"],
                        source.get("branch") or "main", token=kb["source_token"], timeout=GIT_TIMEOUT_SECONDS)
        self._opened.append(git)
        return git

    async def _plan(self, kb: dict[str, Any], sync: dict[str, Any], source: dict[str, Any], fp: str) -> _Plan:
        include, exclude = source["include"], source["exclude"]
        stored = {r["path"]: r for r in await self.sql.rows(
            "SELECT path, blob, outcome, reason FROM knowledge_files WHERE organization_id = ?1 AND kb_id = ?2", [kb["id"]])}
        if source["type"] == "git":
            git = self._git(kb, source)
            head = sync["commit_sha"]
            if not head or not await asyncio.to_thread(git.has_commit, head):
                head = await asyncio.to_thread(git.fetch)
            files = await asyncio.to_thread(git.files, head)
            base = kb["last_commit"]
            incremental = (not sync["full"] and base and kb["synced_fingerprint"] == fp and base != head
                           and await asyncio.to_thread(git.has_commit, base)
                           and await asyncio.to_thread(git.is_ancestor, base, head))
            touched: set[str] | None = None
            if incremental:
                touched = {c.path for c in await asyncio.to_thread(git.diff, base, head)}
            elif base == head and not sync["full"] and kb["synced_fingerprint"] == fp:
                touched = set()  # nothing new upstream: nothing to read
            mode = "incremental" if touched is not None else "full"

            async def read(blobs: list[str]) -> dict[str, bytes]:
                return await asyncio.to_thread(lambda: {b: git.read(b) for b in blobs})
        else:
            head, base, touched, mode = None, None, None, "full"
            rows = await self.sql.rows("SELECT path, size, sha256 FROM knowledge_uploads WHERE organization_id = ?1 "
                                       "AND sync_id = ?2", [sync["id"]])
            files = {r["path"]: (r["sha256"], r["size"]) for r in rows}
            sync_id = sync["id"]

            async def read(blobs: list[str]) -> dict[str, bytes]:  # an upload's files wait in knowledge_uploads
                rows = await self.sql.rows(
                    "SELECT sha256, content FROM knowledge_uploads WHERE organization_id = ?1 AND sync_id = ?2 "
                    "AND sha256 IN (SELECT value FROM json_each(?3))", [sync_id, json.dumps(blobs)])
                return {r["sha256"]: base64.b64decode(r["content"]) for r in rows if r["content"] is not None}
        markers = {p: b for p, (b, _) in files.items() if is_marker(p) and not excluded(p, exclude)}
        wanted = {p: v for p, v in files.items() if selected(p, include, exclude)}
        same_config = kb["synced_fingerprint"] == fp and not sync["full"]
        if touched is None:  # full: compare every file with what the last sync made of it
            changed = {p: v for p, v in wanted.items()
                       if not same_config or p not in stored or stored[p]["blob"] != v[0]}
        else:
            changed = {p: v for p, v in wanted.items() if p in touched or p not in stored}
        # release folders that appeared or went: their files' release changes
        old_markers = {p for p, r in stored.items() if r["outcome"] == "marker"}
        moved = {p.rpartition("/")[0] for p in old_markers.symmetric_difference(markers)}
        for p, v in wanted.items():
            if any(p.startswith(folder + "/") for folder in moved):
                changed.setdefault(p, v)
        # files refused for a duplicate id: the id may be free now
        for p, r in stored.items():
            if r["outcome"] == "failed" and (r["reason"] or "").startswith("duplicate id") and p in wanted:
                changed.setdefault(p, wanted[p])
        gone = [p for p, r in stored.items() if r["outcome"] != "marker" and p not in wanted]
        with_entry = {r["path"] for r in await self.sql.rows(
            "SELECT path FROM knowledge_entries WHERE organization_id = ?1 AND kb_id = ?2", [kb["id"]])}
        deleted = sorted(p for p in gone if p in with_entry)
        stale = [p for p in gone if p not in with_entry]
        if stale:  # skipped or failed before, gone now: nothing to delete but their record
            await self.sql.execute("DELETE FROM knowledge_files WHERE organization_id = ?1 AND kb_id = ?2 "
                                   "AND path IN (SELECT value FROM json_each(?3))", [kb["id"], json.dumps(stale)])
        return _Plan(mode, head, base if mode == "incremental" else None, changed, deleted, markers,
                     len(wanted) - len(changed), read)

    # -- applying --------------------------------------------------------------------------------------

    async def _delete(self, kb_id: str, sync_id: str, paths: list[str]) -> None:
        stmts: list[Statement] = []
        for path in paths:
            stmts += [
                self.sql.stmt("DELETE FROM knowledge_entries WHERE organization_id = ?1 AND kb_id = ?2 AND path = ?3",
                              kb_id, path),
                self.sql.stmt("DELETE FROM knowledge_files WHERE organization_id = ?1 AND kb_id = ?2 AND path = ?3",
                              kb_id, path),
                _outcome(self.sql, sync_id, path, "deleted"),
            ]
        await self.sql.batch(stmts)
        await flush_vector_gc(self.sql, self.vectors)

    async def _apply(self, kb_id: str, sync_id: str, batch: list[tuple[str, str, int]], plan: _Plan,
                     ontology: Ontology, releases: set[str]) -> None:
        small = sorted({b for _, b, size in batch if size <= MAX_FILE_BYTES})
        data = await plan.read(small) if small else {}

        def prepare_all() -> list[Prepared]:
            out = []
            for path, blob, size in batch:
                if size > MAX_FILE_BYTES or blob not in data:
                    out.append(Prepared(path, blob, "failed", f"file is larger than 1 MiB ({size} bytes)"))
                else:
                    out.append(prepare(path, blob, data[blob], ontology=ontology, releases=releases,
                                       embedder=self.embedder))
            return out

        prepared = await asyncio.to_thread(prepare_all)
        ids = [p.id for p in prepared if p.id]
        existing = await self.sql.rows(
            "SELECT uid, id, path, content_hash, index_hash FROM knowledge_entries WHERE organization_id = ?1 "
            "AND kb_id = ?2 AND (path IN (SELECT value FROM json_each(?3)) OR id IN (SELECT value FROM json_each(?4)))",
            [kb_id, json.dumps([p.path for p in prepared]), json.dumps(ids)])
        by_path = {r["path"]: r for r in existing}
        holder = {r["id"]: r["path"] for r in existing}
        stmts: list[Statement] = []
        embed = False
        for p in prepared:
            old = by_path.get(p.path)
            if p.outcome == "entry" and holder.get(p.id, p.path) != p.path:
                p.outcome, p.reason = "failed", f"duplicate id '{p.id}': {holder[p.id]} already has it"
            if p.outcome == "entry":
                holder[p.id] = p.path
                stmts += self._entry(kb_id, sync_id, p, old, plan.head)
                embed = embed or old is None or old["index_hash"] != p.index_hash
            elif p.outcome == "skipped" and old is not None:
                stmts.append(self.sql.stmt("DELETE FROM knowledge_entries WHERE organization_id = ?1 AND uid = ?2",
                                           old["uid"]))
                p.reason = f"{p.reason}; its entry was removed"
            elif p.outcome == "failed" and old is not None:
                p.reason = f"{p.reason}; the entry keeps its last synced version"
            if p.outcome != "entry":
                stmts.append(_outcome(self.sql, sync_id, p.path, p.outcome, p.reason))
            stmts.append(self.sql.stmt(
                "INSERT INTO knowledge_files (organization_id, kb_id, path, blob, outcome, reason) "
                f"SELECT ?1, ?2, ?3, ?4, ?5, ?6 WHERE {SYNC_ALIVE.format(n=7)} "
                "ON CONFLICT (organization_id, kb_id, path) DO UPDATE SET blob = excluded.blob, outcome = excluded.outcome, "
                "reason = excluded.reason", kb_id, p.path, p.blob, "entry" if p.outcome == "entry" else p.outcome, p.reason,
                sync_id))
        if embed:
            stmts.append(enqueue_kb_embed(self.sql, kb_id, now_ms()))
        await self.sql.batch(stmts)
        await flush_vector_gc(self.sql, self.vectors)
        if self._job is not None:
            await renew_lease(self.sql, self._job)
        if embed:
            self.on_enqueue()

    def _entry(self, kb_id: str, sync_id: str, p: Prepared, old: dict[str, Any] | None, head: str | None) -> list[Statement]:
        """The statements that write one entry (its row, chunks and links) and record its outcome."""
        now = now_ms()
        warnings = json.dumps([[f, why] for f, why in p.warnings]) if p.warnings else None
        if old is not None and old["content_hash"] == p.content_hash:
            return [_outcome(self.sql, sync_id, p.path, "unchanged", None, warnings)]
        uid = old["uid"] if old is not None else new_id()
        out = [self.sql.stmt(
            "INSERT INTO knowledge_entries (organization_id, kb_id, uid, id, path, content_type, title, description, "
            "group_name, release, status, tags, date, metadata, body, raw, content_hash, index_hash, issues, synced_at, "
            "commit_sha) SELECT ?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16, ?17, ?18, ?19, ?20, ?21 "
            f"WHERE {SYNC_ALIVE.format(n=22)} ON CONFLICT (organization_id, uid) DO UPDATE SET id = excluded.id, "
            "content_type = excluded.content_type, "
            "title = excluded.title, description = excluded.description, group_name = excluded.group_name, "
            "release = excluded.release, status = excluded.status, tags = excluded.tags, date = excluded.date, "
            "metadata = excluded.metadata, body = excluded.body, raw = excluded.raw, content_hash = excluded.content_hash, "
            "index_hash = excluded.index_hash, issues = excluded.issues, synced_at = excluded.synced_at, "
            "commit_sha = excluded.commit_sha",
            kb_id, uid, p.id, p.path, p.content_type, p.title, p.description, p.group, p.release, p.status,
            json.dumps(p.tags), p.date, json.dumps(p.metadata, default=str), p.body, p.raw, p.content_hash, p.index_hash,
            json.dumps([[f, why] for f, why in p.warnings]), now, head, sync_id)]
        out.append(self.sql.stmt("DELETE FROM knowledge_links WHERE organization_id = ?1 AND source_uid = ?2", uid))
        out += [self.sql.stmt(
            "INSERT INTO knowledge_links (organization_id, kb_id, source_uid, target, label, ordinal) "
            f"SELECT ?1, ?2, ?3, ?4, ?5, ?6 WHERE {ENTRY_ALIVE}", kb_id, uid, target, label, i)
            for i, (target, label) in enumerate(p.links)]
        if old is None or old["index_hash"] != p.index_hash:
            out.append(self.sql.stmt("DELETE FROM chunks WHERE organization_id = ?1 AND kind = 'knowledge' AND parent_id = ?2",
                                     uid))
            out += [self.sql.stmt(
                "INSERT INTO chunks (organization_id, id, kind, parent_id, ordinal, content, token_count) "
                f"SELECT ?1, ?2, 'knowledge', ?3, ?4, ?5, ?6 WHERE {ENTRY_ALIVE}", new_id(), uid, i, text, tokens)
                for i, (text, tokens) in enumerate(p.chunks)]
        out.append(_outcome(self.sql, sync_id, p.path, "added" if old is None else "updated", None, warnings))
        return out

    async def _finish(self, kb: dict[str, Any], sync_id: str, plan: _Plan, fp: str) -> None:
        kb_id = kb["id"]
        # two NOT EXISTS, one per index (by id, by title): an OR of the two compared every link with every entry
        unresolved = await self.sql.rows(
            "SELECT e.path AS path, l.target AS target FROM knowledge_links l JOIN knowledge_entries e "
            "ON e.organization_id = l.organization_id AND e.uid = l.source_uid WHERE l.organization_id = ?1 "
            "AND l.kb_id = ?2 AND NOT EXISTS (SELECT 1 FROM knowledge_entries t WHERE t.organization_id = ?1 "
            "AND t.kb_id = ?2 AND t.id = l.target COLLATE NOCASE) AND NOT EXISTS (SELECT 1 FROM knowledge_entries t "
            "WHERE t.organization_id = ?1 AND t.kb_id = ?2 AND t.title = l.target COLLATE NOCASE) "
            "ORDER BY e.path, l.ordinal LIMIT ?3",
            [kb_id, UNRESOLVED_LIMIT])
        now = now_ms()
        stmts = [self.sql.stmt("DELETE FROM knowledge_files WHERE organization_id = ?1 AND kb_id = ?2 AND outcome = 'marker' "
                               "AND path NOT IN (SELECT value FROM json_each(?3))", kb_id, json.dumps(sorted(plan.markers)))]
        stmts += [self.sql.stmt(
            "INSERT INTO knowledge_files (organization_id, kb_id, path, blob, outcome) SELECT ?1, ?2, ?3, ?4, 'marker' "
            f"WHERE {SYNC_ALIVE.format(n=5)} ON CONFLICT (organization_id, kb_id, path) DO UPDATE SET blob = excluded.blob, "
            "outcome = 'marker', reason = NULL",
            kb_id, path, blob, sync_id) for path, blob in sorted(plan.markers.items())]
        stmts += [
            self.sql.stmt("UPDATE knowledge_syncs SET state = 'succeeded', finished_at = ?3, error = NULL, "
                          "unresolved_links = ?4 WHERE organization_id = ?1 AND id = ?2", sync_id, now,
                          json.dumps([{"path": r["path"], "target": r["target"]} for r in unresolved])),
            self.sql.stmt("UPDATE knowledge_bases SET last_commit = COALESCE(?3, last_commit), last_sync_id = ?4, "
                          "last_synced_at = ?5, synced_fingerprint = ?6 WHERE organization_id = ?1 AND id = ?2",
                          kb_id, plan.head, sync_id, now, fp),
            self.sql.stmt("DELETE FROM knowledge_uploads WHERE organization_id = ?1 AND sync_id = ?2", sync_id),
        ]
        await self.sql.batch(stmts)


def _outcome(sql: OrgSql, sync_id: str, path: str, outcome: str, reason: str | None = None,
             warnings: str | None = None) -> Statement:
    return sql.stmt("INSERT INTO knowledge_sync_files (organization_id, sync_id, path, outcome, reason, warnings) "
                    f"SELECT ?1, ?2, ?3, ?4, ?5, ?6 WHERE {SYNC_ALIVE.format(n=2)} ON CONFLICT DO NOTHING",
                    sync_id, path, outcome, reason, warnings)


def _batches(todo: list[tuple[str, str, int]]) -> Iterable[list[tuple[str, str, int]]]:
    batch: list[tuple[str, str, int]] = []
    size = 0
    for item in todo:
        if batch and (len(batch) >= BATCH_FILES or size + min(item[2], 1 << 20) > BATCH_BYTES):
            yield batch
            batch, size = [], 0
        batch.append(item)
        size += min(item[2], 1 << 20)
    if batch:
        yield batch


# -- vectors ------------------------------------------------------------------------------------------------


async def flush_vector_gc(sql: OrgSql, vectors: OrgVectors, *, page: int = 500) -> int:
    """Delete the vectors of knowledge chunks whose rows are gone (``vector_gc``), then forget them. Returns how many."""
    total = 0
    while True:
        ids = [r["chunk_id"] for r in await sql.rows(
            "SELECT chunk_id FROM vector_gc WHERE organization_id = ?1 ORDER BY chunk_id LIMIT ?2", [page])]
        if not ids:
            return total
        await vectors.delete_by_ids(ids)
        await sql.execute("DELETE FROM vector_gc WHERE organization_id = ?1 AND chunk_id IN (SELECT value FROM json_each(?2))",
                          [json.dumps(ids)])
        total += len(ids)
        if len(ids) < page:
            return total


def enqueue_kb_embed(sql: OrgSql, kb_id: str, now: int) -> Statement:
    """Queue the embedding job of a knowledge base unless one is already waiting."""
    return sql.stmt(
        "INSERT INTO jobs (organization_id, kind, target_id, run_after, created_at) SELECT ?1, ?2, ?3, ?4, ?4 "
        "WHERE NOT EXISTS (SELECT 1 FROM jobs WHERE organization_id = ?1 AND kind = ?2 AND target_id = ?3 "
        "AND state = 'pending' AND locked_until IS NULL) "
        "AND EXISTS (SELECT 1 FROM knowledge_bases WHERE organization_id = ?1 AND id = ?3)", KB_EMBED_JOB, kb_id, now)
