"""The embedders: the local MiniLM (int8 ONNX) model and the hashing embedder used for plumbing tests."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading

import numpy as np
import pytest

from services.adapters.hash_embedder import HashEmbedder
from services.adapters.onnx_embedder import BACKGROUND_NICE, OnnxMiniLMEmbedder, load_tokenizer_json
from services.background import background
from services.ports import Embedder


@pytest.fixture(scope="module")
def minilm() -> OnnxMiniLMEmbedder:
    embedder = OnnxMiniLMEmbedder()
    embedder.warm_up()
    return embedder


@pytest.fixture(scope="module")
def reference_tokenizer():
    """The tokenizer exactly as shipped, but untruncated: an independent count of model tokens."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_str(load_tokenizer_json())
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return tokenizer


def cos(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))


def words_text(n_words: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    vocab = "memory tenant vector search note index query chunk token model river mountain".split()
    return " ".join(vocab[i] for i in rng.integers(0, len(vocab), n_words))


# ---------------------------------------------------------------------------- MiniLM


def test_minilm_is_an_embedder(minilm):
    assert isinstance(minilm, Embedder)
    assert minilm.dimensions == 384
    assert minilm.max_tokens == 256
    assert "MiniLM-L6" in minilm.model_id and "int8" in minilm.model_id


async def test_rows_are_unit_float32_vectors(minilm):
    texts = ["hello", "", "Ünïcödé — 漢字 and emoji 🙂", "x" * 5000, words_text(400, 1)]
    vectors = await minilm.embed(texts)
    assert vectors.shape == (len(texts), 384)
    assert vectors.dtype == np.float32
    assert np.all(np.isfinite(vectors))
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)


async def test_no_texts_gives_an_empty_matrix(minilm):
    vectors = await minilm.embed([])
    assert vectors.shape == (0, 384)
    assert vectors.dtype == np.float32


async def test_paraphrases_score_higher_than_unrelated_texts(minilm):
    cases = [
        (
            "How do I reset my password?",
            "What are the steps to change my login password?",
            "The recipe needs two cups of flour and a pinch of salt.",
        ),
        (
            "The meeting with the design team moved to Thursday afternoon.",
            "We rescheduled the design team sync to Thursday after lunch.",
            "Photosynthesis converts sunlight into chemical energy in plants.",
        ),
        (
            "Postgres connection pool exhausted under load",
            "database ran out of available connections when traffic spiked",
            "my cat likes to sleep on the warm windowsill",
        ),
    ]
    flat = [t for case in cases for t in case]
    vectors = await minilm.embed(flat)
    for k in range(len(cases)):
        anchor, paraphrase, unrelated = vectors[3 * k : 3 * k + 3]
        assert cos(anchor, paraphrase) > cos(anchor, unrelated) + 0.2, cases[k]


async def test_inputs_are_truncated_at_256_tokens_not_128(minilm):
    base = words_text(170, seed=2)
    assert 140 < minilm.count_tokens(base) < 200
    # Same first ~170 tokens, different words after them (still well inside 256 tokens).
    a = base + " " + "the quarterly invoices were paid by the finance department"
    b = base + " " + "a volcano erupted near the small fishing village at dawn"
    assert minilm.count_tokens(a) < 254 and minilm.count_tokens(b) < 254
    va, vb = await minilm.embed([a, b])
    assert cos(va, vb) < 0.999, "content after token 128 must reach the model"

    # Beyond 256 tokens nothing is seen: a different tail changes nothing.
    long_base = words_text(300, seed=3)
    assert minilm.count_tokens(long_base) > 256
    vc, vd = await minilm.embed([long_base + " invoices finance", long_base + " volcano village"])
    np.testing.assert_allclose(vc, vd, atol=1e-6)


