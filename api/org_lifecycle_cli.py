"""``memex org export | import | delete``: the whole organization's lifecycle from the shell, with progress bars
on stderr. They work on the stores directly (like every other command), through the same code as the REST
routes (api.org_lifecycle, services.bundle).

Hooked into ``api.cli.build_parser`` by ``add_commands(org_subparsers)``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import BinaryIO

import msgspec

from api.cli_common import add_data_dir, add_json, emit, json_quiet, progress, settings_from, with_memex

__all__ = ["add_commands", "cmd_org_export", "cmd_org_import", "cmd_org_delete"]

READ_CHUNK = 1024 * 1024


def _bar(total: int, label: str, args: argparse.Namespace):
    return progress(total, label, "records", show=json_quiet(args))


def cmd_org_export(args: argparse.Namespace) -> int:
    """Write the organization's bundle to ``-o FILE`` (written as FILE.partial, renamed when complete) or stdout
    (the bundle's JSON Lines; the summary then goes to stderr, else to stdout)."""
    from api.org_lifecycle import bundle_export  # the REST side (litestar): only loaded when exporting

    async def run(memex):
        org = await memex.orgs.by_slug(args.org)
        bar: list = []
        export = await bundle_export(memex, org.id, progress=lambda n: bar and bar[0].update(n))
        bar.append(_bar(sum(msgspec.structs.asdict(export.header.counts).values()), f"export {org.slug}", args))
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

    summary = asyncio.run(with_memex(settings_from(args), run))
    emit(summary, args, stream=sys.stderr if summary["output"] == "-" else sys.stdout)
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
        bar: list = []

        def on_header(header) -> None:
            counts = msgspec.structs.asdict(header.counts)
            bar.append(_bar(sum(counts.values()), f"import {org.slug}", args))

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

    emit(asyncio.run(with_memex(settings_from(args), run)), args)
    return 0


def cmd_org_delete(args: argparse.Namespace) -> int:
    """Delete an organization for good (``--confirm`` must repeat its slug)."""
    if args.confirm != args.org:
        print("error: --confirm must repeat the organization's slug; nothing was deleted", file=sys.stderr)
        return 2

    async def run(memex):
        org = await memex.orgs.by_slug(args.org)
        if not args.json:
            print(f"deleting {org.slug} ({org.id}): database, vectors, keys, bindings ...", end="", file=sys.stderr,
                  flush=True)
        await memex.delete_org(org.id)
        if not args.json:
            print(" done", file=sys.stderr)
        return {"deleted": org.slug, "id": org.id}

    emit(asyncio.run(with_memex(settings_from(args), run)), args)
    return 0


def add_commands(org) -> None:
    """Add ``export``, ``import`` and ``delete`` to the ``memex org`` subparsers (``org``)."""
    ex = org.add_parser("export", help="write an organization's bundle (JSON Lines; docs/export-bundle.md)")
    ex.add_argument("--org", required=True, help="organization slug")
    ex.add_argument("-o", "--output", default=None, help="file to write (default: stdout)")
    add_json(ex)
    add_data_dir(ex)
    ex.set_defaults(fn=cmd_org_export)
    im = org.add_parser("import", help="restore a bundle into an empty organization")
    im.add_argument("--org", required=True, help="organization slug (it must have no thoughts or conversations)")
    im.add_argument("file", help="the bundle (- for stdin)")
    add_json(im)
    add_data_dir(im)
    im.set_defaults(fn=cmd_org_import)
    de = org.add_parser("delete", help="delete an organization for good: its data, vectors, keys and bindings")
    de.add_argument("--org", required=True, help="organization slug")
    de.add_argument("--confirm", required=True, help="the slug again")
    add_json(de)
    add_data_dir(de)
    de.set_defaults(fn=cmd_org_delete)
