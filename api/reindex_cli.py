"""``memex reindex --org SLUG``: rebuild an organization's vectors from its SQL store (resumable;
services.search.reindex), with the stores and the embedder the composition root built.

Hooked into ``api.cli.build_parser`` by ``add_commands(sub)``.
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from typing import TYPE_CHECKING, Any

from api.cli_common import add_data_dir, add_json, emit, json_quiet, make_memex, progress, settings_from

if TYPE_CHECKING:
    from services.search.reindex import ReindexResult

__all__ = ["add_commands", "cmd_reindex", "reindex_org"]


async def reindex_org(memex: Any, slug: str, *, show: bool | None = None, **kw: Any) -> ReindexResult:
    """``reindex`` for the organization ``slug`` of a started ``api.wiring.Memex``, with a progress bar (``show``:
    as ``api.cli_common.progress``)."""
    from services.search.reindex import reindex  # the services load with the command, not with the parser

    org = await memex.orgs.by_slug(slug)
    backend = memex.backend
    kw.setdefault("state_dir", Path(memex.settings.data_dir) / "reindex")
    backend.patient()  # a long batch job: wait for budget slots instead of failing fast
    store = await memex.stores.open(org.id, any_model=True)  # re-embedding into this model is what it is for
    with progress(None, f"reindex {slug}", "chunks", show=show) as bar:

        def moved(done: int, total: int) -> None:
            bar.total = total
            bar.update(done - bar.n)

        result = await reindex(store.db, store.index, backend.embedder, org.id,
                               list_ids=backend.id_lister(store.index), progress=moved, **kw)
    if result.done >= result.total:  # every chunk now holds this model's vector: the organization is this model's
        await memex.stores.adopt_model(org.id)
    return result


def cmd_reindex(args: argparse.Namespace) -> int:
    """Migrations are applied, the organization is reindexed and a summary printed (JSON with ``--json``). Exit code
    0 when the new vectors are searchable (or the index applies writes synchronously), 1 when the wait timed out."""
    settings = settings_from(args)

    async def go() -> ReindexResult:
        memex = make_memex(settings)
        try:
            await memex.start(worker=False)
            return await reindex_org(memex, args.org, restart=args.restart, prune=args.prune,
                                     page_size=args.page_size, wait=args.wait, show=json_quiet(args))
        finally:
            await memex.stop()

    result = asyncio.run(go())
    summary = {
        "organization": args.org,
        "chunks": result.total,
        "embedded_now": result.embedded,
        "resumed_from": result.resumed_from,
        "stray_vectors_deleted": result.pruned,
        "last_mutation": result.mutation_id,
        "searchable": result.searchable,
        "seconds": result.seconds,
    }
    emit(summary, args)
    return 0 if result.searchable in (None, True) else 1


def add_commands(sub) -> None:
    """Add ``reindex`` to the ``memex`` parser (``sub``: its subparsers)."""
    ri = sub.add_parser("reindex", help="rebuild an organization's vectors from the SQL store (resumable)")
    ri.add_argument("--org", required=True, help="organization slug")
    ri.add_argument("--restart", action="store_true", help="ignore the checkpoint and start over")
    ri.add_argument("--prune", action="store_true", help="also delete vectors with no rows behind them")
    ri.add_argument("--page-size", type=int, default=500)
    ri.add_argument("--wait", type=float, default=120.0, help="seconds to wait for the new vectors to be searchable")
    add_json(ri)
    add_data_dir(ri)
    ri.set_defaults(fn=cmd_reindex)
