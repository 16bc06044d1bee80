"""Conversion of a single-database data directory into one database per organization, nothing lost.

Releases before one database per organization kept every organization in one SQLite file (``memex.sqlite3``,
the schema of migrations/legacy/0001..0010) and every vector in one local index (``vectors.sqlite3``, one
namespace per organization, ids ``<org id>:<chunk id>``). ``convert_on_start`` (called by ``Memex.start``, so
by ``memex serve`` before it serves and by ``memex migrate``) turns such a data directory into the current
layout:

1. The legacy database is brought up to the last legacy migration (a directory from an older release may be
   behind): the copy below reads the schema 0010 left.
2. The new layout is built in ``<data dir>/.converting/``: ``control.sqlite3`` (the control stream) with every
   row of the control tables plus one ``org_databases`` routing row per organization (backend ``sqlite``,
   location = the organization id), and ``orgs/<org id>/memex.sqlite3`` (the org stream) with the organization's
   rows of every organization table, beside ``orgs/<org id>/vectors.sqlite3`` with its vectors (a
   LocalVectorIndex with the legacy index's model and dimensions; ids, values and metadata copied as they are,
   through the index's API).
3. Moved into place: ``.converting/orgs`` becomes ``orgs``, then ``.converting/control.sqlite3`` becomes
   ``control.sqlite3`` LAST: a control database with its schema in it means "converted". The old files are then
   renamed ``memex.sqlite3.pre-per-org`` and ``vectors.sqlite3.pre-per-org``. **They are the operator's backup**:
   the service never reads them again; delete them once the converted service has been checked.

Restartable: until the control file lands, the legacy files are untouched (beyond step 1's migrations) and the
next start deletes ``.converting/`` (and an ``orgs/`` left by a crash between the two renames) and starts over.
After it lands, a start that finds ``.converting/`` and the legacy files finishes the backup renames. A lock
file (``.converting.lock``) keeps two processes from converting the same directory at once, and the legacy files
are held write-locked while they are copied: a process still writing to them (an older server) makes the
conversion stop with a message rather than lose what it writes. The service's own handle on ``control.sqlite3``
(opened, blank, before ``start``) is closed during the conversion and pointed at the converted file afterwards.

What is copied and how: ``services.storage.convert_plan`` (which table goes where, and what stops a conversion)
and ``services.storage.convert_copy`` (the copy itself, written against the ``SqlDatabase`` port only, so the
same code could convert a single-D1 deployment; how, in that module). This module runs them on an embedded data
directory.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import sqlite3
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.ports import SqlDatabase, VectorIndex
from services.storage.convert_copy import copy_control, copy_organization, left_behind
from services.storage.convert_plan import ConversionError, make_plan
from services.storage.migrate import CONTROL_DIR, LEGACY_DIR, ORG_DIR, apply_pending
from services.storage.stores import RoutingTable

__all__ = ["ConversionError", "ConversionReport", "convert_on_start", "convert_data_dir", "after_organization",
           "BACKUP_SUFFIX", "STAGING_NAME"]

log = logging.getLogger("memex.convert")

LEGACY_DB = "memex.sqlite3"
LEGACY_VECTORS = "vectors.sqlite3"
CONTROL_DB = "control.sqlite3"
ORG_DB = "memex.sqlite3"
ORG_VECTORS = "vectors.sqlite3"
#: Appended to the legacy files once converted: they stay as the operator's backup.
BACKUP_SUFFIX = ".pre-per-org"
#: The staging folder inside the data directory.
STAGING_NAME = ".converting"
LOCK_NAME = ".converting.lock"
#: How long the conversion waits for another writer of the legacy files before giving up.
LEGACY_LOCK_WAIT = 10.0
#: Vectors read from the legacy index and written to an organization's per batch.
VECTORS_PER_BATCH = 200

#: ``open_database(path)``: an embedded SqlDatabase on a file (the composition root passes SqliteDatabase).
OpenDatabase = Callable[[Path], SqlDatabase]
#: ``open_index(path, dimensions=, model=)``: a local vector index on a file that never resets a mismatching one
#: (the composition root passes LocalVectorIndex; it also needs ``ids_in_namespace``).
OpenIndex = Callable[..., VectorIndex]


def after_organization(org_id: str, done: int, total: int) -> None:
    """Called after each organization is converted, before the next (a seam: tests raise here to simulate a
    crash mid-conversion)."""


@dataclass
class ConversionReport:
    organizations: list[str] = field(default_factory=list)
    #: Legacy migrations applied before converting.
    legacy_migrations: list[str] = field(default_factory=list)
    #: Rows copied per table (control and all organizations together).
    rows: dict[str, int] = field(default_factory=dict)
    #: Rows per table that belong to no organization: not carried over, kept in the backup.
    left_behind: dict[str, int] = field(default_factory=dict)
    vectors: int = 0
    vectors_left_behind: int = 0
    ignored: dict[str, str] = field(default_factory=dict)
    backups: list[Path] = field(default_factory=list)


def _sidecars(path: Path) -> list[Path]:
    return [path.with_name(path.name + s) for s in ("-wal", "-shm", "-journal")]


def _single_file(path: Path) -> None:
    """Fold a SQLite file's WAL into it and leave it in rollback-journal mode: one self-contained file that can be
    renamed alone (the service turns WAL back on when it opens it)."""
    conn = sqlite3.connect(path, timeout=30.0)
    try:
        conn.execute("PRAGMA journal_mode = DELETE").fetchone()
    finally:
        conn.close()


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _blank(path: Path) -> bool:
    """Does the control database at ``path`` hold nothing (absent, or only the empty file the service's own
    handle created, maybe with an empty d1_migrations)?"""
    if not path.exists():
        return True
    conn = sqlite3.connect(path, timeout=30.0)
    try:
        names = {r[0] for r in conn.execute("SELECT name FROM sqlite_master")}
        if names - {"d1_migrations", "sqlite_sequence"}:
            return False
        return "d1_migrations" not in names or conn.execute("SELECT COUNT(*) FROM d1_migrations").fetchone()[0] == 0
    finally:
        conn.close()


def _keep_backups(data_dir: Path) -> list[Path]:
    """Rename the legacy files (and any sidecar) to ``<name>.pre-per-org``, never over an existing file."""
    kept = []
    for name in (LEGACY_DB, LEGACY_VECTORS):
        src = data_dir / name
        if not src.exists():
            continue
        try:
            _single_file(src)
        except sqlite3.Error as exc:  # someone holds it: its WAL and shared memory move with it instead
            log.warning("could not fold %s's WAL into it (%s): renaming its -wal/-shm with it", src, exc)
        dst = data_dir / (name + BACKUP_SUFFIX)
        n = 1
        while dst.exists():
            dst = data_dir / f"{name}{BACKUP_SUFFIX}.{n}"
            n += 1
        for side_src, side_dst in zip(_sidecars(src), _sidecars(dst), strict=True):
            if side_src.exists():
                os.replace(side_src, side_dst)
        os.replace(src, dst)
        kept.append(dst)
    _fsync_dir(data_dir)
    if kept:
        log.warning("the single-database files are kept as %s: a backup the service no longer reads; delete them "
                    "once the converted data has been checked", " and ".join(str(p) for p in kept))
    return kept


class _WriteGuard:
    """Holds a write lock (``BEGIN IMMEDIATE``, readers still read) on the legacy files while they are copied, so
    nothing (an old server still running, an operator's shell) can write to them unseen; such a writer waits,
    then fails with "database is locked"."""

    def __init__(self) -> None:
        self.conns: list[sqlite3.Connection] = []

    def hold(self, path: Path) -> None:
        conn = sqlite3.connect(path, timeout=LEGACY_LOCK_WAIT, isolation_level=None)
        try:
            conn.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError as exc:
            conn.close()
            raise ConversionError(f"{path} is being written by another process ({exc}): stop every process using "
                                  "this data directory (an older server?) and start again") from None
        self.conns.append(conn)

    def release(self) -> None:
        while self.conns:
            conn = self.conns.pop()
            try:
                conn.execute("ROLLBACK")
            finally:
                conn.close()


def _read_vector_meta(path: Path) -> tuple[str, int] | None:
    """The legacy vector index's model and dimensions (None: no index, or one without usable meta)."""
    if not path.exists():
        return None
    conn = sqlite3.connect(path, timeout=30.0)
    try:
        meta = dict(conn.execute("SELECT key, value FROM meta").fetchall())
        model, dims = meta.get("model"), str(meta.get("dimensions"))
        if not model or not dims.isdigit() or int(dims) < 1:
            return None
        return str(model), int(dims)
    except sqlite3.Error:
        return None
    finally:
        conn.close()


async def _copy_vectors(source: Any, open_index: OpenIndex, path: Path, org_id: str, model: str) -> int:
    """The organization's namespace of the legacy index into a new index at ``path`` (same model and dimensions):
    ids, values and metadata as they are."""
    ids = sorted(await source.ids_in_namespace(org_id))
    target = await asyncio.to_thread(open_index, path, dimensions=source.dimensions, model=model)
    try:
        for i in range(0, len(ids), VECTORS_PER_BATCH):
            await target.upsert(await source.get_by_ids(ids[i:i + VECTORS_PER_BATCH]))
        count = (await target.info()).vector_count
        if count != len(ids):
            raise ConversionError(f"organization {org_id}: {count} vectors written of {len(ids)}")
    finally:
        await target.close()
    return len(ids)


def _clear_staging(data_dir: Path) -> None:
    staging = data_dir / STAGING_NAME
    if staging.exists():
        log.info("removing %s left by an interrupted conversion", staging)
        shutil.rmtree(staging)
    orgs = data_dir / "orgs"
    if orgs.exists():  # only a crash between the two renames leaves one beside an unconverted layout
        log.warning("removing %s left by an interrupted conversion (the control database never landed)", orgs)
        shutil.rmtree(orgs)


async def convert_data_dir(data_dir: Path, *, open_database: OpenDatabase, open_index: OpenIndex,
                           model: str | None = None, dimensions: int | None = None) -> ConversionReport:
    """Convert ``data_dir`` (``memex.sqlite3`` and ``vectors.sqlite3`` of the single-database layout) into the
    control database plus one database and vector file per organization, building it in ``.converting/`` and
    moving it into place, the control database last.

    The legacy files are then renamed ``memex.sqlite3.pre-per-org`` and ``vectors.sqlite3.pre-per-org`` and kept
    as the operator's backup (the service never reads them again; delete them once satisfied). They also keep the
    rows that belong to no organization, which are not carried over (counted in the report and the log).

    ``model`` and ``dimensions`` are the service's embedder's, only to warn when the copied vectors were made by
    another model (the service then discards and re-embeds them on first open, as before). The caller holds no
    handle on ``control.sqlite3``. Restartable: see the module docstring. ``open_database`` and ``open_index`` make
    the adapters (services never choose them)."""
    data_dir = Path(data_dir)
    staging = data_dir / STAGING_NAME
    _clear_staging(data_dir)
    (staging / "orgs").mkdir(parents=True)
    report = ConversionReport()
    handles: list[Any] = []
    guard = _WriteGuard()

    async def close_all() -> None:
        while handles:
            await handles.pop().close()

    try:
        legacy = open_database(data_dir / LEGACY_DB)
        handles.append(legacy)
        report.legacy_migrations = await apply_pending(legacy, LEGACY_DIR)
        if report.legacy_migrations:
            log.info("legacy database brought up to date first: %s", ", ".join(report.legacy_migrations))
        control = open_database(staging / CONTROL_DB)
        handles.append(control)
        await apply_pending(control, CONTROL_DIR)
        guard.hold(data_dir / LEGACY_DB)  # after its migrations: from here on only read
        template = open_database(staging / "template.sqlite3")
        try:
            await apply_pending(template, ORG_DIR)
            plan = await make_plan(legacy, control, template)
        finally:
            await template.close()
        for p in [staging / "template.sqlite3", *_sidecars(staging / "template.sqlite3")]:
            p.unlink(missing_ok=True)
        report.ignored = plan.ignored
        log.info("not copied as rows: %s", "; ".join(f"{name} ({why})" for name, why in sorted(plan.ignored.items())))
        total = len(plan.organizations)
        log.info("converting the single-database layout in %s: %d organizations", data_dir, total)

        report.rows.update(await copy_control(legacy, control, plan))

        source = None
        meta = _read_vector_meta(data_dir / LEGACY_VECTORS)
        legacy_model = meta[0] if meta is not None else ""
        if meta is not None:
            source = await asyncio.to_thread(open_index, data_dir / LEGACY_VECTORS, model=meta[0],
                                             dimensions=meta[1])
            handles.append(source)
            guard.hold(data_dir / LEGACY_VECTORS)  # after the index's own open (it writes its meta there)
            if model is not None and (meta[0], meta[1]) != (model, dimensions):
                log.warning("the legacy vectors were made by %s (%d dims) and the service embeds with %s (%s dims): "
                            "they are copied as they are, and re-embedded when each organization is first opened",
                            meta[0], meta[1], model, dimensions)
        elif (data_dir / LEGACY_VECTORS).exists():
            log.warning("%s has no usable model record: its vectors are not copied (they stay in the backup; the "
                        "service re-embeds every chunk)", data_dir / LEGACY_VECTORS)
        else:
            log.info("no legacy vector index: the service re-embeds every chunk")

        routing = RoutingTable(control)
        for done, org_id in enumerate(plan.organizations, 1):
            directory = staging / "orgs" / org_id
            db = open_database(directory / ORG_DB)
            try:
                await apply_pending(db, ORG_DIR)
                counts = await copy_organization(legacy, db, plan, org_id)
            finally:
                await db.close()
            vectors = 0
            if source is not None:
                vectors = await _copy_vectors(source, open_index, directory / ORG_VECTORS, org_id, legacy_model)
            await control.batch([routing.insert(org_id, "sqlite", org_id)])
            for name, n in counts.items():
                report.rows[name] = report.rows.get(name, 0) + n
            report.vectors += vectors
            report.organizations.append(org_id)
            log.info("organizations converted: %d/%d (%s: %d rows, %d vectors)", done, total, org_id,
                     sum(counts.values()), vectors)
            after_organization(org_id, done, total)

        report.left_behind = await left_behind(legacy, plan, report.rows)
        for name, n in sorted(report.left_behind.items()):
            log.warning("%d rows of %s belong to no organization (leftovers of deleted organizations, or keyword "
                        "rows without their row): not carried over; they stay in %s%s", n, name, LEGACY_DB,
                        BACKUP_SUFFIX)
        if source is not None:
            report.vectors_left_behind = (await source.info()).vector_count - report.vectors
            if report.vectors_left_behind:
                log.warning("%d vectors are in no organization's namespace: not carried over; they stay in %s%s",
                            report.vectors_left_behind, LEGACY_VECTORS, BACKUP_SUFFIX)
    finally:
        guard.release()
        await close_all()

    # Into place: orgs/ first, the control database last (its arrival means "converted").
    _single_file(staging / CONTROL_DB)
    os.replace(staging / "orgs", data_dir / "orgs")
    _fsync_dir(data_dir)
    for side in _sidecars(data_dir / CONTROL_DB):
        side.unlink(missing_ok=True)  # the blank control file's, never to be paired with the converted one
    os.replace(staging / CONTROL_DB, data_dir / CONTROL_DB)
    _fsync_dir(data_dir)
    report.backups = _keep_backups(data_dir)
    shutil.rmtree(staging, ignore_errors=True)
    log.info("converted %d organizations (%d rows, %d vectors) into %s", len(report.organizations),
             sum(report.rows.values()), report.vectors, data_dir)
    return report


class _Lock:
    """An exclusive lock on ``<data dir>/.converting.lock`` (POSIX; elsewhere a no-op)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd: int | None = None

    def acquire(self) -> None:
        try:
            import fcntl
        except ImportError:  # pragma: no cover - not POSIX
            return
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing releases the lock
            self.fd = None


async def convert_on_start(settings: Any, control: SqlDatabase, embedder: Any = None, *,
                           open_database: OpenDatabase, open_index: OpenIndex) -> ConversionReport | None:
    """At start-up (``Memex.start``), before anything reads the control database: convert a single-database data
    directory (embedded backend) if there is one and it is not converted yet; finish an interrupted conversion's
    last renames. Returns the report when it converted, else None.

    ``control`` is the service's handle on ``settings.control_path`` (held by the key manager, the organization
    directory, the routing table...). The file it opened stays blank until the conversion puts the converted one
    in its place, so the handle is closed first and afterwards pointed at the new file (``_reopen``).
    """
    if getattr(settings, "sql", "sqlite") != "sqlite":
        return None  # a single-D1 deployment is converted by an operator (module docstring)
    data_dir = Path(settings.data_dir)
    legacy = data_dir / LEGACY_DB
    staging = data_dir / STAGING_NAME
    control_path = Path(settings.control_path)
    if not legacy.exists():
        if staging.exists() and not _blank(control_path):
            shutil.rmtree(staging, ignore_errors=True)  # a crash after the backup renames
        return None
    if not _blank(control_path):
        # converted; the legacy files are still there when a crash came after the control database landed
        lock = _Lock(data_dir / LOCK_NAME)
        try:
            await asyncio.to_thread(lock.acquire)
            if legacy.exists() and staging.exists():
                log.warning("finishing an interrupted conversion of %s", data_dir)
                _keep_backups(data_dir)
                shutil.rmtree(staging, ignore_errors=True)
            elif legacy.exists():
                log.warning("%s is ignored: %s already holds the converted layout (rename or remove the old file)",
                            legacy, control_path)
        finally:
            lock.release()
        return None
    path = getattr(control, "path", None)
    if path is None or Path(path).resolve() != control_path.resolve():
        raise ConversionError(f"{legacy} must be converted, but the control database handle is not the embedded "
                              f"database at {control_path}")
    await control.close()
    lock = _Lock(data_dir / LOCK_NAME)
    try:
        await asyncio.to_thread(lock.acquire)
        if not legacy.exists() or not _blank(control_path):
            return None  # another process converted it while this one waited: the handle is reopened below
        return await convert_data_dir(data_dir, open_database=open_database, open_index=open_index,
                                      model=getattr(embedder, "model_id", None),
                                      dimensions=getattr(embedder, "dimensions", None))
    finally:
        lock.release()
        _reopen(control, open_database(control_path))


def _reopen(handle: Any, fresh: Any) -> None:
    """Move a freshly opened handle's state into the service's closed one, so every holder of ``handle`` now
    reaches the converted file (the adapters have no reopen of their own)."""
    if type(fresh) is not type(handle):
        raise ConversionError(f"cannot reopen the control database: {type(handle).__name__} is not "
                              f"{type(fresh).__name__}")
    state = vars(handle)
    state.clear()
    state.update(vars(fresh))
