"""Rate limits and the failed-attempt lockout through the running service (tenancy/auth.py, tenancy/ratelimit.py,
tenancy/addresses.py): whom the client address is taken from, what a lockout blocks and what it never blocks,
the per-credential and per-organization limits and the headers a client is told them in.

No clocks: the limits are small counts and every test stays inside one window. Tests on the proxied server
each speak from their own address (through the trusted proxy), so their failure counts cannot meet."""

from __future__ import annotations

import itertools

import pytest

from api.settings import Settings, SettingsError
from tenancy.addresses import ClientAddresses
from tests.conftest import assert_error, signup, start_live

_addresses = (f"198.51.100.{i}" for i in itertools.count(1))
_key_ids = (f"{i:016x}" for i in itertools.count(0xA11CE000))


def _made_up_key(key_id: str | None = None) -> str:
    return f"mx_{key_id or next(_key_ids)}_" + "Q" * 43


def _wrong_secret(raw: str) -> str:
    """The same key id with another secret."""
    return raw[:-1] + ("A" if raw[-1] != "A" else "B")


def _bearer(raw: str) -> dict[str, str]:
    return {"authorization": f"Bearer {raw}"}


@pytest.fixture(scope="module")
def direct(tmp_path_factory):
    """Clients reach it directly: no proxy is trusted (the default)."""
    server, ctx = start_live(tmp_path_factory.mktemp("direct"), embedder="hash", auth_failures_per_minute=2,
                             auth_address_failures_per_minute=1000, signup_rate_per_hour=2)
    yield server
    ctx.__exit__(None, None, None)


@pytest.fixture(scope="module")
def proxied(tmp_path_factory):
    """Behind a proxy on loopback, which it trusts (MEMEX_TRUSTED_PROXIES=127.0.0.1)."""
    server, ctx = start_live(tmp_path_factory.mktemp("proxied"), embedder="hash", trusted_proxies=["127.0.0.1"],
                             auth_failures_per_minute=2, auth_address_failures_per_minute=5,
                             key_rate_per_minute=3, org_rate_per_minute=5)
    yield server
    ctx.__exit__(None, None, None)


def _via(address: str, headers: dict[str, str] | None = None) -> dict[str, str]:
    return {**(headers or {}), "x-forwarded-for": address}


# -- whose address ----------------------------------------------------------------------------------------

def test_a_spoofed_forwarded_for_from_an_untrusted_peer_is_ignored(direct):
    made_up = _made_up_key()
    with direct.client() as c:
        # each attempt claims another address; all come from 127.0.0.1, and that is what is counted
        codes = [c.get("/v1/thoughts", headers={**_bearer(made_up), "x-forwarded-for": f"203.0.113.{i}",
                                                 "cf-connecting-ip": f"203.0.113.{i}"}).status_code for i in range(3)]
        assert codes == [401, 401, 429]
        # sign-ups per address likewise: two allowed from 127.0.0.1, whatever the header says
        for i in range(2):
            assert c.post("/v1/signup", json={"name": "S", "slug": f"spoof-{i}"},
                          headers={"x-forwarded-for": f"203.0.113.{50 + i}"}).status_code == 201
        r = c.post("/v1/signup", json={"name": "S", "slug": "spoof-9"}, headers={"x-forwarded-for": "203.0.113.99"})
        err = assert_error(r, 429, "rate_limited")
        assert err["details"]["limit"] == "signup" and int(r.headers["retry-after"]) > 0
        assert r.headers["ratelimit-limit"] == "2" and r.headers["ratelimit-remaining"] == "0"


def test_a_trusted_proxy_names_the_client(proxied):
    made_up = _made_up_key()
    first, second = next(_addresses), next(_addresses)
    with proxied.client() as c:
        assert [c.get("/v1/thoughts", headers=_via(first, _bearer(made_up))).status_code for _ in range(2)] == [401, 401]
        assert_error(c.get("/v1/thoughts", headers=_via(first, _bearer(made_up))), 429, "rate_limited")
        # another client behind the same proxy has its own count
        assert_error(c.get("/v1/thoughts", headers=_via(second, _bearer(made_up))), 401)
        # what a client wrote itself, left of the address the proxy appended, is not believed
        assert_error(c.get("/v1/thoughts", headers=_via(f"{second}, {first}", _bearer(made_up))), 429)


