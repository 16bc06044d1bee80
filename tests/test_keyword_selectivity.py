"""The keyword side leaves out a query word that most of the organization's rows hold (``Search._selective``), so
that one common word does not make FTS5 score most of the organization; the rule is counted in each organization's
own rows (another organization's words change nothing), and a query of common words only still matches them."""

from __future__ import annotations

import pytest

import services.search.selective as selective_module
from tests.conftest import signup


@pytest.fixture
def small_thresholds(monkeypatch):
    # a word in at least 3 rows and 30% of them is common (the defaults: 2,000 rows and 5%)
    monkeypatch.setattr(selective_module, "COMMON_MIN_ROWS", 3)
    monkeypatch.setattr(selective_module, "COMMON_SHARE", 0.3)
    selective_module._COMMON.clear()
    selective_module._COUNTS.clear()
    yield
    selective_module._COMMON.clear()
    selective_module._COUNTS.clear()


def _capture(live, org, texts: list[str]) -> dict[str, str]:
    ids = {}
    with live.client() as c:
        for t in texts:
            r = c.post("/v1/thoughts", json={"content": t}, headers=org.headers)
            assert r.status_code == 201, r.text
            ids[r.json()["id"]] = t
    return ids


def _keyword_scored(live, org, query: str) -> dict[str, float | None]:
    with live.client() as c:
        r = c.post("/v1/search", json={"query": query, "top_k": 50, "explain": True, "min_score": 0}, headers=org.headers)
        assert r.status_code == 200, r.text
        return {h["document_id"]: h["explain"]["keyword_score"] for h in r.json()["results"]}


def test_a_common_word_is_left_out_counted_in_the_organizations_own_rows(live, small_thresholds):
    crowded, quiet = signup(live, "crowded"), signup(live, "quiet")
    common = _capture(live, crowded, [f"Zephyrine status report number {i} for the fleet." for i in range(10)])
    rare = _capture(live, crowded, ["Quokkabell migration plan: move the archive next Tuesday."])
    # "zephyrine" is in 10 of crowded's 11 rows: only "quokkabell" selects its keyword candidates
    got = _keyword_scored(live, crowded, "zephyrine quokkabell")
    (rare_id,) = rare
    assert got[rare_id] is not None
    assert all(got.get(i) is None for i in common)
    # the same words in another organization: one row each of its three, neither common there
    mine = _capture(live, quiet, ["Zephyrine sighting at the harbour.", "Quokkabell recipe for a picnic.",
                                  "Unrelated note about invoices."])
    got = _keyword_scored(live, quiet, "zephyrine quokkabell")
    both = [i for i, t in mine.items() if "Unrelated" not in t]
    assert all(got.get(i) is not None for i in both)
    # only common words: they are kept, so the query still matches by keyword
    got = _keyword_scored(live, crowded, "zephyrine fleet")
    assert any(got.get(i) is not None for i in common)


def _keyword_hits(live, org, query: str) -> dict[str, float]:
    return {i: s for i, s in _keyword_scored(live, org, query).items() if s is not None}


def test_a_query_of_common_words_only_ranks_the_rows_of_its_rarest_word_as_the_full_match_would(
        live, small_thresholds, monkeypatch):
    """When every word of a query is common, the keyword side matches the rows holding the rarest of them and another
    (bm25 then scores a few thousand rows at 100k chunks, not most of them), scored by every word as before: the
    keyword hits are those of the full match. When too few rows hold the rarest word, the full match runs."""
    import services.search.search as search_module

    monkeypatch.setattr(search_module, "KEYWORD_DEPTH", 3)  # the keyword side keeps its best 3
    org = signup(live, "anchored")
    _capture(live, org, [f"Alpha beta review number {i} of the quarter." for i in range(4)]
             + [f"Alpha rollout step {i} went fine." for i in range(5)] + ["Gamma unrelated grocery list."])

    def full_match(o, query: str) -> dict[str, float]:
        """The keyword hits with no word common (every row holding any word ranked)."""
        with monkeypatch.context() as m:
            m.setattr(selective_module, "COMMON_MIN_ROWS", 10**9)
            selective_module._COMMON.clear()
            hits = _keyword_hits(live, o, query)
        selective_module._COMMON.clear()
        selective_module._COUNTS.clear()
        return hits

    full = full_match(org, "alpha beta")
    assert len(full) == 3
    first = _keyword_hits(live, org, "alpha beta")  # counted in the statement: both common, anchored on "beta"
    again = _keyword_hits(live, org, "alpha beta")  # the counts remembered: anchored without counting
    for got in (first, again):
        assert got.keys() == full.keys() and all(got[i] == pytest.approx(full[i]) for i in full)
    assert selective_module._COUNTS[(org.id, "documents_fts", "beta")][0] == 4
    assert selective_module._COUNTS[(org.id, "documents_fts", "alpha")][0] == 9

    few = signup(live, "fallback")  # "lambda" is common (4 of 12 rows) but only 2 rows hold it and "kappa"
    _capture(live, few, [f"Kappa lambda pair {i}." for i in range(2)] + [f"Kappa alone {i}, kappa again." for i in range(6)]
             + [f"Lambda alone {i}." for i in range(2)] + [f"Other note {i}." for i in range(2)])
    full = full_match(few, "kappa lambda")
    first = _keyword_hits(live, few, "kappa lambda")
    again = _keyword_hits(live, few, "kappa lambda")
    for got in (first, again):
        assert len(full) == 3 and got.keys() == full.keys() and all(got[i] == pytest.approx(full[i]) for i in full)


def test_a_query_word_no_row_holds_leaves_the_keyword_side_to_the_words_rows_do_hold(live, small_thresholds):
    """A word no row holds (a typo, a name never captured) scores nothing. Counted as rare, it was the whole match,
    and the keyword side found nothing for "alpha quarter zzyzxq" in an organization full of alpha and quarter;
    now it is left out, whether the counts run in the statement (first time) or come from the remembered verdicts
    (again), with one common word or several held besides it."""
    org = signup(live, "absent-word")
    alpha = _capture(live, org, [f"Alpha quarter review number {i}." for i in range(4)])
    _capture(live, org, ["Gamma grocery list."])
    for query in ("alpha zzyzxq", "alpha quarter zzyzxq", "zzyzxq alpha quarter qqxyzzy"):
        for attempt in ("first", "again"):
            got = _keyword_hits(live, org, query)
            assert set(got) == set(alpha), (query, attempt, got)
    # no word held at all: nothing by keyword, and no error
    assert _keyword_hits(live, org, "zzyzxq qqxyzzy") == {}
    assert _keyword_hits(live, org, "zzyzxq qqxyzzy") == {}
