"""The job worker: drains the durable job table inside the service.

Jobs are claimed with one UPDATE ... RETURNING (a lease, so several instances can drain one table), run,
and marked done in the same batch that records their effect. A failed job is retried with exponential
backoff; a crash mid-job leaves the lease to expire and the job to be claimed again. The worker knows no job
kind: it runs the handler registered for the job's kind (``handlers``; the composition root registers the
embedding job of ``services.search.indexing`` and the enrichment job of ``services.enrichment``). A job whose
kind has no handler fails (and is retried, like any failure).

A full disk or a database at its size limit (``InsufficientStorage``) is not a job failure: the worker puts
that organization's claimed jobs back (their attempt not counted), pauses that organization only, and probes
it again every few seconds (or at once when woken by a capture); when a write goes through again it
checkpoints the write-ahead logs and drains its pending jobs. The other organizations' jobs go on.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from services.background import IN_BACKGROUND, background
from services.errors import EmbeddingModelMismatch, InsufficientStorage, NotFound
from services.ids import now_ms
from services.ports import Embedder, Statement, model_input_tokens
from services.storage.scoped import OrgSql, OrgVectors
from services.storage.stores import OrgStores

__all__ = ["CLAIM_SQL", "SETTLE_DONE_SQL", "Job", "Handler", "JobWorker", "JobDeferred", "renew_lease", "LEASE_MS",
           "Stage", "Collected", "settle_jobs", "ROUND_TEXTS", "ORG_TEXTS"]

log = logging.getLogger("memex.worker")
LEASE_MS = 60_000
MAX_ATTEMPTS = 8
#: Texts one round embeds at most (one model call), and at most per organization (so one organization's import
#: leaves room for the others' captures in the same call).
ROUND_TEXTS = 256
ORG_TEXTS = 128
#: A model call of at most this many texts' tokens (a capture or two, or one long note's chunks: ~0.1-0.2 s of MiniLM
#: on these cores) is announced to searches (``RecentVectors.expect``): one that wants such a text's vector waits for
#: the call instead of running the model on it again. A bigger call (an import's) outlasts the search's wait.
SHARED_CALL_TOKENS = 1024
#: While the disk is full the worker probes again after 0.5 s, doubling up to this.
PAUSE_MAX_SECONDS = 5.0


@dataclass(frozen=True, slots=True)
class Job:
    id: int
    organization_id: str
    kind: str
    target_id: str
    attempts: int


Handler = Callable[[OrgSql, OrgVectors, Embedder, Job], Awaitable[None]]


class JobDeferred(Exception):
    """Raised by a handler that cannot run its job yet (another holds what it needs): the job goes back to wait
    ``delay_ms``, its attempt not counted."""

    def __init__(self, reason: str, delay_ms: int = 2000) -> None:
        super().__init__(reason)
        self.delay_ms = delay_ms


@dataclass
class Collected:
    """What a stage gathered for one organization's jobs of a round: the texts the model must embed (possibly none),
    the jobs whose work is all in hand (``done``) and those left for a later round (``later``: released, their attempt
    not counted), plus the stage's own state for ``finish``."""

    texts: list[str]
    done: list[Job]
    later: list[Job]
    state: Any = None


class Stage(Protocol):
    """Jobs of one kind run together, across organizations: every organization's share is collected, the texts of
    all of them are embedded in one model call (length-sorted by the embedder), then each organization's share is
    finished (one vector upsert, one SQL batch that also deletes its done jobs and releases the others)."""

    async def collect(self, sql: OrgSql, jobs: list[Job], capacity: int) -> Collected:
        """Gather the work of ``jobs``, at most ``capacity`` texts to embed."""
        ...

    async def finish(self, sql: OrgSql, vectors: OrgVectors, collected: Collected, values: np.ndarray) -> None:
        """Write the results (``values``: one row per collected text) and settle the jobs."""
        ...


