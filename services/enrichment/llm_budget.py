"""The per-organization daily budget for language-model calls, so ingestion can never run away with a bill.

``BudgetedLLM`` wraps the process's ``LLM`` for one organization. Before each call it reserves the call and
an estimate of the prompt's tokens with one statement (``INSERT ... ON CONFLICT DO UPDATE ... WHERE`` under
both limits ``RETURNING``: atomic on SQLite and D1, so concurrent workers and instances can never overspend
together); no row back means the organization is over budget and the call is refused with
``BudgetExceeded`` before anything is sent. After the call the reservation is settled to the tokens the
model reported (prompt + completion). A failed call keeps its count and its prompt estimate.

Day = the UTC calendar day. Limits <= 0 mean "no calls at all"; a refusal is counted in ``llm_usage.refused``.

Use from services (the decisions and enrichment code)::

    if org.llm is not None:                        # None: no model configured
        try:
            result = await org.llm.complete_json(messages, schema=schema, max_tokens=200)
        except BudgetExceeded:                      # over budget: skip, record, never block the write
            ...
        except BackendError:                        # the model failed or answered no JSON
            ...

or ``await org.llm.try_complete_json(...)``, which returns None instead of raising ``BudgetExceeded``.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from services.errors import RateLimited
from services.ports import LLM, ChatMessage, LLMResult
from services.storage.scoped import OrgSql

__all__ = ["LLMBudget", "BudgetExceeded", "BudgetedLLM", "estimate_tokens", "utc_day"]

_WORDS = re.compile(r"\w+|[^\w\s]", re.UNICODE)


def estimate_tokens(text: str) -> int:
    """A tokenizer-free upper-ish estimate: ``max(ceil(1.3 x words-and-marks), ceil(chars / 4))``."""
    if not text:
        return 0
    return max(math.ceil(len(_WORDS.findall(text)) * 1.3), math.ceil(len(text) / 4))


def utc_day(ts: float) -> str:
    return datetime.fromtimestamp(ts, tz=timezone.utc).strftime("%Y-%m-%d")


def _seconds_to_midnight(ts: float) -> int:
    return max(1, 86400 - int(ts) % 86400)


@dataclass(frozen=True, slots=True)
class LLMBudget:
    calls_per_day: int = 500
    tokens_per_day: int = 200_000


class BudgetExceeded(RateLimited):
    """The organization's LLM budget for today is spent (or this prompt alone would exceed it)."""

    code = "llm_budget_exceeded"

    def __init__(self, message: str, *, retry_after: int, details: dict[str, Any] | None = None) -> None:
        super().__init__(message, retry_after=retry_after, details=details)


_RESERVE = (
    "INSERT INTO llm_usage (organization_id, day, calls, tokens) "
    "SELECT ?1, ?2, 1, ?3 WHERE 1 <= ?4 AND ?3 <= ?5 "
    "ON CONFLICT(organization_id, day) DO UPDATE SET calls = calls + 1, tokens = tokens + excluded.tokens "
    "WHERE llm_usage.calls + 1 <= ?4 AND llm_usage.tokens + excluded.tokens <= ?5 "
    "RETURNING calls, tokens"
)
_REFUSED = (
    "INSERT INTO llm_usage (organization_id, day, refused) VALUES (?1, ?2, 1) "
    "ON CONFLICT(organization_id, day) DO UPDATE SET refused = refused + 1"
)
_SETTLE = "UPDATE llm_usage SET tokens = MAX(0, tokens + ?3) WHERE organization_id = ?1 AND day = ?2"


class BudgetedLLM:
    """An ``LLM`` bound to one organization and its daily budget (implements the ``LLM`` port)."""

    def __init__(self, llm: LLM, sql: OrgSql, budget: LLMBudget, *, clock: Callable[[], float] = time.time) -> None:
        self.llm = llm
        self.model_id = llm.model_id
        self.sql = sql
        self.budget = budget
        self.clock = clock

    @staticmethod
    def prompt_tokens(messages: Sequence[ChatMessage]) -> int:
        return sum(estimate_tokens(m.content) + 4 for m in messages)

    async def reserve(self, prompt_tokens: int) -> tuple[str, int]:
        """Count one call and ``prompt_tokens`` against today's budget, or raise ``BudgetExceeded``."""
        now = self.clock()
        day = utc_day(now)
        b = self.budget
        row = await self.sql.one(_RESERVE, [day, prompt_tokens, b.calls_per_day, b.tokens_per_day])
        if row is None:
            await self.sql.execute(_REFUSED, [day])
            raise BudgetExceeded(
                "the organization's daily LLM budget is spent",
                retry_after=_seconds_to_midnight(now),
                details={"day": day, "calls_per_day": b.calls_per_day, "tokens_per_day": b.tokens_per_day},
            )
        return day, prompt_tokens

    async def complete_json(
        self, messages: Sequence[ChatMessage], *, schema: Mapping[str, Any], max_tokens: int = 512,
        temperature: float = 0.2,
    ) -> LLMResult:
        """The model's answer; raises ``BudgetExceeded`` (nothing sent) or ``BackendError`` (model failed)."""
        day, reserved = await self.reserve(self.prompt_tokens(messages))
        # A failure propagates: the call still counts, with its prompt estimate.
        result = await self.llm.complete_json(messages, schema=schema, max_tokens=max_tokens, temperature=temperature)
        used = (result.prompt_tokens or reserved) + (result.completion_tokens or 0)
        if used != reserved:
            await self.sql.execute(_SETTLE, [day, used - reserved])
        return result

    async def try_complete_json(
        self, messages: Sequence[ChatMessage], *, schema: Mapping[str, Any], max_tokens: int = 512,
        temperature: float = 0.2,
    ) -> LLMResult | None:
        """Like ``complete_json`` but None when over budget (model failures still raise ``BackendError``)."""
        try:
            return await self.complete_json(messages, schema=schema, max_tokens=max_tokens, temperature=temperature)
        except BudgetExceeded:
            return None

    async def usage(self) -> dict[str, Any]:
        """Today's counters and limits."""
        day = utc_day(self.clock())
        row = await self.sql.one(
            "SELECT calls, tokens, refused FROM llm_usage WHERE organization_id = ?1 AND day = ?2", [day]
        ) or {"calls": 0, "tokens": 0, "refused": 0}
        return {"day": day, **row, "calls_per_day": self.budget.calls_per_day,
                "tokens_per_day": self.budget.tokens_per_day}

    async def aclose(self) -> None:
        """Nothing to release: the wrapped model belongs to the backend, which closes it."""
