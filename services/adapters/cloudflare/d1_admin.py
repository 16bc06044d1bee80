"""D1 database administration over REST: create, list, find and delete whole databases (one per organization).

Endpoints (``/accounts/{a}/d1/database``): ``POST ""`` ``{"name", "primary_location_hint"?, "jurisdiction"?}`` →
the new database (``result.uuid``); ``GET ""`` with ``page`` (≥ 1), ``per_page`` (10..10,000) and ``name`` ("a
database name to search for") → a page plus ``result_info``; ``DELETE /{uuid}``. Error codes: 7404 no such
database, 7406 account limit (HTTP 400, "System limit reached: databases per account (N)"), 7502 duplicate name
(what wrangler's ``d1 create`` maps to "A database with that name already exists").

Every call goes through the shared ``CloudflareApi``: same request budget, counters (kind ``d1``) and retry
policy as the other adapters.

* ``create_database(name)`` is made safe to retry although creation is not idempotent on the wire: names are
  unique per account, so a repeated create either makes the database (the first try never ran) or answers
  7502, which is resolved by looking the name up and returning that database's uuid. So the client may retry
  a create after a timeout or 5xx, and a caller may call it again after a crash: "create or get by name".
  Callers must derive the name from what owns the database (the organization id), never reuse one.
* ``delete_database(uuid)`` is idempotent: a database that is already gone (7404) is not an error.
* ``list_databases(name_prefix)`` follows the pages; the prefix is applied here, not sent as ``name``: the
  docs do not say whether ``name`` is an exact, prefix or substring match.
* ``find_database(name)`` sends ``name`` to narrow the listing and keeps only the exact match.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from services.errors import InsufficientStorage, InvalidInput

from .client import CloudflareApi, CloudflareApiError, CloudflareNotFound
from .d1 import D1Database

__all__ = ["D1Admin", "D1AccountLimit", "D1_NOT_FOUND", "D1_ACCOUNT_LIMIT", "D1_DUPLICATE_NAME"]

D1_NOT_FOUND = 7404
D1_ACCOUNT_LIMIT = 7406
D1_DUPLICATE_NAME = 7502

MIN_PAGE_SIZE, MAX_PAGE_SIZE = 10, 10_000
_ID_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_LIMIT_RE = re.compile(r"databases per account \((\d+)\)")


class D1AccountLimit(CloudflareApiError, InsufficientStorage):
    """The Cloudflare account holds as many D1 databases as it may (code 7406): no new database can be made.

    Why an ``InsufficientStorage`` (507 ``insufficient_storage``) rather than a plain ``BackendError`` (503
    ``backend_unavailable``): a 503 tells the API user "retry shortly", and retrying will not help here until
    an operator deletes databases or the plan's limit (10 on Free, 50,000 on Paid) is raised. The request asked
    us to store something new (an organization's database) and nothing was stored, which is what 507 says.
    It is still a ``CloudflareApiError`` (so ``except CloudflareApiError`` sees it, with ``errors``, ``codes``,
    ``attempts``); unlike its siblings its ``status`` is the HTTP status we answer (507), not Cloudflare's
    (that one is ``cloudflare_status``).
    """

    def __init__(self, message: str, *, limit: int | None = None, cloudflare_status: int | None = None,
                 **kw: Any) -> None:
        details = {**kw.pop("details", {}), "limit": limit}
        super().__init__(message, status=cloudflare_status, details=details, **kw)
        self.cloudflare_status = cloudflare_status
        self.status = InsufficientStorage.status
        self.limit = limit


def _has(err: CloudflareApiError, code: int, *texts: str) -> bool:
    low = err.text.lower()
    return code in err.codes or any(t in low for t in texts)


def _is_duplicate(err: CloudflareApiError) -> bool:
    return _has(err, D1_DUPLICATE_NAME, "already exists")


def _is_account_limit(err: CloudflareApiError) -> bool:
    return _has(err, D1_ACCOUNT_LIMIT, "databases per account")


def _classify(err: CloudflareApiError) -> str | None:
    """The limit and duplicate answers are final whatever HTTP status carries them (retrying cannot help)."""
    return "fatal" if _is_account_limit(err) or _is_duplicate(err) else None


def _check_id(uuid: str) -> str:
    if not isinstance(uuid, str) or not _ID_RE.match(uuid):
        raise InvalidInput("a D1 database id is letters, digits, '-' and '_' (a UUID)", details={"id": str(uuid)[:80]})
    return uuid


class D1Admin:
    """Create, list, find and delete D1 databases of the account, on the shared ``CloudflareApi``.

    ``protected`` ids are never deleted (the factory protects the control database, ``CLOUDFLARE_D1_DATABASE_ID``).
    ``primary_location_hint`` (weur, eeur, apac, oc, wnam, enam) and ``jurisdiction`` (eu, fedramp) go with every
    create. ``page_size`` is the ``per_page`` of listings (10..10,000: fewer requests per listing of a large
    account; 50,000 databases list in 5 requests at the default).
    """

    def __init__(
        self,
        api: CloudflareApi,
        *,
        protected: Iterable[str] = (),
        primary_location_hint: str | None = None,
        jurisdiction: str | None = None,
        page_size: int = MAX_PAGE_SIZE,
        max_pages: int = 1000,
    ) -> None:
        if not MIN_PAGE_SIZE <= page_size <= MAX_PAGE_SIZE:
            raise ValueError(f"page_size must be between {MIN_PAGE_SIZE} and {MAX_PAGE_SIZE}")
        self.api = api
        self.protected = frozenset(p for p in protected if p)
        self.page_size = page_size
        self.max_pages = max_pages
        self._create_extra: dict[str, str] = {}
        if primary_location_hint:
            self._create_extra["primary_location_hint"] = primary_location_hint
        if jurisdiction:
            self._create_extra["jurisdiction"] = jurisdiction

    # -- create ------------------------------------------------------------------------------------------

    async def create_database(self, name: str) -> str:
        """Create the database ``name`` and return its uuid; if it already exists, return the existing uuid.

        Raises ``D1AccountLimit`` (507) when the account is full, ``CloudflareApiError`` (503) otherwise."""
        if not isinstance(name, str) or not name.strip() or name != name.strip():
            raise InvalidInput("a D1 database name must be a non-empty string without surrounding spaces",
                               details={"name": str(name)[:80]})
        body = {"name": name, **self._create_extra}
        for _ in range(2):
            try:
                # idempotent=True: a repeat after a lost answer gets 7502 and is resolved by name below
                result = await self.api.call("d1", "POST", "d1/database", json=body, idempotent=True,
                                             classify=_classify)
            except CloudflareApiError as err:
                # 7406 after a retry: an earlier try may have created it before the account filled up
                if _is_duplicate(err) or (_is_account_limit(err) and err.attempts > 1):
                    uuid = await self.find_database(name)
                    if uuid is not None:
                        return uuid
                    if not _is_account_limit(err):
                        continue  # the name's holder was deleted between the two calls: create again
                if _is_account_limit(err):
                    raise self._limit(err, name) from err
                raise
            uuid = result.get("uuid") if isinstance(result, dict) else None
            if not isinstance(uuid, str) or not uuid:
                raise CloudflareApiError("D1 created a database but answered without its uuid", kind="d1",
                                         details={"name": name, "result": str(result)[:200]})
            return uuid
        raise CloudflareApiError(f"D1 says a database named {name!r} exists but does not list it", kind="d1",
                                 details={"name": name})

    @staticmethod
    def _limit(err: CloudflareApiError, name: str) -> D1AccountLimit:
        m = _LIMIT_RE.search(err.text)
        limit = int(m.group(1)) if m else None
        cap = f" ({limit})" if limit is not None else ""
        return D1AccountLimit(
            f"insufficient storage: the Cloudflare account has reached its limit of D1 databases{cap}, so no new "
            "database can be created; delete unused databases or raise the account's limit",
            limit=limit, cloudflare_status=err.status, errors=err.errors, kind="d1", attempts=err.attempts,
            details={"name": name},
        )

    # -- delete ------------------------------------------------------------------------------------------

    async def delete_database(self, uuid: str) -> None:
        """Delete the database and its data. Idempotent: a database that is already gone is not an error."""
        _check_id(uuid)
        if uuid in self.protected:
            raise InvalidInput("refusing to delete a protected D1 database (the control database)",
                               details={"id": uuid})
        try:
            await self.api.call("d1", "DELETE", f"d1/database/{uuid}", idempotent=True, classify=_classify)
        except CloudflareNotFound as err:
            if D1_NOT_FOUND in err.codes:
                return
            raise  # a 404 without D1's code: wrong account or base URL, not "already deleted"

    # -- list / find -------------------------------------------------------------------------------------

    async def list_databases(self, name_prefix: str | None = None) -> list[dict]:
        """Every database of the account (``uuid``, ``name``, ``created_at``, ``version``...), all pages, in the
        API's order; only names starting with ``name_prefix`` when given."""
        dbs = await self._list(None)
        if name_prefix:
            dbs = [d for d in dbs if str(d.get("name", "")).startswith(name_prefix)]
        return dbs

    async def find_database(self, name: str) -> str | None:
        """The uuid of the database named exactly ``name``, or None."""
        for d in await self._list(name):
            if d.get("name") == name:
                return d["uuid"]
        return None

    async def _list(self, search: str | None) -> list[dict]:
        out: list[dict] = []
        seen: set[str] = set()
        page = 1
        while True:
            params: dict[str, Any] = {"page": page, "per_page": self.page_size}
            if search:
                params["name"] = search
            body = await self.api.call("d1", "GET", "d1/database", params=params, idempotent=True, envelope=True)
            items = body.get("result") if isinstance(body, dict) else None
            if not isinstance(items, list):
                raise CloudflareApiError("D1 listed databases without a result list", kind="d1",
                                         details={"body": str(body)[:200]})
            info = body.get("result_info") if isinstance(body.get("result_info"), dict) else {}
            fresh = 0
            for it in items:
                if isinstance(it, dict) and isinstance(it.get("uuid"), str) and it["uuid"] not in seen:
                    seen.add(it["uuid"])
                    out.append(it)
                    fresh += 1
            per_page = info.get("per_page")
            per_page = per_page if isinstance(per_page, int) and per_page > 0 else self.page_size
            total = info.get("total_count")
            # the end: a short page, the announced total reached, or a page with nothing new (a server that
            # ignores `page` would otherwise loop forever)
            if fresh == 0 or len(items) < per_page or (isinstance(total, int) and len(seen) >= total):
                return out
            page += 1
            if page > self.max_pages:
                raise CloudflareApiError(f"D1 database listing did not end after {self.max_pages} pages", kind="d1")

    # -- convenience -------------------------------------------------------------------------------------

    def database(self, uuid: str) -> D1Database:
        """The ``SqlDatabase`` adapter for one database of this account (same API, budget and counters)."""
        return D1Database(self.api, _check_id(uuid))