async def test_batches_keep_input_order_and_match_single_embeddings(minilm, monkeypatch):
    # Several ONNX batches (of 4 here, to keep the test fast), texts of very different lengths in
    # no particular order: sorting by length for padding must not reorder the output.
    monkeypatch.setattr(minilm, "batch_size", 4)
    rng = np.random.default_rng(7)
    texts = [words_text(int(n), seed=i) + f" item {i}" for i, n in enumerate(rng.integers(1, 200, 11))]
    batched = await minilm.embed(texts)
    singles = np.stack([(await minilm.embed([t]))[0] for t in texts])
    # The int8-compute graph's kernels for several rows round a little differently from one row's (cosine
    # ~0.99986); the float graph's do not. The service runs one text a run (batch_size=1) either way.
    atol = 1e-5 if minilm.graph_in_use == "float" else 5e-3
    np.testing.assert_allclose(batched, singles, atol=atol)
    assert min(cos(a, b) for a, b in zip(batched, singles, strict=True)) > 0.9995
    # Order: each row is closest to its own single embedding.
    assert list(np.argmax(batched @ singles.T, axis=1)) == list(range(len(texts)))


@pytest.fixture(scope="module")
def float_graph() -> OnnxMiniLMEmbedder:
    embedder = OnnxMiniLMEmbedder(graph="float")
    embedder.warm_up()
    return embedder


@pytest.fixture(scope="module")
def int8_graph() -> OnnxMiniLMEmbedder:
    embedder = OnnxMiniLMEmbedder(graph="int8")
    embedder.warm_up()
    return embedder


@pytest.fixture
def same_graph(float_graph, int8_graph):
    """The reference for an embedder's vectors: one pinned to the graph it chose. "auto" times both graphs on a
    loaded machine, so two embedders may choose differently (their vectors then agree to ~0.999, not 0.99999)."""
    return lambda embedder: float_graph if embedder.graph_in_use == "float" else int8_graph


def plain_model_vectors(texts: list[str]) -> np.ndarray:
    """The package's model file run as it is, every graph optimisation off, mean-pooled: the model's own vectors."""
    import onnxruntime as ort
    from tokenizers import Tokenizer

    from services.adapters.onnx_embedder import default_model_path

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    plain = ort.InferenceSession(str(default_model_path()), sess_options=options, providers=["CPUExecutionProvider"])
    tokenizer = Tokenizer.from_str(load_tokenizer_json())
    tokenizer.enable_truncation(256)
    tokenizer.no_padding()
    inputs = {i.name for i in plain.get_inputs()}
    rows = []
    for text in texts:
        ids = np.array([tokenizer.encode(text).ids], dtype=np.int64)
        feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": np.zeros_like(ids)}
        (hidden,) = plain.run(["last_hidden_state"], {k: v for k, v in feeds.items() if k in inputs})
        rows.append(hidden[0].mean(axis=0))
    return np.stack(rows)


# lengths from a few tokens to past the window, each a new input shape, twice (a shape seen before)
SHAPES = [words_text(n, seed=n) for n in (3, 40, 41, 120, 300)] * 2


async def test_the_session_options_leave_the_models_vectors_unchanged(float_graph):
    # The session is tuned for speed and memory (graph optimisations, memory patterns): on the float graph a
    # user's vectors must still be exactly the model's own.
    got = await float_graph.embed(SHAPES)
    assert float_graph.graph_in_use == "float"
    for vector, expected in zip(got, plain_model_vectors(SHAPES), strict=True):
        assert cos(vector, expected) > 0.9999


async def test_the_int8_compute_graph_keeps_the_models_vectors_and_ranking(float_graph, int8_graph):
    # The graph "auto" picks where onnxruntime has int8 kernels (x86-64 with AVX2, ARM64) multiplies the package's
    # int8 weights as int8. Its activations are quantized too, so vectors move, but only a little, and what a search
    # returns must not: the same nearest text for every query. (Which graph "auto" picks here is timed on a shared
    # machine, so not asserted; the rule it applies is tested with the timings given.)
    int8 = int8_graph
    texts = SHAPES[:5] + [
        "The TLS certificate of the staging cluster expires on Friday.",
        "Grandma's apple pie uses cinnamon and brown sugar.",
        "Backups of the production database are kept for thirty days.",
        "The team moved the weekly sync to Tuesday afternoons.",
    ]
    got = await int8.embed(texts)
    for vector, expected in zip(got, plain_model_vectors(texts), strict=True):
        assert 0.995 < cos(vector, expected) < 0.99999  # close, and really the other graph
    queries = ["when does the certificate expire", "pie recipe", "how long are backups kept", "meeting moved"]
    assert [int(i) for i in np.argmax((await int8.embed(queries)) @ got.T, axis=1)] == [5, 6, 7, 8]
    expected_order = np.argmax((await float_graph.embed(queries)) @ (await float_graph.embed(texts)).T, axis=1)
    assert [int(i) for i in expected_order] == [5, 6, 7, 8]


