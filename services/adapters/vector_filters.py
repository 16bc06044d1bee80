"""Vectorize's metadata filters, compiled to predicates over a metadata mapping (``compile_filter``), with
Vectorize's limits (filter JSON under ``MAX_FILTER_BYTES``; keys without ``$`` or ``"``, at most
``MAX_FILTER_KEY_CHARS``) and operators (``$eq $ne $in $nin $lt $lte $gt $gte``), so a filter that works on the
embedded index works on Vectorize. The embedded vector index (``services.adapters.local_vectors``) runs them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from typing import Any

from services.errors import InvalidInput

__all__ = ["compile_filter", "MAX_FILTER_BYTES", "MAX_FILTER_KEY_CHARS"]

MAX_FILTER_BYTES = 2048
MAX_FILTER_KEY_CHARS = 512

_OPS = frozenset({"$eq", "$ne", "$in", "$nin", "$lt", "$lte", "$gt", "$gte"})
_MISSING = object()


def _tag(v: Any) -> tuple[str, Any] | None:
    """A hashable, type-strict key for equality: bools are not numbers, 1 == 1.0, None only equals None."""
    if v is None:
        return ("z", None)
    if isinstance(v, bool):
        return ("b", v)
    if isinstance(v, (int, float)):
        return ("n", v)
    if isinstance(v, str):
        return ("s", v)
    return None  # objects and lists never equal a scalar operand


def _check_scalar(op: str, key: str, operand: Any) -> None:
    if _tag(operand) is None or (isinstance(operand, float) and not math.isfinite(operand)):
        raise InvalidInput(f"filter {key!r}: {op} takes a string, number, boolean or null", details={"key": key})


def _lookup(meta: Mapping[str, Any], key: str) -> Any:
    if key in meta:
        return meta[key]
    if "." in key:  # Vectorize: '.' addresses nested properties
        cur: Any = meta
        for part in key.split("."):
            if not isinstance(cur, Mapping) or part not in cur:
                return _MISSING
            cur = cur[part]
        return cur
    return _MISSING


def _any(value: Any, pred: Callable[[Any], bool]) -> bool:
    if isinstance(value, list):
        return any(pred(e) for e in value)
    return pred(value)


def _range_pred(op: str, key: str, operand: Any) -> Callable[[Any], bool]:
    if isinstance(operand, bool) or not isinstance(operand, (int, float, str)):
        raise InvalidInput(f"filter {key!r}: {op} takes a number or a string", details={"key": key})
    if isinstance(operand, float) and not math.isfinite(operand):
        raise InvalidInput(f"filter {key!r}: {op} takes a finite number", details={"key": key})
    if isinstance(operand, str):

        def same_type(x: Any) -> bool:
            return isinstance(x, str)

    else:

        def same_type(x: Any) -> bool:
            return isinstance(x, (int, float)) and not isinstance(x, bool)

    if op == "$lt":
        return lambda x: same_type(x) and x < operand
    if op == "$lte":
        return lambda x: same_type(x) and x <= operand
    if op == "$gt":
        return lambda x: same_type(x) and x > operand
    return lambda x: same_type(x) and x >= operand


def _op_check(key: str, op: str, operand: Any) -> Callable[[Any], bool]:
    """A check of one operator against a looked-up value (``_MISSING`` when the key is absent)."""
    if op in ("$eq", "$ne"):
        _check_scalar(op, key, operand)
        if isinstance(operand, str):  # a str only ever equals a str

            def eq(v: Any) -> bool:
                return v == operand or (type(v) is list and operand in v)

        elif isinstance(operand, bool) or operand is None:  # singletons: identity is equality

            def eq(v: Any) -> bool:
                return v is operand or (type(v) is list and any(x is operand for x in v))

        else:  # a number: equal numbers, never booleans (True == 1 in Python, not in JSON)

            def eq(v: Any) -> bool:
                t = type(v)
                if t is int or t is float:
                    return v == operand
                if t is list:
                    return any((type(x) is int or type(x) is float) and x == operand for x in v)
                return False

        if op == "$eq":
            return eq
        return lambda v: not eq(v)  # a missing key is "not equal"
    if op in ("$in", "$nin"):
        if not isinstance(operand, (list, tuple)):
            raise InvalidInput(f"filter {key!r}: {op} takes an array", details={"key": key})
        for item in operand:
            _check_scalar(op, key, item)
        if all(isinstance(item, str) for item in operand):
            strs = frozenset(operand)

            def isin(v: Any) -> bool:
                if type(v) is str:
                    return v in strs
                if type(v) is list:
                    return any(type(x) is str and x in strs for x in v)
                return False

        else:
            wanted = frozenset(_tag(item) for item in operand)

            def isin(v: Any) -> bool:
                return v is not _MISSING and _any(v, lambda x: _tag(x) in wanted)

        if op == "$in":
            return isin
        return lambda v: not isin(v)  # a missing key is "not in"
    pred = _range_pred(op, key, operand)
    return lambda v: v is not _MISSING and _any(v, pred)


def compile_filter(flt: Mapping[str, Any] | None) -> Callable[[Mapping[str, Any]], bool] | None:
    """Validate a Vectorize metadata filter and turn it into a predicate over a metadata mapping.

    ``{"kind": "note", "tags": {"$in": ["a", "b"]}, "created": {"$gte": 10, "$lt": 20}}``: keys are ANDed, a bare
    value means ``$eq``. A list-valued property matches ``$eq``/``$in`` (and ranges) when any element does, and
    ``$ne``/``$nin`` when no element does. A missing property matches only ``$ne``/``$nin``.
    """
    if not flt:
        return None
    if not isinstance(flt, Mapping):
        raise InvalidInput("filter must be an object")
    try:
        size = len(json.dumps(flt, separators=(",", ":"), allow_nan=False).encode())
    except (TypeError, ValueError) as exc:
        raise InvalidInput(f"filter is not valid JSON: {exc}") from exc
    if size >= MAX_FILTER_BYTES:
        raise InvalidInput(f"filter JSON must be under {MAX_FILTER_BYTES} bytes", details={"bytes": size})
    clauses: list[tuple[str, Callable[[Any], bool]]] = []
    for key, cond in flt.items():
        if not isinstance(key, str) or not key or key.startswith("$") or '"' in key or len(key) > MAX_FILTER_KEY_CHARS:
            raise InvalidInput(f"invalid filter key {key!r}", details={"key": str(key)})
        if isinstance(cond, Mapping):
            if not cond:
                raise InvalidInput(f"filter {key!r}: empty condition", details={"key": key})
            for op, operand in cond.items():
                if op not in _OPS:
                    raise InvalidInput(f"filter {key!r}: unknown operator {op!r}", details={"key": key})
                clauses.append((key, _op_check(key, op, operand)))
        else:
            clauses.append((key, _op_check(key, "$eq", cond)))
    if any("." in key for key, _ in clauses):

        def predicate(meta: Mapping[str, Any]) -> bool:
            return all(check(_lookup(meta, key)) for key, check in clauses)

        return predicate

    def predicate(meta: Mapping[str, Any]) -> bool:
        get = meta.get
        for key, check in clauses:
            if not check(get(key, _MISSING)):
                return False
        return True

    return predicate
