"""The web console at ``/`` in a real browser: Playwright drives the system Chromium (no ``playwright install``)
against the real service on a loopback port.

The flows a newcomer depends on: sign up and see the first key once; make a key; find a thought captured through
the API; search with the explain table; revoke a key in the browser and see the API refuse it; a second
organization, signed in beside the first, sees nothing of it; the connect page's Python script runs as pasted.
One browser and one server for the module; each test opens its own browser context (its own sessionStorage).
No sleeps: Playwright's expectations wait for the page. Any error in the page (a script error, a Content Security
Policy violation, a failed asset) fails the test that caused it.
"""

from __future__ import annotations

import io
import itertools
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import httpx
import pytest

CHROMIUM = shutil.which("chromium") or ("/usr/bin/chromium" if os.path.exists("/usr/bin/chromium") else None)
if CHROMIUM is None:
    pytest.skip("no Chromium binary found (install the system package: apt-get install chromium); "
                "the console's browser tests need it", allow_module_level=True)

from playwright.sync_api import Page, expect, sync_playwright  # noqa: E402

from tests.conftest import assert_error, backend_live  # noqa: E402

ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
        "--disable-component-update", "--disable-sync"]
TIMEOUT_MS = 20_000  # an upper bound for a slow CI machine, not a wait: expectations pass as soon as they hold
_n = itertools.count(1)
expect.set_options(timeout=TIMEOUT_MS)


@pytest.fixture(scope="module")
def server():
    with tempfile.TemporaryDirectory() as tmp, backend_live("embedded", Path(tmp)) as live:
        yield live


@pytest.fixture(scope="module")
def browser():
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture
def contexts(browser):
    """new_page(): a page in a fresh browser context; every page must end the test without an error."""
    opened, problems = [], []

    def new_page() -> Page:
        ctx = browser.new_context(locale="en-US")
        opened.append(ctx)
        page = ctx.new_page()
        page.set_default_timeout(TIMEOUT_MS)
        page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
        page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}") if m.type == "error"
                and "401" not in m.text and "404" not in m.text and "403" not in m.text else None)
        page.on("requestfailed", lambda r: problems.append(f"request failed: {r.url} {r.failure}"))
        return page

    yield new_page
    for ctx in opened:
        ctx.close()
    assert not problems, problems


def http(server) -> httpx.Client:
    return httpx.Client(base_url=server.base_url, timeout=60)


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def nav(page: Page, name: str) -> None:
    page.get_by_role("navigation", name="Console").get_by_role("link", name=name, exact=True).click()


def sign_up(page: Page, server, prefix: str = "web") -> tuple[str, str]:
    """Sign up through the console; returns (slug, the first key as the page showed it), signed in."""
    slug = f"{prefix}-{next(_n)}-{int(time.time() * 1000) % 100000}"
    page.goto(server.base_url + "/")
    page.get_by_label("Organization name").fill(f"{prefix} inc")
    page.get_by_label(re.compile("^Slug")).fill(slug)
    page.get_by_role("button", name="Sign up").click()
    secret = page.get_by_test_id("secret")
    expect(secret).to_have_text(re.compile(r"^mx_\w+_\S+$"))
    key = secret.inner_text()
    page.get_by_role("button", name=re.compile("open the console")).click()
    expect(page.get_by_test_id("org")).to_contain_text(slug)
    return slug, key


def test_sign_up_shows_the_first_key_once_and_keeps_it_out_of_urls_and_local_storage(server, contexts):
    page = contexts()
    slug, key = sign_up(page, server)
    with http(server) as c:
        r = c.get("/v1/org", headers=bearer(key))
        assert r.status_code == 200, r.text
        assert r.json()["organization"]["slug"] == slug
    expect(page.get_by_role("heading", name="Thoughts")).to_be_visible()
    assert key not in page.content()  # shown once: gone once the console opens
    nav(page, "Keys")
    row = page.get_by_test_id("keys").locator("tbody tr")
    expect(row).to_have_count(1)
    expect(row).to_contain_text("this session")
    assert key not in page.content()  # the list shows a prefix, never the secret
    assert key not in page.url
    assert page.evaluate("() => localStorage.length") == 0
    assert page.evaluate("() => sessionStorage.getItem('memex.key')") == key
    page.reload()  # the tab's session survives a reload
    expect(page.get_by_test_id("org")).to_contain_text(slug)
    page.get_by_role("button", name="Sign out").click()
    expect(page.get_by_role("heading", name="Sign in with an API key")).to_be_visible()
    assert page.evaluate("() => sessionStorage.length") == 0


