"""Workers AI over ``POST /accounts/{a}/ai/run/{model}``: the bge-base embedder, a llama-3.1-8b JSON-mode chat
client and the bge reranker.

Embedder (``@cf/baai/bge-base-en-v1.5``, mean pooling, 768 dimensions; ``model_id`` says the pooling because
cls and mean vectors are incompatible): at most 100 texts per call (split, up to 4 calls in flight), rows
L2-normalised, empty texts replaced by a placeholder (the API refuses them), texts over the 512-token limit
cut to fit before sending (long search queries; the chunker already keeps chunks inside it). Every call is
idempotent, so 5xx/timeouts are retried.

Token counting (``count_tokens``, no network): the larger of three counts, so a chunk the chunker accepts
is under 512 for the real model and for any reasonable estimate of it:

* the model's own WordPiece count, when the embedder is given one (``exact_count``): the composition root passes
  the local all-MiniLM-L6-v2 tokenizer's (``services.adapters.onnx_embedder.WordPieceCount``) — MiniLM and
  bge-base-en-v1.5 both use the uncased English BERT WordPiece vocabulary;
* ``ceil(1.3 x words-and-punctuation marks)`` (each CJK character counts as a word);
* ``ceil(characters / 4)``.

For English prose the second usually wins by a few percent over the exact count: chunks are slightly smaller
than they could be, never too big.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from services.errors import BackendError, InvalidInput

from .client import CloudflareApi, CloudflareApiError

__all__ = [
    "WorkersAIEmbedder",
    "WorkersAIChat",
    "WorkersAIReranker",
    "EMBED_MODEL",
    "CHAT_MODEL",
    "RERANK_MODEL",
    "conservative_token_count",
]

EMBED_MODEL = "@cf/baai/bge-base-en-v1.5"
CHAT_MODEL = "@cf/meta/llama-3.1-8b-instruct"
RERANK_MODEL = "@cf/baai/bge-reranker-base"
MAX_TEXTS_PER_CALL = 100
EMPTY_PLACEHOLDER = "(empty)"

_CJK = "\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff"
_TOKENS = re.compile(f"[{_CJK}]|[^\\W{_CJK}]+|[^\\w\\s]")


def conservative_token_count(text: str) -> int:
    """``max(ceil(1.3 x words-and-punctuation), ceil(chars / 4))`` — no tokenizer needed."""
    if not text:
        return 0
    return max(math.ceil(len(_TOKENS.findall(text)) * 1.3), math.ceil(len(text) / 4))


class WorkersAIEmbedder:
    """``Embedder`` for ``@cf/baai/bge-base-en-v1.5`` with mean pooling on Workers AI."""

    dimensions: int = 768
    max_tokens: int = 512
    #: No relevance floor on the vector side: bge's cosines sit in a narrow high band whose cut-off for
    #: "unrelated" could not be calibrated offline (these machines cannot reach Workers AI). The keyword side
    #: alone would drop good semantic matches, so the floor is off for this model.
    relevance_floor: float | None = None

    def __init__(
        self,
        api: CloudflareApi,
        *,
        model: str = EMBED_MODEL,
        pooling: str = "mean",
        dimensions: int = 768,
        query_cache_size: int = 1024,
        concurrency: int = 4,
        exact_count: Callable[[str], int | None] | None = None,
    ) -> None:
        """``exact_count(text)``: the model's own token count where one is at hand (None when it is not); without
        it the counts are the estimates alone."""
        if pooling not in ("mean", "cls"):
            raise ValueError("pooling must be 'mean' or 'cls'")
        self.api = api
        self.model = model
        self.pooling = pooling
        self.dimensions = dimensions
        self.model_id = f"{model}:{pooling}"
        self.query_cache_size = max(0, query_cache_size)
        self.exact_count = exact_count
        self._sem = asyncio.Semaphore(max(1, concurrency))
        self._cache: OrderedDict[str, np.ndarray] = OrderedDict()

    # -- tokens --------------------------------------------------------------------------------------

    def count_tokens(self, text: str) -> int:
        """A count at least the model's own (without [CLS]/[SEP]); see the module docstring."""
        if not text:
            return 0
        n = conservative_token_count(text)
        if self.exact_count is not None:
            exact = self.exact_count(text)
            if exact is not None and exact > n:
                n = exact
        return n

    def _fit(self, text: str) -> str:
        if not text.strip():
            return EMPTY_PLACEHOLDER
        limit = self.max_tokens - 2
        if self.count_tokens(text) <= limit:
            return text
        lo, hi = 0, len(text)  # longest prefix that fits
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.count_tokens(text[:mid]) <= limit:
                lo = mid
            else:
                hi = mid - 1
        cut = text[:lo]
        space = cut.rfind(" ")
        if space > lo // 2:
            cut = cut[:space]
        return cut or EMPTY_PLACEHOLDER

    # -- embeddings ----------------------------------------------------------------------------------

    async def _call(self, texts: list[str]) -> np.ndarray:
        async with self._sem:
            res = await self.api.call(
                "ai", "POST", f"ai/run/{self.model}", json={"text": texts, "pooling": self.pooling}, idempotent=True
            )
        data = (res or {}).get("data") if isinstance(res, dict) else None
        try:
            mat = np.asarray(data, dtype=np.float32)
        except (TypeError, ValueError) as exc:
            raise BackendError("Workers AI returned malformed embeddings") from exc
        if mat.ndim != 2 or mat.shape != (len(texts), self.dimensions):
            raise BackendError(
                f"Workers AI returned embeddings of shape {tuple(mat.shape)}, "
                f"expected ({len(texts)}, {self.dimensions})"
            )
        if not np.isfinite(mat).all():
            raise BackendError("Workers AI returned non-finite embeddings")
        norms = np.linalg.norm(mat.astype(np.float64), axis=1, keepdims=True)
        return (mat / np.maximum(norms, 1e-12)).astype(np.float32)

    async def embed(self, texts: Sequence[str]) -> np.ndarray:
        """Shape (len(texts), 768), float32, unit rows, in input order."""
        texts = [self._fit(t if isinstance(t, str) else str(t)) for t in texts]
        if not texts:
            return np.zeros((0, self.dimensions), dtype=np.float32)
        groups = [texts[i : i + MAX_TEXTS_PER_CALL] for i in range(0, len(texts), MAX_TEXTS_PER_CALL)]
        parts = await asyncio.gather(*(self._call(g) for g in groups))
        return np.concatenate(parts, axis=0) if len(parts) > 1 else parts[0]

    async def embed_query(self, text: str) -> np.ndarray:
        """One text -> (768,), through a small LRU keyed on the text (search queries repeat). The query is
        embedded as a document (bge's retrieval instruction prefix is not used)."""
        if self.query_cache_size:
            hit = self._cache.get(text)
            if hit is not None:
                self._cache.move_to_end(text)
                return hit.copy()
        vec = (await self.embed([text]))[0]
        if self.query_cache_size:
            self._cache[text] = vec
            while len(self._cache) > self.query_cache_size:
                self._cache.popitem(last=False)
        return vec.copy()


