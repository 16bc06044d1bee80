"""Hostile input against every operation, over real HTTP: never a 5xx, always the one error body, and never
a traceback in the log for a client's mistake (one line at most). Also what the HTTP server itself refuses
(malformed requests, an over-long request line, oversized headers) and what the MCP transport refuses."""

from __future__ import annotations

import logging
import re
import socket

import httpx
import pytest

from api.limits import MAX_BODY_BYTES, body_limit, MAX_HEADER_BYTES, MAX_JSON_DEPTH, MAX_URL_BYTES
from tests.conftest import assert_error, start_live
from tests.mcp_client import mcp_session

MCP_HEADERS = {"content-type": "application/json", "accept": "application/json, text/event-stream"}


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


@pytest.fixture(scope="module")
def fuzz_live(tmp_path_factory):
    server, ctx = start_live(tmp_path_factory.mktemp("limits"), embedder="hash")
    r = httpx.post(server.base_url + "/v1/signup", json={"name": "Limits", "slug": "limits-org"})
    server.key = r.json()["api_key"]["key"]
    server.headers = {"authorization": f"Bearer {server.key}"}
    yield server
    ctx.__exit__(None, None, None)


@pytest.fixture
def log_records():
    handler = Records()
    root = logging.getLogger()
    root.addHandler(handler)
    old = root.level
    root.setLevel(logging.DEBUG)
    yield handler.records
    root.setLevel(old)
    root.removeHandler(handler)


def _quiet(records):
    """No traceback, no multi-line record: a client error may cost one log line at most."""
    noisy = [r for r in records if r.levelno >= logging.WARNING and (r.exc_info or "\n" in r.getMessage())]
    assert not noisy, [f"{r.name}: {r.getMessage()[:200]}" for r in noisy]


def _operations(live) -> list[tuple[str, str]]:
    spec = httpx.get(live.base_url + "/schema/openapi.json").json()
    out = []
    for path, item in spec["paths"].items():
        for method in item:
            if method in ("get", "post", "put", "patch", "delete"):
                out.append((method.upper(), re.sub(r"\{[^}]+\}", "x", path)))
    return out


def _deep(n: int) -> bytes:
    return b'{"content": "x", "query": "x", "name": "n", "slug": "s-lug", "metadata": {"a": ' + b"[" * n + b"]" * n + b"}}"


BODIES = {
    "deep-500": _deep(500),
    "deep-100k": _deep(100_000),
    "deep-just-over": _deep(MAX_JSON_DEPTH + 1),
    "huge-int": b'{"content": 18446744073709551616999, "query": "q", "top_k": 9223372036854775808, '
                b'"from": 9223372036854775808, "to": -9223372036854775809, "expires_in_seconds": 1e400}',
    "nan": b'{"content": NaN, "query": Infinity, "top_k": -Infinity}',
    "lone-surrogate": b'{"content": "a\\ud800b", "query": "\\udc00", "name": "\\ud800", "slug": "ab\\ud800"}',
    "nul": b'{"content": "a\\u0000b", "query": "\\u0000", "name": "\\u0000"}',
    "raw-nul": b'{"content": "a\x00b"}',
    "truncated": b'{"content": "abc',
    "not-utf8": b'{"content": "\xff\xfe"}',
    "array": b"[1, 2, 3]",
    "empty": b"",
}
TEN_MB = b'{"content": "' + b"x" * (10 * 1024 * 1024) + b'"}'
QUERIES = ["?before=9223372036854775808", "?limit=1e400&before=NaN", "?from=-9223372036854775809&to=Infinity",
           "?before_id=%ED%A0%80", "?cursor=%00%00", "?limit=" + "9" * 400]


def test_hostile_bodies_and_queries_never_5xx(fuzz_live, log_records):
    ops = _operations(fuzz_live)
    assert len(ops) > 20
    with httpx.Client(base_url=fuzz_live.base_url, timeout=60, headers=fuzz_live.headers) as c:
        for method, path in ops:
            for name, body in BODIES.items():
                for ctype in ("application/json", "text/plain", "application/x-www-form-urlencoded"):
                    r = c.request(method, path, content=body, headers={"content-type": ctype})
                    assert r.status_code < 500, (method, path, name, ctype, r.text[:300])
                    if r.status_code >= 300:
                        assert_error(r, r.status_code)
            r = c.request(method, path, content=TEN_MB, headers={"content-type": "application/json"})
            if (method, path) == ("POST", "/v1/org/import"):  # reads bundles up to its own limit (test_org_lifecycle)
                assert_error(r, 415, "unsupported_media_type")
            elif (method, path) == ("POST", "/v1/thoughts:batch"):  # up to 64 MiB: this one is not a batch
                assert_error(r, 400, "invalid_input")
            elif body_limit({"method": method, "path": path}) > len(TEN_MB):  # an archive import (test_kb_sync)
                assert_error(r, 404, "not_found")  # under its limit, and the knowledge base "x" does not exist
            else:
                assert_error(r, 413, "payload_too_large")
            for query in QUERIES:
                r = c.request(method, path + query)
                assert r.status_code < 500, (method, path, query, r.text[:300])
                if r.status_code >= 300:
                    assert_error(r, r.status_code)
    _quiet(log_records)