def test_sign_in_with_a_key_and_a_wrong_key_shows_the_api_message(server, contexts):
    with http(server) as c:
        slug = f"signin-{next(_n)}-{int(time.time() * 1000) % 100000}"
        key = c.post("/v1/signup", json={"name": "Sign In", "slug": slug}).json()["api_key"]["key"]
        message = assert_error(c.get("/v1/org", headers=bearer("mx_nope_nope")), 401)["message"]
    page = contexts()
    page.goto(server.base_url + "/")
    page.get_by_label("API key", exact=True).fill("mx_nope_nope")
    page.get_by_role("button", name="Sign in").click()
    expect(page.get_by_role("alert")).to_contain_text(message)
    page.get_by_label("API key", exact=True).fill(key)
    page.get_by_role("button", name="Sign in").click()
    expect(page.get_by_test_id("org")).to_contain_text(slug)


def test_make_a_key_with_scopes_and_expiry(server, contexts):
    page = contexts()
    _, admin = sign_up(page, server)
    nav(page, "Keys")
    page.get_by_label("Name", exact=True).fill("ci-reader")
    page.get_by_role("checkbox", name="write").uncheck()
    page.get_by_label("Expires after").select_option(label="30 days")
    page.get_by_role("button", name="Create key").click()
    secret = page.get_by_test_id("secret")
    expect(secret).to_have_text(re.compile(r"^mx_"))
    key = secret.inner_text()
    row = page.get_by_test_id("keys").locator("tbody tr", has_text="ci-reader")
    expect(row).to_contain_text("read")
    expect(row).to_contain_text("active")
    expect(row).not_to_contain_text("never")  # it expires
    with http(server) as c:
        assert c.get("/v1/thoughts", headers=bearer(key)).status_code == 200
        assert_error(c.post("/v1/thoughts", json={"content": "no"}, headers=bearer(key)), 403)
        listed = next(k for k in c.get("/v1/keys", headers=bearer(admin)).json()["keys"] if k["name"] == "ci-reader")
    assert listed["scopes"] == ["read"]
    assert 29 * 86400_000 < listed["expires_at"] - listed["created_at"] <= 30 * 86400_000


def test_a_thought_captured_through_the_api_is_on_the_thoughts_page(server, contexts):
    page = contexts()
    _, key = sign_up(page, server)
    text = f"The checkout outage was Redis pool exhaustion; we raised the pool to 400 (note {next(_n)})."
    with http(server) as c:
        r = c.post("/v1/thoughts", json={"content": text, "source": "postmortem"}, headers=bearer(key))
        assert r.status_code == 201, r.text
        tid = r.json()["id"]
    nav(page, "Search")  # away and back: the list is read again
    nav(page, "Thoughts")
    listed = page.get_by_test_id("thoughts").locator("tbody tr", has_text="postmortem")
    expect(listed).to_have_count(1)
    listed.get_by_role("link").click()
    assert page.url.endswith(f"#/thoughts/{tid}")
    expect(page.get_by_test_id("content")).to_have_text(text)
    expect(page.get_by_test_id("chunks").locator("tbody tr")).to_have_count(1)
    expect(page.get_by_text(tid)).to_be_visible()
    nav(page, "Usage")  # whatever GET /v1/usage answers, as tables
    thoughts_row = page.get_by_test_id("usage").locator("tr", has=page.get_by_role("rowheader", name="thoughts", exact=True))
    expect(thoughts_row).to_contain_text("1")


def test_search_with_explain_shows_the_ranking_table(server, contexts):
    page = contexts()
    _, key = sign_up(page, server)
    with http(server) as c:
        for content in ("Our Postgres replica lags by 40 seconds at peak traffic.",
                        "The office plants are watered on Fridays."):
            r = c.post("/v1/thoughts", json={"content": content, "wait": True}, headers=bearer(key))
            assert r.status_code == 201, r.text
            server.wait_indexed(bearer(key), r.json()["id"])  # both sides of the search see it: results are stable
        api = c.post("/v1/search", json={"query": "postgres replica lag", "explain": True}, headers=bearer(key)).json()
    assert api["results"], api
    nav(page, "Search")
    page.get_by_label("Query").fill("postgres replica lag")
    expect(page.get_by_role("checkbox", name="Explain the ranking")).to_be_checked()
    page.get_by_role("button", name="Search", exact=True).click()
    expect(page.get_by_test_id("result-count")).to_have_text(re.compile(rf"^{len(api['results'])} results? "))
    expect(page.locator("ul.results li").first).to_contain_text("Postgres replica")
    table = page.get_by_test_id("explain")
    expect(table.locator("thead th")).to_have_count(1 + len(api["results"]))
    for factor in ("relevance", "recency", "frequency", "importance", "keyword_coverage"):
        expect(table.locator("tbody tr", has=page.get_by_role("rowheader", name=factor, exact=True))).to_have_count(1)
    relevance = table.locator("tbody tr", has=page.get_by_role("rowheader", name="relevance", exact=True)).locator("td").first
    expect(relevance).to_have_text(f"{api['results'][0]['explain']['relevance']:,.4f}".rstrip("0").rstrip("."))
    expect(table).to_contain_text(api["results"][0]["explain"]["formula"])