#: A worker's claim: the first ``?4`` due jobs, leased until ``?2``. In due order, which is the order of the
#: jobs_ready(state, run_after) index and its rowids, so no sort: ``ORDER BY id`` sorted every ready job (58 ms a claim
#: with 87,000 queued). The outer ``organization_id`` is unary-plussed so that the ids are looked up by rowid rather
#: than checked against every entry of the organization's jobs_by_target index (the same for SETTLE_DONE_SQL: 22 ms).
CLAIM_SQL = (
    "UPDATE jobs SET locked_until = ?2, attempts = attempts + 1 WHERE +organization_id = ?1 AND id IN ("
    " SELECT id FROM jobs WHERE organization_id = ?1 AND state = 'pending' AND run_after <= ?3"
    " AND (locked_until IS NULL OR locked_until < ?3) ORDER BY run_after, id LIMIT ?4) "
    "RETURNING id, organization_id, kind, target_id, attempts"
)
SETTLE_DONE_SQL = "DELETE FROM jobs WHERE +organization_id = ?1 AND id IN (SELECT value FROM json_each(?2))"


def settle_jobs(sql: OrgSql, collected: Collected) -> list[Statement]:
    """The statements that end a stage's round for its jobs: the done ones deleted, the others released."""
    out = []
    if collected.done:
        out.append(sql.stmt(SETTLE_DONE_SQL, json.dumps([j.id for j in collected.done])))
    if collected.later:
        out.append(sql.stmt(
            "UPDATE jobs SET locked_until = NULL, attempts = MAX(0, attempts - 1) WHERE +organization_id = ?1 "
            "AND id IN (SELECT value FROM json_each(?2))", json.dumps([j.id for j in collected.later])))
    return out


async def renew_lease(sql: OrgSql, job: Job) -> None:
    """Extend a long job's lease (a knowledge sync between two batches), so no other worker claims it meanwhile."""
    await sql.execute("UPDATE jobs SET locked_until = ?3 WHERE organization_id = ?1 AND id = ?2",
                      [job.id, now_ms() + LEASE_MS])


