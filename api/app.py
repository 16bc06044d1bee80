"""create_app(): the one place that wires the service together."""

from __future__ import annotations

import logging
import re
from contextlib import asynccontextmanager

from litestar import Litestar
from litestar.config.cors import CORSConfig
from litestar.middleware import DefineMiddleware
from litestar.openapi import OpenAPIConfig
from litestar.openapi.spec import Components, SecurityScheme, Tag

from api.auth import PUBLIC_PATHS, AuthMiddleware
from api.console import console_handlers
from api.conversations import conversation_handlers  # also registers the conversation MCP tools
from api.enrichment import enrichment_handlers
from api.docs import docs_handlers, render_plugins
from api.errors import exception_handlers
from api.history import history_handlers  # also registers the history MCP tools
from api.knowledge import knowledge_handlers
from api.knowledge_public import knowledge_public_handlers
from api import knowledge_tools  # noqa: F401  (registers the knowledge MCP tools on the organization's MCP URL)
from api.webhooks import webhook_handlers
from api.mcp import mcp_handlers
from api.org_lifecycle import org_lifecycle_handlers
from api.routes import route_handlers
from api.usage import usage_handlers
from api.limits import MAX_BODY_BYTES, guard
from api.request_log import logging_config, request_log
from api.schema_fixes import constrain_optional_parameters, drop_head_operations
from api.strict import strict_body
from api.settings import Settings
from api.wiring import Memex

__all__ = ["create_app", "openapi_config", "API_VERSION"]

API_VERSION = "1.0.0"
log = logging.getLogger("memex")


def openapi_config() -> OpenAPIConfig:
    return OpenAPIConfig(
        title="Memex API",
        version=API_VERSION,
        description=(
            "Multi-tenant memory for AI agents. Authenticate with `Authorization: Bearer <api key>` (from sign-up or "
            "POST /v1/keys) or, behind Cloudflare Access, the `Cf-Access-Jwt-Assertion` header. Every error is "
            '`{"error": {"code", "message", "details", "request_id"}}`; every response carries `X-Request-Id` (the '
            "client's own when it sends a sane one: 1-128 characters of `A-Za-z0-9._:-`). Agents connect over MCP at "
            "`/orgs/{slug}/mcp`."
        ),
        path="/schema",
        render_plugins=render_plugins(),
        components=Components(
            security_schemes={
                "apiKey": SecurityScheme(type="http", scheme="bearer", bearer_format="mx_<id>_<secret>",
                                         description="An organization API key"),
                "accessJwt": SecurityScheme(type="apiKey", name="Cf-Access-Jwt-Assertion", security_scheme_in="header",
                                            description="A Cloudflare Access application token"),
            }
        ),
        security=[{"apiKey": []}, {"accessJwt": []}],
        tags=[
            Tag(name="organizations", description="Sign-up and the caller's organization"),
            Tag(name="keys", description="API keys (admin scope)"),
            Tag(name="access", description="Cloudflare Access members and service tokens (admin scope)"),
            Tag(name="thoughts", description="Captured notes"),
            Tag(name="search", description="Hybrid search"),
            Tag(name="conversations", description="Verbatim multi-turn conversations"),
            Tag(name="knowledge", description="Knowledge bases: git-synced markdown vaults (admin scope to change)"),
            Tag(name="knowledge (public)", description="A knowledge base's published read-only API, by access tier"),
            Tag(name="usage", description="What the organization stores and spends, and the limits that apply"),
            Tag(name="admin", description="Organization maintenance (admin scope)"),
            Tag(name="second-brain compatibility", description="The seed's original routes"),
            Tag(name="operations", description="Health"),
        ],
        use_handler_docstrings=False,
    )