def test_revoking_a_key_in_the_browser_makes_the_api_refuse_it(server, contexts):
    page = contexts()
    _, key = sign_up(page, server)
    with http(server) as c:
        made = c.post("/v1/keys", json={"name": "laptop", "scopes": ["read"]}, headers=bearer(key)).json()
        assert c.get("/v1/org", headers=bearer(made["key"])).status_code == 200
    nav(page, "Keys")
    row = page.locator(f'tr[data-key="{made["id"]}"]')
    row.get_by_role("button", name="Revoke").click()
    row.get_by_role("button", name="Revoke now").click()
    expect(row).to_contain_text("revoked")
    with http(server) as c:
        assert_error(c.get("/v1/org", headers=bearer(made["key"])), 401)
        assert c.get("/v1/org", headers=bearer(key)).status_code == 200  # only that key
    # revoking the session's own key: the next page shows the API's own error message
    mine = page.locator("tr", has_text="this session")
    mine.get_by_role("button", name="Revoke").click()
    mine.get_by_role("button", name="Revoke (signs you out)").click()
    expect(page.get_by_role("alert")).to_be_visible()
    with http(server) as c:
        message = assert_error(c.get("/v1/thoughts", headers=bearer(key)), 401)["message"]
    nav(page, "Thoughts")
    expect(page.get_by_role("alert")).to_contain_text(message)


def test_a_second_organization_sees_nothing_of_the_first(server, contexts):
    first, second = contexts(), contexts()
    slug_a, key_a = sign_up(first, server, "first")
    secret_text = f"Project Nightingale launches on the ninth of May ({next(_n)})."
    with http(server) as c:
        tid = c.post("/v1/thoughts", json={"content": secret_text, "wait": True}, headers=bearer(key_a)).json()["id"]
        assert c.post("/v1/keys", json={"name": "first-only-key"}, headers=bearer(key_a)).status_code == 201
    nav(first, "Search")
    nav(first, "Thoughts")
    expect(first.get_by_test_id("thoughts")).to_contain_text("Nightingale")

    slug_b, _ = sign_up(second, server, "second")
    expect(second.get_by_text("No thoughts yet")).to_be_visible()
    nav(second, "Keys")
    expect(second.get_by_test_id("keys").locator("tbody tr")).to_have_count(1)
    expect(second.get_by_test_id("keys")).not_to_contain_text("first-only-key")
    nav(second, "Search")
    second.get_by_label("Query").fill("Nightingale launch May")
    second.get_by_role("button", name="Search", exact=True).click()
    expect(second.get_by_test_id("result-count")).to_have_text(re.compile("^0 results"))
    second.goto(f"{server.base_url}/#/thoughts/{tid}")  # the first organization's id, opened by the second
    expect(second.get_by_role("alert")).to_be_visible()
    assert "Nightingale" not in second.content()
    # each tab stays signed in to its own organization
    expect(first.get_by_test_id("org")).to_contain_text(slug_a)
    expect(second.get_by_test_id("org")).to_contain_text(slug_b)


def test_connect_page_gives_a_fresh_key_and_a_python_script_that_runs_as_pasted(server, contexts):
    page = contexts()
    slug, admin = sign_up(page, server)
    nav(page, "Connect an agent")
    url = f"{server.base_url}/orgs/{slug}/mcp"
    expect(page.get_by_test_id("mcp-url")).to_have_text(url)
    page.get_by_role("button", name="Make a key for an agent").click()
    expect(page.get_by_role("status")).to_contain_text("agent-")
    claude = page.get_by_test_id("snippet-claude").inner_text()
    m = re.fullmatch(rf'claude mcp add --transport http memex {re.escape(url)} --header "Authorization: Bearer (mx_\S+)"',
                     claude)
    assert m, claude
    key = m.group(1)
    for name in ("snippet-cursor", "snippet-vscode", "snippet-inspector"):
        expect(page.get_by_test_id(name)).to_contain_text(key)
        expect(page.get_by_test_id(name)).to_contain_text(url)
    expect(page.get_by_text("Node.js 22.19")).to_be_visible()
    script = page.get_by_test_id("snippet-python").inner_text()
    assert key in script and url in script
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "memex_agent.py"
        path.write_text(script)
        run = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=120, cwd=tmp)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "capture_thought" in run.stdout and "semantic_search" in run.stdout, run.stdout
    assert "Memex is connected to this agent." in run.stdout.split("captured:", 1)[1], run.stdout
    with http(server) as c:
        keys = c.get("/v1/keys", headers=bearer(admin)).json()["keys"]
        made = next(k for k in keys if key.startswith(k["prefix"].rstrip("…")))
        assert made["name"].startswith("agent-") and sorted(made["scopes"]) == ["read", "write"]
        found = c.post("/v1/search", json={"query": "is memex connected to this agent"}, headers=bearer(key)).json()
    assert any("Memex is connected" in h["chunk_content"] for h in found["results"])


