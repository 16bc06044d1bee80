"""Access bindings belong to the organization that made them: two organizations bind the same member email
and the same service token common_name, each with its own role or scopes; each sees and removes only its
own; the organization a request acts in is the one its URL or Memex-Organization header names, never
whichever bound last (legacy migration 0009 lifted the deployment-wide UNIQUE on common_name; the control
database's schema, which replaced the legacy stream, keeps it lifted)."""

from __future__ import annotations

import shutil
import sqlite3

import pytest

from services.adapters.sqlite import SqliteDatabase
from services.storage.migrate import CONTROL_DIR, LEGACY_DIR, apply_pending
from tests.access_fixtures import AUD, SERVICE_COMMON_NAME, TEAM_DOMAIN, JWKSServer, default_key, make_token
from tests.conftest import assert_error, signup, start_live
from tests.mcp_client import mcp_session

@pytest.fixture(scope="module")
def access_live(tmp_path_factory):
    key = default_key()
    with JWKSServer([key]) as jwks:
        server, ctx = start_live(tmp_path_factory.mktemp("bindings"), embedder="hash",
                                 access_team_domain=TEAM_DOMAIN, access_audience=[AUD], access_jwks_url=jwks.url)
        try:
            yield server, key
        finally:
            ctx.__exit__(None, None, None)


def _jwt(token: str, org: str | None = None) -> dict[str, str]:
    return {"cf-access-jwt-assertion": token, **({"memex-organization": org} if org else {})}


@pytest.fixture
def two_orgs(access_live):
    """Organizations a and b, each binding an email and a common_name of this test's own (a: owner / read+write;
    b: viewer / read)."""
    live, key = access_live
    a, b = signup(live, "bind-a"), signup(live, "bind-b")
    cn, email = f"{a.slug}.access", f"{a.slug}@corp.example"
    with live.client() as c:
        for org, role, scopes in ((a, "owner", ["read", "write"]), (b, "viewer", ["read"])):
            r = c.post("/v1/members", json={"email": email, "role": role}, headers=org.headers)
            assert r.status_code == 201, r.text
            r = c.post("/v1/service-tokens", json={"common_name": cn, "name": f"{org.slug} bot", "scopes": scopes},
                       headers=org.headers)
            assert r.status_code == 201, r.text
    return live, key, a, b, cn, email


def test_each_organization_sees_only_its_own_binding(two_orgs):
    live, _, a, b, cn, email = two_orgs
    with live.client() as c:
        for org, role, scopes in ((a, "owner", ["read", "write"]), (b, "viewer", ["read"])):
            members = c.get("/v1/members", headers=org.headers).json()["members"]
            assert [(m["email"], m["role"]) for m in members] == [(email, role)]
            tokens = c.get("/v1/service-tokens", headers=org.headers).json()["service_tokens"]
            assert [(t["common_name"], t["name"], t["scopes"]) for t in tokens] == [(cn, f"{org.slug} bot", scopes)]
        # binding the same identity again in the same organization is the conflict (and changes nothing)
        assert_error(c.post("/v1/service-tokens", json={"common_name": cn, "scopes": ["read"]}, headers=b.headers), 409)
        assert c.get("/v1/service-tokens", headers=b.headers).json()["service_tokens"][0]["scopes"] == ["read"]


def test_the_header_chooses_the_organization(two_orgs):
    live, key, a, b, cn, email = two_orgs
    user, service = make_token(key, email=email), make_token(key, kind="service", common_name=cn)
    with live.client() as c:
        for token, principal in ((user, f"user:{email}"), (service, f"service:{cn}")):
            for org, scopes in ((a, None), (b, ["read"])):
                me = c.get("/v1/org", headers=_jwt(token, org.slug)).json()
                assert me["organization"]["id"] == org.id and me["principal"] == principal
                if scopes:
                    assert me["scopes"] == scopes
        # written in a, through the header: a has it, b does not
        r = c.post("/v1/thoughts", json={"content": "the service token writes in a"}, headers=_jwt(service, a.slug))
        assert r.status_code == 201, r.text
        assert_error(c.post("/v1/thoughts", json={"content": "not in b"}, headers=_jwt(service, b.slug)), 403)
        ids = lambda org: {t["id"] for t in c.get("/v1/thoughts", headers=org.headers).json()["thoughts"]}  # noqa: E731
        assert r.json()["id"] in ids(a) and r.json()["id"] not in ids(b)


def test_without_url_or_header_several_bindings_is_400_naming_the_header(two_orgs):
    live, key, a, b, cn, email = two_orgs
    with live.client() as c:
        for token in (make_token(key, email=email), make_token(key, kind="service", common_name=cn)):
            err = assert_error(c.get("/v1/org", headers=_jwt(token)), 400, "invalid_input")
            assert "Memex-Organization" in err["message"] and err["details"]["header"] == "Memex-Organization"
            assert err["details"]["organizations"] == sorted([a.slug, b.slug])
        # an organization that does not bind the identity is not entered by naming it
        third = signup(live, "bind-c")
        assert_error(c.get("/v1/org", headers=_jwt(make_token(key, email=email), third.slug)), 401)
        # an API key belongs to one organization: naming another is 404, as in an MCP URL
        assert_error(c.get("/v1/org", headers={**a.headers, "memex-organization": b.slug}), 404, "not_found")
        assert c.get("/v1/org", headers={**a.headers, "memex-organization": a.slug}).status_code == 200


