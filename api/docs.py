"""The API docs UI, served offline: Swagger UI 5 (its script, stylesheet and favicon come from the
openapi-ui-bundles package, not a CDN: 3.5 MB installed, where swagger-ui-py's 25 MB also carried Swagger Editor) at
``/schema/swagger`` (and ``/schema``); ``/docs`` redirects there. Litestar's other render plugins (Scalar, ReDoc,
RapiDoc, Stoplight) load their code and fonts from CDNs, so none is offered."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from litestar import get
from litestar.openapi.plugins import OpenAPIRenderPlugin, SwaggerRenderPlugin
from litestar.response import Redirect
from litestar.static_files import create_static_files_router

__all__ = ["swagger_assets", "docs_handlers", "render_plugins", "ASSETS_PATH", "DOCS_UI_PATH"]

ASSETS_PATH = "/schema/assets"
#: Where ``/docs`` sends a browser.
DOCS_UI_PATH = "/schema/swagger"


def _static_dir() -> Path:
    spec = importlib.util.find_spec("openapi_ui_bundles")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the openapi-ui-bundles package (a dependency of memex) is not installed")
    d = Path(list(spec.submodule_search_locations)[0]) / "swagger_ui" / "vendor"
    if not (d / "swagger-ui-bundle.js").exists():
        raise RuntimeError(f"openapi-ui-bundles' Swagger UI assets are missing from {d}")
    return d


def swagger_assets() -> tuple[str, str]:
    _static_dir()
    return f"{ASSETS_PATH}/swagger-ui-bundle.js", f"{ASSETS_PATH}/swagger-ui.css"


def render_plugins() -> list[OpenAPIRenderPlugin]:
    js_url, css_url = swagger_assets()
    return [SwaggerRenderPlugin(
        js_url=js_url, css_url=css_url,
        standalone_preset_js_url=f"{ASSETS_PATH}/swagger-ui-standalone-preset.js",
        favicon=f"<link rel='icon' type='image/png' href='{ASSETS_PATH}/favicon-32x32.png'>",
    )]


@get("/docs", include_in_schema=False, exclude_from_auth=True, status_code=302, name="docs-redirect")
async def docs_redirect() -> Redirect:
    return Redirect(DOCS_UI_PATH, status_code=302)


def docs_handlers() -> list:
    return [create_static_files_router(path=ASSETS_PATH, directories=[_static_dir()], opt={"exclude_from_auth": True},
                                       include_in_schema=False, name="swagger-assets"),
            docs_redirect]
