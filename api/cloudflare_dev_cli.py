"""``memex cloudflare dev``: the data-plane Worker on this machine, for ``memex serve`` to use.

It starts two processes and keeps them running until Ctrl-C:

1. the Cloudflare REST emulator (``python -m tests.cloudflare_emulator``, from this repository: a test package, so the
   command runs from a checkout, which it needs anyway for worker/). ``wrangler dev`` simulates D1 and the Durable
   Objects but not Vectorize or Workers AI; the Worker reaches those over the REST wire format at ``CF_EMULATOR_URL``.
   The index (``memex-bge-768``, 768 dimensions, cosine) and its metadata indexes are created there first, as the
   README's wrangler steps do on a real account;
2. the Worker: ``worker/node_modules/.bin/wrangler dev -c wrangler.toml --local --ip 127.0.0.1 --port P --persist-to
   <state>/wrangler --env-file <state>/.dev.vars`` in the repository root. ``<state>/.dev.vars`` holds
   ``MEMEX_WORKER_SECRET`` (generated once, 64 random characters, kept across restarts so the printed exports stay
   valid), ``CF_EMULATOR_URL``, ``CF_ACCOUNT_ID`` and ``CF_API_TOKEN`` (the emulator's), mode 0600.

It waits until the Worker answers a signed ``ping`` and prints the ``export`` line for ``memex serve``. State (the
control D1 database, every organization's Durable Object, the emulator's vectors) persists in ``--state-dir``
(default ``.memex-dev/`` in the repository). Node.js (>= 20.3) and ``npm ci --prefix worker`` are the prerequisites;
without them it says so and exits 2.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import httpx

from services.errors import InvalidInput, MemexError

__all__ = ["DevStack", "DevSetupError", "start_dev", "find_root", "add_command", "cmd_cloudflare_dev"]

EMBED_MODEL_ID = "@cf/baai/bge-base-en-v1.5:mean"
DEFAULT_INDEX = "memex-bge-768"  # api.composition.worker.DEFAULT_INDEX (loaded only when the command runs)
#: The metadata indexes Memex filters on (services.adapters.cloudflare.vectorize.INDEXED_PROPERTIES, repeated here:
#: api modules do not import adapters; tests/test_worker_live.py checks the two agree).
INDEXED_PROPERTIES: dict[str, str] = {"organization_id": "string", "kind": "string", "parent_id": "string",
                                      "kb": "string", "contentType": "string", "group": "string", "release": "string",
                                      "status": "string", "date": "number"}


class DevSetupError(InvalidInput):
    """What ``memex cloudflare dev`` needs is missing (Node, the Worker's npm packages, a free port)."""


def find_root(start: Path | None = None) -> Path:
    """The repository checkout: the first of ``start`` (default: the current directory), its parents, and the folder
    above this package that holds ``wrangler.toml`` and ``worker/package.json``."""
    here = (start or Path.cwd()).resolve()
    for candidate in (here, *here.parents, Path(__file__).resolve().parents[1]):
        if (candidate / "wrangler.toml").is_file() and (candidate / "worker" / "package.json").is_file():
            return candidate
    raise DevSetupError("memex cloudflare dev runs from a checkout of the repository (wrangler.toml and worker/ "
                        "were not found here or above)")


def preflight(root: Path) -> Path:
    """The wrangler executable; ``DevSetupError`` naming the fix when Node or the Worker's packages are missing."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        raise DevSetupError("memex cloudflare dev needs Node.js (>= 20.3) and npm on PATH: install them "
                            "(e.g. apt-get install nodejs npm), then run: npm ci --prefix worker")
    wrangler = root / "worker" / "node_modules" / ".bin" / "wrangler"
    if not wrangler.exists():
        raise DevSetupError(f"the Worker's npm packages are not installed ({wrangler} is missing): run "
                            f"npm ci --prefix {root / 'worker'}")
    return wrangler


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _read_vars(path: Path) -> dict[str, str]:
    out: dict[str, str] = {}
    if path.exists():
        for line in path.read_text(encoding="utf-8").splitlines():
            key, sep, value = line.partition("=")
            if sep and not key.strip().startswith("#"):
                out[key.strip()] = value.strip()
    return out


def write_dev_vars(path: Path, values: dict[str, str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write("# written by `memex cloudflare dev`: the Worker's local secrets (not committed)\n")
        for k, v in values.items():
            f.write(f"{k}={v}\n")
    os.chmod(path, 0o600)


def _stop(proc: subprocess.Popen[Any] | None, timeout: float = 15.0) -> None:
    """End a child this command started, and its process group (wrangler runs workerd under it)."""
    if proc is None or proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=5)


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


@dataclass
class DevStack:
    """The running emulator and Worker (``stop()`` ends both)."""

    root: Path
    state: Path
    port: int
    emulator_url: str
    secret: str
    index: str
    ping: dict[str, Any] = field(default_factory=dict)
    emulator: subprocess.Popen[Any] | None = None
    worker: subprocess.Popen[Any] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def admin_url(self) -> str:
        """The emulator's admin endpoints (request counters, flush): ``.../__emulator``."""
        return self.emulator_url.split("/client/v4")[0] + "/__emulator"

    def env(self) -> dict[str, str]:
        return {"MEMEX_BACKEND": "worker", "MEMEX_WORKER_URL": self.url, "MEMEX_WORKER_SECRET": self.secret,
                "MEMEX_EMBEDDER": "workers-ai", "CLOUDFLARE_VECTORIZE_INDEX": self.index}

    def exports(self) -> str:
        return "export " + " ".join(f"{k}={v}" for k, v in self.env().items())

    def stop(self) -> None:
        _stop(self.worker)
        _stop(self.emulator)

    def __enter__(self) -> "DevStack":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def _start_emulator(root: Path, state: Path, port: int, vector_lag_ms: float) -> tuple[subprocess.Popen[Any], str]:
    log = open(state / "emulator.log", "ab")  # noqa: SIM115 - the child writes it for its lifetime
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.cloudflare_emulator", "--port", str(port), "--data-dir", str(state / "emulator"),
         "--vector-lag-ms", str(vector_lag_ms), "--rate-limit", "1000000"],
        cwd=root, stdout=subprocess.PIPE, stderr=log, start_new_session=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p)},
    )
    log.close()
    assert proc.stdout is not None
    line = proc.stdout.readline().decode().strip()
    if not line.startswith("http"):
        _stop(proc)
        raise DevSetupError(f"the Cloudflare emulator did not start: {_tail(state / 'emulator.log')}")
    return proc, line


