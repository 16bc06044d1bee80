"""Run the real app under uvicorn on a loopback port in a background thread (integration tests, benches)."""

from __future__ import annotations

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


@contextmanager
def serve(app, *, port: int | None = None, timeout: float = 60.0):
    port = port or free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on", access_log=False,
                            **server_options())
    server = uvicorn.Server(config)
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
