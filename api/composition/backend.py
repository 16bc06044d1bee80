"""Every backend a process runs on, chosen from the settings: the control database, where organizations'
databases and vectors live (``OrgStores``), the embedder, the language model and the reranker.

``build_backend(settings)`` is the one function that picks adapters. Each adapter it builds is checked against
its port (``checked``): one that lacks a member is refused at start-up, naming the setting that chose it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx

from api.composition import cloudflare, worker
from api.settings import Settings, SettingsError
from services.adapters.cloudflare import D1Database, VectorizeIndex
from services.adapters.hash_embedder import HashEmbedder
from services.adapters.llm import OpenAICompatibleLLM, WorkersAILLM, WorkersAIRerankerPort
from services.adapters.local_vectors import LocalVectorIndex
from services.adapters.onnx_embedder import OnnxMiniLMEmbedder, user_cache_dir
from services.adapters.sqlite import SqliteDatabase
from services.errors import InvalidInput
from services.ports import LLM, Embedder, Reranker, SqlDatabase, VectorIndex, require
from services.storage.convert import ConversionReport, convert_on_start
from services.storage.d1_stores import D1OrgStores
from services.storage.stores import EmbeddedOrgStores, OrgStores

__all__ = ["Backend", "build_backend", "build_worker_backend", "checked", "embedder_for", "llm_for", "reranker_for",
           "convert_legacy_layout"]


@dataclass
class Backend:
    """Everything the settings chose: the control database, where organizations' databases live, the models."""

    control: SqlDatabase
    stores: OrgStores
    embedder: Embedder
    http: httpx.AsyncClient | None = None
    #: The language model (MEMEX_LLM); None = none configured: enrichment and decisions run deterministically.
    llm: LLM | None = None
    #: The second-stage reranker (MEMEX_RERANKER); None = none.
    reranker: Reranker | None = None
    #: Vectors written become searchable later (Vectorize): the worker confirms their mutations.
    async_index: bool = False
    #: MEMEX_BACKEND=worker: the data-plane Worker's client (its requests, ops and retries); None otherwise.
    worker: Any = None

    def cloudflare_stats(self) -> dict | None:
        """Requests, retries and the request budget of the Cloudflare adapters (None on the embedded backend); on the
        Worker backend, the Worker requests and ops under ``worker``."""
        if self.worker is not None:
            return {"worker": self.worker.snapshot()}
        return cloudflare.cloudflare_stats(self.http)

    def patient(self) -> None:
        """For a long batch job (a reindex): Cloudflare calls wait for a budget slot instead of failing fast."""
        api = cloudflare.api_of(self.http)
        if api is not None:
            api.budget.max_wait = max(api.budget.max_wait, api.budget.window + 5)

    @staticmethod
    def id_lister(index: VectorIndex) -> Callable[[], AsyncIterator[list[str]]] | None:
        """How to page through every id of ``index`` when it cannot list one namespace (Vectorize); else None."""
        return index.list_ids if isinstance(index, VectorizeIndex) else None

    async def close(self) -> None:
        for model in (self.llm, self.reranker):
            if model is not None:
                await model.aclose()
        await self.stores.close()
        await self.control.close()
        if self.http is not None:
            await self.http.aclose()


T = TypeVar("T")


def checked(adapter: T, port: type, setting: str) -> T:
    """``adapter`` when it implements every member of ``port``; else ``SettingsError`` naming the adapter, the
    setting that chose it and the missing members (services call port members directly, never probe)."""
    return require(adapter, port, f"{type(adapter).__name__} ({setting})", error=SettingsError)


def model_cache_dir(settings: Settings) -> Path:
    """Where the local embedder keeps its optimised model: the user's cache directory (``$XDG_CACHE_HOME/memex``,
    else ``~/.cache/memex``), shared by every data directory and every start on the machine; the data directory's
    ``cache/`` when there is no home. A file derived from the installed model, never downloaded."""
    return user_cache_dir() or settings.data_dir / "cache"


