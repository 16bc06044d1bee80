"""The API docs a newcomer reads: every operation has a written summary and description (never a handler's name),
``/docs`` leads to the docs UI, and every docs page loads only what the service itself serves (no CDN, no font or
favicon from elsewhere: the docs work offline)."""

from __future__ import annotations

import json
import re
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import urljoin, urlsplit

import httpx
import pytest

from api.cli import openapi_document
from tests.conftest import start_live

COMMITTED = Path(__file__).resolve().parents[1] / "openapi" / "openapi.json"
#: What a handler's name looks like: one CamelCase or camelCase word (ListMembers, getOne, Health), or snake_case.
HANDLER_NAME = re.compile(r"^([A-Za-z][a-z0-9]*)+$|^[a-z0-9]+(_[a-z0-9]+)+$")
LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1"}


def _operations(doc: dict) -> list[tuple[str, str, dict]]:
    return [(method.upper(), path, op) for path, item in doc["paths"].items() for method, op in item.items()
            if method in ("get", "put", "post", "delete", "patch", "head", "options")]


def _writing_problems(doc: dict) -> list[str]:
    problems = []
    for method, path, op in _operations(doc):
        summary, description = (op.get("summary") or "").strip(), (op.get("description") or "").strip()
        for name, text in (("summary", summary), ("description", description)):
            if not text:
                problems.append(f"{method} {path}: no {name}")
            elif HANDLER_NAME.match(text) or len(text.split()) < 3:
                problems.append(f"{method} {path}: {name} {text!r} reads like a handler name, not a sentence")
        if summary and summary == description:
            problems.append(f"{method} {path}: the description only repeats the summary")
    return problems


def test_the_checker_catches_handler_names_and_missing_text():
    doc = {"paths": {"/a": {"get": {"summary": "ListMembers", "description": "Lists the members of it."},
                            "post": {"summary": "Create a member of it"},
                            "delete": {"summary": "remove_member", "description": "Removes one member."}},
                     "/b": {"get": {"summary": "Health", "description": "Health"}}}}
    problems = _writing_problems(doc)
    assert any("GET /a: summary 'ListMembers'" in p for p in problems)
    assert any("POST /a: no description" in p for p in problems)
    assert any("DELETE /a: summary 'remove_member'" in p for p in problems)
    assert any("GET /b: summary 'Health'" in p for p in problems)
    assert not _writing_problems({"paths": {"/c": {"get": {"summary": "Service health and backends",
                                                           "description": "Public. Names the backends in use."}}}})


def test_every_operation_has_a_written_summary_and_description():
    for doc in (json.loads(openapi_document()), json.loads(COMMITTED.read_text())):
        assert len(_operations(doc)) > 40
        assert not _writing_problems(doc), "\n".join(_writing_problems(doc))


class _Links(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.urls: list[tuple[str, str, str]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for name, value in attrs:
            if name in ("src", "href") and value:
                self.urls.append((tag, name, value))


@pytest.fixture(scope="module")
def docs_live(tmp_path_factory):
    server, ctx = start_live(tmp_path_factory.mktemp("docs"), embedder="hash")
    yield server
    ctx.__exit__(None, None, None)


def test_docs_redirects_to_the_docs_ui(docs_live):
    with docs_live.client() as c:
        r = c.get("/docs")
        assert r.status_code in (302, 307), r.status_code
        assert urlsplit(r.headers["location"]).path == "/schema/swagger"
        page = c.get("/docs", follow_redirects=True)
        assert page.status_code == 200 and "text/html" in page.headers["content-type"]
        assert "SwaggerUIBundle" in page.text


def test_every_docs_page_loads_only_what_the_service_serves(docs_live):
    base = docs_live.base_url
    pages = ["/docs", "/schema", "/schema/swagger", "/schema/oauth2-redirect.html"]
    checked_assets: set[str] = set()
    with docs_live.client() as c:
        for page in pages:
            r = c.get(page, follow_redirects=True)
            assert r.status_code == 200, (page, r.status_code)
            links = _Links()
            links.feed(r.text)
            if page != "/schema/oauth2-redirect.html":
                assert any(tag == "script" for tag, _, _ in links.urls), (page, links.urls)
            for tag, attr, value in links.urls:
                url = urljoin(str(r.url), value)
                parts = urlsplit(url)
                if parts.scheme in ("http", "https"):
                    assert parts.hostname in LOCAL_HOSTS and url.startswith(base), (
                        f"{page} loads {tag} {attr}={value} from another host: the docs must work offline")
                if tag in ("script", "link", "img") and url not in checked_assets:
                    checked_assets.add(url)
                    asset = c.get(url)
                    assert asset.status_code == 200 and asset.content, (page, url, asset.status_code)
                    if url.endswith(".css"):  # a stylesheet's own url(...) references stay local too
                        for ref in re.findall(r"url\(\s*['\"]?(https?://[^'\")\s]+)", asset.text):
                            assert urlsplit(ref).hostname in LOCAL_HOSTS, (url, ref)
        assert {urlsplit(u).path for u in checked_assets} >= {
            "/schema/assets/swagger-ui-bundle.js", "/schema/assets/swagger-ui.css",
            "/schema/assets/swagger-ui-standalone-preset.js", "/schema/assets/favicon-32x32.png"}
        # the render plugins that fetch their code from CDNs are not offered
        for gone in ("/schema/scalar", "/schema/redoc", "/schema/rapidoc", "/schema/elements"):
            assert c.get(gone).status_code == 404, gone
    assert httpx.get(base + "/schema/openapi.json").json()["info"]["title"] == "Memex API"
