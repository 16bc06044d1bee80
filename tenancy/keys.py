"""API keys: ``mx_<key id>_<secret>``, stored only as an argon2id hash.

* The raw key is ``mx_`` + a public 16-hex key id + ``_`` + 43 url-safe characters of ``secrets`` (256 bits).
  It is returned once, at creation, and never again.
* Stored: key id, argon2id PHC hash, name, display prefix, scopes, created/expires/revoked/last-used times.
* Verifying looks the key id up and runs argon2 off the event loop; an unknown id still runs a dummy verify,
  so timing does not tell which ids exist.
* argon2 costs tens of ms a verify, so a success is cached in process for at most ``cache_seconds`` (<= 60)
  under an HMAC of the raw key (a per-process secret: the cache never holds a raw key).
* Each argon2 run holds 19 MiB. Concurrent requests presenting the same uncached key share one verification (the
  4 clients of an import that start together ran four: +80 MB of peak RSS, 3 wasted runs), and at most one run
  per core is in flight, so a burst of distinct keys (or of guesses) queues instead of holding 19 MiB each.
* Revocation reaches every process within a second, whatever path revoked: triggers (migration 0010) append a
  row to ``key_revocations`` for every key revoked, re-scoped or deleted and every organization suspended; a
  cache hit older than ``revocation_check_seconds`` (0.5 s) since the last look first reads the rows past the
  last generation seen (one indexed query, shared by concurrent requests) and evicts those keys. A cache
  entry remembers the generation its row was read at; one read before a revocation already applied is not
  cached. Revoking through this process also evicts at once.
* last_used_at is written at most once a minute per key, off the request path.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import hmac
import json
import os
import re
import secrets
import time
from dataclasses import dataclass
from typing import Any, Final, TypedDict

from argon2 import PasswordHasher
from argon2.exceptions import InvalidHashError, VerificationError, VerifyMismatchError

from services.errors import InvalidInput, NotFound
from services.ports import SqlDatabase, Statement
from services.storage.scoped import OrgSql
from services.ids import now_ms
from tenancy.models import SCOPES

__all__ = ["ARGON2_PARAMETERS", "IssuedKey", "KeyRecord", "VerifiedKey", "KeyManager", "OrgKeys", "parse_raw_key"]


class Argon2Parameters(TypedDict):
    time_cost: int
    memory_cost: int
    parallelism: int
    hash_len: int
    salt_len: int


#: argon2id parameters: 2 passes over 19 MiB with 1 lane (OWASP's baseline), 16-byte salt, 32-byte hash.
ARGON2_PARAMETERS: Final = Argon2Parameters(time_cost=2, memory_cost=19 * 1024, parallelism=1, hash_len=32, salt_len=16)
_hasher = PasswordHasher(**ARGON2_PARAMETERS)
_DUMMY_HASH = _hasher.hash("memex-dummy-key-for-constant-time")
_RAW = re.compile(r"^mx_([0-9a-f]{16})_([A-Za-z0-9_-]{43})$")
LAST_USED_EVERY_MS = 60_000


def parse_raw_key(raw: str) -> str | None:
    """The key id inside a raw key, or None when it is not shaped like one of ours."""
    m = _RAW.match(raw or "")
    return f"key_{m.group(1)}" if m else None


def _validate_scopes(scopes: list[str]) -> list[str]:
    if not scopes or any(s not in SCOPES for s in scopes):
        raise InvalidInput("scopes must be a non-empty subset of read, write, admin", details={"field": "scopes"})
    return sorted(set(scopes))


@dataclass(frozen=True, slots=True)
class KeyRecord:
    id: str
    organization_id: str
    name: str
    prefix: str
    scopes: list[str]
    created_at: int
    expires_at: int | None
    revoked_at: int | None
    last_used_at: int | None

    @classmethod
    def from_row(cls, r: dict[str, Any]) -> "KeyRecord":
        return cls(
            r["id"], r["organization_id"], r["name"], r["prefix"], json.loads(r["scopes"]),
            r["created_at"], r["expires_at"], r["revoked_at"], r["last_used_at"],
        )


@dataclass(frozen=True, slots=True)
class IssuedKey:
    record: KeyRecord
    raw: str


@dataclass(frozen=True, slots=True)
class VerifiedKey:
    key_id: str
    organization_id: str
    scopes: frozenset[str]
    expires_at: int | None


class KeyManager:
    """Key creation and verification for the whole deployment; ``for_org`` gives an org's key admin."""

    def __init__(self, db: SqlDatabase, *, cache_seconds: int = 60, revocation_check_seconds: float = 0.5) -> None:
        self.db = db
        self.cache_seconds = min(60, max(0, cache_seconds))
        self.revocation_check_seconds = min(0.9, max(0.0, revocation_check_seconds))
        #: The newest key_revocations generation applied to the cache (None: not read yet).
        self._generation: int | None = None
        self._checked_at = float("-inf")
        self._checking: asyncio.Future[None] | None = None
        self._by_org: dict[str, set[str]] = {}
        self._secret = secrets.token_bytes(32)
        self._cache: dict[bytes, tuple[VerifiedKey, float]] = {}
        self._by_key: dict[str, set[bytes]] = {}
        self._last_used: dict[str, int] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        #: Verifications running, by the HMAC of the raw key: concurrent requests with that key await the same one.
        self._inflight: dict[bytes, asyncio.Task[VerifiedKey | None]] = {}
        #: argon2 runs in flight at once (each holds 19 MiB; more than one a core only adds memory, not speed).
        self._argon2_slots = asyncio.Semaphore(max(1, os.cpu_count() or 1))

    def for_org(self, org_id: str) -> "OrgKeys":
        return OrgKeys(self, OrgSql(self.db, org_id))

    async def prepare(
        self, org_id: str, *, name: str, scopes: list[str], expires_at: int | None = None
    ) -> tuple[IssuedKey, Statement]:
        """Mint a key and the statement that stores it (inserted only if the organization exists)."""
        if not name or len(name) > 100:
            raise InvalidInput("key name must be 1-100 characters", details={"field": "name"})
        scopes = _validate_scopes(scopes)
        if expires_at is not None and expires_at <= now_ms():
            raise InvalidInput("expires_at must be in the future (epoch ms)", details={"field": "expires_at"})
        hex_id = secrets.token_hex(8)
        raw = f"mx_{hex_id}_{secrets.token_urlsafe(32)}"
        async with self._argon2_slots:
            key_hash = await asyncio.to_thread(_hasher.hash, raw)
        record = KeyRecord(f"key_{hex_id}", org_id, name, raw[:24] + "…", scopes, now_ms(), expires_at, None, None)
        stmt = Statement(
            "INSERT INTO api_keys (id, organization_id, name, prefix, key_hash, scopes, created_at, expires_at) "
            "SELECT ?, ?, ?, ?, ?, ?, ?, ? WHERE EXISTS (SELECT 1 FROM organizations WHERE id = ?)",
            (record.id, org_id, name, record.prefix, key_hash, json.dumps(scopes), record.created_at, expires_at, org_id),
        )
        return IssuedKey(record, raw), stmt

    def _cache_key(self, raw: str) -> bytes:
        return hmac.new(self._secret, raw.encode(), hashlib.sha256).digest()

    async def verify(self, raw: str) -> VerifiedKey | None:
        """The key's identity, or None for anything that is not a live key of an active organization."""
        ck = self._cache_key(raw)
        hit = self._cache.get(ck)
        now_mono = time.monotonic()
        if hit and hit[1] > now_mono:
            await self._apply_revocations()
            hit = self._cache.get(ck)
        if hit and hit[1] > now_mono:
            vk = hit[0]
            if vk.expires_at is None or vk.expires_at > now_ms():
                self._touch(vk.key_id)
                return vk
        task = self._inflight.get(ck)
        if task is None:
            task = asyncio.ensure_future(self._verify_uncached(raw, ck, now_mono))
            self._inflight[ck] = task
            task.add_done_callback(functools.partial(self._verified, ck))
        # shield: a request that goes away (its client disconnected) does not cancel the others' verification
        return await asyncio.shield(task)

    def _verified(self, ck: bytes, task: asyncio.Task[VerifiedKey | None]) -> None:
        if self._inflight.get(ck) is task:
            del self._inflight[ck]
        if not task.cancelled():
            task.exception()  # retrieved here: every waiter may have gone away

    async def _verify_uncached(self, raw: str, ck: bytes, now_mono: float) -> VerifiedKey | None:
        key_id = parse_raw_key(raw)
        row = None
        if key_id:
            rows = (
                await self.db.execute(
                    "SELECT k.*, o.status AS org_status, "
                    "(SELECT COALESCE(MAX(generation), 0) FROM key_revocations) AS revocation_generation "
                    "FROM api_keys k JOIN organizations o ON o.id = k.organization_id WHERE k.id = ?",
                    (key_id,),
                )
            ).rows
            row = rows[0] if rows else None
        async with self._argon2_slots:
            ok = await asyncio.to_thread(_verify_hash, row["key_hash"] if row else _DUMMY_HASH, raw)
        if not (ok and row):
            return None
        if row["revoked_at"] is not None or row["org_status"] != "active":
            return None
        if row["expires_at"] is not None and row["expires_at"] <= now_ms():
            return None
        vk = VerifiedKey(row["id"], row["organization_id"], frozenset(json.loads(row["scopes"])), row["expires_at"])
        if self._cacheable(row["revocation_generation"], now_mono):
            self._cache[ck] = (vk, now_mono + self.cache_seconds)
            self._by_key.setdefault(vk.key_id, set()).add(ck)
            self._by_org.setdefault(vk.organization_id, set()).add(vk.key_id)
            if len(self._cache) > 50_000:
                self._sweep()
        self._last_used.setdefault(vk.key_id, row["last_used_at"] or 0)
        self._touch(vk.key_id)
        return vk

    def evict(self, key_id: str) -> None:
        for ck in self._by_key.pop(key_id, set()):
            self._cache.pop(ck, None)

    def _cacheable(self, generation: int, now_mono: float) -> bool:
        """May a row read at ``generation`` be cached? Not when a newer revocation was already applied (it may
        concern this key and will not be read again)."""
        if not self.cache_seconds:
            return False
        if self._generation is None:  # the first row read tells where the log stands
            self._generation, self._checked_at = generation, now_mono
        return generation >= self._generation

    async def _apply_revocations(self) -> None:
        """Evict the keys revoked since the last look, if that look is older than revocation_check_seconds.
        Concurrent requests share one read; a failed read fails the request (a revoked key is never let in
        because the store could not be asked)."""
        if time.monotonic() - self._checked_at < self.revocation_check_seconds:
            return
        if self._checking is None or self._checking.done():
            self._checking = asyncio.ensure_future(self._read_revocations())
        checking = self._checking
        try:
            await asyncio.shield(checking)
        finally:
            if self._checking is checking and checking.done():
                self._checking = None

    async def _read_revocations(self) -> None:
        started = time.monotonic()
        rows = (
            await self.db.execute(
                "SELECT generation, organization_id, key_id FROM key_revocations WHERE generation > ? "
                "ORDER BY generation LIMIT 1000",
                (self._generation or 0,),
            )
        ).rows
        if len(rows) == 1000 or self._generation is None:  # too far behind to replay (or first look): start afresh
            self._cache.clear()
            self._by_key.clear()
            self._by_org.clear()
            if len(rows) == 1000:
                top = (await self.db.execute("SELECT COALESCE(MAX(generation), 0) AS g FROM key_revocations")).rows
                rows = [{"generation": top[0]["g"], "organization_id": "", "key_id": ""}]
        for r in rows:
            if r["key_id"] is None:
                for key_id in self._by_org.pop(r["organization_id"], set()):
                    self.evict(key_id)
            elif r["key_id"]:
                self.evict(r["key_id"])
        if rows:
            self._generation = max(self._generation or 0, rows[-1]["generation"])
        elif self._generation is None:
            self._generation = 0
        self._checked_at = started

    def _sweep(self) -> None:
        now_mono = time.monotonic()
        for ck, (vk, exp) in list(self._cache.items()):
            if exp <= now_mono:
                self._cache.pop(ck, None)
                self._by_key.get(vk.key_id, set()).discard(ck)
        for key_id in [k for k, cks in self._by_key.items() if not cks]:
            del self._by_key[key_id]
        live = set(self._by_key)
        for org_id in list(self._by_org):
            self._by_org[org_id] &= live
            if not self._by_org[org_id]:
                del self._by_org[org_id]

    def _touch(self, key_id: str) -> None:
        now = now_ms()
        if now - self._last_used.get(key_id, 0) < LAST_USED_EVERY_MS:
            return
        self._last_used[key_id] = now
        task = asyncio.get_running_loop().create_task(self._write_last_used(key_id, now))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _write_last_used(self, key_id: str, now: int) -> None:
        try:
            await self.db.execute(
                "UPDATE api_keys SET last_used_at = ? WHERE id = ? AND (last_used_at IS NULL OR last_used_at < ?)",
                (now, key_id, now - LAST_USED_EVERY_MS + 1),
            )
        except Exception:  # bookkeeping only: never fail a request over it
            pass

    async def drain(self) -> None:
        if self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)


