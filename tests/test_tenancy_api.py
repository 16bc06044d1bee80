"""Sign-up, API keys and scopes over real HTTP."""

from __future__ import annotations

import time

import pytest

from tests.conftest import assert_error, signup, start_live


def test_signup_returns_the_raw_key_once(live, client):
    r = client.post("/v1/signup", json={"name": "Once Inc", "slug": "once-inc"})
    assert r.status_code == 201, r.text
    body = r.json()
    key = body["api_key"]["key"]
    assert key.startswith("mx_") and len(key) >= 60
    assert body["api_key"]["scopes"] == ["admin", "read", "write"]
    assert body["organization"]["slug"] == "once-inc"
    assert body["mcp_url"].endswith("/orgs/once-inc/mcp")
    listed = client.get("/v1/keys", headers={"authorization": f"Bearer {key}"}).json()["keys"]
    assert len(listed) == 1 and "key" not in listed[0] and "key_hash" not in listed[0]
    assert key not in str(listed) and key[-20:] not in str(listed)
    stored = live.sql("SELECT key_hash FROM api_keys WHERE id = ?", (body["api_key"]["id"],))[0][0]
    assert stored.startswith("$argon2id$") and key not in stored


@pytest.mark.parametrize("slug", ["ab", "-abc", "abc-", "ABC", "a b c", "a--b", "x" * 41, "1abc", "admin", "mcp"])
def test_slug_rules(client, slug):
    assert_error(client.post("/v1/signup", json={"name": "N", "slug": slug}), 400)


def test_slug_is_unique(client):
    assert client.post("/v1/signup", json={"name": "First", "slug": "taken-slug"}).status_code == 201
    assert_error(client.post("/v1/signup", json={"name": "Second", "slug": "taken-slug"}), 409, "conflict")


def test_key_lifecycle_and_scopes(live, client):
    org = signup(live, "keys")
    r = client.post("/v1/keys", json={"name": "reader", "scopes": ["read"]}, headers=org.headers)
    assert r.status_code == 201
    reader = {"authorization": f"Bearer {r.json()['key']}"}
    reader_id = r.json()["id"]
    assert client.get("/v1/thoughts", headers=reader).status_code == 200
    assert_error(client.post("/v1/thoughts", json={"content": "nope"}, headers=reader), 403, "forbidden")
    assert_error(client.get("/v1/keys", headers=reader), 403)
    assert client.get("/v1/org", headers=reader).json()["scopes"] == ["read"]
    # last_used_at is recorded (at most once a minute)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        keys = {k["id"]: k for k in client.get("/v1/keys", headers=org.headers).json()["keys"]}
        if keys[reader_id]["last_used_at"]:
            break
        time.sleep(0.05)
    assert keys[reader_id]["last_used_at"]
    # revocation is effective at once, even though the key was cached
    assert client.delete(f"/v1/keys/{reader_id}", headers=org.headers).status_code == 204
    assert_error(client.get("/v1/thoughts", headers=reader), 401, "unauthenticated")
    revoked = {k["id"]: k for k in client.get("/v1/keys", headers=org.headers).json()["keys"]}[reader_id]
    assert revoked["revoked_at"]


def test_expired_and_malformed_keys_are_401(live, client):
    org = signup(live, "expiry")
    r = client.post("/v1/keys", json={"name": "short", "scopes": ["read"], "expires_in_seconds": 1}, headers=org.headers)
    short = {"authorization": f"Bearer {r.json()['key']}"}
    assert client.get("/v1/thoughts", headers=short).status_code == 200
    time.sleep(1.2)
    assert_error(client.get("/v1/thoughts", headers=short), 401)
    assert_error(client.post("/v1/keys", json={"name": "past", "scopes": ["read"], "expires_in_seconds": -5},
                             headers=org.headers), 400)
    assert_error(client.post("/v1/keys", json={"name": "bad", "scopes": ["root"]}, headers=org.headers), 400)
    for bad in ("Bearer nonsense", "Bearer mx_0123456789abcdef_" + "A" * 43, "Basic abc", "Bearer"):
        assert_error(client.get("/v1/thoughts", headers={"authorization": bad}), 401)
    tampered = org.key[:-1] + ("A" if org.key[-1] != "A" else "B")
    assert_error(client.get("/v1/thoughts", headers={"authorization": f"Bearer {tampered}"}), 401)


@pytest.fixture
def strict(tmp_path):
    server, ctx = start_live(tmp_path, embedder="hash", signup_rate_per_hour=2, auth_failures_per_minute=3, key_rate_per_minute=5)
    yield server
    ctx.__exit__(None, None, None)


def test_rate_limits(strict):
    with strict.client() as c:
        keys = []
        for i in range(2):
            r = c.post("/v1/signup", json={"name": "R", "slug": f"rate-{i}"})
            assert r.status_code == 201
            keys.append(r.json()["api_key"]["key"])
        r = c.post("/v1/signup", json={"name": "R", "slug": "rate-9"})
        assert_error(r, 429, "rate_limited")
        assert int(r.headers["retry-after"]) > 0
        # per-key request limit
        h = {"authorization": f"Bearer {keys[0]}"}
        codes = [c.get("/v1/thoughts", headers=h).status_code for _ in range(6)]
        assert codes[:5] == [200] * 5 and codes[5] == 429
        # the other key has its own budget
        assert c.get("/v1/thoughts", headers={"authorization": f"Bearer {keys[1]}"}).status_code == 200
        # failed authentications from one address are limited
        bad = {"authorization": "Bearer mx_0123456789abcdef_" + "B" * 43}
        codes = [c.get("/v1/thoughts", headers=bad).status_code for _ in range(4)]
        assert codes == [401, 401, 401, 429]


def test_cli_does_the_same_work(tmp_path):
    import json
    import subprocess
    import sys

    env_dir = ["--data-dir", str(tmp_path)]

    def memex(*args):
        out = subprocess.run([sys.executable, "-m", "api.cli", *args, *env_dir], capture_output=True, text=True,
                             env={**__import__("os").environ, "MEMEX_EMBEDDER": "hash"}, timeout=120)
        assert out.returncode == 0, out.stderr
        return out.stdout

    assert "control: 0001_control.sql" in memex("migrate")
    created = json.loads(memex("org", "create", "--name", "Shell Co", "--slug", "shell-co", "--json"))
    assert created["api_key"]["key"].startswith("mx_")
    made = json.loads(memex("key", "create", "--org", "shell-co", "--name", "ci", "--scopes", "read", "--json"))
    listed = json.loads(memex("key", "list", "--org", "shell-co", "--json"))
    assert {k["id"] for k in listed} == {created["api_key"]["id"], made["id"]}
    assert all("key_hash" not in k and "key" not in k for k in listed)
    revoked = json.loads(memex("key", "revoke", "--org", "shell-co", made["id"], "--json"))
    assert revoked["revoked_at"]
    # the organization has its own database: migrate reaches it, --status lists it
    assert "organizations: 1 up to date" in memex("migrate")
    status = memex("migrate", "--status")
    from services.storage.migrate import CONTROL_DIR, discover

    n = len(discover(CONTROL_DIR))
    assert f"control: {n}/{n} applied" in status
    assert f"{created['organization']['id']} (sqlite " in status and "up to date" in status