def embedder_for(settings: Settings, http: httpx.AsyncClient | None) -> Embedder:
    """The embedder ``MEMEX_EMBEDDER`` names (the local model loads lazily: building it reads no file)."""
    if settings.embedder == "local":
        return OnnxMiniLMEmbedder(optimized_cache_dir=model_cache_dir(settings))
    if settings.embedder == "hash":
        return HashEmbedder()
    if settings.embedder == "workers-ai":
        return cloudflare.workers_ai_embedder(settings, http)
    raise InvalidInput(f"unknown MEMEX_EMBEDDER {settings.embedder!r}")


def llm_for(settings: Any, http: httpx.AsyncClient | None) -> LLM | None:
    """The language model ``MEMEX_LLM`` names (None for ``none``)."""
    kind = (getattr(settings, "llm", None) or "none").lower()
    if kind == "none":
        return None
    if kind == "workers-ai":
        chat = cloudflare.workers_ai_chat(settings, http)
        if getattr(settings, "llm_model", None):
            chat.model = settings.llm_model
        return WorkersAILLM(chat)
    if kind == "openai":
        return OpenAICompatibleLLM(
            settings.llm_base_url, settings.llm_model, api_key=getattr(settings, "llm_api_key", None),
            response_format=getattr(settings, "llm_response_format", None) or "json_schema",
        )
    raise InvalidInput(f"unknown MEMEX_LLM {kind!r} (none, workers-ai or openai)")


def reranker_for(settings: Any, http: httpx.AsyncClient | None) -> Reranker | None:
    """The reranker ``MEMEX_RERANKER`` names (None for ``none``); ``local`` is ``services/adapters/local_reranker.py``
    when it is installed (a ``local_reranker(settings)`` factory or a ``LocalReranker`` class)."""
    kind = (getattr(settings, "reranker", None) or "none").lower()
    if kind == "none":
        return None
    if kind == "workers-ai":
        return WorkersAIRerankerPort(cloudflare.workers_ai_reranker(settings, http))
    if kind == "local":
        try:
            from services.adapters import local_reranker as mod  # an optional module: imported only when chosen
        except ModuleNotFoundError as exc:
            if exc.name != "services.adapters.local_reranker":
                raise InvalidInput(f"MEMEX_RERANKER=local: a package it needs is missing ({exc.name})") from exc
            raise InvalidInput(
                "MEMEX_RERANKER=local needs services/adapters/local_reranker.py, which is not installed; "
                "use none or workers-ai"
            ) from exc
        factory = getattr(mod, "local_reranker", None)
        if factory is not None:
            return factory(settings)
        cls = getattr(mod, "LocalReranker", None)
        if cls is None:
            raise InvalidInput("services/adapters/local_reranker.py has neither local_reranker() nor LocalReranker")
        return cls()
    raise InvalidInput(f"unknown MEMEX_RERANKER {kind!r} (none, workers-ai or local)")


_PAIRS = {("sqlite", "local"), ("d1", "vectorize")}


def build_worker_backend(settings: Settings) -> Backend:
    """MEMEX_BACKEND=worker: the control database, every organization's Durable Object, the index and (for
    ``workers-ai``) the models, all through the data-plane Worker; no Cloudflare REST client at all."""
    worker.require_settings(settings)
    http = worker.shared_client(settings)
    client = worker.client_for(settings, http)
    if settings.embedder == "workers-ai":
        embedder: Embedder = checked(worker.embedder(client), Embedder, "MEMEX_EMBEDDER=workers-ai")
    else:
        embedder = checked(embedder_for(settings, None), Embedder, f"MEMEX_EMBEDDER={settings.embedder}")
    control = checked(worker.control(client), SqlDatabase, "MEMEX_BACKEND=worker")
    stores = worker.stores(settings, client, control, embedder,
                           check_db=lambda db: checked(db, SqlDatabase, "MEMEX_BACKEND=worker"),
                           check_index=lambda idx: checked(idx, VectorIndex, "MEMEX_BACKEND=worker"))
    llm: LLM | None = None
    if settings.llm == "workers-ai":
        llm = WorkersAILLM(worker.chat(settings, client))
    elif settings.llm != "none":
        llm = llm_for(settings, None)
    reranker: Reranker | None = None
    if settings.reranker == "workers-ai":
        reranker = WorkersAIRerankerPort(worker.reranker(client))
    elif settings.reranker != "none":
        reranker = reranker_for(settings, None)
    return Backend(control=control, stores=stores, embedder=embedder, http=http,
                   llm=checked(llm, LLM, f"MEMEX_LLM={settings.llm}") if llm is not None else None,
                   reranker=checked(reranker, Reranker, f"MEMEX_RERANKER={settings.reranker}") if reranker else None,
                   async_index=True, worker=client)