class JobWorker:
    """Drains every organization's job table (each organization's jobs live in its own database).

    The worker keeps the organizations that have work (``_due``: organization -> the earliest time one of
    its jobs can run): a capture wakes it for its organization, and at start it scans every organization's
    database once (jobs left by a previous run). Each round gives every organization with ready jobs one
    batch, in turn, so one organization's import never starves another's captures.

    On stores that say ``concurrent_orgs`` (the Worker backend) a round claims, collects, finishes and confirms the
    organizations' shares at once, each share still in its own calls and failing alone; the loop runs with
    ``services.background`` set, so the adapters' concurrent calls share requests (about one Worker request per step
    of a round rather than one per organization and step)."""

    def __init__(
        self,
        stores: OrgStores,
        embedder: Embedder,
        *,
        handlers: dict[str, Handler],
        stages: dict[str, Stage] | None = None,
        poll_seconds: float = 1.0,
        max_idle_seconds: float = 30.0,
        batch: int = 64,
        async_index: bool = False,
    ) -> None:
        self.stores = stores
        self.embedder = embedder
        #: Job kind -> what runs it (``handler(sql, vectors, embedder, job)``).
        self.handlers: dict[str, Handler] = dict(handlers)
        #: Job kind -> the stage that runs its jobs together, across organizations (embedding, enrichment).
        self.stages: dict[str, Stage] = dict(stages or {})
        self.poll_seconds = poll_seconds
        self.batch = batch
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._stopping = False
        self.processed = 0
        self.failed = 0
        self._busy = 0
        self._last_confirm = 0.0
        self.max_idle_seconds = max_idle_seconds
        #: Vectorize-like indexes apply writes later; only they need confirmation.
        self._async_index = async_index
        #: Organizations with vectors written but not yet confirmed searchable, and how many times each was added
        #: (a confirmation that ran meanwhile does not forget an organization a round just wrote to).
        self._unconfirmed: set[str] = set()
        self._written: dict[str, int] = {}
        #: Organization -> earliest epoch ms a job of it may be ready (0: now).
        self._due: dict[str, int] = {}
        #: Wakes per organization (a round only forgets an organization no wake touched while it ran) and the
        #: retry times this process set when jobs failed: what the worker knows without asking the database.
        self._wakes: dict[str, int] = {}
        self._retry_at: dict[str, list[int]] = {}
        self._pending_cache: tuple[float, int] | None = None
        self._scanned = False
        self._scan_lock = asyncio.Lock()
        #: Organizations out of space (a full disk, a database at its size limit): why, and the jobs claimed
        #: but put back (uncounted) once a write goes through again. The others' jobs go on meanwhile.
        self._full: dict[str, tuple[str, list[Job]]] = {}
        self._probe_at = 0.0
        self._probe_wait = 0.5
        #: Work on several organizations at once (their claims, a stage's collects and finishes, confirmations),
        #: for stores whose adapters share requests between concurrent calls of a round (the Worker backend:
        #: ``concurrent_orgs``); elsewhere one organization after the other.
        self._concurrent = bool(getattr(stores, "concurrent_orgs", False))
        #: The newest work hint seen in the control database (org_databases.work_at, epoch ms).
        self._hints_seen = now_ms()
        #: Organization -> the work hint this process wrote for it last (``own_hint``): not news when read back.
        self._own_hints: dict[str, int] = {}

    def wake(self, org_id: str | None = None) -> None:
        if org_id is not None:
            self._due[org_id] = 0
            self._wakes[org_id] = self._wakes.get(org_id, 0) + 1
            if self._async_index:
                self._unconfirm(org_id)
        self._probe_at = 0.0  # a write just went through somewhere: try the paused organizations again
        self._wake.set()

    def _forsake(self, org_id: str) -> None:
        """An organization whose vectors are another embedding model's: its jobs are left, unclaimed, to the instances
        of that model (embedded with this one, its vectors would mean nothing to its searches)."""
        if self._due.pop(org_id, None) is not None:
            log.info("leaving the jobs of %s to the instances of its embedding model", org_id)
        self._unconfirmed.discard(org_id)

    def _unconfirm(self, org_id: str) -> None:
        self._unconfirmed.add(org_id)
        self._written[org_id] = self._written.get(org_id, 0) + 1

    def start(self) -> None:
        if self._task is None:
            self._stopping = False
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="memex-job-worker")

    async def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._task is not None:
            try:
                await asyncio.wait_for(self._task, timeout=30)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                self._task.cancel()
            self._task = None

    async def scan(self) -> int:
        """Find every organization with queued jobs or unconfirmed vectors (once at start); how many."""
        found = 0
        for org_id in await self.stores.org_ids():
            try:
                sql = (await self.stores.open(org_id)).sql
                # one query per organization (on D1 an API request): its next job, and unconfirmed vectors
                row = await sql.one(
                    "SELECT (SELECT MIN(MAX(run_after, COALESCE(locked_until, 0))) FROM jobs "
                    "WHERE organization_id = ?1 AND state = 'pending') AS due, EXISTS (SELECT 1 FROM chunks "
                    "WHERE organization_id = ?1 AND vector_mutation IS NOT NULL) AS unconfirmed")
                if row is not None and row["due"] is not None:
                    due = int(row["due"])
                    self._due[org_id] = min(due, self._due.get(org_id, due))
                    found += 1
                if self._async_index and row is not None and row["unconfirmed"]:
                    self._unconfirmed.add(org_id)
            except EmbeddingModelMismatch:  # another model's organization: its instances run its jobs
                continue
            except Exception:
                log.warning("scanning %s for jobs failed", org_id, exc_info=True)
        self._scanned = True
        return found

    async def scan_once(self) -> None:
        """The start-up scan, once, by whoever needs it first: the loop, a drain, or ``/health`` (which, until
        then, would count only the organizations a capture since the start has woken: 0 after a restart)."""
        if self._scanned:
            return
        async with self._scan_lock:
            if not self._scanned:
                await self.scan()

    async def _loop(self) -> None:
        # Idle, the worker sleeps until a capture in this process wakes it, an organization's next retry is
        # due, or it is time to look at the work hints other processes leave in the control database (a CLI
        # import, another instance): every poll_seconds, doubling up to max_idle_seconds while nothing comes.
        # Mutation confirmation runs only while this process has written vectors not yet confirmed.
        IN_BACKGROUND.set(True)  # this task's own context: its calls (and its tasks') are background work
        try:
            await self.scan_once()
        except Exception:
            log.exception("start-up job scan failed")
        poll = self.poll_seconds
        next_hints = time.monotonic() + poll
        while not self._stopping:
            did = 0
            try:
                if self._full and time.monotonic() >= self._probe_at:
                    await self._probe()
                if time.monotonic() >= next_hints:
                    found = await self.read_hints()
                    poll = self.poll_seconds if found else min(self.max_idle_seconds, poll * 2)
                    next_hints = time.monotonic() + poll
                confirm = bool(self._unconfirmed) and time.monotonic() - self._last_confirm >= 1.0
                if confirm:
                    self._last_confirm = time.monotonic()
                if confirm and self._concurrent:  # alongside the round: their requests shared
                    ran, confirmed = await asyncio.gather(self.run_once(), self.confirm_mutations(),
                                                          return_exceptions=True)
                    if isinstance(ran, BaseException):
                        raise ran
                    if isinstance(confirmed, BaseException):
                        raise confirmed
                    did = ran
                else:
                    did = await self.run_once()
                    if confirm:
                        await self.confirm_mutations()
            except Exception:  # the loop must survive a bad batch; the jobs stay leased and retry later
                log.exception("job batch failed")
            if did or self._stopping:
                continue
            timeout = next_hints - time.monotonic()
            ready = [due for org, due in self._due.items() if org not in self._full]
            if ready:
                timeout = min(timeout, (min(ready) - now_ms()) / 1000)
            if self._full:
                timeout = min(timeout, self._probe_at - time.monotonic())
            if self._unconfirmed:
                timeout = min(timeout, 1.0)
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=max(0.02, timeout))
            except asyncio.TimeoutError:
                pass
            self._wake.clear()

    def own_hint(self, org_id: str, work_at: int) -> None:
        """This process is writing the work hint ``work_at`` for ``org_id`` (its own worker was woken already): when
        ``read_hints`` finds exactly that hint, it is not news, and the idle poll goes on backing off (on D1 every
        poll is an API request)."""
        self._own_hints[org_id] = work_at

    async def read_hints(self) -> int:
        """Organizations that another process queued work for since the last look (one control query); how many."""
        rows = await self.stores.control.execute(
            "SELECT organization_id, work_at FROM org_databases WHERE work_at > ?", (self._hints_seen,))
        news = 0
        for r in rows.rows:
            at, org_id = int(r["work_at"]), r["organization_id"]
            self._hints_seen = max(self._hints_seen, at)
            if self._own_hints.get(org_id) == at:
                del self._own_hints[org_id]
                continue
            self._due.setdefault(org_id, 0)
            news += 1
        return news

    @property
    def paused(self) -> str | None:
        """Why some organization's jobs wait for space (a full disk, a database at its size limit), or None."""
        return next(iter(self._full.values()))[0] if self._full else None

    def _pause(self, org_id: str, exc: InsufficientStorage, jobs: list[Job]) -> None:
        if org_id not in self._full:
            log.warning("jobs of %s paused: %s (%s)", org_id, exc.message, exc.details.get("reason"))
            self._full[org_id] = (exc.details.get("reason") or exc.message, [])
            self._probe_wait = 0.5
            self._probe_at = min(self._probe_at, time.monotonic() + self._probe_wait)
        self._full[org_id][1].extend(jobs)

    async def _probe(self) -> None:
        """Try each organization that ran out of space again; back off (up to PAUSE_MAX_SECONDS) while full."""
        try:
            await self.resume()
            self._probe_wait = 0.5
        except InsufficientStorage:
            self._probe_wait = min(PAUSE_MAX_SECONDS, self._probe_wait * 2)
        except Exception:
            log.exception("resuming paused jobs failed")
            self._probe_wait = min(PAUSE_MAX_SECONDS, self._probe_wait * 2)
        self._probe_at = time.monotonic() + self._probe_wait

    async def resume(self) -> None:
        """Put the held jobs of each paused organization back as they were before their claim (a full disk is
        not an attempt; the write doubles as the probe), checkpoint the logs the full disk may have grown, and
        unpause it. Raises ``InsufficientStorage`` while an organization's database is still full (the ones
        that resumed before it stay resumed)."""
        for org_id, (_, held) in list(self._full.items()):
            store = await self.stores.open(org_id)
            if held:
                await store.sql.execute(
                    "UPDATE jobs SET locked_until = NULL, attempts = MAX(0, attempts - 1) WHERE +organization_id = ?1 "
                    "AND +state = 'pending' AND id IN (SELECT value FROM json_each(?2))",
                    [json.dumps([j.id for j in held])],
                )
            else:  # a probe that writes (an UPDATE matching nothing would succeed on a full disk)
                await store.sql.execute(
                    "UPDATE jobs SET attempts = attempts WHERE organization_id = ?1 AND id = (SELECT MAX(id) FROM jobs)")
            for handle in (self.stores.control, store.db, store.index):  # remote backends: no-ops
                try:
                    await handle.checkpoint()
                except Exception:
                    log.warning("checkpoint after a full disk failed", exc_info=True)
            del self._full[org_id]
            self._due[org_id] = 0
            log.warning("jobs of %s resumed: writes go through again", org_id)

    async def claim(self, org_id: str) -> list[Job]:
        now = now_ms()
        sql = (await self.stores.open(org_id)).sql
        rows = await sql.rows(CLAIM_SQL, [now + LEASE_MS, now, self.batch])
        return sorted((Job(**r) for r in rows), key=lambda j: j.id)

    async def run_once(self) -> int:
        """One round: one batch from each organization with ready jobs; returns how many jobs it ran. Jobs of a kind
        with a stage run together after every organization has been claimed from: one model call for the round."""
        self._busy += 1
        try:
            now = now_ms()
            ready = sorted((due, org) for org, due in self._due.items() if due <= now)
            ran = 0
            staged: dict[str, dict[str, list[Job]]] = {}  # kind -> organization -> its jobs of that kind
            claimed: dict[str, tuple[int, int]] = {}  # organization -> (jobs claimed, wakes before the claim)
            early: dict[str, tuple[int, Any]] = {}  # claimed at once (concurrent_orgs): wakes before, jobs or error
            targets = [org_id for _, org_id in ready if org_id not in self._full]
            if self._concurrent and len(targets) > 1 and not self._stopping:
                before = {org_id: self._wakes.get(org_id, 0) for org_id in targets}
                claims = await asyncio.gather(*(self.claim(org_id) for org_id in targets), return_exceptions=True)
                early = {org_id: (before[org_id], g) for org_id, g in zip(targets, claims, strict=True)}
            for _, org_id in ready:
                if self._stopping:
                    break
                if org_id in self._full:
                    continue  # waits for space; the others go on
                wakes = early[org_id][0] if org_id in early else self._wakes.get(org_id, 0)
                try:
                    if org_id in early:
                        if isinstance(early[org_id][1], BaseException):
                            raise early[org_id][1]
                        jobs = early[org_id][1]
                    else:
                        jobs = await self.claim(org_id)
                except NotFound:  # the organization was deleted
                    self._due.pop(org_id, None)
                    continue
                except EmbeddingModelMismatch:  # another model's organization (a work hint brought it): not ours
                    self._forsake(org_id)
                    continue
                except InsufficientStorage as exc:
                    self._pause(org_id, exc, [])
                    continue
                except Exception:
                    if org_id not in early:
                        raise
                    # claimed together with others: theirs go on, this organization is tried again next round
                    log.warning("claiming the jobs of %s failed", org_id, exc_info=True)
                    continue
                single = [j for j in jobs if j.kind not in self.stages]
                for job in jobs:
                    if job.kind in self.stages:
                        staged.setdefault(job.kind, {}).setdefault(org_id, []).append(job)
                done = await self._run_single(org_id, single)
                ran += done
                if done < len(single):
                    continue  # paused: out of space
                claimed[org_id] = (len(jobs), wakes)
            released: set[str] = set()
            for kind in [k for k in self.stages if k in staged]:  # in registration order: enrichment, then embedding
                parts = staged[kind]
                got, later = await self._run_stage(kind, [(o, js) for o, js in parts.items() if o not in self._full])
                ran += got
                released |= later
            for org_id, (count, wakes) in claimed.items():
                if org_id in self._full:
                    continue
                if self._async_index and count:
                    self._unconfirm(org_id)
                if org_id in released:
                    self._due[org_id] = 0  # a stage left work for the next round
                elif count < self.batch and self._wakes.get(org_id, 0) == wakes:
                    # Nothing more is ready. What is left is retries this process scheduled (known without a
                    # query: on D1 each query is an API request); leases of a crashed instance are found by
                    # the start-up scan.
                    # A retry is kept until its time has come and gone (a wake in between must not drop it).
                    later_retries = sorted(at for at in self._retry_at.pop(org_id, []) if at > now)
                    if later_retries:
                        self._retry_at[org_id] = later_retries
                        self._due[org_id] = later_retries[0]
                    else:
                        self._due.pop(org_id, None)
            return ran
        finally:
            self._busy -= 1

    async def _run_single(self, org_id: str, jobs: list[Job]) -> int:
        """Run jobs one by one; returns how many ran (fewer when the organization ran out of space)."""
        for i, job in enumerate(jobs):
            try:
                await self._run(job)
            except InsufficientStorage as exc:  # this job and the rest wait for space, uncounted
                self._pause(org_id, exc, jobs[i:])
                return i
        return len(jobs)

    async def _run_stage(self, kind: str, parts: list[tuple[str, list[Job]]]) -> tuple[int, set[str]]:
        """Collect every organization's share, embed all their texts in one call, finish each share. Returns (jobs
        done, plus one when texts were embedded: progress even before a job completes; organizations with jobs left
        for a later round). A failure fails only the share it happened in (its
        jobs retried with backoff); a failing model call fails the round's jobs."""
        stage = self.stages[kind]
        shares: list[tuple[str, Any, Collected]] = []
        room = ROUND_TEXTS

        async def collect(org_id: str, jobs: list[Job], capacity: int) -> tuple[Any, Collected]:
            store = await self.stores.open(org_id)
            return store, await stage.collect(store.sql, jobs, capacity)

        # concurrent_orgs: every share collected at once with the room a share may have at most; a share that
        # collected more texts than its turn leaves room for is collected again with that room (collecting reads)
        early: list[Any] = [None] * len(parts)
        if self._concurrent and len(parts) > 1:
            early = list(await asyncio.gather(*(collect(org_id, jobs, min(ORG_TEXTS, room)) for org_id, jobs in parts),
                                              return_exceptions=True))
        for (org_id, jobs), pre in zip(parts, early, strict=True):
            capacity = max(0, min(ORG_TEXTS, room))
            try:
                if isinstance(pre, BaseException):
                    raise pre
                if pre is not None and len(pre[1].texts) <= capacity:
                    store, collected = pre
                else:
                    store, collected = await collect(org_id, jobs, capacity)
            except InsufficientStorage as exc:
                self._pause(org_id, exc, jobs)
                continue
            except Exception as exc:
                await self._fail_all(org_id, jobs, exc)
                continue
            room -= len(collected.texts)
            shares.append((org_id, store, collected))
        texts = [t for _, _, c in shares for t in c.texts]
        # a small call (a capture or two, one long note) is announced: a search that wants one of these vectors waits for it
        # instead of running the model on the same text (services.search.unindexed)
        recent = getattr(stage, "recent", None) if texts and self._small_call(texts) else None
        if recent is not None:
            for org_id, _, c in shares:
                recent.expect(org_id, c.texts)
        try:
            values = await self.embedder.embed(texts) if texts else np.zeros((0, self.embedder.dimensions), np.float32)
        except BaseException as exc:
            if recent is not None:  # a waiting search embeds the text itself
                for org_id, _, c in shares:
                    recent.settle(org_id, c.texts, None)
            if not isinstance(exc, Exception):  # cancelled: shutting down
                raise
            for org_id, _, c in shares:
                await self._fail_all(org_id, c.done + c.later, exc)
            return 0, set()
        if recent is not None:
            at = 0
            for org_id, _, c in shares:
                recent.settle(org_id, c.texts, values[at:at + len(c.texts)])
                at += len(c.texts)
        done, later, at = (1 if texts else 0), set(), 0  # embedding texts is progress, even with no job done yet

        async def finish(org_id: str, store: Any, collected: Collected, mine: np.ndarray) -> int:
            try:
                await stage.finish(store.sql, store.vectors, collected, mine)
            except InsufficientStorage as exc:
                self._pause(org_id, exc, collected.done + collected.later)
                return 0
            except Exception as exc:
                await self._fail_all(org_id, collected.done + collected.later, exc)
                return 0
            self.processed += len(collected.done)
            if collected.later:
                later.add(org_id)
            return len(collected.done)

        calls: list[tuple[str, Any, Collected, np.ndarray]] = []
        for org_id, store, collected in shares:
            mine = values[at:at + len(collected.texts)]
            at += len(collected.texts)
            calls.append((org_id, store, collected, mine))
        if self._concurrent and len(calls) > 1:  # every share's writes at once (their requests shared)
            done += sum(await asyncio.gather(*(finish(*call) for call in calls)))
        else:
            for call in calls:
                done += await finish(*call)
        return done, later

    def _small_call(self, texts: list[str]) -> bool:
        """Whether a model call on ``texts`` is small enough to announce (``SHARED_CALL_TOKENS``)."""
        total = 0
        for t in texts:
            total += model_input_tokens(self.embedder, t)
            if total > SHARED_CALL_TOKENS:
                return False
        return True

    async def _fail_all(self, org_id: str, jobs: list[Job], exc: BaseException) -> None:
        try:
            sql = (await self.stores.open(org_id)).sql
            for job in jobs:
                await self._failed(sql, job, exc)
        except Exception:
            log.exception("recording the failure of %s jobs of %s failed", len(jobs), org_id)

    @property
    def busy(self) -> bool:
        """True while a batch is being claimed or run. A job row that is gone (done, or deleted with its
        parent) and a worker not busy *after* that mean nothing is left in flight for it (tests use this)."""
        return self._busy > 0

    async def _run(self, job: Job) -> None:
        store = await self.stores.open(job.organization_id)
        sql, vectors = store.sql, store.vectors
        handler = self.handlers.get(job.kind)
        try:
            if handler is None:
                raise RuntimeError(f"no handler for job kind {job.kind!r}")
            await handler(sql, vectors, self.embedder, job)
        except InsufficientStorage:
            raise
        except JobDeferred as deferred:
            at = now_ms() + deferred.delay_ms
            self._retry_at.setdefault(job.organization_id, []).append(at)
            log.info("job %s (%s) deferred: %s", job.id, job.kind, deferred)
            await sql.execute(
                "UPDATE jobs SET run_after = ?3, locked_until = NULL, attempts = MAX(0, attempts - 1) "
                "WHERE organization_id = ?1 AND id = ?2", [job.id, at])
            return
        except Exception as exc:
            await self._failed(sql, job, exc)
            return
        self.processed += 1
        await sql.execute("DELETE FROM jobs WHERE organization_id = ?1 AND id = ?2", [job.id])

    async def _failed(self, sql: OrgSql, job: Job, exc: BaseException) -> None:
        """Record a failed attempt: retried with backoff, failed for good after MAX_ATTEMPTS."""
        self.failed += 1
        final = job.attempts >= MAX_ATTEMPTS
        # one time for both: the retry this process schedules must not fall before the row's run_after, or the
        # round at that time finds nothing ready and forgets the organization (the job then waits for a restart)
        at = now_ms() + min(300_000, 500 * 2 ** job.attempts)
        if not final:
            self._retry_at.setdefault(job.organization_id, []).append(at)
        log.warning("job %s (%s) failed (attempt %s): %s", job.id, job.kind, job.attempts, exc)
        await sql.execute(
            "UPDATE jobs SET state = ?3, run_after = ?4, locked_until = NULL, last_error = ?5 "
            "WHERE organization_id = ?1 AND id = ?2",
            [job.id, "failed" if final else "pending", at, str(exc)[:500]],
        )

    async def confirm_mutations(self) -> int:
        """Mark chunks searchable whose vector mutation the index has applied. Mutations apply in order, so
        the newest applied one confirms every older one. Returns how many chunks were confirmed."""
        orgs = list(self._unconfirmed)
        if self._concurrent and len(orgs) > 1:  # every organization at once: their reads, index look and updates shared
            got = await asyncio.gather(*(self._confirm(org_id) for org_id in orgs), return_exceptions=True)
            for org_id, g in zip(orgs, got, strict=True):
                if isinstance(g, BaseException):
                    log.warning("confirming the vector writes of %s failed: %s", org_id, g)
            return sum(g for g in got if isinstance(g, int))
        total = 0
        for org_id in orgs:
            total += await self._confirm(org_id)
        return total

    async def _confirm(self, org_id: str) -> int:
        written = self._written.get(org_id, 0)
        try:
            store = await self.stores.open(org_id)
        except (NotFound, EmbeddingModelMismatch):
            self._unconfirmed.discard(org_id)
            return 0
        index = store.index
        if not index.applies_writes_later:  # every write was searchable on return
            self._unconfirmed.discard(org_id)
            return 0
        sql = store.sql
        rows = await sql.rows(
            "SELECT vector_mutation AS m, MAX(indexed_at) AS at FROM chunks WHERE organization_id = ?1 "
            "AND vector_mutation IS NOT NULL GROUP BY vector_mutation ORDER BY at"
        )
        if not rows and self._written.get(org_id, 0) == written:
            self._unconfirmed.discard(org_id)
        for i in range(len(rows) - 1, -1, -1):
            if await index.searchable(rows[i]["m"], issued_at=rows[i]["at"] / 1000):
                done = [r["m"] for r in rows[: i + 1]]
                res = await sql.execute(
                    "UPDATE chunks SET vector_mutation = NULL WHERE organization_id = ?1 "
                    "AND vector_mutation IN (SELECT value FROM json_each(?2))",
                    [json.dumps(done)],
                )
                if i == len(rows) - 1 and self._written.get(org_id, 0) == written:
                    self._unconfirmed.discard(org_id)  # every mutation this table knows of is applied
                return res.changes
        return 0

    async def drain(self, timeout: float = 60.0) -> None:
        """Run until no job is ready and every vector written is searchable (tests and CLI one-shots)."""
        with background():
            await self._drain(timeout)

    async def _drain(self, timeout: float) -> None:
        await self.scan_once()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if await self.run_once() == 0:
                break
        while time.monotonic() < deadline and self._unconfirmed:
            await self.confirm_mutations()
            if not self._unconfirmed:
                return
            await asyncio.sleep(0.1)

    async def pending(self) -> int:
        """Jobs queued in the organizations known to have work (``/health``). Counted at most every 2 s:
        each organization counted is a query (on D1 an API request), so a monitor polling /health cannot
        turn into one query per organization per poll."""
        cached = self._pending_cache
        if cached is not None and time.monotonic() - cached[0] < 2.0:
            return cached[1]
        try:
            await self.scan_once()
        except Exception:  # counted from what is known; the loop logs the scan's failure
            log.warning("job scan for /health failed", exc_info=True)
        total = await self._count_pending()
        self._pending_cache = (time.monotonic(), total)
        return total

    async def _count_pending(self) -> int:
        total = 0
        for org_id in list(self._due):
            try:
                row = await (await self.stores.open(org_id)).sql.one(
                    "SELECT COUNT(*) AS n FROM jobs WHERE organization_id = ?1 AND state = 'pending'")
            except (NotFound, EmbeddingModelMismatch):
                continue
            total += row["n"] if row else 0
        return total