# -- the lockout --------------------------------------------------------------------------------------------

def test_lockout_counts_per_address_and_key_and_never_blocks_the_valid_key(proxied):
    org = signup(proxied, "lock")
    address = next(_addresses)
    with proxied.client() as c:
        # a second key, never verified yet (so nothing cached helps it through)
        raw = c.post("/v1/keys", json={"name": "fresh", "scopes": ["read"]}, headers=org.headers).json()["key"]
        guesses = [c.get("/v1/thoughts", headers=_via(address, _bearer(_wrong_secret(raw)))) for _ in range(3)]
        assert [r.status_code for r in guesses] == [401, 401, 429]
        err = assert_error(guesses[-1], 429, "rate_limited")
        assert err["details"]["limit"] == "auth-failures" and int(guesses[-1].headers["retry-after"]) >= 1
        # the valid key, from the very same address, is let in
        assert c.get("/v1/thoughts", headers=_via(address, _bearer(raw))).status_code == 200
        # wrong guesses stay refused; another key id from the address is a count of its own
        assert_error(c.get("/v1/thoughts", headers=_via(address, _bearer(_wrong_secret(raw)))), 429)
        assert_error(c.get("/v1/thoughts", headers=_via(address, _bearer(_made_up_key()))), 401)


def test_rotating_made_up_key_ids_meets_the_address_limit_but_a_valid_key_passes(proxied):
    org = signup(proxied, "rotate")
    address = next(_addresses)
    with proxied.client() as c:
        codes = [c.get("/v1/thoughts", headers=_via(address, _bearer(_made_up_key()))).status_code for _ in range(6)]
        assert codes == [401] * 5 + [429]  # 5 failures per address, each key id new
        assert_error(c.get("/v1/thoughts", headers=_via(address, {"authorization": "Bearer nonsense"})), 429)
        assert_error(c.get("/v1/thoughts", headers=_via(address)), 429)  # no credential at all
        assert c.get("/v1/thoughts", headers=_via(address, org.headers)).status_code == 200


# -- limits per credential and per organization -------------------------------------------------------------

def test_per_key_limit_answers_429_with_retry_after_and_ratelimit_headers(proxied):
    org = signup(proxied, "perkey")
    with proxied.client() as c:
        ok = [c.get("/v1/thoughts", headers=org.headers) for _ in range(3)]
        assert [r.status_code for r in ok] == [200, 200, 200]
        assert [r.headers["ratelimit-remaining"] for r in ok] == ["2", "1", "0"]
        assert all(r.headers["ratelimit-limit"] == "3" and r.headers["ratelimit-policy"] == "3;w=60" for r in ok)
        assert 1 <= int(ok[0].headers["ratelimit-reset"]) <= 60
        r = c.get("/v1/thoughts", headers=org.headers)
        err = assert_error(r, 429, "rate_limited")
        assert err["details"]["limit"] == "credential" and err["details"]["policy"] == "3;w=60"
        assert 1 <= int(r.headers["retry-after"]) <= 60 and int(err["details"]["retry_after"]) == int(r.headers["retry-after"])
        assert r.headers["ratelimit-limit"] == "3" and r.headers["ratelimit-remaining"] == "0"
        assert r.headers["ratelimit-policy"] == "3;w=60" and int(r.headers["ratelimit-reset"]) >= 1


def test_per_organization_limit_covers_all_its_keys_and_no_other_organization(proxied):
    org, other = signup(proxied, "perorg"), signup(proxied, "perorg-other")
    with proxied.client() as c:
        second = c.post("/v1/keys", json={"name": "second", "scopes": ["read"]}, headers=org.headers).json()["key"]
        assert [c.get("/v1/thoughts", headers=org.headers).status_code for _ in range(2)] == [200, 200]  # org: 3 of 5
        assert [c.get("/v1/thoughts", headers=_bearer(second)).status_code for _ in range(2)] == [200, 200]  # 5 of 5
        r = c.get("/v1/thoughts", headers=_bearer(second))  # the key itself has used 2 of its 3
        err = assert_error(r, 429, "rate_limited")
        assert err["details"]["limit"] == "organization" and r.headers["ratelimit-policy"] == "5;w=60"
        assert int(r.headers["retry-after"]) >= 1
        assert c.get("/v1/thoughts", headers=other.headers).status_code == 200


