"""Language-model and reranker adapters behind the ``LLM`` and ``Reranker`` ports.

LLM (``MEMEX_LLM``):

* ``none`` (the default): no object at all; callers check for None and run their deterministic paths.
* ``workers-ai``: ``@cf/meta/llama-3.1-8b-instruct`` in JSON mode at temperature 0.2, through the shared
  ``WorkersAIChat`` client (one Cloudflare request budget for the whole process). Token usage is the one the
  API reports.
* ``openai``: any OpenAI-compatible ``POST {base}/chat/completions`` (OpenAI, Ollama ``http://host:11434/v1``,
  vLLM, llama.cpp server ...) over httpx with ``response_format`` ``json_schema`` (default) or
  ``json_object``. A server that refuses ``json_schema`` with a 400 is asked again with ``json_object`` and
  remembered. 429 and 5xx are retried (honouring a short Retry-After); the answer's content is parsed as JSON
  after stripping a Markdown code fence, and anything else is a ``BackendError``.

Reranker (``MEMEX_RERANKER``): ``none``; ``workers-ai`` (``@cf/baai/bge-reranker-base``, adapted to the
port's one-score-per-passage-in-order shape); ``local`` (``services/adapters/local_reranker.py`` if it is
installed: a ``LocalReranker`` class or a ``local_reranker(settings)`` factory).

The composition root (``api.composition.backend``) reads those settings and builds these adapters.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import Mapping, Sequence
from typing import Any

import httpx

from services.errors import BackendError, InvalidInput
from services.ports import ChatMessage, LLMResult

__all__ = [
    "WorkersAILLM",
    "OpenAICompatibleLLM",
    "WorkersAIRerankerPort",
    "parse_json_content",
]

log = logging.getLogger("memex.llm")

_FENCE = re.compile(r"^\s*```(?:json|JSON)?\s*\n?(.*?)\n?\s*```\s*$", re.DOTALL)


def parse_json_content(content: Any) -> Any:
    """The JSON value in a model's answer: the text itself, inside a Markdown fence, or the outermost
    ``{...}`` in it. Raises ValueError when there is none."""
    if isinstance(content, (dict, list)):
        return content
    if not isinstance(content, str):
        raise ValueError("no content")
    text = content.strip()
    m = _FENCE.match(text)
    if m:
        text = m.group(1).strip()
    try:
        return json.loads(text)
    except ValueError:
        start, end = text.find("{"), text.rfind("}")
        if 0 <= start < end:
            return json.loads(text[start : end + 1])
        raise


def _int(v: Any) -> int:
    return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else 0


class WorkersAILLM:
    """The ``LLM`` port over Workers AI's llama-3.1-8b-instruct in JSON mode."""

    def __init__(self, chat: Any, *, temperature: float = 0.2) -> None:
        self.chat = chat  # a services.adapters.cloudflare.WorkersAIChat
        self.temperature = temperature
        self.model_id = getattr(chat, "model", "@cf/meta/llama-3.1-8b-instruct")

    async def complete_json(
        self, messages: Sequence[ChatMessage], *, schema: Mapping[str, Any], max_tokens: int = 512,
        temperature: float = 0.2,
    ) -> LLMResult:
        data, usage = await self.chat.complete_json(
            [{"role": m.role, "content": m.content} for m in messages],
            schema, max_tokens=max_tokens, temperature=temperature if temperature is not None else self.temperature,
            with_usage=True,
        )
        return LLMResult(data=data, prompt_tokens=_int(usage.get("prompt_tokens")),
                         completion_tokens=_int(usage.get("completion_tokens")))

    async def aclose(self) -> None:
        """Nothing to release: the Workers AI client shares the backend's HTTP client."""


