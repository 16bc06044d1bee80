"""LocalVectorIndex: exact cosine search with Vectorize semantics, namespaces, filters, durability."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from services.adapters.local_vectors import LocalVectorIndex
from services.errors import EmbeddingModelMismatch, InvalidInput
from services.ports import Vector, VectorIndex

DIMS = 8
MODEL = "test-model"


def unit(*xs: float) -> np.ndarray:
    v = np.zeros(DIMS, dtype=np.float32)
    v[: len(xs)] = xs
    return v / np.linalg.norm(v)


def e(i: int) -> np.ndarray:
    v = np.zeros(DIMS, dtype=np.float32)
    v[i] = 1.0
    return v


@pytest.fixture
async def index():
    idx = LocalVectorIndex(None, dimensions=DIMS, model=MODEL)
    yield idx
    await idx.close()


async def ids_of(idx, vec, ns="A", top_k=10, **kw) -> list[str]:
    return [m.id for m in await idx.query(vec, top_k=top_k, namespace=ns, **kw)]


async def test_satisfies_the_port(index):
    assert isinstance(index, VectorIndex)
    assert index.dimensions == DIMS


# -- ordering --------------------------------------------------------------------------------------


async def test_nearest_first_with_exact_cosine(index):
    q = unit(1, 0)
    await index.upsert(
        [
            Vector("far", unit(0, 1), "A"),
            Vector("near", unit(1, 0.1), "A"),
            Vector("mid", unit(1, 1), "A"),
            Vector("opposite", unit(-1, 0), "A"),
        ]
    )
    matches = await index.query(q, top_k=4, namespace="A")
    assert [m.id for m in matches] == ["near", "mid", "far", "opposite"]
    expected = {"near": 1 / np.sqrt(1.01), "mid": 1 / np.sqrt(2), "far": 0.0, "opposite": -1.0}
    for m in matches:
        assert m.score == pytest.approx(expected[m.id], abs=1e-6)
        assert m.namespace == "A"
        assert m.metadata is None and m.values is None


async def test_scale_does_not_matter_values_are_normalised(index):
    await index.upsert([Vector("a", [3, 4, 0, 0, 0, 0, 0, 0], "A")])
    (m,) = await index.query([30, 40, 0, 0, 0, 0, 0, 0], top_k=1, namespace="A", return_values=True)
    assert m.score == pytest.approx(1.0, abs=1e-6)
    assert np.allclose(m.values, [0.6, 0.8, 0, 0, 0, 0, 0, 0], atol=1e-6)
    (v,) = await index.get_by_ids(["a"])
    assert np.linalg.norm(np.asarray(v.values)) == pytest.approx(1.0, abs=1e-6)


async def test_top_k_limits_results_and_keeps_the_best(index):
    rng = np.random.default_rng(1)
    vecs = rng.normal(size=(300, DIMS)).astype(np.float32)
    await index.upsert([Vector(f"v{i}", vecs[i], "A") for i in range(300)])
    q = rng.normal(size=DIMS).astype(np.float32)
    unitv = vecs / np.linalg.norm(vecs, axis=1, keepdims=True)
    truth = [f"v{i}" for i in np.argsort(-(unitv @ (q / np.linalg.norm(q))))[:7]]
    assert await ids_of(index, q, top_k=7) == truth


async def test_top_k_bounds(index):
    await index.upsert([Vector("a", e(0), "A")])
    for bad in (0, -1, 101, True, 2.5):
        with pytest.raises(InvalidInput):
            await index.query(e(0), top_k=bad, namespace="A")
    assert await ids_of(index, e(0), top_k=1) == ["a"]
    assert await ids_of(index, e(0), top_k=100) == ["a"]


async def test_empty_or_unknown_namespace_returns_nothing(index):
    assert await index.query(e(0), top_k=5, namespace="nobody") == []


# -- namespaces ------------------------------------------------------------------------------------


async def test_namespace_isolation_even_for_the_exact_vector(index):
    await index.upsert([Vector("a1", e(0), "A"), Vector("b1", e(1), "B"), Vector("b2", unit(1, 1), "B")])
    # B's exact vector, asked in A: only A's vector comes back
    assert await ids_of(index, e(1), "A", top_k=100) == ["a1"]
    assert await ids_of(index, e(0), "B", top_k=100) == ["b2", "b1"]
    # a filter that B's vectors would pass does not widen the scope
    assert await ids_of(index, e(1), "A", top_k=100, filter={"x": {"$ne": 1}}) == ["a1"]


async def test_preload_then_query(index):
    await index.upsert([Vector("a", e(0), "A"), Vector("b", e(1), "A"), Vector("c", e(1), "B")])
    assert await index.preload("A") == 2
    assert await index.preload("A") == 2
    assert await index.preload("empty") == 0
    assert await ids_of(index, e(1), "A") == ["b", "a"]


async def test_upsert_into_a_namespace_already_loaded_is_visible(index):
    assert await index.query(e(0), top_k=5, namespace="A") == []  # loads A (empty)
    await index.upsert([Vector("a", e(0), "A")])
    assert await ids_of(index, e(0)) == ["a"]


async def test_ids_in_namespace_and_delete_namespace(index):
    await index.upsert([Vector("a1", e(0), "A"), Vector("a2", e(1), "A"), Vector("b1", e(0), "B")])
    assert await index.ids_in_namespace("A") == {"a1", "a2"}  # unloaded: read from the store
    await ids_of(index, e(0), "A")
    assert await index.ids_in_namespace("A") == {"a1", "a2"}  # loaded: read from memory
    await index.delete_namespace("A")
    assert await index.ids_in_namespace("A") == set()
    assert await index.query(e(0), top_k=5, namespace="A") == []
    assert await ids_of(index, e(0), "B") == ["b1"]
    assert [v.id for v in await index.get_by_ids(["a1", "a2", "b1"])] == ["b1"]


# -- filters ---------------------------------------------------------------------------------------


@pytest.fixture
async def catalogue(index):
    # same direction for all, so the filter alone decides membership; scores break ties by distance
    items = {
        "n1": {"kind": "note", "n": 1, "tags": ["x", "y"], "flag": True},
        "n2": {"kind": "note", "n": 2, "tags": ["y"], "flag": False},
        "t3": {"kind": "task", "n": 3, "tags": [], "name": "beta"},
        "t4": {"kind": "task", "n": 4.5, "name": "alpha"},
        "bare": {},
    }
    await index.upsert(
        [Vector(vid, unit(1, 0.01 * k), "A", meta) for k, (vid, meta) in enumerate(items.items())]
    )
    return index


async def matching(idx, flt) -> set[str]:
    return {m.id for m in await idx.query(e(0), top_k=100, namespace="A", filter=flt)}


@pytest.mark.parametrize(
    ("flt", "expected"),
    [
        ({"kind": "note"}, {"n1", "n2"}),  # bare value = $eq
        ({"kind": {"$eq": "task"}}, {"t3", "t4"}),
        ({"kind": {"$ne": "note"}}, {"t3", "t4", "bare"}),  # missing key matches $ne
        ({"kind": {"$in": ["note", "other"]}}, {"n1", "n2"}),
        ({"kind": {"$nin": ["note"]}}, {"t3", "t4", "bare"}),  # missing key matches $nin
        ({"n": {"$lt": 2}}, {"n1"}),
        ({"n": {"$lte": 2}}, {"n1", "n2"}),
        ({"n": {"$gt": 3}}, {"t4"}),
        ({"n": {"$gte": 3}}, {"t3", "t4"}),
        ({"n": {"$gte": 2, "$lt": 4}}, {"n2", "t3"}),
        ({"n": {"$eq": 4.5}}, {"t4"}),
        ({"n": {"$eq": 1.0}}, {"n1"}),  # 1 == 1.0
        ({"name": {"$lt": "b"}}, {"t4"}),  # strings compare lexicographically
        ({"name": {"$gte": "alpha"}}, {"t3", "t4"}),
        ({"n": {"$lt": "z"}}, set()),  # a string bound never matches numbers
        ({"flag": True}, {"n1"}),
        ({"flag": {"$ne": True}}, {"n2", "t3", "t4", "bare"}),
        ({"n": {"$eq": True}}, set()),  # booleans are not numbers
        ({"kind": "note", "n": {"$gt": 1}}, {"n2"}),  # keys are ANDed
        ({"missing": "x"}, set()),  # missing key fails $eq
        ({"missing": {"$in": ["x"]}}, set()),
        ({"missing": {"$lt": 5}}, set()),
        ({"missing": {"$ne": "x"}}, {"n1", "n2", "t3", "t4", "bare"}),
        # list metadata: $eq/$in match if any element matches; $ne/$nin if none does
        ({"tags": "x"}, {"n1"}),
        ({"tags": {"$eq": "y"}}, {"n1", "n2"}),
        ({"tags": {"$in": ["x", "z"]}}, {"n1"}),
        ({"tags": {"$ne": "x"}}, {"n2", "t3", "t4", "bare"}),
        ({"tags": {"$nin": ["y"]}}, {"t3", "t4", "bare"}),
        ({}, {"n1", "n2", "t3", "t4", "bare"}),
        (None, {"n1", "n2", "t3", "t4", "bare"}),
    ],
)
async def test_filter_operators(catalogue, flt, expected):
    assert await matching(catalogue, flt) == expected


async def test_filter_nested_keys_use_dots(index):
    await index.upsert([Vector("a", e(0), "A", {"src": {"app": "cli"}}), Vector("b", e(0), "A", {"src": {"app": "web"}})])
    assert await matching(index, {"src.app": "cli"}) == {"a"}


@pytest.mark.parametrize(
    "flt",
    [
        {"kind": {"$regex": "x"}},
        {"kind": {"$in": "note"}},
        {"kind": {}},
        {"$kind": 1},
        {"n": {"$lt": True}},
        {"n": {"$gt": [1]}},
        {"kind": {"$eq": {"a": 1}}},
        {"kind": {"$in": ["x" * 3000]}},  # compact JSON must stay under 2048 bytes
    ],
)
async def test_invalid_filters_are_rejected(catalogue, flt):
    with pytest.raises(InvalidInput):
        await catalogue.query(e(0), top_k=5, namespace="A", filter=flt)


async def test_filter_is_applied_before_top_k(index):
    # the 500 nearest vectors are all "noise"; the two "signal" ones are the farthest
    vecs = [Vector(f"noise{i}", unit(1, 0.001 * i), "A", {"kind": "noise"}) for i in range(500)]
    vecs += [Vector("s1", unit(0, 1), "A", {"kind": "signal"}), Vector("s2", unit(-1, 0.1), "A", {"kind": "signal"})]
    await index.upsert(vecs)
    assert await ids_of(index, e(0), top_k=2, filter={"kind": "signal"}) == ["s1", "s2"]
    assert await ids_of(index, e(0), top_k=5, filter={"kind": "signal"}) == ["s1", "s2"]
    got = await ids_of(index, e(0), top_k=3, filter={"kind": {"$ne": "signal"}})
    assert got == ["noise0", "noise1", "noise2"]


async def test_filtered_results_match_brute_force(index):
    rng = np.random.default_rng(7)
    n = 2000
    vecs = rng.normal(size=(n, DIMS)).astype(np.float32)
    kinds = rng.integers(0, 50, size=n)
    await index.upsert([Vector(f"v{i}", vecs[i], "A", {"k": int(kinds[i])}) for i in range(n)])
    unitv = vecs / np.linalg.norm(vecs, axis=1, keepdims=True)
    for _ in range(5):
        q = rng.normal(size=DIMS).astype(np.float32)
        scores = unitv @ (q / np.linalg.norm(q))
        for flt, mask in (({"k": 3}, kinds == 3), ({"k": {"$lt": 40}}, kinds < 40)):
            idx = np.flatnonzero(mask)
            truth = [f"v{i}" for i in idx[np.argsort(-scores[idx])][:20]]
            assert await ids_of(index, q, top_k=20, filter=flt) == truth


class _Mirror:
    """What an index should hold (unit vectors and metadata by id), written through to it."""

    def __init__(self, index) -> None:
        self.index, self.vecs, self.meta = index, {}, {}

    async def put(self, items) -> None:
        await self.index.upsert([Vector(vid, v, "A", m) for vid, v, m in items])
        for vid, v, m in items:
            self.vecs[vid], self.meta[vid] = v / np.linalg.norm(v), m

    async def delete(self, ids) -> None:
        await self.index.delete_by_ids(ids)
        for vid in ids:
            self.vecs.pop(vid), self.meta.pop(vid)

    def best(self, q, passes, top_k: int) -> list[str]:
        """The ids the filter ``passes``, by exact cosine to ``q``, the first ``top_k``."""
        qn = q / np.linalg.norm(q)
        ok = [vid for vid in self.vecs if passes(self.meta[vid])]
        ok.sort(key=lambda vid: -float(self.vecs[vid] @ qn))
        return ok[:top_k]


async def test_a_rare_filter_stays_exact_through_writes(index):
    """A filter few rows pass is remembered per namespace (a mask) after its first search; upserts that change
    a row's verdict, new rows, deletes (swap-remove) and the matrix growing and shrinking must keep it exact."""
    rng = np.random.default_rng(11)
    truth = _Mirror(index)
    put = truth.put

    async def check(flt, want):
        for _ in range(3):
            q = rng.normal(size=DIMS).astype(np.float32)
            assert await ids_of(index, q, top_k=10, filter=flt) == truth.best(q, want, 10)

    rare = {"kind": {"$in": ["turn", "conversation"]}}
    want = lambda m: m["kind"] in ("turn", "conversation")  # noqa: E731
    await put([(f"v{i}", rng.normal(size=DIMS).astype(np.float32),
                {"kind": "conversation" if i % 100 == 0 else "thought"}) for i in range(3000)])
    await check(rare, want)  # 1%: the first search builds the mask
    await put([(f"v{i}", rng.normal(size=DIMS).astype(np.float32), {"kind": "turn"}) for i in range(1, 40, 3)])
    await put([(f"v{i}", rng.normal(size=DIMS).astype(np.float32), {"kind": "thought"}) for i in range(0, 1000, 200)])
    await put([(f"new{i}", rng.normal(size=DIMS).astype(np.float32), {"kind": "turn" if i % 2 else "x"})
               for i in range(3000)])  # the matrix grows
    await check(rare, want)
    await truth.delete([f"v{i}" for i in range(0, 3000, 3)] + [f"new{i}" for i in range(0, 3000, 2)])
    await check(rare, want)
    await truth.delete(list(truth.vecs)[50:])  # the matrix shrinks
    await check(rare, want)
    await check({"kind": "x"}, lambda m: m["kind"] == "x")
    for i in range(12):  # more filters than a namespace remembers: the oldest are dropped, answers stay exact
        await check({"kind": {"$ne": f"k{i}"}}, lambda m: True)
    await check(rare, want)