def test_the_int8_rewrite_replaces_every_weight_matmul_and_nothing_else():
    # The package's graph: 6 layers x (Q, K, V, attention output, two feed-forward) = 36 int8 weight MatMuls.
    import onnxruntime as ort

    from services.adapters.onnx_embedder import default_model_path
    from services.adapters.onnx_graph import int8_matmul_graph

    original = default_model_path().read_bytes()
    converted, count = int8_matmul_graph(original)
    assert count == 36
    session = ort.InferenceSession(converted, providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == [
        i.name for i in ort.InferenceSession(original, providers=["CPUExecutionProvider"]).get_inputs()
    ]
    # A second pass finds nothing left to convert, and returns the graph untouched.
    again, count_again = int8_matmul_graph(converted)
    assert count_again == 0 and again == converted


async def test_embed_query_matches_embed_and_caches(minilm):
    query = "what did we decide about the retention policy?"
    first = await minilm.embed_query(query)
    assert first.shape == (384,)
    np.testing.assert_allclose(first, (await minilm.embed([query]))[0], atol=1e-6)
    first[:] = 0.0  # callers may scribble on what they get: the cache must not change
    with SessionProbe(minilm) as probe:
        again = await minilm.embed_query(query)
    assert probe.runs == 0  # answered from the cache: the model did not run
    np.testing.assert_allclose(np.linalg.norm(again), 1.0, atol=1e-5)


async def test_query_cache_is_bounded(minilm, monkeypatch):
    monkeypatch.setattr(minilm, "query_cache_size", 2)
    monkeypatch.setattr(minilm, "_query_cache", type(minilm._query_cache)())
    for q in ("one", "two", "three", "two"):
        await minilm.embed_query(q)
    assert list(minilm._query_cache) == ["three", "two"]  # least recently used first


class SessionProbe:
    """The embedder's real ONNX session, instrumented: counts ``run`` calls, records the thread they run
    on, and can hold them on a ``threading.Event`` until released."""

    def __init__(self, embedder: OnnxMiniLMEmbedder, *, hold: bool = False, not_on: int | None = None) -> None:
        self.embedder, self.real = embedder, embedder._session
        self.not_on = not_on
        self.runs = 0
        self.threads: set[int] = set()
        self.niceness: list[int] = []  # each run's thread's (Linux: per thread)
        self.entered = threading.Event()
        self.release = threading.Event()
        if not hold:
            self.release.set()

    def __getattr__(self, name):
        return getattr(self.real, name)

    def run(self, *args, **kwargs):
        self.runs += 1
        self.threads.add(threading.get_ident())
        if sys.platform == "linux":
            self.niceness.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        if threading.get_ident() == self.not_on:  # holding it there would hang the loop: fail at once
            raise AssertionError("the model ran on the event loop's thread")
        self.entered.set()
        if not self.release.wait(60):
            raise AssertionError("the held model run was never released")
        return self.real.run(*args, **kwargs)

    def __enter__(self) -> "SessionProbe":
        assert self.real is not None, "warm the embedder up first"
        self.embedder._session = self
        return self

    def __exit__(self, *exc) -> None:
        self.release.set()
        self.embedder._session = self.real


@pytest.mark.skipif(sys.platform != "linux", reason="niceness is per thread on Linux only")
async def test_background_batches_yield_the_cpu_to_requests(minilm):
    """The job worker's batches run on threads of lower priority, and a request's embedding (a search query)
    runs at the process's own priority, without waiting for a batch held in the model."""
    own = os.getpriority(os.PRIO_PROCESS, 0)
    with SessionProbe(minilm, hold=True) as probe:
        with background():
            batch = asyncio.create_task(minilm.embed([words_text(40, seed=i) for i in range(4)]))
        while not probe.entered.is_set():
            assert not batch.done(), batch.result()
            await asyncio.sleep(0.001)
        assert probe.niceness == [min(19, own + BACKGROUND_NICE)]
        probe.entered.clear()
        query = asyncio.create_task(minilm.embed_query("a search while a batch is in the model " + words_text(5, seed=99)))
        while not probe.entered.is_set():
            await asyncio.sleep(0.001)
        assert probe.niceness[1] == own and not batch.done()
        probe.release.set()
        vector, vectors = await query, await batch
    assert vector.shape == (384,) and vectors.shape == (4, 384)
    np.testing.assert_allclose(vectors[0], (await minilm.embed([words_text(40, seed=0)]))[0], atol=1e-5)


_ONLY_OWN_THREADS_NICED = """
import asyncio, os, threading
from services.adapters.onnx_embedder import OnnxMiniLMEmbedder
from services.background import background

async def main():
    embedder = OnnxMiniLMEmbedder()  # kept: its threads end with it
    with background():  # the process's first embedding is background work
        await embedder.embed(["a batch of the worker"] * 12)
    niced = set()
    for tid in os.listdir(f"/proc/{os.getpid()}/task"):
        try:
            if os.getpriority(os.PRIO_PROCESS, int(tid)) != os.getpriority(os.PRIO_PROCESS, 0):
                niced.add(int(tid))
        except ProcessLookupError:  # a thread that ended meanwhile
            pass
    ours = {t.native_id for t in threading.enumerate() if t.name.startswith("memex-embed-bg")}
    print(len(niced), len(ours), niced <= ours)

asyncio.run(main())
"""


@pytest.mark.skipif(sys.platform != "linux", reason="niceness is per thread on Linux only")
def test_a_background_first_embedding_nices_only_its_own_threads():
    """Threads inherit their creator's priority. Had the worker's first batch started the model's intra-op threads or
    the tokenizer's thread pool (which a search's query uses too) from a niced thread, every later query would wait on
    low-priority threads under load. In a fresh process, only the embedder's background threads end up niced."""
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", _ONLY_OWN_THREADS_NICED], cwd=root, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(root)})
    assert done.returncode == 0, done.stderr
    niced, ours, only_ours = done.stdout.split()
    assert int(niced) >= 1 and only_ours == "True", done.stdout


async def test_embedding_does_not_block_the_event_loop(minilm):
    """While the model runs (held inside its real session), the event loop serves other coroutines."""
    loop_thread = threading.get_ident()
    with SessionProbe(minilm, hold=True, not_on=loop_thread) as probe:
        task = asyncio.create_task(minilm.embed([words_text(60, seed=i) for i in range(8)]))
        # Wait for the model to start without blocking the loop: the loop keeps turning while we poll.
        turns = 0
        while not probe.entered.is_set():
            if task.done():
                task.result()  # raises what went wrong
            turns += 1
            assert turns < 1_000_000, "the model never started"
            await asyncio.sleep(0)
        # The model is running now, and held: a loop that embedded on its own thread could not get here.
        assert loop_thread not in probe.threads
        served = await asyncio.gather(*(asyncio.sleep(0, result=i) for i in range(3)), HashEmbedder().embed(["other work"]))
        assert served[:3] == [0, 1, 2] and served[3].shape == (1, 384)
        assert not task.done()  # the embedding is still held in its thread
        probe.release.set()
        vectors = await task
    assert vectors.shape == (8, 384) and probe.runs >= 1
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)


