"""Message compression at rest, exactly as the Engram seed: gzip, then base64 (a TEXT column holds it).

``content_encoding`` says how a stored message reads back:

* ``None``          legacy row, stored as given (never processed; the backfill compresses these)
* ``"raw"``         checked, under 128 bytes of UTF-8: too small to gain, stored as given
* ``"gzip+base64"`` base64 (standard alphabet, padded) of the gzip of the UTF-8 bytes

Reads return the original string exactly. gzip is written with ``mtime=0`` so equal content compresses to
equal bytes.
"""

from __future__ import annotations

import base64
import binascii
import gzip
import zlib

from services.errors import BackendError

__all__ = ["RAW", "GZIP_BASE64", "RAW_THRESHOLD", "encode_content", "decode_content"]

RAW = "raw"
GZIP_BASE64 = "gzip+base64"
#: Content of fewer UTF-8 bytes than this is stored raw.
RAW_THRESHOLD = 128
_LEVEL = 6


def encode_content(content: str) -> tuple[str, str]:
    """``(stored, content_encoding)`` for a message's content."""
    data = content.encode("utf-8")
    if len(data) < RAW_THRESHOLD:
        return content, RAW
    packed = gzip.compress(data, compresslevel=_LEVEL, mtime=0)
    return base64.b64encode(packed).decode("ascii"), GZIP_BASE64


def decode_content(stored: str, encoding: str | None) -> str:
    """The original content of a stored message (any of the three encodings)."""
    if encoding is None or encoding == RAW:
        return stored
    if encoding == GZIP_BASE64:
        try:
            # zlib reads the single gzip member encode_content writes (gzip.decompress parses headers in Python)
            return zlib.decompress(base64.b64decode(stored, validate=True), wbits=31).decode("utf-8")
        except (binascii.Error, OSError, EOFError, zlib.error, UnicodeDecodeError) as exc:
            raise BackendError("a stored message could not be decompressed", details={"reason": str(exc)}) from exc
    raise BackendError(f"unknown content_encoding {encoding!r}")