@pytest.mark.parametrize("int8_pass", [False, True], ids=["float-scan", "int8-pass"])
async def test_a_common_filter_stays_exact_through_writes(index, monkeypatch, int8_pass):
    """A filter most rows pass (the search's own: a ``kind``) keeps each row's verdict once asked, so that later
    searches do not ask again: a row whose metadata an upsert changes, new rows, deletes (swap-remove) and the
    matrix growing and shrinking must keep the answers exact, on the float scan and behind the int8 pass."""
    import services.adapters.vector_matrix as matrix

    if int8_pass:
        monkeypatch.setattr(matrix, "QUANTIZED_MIN_ROWS", 1)
    rng = np.random.default_rng(12)
    truth = _Mirror(index)
    put = truth.put
    queries = [rng.normal(size=DIMS).astype(np.float32) for _ in range(6)]

    async def check(top_k=10):
        for q in queries:  # the same queries each time: their rows have verdicts from the searches before
            want = truth.best(q, lambda m: m["kind"] == "thought", top_k)
            assert await ids_of(index, q, top_k=top_k, filter={"kind": {"$in": ["thought"]}}) == want

    await put([(f"v{i}", rng.normal(size=DIMS).astype(np.float32), {"kind": "turn" if i % 20 == 0 else "thought"})
               for i in range(2000)])
    await check()
    # the best rows of each query stop passing: their remembered verdicts must follow
    best = {vid for q in queries for vid in await ids_of(index, q, top_k=10, filter={"kind": {"$in": ["thought"]}})}
    await put([(vid, truth.vecs[vid], {"kind": "turn"}) for vid in best])
    await check()
    await put([(vid, truth.vecs[vid], {"kind": "thought"}) for vid in list(best)[::2]])  # and pass again
    await check()
    await put([(f"new{i}", rng.normal(size=DIMS).astype(np.float32), {"kind": "thought" if i % 3 else "turn"})
               for i in range(2500)])  # the matrix grows
    await check()
    await truth.delete([f"v{i}" for i in range(0, 2000, 3)] + [f"new{i}" for i in range(0, 2500, 2)])
    await check()
    await truth.delete(list(truth.vecs)[60:])  # the matrix shrinks
    await check()
    await check(top_k=50)  # more than pass: every one that does


