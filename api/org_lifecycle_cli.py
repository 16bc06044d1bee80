"""``memex org export | import | delete``: the whole organization's lifecycle from the shell, with progress bars
on stderr. They work on the stores directly (like every other command), through the same code as the REST
routes (api.org_lifecycle, services.bundle).

Hooked into ``api.cli.build_parser`` by ``add_commands(org_subparsers)``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import BinaryIO

import msgspec

from api.cli_common import ProgressBar, add_data_dir, settings_from, with_memex

__all__ = ["add_commands", "cmd_org_export", "cmd_org_import", "cmd_org_delete", "RecordBar"]

READ_CHUNK = 1024 * 1024


class RecordBar(ProgressBar):
    """The progress bar, counting bundle records."""

    def _draw(self, end: str) -> None:
        frac = 1.0 if self.total == 0 else min(1.0, self.done / self.total)
        filled = int(frac * self.width)
        rate = self.done / max(1e-9, time.monotonic() - self.started)
        line = (f"{self.label} [{'#' * filled}{'.' * (self.width - filled)}] {self.done}/{self.total} "
                f"({frac:4.0%}) {rate:,.0f} records/s")
        self.stream.write(("\r" if self.tty else "") + line + end)
        self.stream.flush()


def _report(obj) -> None:
    print(json.dumps(obj, indent=2), file=sys.stderr)


def cmd_org_export(args: argparse.Namespace) -> int:
    """Write the organization's bundle to ``-o FILE`` (written as FILE.partial, renamed when complete) or stdout."""
    from api.org_lifecycle import bundle_export  # the REST side (litestar): only loaded when exporting

    async def run(memex):
        org = await memex.orgs.by_slug(args.org)
        bar: list[RecordBar] = []
        export = await bundle_export(memex, org.id, progress=lambda n: bar and bar[0].update(n))
        bar.append(RecordBar(sum(msgspec.structs.asdict(export.header.counts).values()), f"export {org.slug}"))
        to_file = args.output not in (None, "-")
        partial = Path(f"{args.output}.partial") if to_file else None
        out: BinaryIO = partial.open("wb") if partial else sys.stdout.buffer
        try:
            async for chunk in export.lines():
                out.write(chunk)
            out.flush()
            if partial:
                os.fsync(out.fileno())
                out.close()
                partial.replace(args.output)
        except BaseException:
            if partial:
                out.close()
                partial.unlink(missing_ok=True)
            raise
        finally:
            bar[0].close()
        return {"organization": org.slug, "output": args.output if to_file else "-", "counts": export.counts}

    _report(asyncio.run(with_memex(settings_from(args), run)))
    return 0


async def _chunks(stream: BinaryIO) -> AsyncIterator[bytes]:
    while chunk := await asyncio.to_thread(stream.read, READ_CHUNK):
        yield chunk


def cmd_org_import(args: argparse.Namespace) -> int:
    """Restore a bundle (FILE, or - for stdin) into an empty organization; its chunks are queued for embedding
    (the service's worker embeds them; a work hint tells a running one)."""
    from api.org_lifecycle import bundle_import  # the REST side (litestar): only loaded when importing

    async def run(memex):
        org = await memex.orgs.by_slug(args.org)
        bar: list[RecordBar] = []

        def on_header(header) -> None:
            counts = msgspec.structs.asdict(header.counts)
            bar.append(RecordBar(sum(counts.values()), f"import {org.slug}"))

        importer = await bundle_import(memex, org.id, on_header=on_header,
                                       progress=lambda n: bar and bar[0].update(n))
        stream = sys.stdin.buffer if args.file == "-" else open(args.file, "rb")
        try:
            result = await importer.run(_chunks(stream))
        finally:
            if bar:
                bar[0].close()
            if stream is not sys.stdin.buffer:
                stream.close()
        memex.wake(org.id)
        return {"organization": org.slug, **msgspec.to_builtins(result)}

    _report(asyncio.run(with_memex(settings_from(args), run)))
    return 0


def cmd_org_delete(args: argparse.Namespace) -> int:
    """Delete an organization for good (``--confirm`` must repeat its slug)."""
    if args.confirm != args.org:
        print("error: --confirm must repeat the organization's slug; nothing was deleted", file=sys.stderr)
        return 2

    async def run(memex):
        org = await memex.orgs.by_slug(args.org)
        print(f"deleting {org.slug} ({org.id}): database, vectors, keys, bindings ...", end="", file=sys.stderr,
              flush=True)
        await memex.delete_org(org.id)
        print(" done", file=sys.stderr)
        return {"deleted": org.slug, "id": org.id}

    print(json.dumps(asyncio.run(with_memex(settings_from(args), run)), indent=2))
    return 0


def add_commands(org) -> None:
    """Add ``export``, ``import`` and ``delete`` to the ``memex org`` subparsers (``org``)."""
    ex = org.add_parser("export", help="write an organization's bundle (JSON Lines; docs/export-bundle.md)")
    ex.add_argument("--org", required=True, help="organization slug")
    ex.add_argument("-o", "--output", default=None, help="file to write (default: stdout)")
    add_data_dir(ex)
    ex.set_defaults(fn=cmd_org_export)
    im = org.add_parser("import", help="restore a bundle into an empty organization")
    im.add_argument("--org", required=True, help="organization slug (it must have no thoughts or conversations)")
    im.add_argument("file", help="the bundle (- for stdin)")
    add_data_dir(im)
    im.set_defaults(fn=cmd_org_import)
    de = org.add_parser("delete", help="delete an organization for good: its data, vectors, keys and bindings")
    de.add_argument("--org", required=True, help="organization slug")
    de.add_argument("--confirm", required=True, help="the slug again")
    add_data_dir(de)
    de.set_defaults(fn=cmd_org_delete)