class OpenAICompatibleLLM:
    """The ``LLM`` port over an OpenAI-compatible chat-completions endpoint."""

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        api_key: str | None = None,
        response_format: str = "json_schema",
        http: httpx.AsyncClient | None = None,
        timeout: float = 60.0,
        retries: int = 2,
        max_retry_after: float = 10.0,
    ) -> None:
        if not base_url:
            raise InvalidInput("MEMEX_LLM_BASE_URL must be set for MEMEX_LLM=openai", details={"missing": ["MEMEX_LLM_BASE_URL"]})
        if not model:
            raise InvalidInput("MEMEX_LLM_MODEL must be set for MEMEX_LLM=openai", details={"missing": ["MEMEX_LLM_MODEL"]})
        if response_format not in ("json_schema", "json_object"):
            raise InvalidInput("MEMEX_LLM_RESPONSE_FORMAT must be json_schema or json_object")
        base = base_url.rstrip("/")
        self.url = base if base.endswith("/chat/completions") else base + "/chat/completions"
        self.model = model
        self.model_id = model
        self.api_key = api_key
        self.response_format = response_format
        self._own_http = http is None
        self.http = http or httpx.AsyncClient(timeout=timeout, headers={"User-Agent": "memex/0.1 (+httpx)"})
        self.timeout = timeout
        self.retries = max(0, retries)
        self.max_retry_after = max_retry_after

    def _format(self, schema: Mapping[str, Any]) -> dict[str, Any]:
        if self.response_format == "json_schema" and schema:
            return {"type": "json_schema", "json_schema": {"name": "response", "schema": dict(schema), "strict": False}}
        return {"type": "json_object"}

    async def _post(self, body: dict[str, Any]) -> httpx.Response:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        attempt = 0
        while True:
            attempt += 1
            try:
                r = await self.http.post(self.url, json=body, headers=headers, timeout=self.timeout)
            except httpx.HTTPError as exc:
                if attempt <= self.retries:
                    await asyncio.sleep(0.5 * 2 ** (attempt - 1))
                    continue
                raise BackendError(f"LLM endpoint unreachable: {type(exc).__name__}") from exc
            if (r.status_code == 429 or r.status_code >= 500) and attempt <= self.retries:
                try:
                    wait = float(r.headers.get("retry-after", "")) if r.headers.get("retry-after") else 0.5 * 2 ** (attempt - 1)
                except ValueError:
                    wait = 0.5 * 2 ** (attempt - 1)
                await asyncio.sleep(min(self.max_retry_after, max(0.0, wait)))
                continue
            return r

    async def complete_json(
        self, messages: Sequence[ChatMessage], *, schema: Mapping[str, Any], max_tokens: int = 512,
        temperature: float = 0.2,
    ) -> LLMResult:
        body: dict[str, Any] = {
            "model": self.model,
            "messages": [{"role": m.role, "content": m.content} for m in messages],
            "temperature": temperature,
            "max_tokens": max_tokens,
            "response_format": self._format(schema),
            "stream": False,
        }
        r = await self._post(body)
        if r.status_code == 400 and body["response_format"]["type"] == "json_schema":
            # Older servers know only json_object: ask again and remember.
            log.info("LLM endpoint refused json_schema (%s); using json_object", r.text[:200])
            self.response_format = "json_object"
            body["response_format"] = {"type": "json_object"}
            r = await self._post(body)
        if r.status_code >= 400:
            raise BackendError(f"LLM endpoint answered HTTP {r.status_code}", details={"body": r.text[:200]})
        try:
            payload = r.json()
            choice = payload["choices"][0]
            content = choice["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise BackendError("LLM endpoint answered an unexpected shape") from exc
        try:
            data = parse_json_content(content)
        except ValueError as exc:
            raise BackendError("LLM did not answer JSON", details={"content": str(content)[:200]}) from exc
        usage = payload.get("usage") if isinstance(payload.get("usage"), dict) else {}
        return LLMResult(data=data, prompt_tokens=_int(usage.get("prompt_tokens")),
                         completion_tokens=_int(usage.get("completion_tokens")))

    async def aclose(self) -> None:
        """Close the HTTP client when the adapter made its own (not one it was given)."""
        if self._own_http:
            await self.http.aclose()


class WorkersAIRerankerPort:
    """The ``Reranker`` port over ``WorkersAIReranker``: one score per passage, in the passages' order."""

    def __init__(self, reranker: Any) -> None:
        self.reranker = reranker  # a services.adapters.cloudflare.WorkersAIReranker
        self.model_id = getattr(reranker, "model", "@cf/baai/bge-reranker-base")

    async def rerank(self, query: str, passages: Sequence[str]) -> list[float]:
        passages = list(passages)
        if not passages:
            return []
        scores = [0.0] * len(passages)
        for i, s in await self.reranker.rerank(query, passages):
            if 0 <= i < len(scores):
                scores[i] = float(s)
        return scores

    async def aclose(self) -> None:
        """Nothing to release: the Workers AI client shares the backend's HTTP client."""
