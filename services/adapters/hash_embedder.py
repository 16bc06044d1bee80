"""A deterministic, dependency-free ``Embedder`` for fast plumbing tests (not for retrieval quality).

Feature hashing of lowercase word unigrams and bigrams into ``dimensions`` buckets, each feature with a
hash-derived sign, then L2-normalised. Identical texts get identical vectors, texts sharing most of
their words get a high cosine similarity, unrelated texts a cosine near 0. Stable across processes and
platforms (blake2b, not Python's salted ``hash``).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from functools import lru_cache
from itertools import pairwise

import numpy as np

__all__ = ["HashEmbedder"]

_WORD = re.compile(r"\w+")
_TOKEN = re.compile(r"\w+|[^\w\s]")
_BIGRAM_WEIGHT = 0.5


@lru_cache(maxsize=65536)
def _feature(feature: str, dimensions: int) -> tuple[int, float]:
    digest = hashlib.blake2b(feature.encode("utf-8"), digest_size=8).digest()
    value = int.from_bytes(digest, "little")
    return value % dimensions, (1.0 if (value >> 63) & 1 else -1.0)


class HashEmbedder:
    """``Embedder`` by feature hashing; ``count_tokens`` counts words and punctuation marks."""

    model_id: str = "memex/hash-embedder-v1"
    #: Texts sharing no word score ~0; sharing a few of a short query's words scores 0.2-0.5.
    relevance_floor: float | None = 0.2

    def __init__(self, dimensions: int = 384, max_tokens: int = 256) -> None:
        if dimensions < 1:
            raise ValueError("dimensions must be >= 1")
        self.dimensions = dimensions
        self.max_tokens = max_tokens

    def count_tokens(self, text: str) -> int:
        """Words (runs of letters/digits/underscore) plus punctuation marks."""
        return len(_TOKEN.findall(text))

    def embed_one(self, text: str) -> np.ndarray:
        vector = np.zeros(self.dimensions, dtype=np.float64)
        words = _WORD.findall(text.lower())
        if not words:
            words = ["\x00empty"]
        for word in words:
            bucket, sign = _feature("u:" + word, self.dimensions)
            vector[bucket] += sign
        for first, second in pairwise(words):
            bucket, sign = _feature("b:" + first + " " + second, self.dimensions)
            vector[bucket] += sign * _BIGRAM_WEIGHT
        norm = np.linalg.norm(vector)
        if norm == 0.0:  # every feature cancelled out: fall back to a fixed unit vector
            bucket, sign = _feature("\x00zero", self.dimensions)
            vector[bucket] = sign
            norm = 1.0
        return (vector / norm).astype(np.float32)

    def embed_sync(self, texts: Sequence[str]) -> np.ndarray:
        out = np.empty((len(texts), self.dimensions), dtype=np.float32)
        for row, text in enumerate(texts):
            out[row] = self.embed_one(text)
        return out

    async def embed(self, texts: Sequence[str]) -> np.ndarray:
        """Shape (len(texts), dimensions), float32, unit rows."""
        return self.embed_sync(list(texts))

    async def embed_query(self, text: str) -> np.ndarray:
        """One text -> shape (dimensions,). No query-specific mode: the query is embedded as a document."""
        return self.embed_one(text)