def test_count_tokens(minilm, reference_tokenizer):
    assert minilm.count_tokens("") == 0
    assert minilm.count_tokens("hello world") == 2
    assert minilm.count_tokens("Hello, world!") == 4
    assert minilm.count_tokens("unaffable") == 3  # una ##ffa ##ble
    long_text = words_text(1000, seed=4)
    assert minilm.count_tokens(long_text) >= 1000  # not truncated
    tricky = [
        "naïve café résumé — “quotes” and ‘single’ … ellipsis",
        "Σίσυφος ΟΔΥΣΣΕΥΣ mixed with ASCII",
        "漢字かな交じり文。한국어 텍스트!",
        "tabs\tand\nnew\r\nlines\x0bvertical\x0cform\x1cfile sep\x00nul\x7fdel",
        "non\u00a0breaking\u2003em\u3000ideographic\u200bzero-width\ufeffbom",
        "https://example.com/a/b?c=d&e=f#frag user@example.org $100 50% C++ a_b",
        "a" * 99 + " " + "b" * 101 + " " + "c1" * 80,
        "🙂🙃 emoji 👩‍👩‍👧 family e\u0301 combining",
        "literal [CLS] and [MASK]ed words, [mask] and [SEP]",
        open(__file__, encoding="utf-8").read(),
    ]
    for text in tricky:
        expected = len(reference_tokenizer.encode(text, add_special_tokens=False).ids)
        assert minilm.count_tokens(text) == expected, text[:60]
        assert minilm.count_tokens(text) == expected, "memoised second count"


