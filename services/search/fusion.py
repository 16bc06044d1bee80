"""The hybrid search's two lists, fused: the query's words (``query_terms``, ``fts_query``, ``floor_terms``), each
side's depth, and the convex fusion of BM25 and cosine scores (``fuse``, ``explain_candidate``).

Fusion (``fuse``): each list is first collapsed to its best chunk per parent (per chunk for kinds whose
hydrator sets ``collapse_per_parent = False``), so a document's keyword and vector evidence meet even when
different chunks carried them; each side's scores are divided by that side's best score (BM25 > 0; cosine
clipped at 0); a candidate one side did not return gets that side's floor (its lowest normalised score when
the list was cut at its depth, else 0: the list was exhaustive); and the fused score is
``(1 - VECTOR_WEIGHT) * keyword + VECTOR_WEIGHT * vector``, in [0, 1]. The figures behind these choices
(BEIR SciFact through the API, bench/bench_scifact.py) are next to the constants and in bench/README.md.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from services.ids import now_ms
from services.text.temporal import resolve_relative

__all__ = ["KEYWORD_DEPTH", "VECTOR_DEPTH", "VECTOR_WEIGHT", "Candidate", "KeywordRow", "VectorRow", "fuse",
           "explain_candidate", "query_terms", "floor_terms", "fts_query", "fts_phrases"]

#: Chunks each side fetches, whatever top_k (x4 on the keyword side under a tag filter, applied on hydration).
#: SciFact test nDCG@10, convex fusion: 73.43 at 30 per side (what top_k=10 fetched before), 73.56 at 100;
#: search p50 cost of the deeper lists at top_k 10: ~2 ms (21.0 -> 22.8 ms, bench/README.md). Thoughts' keyword
#: side scores whole documents (BM25 over documents_fts) instead of their best chunk: 73.56 -> 74.34 test nDCG@10,
#: R@10 86.06 -> 86.50, R@100 94.93 -> 95.27 through the API (+0.48 +- 0.26 paired over train + test).
KEYWORD_DEPTH = 100
VECTOR_DEPTH = 100  # Vectorize's topK limit
#: Weight of the vector side in the convex fusion (the keyword side gets 1 - it). Tuned on SciFact's train
#: split (809 queries: 0.55 73.63, 0.60 73.64, 0.65 73.71 nDCG@10), checked on its test split (73.66 / 73.56 /
#: 72.81); 0.6 sits in the middle of the plateau. Reciprocal-rank fusion (k=60) of the same lists: 71.04 train,
#: 70.72 test; min-max normalisation 73.13 / 73.20; z-scores 73.38 / 73.09.
VECTOR_WEIGHT = 0.6

_TOKEN = re.compile(r"\w+", re.UNICODE)
_STOP = frozenset(
    "a an and are as at be but by for from has have how i in is it its of on or that the this to was what when "
    "where which who why will with you your do does did can could should would".split()
)


def query_terms(text: str) -> list[str]:
    """The query's distinct words, lowercased, stop words dropped when others remain (at most 64)."""
    words = list(dict.fromkeys(w.lower() for w in _TOKEN.findall(text)))[:64]
    return [w for w in words if w not in _STOP] or words


def floor_terms(text: str, reference_time: int | None = None) -> list[str]:
    """The words the relevance floor looks for: the query's content words without a relative date it names
    ("last week", "in March": that is when, not what; services.text.temporal resolves it)."""
    terms = query_terms(text)
    dated = resolve_relative(text, reference_time if reference_time is not None else now_ms())
    if dated is None:
        return terms
    phrase = set(_TOKEN.findall(dated[2].lower()))
    return [t for t in terms if t not in phrase] or terms


def fts_query(text: str) -> str | None:
    """An FTS5 MATCH expression: every distinct word, quoted, ORed (stop words dropped when others remain)."""
    content = query_terms(text)
    if not content:
        return None
    return fts_phrases(content)


def fts_phrases(words: Sequence[str]) -> str:
    """Words (from ``query_terms``: no double quote can be in one) as quoted FTS5 phrases, ORed."""
    return " OR ".join(f'"{w}"' for w in words)


@dataclass(slots=True)
class Candidate:
    chunk_id: str
    kind: str
    parent_id: str
    fused: float = 0.0
    keyword_rank: int | None = None
    vector_rank: int | None = None
    vector_score: float | None = None
    keyword_score: float | None = None
    #: Each side's normalised score (or its floor, for a side that did not return the candidate).
    keyword_part: float = 0.0
    vector_part: float = 0.0
    #: Share of the query's content words the candidate's text holds (FTS5, stemmed); None: not computed
    #: (its vector evidence was strong enough on its own).
    coverage: float | None = None
    #: What kept the candidate above the relevance floor: ``vector``, ``keyword``; None: no floor applied.
    evidence: str | None = None