def create_app(settings: Settings | None = None, *, memex: Memex | None = None, start_worker: bool | None = None) -> Litestar:
    settings = settings or (memex.settings if memex else Settings.from_env())
    holder: dict[str, Memex] = {}

    @asynccontextmanager
    async def lifespan(app: Litestar):
        m = memex or Memex(settings)
        holder["m"] = m
        app.state.memex = m
        applied = await m.start(worker=start_worker)
        if applied:
            log.info("applied migrations: %s", ", ".join(applied))
        try:
            yield
        finally:
            await m.stop()

    app = Litestar(
        route_handlers=[*route_handlers, *history_handlers, *conversation_handlers, *enrichment_handlers, *org_lifecycle_handlers,
                       *knowledge_handlers, *knowledge_public_handlers, *webhook_handlers, *mcp_handlers, *docs_handlers(),
                       *usage_handlers, *console_handlers()],
        lifespan=[lifespan],
        middleware=[DefineMiddleware(AuthMiddleware, exclude=PUBLIC_PATHS)],
        exception_handlers=exception_handlers,
        before_request=strict_body,
        openapi_config=openapi_config(),
        cors_config=CORSConfig(
            allow_origins=["*"],
            allow_headers=["authorization", "content-type", "accept", "mcp-protocol-version", "mcp-session-id",
                           "cf-access-jwt-assertion", "memex-organization", "idempotency-key", "if-none-match",
                           "x-request-id"],
            expose_headers=["Mcp-Session-Id", "ETag", "Retry-After", "RateLimit-Limit", "RateLimit-Remaining", "RateLimit-Reset",
                            "RateLimit-Policy", "X-Request-Id"],
        ),
        request_max_body_size=MAX_BODY_BYTES,
        logging_config=logging_config(settings.log_format),
        debug=False,
    )
    _close_request_objects(app)
    constrain_optional_parameters(app)
    drop_head_operations(app)
    _guard_limits(app)
    app.asgi_handler = request_log(app.asgi_handler)  # outermost: what the guard refuses is logged, with an id
    return app


def _guard_limits(app: Litestar) -> None:
    """api.limits runs before routing: URL, header and body limits, and OPTIONS' Allow per route (a CORS preflight
    is answered before routing, so its route is found from the path)."""
    methods: dict[str, set[str]] = {}
    for route in app.routes:
        template = re.sub(r"\{(\w+):[^}]*\}", r"{\1}", route.path)  # as scope["path_template"] names it
        methods.setdefault(template, set()).update(getattr(route, "methods", ()))
    patterns = [(re.compile("^" + re.sub(r"\\\{\w+\\\}", "[^/]+", re.escape(t)) + "$"), t) for t in methods
                if "{" in t]

    def route_methods(scope) -> set[str] | None:
        template = scope.get("path_template")
        if template is None:
            path = scope.get("path", "")
            template = path if path in methods else next((t for p, t in patterns if p.match(path)), None)
        return methods.get(template) if template else None

    app.asgi_handler = guard(app.asgi_handler, route_methods)


def _all_structs(base: type) -> list[type]:
    out = []
    for sub in base.__subclasses__():
        out.append(sub)
        out.extend(_all_structs(sub))
    return out


_JSON_TO_SPEC = {"minimum": "minimum", "maximum": "maximum", "pattern": "pattern", "maxLength": "max_length",
                 "minLength": "min_length", "description": "description"}


def _primitive_schema(d: dict):
    from litestar.openapi.spec import Schema
    from litestar.openapi.spec.enums import OpenAPIType

    return Schema(type=OpenAPIType(d["type"]), **{_JSON_TO_SPEC[k]: v for k, v in d.items() if k in _JSON_TO_SPEC})


def _close_request_objects(app: Litestar) -> None:
    """Request Structs declared with forbid_unknown_fields reject unknown fields: say so in the schema
    (additionalProperties: false), which Litestar's generator leaves out. Litestar also drops the constraints
    of a union's members (``int >= x | str matching p``): those properties take msgspec's own schema, which
    is exactly what msgspec validates."""
    import msgspec

    closed = {cls.__name__: cls for cls in _all_structs(msgspec.Struct) if cls.__struct_config__.forbid_unknown_fields}
    components = app.openapi_schema.components.schemas or {}
    for name, schema in components.items():
        if name not in closed:
            continue
        schema.additional_properties = False
        exact = msgspec.json.schema(closed[name])
        props = exact.get("$defs", {}).get(name, exact).get("properties", {})
        for field, spec in (schema.properties or {}).items():
            members = props.get(field, {}).get("anyOf")
            if not members or any("type" not in m or set(m) - set(_JSON_TO_SPEC) - {"type"} for m in members):
                continue
            if not any(set(m) & {"minimum", "maximum", "pattern", "maxLength", "minLength"} for m in members):
                continue
            spec.one_of = [_primitive_schema(m) for m in members]
