"""Identifiers and clocks shared by tenancy and services."""

from __future__ import annotations

import secrets
import time
import uuid

__all__ = ["now_ms", "new_org_id", "new_id"]


def now_ms() -> int:
    return int(time.time() * 1000)


def new_org_id() -> str:
    return "org_" + secrets.token_hex(8)


def new_id() -> str:
    return uuid.uuid4().hex