async def test_metadata_is_returned_on_request_and_is_a_copy(index):
    await index.upsert([Vector("a", e(0), "A", {"tags": ["x"], "kind": "note"})])
    (m,) = await index.query(e(0), top_k=1, namespace="A", return_metadata=True)
    assert m.metadata == {"tags": ["x"], "kind": "note"}
    m.metadata["tags"].append("evil")
    (m2,) = await index.query(e(0), top_k=1, namespace="A", return_metadata=True, filter={"tags": {"$nin": ["evil"]}})
    assert m2.metadata == {"tags": ["x"], "kind": "note"}


# -- upsert / get / delete -------------------------------------------------------------------------


async def test_upsert_replaces_values_metadata_and_namespace(index):
    await index.upsert([Vector("v", e(0), "A", {"kind": "note", "old": 1})])
    await ids_of(index, e(0), "A")  # make sure A is loaded, so the in-memory copy must follow
    await index.upsert([Vector("v", e(1), "A", {"kind": "task"})])
    (m,) = await index.query(e(1), top_k=5, namespace="A", return_metadata=True)
    assert (m.id, m.metadata) == ("v", {"kind": "task"})  # no merge: "old" is gone
    assert m.score == pytest.approx(1.0, abs=1e-6)
    assert await matching(index, {"kind": "note"}) == set()

    await ids_of(index, e(0), "B")  # load B too
    await index.upsert([Vector("v", e(2), "B", {"kind": "moved"})])
    assert await index.query(e(2), top_k=5, namespace="A") == []
    assert await ids_of(index, e(2), "B") == ["v"]
    (got,) = await index.get_by_ids(["v"])
    assert got.namespace == "B" and dict(got.metadata) == {"kind": "moved"}
    assert np.allclose(got.values, e(2))
    assert (await index.info()).vector_count == 1


