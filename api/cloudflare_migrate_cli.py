"""``memex cloudflare migrate``: move a REST-backed Cloudflare deployment (one D1 database per organization, or the
older single shared D1 database) into the data-plane Worker's stores (its D1 control binding and one SQLite Durable
Object per organization), resumably, proving the row counts of every table. Vectors stay where they are (the Worker
binds the same Vectorize index).

It reads the REST deployment from CLOUDFLARE_ACCOUNT_ID, CLOUDFLARE_API_TOKEN and CLOUDFLARE_D1_DATABASE_ID (its control
database, or the shared database), and writes to the Worker named by MEMEX_WORKER_URL and MEMEX_WORKER_SECRET. Stop
`memex serve` on the REST backend first; start it with MEMEX_BACKEND=worker afterwards.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

from api.cli_common import add_json, emit, settings_from, table

__all__ = ["add_command", "cmd_cloudflare_migrate"]


def _human(report: dict[str, Any]) -> str:
    rows = [{"organization": org, "rows": sum(c.values()), "tables": len(c)} for org, c in report["moved"].items()]
    lines = [f"source layout: {report['layout']}; control database: {report['control']}",
             table(rows, [("organization", "organization"), ("rows moved", "rows"), ("tables", "tables")],
                   empty="(no organization needed moving)")]
    if report["skipped"]:
        lines.append(f"already in the Worker: {len(report['skipped'])} organization(s)")
    lines.append("done: every table's row count matched on both sides. Start `memex serve` with MEMEX_BACKEND=worker.")
    return "\n".join(lines)


def cmd_cloudflare_migrate(args: argparse.Namespace) -> int:
    from api.composition.migrate import migrate_deployment
    from services.storage.convert_plan import ConversionError

    settings = settings_from(args)

    def say(org: str, what: str) -> None:
        if not args.json:
            print(f"{org}: {what}", file=sys.stderr, flush=True)

    try:
        report = asyncio.run(migrate_deployment(settings, only=args.org or None, progress=say))
    except ConversionError as exc:  # something would be lost: nothing of that organization was switched
        print(f"memex cloudflare migrate: {exc}", file=sys.stderr)
        return 1
    emit(report.as_json(), args, human=_human)
    return 0


def add_command(cf: Any) -> None:
    """``memex cloudflare migrate`` on the ``cloudflare`` subparsers."""
    m = cf.add_parser("migrate", help="move a REST-backed deployment (D1 per organization, or one shared D1) into the "
                                      "data-plane Worker's stores, resumably, proving the counts")
    m.add_argument("--org", action="append", metavar="ORG_ID", help="only this organization (repeatable)")
    add_json(m)
    m.set_defaults(fn=cmd_cloudflare_migrate)