async def test_the_url_chooses_the_organization(two_orgs):
    live, key, a, b, cn, email = two_orgs
    service = make_token(key, kind="service", common_name=cn)
    for org, can_write in ((a, True), (b, False)):
        async with mcp_session(org.mcp_url, _jwt(service)) as s:
            names = {t.name for t in (await s.list_tools()).tools}
            assert ("capture_thought" in names) is can_write and "semantic_search" in names
    with live.client() as c:
        init = {"jsonrpc": "2.0", "id": 1, "method": "tools/list"}
        hdr = {**_jwt(service, b.slug), "accept": "application/json, text/event-stream"}
        err = assert_error(c.post(f"/orgs/{a.slug}/mcp", json=init, headers=hdr), 400, "invalid_input")
        assert err["details"]["header"] == "Memex-Organization"  # URL and header disagree: neither is guessed


def test_removal_in_one_organization_leaves_the_other(two_orgs):
    live, key, a, b, cn, email = two_orgs
    user, service = make_token(key, email=email), make_token(key, kind="service", common_name=cn)
    with live.client() as c:
        assert c.delete(f"/v1/members/{email}", headers=b.headers).status_code == 204
        assert c.delete(f"/v1/service-tokens/{cn}", headers=b.headers).status_code == 204
        assert c.get("/v1/members", headers=b.headers).json()["members"] == []
        assert c.get("/v1/service-tokens", headers=b.headers).json()["service_tokens"] == []
        assert [m["email"] for m in c.get("/v1/members", headers=a.headers).json()["members"]] == [email]
        assert [t["common_name"] for t in c.get("/v1/service-tokens", headers=a.headers).json()["service_tokens"]] == [cn]
        for token in (user, service):
            assert_error(c.get("/v1/org", headers=_jwt(token, b.slug)), 401)
            assert c.get("/v1/org", headers=_jwt(token, a.slug)).json()["organization"]["id"] == a.id
            # one binding left: with nothing named, that one (b's removal moved nobody into b)
            assert c.get("/v1/org", headers=_jwt(token)).json()["organization"]["id"] == a.id
        # removing again is 404 in b, and a's binding is untouched by it
        assert_error(c.delete(f"/v1/service-tokens/{cn}", headers=b.headers), 404)
        assert c.get("/v1/org", headers=_jwt(service, a.slug)).status_code == 200


async def test_migration_0009_keeps_existing_tokens_and_lets_a_second_org_bind(tmp_path):
    """0009 is in the legacy stream now (the single-database layout the converter brings up to date before it
    moves a deployment to one database per organization): an old database at 0008 keeps its tokens through it."""
    before = tmp_path / "before"
    before.mkdir()
    for p in sorted(LEGACY_DIR.glob("*.sql")):
        if p.name < "0009":
            shutil.copy(p, before / p.name)
    assert len(list(before.glob("*.sql"))) == 8
    db = SqliteDatabase(tmp_path / "m.sqlite3")
    try:
        await apply_pending(db, before)
        for org in ("org_a", "org_b"):
            await db.execute("INSERT INTO organizations (id, slug, name, created_at) VALUES (?, ?, ?, 0)",
                             (org, org.replace("_", "-"), org))
        await db.execute("INSERT INTO service_tokens VALUES ('org_a', ?, 'a bot', '[\"read\"]', 1)", (SERVICE_COMMON_NAME,))
        with pytest.raises(sqlite3.IntegrityError):
            await db.execute("INSERT INTO service_tokens VALUES ('org_b', ?, 'b bot', '[\"read\"]', 2)", (SERVICE_COMMON_NAME,))
        assert "0009_bindings_per_organization.sql" in await apply_pending(db, LEGACY_DIR)
        await db.execute("INSERT INTO service_tokens VALUES ('org_b', ?, 'b bot', '[\"read\"]', 2)", (SERVICE_COMMON_NAME,))
        rows = (await db.execute("SELECT organization_id, name FROM service_tokens ORDER BY organization_id")).rows
        assert [(r["organization_id"], r["name"]) for r in rows] == [("org_a", "a bot"), ("org_b", "b bot")]
    finally:
        await db.close()
    with sqlite3.connect(tmp_path / "m.sqlite3") as conn:  # the lookup by common_name has its index
        plan = conn.execute("EXPLAIN QUERY PLAN SELECT * FROM service_tokens WHERE common_name = ?", ("x",)).fetchall()
    assert any("service_tokens_by_common_name" in str(row) for row in plan)


async def test_the_control_database_binds_a_common_name_per_organization(tmp_path):
    """What a deployment runs now: the control stream's service_tokens is per organization from the start."""
    db = SqliteDatabase(tmp_path / "control.sqlite3")
    try:
        await apply_pending(db, CONTROL_DIR)
        for org in ("org_a", "org_b"):
            await db.execute("INSERT INTO organizations (id, slug, name, created_at) VALUES (?, ?, ?, 0)",
                             (org, org.replace("_", "-"), org))
        for org in ("org_a", "org_b"):
            await db.execute("INSERT INTO service_tokens VALUES (?, ?, ?, '[\"read\"]', 1)",
                             (org, SERVICE_COMMON_NAME, f"{org} bot"))
        with pytest.raises(sqlite3.IntegrityError):  # unique per organization
            await db.execute("INSERT INTO service_tokens VALUES ('org_a', ?, 'again', '[\"read\"]', 2)", (SERVICE_COMMON_NAME,))
        rows = (await db.execute("SELECT organization_id, name FROM service_tokens ORDER BY organization_id")).rows
        assert [(r["organization_id"], r["name"]) for r in rows] == [("org_a", "org_a bot"), ("org_b", "org_b bot")]
    finally:
        await db.close()
    with sqlite3.connect(tmp_path / "control.sqlite3") as conn:
        plan = conn.execute("EXPLAIN QUERY PLAN SELECT * FROM service_tokens WHERE common_name = ?", ("x",)).fetchall()
    assert any("service_tokens_by_common_name" in str(row) for row in plan)