async def test_namespace_move_into_an_unloaded_namespace(index):
    await index.upsert([Vector("v", e(0), "A")])
    await ids_of(index, e(0), "A")
    await index.upsert([Vector("v", e(0), "C")])  # C never queried yet
    assert await index.query(e(0), top_k=5, namespace="A") == []
    assert await ids_of(index, e(0), "C") == ["v"]


async def test_repeated_id_in_one_upsert_keeps_the_last(index):
    await index.upsert([Vector("v", e(0), "A", {"n": 1}), Vector("v", e(1), "A", {"n": 2})])
    (got,) = await index.get_by_ids(["v"])
    assert got.metadata == {"n": 2} and np.allclose(got.values, e(1))


async def test_get_by_ids_includes_namespace_metadata_and_omits_unknown(index):
    await index.upsert([Vector("a", e(0), "A", {"k": 1}), Vector("b", e(1), "B")])
    got = await index.get_by_ids(["b", "nope", "a"])
    assert [(v.id, v.namespace, dict(v.metadata)) for v in got] == [("b", "B", {}), ("a", "A", {"k": 1})]
    assert isinstance(got[0].values, np.ndarray) and got[0].values.dtype == np.float32
    assert await index.get_by_ids([]) == []


async def test_delete_removes_from_results_and_get_by_ids(index):
    await index.upsert([Vector(f"v{i}", unit(1, 0.1 * i), "A") for i in range(5)])
    await ids_of(index, e(0))  # loaded
    await index.upsert([Vector("w", e(0), "B")])  # B not loaded
    mid = await index.delete_by_ids(["v0", "v3", "w", "unknown"])
    assert mid is not None
    assert await ids_of(index, e(0)) == ["v1", "v2", "v4"]
    assert await index.query(e(0), top_k=5, namespace="B") == []
    assert [v.id for v in await index.get_by_ids(["v0", "v1", "w"])] == ["v1"]
    assert (await index.info()).vector_count == 3