def test_count_tokens_is_fast(minilm, reference_tokenizer):
    """Counting ASCII text that was counted before takes the memoised fast path: the real tokenizer (the
    slow part) is not called again. (How fast that is belongs to the benchmarks, not to a wall clock here.)"""
    text = (words_text(3000, seed=5) + ". ") * 2  # ~30 KB
    expected = minilm.count_tokens(text)
    assert expected == len(reference_tokenizer.encode(text, add_special_tokens=False).ids)
    with TokenizerProbe(minilm) as probe:
        for _ in range(5):
            assert minilm.count_tokens(text) == expected
    assert probe.calls == []


class TokenizerProbe:
    """The embedder's real counting tokenizer, instrumented: records every call into it."""

    def __init__(self, embedder: OnnxMiniLMEmbedder) -> None:
        self.embedder, self.real = embedder, embedder._counter
        self.calls: list[str] = []
        probe = self

        class Model:
            def __getattr__(self, name):
                attr = getattr(probe.real.model, name)
                if callable(attr):
                    def wrapped(*a, **k):
                        probe.calls.append(f"model.{name}")
                        return attr(*a, **k)
                    return wrapped
                return attr

        self.model = Model()

    def __getattr__(self, name):
        attr = getattr(self.real, name)
        if callable(attr):
            def wrapped(*a, **k):
                self.calls.append(name)
                return attr(*a, **k)
            return wrapped
        return attr

    def __enter__(self) -> "TokenizerProbe":
        self.embedder._counter = self
        return self

    def __exit__(self, *exc) -> None:
        self.embedder._counter = self.real


# ---------------------------------------------------------------------------- HashEmbedder


async def test_hash_embedder_rows_and_protocol():
    embedder = HashEmbedder()
    assert isinstance(embedder, Embedder)
    assert (embedder.model_id, embedder.dimensions, embedder.max_tokens) == ("memex/hash-embedder-v1", 384, 256)
    vectors = await embedder.embed(["alpha beta", "", "!!!", "Ünïcödé 漢字"])
    assert vectors.shape == (4, 384) and vectors.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-6)
    assert (await embedder.embed([])).shape == (0, 384)
    assert (await HashEmbedder(dimensions=64).embed(["x"])).shape == (1, 64)


async def test_hash_embedder_similarity_and_determinism():
    a = "Remember to renew the TLS certificate for the staging cluster before Friday"
    similar = "remember to renew the TLS certificate for the staging cluster before friday!"
    near = "Renew the TLS certificate for the staging cluster before Monday"
    unrelated = "Grandma's apple pie recipe uses cinnamon and brown sugar"
    first = await HashEmbedder().embed([a, similar, near, unrelated])
    second = await HashEmbedder().embed([a])
    np.testing.assert_array_equal(first[0], second[0])  # identical text, fresh instance
    assert cos(first[0], first[1]) > 0.999  # case and punctuation do not matter
    assert cos(first[0], first[2]) > 0.6
    assert cos(first[0], first[2]) > cos(first[0], first[3]) + 0.4
    assert abs(cos(first[0], first[3])) < 0.3