def _provision_index(emulator_url: str, index: str, dimensions: int) -> None:
    headers = {"Authorization": "Bearer test-token"}
    base = f"{emulator_url}/accounts/test-account/vectorize/v2/indexes"
    with httpx.Client(headers=headers, timeout=30) as c:
        r = c.post(base, json={"name": index, "description": f"memex:model={EMBED_MODEL_ID} dims={dimensions}",
                               "config": {"dimensions": dimensions, "metric": "cosine"}})
        if r.status_code not in (200, 201, 409):
            raise DevSetupError(f"creating the index {index} in the emulator failed: {r.text[:300]}")
        have = {i["propertyName"] for i in (c.get(f"{base}/{index}/metadata_index/list").json().get("result") or {})
                .get("metadataIndexes", [])}
        for prop, kind in INDEXED_PROPERTIES.items():
            if prop not in have:
                r = c.post(f"{base}/{index}/metadata_index/create", json={"propertyName": prop, "indexType": kind})
                if r.status_code not in (200, 201, 409):
                    raise DevSetupError(f"creating the metadata index {prop} failed: {r.text[:300]}")


def start_dev(root: Path | None = None, *, port: int = 8787, state_dir: Path | None = None, emulator_port: int = 0,
              vector_lag_ms: float = 0.0, index: str = DEFAULT_INDEX, dimensions: int = 768, timeout: float = 180.0,
              say: Callable[[str], None] = lambda m: print(m, file=sys.stderr, flush=True)) -> DevStack:
    """Start the emulator and the Worker; return once the Worker answers a signed ping."""
    root = find_root(root)
    wrangler = preflight(root)
    if port == 0:
        port = _free_port()
    elif not _port_free(port):
        raise DevSetupError(f"port {port} is taken: pass --port another (or 0 for any free one)")
    state = (state_dir or root / ".memex-dev").resolve()
    state.mkdir(parents=True, exist_ok=True)
    dev_vars = state / ".dev.vars"
    secret = _read_vars(dev_vars).get("MEMEX_WORKER_SECRET") or secrets.token_urlsafe(48)

    say(f"starting the Cloudflare emulator (Vectorize, Workers AI) ... state in {state}")
    emulator, emulator_url = _start_emulator(root, state, emulator_port, vector_lag_ms)
    stack = DevStack(root, state, port, emulator_url, secret, index, emulator=emulator)
    try:
        _provision_index(emulator_url, index, dimensions)
        write_dev_vars(dev_vars, {"MEMEX_WORKER_SECRET": secret, "CF_EMULATOR_URL": emulator_url,
                                  "CF_ACCOUNT_ID": "test-account", "CF_API_TOKEN": "test-token"})
        cmd = [str(wrangler), "dev", "-c", str(root / "wrangler.toml"), "--local", "--ip", "127.0.0.1", "--port",
               str(port), "--persist-to", str(state / "wrangler"), "--env-file", str(dev_vars),
               "--show-interactive-dev-session=false", "--inspector-port", str(_free_port())]
        say(f"starting the Worker: {' '.join(cmd)}")
        log = open(state / "wrangler.log", "ab")  # noqa: SIM115 - the child writes it for its lifetime
        stack.worker = subprocess.Popen(
            cmd, cwd=root, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
            env={**os.environ, "WRANGLER_SEND_METRICS": "false", "CI": "1", "NO_COLOR": "1"})
        log.close()
        stack.ping = _wait_ready(stack, timeout)
        return stack
    except BaseException:
        stack.stop()
        raise


