"""Workers AI: deterministic stand-ins for bge embeddings, the bge reranker and llama-3.1-8b-instruct."""

from __future__ import annotations

import hashlib
import json
import math
import re
import threading
from collections import deque
from itertools import pairwise
from typing import Any, Callable

import numpy as np

from .errors import AI_BAD_INPUT, AI_JSON_MODE_FAILED, AI_NO_SUCH_MODEL, AI_TOO_LARGE, CFError

EMBED_MODELS = {
    "@cf/baai/bge-small-en-v1.5": 384,
    "@cf/baai/bge-base-en-v1.5": 768,
    "@cf/baai/bge-large-en-v1.5": 1024,
}
RERANK_MODEL = "@cf/baai/bge-reranker-base"
LLM_MODELS = ("@cf/meta/llama-3.1-8b-instruct",)
MAX_TEXTS = 100
MAX_TOKENS_PER_TEXT = 512
LLM_DEFAULT_MAX_TOKENS = 256
_WORD_RE = re.compile(r"\w+", re.UNICODE)


def estimate_tokens(text: str) -> int:
    """max(whitespace words * 1.3, characters / 4), rounded up."""
    return max(math.ceil(len(text.split()) * 1.3), math.ceil(len(text) / 4))


def words(text: str) -> list[str]:
    return _WORD_RE.findall(text.lower())


def _bucket(feature: str, dims: int, salt: str) -> tuple[int, float]:
    h = int.from_bytes(hashlib.blake2b(f"{salt}\x00{feature}".encode(), digest_size=8).digest(), "big")
    return h % dims, (1.0 if (h >> 40) & 1 else -1.0)


_STOPWORDS = frozenset(
    "a an the and or but if of to in on at by for with from as is are was were be been being it its this that "
    "these those there here what which who whom whose when where why how do does did done have has had i me my "
    "we our you your he him his she her they them their not no so than then too very can could should would "
    "will just about into over under again".split())
_PROBES = 4  # buckets per feature: denser vectors, same similarity structure


def _stem(w: str) -> str:
    """Crude suffix stripping so that 'prefers'/'preferred'/'preferring' share a feature."""
    for suf in ("ing", "ed", "es", "s"):
        if len(w) > len(suf) + 3 and w.endswith(suf):
            return w[: -len(suf)]
    return w


def embed(text: str, dims: int = 768, pooling: str = "mean") -> list[float]:
    """Feature hashing of lowercase (crudely stemmed) word unigrams (weight 1, stop words 0.2) and bigrams
    (weight 0.5), each into 4 signed buckets, L2-normalised. Deterministic; texts sharing words have a high
    cosine, texts sharing none have ~0. ``cls`` pooling uses another hash salt, so cls and mean vectors are
    unrelated (as the docs warn)."""
    toks = [_stem(t) for t in words(text)]
    feats: list[tuple[str, float]] = [(t, 0.2 if t in _STOPWORDS else 1.0) for t in toks]
    feats += [(f"{a} {b}", 0.5) for a, b in pairwise(toks)]
    if not feats:
        feats = [(f"#raw:{text}", 1.0)]
    vec = np.zeros(dims, dtype=np.float64)
    salt = "bge-" + pooling
    for f, w in feats:
        for k in range(_PROBES):
            i, s = _bucket(f"{k}:{f}", dims, salt)
            vec[i] += s * w
    n = float(np.linalg.norm(vec))
    if n > 0:
        vec /= n
    return [round(float(x), 8) for x in vec]


def _content_words(text: str) -> list[str]:
    toks = [_stem(t) for t in words(text)]
    content = [t for t in toks if t not in _STOPWORDS]
    return content or toks


def rerank_score(query: str, context: str) -> float:
    """sigmoid(10 * share of the query's distinct content words found in the context
    + 2 * share of its bigrams found - 5): 0.0067 for no overlap, 0.5 for half, 0.99+ for all."""
    q, c = _content_words(query), _content_words(context)
    qs, cs = set(q), set(c)
    if not qs:
        return 1 / (1 + math.exp(5))
    overlap = len(qs & cs) / len(qs)
    qb = set(pairwise(q))
    bonus = (len(qb & set(pairwise(c))) / len(qb)) if qb else 0.0
    x = 10.0 * overlap + 2.0 * bonus - 5.0
    return 1 / (1 + math.exp(-x))