def test_the_depth_limit_and_the_integer_bounds(fuzz_live, log_records):
    with httpx.Client(base_url=fuzz_live.base_url, timeout=60, headers=fuzz_live.headers) as c:
        h = {"content-type": "application/json"}
        err = assert_error(c.post("/v1/signup", content=b'{"name": ' + b"[" * 500 + b"]" * 500 + b"}", headers=h), 400)
        assert "deeper than" in str(err)
        ok = c.post("/v1/thoughts", content=b'{"content": "nested ok", "metadata": {"a": ' + b"[" * 20 + b"]" * 20 + b"}}",
                    headers=h)
        assert ok.status_code == 201, ok.text
        for path in ("/v1/thoughts?before=9223372036854775808", "/thoughts?before=18446744073709551616"):
            err = assert_error(c.get(path), 400, "invalid_input")
            assert err["details"]["errors"][0]["key"] == "before"
        assert_error(c.post("/v1/search", json={"query": "q", "from": 2**63}), 400, "invalid_input")
        assert c.post("/v1/thoughts", json={"content": "whole float", "metadata": {"n": 3.0}}).status_code == 201
        assert c.post("/v1/search", json={"query": "q", "top_k": 3.0}).status_code == 200
    _quiet(log_records)


def test_size_limits_are_json_errors(fuzz_live, log_records):
    with httpx.Client(base_url=fuzz_live.base_url, timeout=60, headers=fuzz_live.headers) as c:
        for path in ("/mcp", "/orgs/limits-org/mcp"):
            assert_error(c.post(path, content=TEN_MB, headers=MCP_HEADERS), 413, "payload_too_large")

        def chunks():  # no Content-Length: counted as it streams
            for _ in range(MAX_BODY_BYTES // 65536 + 2):
                yield b"x" * 65536

        assert_error(c.post("/v1/thoughts", content=chunks(), headers=MCP_HEADERS), 413, "payload_too_large")
        assert_error(c.get("/v1/thoughts/" + "a" * MAX_URL_BYTES), 414, "uri_too_long")
        assert_error(c.get("/health", headers={"x-big": "a" * MAX_HEADER_BYTES}), 431, "headers_too_large")
    _quiet(log_records)


def _raw(live, data: bytes, *, shutdown: bool = False) -> tuple[int, dict]:
    host, port = live.base_url.rsplit("/", 1)[1].split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(data)
        if shutdown:
            s.shutdown(socket.SHUT_WR)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    if not out:
        return 0, {}
    head, _, body = out.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), httpx.Response(200, content=body).json()


def test_what_the_http_server_refuses_is_a_json_error(fuzz_live, log_records):
    cases = [
        (b"GARBAGE\r\n\r\n", 400),
        (b"GET /v1/\xff\xfe HTTP/1.1\r\nHost: x\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nHost: x\r\nBad Header Line\r\n\r\n", 400),
        (b"GET /" + b"a" * 64 * 1024 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 414),
        (b"GET / HTTP/1.1\r\nHost: x\r\n" + b"X-Big: " + b"a" * 64 * 1024 + b"\r\n\r\n", 431),
        (b"POST /v1/thoughts HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\n", 501),
    ]
    for data, status in cases:
        got, body = _raw(fuzz_live, data)
        assert got == status, (data[:60], got, body)
        assert set(body) == {"error"} and set(body["error"]) == {"code", "message", "details", "request_id"}, body
    # a body cut short by the client: no reply is possible, and nothing worse than a line in the log
    _raw(fuzz_live, b"POST /v1/signup HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n"
                    b"\r\n{\"name\"", shutdown=True)
    _quiet(log_records)


def test_405_and_options_name_every_method(fuzz_live):
    with httpx.Client(base_url=fuzz_live.base_url, timeout=60, headers=fuzz_live.headers) as c:
        r = c.put("/v1/thoughts/x")
        assert_error(r, 405, "method_not_allowed")
        assert set(r.headers["allow"].replace(" ", "").split(",")) == {"GET", "DELETE", "OPTIONS"}
        r = c.options("/v1/thoughts/x")
        assert r.status_code == 204 and set(r.headers["allow"].replace(" ", "").split(",")) == {"GET", "DELETE", "OPTIONS"}
        r = c.get("/mcp")
        assert_error(r, 405) and r.headers["allow"] == "POST"


async def test_mcp_transport_and_tool_errors(fuzz_live, log_records):
    url = fuzz_live.base_url + "/orgs/limits-org/mcp"
    async with httpx.AsyncClient(timeout=60, headers=fuzz_live.headers) as c:
        call = b'{"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "get_thought", "arguments": %s}}'
        for body, status in [
            (b"{", 400),
            (call % b'{"id": "a\\ud800"}', 400),
            (call % (b"[" * 200 + b"]" * 200), 400),
            (b"\xff", 400),
        ]:
            assert_error(await c.post(url, content=body, headers=MCP_HEADERS), status, "invalid_input")
        assert_error(await c.post(url, content=b"{}", headers={"content-type": "application/json"}), 406, "not_acceptable")
        assert_error(await c.post(url, content=b"{}", headers={"content-type": "text/plain",
                                                                   "accept": MCP_HEADERS["accept"]}), 400)
    async with mcp_session(url, fuzz_live.headers) as s:
        for args in ({"before": 2**63}, {"before": 2**70, "limit": 2**64}, {"limit": -(2**63) - 1}):
            res = await s.call_tool("list_recent", args)
            assert res.isError
            err = __import__("json").loads(res.content[0].text)["error"]
            assert err["code"] == "invalid_input" and "Traceback" not in err["message"], err
        res = await s.call_tool("get_conversation", {"conversation_id": "c", "from": 2**63})
        assert res.isError and '"invalid_input"' in res.content[0].text
    _quiet(log_records)
