"""Run the real app under uvicorn on a loopback port in a background thread (integration tests, benches)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from contextlib import contextmanager

import uvicorn

from api.server import server_options


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Server(uvicorn.Server):
    """uvicorn's server, remembering the event loop it serves on (``serve``'s ``on_loop``)."""

    on_loop = None

    async def serve(self, sockets=None):
        if self.on_loop is not None:
            self.on_loop(asyncio.get_running_loop())
        await super().serve(sockets)


@contextmanager
def serve(app, *, port: int | None = None, timeout: float = 60.0, on_loop=None):
    """``on_loop(loop)``: called with the server's event loop before it starts serving (to run a coroutine on the
    app's own loop from a test: ``asyncio.run_coroutine_threadsafe``)."""
    port = port or free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on", access_log=False,
                            **server_options())
    server = _Server(config)
    server.on_loop = on_loop
    thread = threading.Thread(target=server.run, name=f"uvicorn-{port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("server failed to start")
        if time.monotonic() > deadline:
            raise TimeoutError("server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
