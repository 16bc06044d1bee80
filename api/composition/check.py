"""``memex cloudflare check``: verify a Cloudflare configuration end to end.

``check(settings)`` prints one line per item — ``ok``, ``WARN`` or ``MISSING`` with the exact command that fixes
it: settings present, the API token accepted, the D1 database reachable, every file of migrations/ recorded in
``d1_migrations``, Workers AI answering with the expected dimensions, the Vectorize index present with the
embedder's dimensions, the cosine metric and the model recorded, and the metadata indexes (organization_id, kind,
parent_id) present. ``fix=True`` applies pending migrations, creates a missing index and the missing metadata
indexes. Read-only otherwise.

With ``MEMEX_BACKEND=worker`` the data path is the data-plane Worker, so that is what is checked, through the
Worker's own protocol (no Cloudflare REST call): the settings (MEMEX_WORKER_URL, MEMEX_WORKER_SECRET), a signed
``ping`` (the URL and secret accepted, the protocol, the Worker's version, and the newest org migration it bundles
against this service's newest ``migrations/org``), the control database's migrations through the Worker
(``fix=True`` applies the pending ones), Workers AI through the Worker's binding when MEMEX_EMBEDDER=workers-ai,
and the Vectorize index the Worker binds (``vec.info``: its dimensions against the embedder's).

It lives in the composition root because it does what the root does: reads the settings and builds the
Cloudflare adapters (the embedder the settings choose included), here to probe them.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from api.composition.backend import embedder_for
from api.composition.cloudflare import api_for, shared_client
from services.adapters.cloudflare.client import CloudflareApiError, CloudflareAuthError, CloudflareNotFound
from services.adapters.cloudflare.d1 import D1Database
from services.adapters.cloudflare.vectorize import (
    INDEXED_PROPERTIES,
    VectorizeIndex,
    model_description,
    model_from_description,
)
from services.adapters.cloudflare.worker_client import (
    PROTOCOL,
    WorkerAuthError,
    WorkerClient,
    WorkerOpError,
    WorkerProtocolError,
    worker_http_client,
)
from services.adapters.cloudflare.worker_sql import WorkerSqlDatabase
from services.errors import MemexError
from services.ports import Embedder, SqlDatabase
from services.storage.migrate import CONTROL_DIR, ORG_DIR, apply_pending, discover

__all__ = ["CheckItem", "CheckReport", "check", "run_check"]

Out = Callable[[str], None]


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
    report = CheckReport()

    def add(status: str, what: str, detail: str = "", fix_: str | None = None) -> CheckItem:
        item = CheckItem(status, what, detail, fix_)
        report.items.append(item)
        if out is not None:
            out(item.line())
        return item

    if getattr(settings, "backend", "direct") == "worker":
        await _check_worker(settings, report, add, fix=fix, http=http, embedder=embedder,
                            migrations_dir=migrations_dir)
        if out is not None:
            requests = ((report.stats or {}).get("worker") or {}).get("requests", 0)
            out(f"{'all good' if report.ok else str(len(report.missing)) + ' missing'}; "
                f"Worker requests this run: {requests}")
        return report

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
            embedder = embedder_for(settings, http)
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


def _migration_number(name: str) -> int:
    head = name.split("_", 1)[0]
    return int(head) if head.isdigit() else -1


async def _check_worker(settings: Any, report: CheckReport, add, *, fix: bool, http: Any, embedder: Embedder | None,
                        migrations_dir: Path) -> None:
    """The Worker backend: the Worker itself, through its protocol (see the module's docstring)."""
    from api.composition import worker as worker_root

    url, secret = getattr(settings, "worker_url", None), getattr(settings, "worker_secret", None)
    absent = [k for k, v in (("MEMEX_WORKER_URL", url), ("MEMEX_WORKER_SECRET", secret)) if not v]
    for k in absent:
        add("missing", f"setting {k}", "not set",
            f"export {k}=...  (the deployed Worker's URL and the secret set with `npx wrangler secret put "
            "MEMEX_WORKER_SECRET`; `memex cloudflare dev` prints both for a local Worker)")
    if absent:
        return
    index_name = worker_root.index_name(settings)
    add("ok", "settings", f"Worker {url}, index {index_name}")
    own_http = http is None
    if own_http:
        http = worker_http_client()
    client = WorkerClient(http, url=url, secret=secret, max_attempts=2)
    deploy = "cd worker && npx wrangler deploy  (the Worker of this release)"
    try:
        # -- the Worker: URL, secret, protocol, version, bundled org schema ---------------------------------------
        try:
            answer = await client.ping()
        except WorkerAuthError as exc:
            add("missing", "Worker secret", exc.message,
                "set MEMEX_WORKER_SECRET to the Worker's secret (npx wrangler secret put MEMEX_WORKER_SECRET)")
            return
        except WorkerProtocolError as exc:
            add("missing", "Worker protocol", exc.message, deploy)
            return
        except MemexError as exc:
            add("missing", "Worker", f"{url} unreachable: {exc.message}", "check MEMEX_WORKER_URL, or " + deploy)
            return
        version = answer.get("worker_version") or "unknown"
        if answer.get("protocol") not in (None, PROTOCOL):
            add("missing", "Worker protocol", f"the Worker speaks {answer.get('protocol')}, this service {PROTOCOL}",
                deploy)
        else:
            add("ok", "Worker", f"{url} answers (protocol {PROTOCOL}, worker version {version})")
        theirs = str(answer.get("org_schema_version") or "")
        found = discover(ORG_DIR)
        ours = found[-1].name if found else ""
        if _migration_number(theirs) < _migration_number(ours):
            add("missing", "org schema", f"the Worker bundles org migrations up to {theirs or 'none'}, this service "
                f"needs {ours}", deploy)
        elif theirs != ours:
            add("warn", "org schema", f"the Worker bundles org migrations up to {theirs}, this service knows {ours}",
                "deploy the service of the Worker's release")
        else:
            add("ok", "org schema", f"the Worker bundles {theirs}, as this service")

        # -- the control database (the Worker's D1 binding) --------------------------------------------------------
        try:
            await _check_migrations(WorkerSqlDatabase(client, "control"), add, fix=fix, migrations_dir=migrations_dir)
        except MemexError as exc:
            add("missing", "control database", f"unreachable through the Worker: {exc.message}",
                "bind the D1 database as CONTROL_DB in worker/wrangler.toml, then " + deploy)

        # -- Workers AI (through the Worker's AI binding) ----------------------------------------------------------
        if embedder is None:
            embedder = worker_root.embedder(client) if getattr(settings, "embedder", "") == "workers-ai" \
                else embedder_for(settings, None)
        if getattr(settings, "embedder", "") == "workers-ai":
            try:
                vec = await embedder.embed(["memex cloudflare check"])
                if vec.shape == (1, embedder.dimensions):
                    add("ok", "Workers AI", f"{embedder.model_id} answers through the Worker with "
                        f"{embedder.dimensions} dimensions")
                else:
                    add("missing", "Workers AI", f"{embedder.model_id} answered shape {vec.shape}")
            except MemexError as exc:
                add("missing", "Workers AI", f"{embedder.model_id} through the Worker: {exc.message}",
                    "bind Workers AI as AI in worker/wrangler.toml, then " + deploy)

        # -- the Vectorize index the Worker binds ------------------------------------------------------------------
        create_cmd = (f"npx wrangler vectorize create {index_name} --dimensions={embedder.dimensions} --metric=cosine "
                      f"--description \"{model_description(embedder.model_id, embedder.dimensions)}\", bind it in "
                      "worker/wrangler.toml, then " + deploy)
        try:
            info = await client.run({"op": "vec.info", "index": index_name}, idempotent=True)
        except WorkerOpError as exc:
            if exc.op_code == "unknown_index":
                add("missing", "Vectorize index", f"the Worker binds no index {index_name!r}",
                    create_cmd + " (or set CLOUDFLARE_VECTORIZE_INDEX to the index it binds)")
            else:
                add("missing", "Vectorize index", f"{index_name}: {exc.message}", create_cmd)
        except MemexError as exc:
            add("missing", "Vectorize index", f"{index_name}: {exc.message}", None)
        else:
            dims = info.get("dimensions")
            if dims != embedder.dimensions:
                add("missing", "Vectorize index", f"{index_name}: {dims} dimensions, the embedder "
                    f"{embedder.model_id} makes {embedder.dimensions}",
                    f"use a new index ({create_cmd}), point CLOUDFLARE_VECTORIZE_INDEX at it, then memex reindex "
                    "--org <slug> for every organization")
            else:
                add("ok", "Vectorize index", f"{index_name}: {dims} dimensions, {info.get('vector_count', 0)} vectors")
    finally:
        report.stats = {"worker": client.snapshot()}
        if own_http:
            await http.aclose()


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