async def test_swap_remove_keeps_every_row_correct(index):
    rng = np.random.default_rng(3)
    vecs = {f"v{i}": rng.normal(size=DIMS).astype(np.float32) for i in range(100)}
    await index.upsert([Vector(k, v, "A", {"id": k}) for k, v in vecs.items()])
    await ids_of(index, e(0))
    gone = [f"v{i}" for i in range(0, 100, 3)]
    await index.delete_by_ids(gone)
    for k in gone:
        vecs.pop(k)
    for k, v in vecs.items():  # each survivor is its own nearest neighbour, with its own metadata
        (m,) = await index.query(v, top_k=1, namespace="A", return_metadata=True)
        assert (m.id, m.metadata["id"]) == (k, k)
        assert m.score == pytest.approx(1.0, abs=1e-5)


async def test_growth_beyond_initial_capacity(index):
    await ids_of(index, e(0))  # load empty namespace, then grow it by appends
    rng = np.random.default_rng(4)
    for batch in range(10):
        await index.upsert([Vector(f"b{batch}-{i}", rng.normal(size=DIMS), "A") for i in range(37)])
    assert len(await index.ids_in_namespace("A")) == 370
    got = await index.get_by_ids(["b9-36"])
    (m,) = await index.query(got[0].values, top_k=1, namespace="A")
    assert m.id == "b9-36"


