"""Cloudflare adapters: D1 (``SqlDatabase``), Vectorize v2 (``VectorIndex``) and Workers AI (``Embedder``, the
chat and reranker clients) over the REST API with httpx.

Every adapter takes a ``CloudflareApi``: the adapters built on one API object share one request budget (default
1,100 requests per 300 s, the token's limit being 1,200 per 5 minutes for the whole API), one set of counters,
one retry policy. The composition root (``api.composition.cloudflare``) reads the settings and builds them, one
``CloudflareApi`` per HTTP client (``http_client()``); nothing here reads settings.
"""

from __future__ import annotations

from .budget import DEFAULT_LIMIT, DEFAULT_MAX_WAIT, DEFAULT_WINDOW, BudgetExhausted, RequestBudget
from .client import (
    CloudflareApi,
    CloudflareApiError,
    CloudflareAuthError,
    CloudflareNotFound,
    CloudflareRateLimited,
    default_timeout,
    http_client,
)
from .d1 import D1Database, D1Error, D1IntegrityError, D1OperationalError, D1ProgrammingError
from .d1_admin import D1AccountLimit, D1Admin
from .vectorize import VectorizeIndex, model_description
from .workers_ai import WorkersAIChat, WorkersAIEmbedder, WorkersAIReranker

__all__ = [
    "http_client",
    "default_timeout",
    "CloudflareApi",
    "CloudflareApiError",
    "CloudflareAuthError",
    "CloudflareNotFound",
    "CloudflareRateLimited",
    "BudgetExhausted",
    "RequestBudget",
    "DEFAULT_LIMIT",
    "DEFAULT_MAX_WAIT",
    "DEFAULT_WINDOW",
    "D1Database",
    "D1Admin",
    "D1AccountLimit",
    "D1Error",
    "D1IntegrityError",
    "D1OperationalError",
    "D1ProgrammingError",
    "VectorizeIndex",
    "WorkersAIEmbedder",
    "WorkersAIChat",
    "WorkersAIReranker",
    "model_description",
]