KeywordRow = tuple[str, str, str, float]  # chunk id, kind, parent id, BM25 (higher is better)
VectorRow = tuple[str, str, str, float]  # chunk id, kind, parent id, cosine


def fuse(
    keyword: Sequence[KeywordRow],
    vector: Sequence[VectorRow],
    *,
    key: Callable[[str, str, str], tuple[str, str]],
    keyword_depth: int = KEYWORD_DEPTH,
    vector_depth: int = VECTOR_DEPTH,
    vector_weight: float = VECTOR_WEIGHT,
    unindexed: Sequence[VectorRow] = (),
) -> list[Candidate]:
    """Convex combination of max-normalised BM25 and cosine scores, per ``key`` (see the module docstring).

    ``key(chunk_id, kind, parent_id)`` names what one result stands for (the parent, or the chunk itself).
    Each list must be best first. Returns the candidates best first (ties: the vector side's order, then the
    keyword side's). The candidate's chunk is the one of the side contributing more to its score.

    ``unindexed``: exact cosines of chunks the index does not hold yet (``services.search.search``): they join the
    vector side as if it had returned them, but the side's floor stays that of the index's own list.
    """
    def collapse(rows):
        best: dict[tuple[str, str], tuple[int, tuple]] = {}
        for row in rows:
            k = key(row[0], row[1], row[2])
            if k not in best:
                best[k] = (len(best) + 1, row)
        return best

    cut = len(vector) >= vector_depth
    if unindexed:
        vector = sorted([*vector, *unindexed], key=lambda r: r[3], reverse=True)  # stable: the index's rows first
    kw, vec = collapse(keyword), collapse(vector)
    kw_max = max((r[3] for _, r in kw.values()), default=0.0)
    vec_max = max((max(r[3], 0.0) for _, r in vec.values()), default=0.0)
    kw_norm = {k: (r[3] / kw_max if kw_max > 0 else 0.0) for k, (_, r) in kw.items()}
    vec_norm = {k: (max(r[3], 0.0) / vec_max if vec_max > 0 else 0.0) for k, (_, r) in vec.items()}
    # A side cut at its depth may hold a missed candidate just below its last one; an exhaustive side does not.
    kw_floor = min(kw_norm.values()) if kw_norm and len(keyword) >= keyword_depth else 0.0
    extra = {r[0] for r in unindexed}
    vec_floor = min((vec_norm[k] for k, (_, r) in vec.items() if r[0] not in extra), default=0.0) if cut else 0.0
    out: list[Candidate] = []
    for k in list(vec) + [k for k in kw if k not in vec]:
        v_rank, v_row = vec.get(k, (None, None))
        k_rank, k_row = kw.get(k, (None, None))
        kp = kw_norm.get(k, kw_floor)
        vp = vec_norm.get(k, vec_floor)
        vector_side = v_row is not None and (k_row is None or vector_weight * vp >= (1 - vector_weight) * kp)
        row = v_row if vector_side else k_row
        out.append(Candidate(
            chunk_id=row[0], kind=row[1], parent_id=row[2],
            fused=(1 - vector_weight) * kp + vector_weight * vp,
            keyword_rank=k_rank, vector_rank=v_rank,
            vector_score=v_row[3] if v_row is not None else None,
            keyword_score=k_row[3] if k_row is not None else None,
            keyword_part=kp, vector_part=vp,
        ))
    out.sort(key=lambda c: c.fused, reverse=True)  # stable: ties keep the vector side's order
    return out


def explain_candidate(c: Candidate) -> dict[str, Any]:
    """Why the candidate fused where it did: fused = keyword_weight * keyword_part + vector_weight * vector_part."""
    return {
        "keyword_rank": c.keyword_rank,
        "keyword_score": c.keyword_score,
        "vector_rank": c.vector_rank,
        "vector_score": c.vector_score,
        "fusion": "convex",
        "keyword_part": round(c.keyword_part, 6),
        "vector_part": round(c.vector_part, 6),
        "keyword_weight": round(1 - VECTOR_WEIGHT, 6),
        "vector_weight": VECTOR_WEIGHT,
        "score": round(c.fused, 6),
        "evidence": c.evidence,
        "keyword_coverage": None if c.coverage is None else round(c.coverage, 6),
    }