def build_backend(settings: Settings) -> Backend:
    if getattr(settings, "backend", "direct") == "worker":
        return build_worker_backend(settings)
    if (settings.sql, settings.vectors) not in _PAIRS:
        raise SettingsError(
            f"MEMEX_SQL={settings.sql} with MEMEX_VECTORS={settings.vectors} is not a backend: each organization's "
            "database and vectors live together (sqlite with local, d1 with vectorize)",
            details={"setting": "MEMEX_VECTORS"},
        )
    cloud = ("d1" in settings.sql or settings.vectors == "vectorize" or settings.embedder == "workers-ai"
             or settings.llm == "workers-ai" or settings.reranker == "workers-ai")
    http = cloudflare.shared_client(settings) if cloud else None
    embedder = checked(embedder_for(settings, http), Embedder, f"MEMEX_EMBEDDER={settings.embedder}")
    stores: OrgStores
    if settings.sql == "sqlite":
        control: SqlDatabase = checked(SqliteDatabase(settings.control_path), SqlDatabase, "MEMEX_SQL=sqlite")
        dims, model = embedder.dimensions, embedder.model_id
        stores = EmbeddedOrgStores(
            control, settings.data_dir, dimensions=dims, max_open=settings.max_open_orgs,
            # two readers per organization (searches don't queue behind writes) keep the file handles bounded
            open_database=lambda path: checked(
                SqliteDatabase(path, readers=2, keyword_index_from=settings.keyword_index_from or None), SqlDatabase,
                "MEMEX_SQL=sqlite"),
            open_index=lambda path: checked(
                LocalVectorIndex(path, dimensions=dims, model=model, reset_on_mismatch=True), VectorIndex,
                "MEMEX_VECTORS=local"),
        )
    else:
        if not settings.cloudflare_vectorize_index:
            raise SettingsError("CLOUDFLARE_VECTORIZE_INDEX must be set for MEMEX_VECTORS=vectorize",
                                details={"setting": "CLOUDFLARE_VECTORIZE_INDEX"})
        control = checked(cloudflare.d1_database(settings, http), SqlDatabase, "MEMEX_SQL=d1")
        api = cloudflare.api_for(settings, http)
        stores = D1OrgStores(
            control, admin=cloudflare.d1_admin(settings, http), index_name=settings.cloudflare_vectorize_index,
            account=settings.cloudflare_account_id,
            open_database=lambda uuid: checked(D1Database(api, uuid), SqlDatabase, "MEMEX_SQL=d1"),
            open_index=lambda name: checked(
                VectorizeIndex(api, name, dimensions=embedder.dimensions, model=embedder.model_id), VectorIndex,
                "MEMEX_VECTORS=vectorize"),
        )
    llm = llm_for(settings, http)
    if llm is not None:
        llm = checked(llm, LLM, f"MEMEX_LLM={settings.llm}")
    reranker = reranker_for(settings, http)
    if reranker is not None:
        reranker = checked(reranker, Reranker, f"MEMEX_RERANKER={settings.reranker}")
    return Backend(control=control, stores=stores, embedder=embedder, http=http, llm=llm, reranker=reranker,
                   async_index=settings.vectors == "vectorize")


async def convert_legacy_layout(settings: Settings, backend: Backend) -> ConversionReport | None:
    """At start-up: convert a single-database data directory (the previous release's) into one database per
    organization, with the embedded adapters (services.storage.convert)."""
    return await convert_on_start(settings, backend.control, backend.embedder, open_database=SqliteDatabase,
                                  open_index=LocalVectorIndex)