def _verify_hash(key_hash: str, raw: str) -> bool:
    try:
        return _hasher.verify(key_hash, raw)
    except (VerifyMismatchError, VerificationError, InvalidHashError):
        return False


class OrgKeys:
    """Key administration for one organization."""

    def __init__(self, manager: KeyManager, sql: OrgSql) -> None:
        self.manager = manager
        self.sql = sql

    async def create(self, *, name: str, scopes: list[str], expires_at: int | None = None) -> IssuedKey:
        issued, stmt = await self.manager.prepare(self.sql.org_id, name=name, scopes=scopes, expires_at=expires_at)
        await self.manager.db.execute(stmt.sql, stmt.params)
        return issued

    async def list(self) -> list[KeyRecord]:
        rows = await self.sql.rows(
            "SELECT id, organization_id, name, prefix, scopes, created_at, expires_at, revoked_at, last_used_at "
            "FROM api_keys WHERE organization_id = ?1 ORDER BY created_at, id"
        )
        return [KeyRecord.from_row(r) for r in rows]

    async def get(self, key_id: str) -> KeyRecord:
        row = await self.sql.one(
            "SELECT id, organization_id, name, prefix, scopes, created_at, expires_at, revoked_at, last_used_at "
            "FROM api_keys WHERE organization_id = ?1 AND id = ?2",
            [key_id],
        )
        if row is None:
            raise NotFound("key not found")
        return KeyRecord.from_row(row)

    async def revoke(self, key_id: str) -> KeyRecord:
        await self.sql.execute(
            "UPDATE api_keys SET revoked_at = ?3 WHERE organization_id = ?1 AND id = ?2 AND revoked_at IS NULL",
            [key_id, now_ms()],
        )
        record = await self.get(key_id)  # 404 when the key is not this organization's
        self.manager.evict(key_id)
        return record
