"""Strict request bodies. Litestar converts bodies leniently (0 -> false, "10" -> 10); a documented API
should accept exactly what its schema says, so each JSON body is also decoded strictly against its Struct."""

from __future__ import annotations

import msgspec
from litestar import Request
from litestar.exceptions import HTTPException, ValidationException

__all__ = ["strict_body"]


async def strict_body(request: Request) -> None:
    param = request.route_handler.parsed_fn_signature.parameters.get("data")
    if param is None:
        return None
    tp = param.annotation
    if not (isinstance(tp, type) and issubclass(tp, msgspec.Struct)):
        return None
    media = request.headers.get("content-type", "application/json").split(";")[0].strip().lower()
    if media != "application/json" and not media.endswith("+json"):
        raise HTTPException(
            status_code=415, detail="send the body as application/json", extra={"content_type": media}
        )
    body = await request.body()
    try:
        # JSON Schema's integer admits 3.0; msgspec's strict int does not: normalise whole floats first.
        msgspec.convert(_whole_floats_to_int(msgspec.json.decode(body)), tp, strict=True)
    except msgspec.ValidationError as exc:
        message, _, path = str(exc).partition(" - at `$")
        key = path.rstrip("`").lstrip(".") or "data"
        raise ValidationException(
            f"Validation failed for {request.method} {request.url.path}",
            extra=[{"message": message, "key": key, "source": "body"}],
        ) from None
    except UnicodeDecodeError:
        raise ValidationException("the body is not valid UTF-8") from None
    except msgspec.DecodeError as exc:
        raise ValidationException(str(exc) if "malformed" in str(exc) else f"JSON is malformed: {exc}") from None
    return None


def _whole_floats_to_int(value):
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return int(value)
    if isinstance(value, list):
        return [_whole_floats_to_int(v) for v in value]
    if isinstance(value, dict):
        return {k: _whole_floats_to_int(v) for k, v in value.items()}
    return value