class WorkersAIChat:
    """``@cf/meta/llama-3.1-8b-instruct`` in JSON mode (for enrichment): returns the parsed object.

    ``max_tokens`` defaults to 1024 because the model's own default (256) cuts JSON short, which Workers AI
    reports as "JSON Mode couldn't be met"; that failure is retried ``json_retries`` times.
    """

    def __init__(
        self, api: CloudflareApi, *, model: str = CHAT_MODEL, temperature: float = 0.2, max_tokens: int = 1024,
        json_retries: int = 1,
    ) -> None:
        self.api = api
        self.model = model
        self.temperature = temperature
        self.max_tokens = max_tokens
        self.json_retries = max(0, json_retries)

    @staticmethod
    def _messages(messages: Sequence[Mapping[str, str]] | str, system: str | None) -> list[dict[str, str]]:
        if isinstance(messages, str):
            msgs = [{"role": "user", "content": messages}]
        else:
            msgs = [{"role": str(m["role"]), "content": str(m["content"])} for m in messages]
        if system:
            msgs.insert(0, {"role": "system", "content": system})
        if not msgs:
            raise InvalidInput("chat needs at least one message")
        return msgs

    async def complete_json(
        self,
        messages: Sequence[Mapping[str, str]] | str,
        schema: Mapping[str, Any] | None = None,
        *,
        system: str | None = None,
        max_tokens: int | None = None,
        temperature: float | None = None,
        seed: int | None = None,
        with_usage: bool = False,
    ) -> Any:
        """Ask for JSON matching ``schema`` (a JSON Schema; None = any JSON object) and return it parsed
        (with ``with_usage``: ``(parsed, usage)``, usage being the model's ``{"prompt_tokens", ...}`` or {})."""
        body: dict[str, Any] = {
            "messages": self._messages(messages, system),
            "max_tokens": max_tokens or self.max_tokens,
            "temperature": self.temperature if temperature is None else temperature,
            "response_format": (
                {"type": "json_schema", "json_schema": dict(schema)} if schema is not None else {"type": "json_object"}
            ),
        }
        if seed is not None:
            body["seed"] = seed
        attempt = 0
        while True:
            attempt += 1
            try:
                res = await self.api.call("ai", "POST", f"ai/run/{self.model}", json=body, idempotent=True)
            except CloudflareApiError as exc:
                if "json mode" in exc.text.lower() and attempt <= self.json_retries:
                    continue
                raise
            response = (res or {}).get("response") if isinstance(res, dict) else None
            if isinstance(response, str):
                try:
                    response = json.loads(response)
                except ValueError as exc:
                    if attempt <= self.json_retries:
                        continue
                    raise BackendError("Workers AI chat did not return JSON", details={"response": response[:200]}) from exc
            if response is None:
                raise BackendError("Workers AI chat returned no response")
            if with_usage:
                usage = res.get("usage") if isinstance(res.get("usage"), dict) else {}
                return response, usage
            return response

    async def complete(
        self, messages: Sequence[Mapping[str, str]] | str, *, system: str | None = None, max_tokens: int | None = None,
        temperature: float | None = None,
    ) -> str:
        """Plain text completion."""
        body = {
            "messages": self._messages(messages, system),
            "max_tokens": max_tokens or self.max_tokens,
            "temperature": self.temperature if temperature is None else temperature,
        }
        res = await self.api.call("ai", "POST", f"ai/run/{self.model}", json=body, idempotent=True)
        response = (res or {}).get("response") if isinstance(res, dict) else None
        return response if isinstance(response, str) else json.dumps(response)


