"""``memex import FILE --org SLUG``: a JSON Lines file of thoughts and conversations, streamed into an organization.

Each line is one JSON object:

* a thought: the body of ``POST /v1/thoughts`` (``{"content", "source"?, "metadata"?}``; ``"type": "thought"``
  optional);
* a conversation: ``{"type": "conversation", "title"?, "metadata"?, "created_at"?, "session"?, "messages": [...]}``
  with the messages of ``POST /v1/conversations/{id}/messages`` (appended 100 at a time).

Thoughts go in batches of ``--batch`` (services.thoughts.Thoughts.capture_many: idempotent per thought, so running
an import again stores nothing twice); a line that is not valid is reported with its number and skipped. The file is
read as it streams (any size). Then, unless ``--no-wait``, the job worker runs in this process until everything is
embedded (a serving process on the same data directory may do it instead: it is told through a work hint). Progress
bars on stderr (tqdm, on a terminal); a summary on stdout (one JSON document with ``--json``); exit status 0, or 1
when some line was refused.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import msgspec

from api.cli_common import add_data_dir, add_json, emit, json_quiet, progress, settings_from, with_memex

__all__ = ["add_commands", "cmd_import"]

#: Most refused lines listed in the summary (all are counted).
SHOWN_ERRORS = 50


async def _import(memex: Any, slug: str, path: Path, batch: int, wait: bool,
                  show: bool | None = None) -> tuple[dict[str, Any], int]:
    from tenancy.models import AuthContext

    org = await memex.orgs.by_slug(slug)
    services = await memex.for_org(AuthContext(org.id, org.slug, "cli:import", frozenset({"admin"})))
    summary: dict[str, Any] = {"organization": org.slug, "lines": 0, "thoughts": {"created": 0, "existing": 0, "refused": 0},
                               "conversations": 0, "messages": 0, "errors": []}
    refused = 0
    pending: list[tuple[int, dict[str, Any]]] = []

    def error(line: int, message: str) -> None:
        nonlocal refused
        refused += 1
        if len(summary["errors"]) < SHOWN_ERRORS:
            summary["errors"].append({"line": line, "error": message[:300]})

    async def flush() -> None:
        if not pending:
            return
        result = await services.thoughts.capture_many([item for _, item in pending])
        for (line, _), item in zip(pending, result.results, strict=True):
            if item.status == 201:
                summary["thoughts"]["created"] += 1
            elif item.status == 200:
                summary["thoughts"]["existing"] += 1
            else:
                summary["thoughts"]["refused"] += 1
                error(line, f"{item.error.code}: {item.error.message}")
        pending.clear()

    bar = progress(path.stat().st_size, f"import {org.slug}", "B", show=show, scale=True)
    read = 0
    with path.open("rb") as stream:
        for line, raw in enumerate(stream, start=1):
            read += len(raw)
            if line % 200 == 0:
                bar.update(read)
                read = 0
            summary["lines"] = line
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
                if not isinstance(record, dict):
                    raise ValueError("a line must be a JSON object")
            except ValueError as exc:
                error(line, f"not a JSON object: {exc}")
                continue
            kind = record.pop("type", "thought")
            if kind == "thought":
                pending.append((line, record))
                if len(pending) >= batch:
                    await flush()
            elif kind == "conversation":
                await flush()  # keep the file's order
                try:
                    summary["messages"] += await _conversation(services, record)
                    summary["conversations"] += 1
                except Exception as exc:  # a refused conversation (its own 4xx) is reported, the import goes on
                    error(line, f"{getattr(exc, 'code', type(exc).__name__)}: {getattr(exc, 'message', str(exc))}")
            else:
                error(line, f"unknown type {str(kind)[:40]!r}: thought or conversation")
        await flush()
    bar.update(read)
    bar.close()
    if wait:
        summary["indexing"] = await _wait_indexed(memex, org.id, show)
    return summary, (1 if refused else 0)


async def _conversation(services: Any, record: dict[str, Any]) -> int:
    from services.conversations.models import MessageIn
    from services.errors import InvalidInput

    messages = record.get("messages") or []
    if not isinstance(messages, list):
        raise InvalidInput("messages must be a list")
    converted = msgspec.convert(messages, list[MessageIn])
    conversation = await services.conversations.create(title=record.get("title"), metadata=record.get("metadata"))
    for start in range(0, len(converted), 100):
        await services.conversations.append(conversation.id, converted[start:start + 100],
                                            created_at=record.get("created_at"), session=record.get("session"))
    return len(converted)


async def _wait_indexed(memex: Any, org_id: str, show: bool | None = None) -> dict[str, Any]:
    """Run the worker here until the organization has no job left; a bar counts its jobs done."""
    sql = await memex.org_sql(org_id)

    async def left() -> int:
        row = await sql.one("SELECT COUNT(*) AS n FROM jobs WHERE organization_id = ?1 AND state = 'pending'")
        return row["n"] if row else 0

    total = await left()
    bar = progress(total, "indexing", "jobs", show=show)
    started = time.monotonic()
    memex.worker.wake(org_id)
    while (now_left := await left()) > 0:
        bar.update(max(0, total - now_left) - bar.n)
        if not await memex.worker.run_once():
            memex.worker.wake(org_id)
            await asyncio.sleep(0.2)
    await memex.worker.drain()  # and every vector written is searchable (Vectorize applies writes later)
    bar.update(total - bar.n)
    bar.close()
    return {"jobs": total, "seconds": round(time.monotonic() - started, 1)}


def cmd_import(args: argparse.Namespace) -> int:
    path = Path(args.file)
    if not path.is_file():
        print(f"memex import: {args.file}: no such file", file=sys.stderr)
        return 2

    async def run(memex):
        return await _import(memex, args.org, path, max(1, min(1000, args.batch)), not args.no_wait, json_quiet(args))

    try:
        summary, code = asyncio.run(with_memex(settings_from(args), run))
    except Exception as exc:  # an unknown organization: one line, no traceback
        if getattr(exc, "code", None) in ("not_found", "invalid_input"):
            print(f"memex import: {getattr(exc, 'message', exc)}", file=sys.stderr)
            return 2
        raise
    emit(summary, args)
    return code


def add_commands(sub: Any) -> None:
    p = sub.add_parser("import", help="stream a JSON Lines file of thoughts and conversations into an organization")
    p.add_argument("file", help="one JSON object per line: a thought, or {\"type\": \"conversation\", ...}")
    p.add_argument("--org", required=True, help="organization slug")
    p.add_argument("--batch", type=int, default=500, help="thoughts per batch (default 500, at most 1000)")
    p.add_argument("--no-wait", action="store_true", help="do not wait for the embedding (a serving process does it)")
    add_json(p)
    add_data_dir(p)
    p.set_defaults(fn=cmd_import)

