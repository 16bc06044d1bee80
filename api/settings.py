"""Settings: the one place that reads the environment. Built once at the root and passed down."""

from __future__ import annotations

import os
import importlib.util
from dataclasses import dataclass, field, replace
from pathlib import Path

from services.errors import InvalidInput

__all__ = ["Settings", "SettingsError", "CHOICES"]


def _env(name: str, default: str | None = None) -> str | None:
    value = os.environ.get(name)
    return value if value not in (None, "") else default


class SettingsError(InvalidInput, ValueError):
    """A setting with a value Memex cannot run with: refused at start-up with a message naming the variable
    and what it accepts (``memex`` prints it and exits with status 2)."""


def _int(name: str, default: int) -> int:
    raw = _env(name)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise SettingsError(f"{name} must be an integer, not {raw!r}", details={"setting": name}) from None


def _float(name: str, default: float) -> float:
    raw = _env(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if value != value or value in (float("inf"), float("-inf")):
        raise SettingsError(f"{name} must be a number, not {raw!r}", details={"setting": name})
    return value


def _decisions(name: str = "MEMEX_DECISIONS") -> str:
    raw = (_env(name, "on") or "on").lower()
    if raw in ("on", "1", "true", "yes"):
        return "on"
    if raw in ("off", "0", "false", "no"):
        return "off"
    if raw == "full":
        return "full"
    raise SettingsError(f"{name} must be one of on, off, full, not {raw!r}", details={"setting": name})


def _local_reranker_installed() -> bool:
    """Whether an offline reranker adapter ships with this install (MEMEX_RERANKER=local needs one)."""
    try:
        return importlib.util.find_spec("services.adapters.local_reranker") is not None
    except (ImportError, ValueError):
        return False


#: The settings that name one of a few choices: field -> (environment variable, the values it accepts).
#: Anything else is refused when Settings is built, before any adapter is chosen.
CHOICES: dict[str, tuple[str, tuple[str, ...]]] = {
    "sql": ("MEMEX_SQL", ("sqlite", "d1")),
    "vectors": ("MEMEX_VECTORS", ("local", "vectorize")),
    "embedder": ("MEMEX_EMBEDDER", ("local", "workers-ai", "hash")),
    "llm": ("MEMEX_LLM", ("none", "workers-ai", "openai")),
    "llm_response_format": ("MEMEX_LLM_RESPONSE_FORMAT", ("json_schema", "json_object")),
    "reranker": ("MEMEX_RERANKER", ("none", "workers-ai")),  # + "local" when an adapter is installed
    "client_ip_header": ("MEMEX_CLIENT_IP_HEADER", ("x-forwarded-for", "cf-connecting-ip")),
    "backend": ("MEMEX_BACKEND", ("direct", "worker")),
    "log_format": ("MEMEX_LOG_FORMAT", ("text", "json")),
}


def _list(name: str) -> list[str]:
    raw = _env(name)
    return [p.strip() for p in raw.split(",") if p.strip()] if raw else []


#: Rate settings (field -> variable): each must be at least 1.
_RATES = {
    "key_rate_per_minute": "MEMEX_KEY_RATE_PER_MINUTE",
    "org_rate_per_minute": "MEMEX_ORG_RATE_PER_MINUTE",
    "signup_rate_per_hour": "MEMEX_SIGNUP_RATE_PER_HOUR",
    "auth_failures_per_minute": "MEMEX_AUTH_FAILURES_PER_MINUTE",
    "auth_address_failures_per_minute": "MEMEX_AUTH_ADDRESS_FAILURES_PER_MINUTE",
    "kb_public_rate_per_minute": "MEMEX_KB_PUBLIC_RATE_PER_MINUTE",
}


#: Settings that no longer exist, refused at start-up rather than silently ignored.
_REMOVED = {
    "MEMEX_RANK_RECALL_TOP": "searches no longer count as uses of what they return (ranking fed on itself); "
                             "a thought fetched by id or marked used (POST /v1/thoughts/{id}/used) counts",
}


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
    #: ``direct`` (MEMEX_SQL / MEMEX_VECTORS choose the stores) or ``worker``: every store and Workers AI behind the
    #: data-plane Worker (worker/, docs/worker-protocol.md) at MEMEX_WORKER_URL; ``sql`` and ``vectors`` then read
    #: ``worker``.
    backend: str = "direct"
    #: The Worker's base URL (https, or http on a loopback address for `memex cloudflare dev`).
    worker_url: str | None = None
    #: The secret shared with the Worker (HMAC-SHA256 request signatures), at least 32 bytes.
    worker_secret: str | None = field(default=None, repr=False)
    #: Public base URL printed in messages (defaults to http://host:port).
    public_url: str | None = None
    #: Largest thought accepted, in bytes of UTF-8 (413 above).
    max_content_bytes: int = 256 * 1024
    #: Largest metadata object accepted, in bytes of its JSON.
    max_metadata_bytes: int = 16 * 1024
    #: Requests a credential (API key, Access user or service token, per organization) may make per minute.
    key_rate_per_minute: int = 1200
    #: Requests one organization may make per minute, all its credentials together.
    org_rate_per_minute: int = 6000
    #: Sign-ups a client address may make per hour.
    signup_rate_per_hour: int = 20
    #: Failed authentications per minute from one client address with one credential prefix (a key's id,
    #: ``access``, ``malformed``, ``none``) before 429; a valid credential is still accepted.
    auth_failures_per_minute: int = 30
    #: Failed authentications per minute from one client address, all prefixes together, before 429.
    auth_address_failures_per_minute: int = 120
    #: Where rate-limit counters live: a `limits` storage URI. ``memory://`` (per process); a shared one
    #: (``redis://``, ``rediss://``, ``redis+sentinel://``, ``memcached://``, ``mongodb://``) where several
    #: processes serve; its client library is installed separately.
    rate_limit_storage: str = "memory://"
    #: Proxies whose client-address header is believed (IPs or CIDRs); none by default: the TCP peer is the client.
    trusted_proxies: list[str] = field(default_factory=list)
    #: Which header a trusted proxy names the client in: ``x-forwarded-for`` or ``cf-connecting-ip``.
    client_ip_header: str = "x-forwarded-for"
    #: Seconds a verified key stays cached in process (at most 60).
    key_cache_seconds: int = 60
    #: Longest a cached key goes unchecked against the revocation log (0-0.9 s: a revocation anywhere stops it
    #: within a second). Under traffic it costs one SQL read per interval per instance (on D1, API requests).
    key_revocation_check_seconds: float = 0.5
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
    #: Organization databases and vector files open at once (embedded; the least recently used idle one closes
    #: when another opens). Each open organization costs a few file handles and its vectors' memory.
    max_open_orgs: int = 64
    #: Embedded: organizations with at least this many thoughts (conversation chunks) rank their thoughts' (their
    #: conversations') keyword side with a tantivy index kept beside their database
    #: (services/adapters/keyword_index.py); 0 turns both off. FTS5 answers below it, and whenever an index is behind.
    keyword_index_from: int = 10_000
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
    #: Which language model enriches and decides: ``none`` (deterministic paths only), ``workers-ai`` or ``openai``.
    llm: str = "none"
    #: OpenAI-compatible endpoint base URL (e.g. https://api.openai.com/v1, http://localhost:11434/v1 for Ollama).
    llm_base_url: str | None = None
    #: Model name for MEMEX_LLM=openai (required there); overrides @cf/meta/llama-3.1-8b-instruct for workers-ai.
    llm_model: str | None = None
    #: API key sent as a Bearer token to the OpenAI-compatible endpoint (none for local servers).
    llm_api_key: str | None = None
    #: ``response_format`` asked of the OpenAI-compatible endpoint: ``json_schema`` or ``json_object``.
    llm_response_format: str = "json_schema"
    #: Second-stage reranker: ``none`` or ``workers-ai`` (bge-reranker-base); ``local`` only where an offline
    #: adapter (services/adapters/local_reranker.py) is installed: none ships today, so it is refused.
    reranker: str = "none"
    #: LLM calls one organization may make per UTC day (over it, enrichment is skipped and recorded).
    llm_calls_per_day: int = 500
    #: LLM tokens (prompt + completion) one organization may spend per UTC day.
    llm_tokens_per_day: int = 200_000
    #: How many of an organization's most used tags are offered to the model for reuse.
    enrich_vocabulary_size: int = 30

    #: Write-time decisions on capture (duplicate / contradiction / replace / merge bands); off: every new
    #: content is simply created (no embedding or vector query on the capture path).
    decisions: bool = True
    #: MEMEX_DECISIONS=full: embed every capture for its decision. The default (on) skips the model run on the
    #: request path when no language model is configured and no thought shares enough words to be >= 0.85 close.
    decisions_full: bool = False
    #: Ranking half-lives in days (recency = 0.5 ** (age / half-life)) for task-like, work and context thoughts.
    rank_task_half_life_days: float = 7.0
    rank_work_half_life_days: float = 90.0
    rank_context_half_life_days: float = 180.0
    #: Tags that make a thought task-like / context (empty: the built-in lists in services.search.ranking).
    rank_task_tags: list[str] = field(default_factory=list)
    rank_context_tags: list[str] = field(default_factory=list)
    #: Seconds a reranker's result is reused for the same query and candidates (in process).
    rerank_cache_seconds: float = 3600.0
    #: Folders under which a knowledge base's git source may be a local path (a tenant may not name any path of the
    #: server's: none by default; ``memex kb create`` from the shell, the operator, is not bound by it).
    kb_local_roots: list[str] = field(default_factory=list)
    #: Whether a knowledge base's git source may be plain http:// (https only by default).
    kb_allow_http: bool = False
    #: Where knowledge bases' git sources are mirrored (a cache, rebuilt from the source when lost); default
    #: ``<data dir>/kb-cache``.
    kb_cache_dir: Path | None = None
    #: Requests per minute one client address may make without a credential to published knowledge bases.
    kb_public_rate_per_minute: int = 600
    #: How the request log (one line per request, logger ``memex.request``) is written: ``text`` (through the
    #: process's logging) or ``json`` (one JSON object per line on stderr).
    log_format: str = "text"

    def __post_init__(self) -> None:
        self._check_worker()
        for name, (env, allowed) in CHOICES.items():
            value = getattr(self, name)
            if name in ("sql", "vectors") and value == "worker" and self.backend == "worker":
                continue
            if isinstance(value, str) and value != value.strip().lower():  # MEMEX_LLM=OpenAI means openai
                value = value.strip().lower()
                object.__setattr__(self, name, value)
            if name == "reranker" and value == "local":
                if _local_reranker_installed():
                    continue
                raise SettingsError(
                    f"{env}=local needs an offline reranker adapter (services/adapters/local_reranker.py), and none "
                    f"is installed; {env} must be one of {', '.join(allowed)}",
                    details={"setting": env, "allowed": list(allowed)},
                )
            if value not in allowed:
                raise SettingsError(
                    f"{env} must be one of {', '.join(allowed)}, not {value!r}",
                    details={"setting": env, "allowed": list(allowed)},
                )

        self._check_limits()

    def _check_worker(self) -> None:
        """MEMEX_BACKEND=worker replaces MEMEX_SQL and MEMEX_VECTORS; the Worker's URL and secret, where given, are
        checked here (their presence when the Worker backend is built: api.composition.backend)."""
        backend = str(self.backend or "direct").strip().lower()
        object.__setattr__(self, "backend", backend)
        if backend == "worker":
            sql, vectors = str(self.sql).strip().lower(), str(self.vectors).strip().lower()
            if sql not in ("sqlite", "worker") or vectors not in ("local", "worker"):
                raise SettingsError(
                    f"MEMEX_BACKEND=worker keeps every database and vector behind the Worker: unset MEMEX_SQL and "
                    f"MEMEX_VECTORS (they say {sql} and {vectors})", details={"setting": "MEMEX_BACKEND"})
            object.__setattr__(self, "sql", "worker")
            object.__setattr__(self, "vectors", "worker")
        if self.worker_url is not None:
            from urllib.parse import urlsplit

            url = urlsplit(self.worker_url.strip())
            host = (url.hostname or "").lower()
            loopback = host in ("localhost", "::1") or host.startswith("127.")
            if url.scheme not in ("https", "http") or not host or url.query or url.fragment or url.username:
                raise SettingsError(f"MEMEX_WORKER_URL must be the Worker's base URL (https://...), not "
                                    f"{self.worker_url!r}", details={"setting": "MEMEX_WORKER_URL"})
            if url.scheme == "http" and not loopback:
                raise SettingsError("MEMEX_WORKER_URL must use https (plain http only on a loopback address, for "
                                    f"`memex cloudflare dev`), not {self.worker_url!r}",
                                    details={"setting": "MEMEX_WORKER_URL"})
        if self.worker_secret is not None and len(self.worker_secret.encode("utf-8")) < 32:
            raise SettingsError(
                f"MEMEX_WORKER_SECRET must be at least 32 bytes (it is {len(self.worker_secret.encode('utf-8'))}): "
                "generate one with `python -c 'import secrets; print(secrets.token_urlsafe(48))'` and give the Worker "
                "the same (wrangler secret put MEMEX_WORKER_SECRET)", details={"setting": "MEMEX_WORKER_SECRET"})

    def _check_limits(self) -> None:
        if self.keyword_index_from < 0:
            raise SettingsError(f"MEMEX_KEYWORD_INDEX_FROM must be 0 (off) or a number of thoughts, not "
                                f"{self.keyword_index_from}", details={"setting": "MEMEX_KEYWORD_INDEX_FROM"})
        for name, env in _RATES.items():
            if getattr(self, name) < 1:
                raise SettingsError(f"{env} must be at least 1, not {getattr(self, name)}", details={"setting": env})
        from tenancy.addresses import parse_networks
        from tenancy.ratelimit import ConfigurationError, storage_for

        try:
            parse_networks(self.trusted_proxies)
        except ValueError as exc:
            raise SettingsError(f"MEMEX_TRUSTED_PROXIES: {exc}; give comma-separated IPs or CIDRs",
                                details={"setting": "MEMEX_TRUSTED_PROXIES"}) from None
        try:
            storage_for(self.rate_limit_storage)
        except (ConfigurationError, ValueError) as exc:
            raise SettingsError(
                f"MEMEX_RATE_LIMIT_STORAGE={self.rate_limit_storage.split('@')[-1]!r} cannot be used: {exc} "
                "(memory://, redis://, rediss://, redis+sentinel://, redis+cluster://, memcached://, mongodb://)",
                details={"setting": "MEMEX_RATE_LIMIT_STORAGE"},
            ) from None

    @property
    def control_path(self) -> Path:
        """The embedded control database (organizations, keys, bindings, usage, routing)."""
        return self.data_dir / "control.sqlite3"

    @property
    def orgs_dir(self) -> Path:
        """Where the embedded backend keeps one folder per organization (its database and vector file)."""
        return self.data_dir / "orgs"

    @property
    def legacy_sqlite_path(self) -> Path:
        """The single database of releases before one database per organization (converted at start)."""
        return self.data_dir / "memex.sqlite3"

    @property
    def legacy_vectors_path(self) -> Path:
        return self.data_dir / "vectors.sqlite3"

    @property
    def kb_cache_root(self) -> Path:
        return self.kb_cache_dir or self.data_dir / "kb-cache"

    @property
    def access_enabled(self) -> bool:
        return bool(self.access_team_domain and self.access_audience)

    def with_(self, **changes) -> "Settings":
        return replace(self, **changes)

    @classmethod
    def from_env(cls, **overrides) -> "Settings":
        for name, why in _REMOVED.items():
            if os.environ.get(name) is not None:
                raise SettingsError(f"{name} is no longer a setting: {why}; unset it", details={"setting": name})
        base = cls(
            data_dir=Path(_env("MEMEX_DATA_DIR", "./data")),
            sql=_env("MEMEX_SQL", "sqlite"),
            vectors=_env("MEMEX_VECTORS", "local"),
            embedder=_env("MEMEX_EMBEDDER", "local"),
            backend=_env("MEMEX_BACKEND", "direct"),
            worker_url=_env("MEMEX_WORKER_URL"),
            worker_secret=_env("MEMEX_WORKER_SECRET"),
            public_url=_env("MEMEX_PUBLIC_URL"),
            max_content_bytes=_int("MEMEX_MAX_CONTENT_BYTES", 256 * 1024),
            max_metadata_bytes=_int("MEMEX_MAX_METADATA_BYTES", 16 * 1024),
            key_rate_per_minute=_int("MEMEX_KEY_RATE_PER_MINUTE", 1200),
            org_rate_per_minute=_int("MEMEX_ORG_RATE_PER_MINUTE", 6000),
            signup_rate_per_hour=_int("MEMEX_SIGNUP_RATE_PER_HOUR", 20),
            auth_failures_per_minute=_int("MEMEX_AUTH_FAILURES_PER_MINUTE", 30),
            auth_address_failures_per_minute=_int("MEMEX_AUTH_ADDRESS_FAILURES_PER_MINUTE", 120),
            rate_limit_storage=_env("MEMEX_RATE_LIMIT_STORAGE", "memory://"),
            trusted_proxies=_list("MEMEX_TRUSTED_PROXIES"),
            client_ip_header=_env("MEMEX_CLIENT_IP_HEADER", "x-forwarded-for"),
            key_cache_seconds=min(60, _int("MEMEX_KEY_CACHE_SECONDS", 60)),
            key_revocation_check_seconds=min(0.9, _float("MEMEX_KEY_REVOCATION_CHECK_SECONDS", 0.5)),
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
            cloudflare_budget_window=_float("MEMEX_CLOUDFLARE_BUDGET_WINDOW", 300.0),
            llm=_env("MEMEX_LLM", "none"),
            llm_base_url=_env("MEMEX_LLM_BASE_URL"),
            llm_model=_env("MEMEX_LLM_MODEL"),
            llm_api_key=_env("MEMEX_LLM_API_KEY"),
            llm_response_format=_env("MEMEX_LLM_RESPONSE_FORMAT", "json_schema"),
            reranker=_env("MEMEX_RERANKER", "none"),
            llm_calls_per_day=_int("MEMEX_LLM_CALLS_PER_DAY", 500),
            llm_tokens_per_day=_int("MEMEX_LLM_TOKENS_PER_DAY", 200_000),
            enrich_vocabulary_size=_int("MEMEX_ENRICH_VOCABULARY_SIZE", 30),
            decisions=_decisions() != "off",
            decisions_full=_decisions() == "full",
            rank_task_half_life_days=_float("MEMEX_RANK_TASK_HALF_LIFE_DAYS", 7.0),
            rank_work_half_life_days=_float("MEMEX_RANK_WORK_HALF_LIFE_DAYS", 90.0),
            rank_context_half_life_days=_float("MEMEX_RANK_CONTEXT_HALF_LIFE_DAYS", 180.0),
            rank_task_tags=_list("MEMEX_RANK_TASK_TAGS"),
            rank_context_tags=_list("MEMEX_RANK_CONTEXT_TAGS"),
            rerank_cache_seconds=_float("MEMEX_RERANK_CACHE_SECONDS", 3600.0),
            max_open_orgs=_int("MEMEX_MAX_OPEN_ORGS", 64),
            keyword_index_from=_int("MEMEX_KEYWORD_INDEX_FROM", 10_000),
            kb_local_roots=_list("MEMEX_KB_LOCAL_ROOTS"),
            kb_allow_http=(_env("MEMEX_KB_ALLOW_HTTP", "false") or "").strip().lower() in ("1", "true", "yes", "on"),
            kb_cache_dir=Path(c) if (c := _env("MEMEX_KB_CACHE_DIR")) else None,
            kb_public_rate_per_minute=_int("MEMEX_KB_PUBLIC_RATE_PER_MINUTE", 600),
            log_format=_env("MEMEX_LOG_FORMAT", "text"),
        )
        return replace(base, **overrides)
