"""Cloudflare Access JWT verification: every forgery is a 401, real user/service tokens pass."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import ssl
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import jwt
import pytest

try:
    from access_fixtures import (
        AUD,
        DROP,
        OTHER_AUD,
        SERVICE_COMMON_NAME,
        TEAM_DOMAIN,
        USER_EMAIL,
        USER_SUB,
        AccessKey,
        FakeClock,
        JWKSServer,
        access_config,
        access_key,
        b64url,
        default_key,
        fake_clock,
        generate_key,
        hs256_confusion_token,
        jwks_server,
        make_token,
        unsigned_token,
        user_claims,
    )
except ImportError:  # tests/ turned into a package
    from tests.access_fixtures import (  # type: ignore[no-redef]
        AUD,
        DROP,
        OTHER_AUD,
        SERVICE_COMMON_NAME,
        TEAM_DOMAIN,
        USER_EMAIL,
        USER_SUB,
        AccessKey,
        FakeClock,
        JWKSServer,
        access_config,
        access_key,
        b64url,
        default_key,
        fake_clock,
        generate_key,
        hs256_confusion_token,
        jwks_server,
        make_token,
        unsigned_token,
        user_claims,
    )

from services.errors import Unauthenticated
from tenancy.access import AccessClaims, AccessConfig, AccessVerifier, token_from_request

__fixtures__ = (access_config, access_key, fake_clock, jwks_server)  # imported fixtures, used by name

GENERIC_MESSAGE = "invalid access token"


_SSL_CONTEXT = ssl.create_default_context()  # building one per client costs ~30 ms; the JWKS here is plain http


@pytest.fixture
async def http_client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(trust_env=False, timeout=2, verify=_SSL_CONTEXT) as client:
        yield client


@pytest.fixture
def verifier(access_config: AccessConfig, http_client: httpx.AsyncClient, fake_clock: FakeClock) -> AccessVerifier:
    return AccessVerifier(access_config, http_client, clock=fake_clock)


async def assert_rejected(verifier: AccessVerifier, token: Any) -> Unauthenticated:
    with pytest.raises(Unauthenticated) as info:
        await verifier.verify(token)
    assert str(info.value) == GENERIC_MESSAGE  # one short message: nothing about which check failed
    assert info.value.status == 401
    return info.value


def _split(token: str) -> tuple[dict[str, Any], dict[str, Any], str]:
    def dec(part: str) -> dict[str, Any]:
        return json.loads(base64.urlsafe_b64decode(part + "=" * (-len(part) % 4)))

    h, p, s = token.split(".")
    return dec(h), dec(p), s


# ---------------------------------------------------------------------------------------------- valid tokens


async def test_valid_user_token(verifier: AccessVerifier, jwks_server: JWKSServer) -> None:
    claims = await verifier.verify(make_token())
    assert isinstance(claims, AccessClaims)
    assert claims.kind == "user"
    assert claims.email == USER_EMAIL
    assert claims.sub == USER_SUB
    assert claims.common_name is None
    assert claims.raw["country"] == "DE" and claims.raw["type"] == "app"
    assert jwks_server.fetches == 1


async def test_valid_service_token(verifier: AccessVerifier) -> None:
    claims = await verifier.verify(make_token(kind="service"))
    assert claims.kind == "service"
    assert claims.common_name == SERVICE_COMMON_NAME
    assert claims.sub == ""
    assert claims.email is None


async def test_aud_list_with_another_value_plus_ours(verifier: AccessVerifier) -> None:
    claims = await verifier.verify(make_token(aud=[OTHER_AUD, AUD]))
    assert claims.email == USER_EMAIL


async def test_config_accepts_several_audience_tags(jwks_server: JWKSServer, http_client: httpx.AsyncClient) -> None:
    config = AccessConfig(team_domain=TEAM_DOMAIN + "/", audience=[AUD, OTHER_AUD], jwks_url=jwks_server.url)
    verifier = AccessVerifier(config, http_client)
    assert (await verifier.verify(make_token(aud=[OTHER_AUD]))).kind == "user"
    assert (await verifier.verify(make_token(aud=[AUD]))).kind == "user"
    await assert_rejected(verifier, make_token(aud=["f" * 64]))


async def test_leeway_accepts_token_expired_ten_seconds_ago(verifier: AccessVerifier) -> None:
    now = int(time.time())
    claims = await verifier.verify(make_token(now=now - 610, exp=now - 10))
    assert claims.kind == "user"


async def test_leeway_accepts_nbf_slightly_in_the_future(verifier: AccessVerifier) -> None:
    now = int(time.time())
    assert (await verifier.verify(make_token(nbf=now + 10, iat=now + 10))).kind == "user"


async def test_valid_tokens_share_one_cached_jwks_fetch(
    verifier: AccessVerifier, jwks_server: JWKSServer, fake_clock: FakeClock
) -> None:
    for _ in range(5):
        await verifier.verify(make_token())
    assert jwks_server.fetches == 1
    fake_clock.advance(301)  # jwks_cache_seconds = 300
    await verifier.verify(make_token())
    assert jwks_server.fetches == 2


async def test_concurrent_cold_start_fetches_once(verifier: AccessVerifier, jwks_server: JWKSServer) -> None:
    jwks_server.delay_seconds = 0.05
    results = await asyncio.gather(*(verifier.verify(make_token()) for _ in range(20)))
    assert {r.email for r in results} == {USER_EMAIL}
    assert jwks_server.fetches == 1


# ---------------------------------------------------------------------------------------------- algorithm attacks


async def test_alg_none_is_rejected_without_touching_keys(verifier: AccessVerifier, jwks_server: JWKSServer) -> None:
    for alg in ("none", "None", "NONE"):
        await assert_rejected(verifier, unsigned_token(user_claims(), kid=default_kid(), alg=alg))
    await assert_rejected(verifier, make_token(alg="none"))
    assert jwks_server.fetches == 0


async def test_hs256_key_confusion_is_rejected(
    verifier: AccessVerifier, jwks_server: JWKSServer, access_key: AccessKey
) -> None:
    # Prime the cache so the key is "available" -- the attack must still fail.
    await verifier.verify(make_token())
    forged = hs256_confusion_token(user_claims(), access_key)
    header, payload, _ = _split(forged)
    assert header == {"alg": "HS256", "typ": "JWT", "kid": access_key.kid}
    assert payload["email"] == USER_EMAIL
    await assert_rejected(verifier, forged)
    await assert_rejected(verifier, make_token(alg="HS512"))


@pytest.mark.parametrize("alg", ["HS256", "RS512", "PS256", "ES256", "rs256", "", None, 256, ["RS256"]])
async def test_any_other_alg_header_is_rejected(verifier: AccessVerifier, jwks_server: JWKSServer, alg: Any) -> None:
    # Valid RS256 signature, lying header: we must not even look the key up.
    token = make_token(headers={"alg": alg})
    header, _, _ = _split(token)
    assert header["alg"] == alg
    await assert_rejected(verifier, token)
    assert jwks_server.fetches == 0


# ---------------------------------------------------------------------------------------------- claim checks


@pytest.mark.parametrize(
    "aud",
    [[OTHER_AUD], OTHER_AUD, [], [AUD.upper()], [AUD[:-1]], [AUD + "0"], [[AUD]], [None], DROP],
    ids=["other", "other-str", "empty", "upper", "prefix", "suffix", "nested", "null", "missing"],
)
async def test_wrong_aud_is_rejected(verifier: AccessVerifier, aud: Any) -> None:
    await assert_rejected(verifier, make_token(aud=aud))


@pytest.mark.parametrize(
    "iss",
    [
        TEAM_DOMAIN + "/",
        "https://evil.cloudflareaccess.com",
        "http://acme.cloudflareaccess.com",
        "https://ACME.cloudflareaccess.com",
        "https://acme.cloudflareaccess.com.evil.example",
        "acme.cloudflareaccess.com",
        "",
        ["https://acme.cloudflareaccess.com"],
        DROP,
    ],
)
async def test_wrong_iss_is_rejected(verifier: AccessVerifier, iss: Any) -> None:
    await assert_rejected(verifier, make_token(iss=iss))


async def test_expired_token_is_rejected(verifier: AccessVerifier) -> None:
    now = int(time.time())
    await assert_rejected(verifier, make_token(now=now - 700, exp=now - 60))  # beyond the 30 s leeway
    await assert_rejected(verifier, make_token(exp=DROP))


async def test_nbf_and_iat_in_the_future_are_rejected(verifier: AccessVerifier) -> None:
    now = int(time.time())
    await assert_rejected(verifier, make_token(nbf=now + 120))
    await assert_rejected(verifier, make_token(iat=now + 120))
    await assert_rejected(verifier, make_token(iat=DROP))


@pytest.mark.parametrize("typ", ["org", "APP", "", None, DROP])
async def test_type_other_than_app_is_rejected(verifier: AccessVerifier, typ: Any) -> None:
    await assert_rejected(verifier, make_token(type=typ))
    await assert_rejected(verifier, make_token(kind="service", type=typ))


@pytest.mark.parametrize("email", [DROP, "", "   ", None, 42, ["ann@corp.example"]])
async def test_user_token_without_email_is_rejected(verifier: AccessVerifier, email: Any) -> None:
    await assert_rejected(verifier, make_token(email=email))


@pytest.mark.parametrize("common_name", [DROP, "", None, 7])
async def test_service_token_without_common_name_is_rejected(verifier: AccessVerifier, common_name: Any) -> None:
    await assert_rejected(verifier, make_token(kind="service", common_name=common_name))


async def test_token_without_sub_is_rejected(verifier: AccessVerifier) -> None:
    await assert_rejected(verifier, make_token(sub=DROP))
    await assert_rejected(verifier, make_token(kind="service", sub=DROP))
    # An email does not turn a service-shaped token (sub "") into a user, nor does it help without common_name.
    await assert_rejected(verifier, make_token(sub=""))


async def test_tampered_payload_is_rejected(verifier: AccessVerifier) -> None:
    token = make_token()
    header_b64, _, signature = token.split(".")
    for change in ({"email": "mallory@corp.example"}, {"exp": int(time.time()) + 86400}, {"sub": ""}):
        payload = {**user_claims(), **change}
        await assert_rejected(verifier, f"{header_b64}.{b64url(payload)}.{signature}")
    # Flip one character of the signature too.
    flipped = signature[:-2] + ("A" if signature[-2] != "A" else "B") + signature[-1]
    await assert_rejected(verifier, f"{token.rsplit('.', 1)[0]}.{flipped}")
    # A token signed by a key that is not in the JWKS but claims a kid that is.
    await assert_rejected(verifier, make_token(generate_key(), kid=default_kid()))


@pytest.mark.parametrize(
    "token",
    [
        "",
        "   ",
        "abc",
        "a.b.c",
        "..",
        "...",
        "Bearer " + "x" * 20,
        "eyJhbGciOiJSUzI1NiJ9",
        "eyJhbGciOiJSUzI1NiJ9.e30",
        "eyJhbGciOiJSUzI1NiJ9.e30.",
        b64url(b"[1,2]") + ".e30.",
        b64url(b"\xff\xfe") + ".e30.sig",
        "x" * 100_000,
        "€.€.€",
        None,
        b"bytes.token.here",
    ],
)
async def test_garbage_is_rejected(verifier: AccessVerifier, jwks_server: JWKSServer, token: Any) -> None:
    await assert_rejected(verifier, token)
    assert jwks_server.fetches == 0


async def test_header_without_kid_is_rejected(verifier: AccessVerifier) -> None:
    await assert_rejected(verifier, make_token(headers={"kid": DROP}))
    await assert_rejected(verifier, make_token(kid=""))


# ---------------------------------------------------------------------------------------------- JWKS refresh


async def test_unknown_kid_refetches_once_and_is_rate_limited(
    verifier: AccessVerifier, jwks_server: JWKSServer, fake_clock: FakeClock
) -> None:
    await verifier.verify(make_token())
    assert jwks_server.fetches == 1

    # Right after a fetch, an unknown kid does not cause another one.
    await assert_rejected(verifier, make_token(kid="deadbeef"))
    assert jwks_server.fetches == 1

    fake_clock.advance(11)
    await assert_rejected(verifier, make_token(kid="unknown-1"))
    assert jwks_server.fetches == 2  # refetched once
    await assert_rejected(verifier, make_token(kid="unknown-2"))
    assert jwks_server.fetches == 2  # a second unknown kid right after: no new fetch

    # A flood of random kids, concurrently, after the window: one fetch in total.
    fake_clock.advance(11)
    tokens = [make_token(kid=f"random-{i}") for i in range(30)]
    results = await asyncio.gather(*(verifier.verify(t) for t in tokens), return_exceptions=True)
    assert all(isinstance(r, Unauthenticated) for r in results)
    assert jwks_server.fetches == 3

    # Known keys keep working throughout.
    assert (await verifier.verify(make_token())).kind == "user"
    assert jwks_server.fetches == 3


async def test_key_rotation_is_picked_up_by_refetch(
    verifier: AccessVerifier, jwks_server: JWKSServer, fake_clock: FakeClock, access_key: AccessKey
) -> None:
    await verifier.verify(make_token(access_key))
    new_key = generate_key()
    new_token = make_token(new_key)
    fake_clock.advance(11)
    await assert_rejected(verifier, new_token)  # not published yet: refetch finds nothing
    assert jwks_server.fetches == 2

    jwks_server.set_keys([new_key, access_key])  # Cloudflare rotates: current + previous
    fake_clock.advance(11)
    claims = await verifier.verify(new_token)
    assert claims.email == USER_EMAIL
    assert jwks_server.fetches == 3
    assert (await verifier.verify(make_token(access_key))).kind == "user"  # previous key still valid

    # The previous key is retired; after the cache expires, its tokens fail.
    jwks_server.set_keys([new_key])
    fake_clock.advance(301)
    await assert_rejected(verifier, make_token(access_key))
    assert (await verifier.verify(new_token)).kind == "user"


async def test_jwks_fetch_failure_is_401_and_logged(
    verifier: AccessVerifier, jwks_server: JWKSServer, caplog: pytest.LogCaptureFixture
) -> None:
    jwks_server.status = 500
    with caplog.at_level(logging.WARNING, logger="tenancy.access"):
        await assert_rejected(verifier, make_token())
    assert jwks_server.fetches == 1
    assert any("JWKS fetch" in r.getMessage() for r in caplog.records)
    # Failures are rate-limited too: a dead endpoint is not hammered.
    await assert_rejected(verifier, make_token())
    assert jwks_server.fetches == 1


@pytest.mark.parametrize(
    "body",
    [b"not json", b"[]", b'{"keys": []}', b'{"keys": "x"}', b'{"nokeys": 1}',
     b'{"keys": [{"kty": "oct", "k": "c2VjcmV0", "kid": "sym"}]}'],
)
async def test_broken_jwks_is_401(verifier: AccessVerifier, jwks_server: JWKSServer, body: bytes) -> None:
    jwks_server.body = body
    await assert_rejected(verifier, make_token())


async def test_symmetric_key_in_jwks_is_never_used(
    jwks_server: JWKSServer, http_client: httpx.AsyncClient, access_key: AccessKey
) -> None:
    secret = b"a-shared-secret-that-is-32-bytes!"
    oct_jwk = {"kty": "oct", "k": b64url(secret), "kid": "sym", "alg": "HS256"}
    jwks_server.set_keys([access_key], extra_keys=[oct_jwk])
    config = AccessConfig(team_domain=TEAM_DOMAIN, audience=AUD, jwks_url=jwks_server.url)
    verifier = AccessVerifier(config, http_client)
    assert (await verifier.verify(make_token())).kind == "user"
    forged = jwt.encode(user_claims(), secret, algorithm="HS256", headers={"kid": "sym"})
    await assert_rejected(verifier, forged)
    header_b64 = b64url({"alg": "RS256", "kid": "sym", "typ": "JWT"})
    await assert_rejected(verifier, header_b64 + "." + forged.split(".", 1)[1])


async def test_unreachable_jwks_is_401(http_client: httpx.AsyncClient) -> None:
    server = JWKSServer([])
    url = server.url
    server.stop()  # port closed: connection refused
    verifier = AccessVerifier(AccessConfig(team_domain=TEAM_DOMAIN, audience=AUD, jwks_url=url), http_client)
    await assert_rejected(verifier, make_token())


async def test_stale_keys_survive_a_jwks_outage_for_a_while(
    verifier: AccessVerifier, jwks_server: JWKSServer, fake_clock: FakeClock
) -> None:
    await verifier.verify(make_token())
    jwks_server.status = 503
    fake_clock.advance(301)  # cache expired, refresh fails: keep the previous set
    assert (await verifier.verify(make_token())).kind == "user"
    assert jwks_server.fetches == 2
    fake_clock.advance(3600)  # beyond jwks_max_stale_seconds: give up
    await assert_rejected(verifier, make_token())
    jwks_server.status = 200
    fake_clock.advance(11)
    assert (await verifier.verify(make_token())).kind == "user"


async def test_verifier_owns_its_client_when_none_is_given(access_config: AccessConfig) -> None:
    async with AccessVerifier(access_config) as verifier:
        assert (await verifier.verify(make_token(kind="service"))).kind == "service"


# ---------------------------------------------------------------------------------------------- config + extraction


def test_config_normalises() -> None:
    cfg = AccessConfig(team_domain="https://acme.cloudflareaccess.com/", audience=AUD)
    assert cfg.team_domain == TEAM_DOMAIN
    assert cfg.audience == (AUD,)
    assert cfg.audiences == (AUD,)
    assert cfg.jwks_url == "https://acme.cloudflareaccess.com/cdn-cgi/access/certs"
    assert cfg.leeway_seconds == 30 and cfg.jwks_cache_seconds == 300
    assert AccessConfig(team_domain=TEAM_DOMAIN, audience=[AUD, OTHER_AUD]).audience == (AUD, OTHER_AUD)
    assert AccessConfig(team_domain=TEAM_DOMAIN, audience=AUD, jwks_url="http://127.0.0.1:1/x").jwks_url == (
        "http://127.0.0.1:1/x"
    )
    for bad in ({"team_domain": "", "audience": AUD}, {"team_domain": TEAM_DOMAIN, "audience": []},
                {"team_domain": TEAM_DOMAIN, "audience": ""}):
        with pytest.raises(ValueError):
            AccessConfig(**bad)


def test_token_from_request() -> None:
    assert token_from_request({"Cf-Access-Jwt-Assertion": "h"}, {"CF_Authorization": "c"}) == "h"
    assert token_from_request({"cf-access-jwt-assertion": "h"}, {}) == "h"
    assert token_from_request({"CF-ACCESS-JWT-ASSERTION": "h"}, {}) == "h"
    assert token_from_request(httpx.Headers({"CF-Access-JWT-Assertion": "h"}), {}) == "h"
    assert token_from_request({}, {"CF_Authorization": "c"}) == "c"
    assert token_from_request({"Cf-Access-Jwt-Assertion": "  "}, {"CF_Authorization": "c"}) == "c"
    assert token_from_request({"Authorization": "Bearer x"}, {"cf_authorization": "c"}) is None
    assert token_from_request({}, {}) is None


def default_kid() -> str:
    return default_key().kid


async def test_concurrent_refetches_coalesce_even_without_rate_limit(
    jwks_server: JWKSServer, http_client: httpx.AsyncClient
) -> None:
    config = AccessConfig(team_domain=TEAM_DOMAIN, audience=AUD, jwks_url=jwks_server.url, jwks_min_refetch_seconds=0)
    verifier = AccessVerifier(config, http_client)
    jwks_server.delay_seconds = 0.05
    await asyncio.gather(*(verifier.verify(make_token()) for _ in range(10)))
    assert jwks_server.fetches == 1
    results = await asyncio.gather(*(verifier.verify(make_token(kid=f"k{i}")) for i in range(10)), return_exceptions=True)
    assert all(isinstance(r, Unauthenticated) for r in results)
    assert jwks_server.fetches == 2  # ten unknown kids at once: one refetch
