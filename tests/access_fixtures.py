"""Test helpers for Cloudflare Access JWTs: RSA keys, a JWKS served over real loopback HTTP, token minting.

Reusable from any test::

    from access_fixtures import AUD, TEAM_DOMAIN, JWKSServer, default_key, make_token

    with JWKSServer([default_key()]) as server:
        config = AccessConfig(team_domain=TEAM_DOMAIN, audience=AUD, jwks_url=server.url)
        token = make_token()                     # a valid user token signed with default_key()
        token = make_token(kind="service")       # a valid service-token token (sub "", common_name)
        token = make_token(exp=DROP)             # drop a claim; any other keyword overrides a claim

The pytest fixtures ``access_key``, ``jwks_server``, ``access_config`` and ``fake_clock`` can be imported
into a test module as well (import all you use *and* what they depend on: ``jwks_server`` needs ``access_key``,
``access_config`` needs ``jwks_server``). Use ``httpx.AsyncClient(trust_env=False)`` against the loopback JWKS.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import hmac
import json
import secrets
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import jwt
import pytest
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa

# The repo root must be importable (``tenancy``, ``services``) even without an installed package.
_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from tenancy.access import AccessConfig  # noqa: E402

__all__ = [
    "AUD",
    "OTHER_AUD",
    "TEAM_DOMAIN",
    "USER_EMAIL",
    "USER_SUB",
    "SERVICE_COMMON_NAME",
    "DROP",
    "AccessKey",
    "FakeClock",
    "JWKSServer",
    "generate_key",
    "default_key",
    "jwks_dict",
    "user_claims",
    "service_claims",
    "make_token",
    "sign_rs256",
    "unsigned_token",
    "hs256_confusion_token",
    "b64url",
    "access_key",
    "jwks_server",
    "access_config",
    "fake_clock",
]

TEAM_DOMAIN = "https://acme.cloudflareaccess.com"
AUD = "4714c1358e65fe4b408ad6d432a5f878f08194bdb4752441fd56faefa9b2b6f2"
OTHER_AUD = "0f" * 32
USER_EMAIL = "ann@corp.example"
USER_SUB = "7335d417-61da-459d-899c-0a01c76a2f94"
SERVICE_COMMON_NAME = "88bf3b6d86161464f6509f7219099e57.access"

DROP: Any = object()
"""Pass as a claim override to remove that claim from the token."""


# ---------------------------------------------------------------------------------------------- keys


@dataclass(frozen=True)
class AccessKey:
    private_key: rsa.RSAPrivateKey
    kid: str

    @property
    def public_key(self) -> rsa.RSAPublicKey:
        return self.private_key.public_key()

    @property
    def public_pem(self) -> bytes:
        return self.public_key.public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )

    def public_jwk(self) -> dict[str, Any]:
        jwk = json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(self.public_key))
        jwk.update({"kid": self.kid, "alg": "RS256", "use": "sig"})
        return jwk


def generate_key(kid: str | None = None) -> AccessKey:
    """A fresh RSA-2048 key with a random hex kid (Cloudflare kids are 64 hex chars)."""
    private = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    return AccessKey(private_key=private, kid=kid or secrets.token_hex(32))


@functools.lru_cache(maxsize=1)
def default_key() -> AccessKey:
    """One key per test session (RSA keygen is the slowest thing here)."""
    return generate_key()


def jwks_dict(keys: Sequence[AccessKey], *, extra_keys: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
    """The JSON Cloudflare serves at /cdn-cgi/access/certs: ``keys`` plus ``public_cert``/``public_certs``."""
    pems = [{"kid": k.kid, "cert": k.public_pem.decode()} for k in keys]
    return {
        "keys": [k.public_jwk() for k in keys] + list(extra_keys),
        "public_cert": pems[0] if pems else None,
        "public_certs": pems,
    }


# ---------------------------------------------------------------------------------------------- JWKS server


class JWKSServer:
    """Serves a JWKS over HTTP on 127.0.0.1:<random port> in a daemon thread; counts fetches.

    Change what it serves with :meth:`set_keys` / :attr:`body`; make it fail with :attr:`status` (e.g. 500).
    """

    path = "/cdn-cgi/access/certs"

    def __init__(self, keys: Sequence[AccessKey] = (), *, extra_keys: Sequence[dict[str, Any]] = ()) -> None:
        self._lock = threading.Lock()
        self._fetches = 0
        self.status = 200
        self.body: bytes = b""
        self.delay_seconds = 0.0
        self.set_keys(keys, extra_keys=extra_keys)
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server API
                with server._lock:
                    server._fetches += 1
                    status, body, delay = server.status, server.body, server.delay_seconds
                if delay:
                    time.sleep(delay)
                if self.path != server.path:
                    status, body = 404, b'{"error":"not found"}'
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - silence stderr
                pass

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self._thread: threading.Thread | None = None

    def set_keys(self, keys: Sequence[AccessKey], *, extra_keys: Sequence[dict[str, Any]] = ()) -> None:
        self.body = json.dumps(jwks_dict(keys, extra_keys=extra_keys)).encode()

    @property
    def fetches(self) -> int:
        with self._lock:
            return self._fetches

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}{self.path}"

    def start(self) -> JWKSServer:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._httpd.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True
            )
            self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self._httpd.shutdown()
            self._thread.join(timeout=2)
            self._thread = None
        self._httpd.server_close()

    def __enter__(self) -> JWKSServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class FakeClock:
    """A monotonic clock for the verifier's JWKS cache; advance it instead of sleeping."""

    def __init__(self, start: float = 1_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


# ---------------------------------------------------------------------------------------------- tokens


def b64url(data: bytes | str | dict[str, Any]) -> str:
    if isinstance(data, dict):
        data = json.dumps(data, separators=(",", ":"))
    if isinstance(data, str):
        data = data.encode()
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def user_claims(*, now: int | None = None, team_domain: str = TEAM_DOMAIN, aud: Any = AUD) -> dict[str, Any]:
    """The claim shape of a user (IdP login) application token."""
    now = int(time.time()) if now is None else now
    return {
        "aud": [aud] if isinstance(aud, str) else aud,
        "email": USER_EMAIL,
        "exp": now + 600,
        "iat": now,
        "nbf": now,
        "iss": team_domain,
        "type": "app",
        "identity_nonce": "6ei69kawdKzMIAPF",
        "sub": USER_SUB,
        "country": "DE",
    }


def service_claims(*, now: int | None = None, team_domain: str = TEAM_DOMAIN, aud: Any = AUD) -> dict[str, Any]:
    """The claim shape of a service-token application token (no email, ``sub == ""``)."""
    now = int(time.time()) if now is None else now
    return {
        "type": "app",
        "aud": [aud] if isinstance(aud, str) else aud,
        "exp": now + 600,
        "iat": now,
        "iss": team_domain,
        "common_name": SERVICE_COMMON_NAME,
        "sub": "",
    }


def sign_rs256(claims: dict[str, Any], key: AccessKey, *, kid: str | None = None, headers: dict[str, Any] | None = None) -> str:
    """A real RS256 signature over exactly the header/claims given (built by hand, so headers and claims may lie)."""
    header: dict[str, Any] = {"alg": "RS256", "kid": key.kid if kid is None else kid, "typ": "JWT"}
    header.update(headers or {})
    header = {k: v for k, v in header.items() if v is not DROP}
    signing_input = f"{b64url(header)}.{b64url(claims)}".encode()
    signature = key.private_key.sign(signing_input, padding.PKCS1v15(), hashes.SHA256())
    return f"{signing_input.decode()}.{b64url(signature)}"


def unsigned_token(claims: dict[str, Any], *, kid: str | None = None, alg: str = "none") -> str:
    """``alg: none`` with an empty signature (crafted by hand)."""
    header: dict[str, Any] = {"alg": alg, "typ": "JWT"}
    if kid is not None:
        header["kid"] = kid
    return f"{b64url(header)}.{b64url(claims)}."


def hs256_confusion_token(claims: dict[str, Any], key: AccessKey, *, kid: str | None = None, alg: str = "HS256") -> str:
    """The RS/HS key-confusion attack: HMAC-SHA256 keyed with the *public* key PEM (pyjwt refuses to build it)."""
    header = {"alg": alg, "typ": "JWT", "kid": key.kid if kid is None else kid}
    signing_input = f"{b64url(header)}.{b64url(claims)}".encode()
    digest = hashlib.sha256 if alg.upper().endswith("256") else hashlib.sha512
    signature = hmac.new(key.public_pem, signing_input, digest).digest()
    return f"{signing_input.decode()}.{b64url(signature)}"


def make_token(
    key: AccessKey | None = None,
    *,
    kind: str = "user",
    kid: str | None = None,
    alg: str = "RS256",
    headers: dict[str, Any] | None = None,
    now: int | None = None,
    team_domain: str = TEAM_DOMAIN,
    aud: Any = AUD,
    **overrides: Any,
) -> str:
    """Mint an Access application token.

    ``kind``: "user" or "service" claim shape. ``overrides``: claim values (``DROP`` removes a claim).
    ``alg``: "RS256" (real signature), "none" (unsigned) or "HS256"/"HS512" (HMAC keyed with the public PEM).
    """
    key = key or default_key()
    base = service_claims if kind == "service" else user_claims
    claims = base(now=now, team_domain=team_domain, aud=AUD if aud is DROP else aud)
    if aud is DROP:
        del claims["aud"]
    for name, value in overrides.items():
        if value is DROP:
            claims.pop(name, None)
        else:
            claims[name] = value
    if alg == "RS256":
        return sign_rs256(claims, key, kid=kid, headers=headers)
    if alg.lower() == "none":
        return unsigned_token(claims, kid=key.kid if kid is None else kid, alg=alg)
    if alg.upper().startswith("HS"):
        return hs256_confusion_token(claims, key, kid=kid, alg=alg)
    raise ValueError(f"make_token cannot sign with alg {alg!r}")


# ---------------------------------------------------------------------------------------------- pytest fixtures


@pytest.fixture
def access_key() -> AccessKey:
    return default_key()


@pytest.fixture
def jwks_server(access_key: AccessKey) -> Iterator[JWKSServer]:
    with JWKSServer([access_key]) as server:
        yield server


@pytest.fixture
def access_config(jwks_server: JWKSServer) -> AccessConfig:
    return AccessConfig(team_domain=TEAM_DOMAIN, audience=AUD, jwks_url=jwks_server.url)


@pytest.fixture
def fake_clock() -> FakeClock:
    return FakeClock()
