"""Workers AI through the data-plane Worker's ``AI`` binding: the embedder (``ai.embed``) and, for the chat model
and the reranker, the REST adapters' own logic (``WorkersAIChat``, ``WorkersAIReranker``) on an ``ai.run``
transport (``WorkerAiTransport``), so prompts, JSON-mode retries and score parsing stay in one place.

``WorkerEmbedder`` is ``WorkersAIEmbedder`` (token counting, fitting texts into 512 tokens, the query cache, unit
rows) with its transport replaced: every group of at most 100 texts is one ``ai.embed`` op, and the groups of one
call travel together in one request (at most ``OPS_PER_REQUEST`` ops each).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, cast

import numpy as np

from services.errors import BackendError

from .client import CloudflareApi, CloudflareApiError
from .workers_ai import EMBED_MODEL, MAX_TEXTS_PER_CALL, WorkersAIChat, WorkersAIEmbedder, WorkersAIReranker
from .worker_client import WorkerClient, WorkerOpError

__all__ = ["WorkerEmbedder", "WorkerAiTransport", "worker_chat", "worker_reranker"]

#: ai.embed ops (each <= 100 texts) per request.
OPS_PER_REQUEST = 16


class WorkerEmbedder(WorkersAIEmbedder):
    """``Embedder`` for bge-base-en-v1.5 on the Worker's AI binding (``ai.embed``)."""

    def __init__(self, client: WorkerClient, *, model: str = EMBED_MODEL, pooling: str = "mean", dimensions: int = 768,
                 query_cache_size: int = 1024, exact_count: Callable[[str], int | None] | None = None) -> None:
        super().__init__(cast(CloudflareApi, None), model=model, pooling=pooling, dimensions=dimensions,
                         query_cache_size=query_cache_size, exact_count=exact_count)
        self.client = client

    def _rows(self, res: Mapping[str, Any], n: int) -> np.ndarray:
        try:
            mat = np.asarray(res.get("data"), dtype=np.float32)
        except (TypeError, ValueError) as exc:
            raise BackendError("the Worker returned malformed embeddings") from exc
        if mat.ndim != 2 or mat.shape != (n, self.dimensions):
            raise BackendError(f"the Worker returned embeddings of shape {tuple(mat.shape)}, expected ({n}, "
                               f"{self.dimensions})")
        if not np.isfinite(mat).all():
            raise BackendError("the Worker returned non-finite embeddings")
        norms = np.linalg.norm(mat.astype(np.float64), axis=1, keepdims=True)
        return (mat / np.maximum(norms, 1e-12)).astype(np.float32)

    async def _call(self, texts: list[str]) -> np.ndarray:
        return (await self._embed_groups([texts]))[0]

    async def _embed_groups(self, groups: list[list[str]]) -> list[np.ndarray]:
        ops = [{"op": "ai.embed", "model": self.model, "texts": g, "pooling": self.pooling} for g in groups]
        out: list[np.ndarray] = []
        for start in range(0, len(ops), OPS_PER_REQUEST):
            part = ops[start:start + OPS_PER_REQUEST]
            results = await self.client.send(part, idempotent=True)
            for i, res in enumerate(results):
                out.append(self._rows(self.client.raise_for("ai.embed", res, start + i), len(groups[start + i])))
        return out

    async def embed(self, texts: Any) -> np.ndarray:
        """Shape (len(texts), dimensions), float32, unit rows, in input order: one request per 1,600 texts."""
        fitted = [self._fit(t if isinstance(t, str) else str(t)) for t in texts]
        if not fitted:
            return np.zeros((0, self.dimensions), dtype=np.float32)
        groups = [fitted[i:i + MAX_TEXTS_PER_CALL] for i in range(0, len(fitted), MAX_TEXTS_PER_CALL)]
        parts = await self._embed_groups(groups)
        return np.concatenate(parts, axis=0) if len(parts) > 1 else parts[0]


class WorkerAiTransport:
    """What ``WorkersAIChat`` and ``WorkersAIReranker`` call (``call("ai", "POST", "ai/run/<model>", json=...)``),
    sent as one ``ai.run`` op. An op failure is raised as the ``CloudflareApiError`` those clients read (its text
    is Workers AI's message, e.g. "JSON Mode couldn't be met", which the chat client retries)."""

    def __init__(self, client: WorkerClient) -> None:
        self.client = client

    async def call(self, kind: str, method: str, path: str, *, idempotent: bool, json: Any = None, **_: Any) -> Any:
        if kind != "ai" or method != "POST" or not path.startswith("ai/run/"):
            raise BackendError(f"the Worker transport carries Workers AI runs only, not {kind} {method} {path}")
        model = path[len("ai/run/"):]
        try:
            res = await self.client.run({"op": "ai.run", "model": model, "input": json or {}}, idempotent=idempotent)
        except WorkerOpError as err:
            raise CloudflareApiError(f"Workers AI (through the Worker) failed: {err.op_message}", kind="ai",
                                     errors=[{"code": err.op_code, "message": err.op_message}],
                                     attempts=err.attempts) from err
        return res.get("result")


def worker_chat(client: WorkerClient, **kw: Any) -> WorkersAIChat:
    """llama-3.1-8b in JSON mode on the Worker's AI binding (``WorkersAIChat`` over ``ai.run``)."""
    return WorkersAIChat(cast(CloudflareApi, WorkerAiTransport(client)), **kw)


def worker_reranker(client: WorkerClient, **kw: Any) -> WorkersAIReranker:
    """bge-reranker-base on the Worker's AI binding (``WorkersAIReranker`` over ``ai.run``)."""
    return WorkersAIReranker(cast(CloudflareApi, WorkerAiTransport(client)), **kw)
