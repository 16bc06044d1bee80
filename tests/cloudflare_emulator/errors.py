"""Error type and envelope helpers shared by every part of the emulator."""

from __future__ import annotations

from typing import Any


class CFError(Exception):
    """An error answered as a Cloudflare envelope: ``success: false`` + ``errors``."""

    def __init__(self, status: int, code: int, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.headers = headers or {}


def envelope(result: Any = None, *, success: bool = True, errors: list[dict] | None = None,
             result_info: dict | None = None) -> dict:
    body: dict[str, Any] = {
        "success": success,
        "errors": errors or [],
        "messages": [],
        "result": result,
    }
    if result_info is not None:
        body["result_info"] = result_info
    return body


def error_envelope(code: int, message: str) -> dict:
    return envelope(None, success=False, errors=[{"code": code, "message": message}])


# Error codes. The ones from the reference docs are marked "doc"; the others are the emulator's own
# choice (the docs only promise `success: false` + an `errors[]` entry, and say not to branch on SQL codes).
AUTH_ERROR = 10000          # doc
D1_NOT_FOUND = 7404         # doc
D1_ACCOUNT_LIMIT = 7406     # doc (HTTP 400; message "System limit reached: databases per account (N)")
D1_DUPLICATE_NAME = 7502    # wrangler's d1/create.ts maps it to "A database with that name already exists"
D1_SQL_ERROR = 7500         # emulator's choice (SQL errors: read errors[].message)
D1_BAD_REQUEST = 7400       # emulator's choice
NO_ROUTE = 7000             # emulator's choice
METHOD_NOT_ALLOWED = 7001   # emulator's choice
MALFORMED_JSON = 6007       # emulator's choice
RATE_LIMITED = 971          # emulator's choice (docs only specify HTTP 429 + headers)
SERVER_ERROR = 10001        # emulator's choice (injected 5xx)
VEC_BAD_REQUEST = 40001     # emulator's choice
VEC_NOT_FOUND = 40004       # emulator's choice
VEC_CONFLICT = 40009        # emulator's choice
AI_NO_SUCH_MODEL = 5007     # doc (HTTP 400)
AI_BAD_INPUT = 3003         # doc (HTTP 400)
AI_TOO_LARGE = 3006         # doc (HTTP 413)
AI_JSON_MODE_FAILED = 3030  # emulator's choice (docs give the message "JSON Mode couldn't be met", no code)