def _wait_ready(stack: DevStack, timeout: float) -> dict[str, Any]:
    from api.composition.worker import ping  # the Worker client: loaded for this command only

    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        if stack.worker is not None and stack.worker.poll() is not None:
            raise DevSetupError(f"wrangler dev exited ({stack.worker.returncode}):\n{_tail(stack.state / 'wrangler.log')}")
        try:
            return asyncio.run(ping(stack.url, stack.secret))
        except MemexError as exc:
            last = exc
        time.sleep(0.5)
    raise DevSetupError(f"the Worker did not answer within {timeout:.0f} s ({last}):\n{_tail(stack.state / 'wrangler.log')}")


def cmd_cloudflare_dev(args: argparse.Namespace) -> int:
    from services.storage.migrate import ORG_DIR, discover

    stack = start_dev(port=args.port, state_dir=Path(args.state_dir) if args.state_dir else None,
                      vector_lag_ms=args.vector_lag_ms, timeout=args.timeout)
    with stack:
        latest = discover(ORG_DIR)[-1].name if discover(ORG_DIR) else ""
        if stack.ping.get("org_schema_version") != latest:
            print(f"WARNING: the Worker bundles org migrations up to {stack.ping.get('org_schema_version')!r}; this "
                  f"service has {latest!r} (restart to rebuild)", file=sys.stderr)
        print(f"Worker ready at {stack.url} (protocol {stack.ping.get('protocol')}, "
              f"{stack.ping.get('worker_version')}); emulator at {stack.emulator_url}", file=sys.stderr)
        print("# in another shell, then `memex serve`:", flush=True)
        print(stack.exports(), flush=True)
        stop = False

        def ask_stop(*_: Any) -> None:
            nonlocal stop
            stop = True

        signal.signal(signal.SIGTERM, ask_stop)
        try:
            while not stop:
                if stack.worker is not None and stack.worker.poll() is not None:
                    print(f"wrangler dev exited:\n{_tail(stack.state / 'wrangler.log')}", file=sys.stderr)
                    return 1
                if stack.emulator is not None and stack.emulator.poll() is not None:
                    print(f"the emulator exited:\n{_tail(stack.state / 'emulator.log')}", file=sys.stderr)
                    return 1
                time.sleep(0.5)
        except KeyboardInterrupt:
            pass
        print("stopping the Worker and the emulator", file=sys.stderr)
    return 0


def add_command(cf: Any) -> None:
    """``memex cloudflare dev`` on the ``cloudflare`` subparsers."""
    d = cf.add_parser("dev", help="run the data-plane Worker locally (wrangler dev + the Vectorize/Workers AI emulator) "
                                  "and print what to export for `memex serve`")
    d.add_argument("--port", type=int, default=8787, help="the Worker's port on 127.0.0.1 (0: any free one)")
    d.add_argument("--state-dir", default=None, help="where D1, the Durable Objects and vectors persist "
                                                     "(default .memex-dev/ in the repository)")
    d.add_argument("--vector-lag-ms", type=float, default=0.0, help="delay before a vector write is searchable")
    d.add_argument("--timeout", type=float, default=180.0, help="seconds to wait for the Worker to answer")
    d.set_defaults(fn=cmd_cloudflare_dev)