def test_knowledge_bases_show_their_sync_state_and_per_file_errors(server, contexts):
    page = contexts()
    _, key = sign_up(page, server)
    nav(page, "Knowledge bases")
    expect(page.get_by_text("This organization has no knowledge base")).to_be_visible()
    archive = io.BytesIO()
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("data/concepts/fine.md", "---\ntitle: Fine\npublish: true\n---\nConsent rounds decide.\n")
        z.writestr("data/concepts/broken.md", "---\ntitle: [unclosed\npublish: true\n---\nNever parsed.\n")
    with http(server) as c:
        assert c.post("/v1/knowledge-bases", json={"slug": "handbook", "source": {"type": "upload"}},
                      headers=bearer(key)).status_code == 201
        r = c.post("/v1/knowledge-bases/handbook/import", content=archive.getvalue(),
                   headers={**bearer(key), "content-type": "application/zip"})
        assert r.status_code == 202, r.text
        sync_id = r.json()["id"]
        deadline = time.monotonic() + 90
        while (s := c.get(f"/v1/knowledge-bases/handbook/syncs/{sync_id}", headers=bearer(key)).json())["state"] not in (
                "succeeded", "failed"):
            assert time.monotonic() < deadline, s  # the sync is the service worker's job: wait for it to finish
            time.sleep(0.1)
    assert [e["path"] for e in s["errors"]] == ["data/concepts/broken.md"], s
    nav(page, "Search")
    nav(page, "Knowledge bases")
    row = page.get_by_test_id("knowledge-bases").locator("tbody tr", has_text="handbook")
    expect(row).to_contain_text(s["state"])
    expect(row).to_contain_text("1 file failed")
    row.get_by_role("link").click()
    page.get_by_test_id("syncs").locator("tbody tr").first.get_by_role("link").click()
    sync = page.get_by_test_id("sync")
    expect(sync).to_contain_text(sync_id)
    errors = sync.locator("table", has=page.get_by_role("columnheader", name="reason"))
    expect(errors.locator("tbody tr", has_text="data/concepts/broken.md")).to_contain_text(s["errors"][0]["reason"])


def test_conversations_list_read_and_search(server, contexts):
    page = contexts()
    _, key = sign_up(page, server)
    with http(server) as c:
        cid = c.post("/v1/conversations", json={"title": "support chat"}, headers=bearer(key)).json()["id"]
        r = c.post(f"/v1/conversations/{cid}/messages", headers=bearer(key), json={"messages": [
            {"role": "user", "content": "Our Postgres replica lags by 40s at peak."},
            {"role": "assistant", "content": "Raise max_wal_senders and check the replica disk."}]})
        assert r.status_code == 201, r.text
    nav(page, "Conversations")
    page.get_by_test_id("conversations").get_by_role("link", name="support chat").click()
    messages = page.get_by_test_id("messages")
    expect(messages.locator(".msg")).to_have_count(2)
    expect(messages.locator(".msg").nth(1)).to_contain_text("assistant")
    expect(messages.locator(".msg").nth(1)).to_contain_text("max_wal_senders")
    page.get_by_label("Query").fill("max_wal_senders replica")
    page.get_by_role("button", name="Search", exact=True).click()
    best = page.locator("ul.results .msg.best").first
    expect(best).to_contain_text("max_wal_senders")


def test_the_api_docs_render_every_operation_from_the_service_alone(server, contexts):
    """/docs leads to Swagger UI, which renders the OpenAPI 3.1 document: every operation listed, every request to
    this service (the page never reaches another host, so it works offline)."""
    page = contexts()
    hosts: set[str] = set()
    page.on("request", lambda r: hosts.add(r.url.split("/")[2]))
    page.goto(server.base_url + "/docs")
    expect(page).to_have_url(re.compile(r"/schema/swagger$"))
    with http(server) as c:
        doc = c.get("/schema/openapi.json").json()
    operations = sum(1 for item in doc["paths"].values() for m in item if m in ("get", "post", "put", "patch", "delete"))
    assert operations > 40
    expect(page.locator(".opblock")).to_have_count(operations)
    expect(page.locator(".opblock-summary-path", has_text="/v1/search").first).to_be_visible()
    assert hosts == {server.base_url.split("/")[2]}, hosts
