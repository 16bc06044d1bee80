"""Request ids and the request log, through real HTTP: every response carries X-Request-Id (the client's when sane),
every error body names it, and every request is one log line on ``memex.request`` (method, path template, status,
duration, organization, key id, request id) that never holds a secret, a body, a query string or a raw path.
``memex serve`` itself prints those lines, as text or (MEMEX_LOG_FORMAT=json) as JSON lines."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from api.request_log import LOGGER_NAME, UNMATCHED
from api.settings import Settings, SettingsError
from tests.conftest import assert_error, signup, start_live
from tests.live import free_port

ROOT = Path(__file__).resolve().parents[1]
GENERATED = re.compile(r"^req_[0-9a-f]{24}$")
MCP_HEADERS = {"accept": "application/json, text/event-stream", "content-type": "application/json"}


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def line(self, request_id: str) -> logging.LogRecord:
        """The one record of the request with this id (the response is sent before the line is written)."""
        deadline = time.monotonic() + 10
        while True:
            found = [r for r in self.records if r.memex_request["request_id"] == request_id]  # type: ignore[attr-defined]
            if found or time.monotonic() > deadline:
                assert len(found) == 1, (request_id, [r.getMessage() for r in found])
                return found[0]
            time.sleep(0.01)


def _raw(live, request: bytes) -> tuple[int, dict[str, str], dict]:
    """Send ``request`` as it is (a declared body never sent) and read the answer."""
    host, port = live.base_url.rsplit("/", 1)[1].split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(request)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    head, _, body = out.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    return int(lines[0].split(" ", 2)[1]), headers, json.loads(body)


@pytest.fixture(scope="module")
def rlive(tmp_path_factory):
    server, ctx = start_live(tmp_path_factory.mktemp("request-log"), embedder="hash")
    yield server
    ctx.__exit__(None, None, None)


@pytest.fixture
def records():
    handler = Records()
    logger = logging.getLogger(LOGGER_NAME)
    logger.addHandler(handler)
    yield handler
    logger.removeHandler(handler)


@pytest.fixture
def http(rlive):
    with rlive.client() as c:
        yield c


def test_an_id_is_made_for_every_response_and_a_sane_client_id_is_kept(rlive, http):
    ids = {http.get("/health").headers["x-request-id"] for _ in range(3)}
    assert len(ids) == 3 and all(GENERATED.match(i) for i in ids), ids
    for sane in ("abc", "A" * 128, "trace-1.2:3_x", "0"):
        assert http.get("/health", headers={"x-request-id": sane}).headers["x-request-id"] == sane
    for insane in ("A" * 129, "has space", "semi;colon", "quote\"d", "slash/y", b"caf\xc3\xa9"):
        got = http.get("/health", headers={"x-request-id": insane}).headers["x-request-id"]
        assert GENERATED.match(got), (insane, got)


def test_every_error_body_names_the_request_id(rlive, http):
    org = signup(rlive, "rid")
    cases = [
        http.get("/no/such/route"),                                                       # unmatched: 404
        http.get("/v1/org"),                                                              # no credential: 401
        http.get("/v1/org", headers={"authorization": "Bearer mx_nope_nope"}),           # bad credential: 401
        http.get("/v1/thoughts/th_missing", headers=org.headers),                        # not found: 404
        http.post("/v1/thoughts", json={"nope": 1}, headers=org.headers),                # invalid: 400
        http.put("/v1/thoughts", json={}, headers=org.headers),                          # method: 405
        http.get(f"/orgs/{org.slug}/mcp", headers=org.headers),                          # stateless MCP: 405
        http.post(f"/orgs/{org.slug}/mcp", headers={**org.headers, "content-type": "application/json"},
                  json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"}),             # the SDK refuses the Accept: 406
        http.get("/kb/nobody/nothing/api/v1/entries"),                                   # published knowledge: 404
    ]
    statuses = []
    for r in cases:
        statuses.append(r.status_code)
        assert_error(r, r.status_code)  # the body's request_id is the header's (tests.conftest.assert_error)
    assert statuses == [404, 401, 401, 404, 400, 405, 405, 406, 404], statuses
    status, headers, body = _raw(rlive, b"POST /v1/thoughts HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                        b"Content-Length: 9437184\r\n\r\n")
    assert status == 413 and body["error"]["request_id"] == headers["x-request-id"], (status, headers, body)
    sent = http.get("/v1/thoughts/th_missing", headers={**org.headers, "x-request-id": "client-chosen-1"})
    assert sent.json()["error"]["request_id"] == "client-chosen-1"


def test_one_line_per_request_with_the_template_and_never_a_secret(rlive, http, records):
    org = signup(rlive, "log")
    secret = org.key.split("_", 2)[2]  # mx_<key id>_<secret>: the secret may hold "_" itself
    r = http.post("/v1/thoughts", json={"content": "BODYSECRET the quarterly numbers"}, headers=org.headers)
    assert r.status_code == 201
    thought = r.json()["id"]
    got = http.get(f"/v1/thoughts/{thought}", headers={**org.headers, "x-request-id": "trace-get-1"})
    assert got.status_code == 200
    listed = http.get("/v1/thoughts?limit=5&before_id=QUERYSECRET", headers=org.headers)
    missing = http.get("/v1/PATHSECRET/elsewhere?q=QUERYSECRET2")
    refused = http.get("/v1/org")
    mcp = http.post(f"/orgs/{org.slug}/mcp", headers={**org.headers, **MCP_HEADERS},
                    json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"})
    kb = http.get(f"/kb/{org.slug}/handbook/api/v1/entries?q=QUERYSECRET3")
    assert mcp.status_code == 200 and kb.status_code in (401, 404)

    expected = [
        (r, "POST", "/v1/thoughts", 201, True),
        (got, "GET", "/v1/thoughts/{thought_id}", 200, True),
        (listed, "GET", "/v1/thoughts", 200, True),
        (missing, "GET", UNMATCHED, 404, False),
        (refused, "GET", "/v1/org", 401, False),
        (mcp, "POST", "/orgs/{org_slug}/mcp", 200, True),
        (kb, "GET", "/kb/{org_slug}/{kb}/api/v1/entries", kb.status_code, False),
    ]
    for response, method, path, status, authenticated in expected:
        rid = response.headers["x-request-id"]
        record = records.line(rid)
        fields = record.memex_request  # type: ignore[attr-defined]
        assert record.levelno == logging.INFO and record.name == "memex.request"
        assert (fields["method"], fields["path"], fields["status"]) == (method, path, status), fields
        assert fields["org_id"] == (org.id if authenticated else None), fields
        assert fields["key_id"] == (org.key_id if authenticated else None), fields
        assert isinstance(fields["duration_ms"], float) and fields["duration_ms"] >= 0
        line = record.getMessage()
        assert line.startswith(f"{method} {path} {status} ") and f"request_id={rid}" in line, line
        assert re.search(r" \d+\.\dms ", line), line
        assert (f"org={org.id} key={org.key_id}" if authenticated else "org=- key=-") in line, line
    assert records.line("trace-get-1").memex_request["path"] == "/v1/thoughts/{thought_id}"  # type: ignore[attr-defined]
    everything = "\n".join(r.getMessage() + json.dumps(r.memex_request) for r in records.records)  # type: ignore[attr-defined]
    for leak in (secret, org.key, "BODYSECRET", "QUERYSECRET", "PATHSECRET", thought, "handbook", "limit=5", "?"):
        assert leak not in everything, leak


def test_what_the_limits_refuse_before_routing_is_logged_too(rlive, http, records):
    status, headers, _ = _raw(rlive, b"POST /v1/signup HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                     b"Content-Length: 9437184\r\n\r\n")
    assert status == 413
    fields = records.line(headers["x-request-id"]).memex_request  # type: ignore[attr-defined]
    assert (fields["method"], fields["path"], fields["status"]) == ("POST", UNMATCHED, 413)


def test_an_unknown_log_format_is_refused(monkeypatch):
    monkeypatch.setenv("MEMEX_LOG_FORMAT", "xml")
    with pytest.raises(SettingsError, match="MEMEX_LOG_FORMAT must be one of text, json, not 'xml'"):
        Settings.from_env()
    monkeypatch.setenv("MEMEX_LOG_FORMAT", "JSON")
    assert Settings.from_env().log_format == "json"


def _serve(tmp_path: Path, log_format: str | None):
    port = free_port()
    env = {**os.environ, "MEMEX_EMBEDDER": "hash", "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    env.pop("MEMEX_LOG_FORMAT", None)
    if log_format:
        env["MEMEX_LOG_FORMAT"] = log_format
    proc = subprocess.Popen([sys.executable, "-m", "api.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
                             "--data-dir", str(tmp_path / "data")], env=env, cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while True:
        try:
            if httpx.get(base + "/health", timeout=5).status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "memex serve did not start"
        time.sleep(0.1)
    return proc, base


def _stop(proc) -> tuple[str, str]:
    proc.send_signal(signal.SIGINT)
    try:
        out, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    return out.decode(), err.decode()


@pytest.mark.parametrize("log_format", [None, "json"])
def test_memex_serve_prints_the_request_lines(tmp_path, log_format):
    proc, base = _serve(tmp_path, log_format)
    try:
        body = httpx.post(base + "/v1/signup", json={"name": "Acme", "slug": "acme-log"}).json()
        key, key_id, org_id = body["api_key"]["key"], body["api_key"]["id"], body["organization"]["id"]
        r = httpx.get(base + "/v1/thoughts/th_nothing?x=QUERYSECRET",
                      headers={"authorization": f"Bearer {key}", "x-request-id": "serve-check-1"})
        assert r.status_code == 404 and r.json()["error"]["request_id"] == "serve-check-1"
    finally:  # a graceful stop: the request's line is written before the process ends
        out, err = _stop(proc)
    text = out + err
    assert key.split("_", 2)[2] not in text and "QUERYSECRET" not in text
    mine = [line for line in text.splitlines() if "serve-check-1" in line]
    assert len(mine) == 1, text[-3000:]
    if log_format == "json":
        record = json.loads(mine[0])
        assert record == {**record, "level": "info", "logger": "memex.request", "method": "GET",
                          "path": "/v1/thoughts/{thought_id}", "status": 404, "org_id": org_id, "key_id": key_id,
                          "principal": "key", "request_id": "serve-check-1"}, record
        assert isinstance(record["duration_ms"], float) and re.match(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$",
                                                                     record["time"])
        for line in text.splitlines():
            if '"memex.request"' in line:
                json.loads(line)  # every request line is a whole JSON document
    else:
        assert re.search(rf"memex\.request: GET /v1/thoughts/\{{thought_id\}} 404 \d+\.\dms org={org_id} key={key_id} "
                         r"request_id=serve-check-1$", mine[0]), mine[0]
