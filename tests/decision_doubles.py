"""Test doubles for the write-time decisions: an embedder whose similarities are scripted exactly, and a
language model answering from a script (both implement the ports; bands, validation and fallbacks are ours)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from services.adapters.hash_embedder import HashEmbedder
from services.ports import ChatMessage, LLMResult


def basis(i: int, dims: int = 384) -> np.ndarray:
    v = np.zeros(dims, dtype=np.float32)
    v[i] = 1.0
    return v


def near(base: int, other: int, cos: float, dims: int = 384) -> np.ndarray:
    """A unit vector at cosine ``cos`` from ``basis(base)`` (in the plane of ``base`` and ``other``)."""
    return (cos * basis(base, dims) + math.sqrt(max(0.0, 1 - cos * cos)) * basis(other, dims)).astype(np.float32)


class ScriptedEmbedder(HashEmbedder):
    """The hash embedder, except for texts given a vector with ``set``; counts the texts it embeds."""

    def __init__(self) -> None:
        super().__init__()
        self.script: dict[str, np.ndarray] = {}
        self.embedded: list[str] = []

    def set(self, text: str, vector: np.ndarray) -> str:
        self.script[text] = vector / np.linalg.norm(vector)
        return text

    def embed_one(self, text: str) -> np.ndarray:
        return self.script[text] if text in self.script else super().embed_one(text)

    async def embed(self, texts: Sequence[str]) -> np.ndarray:
        self.embedded.extend(texts)
        return self.embed_sync(list(texts))


class ScriptedLLM:
    """Answers the decision prompts with the next scripted value (a callable gets the messages; an exception
    instance is raised) and records them; any other prompt (enrichment) gets a fixed neutral answer."""

    model_id = "test/scripted-llm"

    def __init__(self, *answers: Any) -> None:
        self.answers = list(answers)
        self.calls: list[dict[str, Any]] = []

    def then(self, *answers: Any) -> "ScriptedLLM":
        self.answers.extend(answers)
        return self

    async def complete_json(self, messages: Sequence[ChatMessage], *, schema, max_tokens: int = 512,
                            temperature: float = 0.2) -> LLMResult:
        if "action" not in (schema or {}).get("properties", {}):  # not a decision (enrichment): a neutral answer
            return LLMResult(data={"summary": "scripted summary", "tags": [], "importance": 3})
        self.calls.append({"messages": list(messages), "schema": schema, "max_tokens": max_tokens})
        answer = self.answers.pop(0) if self.answers else {"action": "keep_both"}
        if isinstance(answer, BaseException):
            raise answer
        if isinstance(answer, Callable):
            answer = answer(messages)
        return LLMResult(data=answer, prompt_tokens=50, completion_tokens=10)

    @property
    def prompt(self) -> str:
        return self.calls[-1]["messages"][-1].content

    async def aclose(self) -> None:
        """Nothing to release."""
