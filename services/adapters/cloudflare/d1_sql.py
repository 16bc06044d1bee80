"""What the D1 adapter sends, checked before it is sent: scripts split into statements (``split_statements``),
which statements may be retried after they may have run (``is_idempotent``), and D1's limits on a statement and
its parameters (``check_statement``, ``bind_params``: at most ``MAX_PARAMS`` bound parameters, ``MAX_STATEMENT_BYTES``
of SQL, no transaction statements, parameters as JSON values). The rules are in ``services.adapters.cloudflare.d1``.
"""

from __future__ import annotations

import math
import re
import sqlite3
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from services.errors import InvalidInput, PayloadTooLarge
from services.ports import SqlValue

__all__ = ["split_statements", "is_idempotent", "check_statement", "bind_params", "MAX_PARAMS", "MAX_STATEMENT_BYTES",
           "MAX_VALUE_BYTES", "JS_SAFE_INT"]

MAX_PARAMS = 100
MAX_STATEMENT_BYTES = 100_000
MAX_VALUE_BYTES = 2_000_000
JS_SAFE_INT = 2**53


def _code_only(sql: str) -> str:
    """``sql`` with string literals, quoted identifiers and comments blanked out (same length)."""
    out = list(sql)
    i, n = 0, len(sql)
    while i < n:
        c = sql[i]
        if c in "'\"`":
            j = i + 1
            while j < n:
                if sql[j] == c:
                    if j + 1 < n and sql[j + 1] == c:
                        j += 2
                        continue
                    break
                j += 1
            for k in range(i, min(j + 1, n)):
                out[k] = " "
            i = j + 1
        elif c == "[":
            j = sql.find("]", i + 1)
            j = n - 1 if j < 0 else j
            for k in range(i, j + 1):
                out[k] = " "
            i = j + 1
        elif sql.startswith("--", i):
            j = sql.find("\n", i)
            j = n if j < 0 else j
            for k in range(i, j):
                out[k] = " "
            i = j
        elif sql.startswith("/*", i):
            j = sql.find("*/", i + 2)
            j = n if j < 0 else j + 2
            for k in range(i, j):
                out[k] = " "
            i = j
        else:
            i += 1
    return "".join(out)


def split_statements(sql: str) -> list[str]:
    """Complete statements of a script (trigger bodies with inner ``;`` stay whole), comments kept."""
    code = _code_only(sql)
    out: list[str] = []
    start = 0
    for i, ch in enumerate(code):
        if ch == ";" and sqlite3.complete_statement(sql[start : i + 1]):
            out.append(sql[start : i + 1])
            start = i + 1
    out.append(sql[start:])
    return [s.strip() for s in out if _code_only(s).strip().strip(";").strip()]


_WORD = re.compile(r"[A-Za-z_]+")
_TXN = {"BEGIN", "COMMIT", "END", "ROLLBACK", "SAVEPOINT", "RELEASE"}
_WRITES = {"INSERT", "UPDATE", "DELETE", "REPLACE"}
_READS = ("SELECT", "WITH", "VALUES", "PRAGMA", "EXPLAIN")
_NUMBERED = re.compile(r"\?(\d+)")


def _words(code: str) -> list[str]:
    return [w.upper() for w in _WORD.findall(code)]


def is_idempotent(sql: str) -> bool:
    """True when running ``sql`` twice leaves the same state and returns what the caller relies on."""
    for stmt in split_statements(sql) or [sql]:
        words = _words(_code_only(stmt))
        if not words:
            continue
        first, ws = words[0], set(words)
        if "RETURNING" in ws and first != "SELECT":
            return False
        if first in ("SELECT", "WITH", "VALUES", "EXPLAIN"):
            if ws & _WRITES:
                return False
        elif first == "PRAGMA":
            pass
        elif first == "CREATE":
            if not ("IF" in ws and "NOT" in ws and "EXISTS" in ws):
                return False
        elif first == "DROP":
            if not ("IF" in ws and "EXISTS" in ws):
                return False
        elif first == "DELETE" or first == "REPLACE":
            pass
        elif first == "INSERT":
            text = " ".join(words)
            if not ("INSERT OR IGNORE" in text or "INSERT OR REPLACE" in text or "DO NOTHING" in text):
                return False
        else:
            return False
    return True


@dataclass(frozen=True, slots=True)
class _Shape:
    statements: int
    first_word: str
    size: int
    highest_numbered: int
    idempotent: bool
    read: bool


@lru_cache(maxsize=4096)
def _shape(sql: str) -> _Shape:
    """What the adapter needs to know about a SQL text (cached: services use a few constant texts)."""
    code = _code_only(sql)
    words = _words(code)
    return _Shape(
        statements=len(split_statements(sql)),
        first_word=words[0] if words else "",
        size=len(sql.encode("utf-8")),
        highest_numbered=max((int(m) for m in _NUMBERED.findall(code)), default=0),
        idempotent=is_idempotent(sql),
        read=bool(words) and words[0] in _READS and not (set(words) & _WRITES),
    )


def check_statement(sql: str, params: Sequence[Any], where: str) -> _Shape:
    if not isinstance(sql, str) or not sql.strip():
        raise InvalidInput(f"{where}: empty SQL statement")
    shape = _shape(sql)
    if shape.first_word in _TXN:
        raise InvalidInput(f"{where}: transactions are not allowed on D1 (a request is the transaction): use batch()")
    if shape.size > MAX_STATEMENT_BYTES:
        raise InvalidInput(
            f"{where}: SQL statement is {shape.size} bytes; D1 accepts at most {MAX_STATEMENT_BYTES} "
            "(bind long lists as one JSON array and read them with json_each)",
            details={"bytes": shape.size, "limit": MAX_STATEMENT_BYTES},
        )
    count = max(len(params), shape.highest_numbered)
    if count > MAX_PARAMS:
        raise InvalidInput(
            f"{where}: {count} bound parameters; D1 accepts at most {MAX_PARAMS} per statement "
            "(bind long lists as one JSON array and read them with json_each)",
            details={"params": count, "limit": MAX_PARAMS},
        )
    return shape


def _param(value: SqlValue, where: str) -> Any:
    if value is None or isinstance(value, str):
        if isinstance(value, str) and len(value) * 4 > MAX_VALUE_BYTES and len(value.encode()) > MAX_VALUE_BYTES:
            raise PayloadTooLarge(f"{where}: a bound string is over {MAX_VALUE_BYTES} bytes (D1's value limit)")
        return value
    if isinstance(value, bool):
        return 1 if value else 0
    if isinstance(value, int):
        if not -JS_SAFE_INT <= value <= JS_SAFE_INT:
            raise InvalidInput(
                f"{where}: integer {value} is beyond +-2^53 and would lose precision through D1's JSON API: "
                "store it as TEXT",
            )
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise InvalidInput(f"{where}: NaN and Infinity cannot be bound over D1's JSON API")
        return value
    if isinstance(value, (bytes, bytearray, memoryview)):
        raise InvalidInput(f"{where}: BLOB parameters are not supported over D1's JSON API: bind hex or base64 text")
    raise InvalidInput(f"{where}: unsupported parameter type {type(value).__name__}")


def bind_params(params: Sequence[SqlValue], where: str) -> list[Any]:
    return [_param(p, f"{where}, parameter {i + 1}") for i, p in enumerate(params)]