class LLMScript:
    """Canned responses for the chat model, consumed in order, one per call.

    An entry may be: a string, a JSON-able object (dict/list/number...), a callable(body) -> entry, or
    ``{"__error__": {"status": 400, "code": 3030, "message": "..."}}`` to answer an error.
    With an empty queue the model echoes: JSON mode -> a minimal object valid for the given json_schema
    (or ``{"echo": <last user message, <= 200 chars>}``); text mode -> the last user message."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queue: deque[Any] = deque()
        self.requests: list[dict] = []

    def push(self, *entries: Any) -> None:
        with self._lock:
            self._queue.extend(entries)

    def clear(self) -> None:
        with self._lock:
            self._queue.clear()
            self.requests.clear()

    def pending(self) -> int:
        with self._lock:
            return len(self._queue)

    def next(self, body: dict) -> tuple[bool, Any]:
        with self._lock:
            self.requests.append(body)
            if len(self.requests) > 1000:
                del self.requests[:-1000]
            if not self._queue:
                return False, None
            entry = self._queue.popleft()
        while callable(entry):
            entry = entry(body)
        return True, entry


def _schema_instance(schema: Any, depth: int = 0) -> Any:
    if not isinstance(schema, dict) or depth > 8:
        return {}
    if "const" in schema:
        return schema["const"]
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return schema["enum"][0]
    if "default" in schema:
        return schema["default"]
    for key in ("anyOf", "oneOf", "allOf"):
        if isinstance(schema.get(key), list) and schema[key]:
            return _schema_instance(schema[key][0], depth + 1)
    typ = schema.get("type")
    if isinstance(typ, list):
        typ = next((t for t in typ if t != "null"), "null")
    if typ == "object" or (typ is None and "properties" in schema):
        props = schema.get("properties") or {}
        req = schema.get("required")
        keys = req if isinstance(req, list) else list(props)
        return {k: _schema_instance(props.get(k, {}), depth + 1) for k in keys}
    if typ == "array":
        n = int(schema.get("minItems", 0) or 0)
        return [_schema_instance(schema.get("items", {}), depth + 1) for _ in range(n)]
    if typ == "string":
        return "x" * int(schema.get("minLength", 0) or 0)
    if typ in ("number", "integer"):
        return schema.get("minimum", 0)
    if typ == "boolean":
        return False
    if typ == "null":
        return None
    return {}


class WorkersAI:
    def __init__(self) -> None:
        self.llm = LLMScript()

    def run(self, model: str, body: Any) -> Any:
        if model in EMBED_MODELS:
            return self._embed(model, body)
        if model == RERANK_MODEL:
            return self._rerank(body)
        if model in LLM_MODELS:
            return self._chat(body)
        raise CFError(400, AI_NO_SUCH_MODEL, f"No such model {model} or task")

    @staticmethod
    def _bad(msg: str) -> CFError:
        return CFError(400, AI_BAD_INPUT, f"AiError: Bad input: {msg}")

    def _embed(self, model: str, body: Any) -> dict:
        if not isinstance(body, dict) or "text" not in body:
            raise self._bad("required properties at '/' are 'text'")
        text = body["text"]
        texts = [text] if isinstance(text, str) else text
        if not isinstance(texts, list) or not texts:
            raise self._bad("'text' must be a string or a non-empty array of strings")
        if len(texts) > MAX_TEXTS:
            raise self._bad(f"'text' must have at most {MAX_TEXTS} items")
        for i, t in enumerate(texts):
            if not isinstance(t, str) or not t:
                raise self._bad(f"'text[{i}]' must be a non-empty string")
        pooling = body.get("pooling", "mean")
        if pooling not in ("mean", "cls"):
            raise self._bad("'pooling' must be 'mean' or 'cls'")
        for i, t in enumerate(texts):
            n = estimate_tokens(t)
            if n > MAX_TOKENS_PER_TEXT:
                raise CFError(413, AI_TOO_LARGE,
                              f"AiError: Input too large: text[{i}] has ~{n} tokens (max {MAX_TOKENS_PER_TEXT})")
        dims = EMBED_MODELS[model]
        return {"shape": [len(texts), dims], "data": [embed(t, dims, pooling) for t in texts], "pooling": pooling}

    def _rerank(self, body: Any) -> dict:
        if not isinstance(body, dict):
            raise self._bad("body must be an object")
        query, contexts = body.get("query"), body.get("contexts")
        if not isinstance(query, str) or not query:
            raise self._bad("'query' must be a non-empty string")
        if not isinstance(contexts, list) or not contexts:
            raise self._bad("'contexts' must be a non-empty array of {text}")
        for i, c in enumerate(contexts):
            if not isinstance(c, dict) or not isinstance(c.get("text"), str):
                raise self._bad(f"'contexts[{i}].text' must be a string")
        top_k = body.get("top_k")
        if top_k is not None and (not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1):
            raise self._bad("'top_k' must be a positive integer")
        scored = [(i, rerank_score(query, c["text"])) for i, c in enumerate(contexts)]
        scored.sort(key=lambda p: (-p[1], p[0]))
        if top_k is not None:
            scored = scored[:top_k]
        return {"response": [{"id": i, "score": s} for i, s in scored]}

    def _chat(self, body: Any) -> dict:
        if not isinstance(body, dict):
            raise self._bad("body must be an object")
        msgs = body.get("messages")
        prompt = body.get("prompt")
        if msgs is not None:
            if not isinstance(msgs, list) or not msgs or not all(
                    isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                    for m in msgs):
                raise self._bad("'messages' must be a non-empty array of {role, content}")
            prompt_text = "\n".join(m["content"] for m in msgs)
            last_user = next((m["content"] for m in reversed(msgs) if m["role"] == "user"), msgs[-1]["content"])
        elif isinstance(prompt, str) and prompt:
            prompt_text = last_user = prompt
        else:
            raise self._bad("required properties at '/' are 'messages' or 'prompt'")
        max_tokens = body.get("max_tokens", LLM_DEFAULT_MAX_TOKENS)
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise self._bad("'max_tokens' must be a positive integer")
        temp = body.get("temperature", 0.6)
        if not (isinstance(temp, (int, float)) and not isinstance(temp, bool) and 0 <= temp <= 5):
            raise self._bad("'temperature' must be between 0 and 5")
        rf = body.get("response_format")
        json_mode = False
        schema = None
        if rf is not None:
            if not isinstance(rf, dict) or rf.get("type") not in ("json_object", "json_schema"):
                raise self._bad("'response_format.type' must be 'json_object' or 'json_schema'")
            json_mode = True
            schema = rf.get("json_schema")
            if isinstance(schema, dict) and isinstance(schema.get("schema"), dict) \
                    and "type" not in schema and "properties" not in schema:
                schema = schema["schema"]  # OpenAI-style {"name", "schema"} wrapper
            if body.get("stream"):
                raise self._bad("JSON mode does not support streaming")
        if body.get("stream"):
            raise self._bad("stream=true is not supported by the emulator")

        scripted, entry = self.llm.next(body)
        if scripted and isinstance(entry, dict) and "__error__" in entry:
            e = entry["__error__"] or {}
            raise CFError(int(e.get("status", 400)), int(e.get("code", AI_BAD_INPUT)),
                          str(e.get("message", "AiError: scripted error")))
        if not scripted:
            if json_mode:
                entry = _schema_instance(schema) if isinstance(schema, dict) and schema else \
                    {"echo": last_user[:200]}
            else:
                entry = last_user
        budget_chars = max_tokens * 4
        if json_mode:
            if isinstance(entry, str):
                try:
                    entry = json.loads(entry)
                except ValueError:
                    raise CFError(400, AI_JSON_MODE_FAILED, "JSON Mode couldn't be met") from None
            text = json.dumps(entry, separators=(",", ":"))
            if estimate_tokens(text) > max_tokens:
                # the real model would stop at max_tokens, leaving invalid JSON
                raise CFError(400, AI_JSON_MODE_FAILED, "JSON Mode couldn't be met")
            response: Any = entry
        else:
            text = entry if isinstance(entry, str) else json.dumps(entry)
            if estimate_tokens(text) > max_tokens:
                text = text[:budget_chars]  # cut at max_tokens, like the real model
            response = text
        pt, ct = estimate_tokens(prompt_text), estimate_tokens(text)
        return {"response": response, "tool_calls": [],
                "usage": {"prompt_tokens": pt, "completion_tokens": ct, "total_tokens": pt + ct}}


LLMEntry = str | dict | list | Callable[[dict], Any]
