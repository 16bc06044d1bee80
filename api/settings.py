"""Settings: the one place that reads the environment. Built once at the root and passed down."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path

__all__ = ["Settings"]


def _env(name: str, default: str | None = None) -> str | None:
    value = os.environ.get(name)
    return value if value not in (None, "") else default


def _int(name: str, default: int) -> int:
    raw = _env(name)
    return int(raw) if raw is not None else default


def _list(name: str) -> list[str]:
    raw = _env(name)
    return [p.strip() for p in raw.split(",") if p.strip()] if raw else []


@dataclass(frozen=True)
class Settings:
    #: Directory holding the SQLite database and the local vector index.
    data_dir: Path = Path("./data")
    #: Which SQL adapter: ``sqlite`` (embedded) or ``d1`` (Cloudflare D1 over REST).
    sql: str = "sqlite"
    #: Which vector adapter: ``local`` (numpy, exact) or ``vectorize`` (Cloudflare Vectorize v2).
    vectors: str = "local"
    #: Which embedder: ``local`` (MiniLM ONNX, offline), ``workers-ai`` (bge-base) or ``hash`` (tests only).
    embedder: str = "local"
    #: Public base URL printed in messages (defaults to http://host:port).
    public_url: str | None = None
    #: Largest thought accepted, in bytes of UTF-8 (413 above).
    max_content_bytes: int = 256 * 1024
    #: Largest metadata object accepted, in bytes of its JSON.
    max_metadata_bytes: int = 16 * 1024
    #: Requests a key may make per minute (429 above).
    key_rate_per_minute: int = 1200
    #: Sign-ups a client address may make per hour.
    signup_rate_per_hour: int = 20
    #: Failed authentications a client address may make per minute before 429.
    auth_failures_per_minute: int = 30
    #: Seconds a verified key stays cached in process (at most 60).
    key_cache_seconds: int = 60
    #: Cloudflare Access team domain (https://<team>.cloudflareaccess.com); Access is on when this and the AUD are set.
    access_team_domain: str | None = None
    #: Cloudflare Access application AUD tag(s).
    access_audience: list[str] = field(default_factory=list)
    #: JWKS URL override (tests point it at loopback).
    access_jwks_url: str | None = None
    #: MCP Host header allow-list (empty = no Host/Origin checking).
    mcp_allowed_hosts: list[str] = field(default_factory=list)
    #: MCP Origin allow-list.
    mcp_allowed_origins: list[str] = field(default_factory=list)
    #: Seconds between job-table polls when no local capture woke the worker.
    worker_poll_seconds: float = 1.0
    #: Whether the in-process embedding worker runs (off for CLI one-shots).
    run_worker: bool = True
    #: Cloudflare credentials and resources (used by the d1 / vectorize / workers-ai adapters).
    cloudflare_account_id: str | None = None
    cloudflare_api_token: str | None = None
    cloudflare_d1_database_id: str | None = None
    cloudflare_vectorize_index: str | None = None
    cloudflare_api_base_url: str = "https://api.cloudflare.com/client/v4"
    #: Client-side request budget for the whole Cloudflare API (the token's limit is 1200 per 300 s; with N
    #: instances sharing a token, give each about 1100/N).
    cloudflare_budget_limit: int = 1100
    #: The budget's window in seconds.
    cloudflare_budget_window: float = 300.0
    #: Longest a call waits for a budget slot before failing with 503.
    cloudflare_budget_max_wait: float = 30.0

    @property
    def sqlite_path(self) -> Path:
        return self.data_dir / "memex.sqlite3"

    @property
    def vectors_path(self) -> Path:
        return self.data_dir / "vectors.sqlite3"

    @property
    def access_enabled(self) -> bool:
        return bool(self.access_team_domain and self.access_audience)

    def with_(self, **changes) -> "Settings":
        return replace(self, **changes)

    @classmethod
    def from_env(cls, **overrides) -> "Settings":
        base = cls(
            data_dir=Path(_env("MEMEX_DATA_DIR", "./data")),
            sql=_env("MEMEX_SQL", "sqlite"),
            vectors=_env("MEMEX_VECTORS", "local"),
            embedder=_env("MEMEX_EMBEDDER", "local"),
            public_url=_env("MEMEX_PUBLIC_URL"),
            max_content_bytes=_int("MEMEX_MAX_CONTENT_BYTES", 256 * 1024),
            max_metadata_bytes=_int("MEMEX_MAX_METADATA_BYTES", 16 * 1024),
            key_rate_per_minute=_int("MEMEX_KEY_RATE_PER_MINUTE", 1200),
            signup_rate_per_hour=_int("MEMEX_SIGNUP_RATE_PER_HOUR", 20),
            auth_failures_per_minute=_int("MEMEX_AUTH_FAILURES_PER_MINUTE", 30),
            key_cache_seconds=min(60, _int("MEMEX_KEY_CACHE_SECONDS", 60)),
            access_team_domain=_env("MEMEX_ACCESS_TEAM_DOMAIN"),
            access_audience=_list("MEMEX_ACCESS_AUD"),
            access_jwks_url=_env("MEMEX_ACCESS_JWKS_URL"),
            mcp_allowed_hosts=_list("MEMEX_MCP_ALLOWED_HOSTS"),
            mcp_allowed_origins=_list("MEMEX_MCP_ALLOWED_ORIGINS"),
            cloudflare_account_id=_env("CLOUDFLARE_ACCOUNT_ID"),
            cloudflare_api_token=_env("CLOUDFLARE_API_TOKEN"),
            cloudflare_d1_database_id=_env("CLOUDFLARE_D1_DATABASE_ID"),
            cloudflare_vectorize_index=_env("CLOUDFLARE_VECTORIZE_INDEX"),
            cloudflare_api_base_url=_env("CLOUDFLARE_API_BASE_URL", "https://api.cloudflare.com/client/v4"),
            cloudflare_budget_limit=_int("MEMEX_CLOUDFLARE_BUDGET", 1100),
            cloudflare_budget_window=float(_env("MEMEX_CLOUDFLARE_BUDGET_WINDOW", "300")),
        )
        return replace(base, **overrides)
