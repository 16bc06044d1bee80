"""The ASGI app: routing under /client/v4, auth, global rate limit, faults, counters, and /__emulator admin."""

from __future__ import annotations

import json
import logging
import re
from typing import Any, Awaitable, Callable

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from . import d1 as d1mod
from .errors import (
    AUTH_ERROR,
    MALFORMED_JSON,
    METHOD_NOT_ALLOWED,
    NO_ROUTE,
    RATE_LIMITED,
    SERVER_ERROR,
    CFError,
    envelope,
    error_envelope,
)

log = logging.getLogger("cloudflare_emulator")

API_PREFIX = "/client/v4"
ADMIN_PREFIX = "/__emulator"


def _json_bytes(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode("utf-8")


class _Json(JSONResponse):
    def render(self, content: Any) -> bytes:
        return _json_bytes(content)


def _reply(status: int, body: Any, headers: dict[str, str] | None = None) -> Response:
    if isinstance(body, str):
        return Response(body, status_code=status, headers=headers)
    return _Json(body, status_code=status, headers=headers)


async def _json_body(request: Request) -> Any:
    raw = await request.body()
    if not raw.strip():
        return {}
    try:
        return json.loads(raw)
    except ValueError:
        raise CFError(400, MALFORMED_JSON, "Malformed JSON in request body") from None


Handler = Callable[["_Ctx"], Awaitable[Any]]


class _Ctx:
    def __init__(self, emu: Any, request: Request, account: str, params: dict[str, str]):
        self.emu = emu
        self.request = request
        self.account = account
        self.params = params
        self.status = 200
        self.result_info: dict | None = None


# --------------------------------------------------------------------------------------------------------
# Handlers
# --------------------------------------------------------------------------------------------------------

async def d1_list(c: _Ctx) -> Any:
    q = c.request.query_params
    dbs, c.result_info = c.emu.d1.list(c.account, q.get("name"), q.get("page"), q.get("per_page"))
    return dbs


async def d1_create(c: _Ctx) -> Any:
    return c.emu.d1.create(c.account, await _json_body(c.request))


async def d1_get(c: _Ctx) -> Any:
    return c.emu.d1.get(c.account, c.params["db"]).info()


async def d1_delete(c: _Ctx) -> Any:
    c.emu.d1.delete(c.account, c.params["db"])
    return None


async def _d1_run(c: _Ctx, raw: bool) -> Any:
    db = c.emu.d1.get(c.account, c.params["db"])
    items = d1mod.parse_body(await _json_body(c.request))
    try:
        return db.execute(items, raw)
    except d1mod.D1Error as e:
        raise d1mod.error(str(e)) from e


async def d1_query(c: _Ctx) -> Any:
    return await _d1_run(c, raw=False)


async def d1_raw(c: _Ctx) -> Any:
    return await _d1_run(c, raw=True)


async def vec_list_indexes(c: _Ctx) -> Any:
    return c.emu.vectorize.list_indexes(c.account)


async def vec_create_index(c: _Ctx) -> Any:
    res = c.emu.vectorize.create_index(c.account, await _json_body(c.request))
    c.status = 201
    return res


async def vec_get_index(c: _Ctx) -> Any:
    return c.emu.vectorize.get_index(c.account, c.params["index"])


async def vec_delete_index(c: _Ctx) -> Any:
    c.emu.vectorize.delete_index(c.account, c.params["index"])
    return None


async def vec_info(c: _Ctx) -> Any:
    return c.emu.vectorize.info(c.account, c.params["index"])


async def _vec_payload(request: Request) -> bytes:
    ctype = request.headers.get("content-type", "")
    if ctype.startswith("multipart/form-data"):
        try:
            form = await request.form(max_part_size=110 * 1024 * 1024)
        except Exception as e:  # malformed multipart
            raise CFError(400, 40001, f"could not parse multipart body: {e}") from e
        field = form.get("vectors")
        if field is None:
            raise CFError(400, 40001, "multipart body needs a 'vectors' field")
        if isinstance(field, str):
            return field.encode("utf-8")
        return await field.read()
    return await request.body()


async def _vec_write(c: _Ctx, kind: str) -> Any:
    payload = await _vec_payload(c.request)
    unparsable = c.request.query_params.get("unparsable-behavior", "error")
    return c.emu.vectorize.write(c.account, c.params["index"], kind, payload, unparsable)


async def vec_insert(c: _Ctx) -> Any:
    return await _vec_write(c, "insert")


async def vec_upsert(c: _Ctx) -> Any:
    return await _vec_write(c, "upsert")


async def vec_query(c: _Ctx) -> Any:
    return c.emu.vectorize.query(c.account, c.params["index"], await _json_body(c.request))


async def vec_get_by_ids(c: _Ctx) -> Any:
    return c.emu.vectorize.get_by_ids(c.account, c.params["index"], await _json_body(c.request))


async def vec_delete_by_ids(c: _Ctx) -> Any:
    return c.emu.vectorize.delete_by_ids(c.account, c.params["index"], await _json_body(c.request))


async def vec_list(c: _Ctx) -> Any:
    q = c.request.query_params
    return c.emu.vectorize.list_vectors(c.account, c.params["index"], q.get("count"), q.get("cursor"))


async def vec_mi_create(c: _Ctx) -> Any:
    return c.emu.vectorize.create_metadata_index(c.account, c.params["index"], await _json_body(c.request))


async def vec_mi_list(c: _Ctx) -> Any:
    return c.emu.vectorize.list_metadata_indexes(c.account, c.params["index"])


async def vec_mi_delete(c: _Ctx) -> Any:
    return c.emu.vectorize.delete_metadata_index(c.account, c.params["index"], await _json_body(c.request))


async def ai_run(c: _Ctx) -> Any:
    return c.emu.ai.run(c.params["model"], await _json_body(c.request))


_V = r"vectorize/v2/indexes"
_N = r"(?P<index>[^/]+)"
ROUTES: list[tuple[str, re.Pattern, str, Handler]] = [
    (m, re.compile(p + r"$"), op, h) for m, p, op, h in [
        ("GET", r"d1/database", "d1.list", d1_list),
        ("POST", r"d1/database", "d1.create", d1_create),
        ("GET", r"d1/database/(?P<db>[^/]+)", "d1.get", d1_get),
        ("DELETE", r"d1/database/(?P<db>[^/]+)", "d1.delete", d1_delete),
        ("POST", r"d1/database/(?P<db>[^/]+)/query", "d1.query", d1_query),
        ("POST", r"d1/database/(?P<db>[^/]+)/raw", "d1.raw", d1_raw),
        ("GET", _V, "vectorize.list_indexes", vec_list_indexes),
        ("POST", _V, "vectorize.create_index", vec_create_index),
        ("GET", rf"{_V}/{_N}", "vectorize.get_index", vec_get_index),
        ("DELETE", rf"{_V}/{_N}", "vectorize.delete_index", vec_delete_index),
        ("GET", rf"{_V}/{_N}/info", "vectorize.info", vec_info),
        ("POST", rf"{_V}/{_N}/insert", "vectorize.insert", vec_insert),
        ("POST", rf"{_V}/{_N}/upsert", "vectorize.upsert", vec_upsert),
        ("POST", rf"{_V}/{_N}/query", "vectorize.query", vec_query),
        ("POST", rf"{_V}/{_N}/get_by_ids", "vectorize.get_by_ids", vec_get_by_ids),
        ("POST", rf"{_V}/{_N}/delete_by_ids", "vectorize.delete_by_ids", vec_delete_by_ids),
        ("GET", rf"{_V}/{_N}/list", "vectorize.list", vec_list),
        ("POST", rf"{_V}/{_N}/metadata_index/create", "vectorize.metadata_index_create", vec_mi_create),
        ("GET", rf"{_V}/{_N}/metadata_index/list", "vectorize.metadata_index_list", vec_mi_list),
        ("POST", rf"{_V}/{_N}/metadata_index/delete", "vectorize.metadata_index_delete", vec_mi_delete),
        ("POST", r"ai/run/(?P<model>.+)", "ai.run", ai_run),
    ]
]
_ACCOUNT_RE = re.compile(r"^/accounts/(?P<account>[^/]+)(?:/(?P<rest>.*))?$")


def _kind(rest: str) -> str:
    for k in ("d1", "vectorize", "ai"):
        if rest == k or rest.startswith(k + "/"):
            return k
    return "other"


def _resolve(method: str, rest: str) -> tuple[str, Handler | None, dict[str, str], bool]:
    """-> (op name, handler or None, path params, path-exists-with-other-method)."""
    other_method = False
    for m, pat, op, h in ROUTES:
        mt = pat.match(rest)
        if mt:
            if m == method:
                params = mt.groupdict()
                if op == "ai.run":
                    op = f"ai.run:{params['model']}"
                return op, h, params, False
            other_method = True
    return f"{_kind(rest)}.unknown", None, {}, other_method


# --------------------------------------------------------------------------------------------------------
# Entry points
# --------------------------------------------------------------------------------------------------------

def build_app(emu: Any) -> Starlette:
    async def api(request: Request) -> Response:
        path = request.url.path[len(API_PREFIX):]
        mt = _ACCOUNT_RE.match(path)
        account = mt.group("account") if mt else ""
        rest = (mt.group("rest") or "").rstrip("/") if mt else ""
        method = request.method.upper()
        op, handler, params, other_method = _resolve(method, rest) if mt else ("other.unknown", None, {}, False)
        emu.counters.record(_kind(rest) if mt else "other", op, params.get("db") if op.startswith("d1.") else None)
        resp = await _serve(request, account, method, path, handler, params, other_method, mt is not None)
        emu.counters.record_status(resp.status_code)
        return resp

    async def _serve(request: Request, account: str, method: str, path: str, handler: Handler | None,
                     params: dict[str, str], other_method: bool, under_account: bool) -> Response:
        # 1. auth
        auth = request.headers.get("authorization", "")
        if not auth.lower().startswith("bearer ") or not auth[7:].strip():
            return _reply(401, error_envelope(AUTH_ERROR, "Authentication error"))
        token = auth[7:].strip()
        if token not in emu.tokens:
            return _reply(403, error_envelope(AUTH_ERROR, "Authentication error"))
        # 2. global rate limit (per token, across the whole API)
        allowed, rl_headers = emu.rate_limiter.hit(token)
        if not allowed:
            return _reply(429, error_envelope(RATE_LIMITED, "Please wait and consider throttling your request speed"),
                          rl_headers)
        try:
            if not under_account:
                raise CFError(404, NO_ROUTE, "No route for that URI")
            if account not in emu.accounts:
                raise CFError(403, AUTH_ERROR, "Authentication error")
            # 3. injected faults
            fault = emu.faults.take(method, request.url.path)
            if fault is not None and not fault.after:
                status, body, headers = fault.response()
                return _reply(status, body, {**rl_headers, **headers})
            if handler is None:
                if other_method:
                    raise CFError(405, METHOD_NOT_ALLOWED, "Method not allowed for this URI")
                raise CFError(404, NO_ROUTE, "No route for that URI")
            ctx = _Ctx(emu, request, account, params)
            result = await handler(ctx)
            if fault is not None:
                status, body, headers = fault.response()
                return _reply(status, body, {**rl_headers, **headers})
            return _reply(ctx.status, envelope(result, result_info=ctx.result_info), rl_headers)
        except CFError as e:
            return _reply(e.status, error_envelope(e.code, e.message), {**rl_headers, **e.headers})
        except Exception as e:  # an emulator bug: still answer an envelope, and say so
            log.exception("cloudflare emulator: unhandled error on %s %s", method, path)
            return _reply(500, error_envelope(SERVER_ERROR, f"internal emulator error: {type(e).__name__}: {e}"),
                          rl_headers)

    async def admin(request: Request) -> Response:
        path = request.url.path[len(ADMIN_PREFIX):].rstrip("/")
        method = request.method.upper()
        try:
            body = await request.json() if method in ("POST", "PUT") and (await request.body()).strip() else {}
        except ValueError:
            return _Json({"error": "malformed JSON"}, status_code=400)
        try:
            out = emu.admin(method, path, body if isinstance(body, dict) else {"_": body})
        except KeyError:
            return _Json({"error": f"no admin route {method} {path}"}, status_code=404)
        except (ValueError, TypeError) as e:
            return _Json({"error": str(e)}, status_code=400)
        return _Json(out)

    methods = ["GET", "POST", "PUT", "PATCH", "DELETE"]
    return Starlette(routes=[
        Route(API_PREFIX + "/{rest:path}", api, methods=methods),
        Route(ADMIN_PREFIX + "/{rest:path}", admin, methods=methods),
    ])
