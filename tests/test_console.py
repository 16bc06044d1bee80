"""``GET /`` and the console's assets over real HTTP (no browser: tests/test_console_browser.py drives one).

A browser gets the console's page with a strict Content-Security-Policy; a client that prefers JSON gets the small
index; the assets need no credential, are addressed by the digest of their contents (so a year of caching is safe)
and are all listed in the wheel's package data; nothing the page loads comes from another origin."""

from __future__ import annotations

import re
import tempfile
from importlib.metadata import version
from pathlib import Path

import httpx
import pytest

from api.console import STATIC_DIR
from tests.conftest import backend_live

BROWSER_ACCEPT = "text/html,application/xhtml+xml,application/xml;q=0.9,image/avif,image/webp,*/*;q=0.8"


@pytest.fixture(scope="module")
def base_url():
    with tempfile.TemporaryDirectory() as tmp, backend_live("embedded", Path(tmp)) as live:
        yield live.base_url


@pytest.fixture
def http(base_url):
    with httpx.Client(base_url=base_url, timeout=30) as c:
        yield c


def _page(http) -> httpx.Response:
    r = http.get("/", headers={"accept": BROWSER_ACCEPT})
    assert r.status_code == 200, r.text
    return r


def test_a_client_that_prefers_json_gets_the_index(http):
    for accept in ("application/json", "application/json, text/html;q=0.9"):
        r = http.get("/", headers={"accept": accept})
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("application/json")
        assert r.json() == {"name": "memex", "version": version("memex"), "docs": "/docs",
                            "openapi": "/schema/openapi.json", "health": "/health", "console": "/"}
        assert "accept" in r.headers["vary"].lower()
    for path in ("/health", "/schema/openapi.json"):
        assert http.get(path).status_code == 200


def test_a_browser_gets_the_console_with_a_strict_policy(http):
    r = _page(http)
    assert r.headers["content-type"].startswith("text/html")
    csp = dict(d.strip().split(" ", 1) for d in r.headers["content-security-policy"].split(";"))
    assert csp["default-src"] == "'self'" and csp["script-src"] == "'self'" and csp["style-src"] == "'self'"
    assert csp["frame-ancestors"] == "'none'" and csp["object-src"] == "'none'"
    assert "unsafe" not in r.headers["content-security-policy"]
    assert r.headers["x-content-type-options"] == "nosniff"
    assert r.headers["cache-control"] == "no-cache"
    html = r.text
    assert "<script>" not in html and " style=" not in html and "<style" not in html  # nothing inline
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", html)  # nothing from another origin


def test_assets_need_no_credential_and_are_cached_by_content(http):
    html = _page(http).text
    assets = re.findall(r'(?:src|href)="(/console/[0-9a-f]{12}/[^"]+)"', html)
    assert {a.rsplit("/", 1)[1] for a in assets} == {"app.js", "style.css"}
    base = assets[0].rsplit("/", 1)[0]
    for name in ("app.js", "lib.js", "pages.js", "connect.js", "vendor/preact-htm.js", "style.css"):
        r = http.get(f"{base}/{name}")  # no Authorization header
        assert r.status_code == 200, (name, r.status_code)
        assert r.content == (STATIC_DIR / name).read_bytes()
        assert "immutable" in r.headers["cache-control"] and "max-age=31536000" in r.headers["cache-control"]
        kind = "text/css" if name.endswith(".css") else "javascript"
        assert kind in r.headers["content-type"], r.headers["content-type"]
        imports = re.findall(r"""from\s+["']([^"']+)["']""", r.text)
        assert all(i.startswith("./") for i in imports), imports  # modules load from this folder only
    assert http.get(f"{base}/nope.js").status_code == 404
    assert http.get("/console/000000000000/app.js").status_code == 404  # another build's address is not served


def test_console_routes_stay_out_of_the_openapi_document(http):
    paths = http.get("/schema/openapi.json").json()["paths"]
    assert "/" not in paths
    assert not [p for p in paths if p.startswith("/console")]


def test_every_static_file_is_package_data():
    """pyproject's package-data patterns for api.console match every file the console serves (the wheel test then
    proves a wheel install serves from its own copy)."""
    import tomllib

    patterns = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())[
        "tool"]["setuptools"]["package-data"]["api.console"]
    matched = {p for pattern in patterns for p in STATIC_DIR.parent.glob(pattern) if p.is_file()}
    assert matched == {p for p in STATIC_DIR.rglob("*") if p.is_file()}
    for license_file in ("LICENSE-htm.txt", "LICENSE-preact.txt"):
        assert (STATIC_DIR / "vendor" / license_file).is_file()
