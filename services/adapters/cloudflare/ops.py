"""Operations: ``memex cloudflare check`` and ``memex reindex --org SLUG``.

``check(settings)`` verifies a Cloudflare configuration end to end and prints one line per item — ``ok``,
``WARN`` or ``MISSING`` with the exact command that fixes it: settings present, the API token accepted, the D1
database reachable, every file of migrations/ recorded in ``d1_migrations``, Workers AI answering with the
expected dimensions, the Vectorize index present with the embedder's dimensions, the cosine metric and the
model recorded, and the metadata indexes (organization_id, kind, parent_id) present. ``fix=True`` applies
pending migrations, creates a missing index and the missing metadata indexes. Read-only otherwise.

``reindex(...)`` rebuilds one organization's vectors from the SQL store (after a model change, or into a new
index): pages of chunks in ``pk`` order are embedded, upserted (the same ids and metadata the job worker
writes) and marked indexed. A checkpoint file (``<data_dir>/reindex/<org id>.json``: last pk, index, model)
makes it resumable: a rerun against the same index and model continues after the last finished page
(``restart=True`` starts over). Cloudflare cost per page of 500 chunks: 1 D1 read, 5 Workers AI calls, 1
Vectorize upsert, 1 D1 update. ``prune=True`` also deletes the organization's vectors that no chunk owns
(Vectorize: pages through the whole index listing, one request per 1,000 ids).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.errors import MemexError
from services.ids import now_ms
from services.storage.migrate import CONTROL_DIR, apply_pending, discover
from services.ports import Embedder, SqlDatabase, VectorIndex
from services.storage.scoped import OrgSql, OrgVectors

from .vectorize import VectorizeIndex, wait_searchable

__all__ = [
    "CheckItem",
    "CheckReport",
    "check",
    "run_check",
    "reindex",
    "reindex_org",
    "run_reindex",
    "ReindexResult",
]

Out = Callable[[str], None]


# ------------------------------------------------------------------------------------------------------
# memex cloudflare check
# ------------------------------------------------------------------------------------------------------


@dataclass
class CheckItem:
    status: str  # "ok" | "warn" | "missing"
    what: str
    detail: str = ""
    fix: str | None = None

    def line(self) -> str:
        tag = {"ok": "ok     ", "warn": "WARN   ", "missing": "MISSING"}[self.status]
        text = f"{tag}  {self.what}"
        if self.detail:
            text += f": {self.detail}"
        if self.fix and self.status != "ok":
            text += f"\n         fix: {self.fix}"
        return text


@dataclass
class CheckReport:
    items: list[CheckItem] = field(default_factory=list)
    stats: dict[str, Any] | None = None

    @property
    def missing(self) -> list[CheckItem]:
        return [i for i in self.items if i.status == "missing"]

    @property
    def ok(self) -> bool:
        return not self.missing

    def as_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "items": [{"status": i.status, "what": i.what, "detail": i.detail, "fix": i.fix} for i in self.items],
            "cloudflare": self.stats,
        }


def _embedder_for(settings: Any, http: Any) -> Embedder:
    kind = getattr(settings, "embedder", "local")
    if kind == "workers-ai":
        from . import workers_ai_embedder

        return workers_ai_embedder(settings, http)
    if kind == "hash":
        from services.adapters.hash_embedder import HashEmbedder

        return HashEmbedder()
    from services.adapters.onnx_embedder import OnnxMiniLMEmbedder

    return OnnxMiniLMEmbedder()  # model and tokenizer load lazily: only model_id/dimensions are read here


async def check(
    settings: Any,
    *,
    fix: bool = False,
    out: Out | None = print,
    http: Any = None,
    embedder: Embedder | None = None,
    migrations_dir: Path = CONTROL_DIR,
) -> CheckReport:
    """Verify the Cloudflare configuration in ``settings``; print and return what is missing."""
    from . import api_for, shared_client
    from .client import CloudflareApiError, CloudflareAuthError, CloudflareNotFound
    from .d1 import D1Database
    from .vectorize import INDEXED_PROPERTIES, VectorizeIndex, model_description, model_from_description

    report = CheckReport()

    def add(status: str, what: str, detail: str = "", fix_: str | None = None) -> CheckItem:
        item = CheckItem(status, what, detail, fix_)
        report.items.append(item)
        if out is not None:
            out(item.line())
        return item

    uses_d1 = "d1" in str(getattr(settings, "sql", ""))
    uses_vec = getattr(settings, "vectors", "") == "vectorize"
    uses_ai = getattr(settings, "embedder", "") == "workers-ai"
    db_id = getattr(settings, "cloudflare_d1_database_id", None)
    index_name = getattr(settings, "cloudflare_vectorize_index", None)
    if not (uses_d1 or uses_vec or uses_ai):
        uses_d1, uses_vec = bool(db_id), bool(index_name)
        if not (uses_d1 or uses_vec):
            add("missing", "a Cloudflare backend", "MEMEX_SQL, MEMEX_VECTORS and MEMEX_EMBEDDER select none",
                "set MEMEX_SQL=d1, MEMEX_VECTORS=vectorize and/or MEMEX_EMBEDDER=workers-ai")
            return report

    # -- settings ---------------------------------------------------------------------------------------
    needed = {"CLOUDFLARE_ACCOUNT_ID": getattr(settings, "cloudflare_account_id", None),
              "CLOUDFLARE_API_TOKEN": getattr(settings, "cloudflare_api_token", None)}
    if uses_d1:
        needed["CLOUDFLARE_D1_DATABASE_ID"] = db_id
    if uses_vec:
        needed["CLOUDFLARE_VECTORIZE_INDEX"] = index_name
    absent = [k for k, v in needed.items() if not v]
    if absent:
        for k in absent:
            add("missing", f"setting {k}", "not set", f"export {k}=...  (see README: Cloudflare)")
        return report
    add("ok", "settings", f"account {settings.cloudflare_account_id}, API {settings.cloudflare_api_base_url}")

    own_http = http is None
    if own_http:
        http = shared_client(settings)
    api = api_for(settings, http)
    try:
        token_ok: bool | None = None

        def auth_failed(exc: CloudflareApiError, what: str) -> None:
            nonlocal token_ok
            token_ok = False
            add("missing", "API token", f"rejected while {what}: {exc.text}",
                "create a token with Account > D1 > Edit, Workers AI > Read + Edit and Vectorize > Edit "
                "for this account, and export CLOUDFLARE_API_TOKEN")

        # -- D1 -----------------------------------------------------------------------------------------
        if uses_d1:
            db = D1Database(api, db_id)
            reachable = False
            try:
                await api.call("d1", "GET", f"d1/database/{db_id}", idempotent=True)
                await db.execute("SELECT 1 AS one")
                reachable = True
                if token_ok is None:
                    token_ok = True
                    add("ok", "API token", "accepted")
                add("ok", "D1 database", f"{db_id} reachable")
            except CloudflareAuthError as exc:
                auth_failed(exc, "reading the D1 database")
            except CloudflareNotFound:
                add("missing", "D1 database", f"{db_id} not found in account {settings.cloudflare_account_id}",
                    "wrangler d1 create <name>, then put its id in wrangler.toml and CLOUDFLARE_D1_DATABASE_ID")
            except MemexError as exc:
                add("missing", "D1 database", f"{db_id} unreachable: {exc.message}", "check the id and the network")
            if reachable:
                await _check_migrations(db, add, fix=fix, migrations_dir=migrations_dir)

        # -- Workers AI ---------------------------------------------------------------------------------
        if embedder is None:
            embedder = _embedder_for(settings, http)
        if uses_ai and token_ok is not False:
            try:
                vec = await embedder.embed(["memex cloudflare check"])
                if token_ok is None:
                    token_ok = True
                    add("ok", "API token", "accepted")
                if vec.shape == (1, embedder.dimensions):
                    add("ok", "Workers AI", f"{embedder.model_id} answers with {embedder.dimensions} dimensions")
                else:
                    add("missing", "Workers AI", f"{embedder.model_id} answered shape {vec.shape}")
            except CloudflareAuthError as exc:
                auth_failed(exc, "calling Workers AI")
            except MemexError as exc:
                add("missing", "Workers AI", f"{embedder.model_id}: {exc.message}",
                    "check the token's Workers AI permissions and the model name")

        # -- Vectorize ----------------------------------------------------------------------------------
        if uses_vec and token_ok is not False:
            index = VectorizeIndex(api, index_name, dimensions=embedder.dimensions, model=embedder.model_id)
            create_cmd = (
                f"wrangler vectorize create {index_name} --dimensions={embedder.dimensions} --metric=cosine "
                f"--description \"{model_description(embedder.model_id, embedder.dimensions)}\"  "
                "(or: memex cloudflare check --fix)"
            )
            desc: dict[str, Any] | None = None
            try:
                desc = await index.describe()
                if token_ok is None:
                    token_ok = True
                    add("ok", "API token", "accepted")
            except CloudflareAuthError as exc:
                auth_failed(exc, "reading the Vectorize index")
            except MemexError as exc:
                if isinstance(exc.__cause__, CloudflareNotFound) or isinstance(exc, CloudflareNotFound):
                    if fix:
                        await index.create_index()
                        desc = await index.describe(refresh=True)
                        add("ok", "Vectorize index", f"{index_name} created (cosine, {embedder.dimensions} dims)")
                    else:
                        add("missing", "Vectorize index", f"{index_name} does not exist", create_cmd)
                else:
                    add("missing", "Vectorize index", f"{index_name}: {exc.message}", None)
            if desc is not None:
                config = desc.get("config") or {}
                dims, metric = config.get("dimensions"), config.get("metric")
                recorded = model_from_description(desc.get("description"))
                problems = []
                if dims != embedder.dimensions:
                    problems.append(f"{dims} dimensions, the embedder makes {embedder.dimensions}")
                if metric != "cosine":
                    problems.append(f"metric {metric}, Memex needs cosine")
                if recorded is not None and recorded != embedder.model_id:
                    problems.append(f"made for {recorded}, the embedder is {embedder.model_id}")
                if problems:
                    add("missing", "Vectorize index", f"{index_name}: " + "; ".join(problems),
                        f"use a new index ({create_cmd}), point CLOUDFLARE_VECTORIZE_INDEX at it, then "
                        "memex reindex --org <slug> for every organization")
                else:
                    add("ok", "Vectorize index", f"{index_name}: cosine, {dims} dimensions")
                    if recorded is None:
                        add("warn", "Vectorize index model",
                            f"the description {desc.get('description')!r} does not record the model; only the "
                            "dimensions can be checked (descriptions are fixed at creation)",
                            f"next time create the index with --description "
                            f"\"{model_description(embedder.model_id, embedder.dimensions)}\"")
                    else:
                        add("ok", "Vectorize index model", recorded)
                    await _check_metadata_indexes(index, INDEXED_PROPERTIES, add, fix=fix)
    finally:
        report.stats = api.snapshot()
        if own_http:
            await http.aclose()
    if out is not None:
        budget = report.stats["budget"] if report.stats else {}
        out(f"{'all good' if report.ok else str(len(report.missing)) + ' missing'}; "
            f"API requests this run: {sum((report.stats or {}).get('requests', {}).values())}, "
            f"budget remaining {budget.get('remaining')}/{budget.get('limit')}")
    return report


async def _check_migrations(db: SqlDatabase, add, *, fix: bool, migrations_dir: Path) -> None:
    files = [m.name for m in discover(migrations_dir)]
    table = await db.execute("SELECT name FROM sqlite_master WHERE type = 'table' AND name = 'd1_migrations'")
    applied: list[str] = []
    if table.rows:
        applied = [r["name"] for r in (await db.execute("SELECT name FROM d1_migrations ORDER BY id")).rows]
    pending = [f for f in files if f not in applied]
    unknown = [a for a in applied if a not in files]
    ran: list[str] = []
    if pending and fix:
        ran = await apply_pending(db, migrations_dir)
        pending = [f for f in pending if f not in ran]
    if pending:
        add("missing", "migrations", f"not applied: {', '.join(pending)}",
            "memex migrate  (or: wrangler d1 migrations apply <database name> --remote)")
    else:
        add("ok", "migrations", f"all {len(files)} applied" + (f" (now: {', '.join(ran)})" if ran else ""))
    if unknown:
        add("warn", "migrations", f"recorded in d1_migrations but not in {migrations_dir.name}/: {', '.join(unknown)}",
            "deploy the code that has those migrations")


async def _check_metadata_indexes(index: Any, wanted: dict[str, str], add, *, fix: bool) -> None:
    have = await index.metadata_indexes()
    missing = [p for p in wanted if p not in have]
    wrong = {p: have[p] for p in wanted if p in have and have[p] != wanted[p]}
    for p, t in wrong.items():
        add("missing", f"metadata index {p}", f"is {t}, must be {wanted[p]}",
            f"wrangler vectorize delete-metadata-index {index.name} --property-name={p} && "
            f"wrangler vectorize create-metadata-index {index.name} --property-name={p} --type={wanted[p]}, "
            "then memex reindex every organization")
    if missing and fix:
        info = await index.info()
        report = await index.ensure_metadata_indexes({p: wanted[p] for p in missing})
        add("ok", "metadata indexes", f"created {', '.join(report['created'])}")
        if info.vector_count:
            add("warn", "metadata indexes",
                f"the index already holds {info.vector_count} vectors written before these indexes: they are not "
                "filterable on them", "memex reindex --org <slug> for every organization")
        missing = []
    for p in missing:
        add("missing", f"metadata index {p}", "absent (create it before writing vectors)",
            f"wrangler vectorize create-metadata-index {index.name} --property-name={p} --type={wanted[p]}")
    present = [p for p in wanted if p in have and p not in wrong]
    if present and not missing and not wrong:
        add("ok", "metadata indexes", ", ".join(present))


def run_check(settings: Any, *, fix: bool = False, as_json: bool = False) -> int:
    """For the CLI: run ``check``; exit code 0 when nothing is missing, 1 otherwise."""

    async def go() -> CheckReport:
        return await check(settings, fix=fix, out=None if as_json else print)

    report = asyncio.run(go())
    if as_json:
        print(json.dumps(report.as_dict(), indent=2, default=str))
    return 0 if report.ok else 1


# ------------------------------------------------------------------------------------------------------
# memex reindex --org SLUG
# ------------------------------------------------------------------------------------------------------


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


class _Progress:
    def __init__(self, label: str, total: int, stream=None) -> None:
        self.label = label
        self.total = max(total, 0)
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.start = time.monotonic()
        self._last = 0.0

    def update(self, done: int, *, final: bool = False) -> None:
        now = time.monotonic()
        if not final and now - self._last < (0.2 if self.tty else 5.0):
            return
        self._last = now
        pct = (done / self.total) if self.total else 1.0
        width = 30
        bar = "#" * int(pct * width) + "-" * (width - int(pct * width))
        rate = done / max(now - self.start, 1e-6)
        text = f"{self.label} [{bar}] {done}/{self.total} chunks ({pct:.0%}, {rate:.0f}/s)"
        if self.tty:
            self.stream.write("\r" + text + ("\n" if final else ""))
        else:
            self.stream.write(text + "\n")
        self.stream.flush()


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
    progress: bool | Any = True,
    label: str | None = None,
) -> ReindexResult:
    """Re-embed and re-upsert every chunk of ``org_id`` (resumable through ``state_dir``)."""
    from services.search.indexing import chunk_metadata  # the exact metadata the job worker writes

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
    bar = None
    if progress:
        bar = _Progress(label or f"reindex {org_id}", total, None if progress is True else progress)
        bar.update(done, final=False)
    embedded = 0
    mutation: str | None = None
    while True:
        rows = await sql.rows(
            "SELECT c.pk, c.id, c.kind, c.parent_id, c.ordinal, c.content, c.start_sequence, c.end_sequence, "
            "d.tags AS tags FROM chunks c LEFT JOIN documents d ON c.kind = 'thought' "
            "AND d.organization_id = c.organization_id AND d.id = c.parent_id "
            "WHERE c.organization_id = ?1 AND c.pk > ?2 ORDER BY c.pk LIMIT ?3",
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
            bar.update(done)
        if len(rows) < page_size:
            break

    pruned = 0
    if prune:
        pruned, prune_mutation = await _prune(sql, vectors, index, org_id)
        mutation = prune_mutation or mutation
    save(last_pk, finished=True)
    if bar is not None:
        bar.update(done, final=True)
    searchable = None  # an index that applies writes synchronously has nothing to wait for
    if mutation and wait and index.applies_writes_later:
        searchable = await wait_searchable(index, mutation, wait)
    return ReindexResult(org_id=org_id, total=total, done=done, embedded=embedded, resumed_from=resumed_from,
                         pruned=pruned, mutation_id=mutation, searchable=searchable,
                         seconds=round(time.monotonic() - started, 3))


async def _prune(sql: OrgSql, vectors: OrgVectors, index: VectorIndex, org_id: str) -> tuple[int, str | None]:
    prefix = f"{org_id}:"
    in_index: set[str] = set()
    listed = await index.ids_in_namespace(org_id)
    if listed is not None:
        in_index = {i[len(prefix):] for i in listed if i.startswith(prefix)}
    elif isinstance(index, VectorizeIndex):  # it cannot list a namespace: page through the whole index
        async for page in index.list_ids():
            in_index.update(i[len(prefix):] for i in page if i.startswith(prefix))
    else:
        return 0, None
    known = {r["id"] for r in await sql.rows("SELECT id FROM chunks WHERE organization_id = ?1")}
    stray = sorted(in_index - known)
    mutation = await vectors.delete_by_ids(stray) if stray else None
    return len(stray), mutation


async def reindex_org(memex: Any, slug: str, **kw: Any) -> ReindexResult:
    """``reindex`` for the organization ``slug`` of a started ``api.wiring.Memex``."""
    org = await memex.orgs.by_slug(slug)
    backend = memex.backend
    kw.setdefault("state_dir", Path(memex.settings.data_dir) / "reindex")
    kw.setdefault("label", f"reindex {slug}")
    api = None
    http = getattr(backend, "http", None)
    if http is not None:
        from . import _APIS

        api = _APIS.get(http)
    if api is not None:  # a long batch job: wait for budget slots instead of failing fast
        api.budget.max_wait = max(api.budget.max_wait, api.budget.window + 5)
    store = await memex.stores.open(org.id)
    return await reindex(store.db, store.index, backend.embedder, org.id, **kw)


def run_reindex(make_memex: Callable[[], Any], slug: str, *, restart: bool = False, prune: bool = False,
                page_size: int = 500, wait: float = 120.0) -> int:
    """For the CLI: ``make_memex()`` builds an ``api.wiring.Memex`` (no worker; services never import the
    api layer); migrations are applied, ``slug`` is reindexed and a JSON summary printed. Exit code 0 when the
    new vectors are searchable (or the index applies writes synchronously), 1 when the wait timed out."""

    async def go() -> ReindexResult:
        memex = make_memex()
        try:
            await memex.start(worker=False)
            return await reindex_org(memex, slug, restart=restart, prune=prune, page_size=page_size, wait=wait)
        finally:
            await memex.stop()

    result = asyncio.run(go())
    summary = {
        "organization": slug,
        "chunks": result.total,
        "embedded_now": result.embedded,
        "resumed_from": result.resumed_from,
        "stray_vectors_deleted": result.pruned,
        "last_mutation": result.mutation_id,
        "searchable": result.searchable,
        "seconds": result.seconds,
    }
    print(json.dumps(summary, indent=2))
    return 0 if result.searchable in (None, True) else 1