@pytest.mark.parametrize(
    "bad",
    [
        Vector("a", np.ones(DIMS - 1), "A"),
        Vector("a", np.ones(DIMS + 1), "A"),
        Vector("a", np.ones((2, DIMS)), "A"),
        Vector("a", np.zeros(DIMS), "A"),
        Vector("a", [float("nan")] * DIMS, "A"),
        Vector("", np.ones(DIMS), "A"),
        Vector("x" * 65, np.ones(DIMS), "A"),
        Vector("a", np.ones(DIMS), ""),
        Vector("a", np.ones(DIMS), "n" * 65),
        Vector("a", np.ones(DIMS), "A", {"big": "x" * 11000}),
        Vector("a", np.ones(DIMS), "A", {"obj": object()}),
    ],
)
async def test_invalid_upserts_raise_and_write_nothing(index, bad):
    with pytest.raises(InvalidInput):
        await index.upsert([Vector("ok", np.ones(DIMS), "A"), bad])
    assert await index.get_by_ids(["ok", "a"]) == []
    assert (await index.info()).vector_count == 0


async def test_query_vector_dimension_is_checked(index):
    for bad in (np.ones(DIMS - 1), np.ones(DIMS + 1), np.zeros(DIMS)):
        with pytest.raises(InvalidInput):
            await index.query(bad, top_k=1, namespace="A")


async def test_mutation_ids_are_monotonic_and_info_reports_them(index):
    info = await index.info()
    assert (info.dimensions, info.vector_count, info.model, info.processed_up_to_mutation) == (DIMS, 0, MODEL, None)
    m1 = await index.upsert([Vector("a", e(0), "A")])
    m2 = await index.upsert([Vector("b", e(1), "B")])
    m3 = await index.delete_by_ids(["a"])
    assert int(m1) < int(m2) < int(m3)
    info = await index.info()
    assert info.processed_up_to_mutation == m3 and info.vector_count == 1


async def test_concurrent_upserts_and_queries(index):
    rng = np.random.default_rng(5)

    async def writer(w: int) -> None:
        for b in range(10):
            await index.upsert([Vector(f"w{w}-{b}-{i}", rng.normal(size=DIMS), "A") for i in range(20)])

    async def reader() -> None:
        for _ in range(50):
            await index.query(rng.normal(size=DIMS), top_k=10, namespace="A", filter={"x": {"$ne": 1}})
            await asyncio.sleep(0)

    await asyncio.gather(*(writer(w) for w in range(4)), *(reader() for _ in range(4)))
    assert len(await index.ids_in_namespace("A")) == 800
    assert (await index.info()).vector_count == 800


async def test_big_namespace_code_paths_give_the_same_answers(index, monkeypatch):
    import services.adapters.local_vectors as mod
    import services.adapters.vector_matrix as matrix

    rng = np.random.default_rng(8)
    vecs = rng.normal(size=(500, DIMS)).astype(np.float32)
    await index.upsert([Vector(f"v{i}", vecs[i], "A", {"k": i % 5}) for i in range(500)])
    queries = rng.normal(size=(5, DIMS))
    small = [await index.query(q, top_k=20, namespace="A", filter={"k": {"$gte": 3}}) for q in queries]
    # as if the namespace were big: searched in a worker thread, scored with einsum instead of BLAS
    monkeypatch.setattr(mod, "INLINE_QUERY_MAX_FLOATS", 0)
    monkeypatch.setattr(matrix, "_BLAS_MAX_FLOATS", 0)
    big = [await index.query(q, top_k=20, namespace="A", filter={"k": {"$gte": 3}}) for q in queries]
    for a, b in zip(small, big, strict=True):
        assert [m.id for m in a] == [m.id for m in b]
        assert [m.score for m in a] == pytest.approx([m.score for m in b], abs=1e-6)


