"""``memex conversations backfill-compress``: compress legacy messages in resumable batches, with a progress bar.

Hooked into ``api.cli.build_parser`` by ``add_commands(sub)``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import TextIO

from api.cli_common import add_data_dir, add_json, emit, json_quiet, progress, settings_from, with_memex
from tenancy.models import AuthContext

__all__ = ["add_commands", "cmd_backfill_compress", "backfill_org"]


async def backfill_org(conversations, *, batch_size: int = 500, cursor: str | None = None, label: str = "",
                       stream: TextIO | None = None, show: bool | None = None) -> dict:
    """Run the backfill of one organization to the end; returns totals (and the last cursor). A progress bar on
    ``stream`` (stderr), drawn as ``api.cli_common.progress_shown`` says (``show``: force it on or off)."""
    bar = progress(await conversations.uncompressed_count(), label or "backfill", "msg", stream=stream, show=show)
    totals = {"processed": 0, "compressed": 0, "raw": 0, "bytes_before": 0, "bytes_after": 0, "cursor": cursor}
    try:
        while True:
            res = await conversations.backfill_compress(batch_size=batch_size, cursor=totals["cursor"])
            for k in ("processed", "compressed", "raw", "bytes_before", "bytes_after"):
                totals[k] += getattr(res, k)
            totals["cursor"] = res.next_cursor
            bar.update(res.processed)
            if res.done:
                return totals
    finally:
        bar.close()


def cmd_backfill_compress(args: argparse.Namespace) -> int:
    async def run(memex):
        orgs = [await memex.orgs.by_slug(args.org)] if args.org else await memex.orgs.all()
        report = {}
        for org in orgs:
            ctx = AuthContext(org_id=org.id, org_slug=org.slug, principal="cli", scopes=frozenset({"admin"}))
            conversations = (await memex.for_org(ctx)).conversations
            try:
                report[org.slug] = await backfill_org(conversations, batch_size=args.batch_size,
                                                      cursor=args.cursor if args.org else None, label=org.slug,
                                                      show=json_quiet(args))
            except (KeyboardInterrupt, asyncio.CancelledError):
                print(f"\ninterrupted: resume with --org {org.slug} (rows already compressed stay compressed)",
                      file=sys.stderr)
                raise
        return report

    emit(asyncio.run(with_memex(settings_from(args), run)), args)
    return 0


def add_commands(sub) -> None:
    """Add ``conversations backfill-compress`` to the ``memex`` parser (``sub``: its subparsers)."""
    conv = sub.add_parser("conversations", help="conversations").add_subparsers(dest="conversations_command", required=True)
    bf = conv.add_parser("backfill-compress", help="compress legacy (uncompressed) messages in batches; resumable")
    bf.add_argument("--org", default=None, help="organization slug (default: every organization)")
    bf.add_argument("--batch-size", type=int, default=500, help="messages per batch (1-1000)")
    bf.add_argument("--cursor", default=None, help="start after this message id (with --org)")
    add_json(bf)
    add_data_dir(bf)
    bf.set_defaults(fn=cmd_backfill_compress)
