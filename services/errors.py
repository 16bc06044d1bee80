"""The domain error tree. Each error has a stable ``code``; ``api.errors`` maps them to HTTP in one place.

MemexError                      (500 internal)
├── InvalidInput                (400 invalid_input)
├── Unauthenticated             (401 unauthenticated)
├── Forbidden                   (403 forbidden)
├── NotFound                    (404 not_found)
├── Conflict                    (409 conflict)
├── PayloadTooLarge             (413 payload_too_large)
├── RateLimited                 (429 rate_limited, carries retry_after seconds)
└── BackendError                (503 backend_unavailable: a store or model failed; retry later)
    ├── EmbeddingModelMismatch  (an index holds vectors of another model)
    └── InsufficientStorage     (507 insufficient_storage: the disk (or the database's size limit) is full;
                                 nothing was written; retry once space is freed)
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "MemexError",
    "InvalidInput",
    "Unauthenticated",
    "Forbidden",
    "NotFound",
    "Conflict",
    "PayloadTooLarge",
    "RateLimited",
    "BackendError",
    "EmbeddingModelMismatch",
    "InsufficientStorage",
    "answer_status",
]


class MemexError(Exception):
    code = "internal"
    status = 500

    def __init__(self, message: str, *, details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.details = details or {}


class InvalidInput(MemexError):
    code = "invalid_input"
    status = 400


class Unauthenticated(MemexError):
    code = "unauthenticated"
    status = 401


class Forbidden(MemexError):
    code = "forbidden"
    status = 403


class NotFound(MemexError):
    code = "not_found"
    status = 404


class Conflict(MemexError):
    code = "conflict"
    status = 409


class PayloadTooLarge(MemexError):
    code = "payload_too_large"
    status = 413


class RateLimited(MemexError):
    code = "rate_limited"
    status = 429

    def __init__(self, message: str, *, retry_after: int, details: dict[str, Any] | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message, details={"retry_after": retry_after, **(details or {})})
        self.retry_after = retry_after
        #: Extra response headers (RateLimit-Limit / -Remaining / -Reset / -Policy) beside Retry-After.
        self.headers = dict(headers or {})


class BackendError(MemexError):
    code = "backend_unavailable"
    status = 503


class EmbeddingModelMismatch(BackendError):
    code = "embedding_model_mismatch"


class InsufficientStorage(BackendError):
    code = "insufficient_storage"
    status = 507


def answer_status(exc: MemexError) -> int:
    """The HTTP status an error answers with (api.errors maps them; a batch reports it per item). A backend's failure
    is ours to report (5xx), whatever status the backend itself answered: an adapter error may carry the upstream
    status (a Cloudflare 404 or 401, or none when the connection failed), which must neither reach the client as its
    own 404 nor crash here."""
    status = exc.status if isinstance(exc.status, int) and 400 <= exc.status < 600 else type(exc).status
    if isinstance(exc, BackendError) and status < 500:
        status = BackendError.status
    return status