def test_the_int8_pass_keeps_the_best_candidates_whatever_its_sample_reads():
    """The int8 pass keeps its ``c`` best-scored rows by a threshold read off a sample of the scores: the rows it
    keeps must be the ``c`` best of all (as a multiset of scores, each row once), when the sample is typical, when
    it holds the very best rows (too few reach its threshold: the whole array is partitioned), with ties, and
    for every size up to a few samples."""
    from services.adapters.vector_matrix import _SAMPLE_STEP, _best

    rng = np.random.default_rng(11)
    cases = [rng.standard_normal(m).astype(np.float32) for m in (1, 2, 63, 64, 65, 300, 301, 1000, 20_000)]
    cases.append(np.round(rng.standard_normal(20_000), 1).astype(np.float32))  # many ties
    sampled_best = rng.standard_normal(20_000).astype(np.float32)
    sampled_best[::_SAMPLE_STEP] += 100.0  # every row the sample reads is among the best
    cases.append(sampled_best)
    cases.append(np.ones(5_000, dtype=np.float32))  # all equal
    for values in cases:
        for c in {1, 7, 300, len(values) - 1, len(values)}:
            if not 1 <= c <= len(values):
                continue
            got = _best(values, c)
            assert len(got) == c and len(set(got.tolist())) == c
            assert np.array_equal(np.sort(values[got]), np.sort(values)[len(values) - c :])


async def test_the_int8_first_pass_finds_the_exact_answer(monkeypatch):
    """Big namespaces rank candidates by their int8 copies, then score those exactly: the results (ids, order and
    scores) must be the float32 scan's, unfiltered, under a filter most rows pass, under a rare one (a mask),
    and after writes that change rows (the int8 copy follows every upsert, move and delete)."""
    import services.adapters.vector_matrix as matrix

    dims = 64
    rng = np.random.default_rng(9)
    centres = rng.normal(size=(20, dims)).astype(np.float32)
    vecs = rng.normal(size=(3000, dims)).astype(np.float32)
    vecs[:1500] = centres[rng.integers(0, 20, size=1500)] + 0.3 * rng.normal(size=(1500, dims)).astype(np.float32)
    meta = [{"k": "rare" if i % 50 == 0 else "common"} for i in range(3000)]

    async def answers(idx, queries):
        out = []
        for q in queries:
            for flt in (None, {"k": "common"}, {"k": "rare"}):
                for k in (1, 10, 100):
                    got = await idx.query(q, top_k=k, namespace="A", filter=flt)
                    out.append([(m.id, round(m.score, 5)) for m in got])
        return out

    exact = LocalVectorIndex(None, dimensions=dims, model=MODEL)
    quant = LocalVectorIndex(None, dimensions=dims, model=MODEL)
    try:
        queries = np.concatenate([centres + 0.3 * rng.normal(size=(20, dims)).astype(np.float32),
                                  vecs[3:3000:97], vecs[2800:3000:9]])  # rows themselves (the last ones move on delete)
        for idx in (exact, quant):
            await idx.upsert([Vector(f"v{i}", vecs[i], "A", meta[i]) for i in range(3000)])
            await idx.query(vecs[0], top_k=1, namespace="A")  # loaded: the writes below change it in memory
            await idx.upsert([Vector(f"v{i}", -vecs[i], "A", {"k": "rare"}) for i in range(0, 3000, 7)])
            await idx.upsert([Vector(f"v{i}", vecs[i], "B", {}) for i in range(1, 3000, 11)])  # moved away
            await idx.delete_by_ids([f"v{i}" for i in range(2, 3000, 13)])
        want = await answers(exact, queries)
        monkeypatch.setattr(matrix, "QUANTIZED_MIN_ROWS", 1)
        assert await answers(quant, queries) == want
    finally:
        await exact.close()
        await quant.close()


# -- durability and model identity ------------------------------------------------------------------


async def test_durable_across_close_and_reopen(tmp_path):
    path = tmp_path / "sub" / "vectors.sqlite3"
    idx = LocalVectorIndex(path, dimensions=DIMS, model=MODEL)
    assert idx.was_created and not idx.was_reset
    rng = np.random.default_rng(6)
    vecs = [Vector(f"v{i}", rng.normal(size=DIMS), "A" if i % 2 else "B", {"i": i}) for i in range(50)]
    await idx.upsert(vecs)
    await idx.delete_by_ids(["v1"])
    await idx.upsert([Vector("v3", e(0), "B", {"moved": True})])
    q = rng.normal(size=DIMS)
    before = {ns: await idx.query(q, top_k=10, namespace=ns, return_metadata=True) for ns in "AB"}
    last_mutation = (await idx.info()).processed_up_to_mutation
    await idx.close()

    again = LocalVectorIndex(path, dimensions=DIMS, model=MODEL)
    assert not again.was_created and not again.was_reset
    after = {ns: await again.query(q, top_k=10, namespace=ns, return_metadata=True) for ns in "AB"}
    assert [(m.id, m.metadata) for m in after["A"]] == [(m.id, m.metadata) for m in before["A"]]
    assert [(m.id, m.metadata) for m in after["B"]] == [(m.id, m.metadata) for m in before["B"]]
    for x, y in zip(after["A"] + after["B"], before["A"] + before["B"], strict=True):
        assert x.score == pytest.approx(y.score, abs=1e-6)
    info = await again.info()
    assert info.vector_count == 49 and info.processed_up_to_mutation == last_mutation
    assert int(await again.delete_by_ids(["v5"])) > int(last_mutation)  # the counter survives restarts
    await again.close()