def test_hash_embedder_count_tokens():
    embedder = HashEmbedder()
    assert embedder.count_tokens("") == 0
    assert embedder.count_tokens("Hello, world!") == 4
    assert embedder.count_tokens("one two  three\nfour") == 4


async def test_the_chosen_graph_is_saved_once_and_gives_the_same_vectors(tmp_path, same_graph):
    # Both graphs are built, timed and compared on the first start, and the chosen one is loaded as it was saved
    # on the next (a lower start-up memory peak, no second measurement): a user's vectors must not move.
    texts = [words_text(n, seed=n) for n in (3, 41, 300)]
    cache = tmp_path / "cache"
    first = OnnxMiniLMEmbedder(optimized_cache_dir=cache)
    got_first = await first.embed(texts)
    reference = await same_graph(first).embed(texts)
    saved = {p.name.rsplit("-", 1)[1]: p for p in cache.iterdir()}
    kept = "int8mm.onnx" if first.graph_in_use == "int8" else "basic.onnx"
    assert sorted(saved) == sorted([kept, "graph.json"])  # the chosen graph only
    assert all(p.name.startswith("minilm-") for p in saved.values())
    record = json.loads(saved["graph.json"].read_text())
    assert record["graph"] == first.graph_in_use and record["min_cosine"] >= 0.995
    stamps = {name: p.stat().st_mtime_ns for name, p in saved.items()}
    second = OnnxMiniLMEmbedder(optimized_cache_dir=cache)
    got_second = await second.embed(texts)
    assert second.graph_in_use == first.graph_in_use
    assert sorted(p.name for p in cache.iterdir()) == sorted(p.name for p in saved.values())  # no temporary left
    assert {name: p.stat().st_mtime_ns for name, p in saved.items()} == stamps  # read, not written again
    for got in (got_first, got_second):
        for a, b in zip(got, reference, strict=True):
            assert cos(a, b) > 0.99999


async def test_a_choice_made_on_another_machine_is_made_again(tmp_path, minilm):
    # A cache directory carried to another CPU (a copied volume): the graph is timed again there.
    cache = tmp_path / "cache"
    OnnxMiniLMEmbedder(optimized_cache_dir=cache).warm_up()
    (choice,) = cache.glob("*-graph.json")
    record = json.loads(choice.read_text())
    choice.write_text(json.dumps({**record, "probe_ms": {}, "machine": "another cpu"}))
    again = OnnxMiniLMEmbedder(optimized_cache_dir=cache)
    again.warm_up()
    remeasured = json.loads(choice.read_text())
    assert remeasured["machine"] == record["machine"] and remeasured["probe_ms"].keys() == {"int8", "float"}
    assert remeasured["graph"] == again.graph_in_use


async def test_a_cpu_where_int8_is_slower_keeps_the_float_graph(tmp_path, float_graph, monkeypatch):
    # Without onnxruntime's int8 kernels MatMulNBits dequantizes its weights at every run (~3x slower): there the
    # float graph must be kept. Simulated by asking int8 to be 100x faster than it can be; the timing is real.
    monkeypatch.setattr("services.adapters.onnx_embedder._INT8_SLOWER_AT_MOST", 0.01)
    cache = tmp_path / "cache"
    embedder = OnnxMiniLMEmbedder(optimized_cache_dir=cache)
    text = words_text(30, seed=4)
    vector = (await embedder.embed([text]))[0]
    assert embedder.graph_in_use == "float"
    assert cos(vector, (await float_graph.embed([text]))[0]) > 0.99999
    (choice,) = cache.glob("*-graph.json")
    assert json.loads(choice.read_text())["graph"] == "float"
    assert not list(cache.glob("*-int8mm.onnx"))  # the losing graph is not kept
    monkeypatch.undo()
    after = OnnxMiniLMEmbedder(optimized_cache_dir=cache)  # the choice holds on the next start
    after.warm_up()
    assert after.graph_in_use == "float"


