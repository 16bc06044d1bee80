"""``memex serve`` says where it listens: the banner names the bound port (``--port 0``: the one the system picked),
and a port another program holds fails before anything claims to listen."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.conftest import stop

ROOT = Path(__file__).resolve().parents[1]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMEX_")}
    return {**env, "MEMEX_EMBEDDER": "hash", "PYTHONPATH": str(ROOT)}


def test_serve_on_port_0_prints_the_port_it_listens_on(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-m", "api.cli", "serve", "--host", "127.0.0.1", "--port", "0", "--data-dir", str(tmp_path)],
        cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        first = proc.stdout.readline()  # type: ignore[union-attr]
        found = re.match(r"Memex listening on (http://127\.0\.0\.1:(\d+)) ", first)
        assert found and found.group(2) != "0", first
        url = found.group(1)
        deadline = time.monotonic() + 60
        while True:
            try:
                r = httpx.get(f"{url}/health", timeout=5)
                break
            except httpx.HTTPError:
                assert proc.poll() is None and time.monotonic() < deadline, "the service did not answer on the printed URL"
                time.sleep(0.1)
        assert r.status_code == 200, r.text
    finally:
        stop(proc)


def test_serve_on_a_taken_port_fails_without_claiming_to_listen(tmp_path):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        proc = subprocess.run(
            [sys.executable, "-m", "api.cli", "serve", "--host", "127.0.0.1", "--port", str(port), "--data-dir",
             str(tmp_path)], cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0, proc.stdout
    assert "listening" not in proc.stdout
    assert "address already in use" in proc.stderr.lower(), proc.stderr[-2000:]


def test_the_serving_socket_gets_tcp_nodelay_on_each_connection():
    """The socket ``memex serve`` binds must let asyncio set TCP_NODELAY on every accepted connection (it does only for
    a socket whose protocol is IPPROTO_TCP): without it each response waits on the client's delayed ACK."""
    import asyncio

    from api.cli import _listen_socket

    async def go() -> int:
        accepted: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        class Probe(asyncio.Protocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                sock = transport.get_extra_info("socket")
                accepted.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
                transport.close()

        server = await asyncio.get_running_loop().create_server(Probe, sock=_listen_socket("127.0.0.1", 0))
        async with server:
            port = server.sockets[0].getsockname()[1]
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            try:
                return await asyncio.wait_for(accepted, 10)
            finally:
                writer.close()

    assert asyncio.run(go()) != 0