async def test_model_or_dimension_mismatch_raises(tmp_path):
    path = tmp_path / "vectors.sqlite3"
    idx = LocalVectorIndex(path, dimensions=DIMS, model=MODEL)
    await idx.upsert([Vector("a", e(0), "A")])
    await idx.close()
    with pytest.raises(EmbeddingModelMismatch):
        LocalVectorIndex(path, dimensions=DIMS, model="other-model")
    with pytest.raises(EmbeddingModelMismatch):
        LocalVectorIndex(path, dimensions=DIMS * 2, model=MODEL)
    # the refused opens changed nothing
    idx = LocalVectorIndex(path, dimensions=DIMS, model=MODEL)
    assert [v.id for v in await idx.get_by_ids(["a"])] == ["a"]
    await idx.close()


async def test_reset_on_mismatch_wipes_and_reports(tmp_path):
    path = tmp_path / "vectors.sqlite3"
    idx = LocalVectorIndex(path, dimensions=DIMS, model=MODEL)
    await idx.upsert([Vector("a", e(0), "A")])
    await idx.close()

    new = LocalVectorIndex(path, dimensions=4, model="other-model", reset_on_mismatch=True)
    assert new.was_reset
    info = await new.info()
    assert (info.vector_count, info.dimensions, info.model) == (0, 4, "other-model")
    assert await new.query(np.ones(4), top_k=5, namespace="A") == []
    await new.upsert([Vector("b", np.ones(4), "A")])
    await new.close()

    # the new identity is recorded: reopening with it is clean, the old one now mismatches
    same = LocalVectorIndex(path, dimensions=4, model="other-model", reset_on_mismatch=True)
    assert not same.was_reset and not same.was_created
    assert [v.id for v in await same.get_by_ids(["b"])] == ["b"]
    await same.close()
    with pytest.raises(EmbeddingModelMismatch):
        LocalVectorIndex(path, dimensions=DIMS, model=MODEL)


async def test_a_predictable_search_runs_on_the_loop_and_a_busy_namespace_waits_in_a_thread(index, monkeypatch):
    """Between the two thresholds a namespace is searched on the event loop only when that is quick and cannot wait:
    its filter's verdicts are kept (the first search with a filter judges rows, in a thread) and no writer holds it.
    A namespace whose lock is held is searched in a thread, so the loop keeps serving meanwhile; the answers are
    the same either way."""
    import services.adapters.local_vectors as lv

    monkeypatch.setattr(lv, "INLINE_QUERY_MAX_FLOATS", 0)
    monkeypatch.setattr(lv, "INLINE_PREDICTABLE_MAX_FLOATS", 10**9)
    rng = np.random.default_rng(3)
    await index.upsert([Vector(id=f"v{i}", values=rng.normal(size=DIMS).astype(np.float32), namespace="A",
                               metadata={"kind": "thought" if i % 4 else "turn"}) for i in range(500)])
    q = rng.normal(size=DIMS).astype(np.float32)
    await ids_of(index, q)  # the namespace loaded (in a thread)
    hops: list[str] = []
    real = asyncio.to_thread

    async def counted(fn, *args):
        hops.append(getattr(fn, "__name__", "?"))
        return await real(fn, *args)

    monkeypatch.setattr(lv.asyncio, "to_thread", counted)
    flt = {"kind": {"$in": ["thought"]}}
    first = await ids_of(index, q, filter=flt)
    assert hops == ["search_locked"]  # a filter not seen before: in a thread
    assert await ids_of(index, q, filter=flt) == first and hops == ["search_locked"]  # then on the loop
    assert await ids_of(index, q) == await ids_of(index, q) and hops == ["search_locked"]  # no filter: on the loop

    space = index._spaces["A"]
    space.lock.acquire()  # a writer holds the namespace
    try:
        task = asyncio.ensure_future(ids_of(index, q, filter=flt))
        for _ in range(20):  # the loop is not blocked: it keeps running while the search waits
            await asyncio.sleep(0.001)
        assert not task.done()
    finally:
        space.lock.release()
    assert await task == first and hops == ["search_locked", "search_locked"]
