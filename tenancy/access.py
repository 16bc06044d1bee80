"""Cloudflare Access: verify the application JWT that Access puts on every request it lets through.

The origin must verify the token itself (see ``/work/shared/reference/cloudflare-access.md``):

* header ``alg`` must be ``RS256`` (checked before any key is touched; ``jwt.decode`` is also pinned to RS256);
* the ``kid`` must name an RSA key in the team's JWKS (``<team>/cdn-cgi/access/certs``);
* signature, ``aud`` (a list; one of ours must be in it), ``iss`` (exact team domain), ``exp``/``nbf``/``iat``
  with leeway, and ``type == "app"`` (the global ``org`` session token is never accepted);
* a user token carries a non-empty ``email``; a service-token token has ``sub == ""`` and a ``common_name``.

The JWKS is fetched with httpx (never blocking urllib), cached for ``jwks_cache_seconds`` and refetched when a
token carries an unknown ``kid`` -- at most once per ``jwks_min_refetch_seconds`` (counting every fetch attempt),
so a flood of random kids cannot hammer the endpoint. Concurrent fetches are coalesced behind one lock.

Every failure is :class:`services.errors.Unauthenticated` with the same short message; the reason is logged.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx
import jwt
from cryptography.hazmat.primitives.asymmetric.rsa import RSAPublicKey

from services.errors import Unauthenticated

__all__ = [
    "ACCESS_HEADER",
    "ACCESS_COOKIE",
    "AccessConfig",
    "AccessClaims",
    "AccessVerifier",
    "token_from_request",
]

log = logging.getLogger(__name__)

ACCESS_HEADER = "Cf-Access-Jwt-Assertion"
ACCESS_COOKIE = "CF_Authorization"

_ALGORITHM = "RS256"
_INVALID = "invalid access token"
# Real Access tokens are ~1 KB (more with IdP groups); anything far larger is not worth parsing.
_MAX_TOKEN_CHARS = 32 * 1024
# The JWKS is a few KB; refuse absurd bodies.
_MAX_JWKS_BYTES = 1024 * 1024


@dataclass(frozen=True, slots=True)
class AccessConfig:
    """Where the Access team lives and which application we are.

    ``audience`` accepts one AUD tag or a list of accepted tags; it is stored as a tuple.
    ``jwks_url`` defaults to ``f"{team_domain}/cdn-cgi/access/certs"`` (override it in tests).
    """

    team_domain: str
    audience: str | Sequence[str]
    jwks_url: str | None = None
    leeway_seconds: float = 30
    jwks_cache_seconds: float = 300
    # An unknown kid triggers a refetch only if the last fetch attempt is at least this old.
    jwks_min_refetch_seconds: float = 10
    # If a refresh of an expired cache fails, keep verifying with the previous key set for this long.
    jwks_max_stale_seconds: float = 3600
    http_timeout_seconds: float = 5

    def __post_init__(self) -> None:
        domain = (self.team_domain or "").strip().rstrip("/")
        if not domain:
            raise ValueError("AccessConfig.team_domain is required")
        object.__setattr__(self, "team_domain", domain)

        aud = self.audience
        tags: tuple[str, ...] = (aud,) if isinstance(aud, str) else tuple(aud)
        tags = tuple(t.strip() for t in tags if isinstance(t, str) and t.strip())
        if not tags:
            raise ValueError("AccessConfig.audience needs at least one AUD tag")
        object.__setattr__(self, "audience", tags)

        url = (self.jwks_url or "").strip() or f"{domain}/cdn-cgi/access/certs"
        object.__setattr__(self, "jwks_url", url)

        for name in ("leeway_seconds", "jwks_cache_seconds", "jwks_min_refetch_seconds", "jwks_max_stale_seconds"):
            if getattr(self, name) < 0:
                raise ValueError(f"AccessConfig.{name} must be >= 0")
        if self.http_timeout_seconds <= 0:
            raise ValueError("AccessConfig.http_timeout_seconds must be > 0")

    @property
    def audiences(self) -> tuple[str, ...]:
        return self.audience  # type: ignore[return-value]  # normalised to a tuple in __post_init__


@dataclass(frozen=True, slots=True)
class AccessClaims:
    """A verified Access identity. ``kind == "user"`` has ``email``; ``kind == "service"`` has ``common_name``."""

    kind: Literal["user", "service"]
    email: str | None
    common_name: str | None
    sub: str
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)


class AccessVerifier:
    """Verifies Cloudflare Access application tokens against the team's JWKS.

    ``http_client`` is optional; without one the verifier creates (and owns) its own ``httpx.AsyncClient``,
    closed by :meth:`aclose`. ``clock`` is a monotonic clock used only for JWKS caching (tests inject one).
    """

    def __init__(
        self,
        config: AccessConfig,
        http_client: httpx.AsyncClient | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._config = config
        self._client = http_client
        self._owns_client = http_client is None
        self._clock = clock
        self._lock = asyncio.Lock()
        self._keys: dict[str, RSAPublicKey] | None = None
        self._fetched_at: float = 0.0  # last successful fetch
        self._attempted_at: float | None = None  # last fetch attempt (success or failure)
        self._generation = 0  # bumped after every fetch attempt; lets waiters see that someone else fetched

    @property
    def config(self) -> AccessConfig:
        return self._config

    async def aclose(self) -> None:
        if self._owns_client and self._client is not None:
            await self._client.aclose()
            self._client = None

    async def __aenter__(self) -> AccessVerifier:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # ------------------------------------------------------------------ verification

    async def verify(self, token: str) -> AccessClaims:
        if not isinstance(token, str) or not token or len(token) > _MAX_TOKEN_CHARS:
            raise self._fail("missing, non-string or oversized token")
        token = token.strip()

        try:
            header = jwt.get_unverified_header(token)
        except jwt.PyJWTError as exc:
            raise self._fail(f"malformed token header: {type(exc).__name__}") from None
        except Exception as exc:  # noqa: BLE001 - any parse failure is just a bad token
            raise self._fail(f"malformed token: {type(exc).__name__}") from None

        # Reject everything but RS256 before any key is looked at (alg none, HS256 key confusion, ...).
        alg = header.get("alg")
        if alg != _ALGORITHM:
            raise self._fail(f"unexpected alg {alg!r:.20}")
        kid = header.get("kid")
        if not isinstance(kid, str) or not kid or len(kid) > 256:
            raise self._fail("missing or invalid kid")

        key = await self._key_for(kid)

        cfg = self._config
        try:
            claims = jwt.decode(
                token,
                key,
                algorithms=[_ALGORITHM],
                audience=list(cfg.audiences),
                issuer=cfg.team_domain,
                leeway=cfg.leeway_seconds,
                options={
                    "verify_signature": True,
                    "verify_exp": True,
                    "verify_nbf": True,
                    "verify_iat": True,
                    "verify_aud": True,
                    "verify_iss": True,
                    "require": ["exp", "iat", "iss", "aud"],
                },
            )
        except jwt.PyJWTError as exc:
            raise self._fail(f"token rejected: {type(exc).__name__}") from None
        except Exception as exc:  # noqa: BLE001 - never let a parsing corner case become a 500
            raise self._fail(f"token rejected: {type(exc).__name__}") from None

        return self._classify(claims)

    def _classify(self, claims: dict[str, Any]) -> AccessClaims:
        # Belt and braces on top of pyjwt's own checks.
        if claims.get("iss") != self._config.team_domain:
            raise self._fail("issuer mismatch")
        if claims.get("type") != "app":
            raise self._fail("token type is not 'app'")

        sub = claims.get("sub")
        if not isinstance(sub, str):
            raise self._fail("missing sub")
        raw = dict(claims)

        if sub == "":
            common_name = claims.get("common_name")
            if not isinstance(common_name, str) or not common_name.strip():
                raise self._fail("service token without common_name")
            return AccessClaims(kind="service", email=None, common_name=common_name, sub=sub, raw=raw)

        email = claims.get("email")
        if not isinstance(email, str) or not email.strip():
            raise self._fail("user token without email")
        return AccessClaims(kind="user", email=email, common_name=None, sub=sub, raw=raw)

    @staticmethod
    def _fail(reason: str) -> Unauthenticated:
        log.debug("cloudflare access token rejected: %s", reason)
        return Unauthenticated(_INVALID)

    # ------------------------------------------------------------------ JWKS

    async def _key_for(self, kid: str) -> RSAPublicKey:
        cfg = self._config
        now = self._clock()
        keys = self._keys

        if keys is None or now - self._fetched_at >= cfg.jwks_cache_seconds:
            # Nothing cached yet, or the cache expired: refresh (rate-limited if previous attempts failed).
            await self._refresh(self._generation, reason="expired")
        elif kid not in keys:
            # Maybe the key rotated: refetch once, but not if we fetched a moment ago.
            await self._refresh(self._generation, reason="unknown kid")

        keys = self._keys
        if keys is None:
            raise self._fail("no JWKS available")
        if self._clock() - self._fetched_at >= cfg.jwks_cache_seconds + cfg.jwks_max_stale_seconds:
            raise self._fail("JWKS too stale and refresh failing")
        key = keys.get(kid)
        if key is None:
            raise self._fail("kid not in JWKS")
        return key

    async def _refresh(self, seen_generation: int, *, reason: str) -> None:
        async with self._lock:
            if self._generation != seen_generation:
                return  # someone else fetched while we waited for the lock
            now = self._clock()
            if self._attempted_at is not None and now - self._attempted_at < self._config.jwks_min_refetch_seconds:
                return  # rate limit: the set fetched (or tried) a moment ago is as fresh as we will get
            self._attempted_at = now
            try:
                keys = await self._fetch()
            except Exception as exc:  # noqa: BLE001 - a JWKS outage must become 401, not 500
                log.warning(
                    "cloudflare access JWKS fetch from %s failed (%s): %s: %s",
                    self._config.jwks_url,
                    reason,
                    type(exc).__name__,
                    exc,
                )
                return
            finally:
                # Bumped when the attempt is over, so coroutines that queued during it see it and don't repeat it.
                self._generation += 1
            self._keys = keys
            self._fetched_at = self._clock()
            log.debug("cloudflare access JWKS refreshed (%s): %d keys", reason, len(keys))

    async def _fetch(self) -> dict[str, RSAPublicKey]:
        client = self._client
        if client is None:
            client = self._client = httpx.AsyncClient(timeout=self._config.http_timeout_seconds)
        response = await client.get(
            self._config.jwks_url,  # type: ignore[arg-type]  # normalised to str in __post_init__
            headers={"Accept": "application/json"},
            timeout=self._config.http_timeout_seconds,
        )
        response.raise_for_status()
        if len(response.content) > _MAX_JWKS_BYTES:
            raise ValueError("JWKS response too large")
        data = response.json()
        if not isinstance(data, dict):
            raise ValueError("JWKS is not a JSON object")
        jwk_set = jwt.PyJWKSet.from_dict(data)
        keys: dict[str, RSAPublicKey] = {}
        for jwk in jwk_set.keys:
            if not jwk.key_id or not isinstance(jwk.key, RSAPublicKey):
                continue  # only RSA public keys with a kid can verify an Access token
            if jwk.algorithm_name not in (_ALGORITHM, None):
                continue
            keys[jwk.key_id] = jwk.key
        if not keys:
            raise ValueError("JWKS holds no usable RSA keys")
        return keys


def token_from_request(headers: Mapping[str, str], cookies: Mapping[str, str]) -> str | None:
    """The Access token of a request: header ``Cf-Access-Jwt-Assertion`` first, then cookie ``CF_Authorization``."""
    value = _header(headers, ACCESS_HEADER)
    if value:
        return value
    cookie = cookies.get(ACCESS_COOKIE) if cookies is not None else None
    if isinstance(cookie, str) and cookie.strip():
        return cookie.strip()
    return None


def _header(headers: Mapping[str, str], name: str) -> str | None:
    if headers is None:
        return None
    value: Any = None
    for candidate in (name, name.lower()):
        value = headers.get(candidate)
        if value:
            break
    else:
        wanted = name.lower()
        for key, val in headers.items():
            if isinstance(key, str) and key.lower() == wanted and val:
                value = val
                break
    if isinstance(value, bytes):
        value = value.decode("latin-1")
    if isinstance(value, str) and value.strip():
        return value.strip()
    return None
