"""The relevance floor's keyword coverage (services.search.relevance): the IDF-weighted share of the query's words a
candidate's text holds, read by FTS5 from the organization's own database. Checked against the same share computed
here from the texts, and with a remembered row count that the organization has since outgrown."""

from __future__ import annotations

import math
import uuid

import pytest

from services.search import relevance, selective
from services.search.fusion import Candidate
from services.thoughts.thoughts import Thoughts
from tests.decision_doubles import ScriptedEmbedder
from tests.stores import make_stores

# Words chosen so that FTS5's porter stemmer leaves them whole: the df counted here is FTS5's.
TEXTS = {
    "both": "kiwi mango orchard harvest",
    "kiwi": "kiwi basket market",
    "mango": "mango chutney jar",
    "none": "granite quarry truck",
    "all": "kiwi mango papaya salad",
}
TERMS = ["kiwi", "mango", "papaya"]


@pytest.fixture
async def org(tmp_path):
    org_id = f"org_{uuid.uuid4().hex[:16]}"  # the remembered counts are the process's, by organization id
    control, stores = await make_stores(tmp_path, ScriptedEmbedder(), orgs=(org_id,))
    store = await stores.open(org_id)
    t = Thoughts(store.sql, store.vectors, ScriptedEmbedder())
    ids = {name: (await t.capture(text, wait=True)).id for name, text in TEXTS.items()}
    yield store.sql, ids
    await stores.close()
    await control.close()


def expected_share(words_held: set[str]) -> float:
    """ln(1 + (N - df + 0.5) / (df + 0.5)) per term over TEXTS, the held terms' share of the sum."""
    n = len(TEXTS)
    idf = {t: math.log(1 + (n - df + 0.5) / (df + 0.5))
           for t in TERMS for df in [sum(t in text.split() for text in TEXTS.values())]}
    return sum(idf[t] for t in words_held) / sum(idf.values())


async def test_coverage_is_the_idf_weighted_share_of_the_query_words_each_candidate_holds(org):
    sql, ids = org
    cands = [Candidate(chunk_id="c-" + name, kind="thought", parent_id=doc) for name, doc in ids.items()]
    got = await relevance._coverage(sql, TERMS, cands)
    want = {"both": {"kiwi", "mango"}, "kiwi": {"kiwi"}, "mango": {"mango"}, "none": set(), "all": set(TERMS)}
    for name, held in want.items():
        assert got.get(("thought", ids[name]), 0.0) == pytest.approx(expected_share(held)), name
    # only the candidates asked about are read
    only = await relevance._coverage(sql, TERMS, cands[:1])
    assert set(only) == {("thought", ids["both"])}


async def test_a_remembered_row_count_the_organization_outgrew_still_weighs_every_word_positively(org):
    sql, ids = org
    selective.remember_rows(sql.org_id, "documents_fts", 1)  # as if remembered when it held one thought
    cands = [Candidate(chunk_id="c", kind="thought", parent_id=ids["both"])]
    got = await relevance._coverage(sql, TERMS, cands)
    share = got[("thought", ids["both"])]
    assert 0.0 < share < 1.0  # a df above N would weigh words negatively (kiwi and mango: 1.35)


async def test_a_small_organizations_row_count_is_counted_each_time(org):
    sql, ids = org
    await relevance._coverage(sql, TERMS, [Candidate(chunk_id="c", kind="thought", parent_id=ids["all"])])
    assert selective.known_rows(sql.org_id, "documents_fts") is None  # 5 rows: below REMEMBER_ROWS_FROM


async def test_a_large_organizations_row_count_is_remembered(org, monkeypatch):
    sql, ids = org
    monkeypatch.setattr(relevance, "REMEMBER_ROWS_FROM", 3)  # "large": 3 rows and up, for a 5-thought organization
    await relevance._coverage(sql, TERMS, [Candidate(chunk_id="c", kind="thought", parent_id=ids["all"])])
    assert selective.known_rows(sql.org_id, "documents_fts") == len(TEXTS)