async def test_the_float_graph_serves_when_the_int8_rewrite_fails(tmp_path, minilm, float_graph, monkeypatch, caplog):
    # A model whose graph the rewrite cannot handle (or an onnxruntime without MatMulNBits) still serves, on the
    # float graph, and says so.
    def broken(model_bytes):
        raise ValueError("unexpected graph")

    monkeypatch.setattr("services.adapters.onnx_graph.int8_matmul_graph", broken)
    cache = tmp_path / "cache"
    embedder = OnnxMiniLMEmbedder(optimized_cache_dir=cache)
    text = words_text(30, seed=3)
    with caplog.at_level("WARNING", logger="memex.embedder"):
        vector = (await embedder.embed([text]))[0]
    assert embedder.graph_in_use == "float" and "int8-compute graph" in caplog.text
    assert cos(vector, (await float_graph.embed([text]))[0]) > 0.99999
    assert not list(cache.glob("*-int8mm.onnx"))


@pytest.mark.parametrize(
    ("recorded", "retimed_would_pick", "damage"),
    [("int8", "float", "garbage"), ("float", "int8", "missing")],
)
async def test_a_damaged_optimised_model_is_rebuilt_as_the_graph_recorded(
    tmp_path, same_graph, monkeypatch, recorded, retimed_would_pick, damage
):
    # A cached graph that is damaged (a torn copy) or gone (a cleaned cache) is built again, and it is the graph
    # recorded for this machine, not a new timing's pick: the two graphs' vectors differ slightly, and stored
    # vectors and new query vectors must come from one graph. The timing is steered to the other graph, so a
    # rebuild that timed again would be seen.
    cache = tmp_path / "cache"
    OnnxMiniLMEmbedder(optimized_cache_dir=cache).warm_up()
    (choice,) = cache.glob("*-graph.json")
    record = {**json.loads(choice.read_text()), "graph": recorded, "probe_ms": {"int8": 1.0, "float": 1.0}}
    choice.write_text(json.dumps(record))
    stem = choice.name.removesuffix("-graph.json")
    for leftover in cache.glob("*.onnx"):
        leftover.unlink()
    saved = cache / f"{stem}-{'int8mm' if recorded == 'int8' else 'basic'}.onnx"
    if damage == "garbage":
        saved.write_bytes(b"not a model")
    monkeypatch.setattr(
        "services.adapters.onnx_embedder._INT8_SLOWER_AT_MOST", 0.01 if retimed_would_pick == "float" else 100.0
    )
    healed = OnnxMiniLMEmbedder(optimized_cache_dir=cache)
    text = words_text(50, seed=5)
    vector = (await healed.embed([text]))[0]
    assert healed.graph_in_use == recorded
    assert cos(vector, (await same_graph(healed).embed([text]))[0]) > 0.99999
    assert json.loads(choice.read_text()) == record  # not timed again
    assert saved.stat().st_size > 1_000_000  # built and saved again
    again = OnnxMiniLMEmbedder(optimized_cache_dir=cache)  # and loaded as saved on the next start
    again.warm_up()
    assert again.graph_in_use == recorded


async def test_an_unwritable_cache_directory_still_serves(tmp_path, same_graph):
    blocker = tmp_path / "cache"
    blocker.write_text("a file where the directory would go")
    embedder = OnnxMiniLMEmbedder(optimized_cache_dir=blocker)
    text = words_text(20, seed=2)
    vector = (await embedder.embed([text]))[0]
    assert cos(vector, (await same_graph(embedder).embed([text]))[0]) > 0.99999


def test_the_service_keeps_the_optimised_model_in_the_users_cache_directory(tmp_path, monkeypatch):
    from api.composition.backend import embedder_for, model_cache_dir
    from api.settings import Settings

    settings = Settings(data_dir=tmp_path / "data")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert model_cache_dir(settings) == tmp_path / "xdg" / "memex"
    assert embedder_for(settings, None)._optimized_cache_dir == tmp_path / "xdg" / "memex"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert model_cache_dir(settings) == tmp_path / "home" / ".cache" / "memex"
    monkeypatch.delenv("HOME")
    monkeypatch.setattr("pathlib.Path.home", lambda: (_ for _ in ()).throw(RuntimeError("no home directory")))
    assert model_cache_dir(settings) == tmp_path / "data" / "cache"
