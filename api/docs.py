"""The API docs UI, served offline: Swagger UI's assets come from the swagger-ui-py package, not a CDN."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from litestar.static_files import create_static_files_router

__all__ = ["swagger_assets", "docs_handlers", "ASSETS_PATH"]

ASSETS_PATH = "/schema/assets"


def _static_dir() -> Path | None:
    spec = importlib.util.find_spec("swagger_ui")
    if spec is None or not spec.submodule_search_locations:
        return None
    d = Path(list(spec.submodule_search_locations)[0]) / "static"
    return d if (d / "swagger-ui-bundle.js").exists() else None


def swagger_assets() -> tuple[str | None, str | None]:
    if _static_dir() is None:
        return None, None
    return f"{ASSETS_PATH}/swagger-ui-bundle.js", f"{ASSETS_PATH}/swagger-ui.css"


def docs_handlers() -> list:
    d = _static_dir()
    if d is None:
        return []
    return [create_static_files_router(path=ASSETS_PATH, directories=[d], opt={"exclude_from_auth": True},
                                       include_in_schema=False, name="swagger-assets")]
