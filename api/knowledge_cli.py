"""``memex kb create | sync | import | list | status``: an organization's knowledge bases from the shell, on the data
directory like every other command, through the same services as the REST routes (api.knowledge).

``sync`` and ``import`` queue a sync, then (unless ``--no-wait``) run the job worker in this process until the sync
has finished and every chunk is embedded, with progress bars on stderr (files, then chunks), and print the sync's
result (one JSON document with ``--json``): exit code 0 when the sync succeeded (per-file errors included), 1 when it
failed. A service
running on the same data directory may pick the jobs up instead (the command leaves it a work hint): the command
then just watches the sync's row. Errors (an unknown organization or knowledge base, an invalid source) print one
line on stderr and exit 2 (``api.cli.main``).

Hooked into ``api.cli.build_parser`` by ``add_commands(sub)``.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import os
import sys
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO
from urllib.parse import unquote, urlsplit

from api.cli_common import add_data_dir, add_json, emit, json_quiet, progress, settings_from, table, with_memex

__all__ = ["add_commands", "cmd_kb_create", "cmd_kb_sync", "cmd_kb_import", "cmd_kb_list", "cmd_kb_status",
           "pack_directory", "SyncWatch"]

#: Seconds between two looks at the sync's row (and between two claims when the worker found nothing).
POLL_SECONDS = 0.25
#: Seconds the embedding may sit with chunks pending and no embedding job queued before the command stops waiting.
STALL_SECONDS = 5.0


def _refuse(message: str, **details: Any) -> Exception:
    from services.errors import InvalidInput

    return InvalidInput(message, details=details or None)


# -- the organization and its knowledge bases -------------------------------------------------------------


async def _knowledge(memex: Any, slug: str, policy: Any = None) -> Any:
    """The organization's ``Knowledge`` (``policy``: the sources it may name; the deployment's by default)."""
    org = await memex.orgs.by_slug(slug)
    store = await memex.stores.open(org.id)
    return memex.knowledge(org.id, store.sql, store.vectors, policy=policy)


def _builtins(struct: Any) -> Any:
    import msgspec

    return msgspec.to_builtins(struct)


def _is_local(url: str) -> bool:
    """A local folder: a ``file:`` URL, a path (absolute, ``./``, ``~``), or a folder that exists here."""
    return url.lower().startswith("file:") or url.startswith(("/", ".", "~")) or ("://" not in url and os.path.isdir(url))


def _local_source(url: str) -> tuple[str, Any]:
    """A local folder (absolute, or relative to the working directory) and the policy that admits it: the operator
    runs this command, so any folder they name is allowed, whatever MEMEX_KB_LOCAL_ROOTS says."""
    from services.knowledge.bases import SourcePolicy

    path = unquote(urlsplit(url).path) if url.lower().startswith("file:") else url
    real = os.path.realpath(os.path.abspath(os.path.expanduser(path)))
    if not os.path.isdir(real):
        raise _refuse(f"--git {url}: no such folder", field="source.url")
    return real, SourcePolicy(local_roots=(real,), allow_http=True)


def _source(args: argparse.Namespace) -> tuple[dict[str, Any], Any]:
    """The source of ``kb create`` (as the REST body names it) and the policy to check it with."""
    globs = {k: v for k, v in (("include", args.include), ("exclude", args.exclude)) if v is not None}
    if args.upload:
        if args.branch is not None or args.token_env is not None:
            raise _refuse("--branch and --token-env are for a --git source", field="source")
        return {"type": "upload", **globs}, None
    from services.knowledge.bases import SourcePolicy

    url, policy = args.git, SourcePolicy(allow_http=True)
    if _is_local(url):
        url, policy = _local_source(url)
    source: dict[str, Any] = {"type": "git", "url": url, "branch": args.branch or "main", **globs}
    if args.token_env is not None:
        token = os.environ.get(args.token_env)
        if not token:
            raise _refuse(f"--token-env {args.token_env}: that environment variable is not set or empty",
                          field="source.token")
        source["token"] = token
    return source, policy


def cmd_kb_create(args: argparse.Namespace) -> int:
    """Create a knowledge base; print it with its webhook secret (shown once). A git source's first sync is queued
    (``--no-sync``: not), for ``memex kb sync`` or a running service to run."""
    from services.knowledge.models import KnowledgeBaseCreated

    source, policy = _source(args)

    async def run(memex):
        import msgspec

        ks = await _knowledge(memex, args.org, policy)
        row, secret, sync_id = await ks.bases.create(
            slug=args.slug, name=args.name, visibility=args.visibility, document_tier=args.document_tier,
            source=source, ontology=None, sync=not args.no_sync)
        view = await ks.bases.view(row)
        sync = await ks.bases.sync(row, sync_id, detail=False) if sync_id else None
        return _builtins(KnowledgeBaseCreated(**msgspec.structs.asdict(view), webhook_secret=secret, sync=sync))

    created = asyncio.run(with_memex(settings_from(args), run))
    emit(created, args)
    print("Store the webhook secret now: it is not shown again.", file=sys.stderr)
    return 0


# -- waiting for a sync ------------------------------------------------------------------------------------


@dataclass
class SyncWatch:
    """Runs the job worker in this process while it watches one sync: its files, then its knowledge base's
    chunks until every one is embedded.
    Progress bars on ``stream`` (drawn as ``api.cli_common.progress_shown`` says; ``show`` forces them on or off)."""

    memex: Any
    knowledge: Any
    row: dict[str, Any]
    sync_id: str
    stream: TextIO = field(default_factory=lambda: sys.stderr)
    show: bool | None = None
    _stop: bool = False

    async def run(self) -> tuple[Any, Any]:
        """(the finished sync with its detail, the knowledge base's view)."""
        worker = asyncio.create_task(self._drive())
        try:
            sync = await self._files()
            view = await self._chunks() if sync.state == "succeeded" else await self.knowledge.bases.view(self.row)
        finally:
            self._stop = True
            await worker  # lets the job in hand finish: no lease is left behind
        return await self.knowledge.bases.sync(self.row, self.sync_id), view

    async def _drive(self) -> None:
        """The job worker, one round at a time; between empty rounds it looks again (retries fall due, a job
        queued by another process)."""
        memex, org_id = self.memex, self.knowledge.sql.org_id
        while not self._stop:
            memex.worker.wake(org_id)
            ran = await memex.worker.run_once()
            if memex.backend.async_index:
                await memex.worker.confirm_mutations()
            if not ran:
                await asyncio.sleep(POLL_SECONDS)

    async def _files(self) -> Any:
        from services.ids import now_ms

        bar: Any = None
        try:
            while True:
                sync = await self.knowledge.bases.sync(self.row, self.sync_id, detail=False)
                if sync.files_total is not None:
                    if bar is None:
                        bar = progress(sync.files_total, f"sync {self.row['slug']}", "files", stream=self.stream,
                                       show=self.show)
                        if sync.started_at and not bar.disable:  # begun before the bar (a service ran it)
                            bar.start_t -= max(0.0, (now_ms() - sync.started_at) / 1000)
                    bar.total = sync.files_total
                    bar.update(sync.files_done - bar.n)
                if sync.state in ("succeeded", "failed"):
                    return sync
                await asyncio.sleep(POLL_SECONDS)
        finally:
            if bar is not None:
                bar.close()

    async def _chunks(self) -> Any:
        view = await self.knowledge.bases.view(self.row)
        bar = progress(view.chunks, f"embed {self.row['slug']}", "chunks", stream=self.stream, show=self.show,
                       initial=view.chunks_searchable)
        stalled_since: float | None = None
        try:
            while view.chunks_searchable < view.chunks:
                await asyncio.sleep(POLL_SECONDS)
                view = await self.knowledge.bases.view(self.row)
                bar.total = view.chunks
                bar.update(view.chunks_searchable - bar.n)
                if await self._embedding_queued():
                    stalled_since = None
                elif stalled_since is None:
                    stalled_since = time.monotonic()
                elif time.monotonic() - stalled_since > STALL_SECONDS:
                    print(f"warning: {view.chunks - view.chunks_searchable} chunks are not embedded and no embedding "
                          "job is queued (see the jobs table's last_error)", file=self.stream)
                    break
        finally:
            bar.close()
        return view

    async def _embedding_queued(self) -> bool:
        from services.search.indexing import KB_EMBED_JOB

        row = await self.knowledge.sql.one(
            "SELECT COUNT(*) AS n FROM jobs WHERE organization_id = ?1 AND kind = ?2 AND target_id = ?3 "
            "AND state = 'pending'", [KB_EMBED_JOB, self.row["id"]])
        return bool(row and row["n"])


def _result(sync: Any, view: Any) -> dict[str, Any]:
    return {**_builtins(sync), "knowledge_base": {"id": view.id, "slug": view.slug, "entries": view.entries,
                                                  "chunks": view.chunks, "chunks_searchable": view.chunks_searchable}}


async def _queued_or_waited(memex: Any, ks: Any, row: dict[str, Any], sync_id: str, wait: bool,
                            show: bool | None = None) -> tuple[dict, int]:
    if not wait:
        print("queued: a service running on this data directory runs it (memex kb status to follow it)",
              file=sys.stderr)
        return _builtins(await ks.bases.sync(row, sync_id, detail=False)), 0
    sync, view = await SyncWatch(memex, ks, row, sync_id, show=show).run()
    return _result(sync, view), 0 if sync.state == "succeeded" else 1


def cmd_kb_sync(args: argparse.Namespace) -> int:
    """Queue a sync from the git source, run it here (unless ``--no-wait``), print its result."""

    async def run(memex):
        ks = await _knowledge(memex, args.org)
        row = await ks.bases.row(args.kb)
        sync_id, _ = await ks.bases.request_sync(row, "cli", full=args.full)
        return await _queued_or_waited(memex, ks, row, sync_id, not args.no_wait, json_quiet(args))

    out, code = asyncio.run(with_memex(settings_from(args), run))
    emit(out, args)
    return code


# -- importing a folder or an archive -----------------------------------------------------------------------


def pack_directory(folder: Path) -> tuple[bytes, int]:
    """A .tar.gz (in memory) of the folder's regular files, dot-folders and dot-files left out, every member under
    the folder's own name (which the import strips, like GitHub's ``repo-main/``); and how many files it holds."""
    buffer = io.BytesIO()
    count = 0
    top = folder.resolve().name or "vault"
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for dirpath, dirnames, filenames in os.walk(folder):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            for name in sorted(filenames):
                path = Path(dirpath) / name
                if name.startswith(".") or path.is_symlink() or not path.is_file():
                    continue
                rel = path.relative_to(folder).as_posix()
                tar.add(str(path), arcname=f"{top}/{rel}", recursive=False)
                count += 1
    return buffer.getvalue(), count


def _archive_bytes(target: Path) -> bytes:
    """The folder packed, or the archive file's bytes (one larger than the import takes is refused unread)."""
    from services.knowledge.archive import MAX_ARCHIVE_BYTES

    if target.is_dir():
        data, count = pack_directory(target)
        print(f"packed {count} files of {target} ({len(data):,} bytes, .tar.gz)", file=sys.stderr)
        return data
    if not target.is_file():
        raise _refuse(f"{target}: no such folder or archive", field="archive")
    if target.stat().st_size > MAX_ARCHIVE_BYTES:
        raise _refuse(f"{target} is larger than {MAX_ARCHIVE_BYTES // (1024 * 1024)} MiB", field="archive")
    return target.read_bytes()


def cmd_kb_import(args: argparse.Namespace) -> int:
    """Send a folder (packed here) or a .zip / .tar.gz to an upload knowledge base, run the sync, print its result."""
    target = Path(args.source)

    async def run(memex):
        ks = await _knowledge(memex, args.org)
        row = await ks.bases.row(args.kb)
        data = await asyncio.to_thread(_archive_bytes, target)
        sync_id = await ks.bases.import_archive(row, data)  # the REST import's checks and filter
        return await _queued_or_waited(memex, ks, row, sync_id, not args.no_wait, json_quiet(args))

    out, code = asyncio.run(with_memex(settings_from(args), run))
    emit(out, args)
    return code


# -- reading -------------------------------------------------------------------------------------------------


def cmd_kb_list(args: argparse.Namespace) -> int:
    async def run(memex):
        ks = await _knowledge(memex, args.org)
        return [_builtins(kb) for kb in await ks.bases.list()]

    emit(asyncio.run(with_memex(settings_from(args), run)), args, human=_kb_table)
    return 0


def cmd_kb_status(args: argparse.Namespace) -> int:
    """One knowledge base, and its last sync (or ``--sync ID``) with every per-file error, skip and warning."""

    async def run(memex):
        ks = await _knowledge(memex, args.org)
        row = await ks.bases.row(args.kb)
        view = await ks.bases.view(row)
        sync_id = args.sync or (view.last_sync.id if view.last_sync else None)
        sync = await ks.bases.sync(row, sync_id) if sync_id else None
        out = _builtins(view)
        out["last_sync"] = _builtins(sync) if sync is not None else None
        return out

    emit(asyncio.run(with_memex(settings_from(args), run)), args)
    return 0


def _kb_table(rows: list[dict[str, Any]]) -> str:
    flat = [{**r, "source": (r.get("source") or {}).get("url") or (r.get("source") or {}).get("type"),
             "last_sync": (r.get("last_sync") or {}).get("state")} for r in rows]
    return table(flat, [("SLUG", "slug"), ("NAME", "name"), ("VISIBILITY", "visibility"), ("SOURCE", "source"),
                        ("ENTRIES", "entries"), ("CHUNKS", "chunks"), ("SEARCHABLE", "chunks_searchable"),
                        ("LAST SYNC", "last_sync")])


# -- the parser ------------------------------------------------------------------------------------------------


def _add_create(kb) -> None:
    from services.knowledge.bases import TIERS, VISIBILITIES

    cr = kb.add_parser("create", help="create a knowledge base (a git repository or an upload target)")
    cr.add_argument("--org", required=True, help="organization slug")
    cr.add_argument("--slug", required=True, help="the knowledge base's slug")
    where = cr.add_mutually_exclusive_group(required=True)
    where.add_argument("--git", metavar="URL_OR_PATH", help="an https:// repository, or a local folder (any folder: "
                       "MEMEX_KB_LOCAL_ROOTS limits what tenants name, not the operator)")
    where.add_argument("--upload", action="store_true", help="filled by `memex kb import` (or the REST import)")
    cr.add_argument("--branch", default=None, help="the branch to sync (default main)")
    cr.add_argument("--token-env", metavar="VAR", default=None,
                    help="the environment variable holding the token of a private repository (never on the command line)")
    cr.add_argument("--name", default=None)
    cr.add_argument("--visibility", choices=VISIBILITIES, default="private")
    cr.add_argument("--document-tier", choices=TIERS, default="members")
    cr.add_argument("--include", nargs="+", action="extend", metavar="GLOB", default=None, help="files read (default **/*.md)")
    cr.add_argument("--exclude", nargs="+", action="extend", metavar="GLOB", default=None,
                    help="files left out (default drafts/** and dot-folders)")
    cr.add_argument("--no-sync", action="store_true", help="do not queue the first sync of a git source")
    add_json(cr)
    add_data_dir(cr)
    cr.set_defaults(fn=cmd_kb_create)


def add_commands(sub) -> None:
    """Add ``kb create | sync | import | list | status`` to the ``memex`` parser (``sub``: its subparsers)."""
    kb = sub.add_parser("kb", help="knowledge bases (git-synced or uploaded markdown vaults)").add_subparsers(
        dest="kb_command", required=True)
    _add_create(kb)
    sy = kb.add_parser("sync", help="sync from the git source here, with progress; print the result")
    sy.add_argument("--org", required=True, help="organization slug")
    sy.add_argument("kb", help="the knowledge base's slug or id")
    sy.add_argument("--full", action="store_true", help="compare every file, not only what git says changed")
    sy.add_argument("--no-wait", action="store_true", help="only queue it (a running service syncs it)")
    add_json(sy)
    add_data_dir(sy)
    sy.set_defaults(fn=cmd_kb_sync)
    im = kb.add_parser("import", help="send a folder or a .zip / .tar.gz to an upload knowledge base and sync it")
    im.add_argument("--org", required=True, help="organization slug")
    im.add_argument("kb", help="the knowledge base's slug or id")
    im.add_argument("source", metavar="DIR_OR_ARCHIVE")
    im.add_argument("--no-wait", action="store_true", help="only queue the sync (a running service applies it)")
    add_json(im)
    add_data_dir(im)
    im.set_defaults(fn=cmd_kb_import)
    ls = kb.add_parser("list", help="the organization's knowledge bases")
    ls.add_argument("--org", required=True, help="organization slug")
    add_json(ls)
    add_data_dir(ls)
    ls.set_defaults(fn=cmd_kb_list)
    st = kb.add_parser("status", help="one knowledge base and its last sync's detail")
    st.add_argument("--org", required=True, help="organization slug")
    st.add_argument("kb", help="the knowledge base's slug or id")
    st.add_argument("--sync", default=None, metavar="ID", help="this sync instead of the last one")
    add_json(st)
    add_data_dir(st)
    st.set_defaults(fn=cmd_kb_status)