class WorkersAIReranker:
    """``@cf/baai/bge-reranker-base``: scores (query, text) pairs; returns ``[(index, score)]`` best first.

    Scores are the model's relevance in 0..1 (sigmoid); calibrate thresholds on real data. Pairs are scored
    independently (a cross-encoder), so long candidate lists are split into calls of ``batch`` contexts and
    merged.
    """

    def __init__(self, api: CloudflareApi, *, model: str = RERANK_MODEL, batch: int = 100) -> None:
        self.api = api
        self.model = model
        self.batch = max(1, batch)

    async def rerank(self, query: str, texts: Sequence[str], *, top_k: int | None = None) -> list[tuple[int, float]]:
        if not query or not query.strip():
            raise InvalidInput("rerank query must be a non-empty string")
        texts = list(texts)
        if not texts:
            return []
        scored: list[tuple[int, float]] = []
        for start in range(0, len(texts), self.batch):
            group = texts[start : start + self.batch]
            res = await self.api.call(
                "ai", "POST", f"ai/run/{self.model}",
                json={"query": query, "contexts": [{"text": t or EMPTY_PLACEHOLDER} for t in group]},
                idempotent=True,
            )
            for item in (res or {}).get("response") or []:
                if isinstance(item, dict) and isinstance(item.get("id"), int) and 0 <= item["id"] < len(group):
                    scored.append((start + item["id"], float(item.get("score", 0.0))))
        scored.sort(key=lambda p: (-p[1], p[0]))
        return scored[:top_k] if top_k else scored
