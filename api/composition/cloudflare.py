"""The Cloudflare adapters, built from the settings.

Every adapter built on the same ``httpx.AsyncClient`` shares one ``CloudflareApi``: one request budget (default
1,100 requests per 300 s, the token's limit being 1,200 per 5 minutes for the whole API), one set of counters,
one retry policy. ``cloudflare_stats(http)`` reports them for /health and metrics.

Settings read with defaults (``getattr``, so a settings object without them still works):
``cloudflare_budget_limit`` (1100), ``cloudflare_budget_window`` (300.0 s), ``cloudflare_budget_max_wait`` (30.0 s:
how long a call may wait for a budget slot before failing with 503); for ``d1_admin``,
``cloudflare_d1_location_hint`` (weur|eeur|apac|oc|wnam|enam) and ``cloudflare_d1_jurisdiction`` (eu|fedramp)
sent with every database it creates (default: none, Cloudflare picks).
"""

from __future__ import annotations

import weakref
from typing import Any

import httpx

from services.adapters.cloudflare import (
    DEFAULT_LIMIT,
    DEFAULT_MAX_WAIT,
    DEFAULT_WINDOW,
    CloudflareApi,
    D1Admin,
    D1Database,
    RequestBudget,
    VectorizeIndex,
    WorkersAIChat,
    WorkersAIEmbedder,
    WorkersAIReranker,
    http_client,
)
from services.adapters.onnx_embedder import WordPieceCount
from services.errors import InvalidInput
from services.ports import Embedder

__all__ = [
    "shared_client",
    "api_for",
    "api_of",
    "cloudflare_stats",
    "d1_database",
    "d1_admin",
    "vectorize_index",
    "workers_ai_embedder",
    "workers_ai_chat",
    "workers_ai_reranker",
]

_APIS: "weakref.WeakKeyDictionary[httpx.AsyncClient, CloudflareApi]" = weakref.WeakKeyDictionary()
#: The local MiniLM tokenizer's count: bge-base-en-v1.5's own (the same WordPiece vocabulary), loaded once.
_WORDPIECE = WordPieceCount()


def shared_client(settings: Any) -> httpx.AsyncClient:
    """The process's HTTP client for Cloudflare (the backend closes it)."""
    return http_client()


def _require(settings: Any, *names: str, why: str) -> None:
    missing = [n.upper() for n in names if not getattr(settings, n, None)]
    if missing:
        raise InvalidInput(f"{', '.join(missing)} must be set for {why}", details={"missing": missing})


def api_for(settings: Any, http: httpx.AsyncClient | None) -> CloudflareApi:
    """The ``CloudflareApi`` shared by every adapter on ``http`` (made on first use)."""
    _require(settings, "cloudflare_account_id", "cloudflare_api_token", why="the Cloudflare adapters")
    if http is None:
        http = shared_client(settings)
    api = _APIS.get(http)
    if api is None:
        budget = RequestBudget(
            int(getattr(settings, "cloudflare_budget_limit", None) or DEFAULT_LIMIT),
            float(getattr(settings, "cloudflare_budget_window", None) or DEFAULT_WINDOW),
            max_wait=float(getattr(settings, "cloudflare_budget_max_wait", None) or DEFAULT_MAX_WAIT),
        )
        api = CloudflareApi(
            http,
            account_id=settings.cloudflare_account_id,
            api_token=settings.cloudflare_api_token,
            base_url=getattr(settings, "cloudflare_api_base_url", None) or "https://api.cloudflare.com/client/v4",
            budget=budget,
        )
        _APIS[http] = api
    return api


def api_of(http: httpx.AsyncClient | None) -> CloudflareApi | None:
    """The ``CloudflareApi`` already made for ``http``, if any."""
    return _APIS.get(http) if http is not None else None


def cloudflare_stats(http: httpx.AsyncClient | None) -> dict[str, Any] | None:
    """Requests per kind, retries, failures and the budget snapshot; None when no Cloudflare adapter runs."""
    api = api_of(http)
    return api.snapshot() if api is not None else None


def d1_database(settings: Any, http: httpx.AsyncClient | None) -> D1Database:
    _require(settings, "cloudflare_d1_database_id", why="MEMEX_SQL=d1")
    return D1Database(api_for(settings, http), settings.cloudflare_d1_database_id)


def d1_admin(settings: Any, http: httpx.AsyncClient | None) -> D1Admin:
    """Create/list/delete whole D1 databases (one per organization) on the shared API and budget. The control
    database (``cloudflare_d1_database_id``, when set) is protected from deletion."""
    return D1Admin(
        api_for(settings, http),
        protected=[getattr(settings, "cloudflare_d1_database_id", None) or ""],
        primary_location_hint=getattr(settings, "cloudflare_d1_location_hint", None),
        jurisdiction=getattr(settings, "cloudflare_d1_jurisdiction", None),
    )


def vectorize_index(settings: Any, http: httpx.AsyncClient | None, embedder: Embedder) -> VectorizeIndex:
    _require(settings, "cloudflare_vectorize_index", why="MEMEX_VECTORS=vectorize")
    return VectorizeIndex(
        api_for(settings, http),
        settings.cloudflare_vectorize_index,
        dimensions=embedder.dimensions,
        model=embedder.model_id,
    )


def workers_ai_embedder(settings: Any, http: httpx.AsyncClient | None) -> WorkersAIEmbedder:
    """bge-base on Workers AI, counting tokens with the local tokenizer's exact WordPiece count when it loads."""
    return WorkersAIEmbedder(api_for(settings, http), exact_count=_WORDPIECE)


def workers_ai_chat(settings: Any, http: httpx.AsyncClient | None) -> WorkersAIChat:
    return WorkersAIChat(api_for(settings, http))


def workers_ai_reranker(settings: Any, http: httpx.AsyncClient | None) -> WorkersAIReranker:
    return WorkersAIReranker(api_for(settings, http))
