"""Cloudflare Access through the running service: members by email, service tokens by common_name,
the same auth step for REST and MCP, and every forged token is 401."""

from __future__ import annotations

import pytest

from tests.access_fixtures import AUD, SERVICE_COMMON_NAME, TEAM_DOMAIN, JWKSServer, default_key, make_token
from tests.conftest import assert_error, signup, start_live
from tests.mcp_client import mcp_session


@pytest.fixture(scope="module")
def access_live(tmp_path_factory):
    key = default_key()
    with JWKSServer([key]) as jwks:
        server, ctx = start_live(
            tmp_path_factory.mktemp("access"), embedder="hash",
            access_team_domain=TEAM_DOMAIN, access_audience=[AUD], access_jwks_url=jwks.url,
        )
        try:
            yield server, key
        finally:
            ctx.__exit__(None, None, None)


def _jwt(token: str) -> dict[str, str]:
    return {"cf-access-jwt-assertion": token}


def test_member_by_email_gets_role_scopes(access_live):
    live, key = access_live
    org = signup(live, "acc")
    with live.client() as c:
        assert c.post("/v1/members", json={"email": "Viewer@Corp.example", "role": "viewer"},
                      headers=org.headers).status_code == 201
        token = make_token(key, email="viewer@corp.example")
        me = c.get("/v1/org", headers=_jwt(token)).json()
        assert me["organization"]["id"] == org.id and me["scopes"] == ["read"] and me["principal"] == "user:viewer@corp.example"
        assert_error(c.post("/v1/thoughts", json={"content": "no"}, headers=_jwt(token)), 403)
        # the cookie works too
        assert c.get("/v1/thoughts", cookies={"CF_Authorization": token}).status_code == 200
        # a stranger with a valid token is not let in
        assert_error(c.get("/v1/thoughts", headers=_jwt(make_token(key, email="stranger@else.example"))), 401)


def test_member_of_two_orgs_names_one(access_live):
    live, key = access_live
    a, b = signup(live, "multi-a"), signup(live, "multi-b")
    with live.client() as c:
        for org in (a, b):
            c.post("/v1/members", json={"email": "both@corp.example", "role": "member"}, headers=org.headers)
        token = make_token(key, email="both@corp.example")
        assert_error(c.get("/v1/org", headers=_jwt(token)), 400)
        me = c.get("/v1/org", headers={**_jwt(token), "memex-organization": b.slug}).json()
        assert me["organization"]["id"] == b.id


async def test_service_token_over_rest_and_mcp(access_live):
    live, key = access_live
    org = signup(live, "svc")
    with live.client() as c:
        r = c.post("/v1/service-tokens", json={"common_name": SERVICE_COMMON_NAME, "scopes": ["read", "write"]},
                   headers=org.headers)
        assert r.status_code == 201, r.text
        token = make_token(key, kind="service")
        assert c.post("/v1/thoughts", json={"content": "written by a service token"}, headers=_jwt(token)).status_code == 201
        other = signup(live, "svc-other")  # binding per organization: see tests/test_bindings_per_org.py
        assert_error(c.post("/v1/service-tokens", json={"common_name": SERVICE_COMMON_NAME, "scopes": ["read"]},
                            headers=org.headers), 409)
    async with mcp_session(org.mcp_url, _jwt(token)) as s:
        names = {t.name for t in (await s.list_tools()).tools}
        assert "capture_thought" in names
        res = await s.call_tool("semantic_search", {"query": "service token"})
        assert res.structuredContent["results"]
    with live.client() as c:
        init = {"jsonrpc": "2.0", "id": 1, "method": "tools/list"}
        hdr = {**_jwt(token), "accept": "application/json, text/event-stream"}
        assert_error(c.post(f"/orgs/{other.slug}/mcp", json=init, headers=hdr), 401)  # not bound there
        assert c.delete(f"/v1/service-tokens/{SERVICE_COMMON_NAME}", headers=org.headers).status_code == 204
        assert_error(c.get("/v1/thoughts", headers=_jwt(token)), 401)


@pytest.mark.parametrize(
    "forge",
    [
        lambda k, e: make_token(k, email=e, alg="none"),
        lambda k, e: make_token(k, email=e, alg="HS256"),
        lambda k, e: make_token(k, email=e, aud=["0f" * 32]),
        lambda k, e: make_token(k, email=e, team_domain="https://evil.cloudflareaccess.com"),
        lambda k, e: make_token(k, email=e, exp=1_000_000_000, iat=999_999_000, nbf=999_999_000),
        lambda k, e: make_token(k, email=e, kid="unknown-kid"),
        lambda k, e: _tamper(make_token(k, email="mallory@corp.example"), e),
        lambda k, e: make_token(k, email=e, type="org"),
    ],
    ids=["alg-none", "hs256-with-public-key", "wrong-aud", "wrong-iss", "expired", "unknown-kid", "tampered", "org-token"],
)
def test_forged_tokens_are_401(access_live, forge):
    live, key = access_live
    org = signup(live, "forge")
    with live.client() as c:
        email = f"ann-{org.slug}@corp.example"
        c.post("/v1/members", json={"email": email, "role": "owner"}, headers=org.headers)
        assert c.get("/v1/org", headers=_jwt(make_token(key, email=email))).status_code == 200
        assert_error(c.get("/v1/org", headers=_jwt(forge(key, email))), 401, "unauthenticated")


def _tamper(token: str, email: str) -> str:
    import base64
    import json

    head, payload, sig = token.split(".")
    claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    claims["email"] = email
    claims["sub"] = "someone-else"
    forged = base64.urlsafe_b64encode(json.dumps(claims).encode()).rstrip(b"=").decode()
    return f"{head}.{forged}.{sig}"
