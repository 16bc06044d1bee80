"""Fusion of the keyword and vector lists (services.search.fusion.fuse) and the optional reranking stage."""

from __future__ import annotations

import pytest

from services.errors import BackendError
from services.models import SearchHit
from services.search.fusion import VECTOR_WEIGHT, fuse
from services.search.search import Search

W = VECTOR_WEIGHT


def per_parent(chunk_id, kind, parent_id):
    return (kind, parent_id)


def per_chunk(chunk_id, kind, parent_id):
    return (kind, chunk_id)


def test_a_documents_keyword_and_vector_evidence_meet_even_from_different_chunks():
    keyword = [("a2", "thought", "A", 8.0), ("b1", "thought", "B", 4.0)]
    vector = [("a1", "thought", "A", 0.8), ("c1", "thought", "C", 0.6)]
    out = fuse(keyword, vector, key=per_parent, keyword_depth=100, vector_depth=100)
    assert [c.parent_id for c in out] == ["A", "C", "B"]
    a = out[0]
    assert a.fused == pytest.approx(1.0)  # the best of both sides
    assert (a.keyword_rank, a.vector_rank, a.keyword_score, a.vector_score) == (1, 1, 8.0, 0.8)
    assert a.chunk_id == "a1"  # the vector side contributes more (W > 1 - W)
    c, b = out[1], out[2]
    # Both lists were exhaustive (shorter than their depth): a side that did not return a candidate gives 0.
    assert c.fused == pytest.approx(W * 0.6 / 0.8) and c.keyword_part == 0.0
    assert b.fused == pytest.approx((1 - W) * 4.0 / 8.0) and b.vector_part == 0.0
    assert b.chunk_id == "b1"


def test_a_side_cut_at_its_depth_gives_missing_candidates_its_lowest_score():
    keyword = [("a1", "thought", "A", 10.0), ("b1", "thought", "B", 5.0)]
    vector = [("c1", "thought", "C", 0.5), ("a1", "thought", "A", 0.25)]
    out = {c.parent_id: c for c in fuse(keyword, vector, key=per_parent, keyword_depth=2, vector_depth=2)}
    assert out["C"].keyword_part == pytest.approx(0.5)  # the keyword list was full: floor = its minimum
    assert out["B"].vector_part == pytest.approx(0.5)
    assert out["A"].fused == pytest.approx((1 - W) * 1.0 + W * 0.5)


def test_chunks_stay_separate_for_kinds_that_do_not_collapse_per_parent():
    keyword = [("w1", "conversation", "K", 3.0), ("w2", "conversation", "K", 2.0)]
    vector = [("w2", "conversation", "K", 0.9), ("w1", "conversation", "K", 0.3)]
    out = fuse(keyword, vector, key=per_chunk, keyword_depth=100, vector_depth=100)
    assert sorted(c.chunk_id for c in out) == ["w1", "w2"]
    assert {c.chunk_id: c.keyword_rank for c in out} == {"w1": 1, "w2": 2}


def test_negative_cosines_count_as_no_similarity_and_empty_sides_are_fine():
    out = fuse([], [("a1", "thought", "A", -0.2), ("b1", "thought", "B", 0.4)], key=per_parent)
    assert [c.parent_id for c in out] == ["B", "A"]
    assert out[1].vector_part == 0.0 and out[0].fused == pytest.approx(W)
    out = fuse([("a1", "thought", "A", 2.0)], [], key=per_parent)
    assert len(out) == 1 and out[0].fused == pytest.approx(1 - W) and out[0].chunk_id == "a1"
    assert fuse([], [], key=per_parent) == []


def hit(i: int, score: float) -> SearchHit:
    return SearchHit(kind="thought", document_id=f"d{i}", chunk_id=f"c{i}", chunk_content=f"text {i}", score=score)


class FakeReranker:
    model_id = "fake"

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.seen: list[list[str]] = []

    async def rerank(self, query, passages):
        self.seen.append(list(passages))
        if self.fail:
            raise BackendError("down")
        return [(float(p.split()[1]) + 1) / 100 for p in passages]  # prefers higher numbers

    async def aclose(self) -> None:
        pass


async def test_the_reranker_reorders_the_head_and_the_tail_stays_below_in_fused_order(monkeypatch):
    monkeypatch.setattr("services.search.search.RERANK_DEPTH", 3)
    rr = FakeReranker()
    search = Search(None, None, None, {}, reranker=rr)
    assert search._rerank is not None
    hits = [hit(i, 1.0 - i / 10) for i in range(5)]  # fused order d0..d4
    out = await search._rerank(query="q", hits=list(reversed(hits)))
    assert rr.seen == [["text 0", "text 1", "text 2"]]  # the best fused first, whatever order they came in
    assert [h.document_id for h in out] == ["d2", "d1", "d0", "d3", "d4"]
    scores = [h.score for h in out]
    assert scores == sorted(scores, reverse=True) and scores[2] > scores[3] > scores[4] > 0


async def test_a_failing_reranker_keeps_the_fused_order():
    search = Search(None, None, None, {}, reranker=FakeReranker(fail=True))
    hits = [hit(i, 1.0 - i / 10) for i in range(4)]
    out = await search._rerank(query="q", hits=hits)
    assert [h.document_id for h in out] == ["d0", "d1", "d2", "d3"] and out[0].score == 1.0


def test_without_a_reranker_there_is_no_second_stage():
    assert Search(None, None, None, {})._rerank is None
