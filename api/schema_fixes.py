"""Corrections to Litestar's generated OpenAPI that make it say exactly what the app validates."""

from __future__ import annotations

from litestar import Litestar
from litestar.openapi.spec import Schema

__all__ = ["constrain_optional_parameters", "drop_head_operations"]

_BOUNDS = {"ge": "minimum", "le": "maximum", "gt": "exclusive_minimum", "lt": "exclusive_maximum",
           "min_length": "min_length", "max_length": "max_length", "pattern": "pattern"}


def constrain_optional_parameters(app: Litestar) -> None:
    """An optional parameter (``int | None`` with ``Parameter(ge=..., le=...)``) is documented as
    ``oneOf: [integer, null]`` without its bounds, though they are validated: copy them onto the member, so a
    schema-valid value (schemathesis' positive data) is never refused and every integer is bounded on paper."""
    kwargs = {}
    for route in app.routes:
        for handler in getattr(route, "route_handlers", ()):
            if handler.operation_id is None:
                continue
            for name, param in handler.parsed_fn_signature.parameters.items():
                kd = param.kwarg_definition
                if kd is not None and hasattr(kd, "ge"):
                    alias = getattr(kd, "query", None) or getattr(kd, "header", None) or name
                    kwargs[(handler.operation_id, alias)] = kd
    for path_item in (app.openapi_schema.paths or {}).values():
        for op in (path_item.get, path_item.post, path_item.put, path_item.patch, path_item.delete):
            for p in (op.parameters or []) if op else ():
                kd = kwargs.get((op.operation_id, p.name))
                schema = p.schema
                if kd is None or not isinstance(schema, Schema) or not schema.one_of:
                    continue
                for member in schema.one_of:
                    if isinstance(member, Schema) and member.type is not None and str(member.type.value) != "null":
                        for src, dst in _BOUNDS.items():
                            value = getattr(kd, src, None)
                            if value is not None and getattr(member, dst, None) is None:
                                setattr(member, dst, value)


def drop_head_operations(app: Litestar) -> None:
    """HEAD answers as GET without a body (HTTP's rule, RFC 9110 §9.3.2): the document describes GET alone, so each
    operation appears once and a client generator makes one method of it."""
    for path_item in (app.openapi_schema.paths or {}).values():
        if path_item.get is not None:
            path_item.head = None
