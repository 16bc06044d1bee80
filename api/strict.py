"""Strict request bodies. Litestar converts bodies leniently (0 -> false, "10" -> 10); a documented API
should accept exactly what its schema says, so each JSON body is also decoded strictly against its Struct.

Bounded before decoding: the body's size (api.limits, 413) and its nesting depth (``MAX_JSON_DEPTH``, found
by a scan of the body's brackets outside strings: no recursion over untyped JSON anywhere). msgspec then
decodes straight into the typed Struct, whose fields carry their own bounds (lengths, item counts, integer
ranges), so the 400 comes from validation and never from what a value would do further in."""

from __future__ import annotations

import re
import types
import typing

import msgspec
import numpy as np
from litestar import Request
from litestar.exceptions import HTTPException, ValidationException

from api.limits import MAX_JSON_DEPTH

__all__ = ["strict_body", "json_too_deep"]

_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_SIGNS = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")


def json_too_deep(body: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether arrays and objects in ``body`` nest deeper than ``limit`` (linear, C speed)."""
    if body.count(b"[") + body.count(b"{") <= limit:
        return False
    brackets = _STRING.sub(b"", body).translate(None, _NOT_BRACKETS).translate(_SIGNS)
    return bool(brackets) and int(np.cumsum(np.frombuffer(brackets, dtype=np.int8), dtype=np.int64).max()) > limit


def _invalid(request: Request, message: str, key: str = "data") -> ValidationException:
    return ValidationException(
        f"Validation failed for {request.method} {request.url.path[:200]}",
        extra=[{"message": message, "key": key, "source": "body"}],
    )


async def strict_body(request: Request) -> None:
    param = request.route_handler.parsed_fn_signature.parameters.get("data")
    if param is None:
        return None
    tp, optional = _struct_of(param.annotation)
    if tp is None:
        return None
    media = request.headers.get("content-type", "application/json").split(";")[0].strip().lower()
    if media != "application/json" and not media.endswith("+json"):
        raise HTTPException(
            status_code=415, detail="send the body as application/json", extra={"content_type": media[:100]}
        )
    body = await request.body()
    if optional and not body.strip():
        return None  # an optional body left out
    if optional:
        tp = tp | None  # JSON null is the schema's other member
    if json_too_deep(body):
        raise _invalid(request, f"JSON nests deeper than {MAX_JSON_DEPTH} levels")
    try:
        try:
            msgspec.json.decode(body, type=tp, strict=True)
        except msgspec.ValidationError as exc:
            if "got `float`" not in str(exc):
                raise
            # JSON Schema's integer admits 3.0; msgspec's strict int does not: whole floats of the Struct's own
            # fields (and of its nested Structs) become ints, then the value is checked again.
            msgspec.convert(_whole_floats_to_int(msgspec.json.decode(body), 4), tp, strict=True)
    except msgspec.ValidationError as exc:
        message, _, path = str(exc).partition(" - at `$")
        raise _invalid(request, message[:500], path.rstrip("`").lstrip(".")[:200] or "data") from None
    except UnicodeDecodeError:
        raise ValidationException("the body is not valid UTF-8") from None
    except msgspec.DecodeError as exc:
        text = str(exc)[:300]
        raise ValidationException(text if "malformed" in text else f"JSON is malformed: {text}") from None
    return None


def _struct_of(annotation) -> tuple[type | None, bool]:
    """The Struct a ``data`` parameter takes and whether it may be left out (``SomeIn | None``); (None, _) when the
    parameter is not a Struct."""
    optional = False
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        members = [a for a in typing.get_args(annotation) if a is not type(None)]
        optional = len(members) < len(typing.get_args(annotation))
        annotation = members[0] if len(members) == 1 else None
    if isinstance(annotation, type) and issubclass(annotation, msgspec.Struct):
        return annotation, optional
    return None, False


def _whole_floats_to_int(value, depth: int):
    """Whole floats below 2**53 become ints, down to ``depth`` levels (the body's depth is bounded already)."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return int(value)
    if depth <= 0:
        return value
    if isinstance(value, list):
        return [_whole_floats_to_int(v, depth - 1) for v in value]
    if isinstance(value, dict):
        return {k: _whole_floats_to_int(v, depth - 1) for k, v in value.items()}
    return value
