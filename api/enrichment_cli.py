"""``memex enrich backfill``: the two-pass enrichment backfill (second-brain-design §7.2), resumable, with a
progress bar. Hooked into ``api.cli.build_parser`` by ``add_commands(sub)``.

The checkpoint lives in the database (``enrichment_backfill``), so an interrupted run, a run stopped by the
daily LLM budget, or one started over REST (``POST /v1/admin/backfill/enrich``) continues where it was.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any, TextIO

from api.cli_common import add_data_dir, add_json, emit, json_quiet, progress, settings_from, with_memex
from tenancy.models import AuthContext

__all__ = ["add_commands", "cmd_enrich_backfill", "backfill_enrich_org"]


PHASES = {1: "pass 1 (vocabulary seed)", 2: "pass 2 (persisting)"}


async def backfill_enrich_org(enricher: Any, *, batch_size: int = 50, restart: bool = False, label: str = "",
                              stream: TextIO | None = None, show: bool | None = None) -> dict:
    """Run one organization's backfill (of its ``Enricher``) until it is done or stops (budget); returns totals.
    A progress bar on ``stream`` (stderr) with the pass in its postfix, drawn as ``api.cli_common.progress_shown``
    says (``show``: force it on or off)."""

    shown: list[str] = []

    def step(bar: Any, n: int, phase: int) -> None:
        what = PHASES.get(phase, "done")
        bar.update(n)
        bar.set_postfix_str(what, refresh=what not in shown)  # a new pass is drawn at once
        shown.append(what)

    from services.enrichment.backfill import Backfill  # the services load with the command, not with the parser

    backfill = Backfill(enricher)
    if restart:
        first = await backfill.run(batch_size=batch_size, restart=True)
        bar = progress(first.processed + await backfill.left(), label or "enrich", "thoughts", stream=stream, show=show)
        step(bar, first.processed, first.phase)
    else:
        first = None
        bar = progress(await backfill.left(), label or "enrich", "thoughts", stream=stream, show=show)
    totals: dict[str, Any] = {"processed": 0, "enriched": 0, "failed": 0, "cursor": None, "done": False, "stopped": None}
    try:
        res = first
        while True:
            if res is None:
                res = await backfill.run(batch_size=batch_size)
                step(bar, res.processed, res.phase)
            for k in ("processed", "enriched", "failed"):
                totals[k] += getattr(res, k)
            totals.update(cursor=res.cursor, done=res.done, stopped=res.stopped, seed_tags=res.seed_tags)
            if res.done or res.stopped:  # every other call made progress
                return totals
            res = None
    finally:
        bar.close()


def cmd_enrich_backfill(args: argparse.Namespace) -> int:
    async def run(memex):
        orgs = [await memex.orgs.by_slug(args.org)] if args.org else await memex.orgs.all()
        report = {}
        for org in orgs:
            ctx = AuthContext(org_id=org.id, org_slug=org.slug, principal="cli", scopes=frozenset({"admin"}))
            enricher = (await memex.for_org(ctx)).enrichment
            try:
                report[org.slug] = await backfill_enrich_org(enricher, batch_size=args.batch_size,
                                                             restart=args.restart, label=org.slug,
                                                             show=json_quiet(args))
            except (KeyboardInterrupt, asyncio.CancelledError):
                print(f"\ninterrupted: run again to resume {org.slug} from its checkpoint", file=sys.stderr)
                raise
            if report[org.slug].get("stopped") == "budget":
                print(f"{org.slug}: the daily LLM budget is spent; run again tomorrow to resume", file=sys.stderr)
        return report

    emit(asyncio.run(with_memex(settings_from(args), run)), args)
    return 0


def add_commands(sub) -> None:
    """Add ``enrich backfill`` to the ``memex`` parser (``sub``: its subparsers)."""
    enrich = sub.add_parser("enrich", help="summaries, tags and importance").add_subparsers(
        dest="enrich_command", required=True)
    bf = enrich.add_parser("backfill", help="enrich thoughts that have no summary/tags: two passes, resumable")
    bf.add_argument("--org", default=None, help="organization slug (default: every organization)")
    bf.add_argument("--batch-size", type=int, default=50, help="thoughts per batch (1-1000)")
    bf.add_argument("--restart", action="store_true", help="drop the checkpoint and start again at pass 1")
    add_json(bf)
    add_data_dir(bf)
    bf.set_defaults(fn=cmd_enrich_backfill)
