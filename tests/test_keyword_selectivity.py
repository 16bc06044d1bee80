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
    yield
    selective_module._COMMON.clear()


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
