"""Rebuild an organization's vectors from its SQL store (``memex reindex --org SLUG``): after a model change, or
into a new index.

Pages of chunks in ``pk`` order are embedded, upserted (the same ids and metadata the embedding job writes,
``services.search.indexing.chunk_metadata``) and marked indexed. A checkpoint file (``<state dir>/<org id>.json``:
last pk, index, model) makes it resumable: a rerun against the same index and model continues after the last
finished page (``restart=True`` starts over). Cloudflare cost per page of 500 chunks: 1 D1 read, 5 Workers AI
calls, 1 Vectorize upsert, 1 D1 update. ``prune=True`` also deletes the organization's vectors that no chunk owns
(Vectorize: pages through the whole index listing, one request per 1,000 ids).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

from services.ids import now_ms
from services.ports import Embedder, SqlDatabase, VectorIndex, wait_searchable
from services.search.indexing import CHUNK_ROWS, chunk_metadata
from services.storage.scoped import OrgSql, OrgVectors

__all__ = ["ReindexResult", "reindex"]


@dataclass
class ReindexResult:
    org_id: str
    total: int
    done: int
    embedded: int
    resumed_from: int
    pruned: int = 0
    mutation_id: str | None = None
    searchable: bool | None = None
    seconds: float = 0.0


def _index_identity(index: VectorIndex) -> str:
    name = getattr(index, "name", None) or getattr(index, "path", None)
    return f"{type(index).__name__}:{name}"


async def reindex(
    db: SqlDatabase,
    index: VectorIndex,
    embedder: Embedder,
    org_id: str,
    *,
    state_dir: Path | None = None,
    restart: bool = False,
    page_size: int = 500,
    prune: bool = False,
    wait: float = 120.0,
    progress: Callable[[int, int], None] | bool | None = None,
    label: str | None = None,
    list_ids: Callable[[], AsyncIterator[list[str]]] | None = None,
) -> ReindexResult:
    """Re-embed and re-upsert every chunk of ``org_id`` (resumable through ``state_dir``). ``list_ids`` pages
    through every id of ``index`` when it cannot list a namespace (Vectorize's ``list_ids``; the caller knows its
    index): ``prune`` needs one of the two, and prunes nothing without. ``progress(done, total)`` is called as
    chunks are done (the command's progress bar; ``label`` is not used and kept for callers)."""
    started = time.monotonic()
    sql, vectors = OrgSql(db, org_id), OrgVectors(index, org_id)
    state_path = (state_dir / f"{org_id}.json") if state_dir is not None else None
    identity, model = _index_identity(index), embedder.model_id
    last_pk = 0
    if state_path is not None and state_path.exists() and not restart:
        try:
            state = json.loads(state_path.read_text())
            if state.get("index") == identity and state.get("model") == model and not state.get("finished"):
                last_pk = int(state.get("last_pk", 0))
        except (ValueError, OSError):
            last_pk = 0

    def save(pk: int, finished: bool = False) -> None:
        if state_path is None:
            return
        state_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"org_id": org_id, "index": identity, "model": model, "last_pk": pk,
                                   "finished": finished, "updated_at": now_ms()}))
        tmp.replace(state_path)

    total = (await sql.one("SELECT COUNT(*) AS n FROM chunks WHERE organization_id = ?1"))["n"]
    done = (await sql.one("SELECT COUNT(*) AS n FROM chunks WHERE organization_id = ?1 AND pk <= ?2", [last_pk]))["n"]
    resumed_from = done
    bar = progress if callable(progress) else None
    if bar is not None:
        bar(done, total)
    embedded = 0
    mutation: str | None = None
    while True:
        rows = await sql.rows(
            CHUNK_ROWS + "WHERE c.organization_id = ?1 AND c.pk > ?2 ORDER BY c.pk LIMIT ?3",
            [last_pk, page_size],
        )
        if not rows:
            break
        values = await embedder.embed([r["content"] for r in rows])
        items = [(r["id"], values[i], chunk_metadata(r)) for i, r in enumerate(rows)]
        mutation = await vectors.upsert(items) or mutation
        ids = [r["id"] for r in rows]
        res = await sql.execute(
            "UPDATE chunks SET indexed_at = COALESCE(indexed_at, ?2) "
            "WHERE organization_id = ?1 AND id IN (SELECT value FROM json_each(?3))",
            [now_ms(), json.dumps(ids)],
        )
        if res.changes < len(ids):  # chunks deleted meanwhile: drop their fresh vectors again
            alive = {r["id"] for r in await sql.rows(
                "SELECT id FROM chunks WHERE organization_id = ?1 AND id IN (SELECT value FROM json_each(?2))",
                [json.dumps(ids)],
            )}
            gone = [i for i in ids if i not in alive]
            if gone:
                mutation = await vectors.delete_by_ids(gone) or mutation
        embedded += len(rows)
        done += len(rows)
        last_pk = rows[-1]["pk"]
        save(last_pk)
        if bar is not None:
            bar(done, total)
        if len(rows) < page_size:
            break

    pruned = 0
    if prune:
        pruned, prune_mutation = await _prune(sql, vectors, index, org_id, list_ids)
        mutation = prune_mutation or mutation
    save(last_pk, finished=True)
    searchable = None  # an index that applies writes synchronously has nothing to wait for
    if mutation and wait and index.applies_writes_later:
        searchable = await wait_searchable(index, mutation, wait)
    return ReindexResult(org_id=org_id, total=total, done=done, embedded=embedded, resumed_from=resumed_from,
                         pruned=pruned, mutation_id=mutation, searchable=searchable,
                         seconds=round(time.monotonic() - started, 3))


async def _prune(sql: OrgSql, vectors: OrgVectors, index: VectorIndex, org_id: str,
                 list_ids: Callable[[], AsyncIterator[list[str]]] | None) -> tuple[int, str | None]:
    prefix = f"{org_id}:"
    in_index: set[str] = set()
    listed = await index.ids_in_namespace(org_id)
    if listed is not None:
        in_index = {i[len(prefix):] for i in listed if i.startswith(prefix)}
    elif list_ids is not None:  # it cannot list a namespace: page through the whole index
        async for page in list_ids():
            in_index.update(i[len(prefix):] for i in page if i.startswith(prefix))
    else:
        return 0, None
    known = {r["id"] for r in await sql.rows("SELECT id FROM chunks WHERE organization_id = ?1")}
    stray = sorted(in_index - known)
    mutation = await vectors.delete_by_ids(stray) if stray else None
    return len(stray), mutation