# -- the address resolver and the settings ------------------------------------------------------------------

@pytest.mark.parametrize("trusted, header, peer, values, expected", [
    ([], "x-forwarded-for", "127.0.0.1", ["6.6.6.6"], "127.0.0.1"),
    (["127.0.0.1"], "x-forwarded-for", "127.0.0.1", ["6.6.6.6, 10.0.0.9"], "10.0.0.9"),
    (["127.0.0.1", "10.0.0.0/8"], "x-forwarded-for", "127.0.0.1", ["6.6.6.6", "10.0.0.9"], "6.6.6.6"),
    (["127.0.0.1"], "x-forwarded-for", "192.0.2.1", ["6.6.6.6"], "192.0.2.1"),  # the peer is no proxy of ours
    (["127.0.0.1"], "x-forwarded-for", "127.0.0.1", ["garbage, 10.0.0.9"], "10.0.0.9"),
    (["127.0.0.1"], "x-forwarded-for", "127.0.0.1", ["10.0.0.9, garbage"], "127.0.0.1"),
    (["127.0.0.1"], "x-forwarded-for", "127.0.0.1", [], "127.0.0.1"),
    (["::1"], "x-forwarded-for", "::1", ["[2001:db8::1]:443"], "2001:db8::1"),
    (["127.0.0.1"], "x-forwarded-for", "::ffff:127.0.0.1", ["10.0.0.9:5000"], "10.0.0.9"),
    (["127.0.0.1"], "cf-connecting-ip", "127.0.0.1", ["6.6.6.6"], "6.6.6.6"),
    ([], "cf-connecting-ip", "127.0.0.1", ["6.6.6.6"], "127.0.0.1"),
    (["127.0.0.1"], "cf-connecting-ip", "127.0.0.1", ["nonsense"], "127.0.0.1"),
])
def test_client_address(trusted, header, peer, values, expected):
    assert ClientAddresses(trusted, header).resolve(peer, values) == expected


@pytest.mark.parametrize("env, value, text", [
    ("MEMEX_TRUSTED_PROXIES", "10.0.0.0/8, proxy.local", "MEMEX_TRUSTED_PROXIES: 'proxy.local' is not an IP"),
    ("MEMEX_RATE_LIMIT_STORAGE", "carrier-pigeon://loft", "MEMEX_RATE_LIMIT_STORAGE='carrier-pigeon://loft' cannot be used"),
    ("MEMEX_RATE_LIMIT_STORAGE", "memcached://localhost:11211", "MEMEX_RATE_LIMIT_STORAGE=.*prerequisite"),
    ("MEMEX_ORG_RATE_PER_MINUTE", "0", "MEMEX_ORG_RATE_PER_MINUTE must be at least 1"),
    ("MEMEX_AUTH_ADDRESS_FAILURES_PER_MINUTE", "-1", "MEMEX_AUTH_ADDRESS_FAILURES_PER_MINUTE must be at least 1"),
    ("MEMEX_CLIENT_IP_HEADER", "x-real-ip", "MEMEX_CLIENT_IP_HEADER must be one of x-forwarded-for, cf-connecting-ip"),
])
def test_rate_settings_are_checked_at_start_up(monkeypatch, env, value, text):
    monkeypatch.setenv(env, value)
    with pytest.raises(SettingsError, match=text):
        Settings.from_env()


def test_rate_settings_defaults_and_values(monkeypatch):
    s = Settings.from_env()
    assert (s.trusted_proxies, s.client_ip_header, s.rate_limit_storage) == ([], "x-forwarded-for", "memory://")
    assert (s.org_rate_per_minute, s.auth_address_failures_per_minute) == (6000, 120)
    monkeypatch.setenv("MEMEX_TRUSTED_PROXIES", "127.0.0.1, 10.0.0.0/8,::1")
    monkeypatch.setenv("MEMEX_CLIENT_IP_HEADER", "CF-Connecting-IP")
    s = Settings.from_env()
    assert s.trusted_proxies == ["127.0.0.1", "10.0.0.0/8", "::1"] and s.client_ip_header == "cf-connecting-ip"
