"""The web console at ``/``: a small single-page app (plain ES modules, Preact + htm vendored as one file) served
by the service itself, fully offline, with no build step. It talks to the REST API like any client, with the
key in an ``Authorization: Bearer`` header (the key lives in the tab's sessionStorage only).

``GET /`` answers the console's HTML, or a small JSON index to a client that prefers ``application/json``.
The assets are served under ``/console/<hash of their contents>/``, so they can be cached for a year
(``immutable``): a changed file changes the address. The page is sent with a strict Content-Security-Policy
(scripts, styles and requests from this origin only; nothing inline, no eval)."""

from __future__ import annotations

import hashlib
from functools import lru_cache
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from litestar import Request, Response, get
from litestar.datastructures import CacheControlHeader
from litestar.static_files import create_static_files_router

__all__ = ["console_handlers", "STATIC_DIR", "CSP", "asset_base"]

STATIC_DIR = Path(__file__).parent / "static"
CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
       "font-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'")
SECURITY_HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff",
                    "Referrer-Policy": "no-referrer", "X-Frame-Options": "DENY"}
_PUBLIC = {"exclude_from_auth": True}


@lru_cache(maxsize=1)
def asset_base() -> str:
    """``/console/<12 hex digits>``: the digest of every static file's path and bytes."""
    h = hashlib.sha256()
    for f in sorted(p for p in STATIC_DIR.rglob("*") if p.is_file()):
        h.update(f.relative_to(STATIC_DIR).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return f"/console/{h.hexdigest()[:12]}"


@lru_cache(maxsize=1)
def _page() -> str:
    return (STATIC_DIR / "index.html").read_text(encoding="utf-8").replace("{{ASSETS}}", asset_base())


def _version() -> str:
    try:
        return version("memex")
    except PackageNotFoundError:  # pragma: no cover - running from a checkout that was never installed
        return "unknown"


def index_document() -> dict[str, Any]:
    return {"name": "memex", "version": _version(), "docs": "/docs", "openapi": "/schema/openapi.json",
            "health": "/health", "console": "/"}


@get("/", include_in_schema=False, opt=_PUBLIC, name="console")
async def console_index(request: Request) -> Response:
    """The console to a browser; the JSON index to a client that prefers application/json."""
    wanted = request.accept.best_match(["text/html", "application/json"], default="text/html")
    if wanted == "application/json":
        return Response(index_document(), media_type="application/json",
                        headers={"Vary": "Accept", "Cache-Control": "no-cache"})
    return Response(_page(), media_type="text/html",
                    headers={**SECURITY_HEADERS, "Vary": "Accept", "Cache-Control": "no-cache"})


async def _secure(response: Response) -> Response:
    response.headers.update(SECURITY_HEADERS)
    return response


def console_handlers() -> list:
    assets = create_static_files_router(
        path=asset_base(), directories=[STATIC_DIR], opt=_PUBLIC, include_in_schema=False, name="console-assets",
        cache_control=CacheControlHeader(public=True, max_age=31_536_000, immutable=True), after_request=_secure)
    return [console_index, assets]
