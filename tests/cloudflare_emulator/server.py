"""CloudflareEmulator: state + knobs + a uvicorn server in a background thread."""

from __future__ import annotations

import shutil
import socket
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterable, Iterator

import uvicorn

from .ai import WorkersAI
from .app import ADMIN_PREFIX, API_PREFIX, build_app
from .control import Counters, Faults, RateLimiter
from .d1 import DEFAULT_MAX_DATABASES, D1Store
from .vectorize import VectorizeStore

DEFAULT_ACCOUNT = "test-account"
DEFAULT_TOKEN = "test-token"


def _as_list(v: str | Iterable[str] | None, default: str) -> list[str]:
    if v is None:
        return [default]
    if isinstance(v, str):
        return [v]
    return list(v)


class CloudflareEmulator:
    """A local server speaking Cloudflare's REST wire format for D1, Vectorize v2 and Workers AI.

    >>> emu = CloudflareEmulator(vector_lag_ms=0).start()     # doctest: +SKIP
    >>> emu.base_url                                          # 'http://127.0.0.1:PORT/client/v4'
    >>> emu.stop()

    Every knob can be changed while the server runs (from any thread)."""

    def __init__(
        self,
        *,
        account: str | Iterable[str] | None = None,
        token: str | Iterable[str] | None = None,
        data_dir: str | Path | None = None,
        vector_lag_ms: float = 0,
        rate_limit: int = 1200,
        rate_window_s: float = 300.0,
        databases: Iterable[str] | None = None,
        d1_auto_create: bool | None = None,
        d1_max_databases: int = DEFAULT_MAX_DATABASES,
        host: str = "127.0.0.1",
        port: int = 0,
    ):
        self.accounts: list[str] = _as_list(account, DEFAULT_ACCOUNT)
        self.tokens: list[str] = _as_list(token, DEFAULT_TOKEN)
        self.host = host
        self.port = port
        self._tmp: str | None = None
        if data_dir is None:
            self._tmp = tempfile.mkdtemp(prefix="cf-emulator-")
            root = Path(self._tmp)
            persist_vectors = False
        else:
            root = Path(data_dir)
            root.mkdir(parents=True, exist_ok=True)
            persist_vectors = True
        self.data_dir = root
        self.vector_lag_ms = float(vector_lag_ms)
        self.rate_limiter = RateLimiter(rate_limit, rate_window_s)
        self.faults = Faults()
        self.counters = Counters()
        self.d1 = D1Store(root, None if databases is None else list(databases), auto_create=d1_auto_create,
                          max_databases=d1_max_databases)
        self.vectorize = VectorizeStore(root if persist_vectors else None, lambda: self.vector_lag_ms)
        self.ai = WorkersAI()
        self.app = build_app(self)
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self._sock: socket.socket | None = None

    # -- identity ----------------------------------------------------------------------------------------
    @property
    def account(self) -> str:
        return self.accounts[0]

    @property
    def token(self) -> str:
        return self.tokens[0]

    @property
    def root_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def base_url(self) -> str:
        return self.root_url + API_PREFIX

    @property
    def admin_url(self) -> str:
        return self.root_url + ADMIN_PREFIX

    @property
    def account_url(self) -> str:
        return f"{self.base_url}/accounts/{self.account}"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    # -- lifecycle ---------------------------------------------------------------------------------------
    def start(self, timeout: float = 10.0) -> "CloudflareEmulator":
        if self._thread is not None:
            return self
        # proto=IPPROTO_TCP: asyncio sets TCP_NODELAY only on such sockets; with proto 0 every response waits
        # on Nagle + the client's delayed ACK (~40 ms a request on loopback)
        sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET, socket.SOCK_STREAM,
                             socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        sock.listen(128)
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self.app, log_level="warning", access_log=False, lifespan="off",
                                timeout_keep_alive=30)
        server = uvicorn.Server(config)
        self._server = server
        self._thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]},
                                        name=f"cf-emulator-{self.port}", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("Cloudflare emulator failed to start")
            time.sleep(0.01)
        self._sock = sock
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._server = None
        self._thread = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self.d1.close()
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def __enter__(self) -> "CloudflareEmulator":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # -- knobs -------------------------------------------------------------------------------------------
    def set_rate_limit(self, limit: int | None = None, window_s: float | None = None) -> None:
        """Change the global per-token limit (also clears every window and block)."""
        self.rate_limiter.configure(limit, window_s)

    def reset_rate_limit(self) -> None:
        self.rate_limiter.reset()

    @property
    def d1_max_databases(self) -> int:
        """Databases per account before `POST d1/database` answers 400 / 7406 (default 50,000, Paid plan)."""
        return self.d1.max_databases

    @d1_max_databases.setter
    def d1_max_databases(self, n: int) -> None:
        n = int(n)
        if n < 0:
            raise ValueError("d1_max_databases must be >= 0")
        self.d1.max_databases = n

    @property
    def d1_auto_create(self) -> bool:
        """Whether a never-seen, non-UUID database id springs into existence on first use."""
        return self.d1.auto_create

    @d1_auto_create.setter
    def d1_auto_create(self, on: bool) -> None:
        self.d1.auto_create = bool(on)

    def inject_fault(self, kind: str = "status", count: int = 1, *, path_contains: str | None = None,
                     method: str | None = None, status: int | None = None, retry_after: float | None = None,
                     message: str | None = None, code: int | None = None, after: bool = False,
                     raw_body: str | None = None) -> dict:
        """Make the next `count` matching API requests fail.

        kind="rate_limit": 429 + Retry-After (default 1 s) · kind="status": `status` (default 500) envelope ·
        kind="d1_transient": D1 error body, message "network" (default: "D1_ERROR: Network connection lost."),
        "remote" ("D1_ERROR: transient issue on remote node") or your own text; status default 500.
        after=True runs the request for real and then answers the failure (lost-response case)."""
        f = self.faults.add(kind=kind, count=count, path_contains=path_contains, method=method, status=status,
                            retry_after=retry_after, message=message, code=code, after=after, raw_body=raw_body)
        return {"id": f.id}

    def fail_next(self, n: int = 1, status: int = 500, path_contains: str | None = None, **kw: Any) -> dict:
        return self.inject_fault("status", n, status=status, path_contains=path_contains, **kw)

    def rate_limit_next(self, n: int = 1, retry_after: float = 1, path_contains: str | None = None,
                        **kw: Any) -> dict:
        return self.inject_fault("rate_limit", n, retry_after=retry_after, path_contains=path_contains, **kw)

    def d1_transient_next(self, n: int = 1, message: str = "network", path_contains: str | None = "/d1/",
                          **kw: Any) -> dict:
        return self.inject_fault("d1_transient", n, message=message, path_contains=path_contains, **kw)

    def clear_faults(self) -> None:
        self.faults.clear()

    def counters_snapshot(self) -> dict:
        """{"d1", "vectorize", "ai", "other", "total", "by_op": {...}, "by_status": {...}}"""
        return self.counters.snapshot()

    def reset_counters(self) -> dict:
        """Reset and return the counts accumulated so far."""
        return self.counters.reset()

    def push_llm_response(self, *entries: Any) -> None:
        """Queue canned chat responses (str, JSON-able object, callable(body), or {"__error__": {...}})."""
        self.ai.llm.push(*entries)

    def clear_llm(self) -> None:
        self.ai.llm.clear()

    @property
    def llm_requests(self) -> list[dict]:
        return list(self.ai.llm.requests)

    def flush_vectors(self) -> None:
        """Apply every pending Vectorize mutation now, whatever the lag."""
        self.vectorize.flush()

    def config(self) -> dict:
        return {
            "accounts": self.accounts,
            "tokens_configured": len(self.tokens),
            "vector_lag_ms": self.vector_lag_ms,
            "rate_limit": self.rate_limiter.limit,
            "rate_window_s": self.rate_limiter.window_s,
            "data_dir": str(self.data_dir),
            "d1_fixed_databases": None if self.d1.fixed is None else sorted(self.d1.fixed),
            "d1_auto_create": self.d1_auto_create,
            "d1_max_databases": self.d1_max_databases,
        }

    # -- admin HTTP (same knobs, for an emulator started in another process) -----------------------------
    def admin(self, method: str, path: str, body: dict) -> Any:
        route = (method, path)
        if route == ("GET", "/health"):
            return {"ok": True}
        if route == ("GET", "/config"):
            return self.config()
        if route == ("POST", "/config"):
            allowed = {"vector_lag_ms", "rate_limit", "rate_window_s", "d1_max_databases", "d1_auto_create"}
            if set(body) - allowed:
                raise ValueError(f"unknown config keys {sorted(set(body) - allowed)}")
            if "d1_auto_create" in body and not isinstance(body["d1_auto_create"], bool):
                raise ValueError("d1_auto_create must be true or false")
            if "d1_max_databases" in body:
                self.d1_max_databases = body["d1_max_databases"]
            if "d1_auto_create" in body:
                self.d1_auto_create = body["d1_auto_create"]
            if "vector_lag_ms" in body:
                self.vector_lag_ms = float(body["vector_lag_ms"])
            if "rate_limit" in body or "rate_window_s" in body:
                self.set_rate_limit(body.get("rate_limit"), body.get("rate_window_s"))
            return self.config()
        if route == ("POST", "/rate_limit/reset"):
            self.reset_rate_limit()
            return {"ok": True}
        if route == ("GET", "/rate_limit"):
            return self.rate_limiter.snapshot()
        if route == ("GET", "/counters"):
            return self.counters_snapshot()
        if route == ("POST", "/counters/reset"):
            return self.reset_counters()
        if route == ("GET", "/faults"):
            return {"faults": self.faults.list()}
        if route == ("POST", "/faults"):
            return self.inject_fault(**body)
        if route == ("DELETE", "/faults"):
            self.clear_faults()
            return {"ok": True}
        if route == ("POST", "/llm/responses"):
            responses = body.get("responses")
            if not isinstance(responses, list):
                raise ValueError("body must be {\"responses\": [...]}")
            self.push_llm_response(*responses)
            return {"pending": self.ai.llm.pending()}
        if route == ("DELETE", "/llm/responses"):
            self.clear_llm()
            return {"ok": True}
        if route == ("GET", "/llm/requests"):
            return {"requests": self.llm_requests}
        if route == ("POST", "/vectorize/flush"):
            self.flush_vectors()
            return {"ok": True}
        if route == ("GET", "/vectorize/pending"):
            return {"pending": self.vectorize.pending_count()}
        raise KeyError(path)


@contextmanager
def running_emulator(**kwargs: Any) -> Iterator[CloudflareEmulator]:
    """`with running_emulator(vector_lag_ms=500) as emu: httpx.get(emu.base_url + ...)`"""
    emu = CloudflareEmulator(**kwargs).start()
    try:
        yield emu
    finally:
        emu.stop()
