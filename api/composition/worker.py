"""The Worker backend's adapters, built from the settings (``MEMEX_BACKEND=worker``).

One ``WorkerClient`` per HTTP client (so per process): the control database (``db = "control"``, the Worker's D1
binding), every organization's Durable Object (``org:<id>``, ``WorkerOrgStores``), the Vectorize index
(``CLOUDFLARE_VECTORIZE_INDEX``, default ``memex-bge-768``: the Worker binds it) and, when MEMEX_EMBEDDER /
MEMEX_LLM / MEMEX_RERANKER say ``workers-ai``, the models on the Worker's AI binding. None of them calls
Cloudflare's REST API: the data path is the Worker's protocol only.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

import httpx

from api.settings import SettingsError
from services.adapters.cloudflare.worker_ai import WorkerEmbedder, worker_chat, worker_reranker
from services.adapters.cloudflare.worker_client import WorkerClient, worker_http_client
from services.adapters.cloudflare.worker_sql import WorkerSqlDatabase
from services.adapters.cloudflare.worker_vectors import WorkerVectorIndex
from services.adapters.cloudflare.workers_ai import WorkersAIChat, WorkersAIReranker
from services.adapters.onnx_embedder import WordPieceCount
from services.errors import BackendError
from services.ports import Embedder, SqlDatabase, VectorIndex
from services.storage.migrate import ORG_DIR, discover
from services.storage.worker_stores import WorkerOrgStores

__all__ = ["DEFAULT_INDEX", "shared_client", "client_for", "client_of", "control", "stores", "embedder", "chat",
           "reranker", "require_settings", "ping", "check_org_schema"]

DEFAULT_INDEX = "memex-bge-768"
log = logging.getLogger("memex.worker")
_CLIENTS: "weakref.WeakKeyDictionary[httpx.AsyncClient, WorkerClient]" = weakref.WeakKeyDictionary()
_WORDPIECE = WordPieceCount()


def require_settings(settings: Any) -> None:
    """MEMEX_WORKER_URL and MEMEX_WORKER_SECRET must be set for MEMEX_BACKEND=worker (their shape is checked by
    Settings)."""
    missing = [env for env, value in (("MEMEX_WORKER_URL", getattr(settings, "worker_url", None)),
                                      ("MEMEX_WORKER_SECRET", getattr(settings, "worker_secret", None))) if not value]
    if missing:
        raise SettingsError(
            f"MEMEX_BACKEND=worker needs {' and '.join(missing)} (the Worker's URL and the secret it shares with this "
            "service; `memex cloudflare dev` prints both for a local Worker)",
            details={"setting": missing[0], "missing": missing})


def shared_client(settings: Any) -> httpx.AsyncClient:
    """The process's HTTP client for the Worker (the backend closes it)."""
    return worker_http_client()


def client_for(settings: Any, http: httpx.AsyncClient) -> WorkerClient:
    """The ``WorkerClient`` shared by every adapter on ``http`` (made on first use)."""
    require_settings(settings)
    client = _CLIENTS.get(http)
    if client is None:
        client = _CLIENTS[http] = WorkerClient(http, url=settings.worker_url, secret=settings.worker_secret)
    return client


def client_of(http: httpx.AsyncClient | None) -> WorkerClient | None:
    return _CLIENTS.get(http) if http is not None else None


def index_name(settings: Any) -> str:
    return getattr(settings, "cloudflare_vectorize_index", None) or DEFAULT_INDEX


def control(client: WorkerClient) -> SqlDatabase:
    return WorkerSqlDatabase(client, "control")


def stores(settings: Any, client: WorkerClient, control_db: SqlDatabase, embedder_: Embedder, *,
           check_db: Any = None, check_index: Any = None) -> WorkerOrgStores:
    """Each organization's Durable Object and the shared index. ``check_db`` / ``check_index`` (the root's port
    checks) wrap each adapter made."""
    def open_database(location: str) -> SqlDatabase:
        db = WorkerSqlDatabase(client, location)
        return check_db(db) if check_db is not None else db

    def open_index(name: str) -> VectorIndex:
        idx = WorkerVectorIndex(client, name, dimensions=embedder_.dimensions, model=embedder_.model_id)
        return check_index(idx) if check_index is not None else idx

    async def schema_check() -> None:
        await check_org_schema(client)

    return WorkerOrgStores(control_db, open_database=open_database, open_index=open_index,
                           index_name=index_name(settings), schema_check=schema_check, model=embedder_.model_id)


def _number(name: str) -> int:
    head = name.split("_", 1)[0]
    return int(head) if head.isdigit() else -1


async def check_org_schema(client: WorkerClient) -> dict[str, Any]:
    """Ping the Worker and compare the newest org migration it bundles with this service's: older is refused
    (``BackendError``: deploy the Worker of this release), newer is logged."""
    answer = await client.ping()
    theirs = str(answer.get("org_schema_version") or "")
    found = discover(ORG_DIR)
    ours = found[-1].name if found else ""
    if ours and _number(theirs) < _number(ours):
        raise BackendError(
            f"the Worker at {client.url} bundles org migrations up to {theirs or 'none'}, this service needs {ours}: "
            "deploy the Worker of this release (npx wrangler deploy)",
            details={"worker_org_schema": theirs, "service_org_schema": ours})
    if theirs != ours:
        log.warning("the Worker bundles org migrations up to %s; this service knows %s", theirs, ours)
    return answer


def embedder(client: WorkerClient) -> WorkerEmbedder:
    """bge-base on the Worker's AI binding, counting tokens with the local tokenizer's WordPiece count."""
    return WorkerEmbedder(client, exact_count=_WORDPIECE)


def chat(settings: Any, client: WorkerClient) -> WorkersAIChat:
    c = worker_chat(client)
    if getattr(settings, "llm_model", None):
        c.model = settings.llm_model
    return c


def reranker(client: WorkerClient) -> WorkersAIReranker:
    return worker_reranker(client)


async def ping(url: str, secret: str) -> dict[str, Any]:
    """One signed ``ping`` to the Worker at ``url`` (``memex cloudflare dev`` waits on it): its protocol, version and
    the newest org migration it bundles. Raises ``WorkerError`` (a ``BackendError``) when it cannot answer."""
    async with worker_http_client() as http:
        return await WorkerClient(http, url=url, secret=secret, max_attempts=1).ping()
