"""The FTS5 MATCH operand of a query's words without its common ones (``Selective``): the keyword side of search
and the write-time decisions' lexical gate both use it."""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from typing import Any

from services.search.fusion import fts_phrases

__all__ = ["COMMON_CACHE", "COMMON_MIN_ROWS", "COMMON_SHARE", "COMMON_TTL", "Selective", "all_common", "remember"]

#: The keyword side leaves out a query word found in more than this share of the searched rows (and in at
#: least COMMON_MIN_ROWS of them) when a rarer word remains (``Selective``).
COMMON_SHARE = 0.05
COMMON_MIN_ROWS = 2000
#: Whether a word is common changes slowly: the verdict is kept per (organization, table, word) this long
#: (seconds), for the COMMON_CACHE most recently used words of the process.
COMMON_TTL = 300.0
COMMON_CACHE = 50_000
_COMMON: OrderedDict[tuple[str, str, str], tuple[bool, float]] = OrderedDict()


class Selective:
    """The FTS5 MATCH operand of a query's words (quoted, ORed) without its common ones: a word found in at least
    ``COMMON_SHARE`` of ``table``'s rows (and in at least ``COMMON_MIN_ROWS``) is left out when a rarer word
    remains. FTS5 scores every row a query matches before it sorts them, so the keyword side costs in proportion
    to the rows matched; a common word ("my", "time", "after" in 100k messages) matches most of them and, with an
    IDF under ln(1 + 1 / COMMON_SHARE), moves the ranking little (BM25 alone on SciFact: nDCG@10 68.66 -> 68.62;
    bench/README.md).

    The words' counts run inside the keyword statement itself (a subquery as the MATCH operand: no extra round
    trip, which on D1 is an API request), each stopping at the threshold; the table's highest rowid stands for
    its row count (an upper bound: never more pruning than the rule says). The database is this organization's
    own (one per organization, embedded and on D1), so the counts need no per-row organization check, which
    would read every matching row's stored columns rather than the index alone (5 words over 134k rows: 2 ms
    against 0.5-1.3 s). The statement also returns the words it kept, so the verdicts are remembered per
    (organization, table, word) for ``COMMON_TTL`` seconds and a query of known words skips the counts. The kept
    words are a materialized CTE (``prefix``) that the MATCH and the returned column both read: written out twice,
    the counts would run twice (the whole keyword statement, 5 words over 134k chunks: 24.1 against 20.3 ms)."""

    __slots__ = ("key", "words", "prefix", "operand", "param", "column", "now")

    def __init__(self, org_id: str, table: str, words: list[str]) -> None:
        self.key, self.words, self.now = (org_id, table), words, time.monotonic()
        self.prefix = self.column = ""
        verdicts = [_verdict(org_id, table, w, self.now) for w in words]
        if len(words) == 1 or all(v is not None for v in verdicts):
            rare = [w for w, v in zip(words, verdicts, strict=True) if not v]
            self.operand, self.param = "?2", fts_phrases(rare or words)
            return
        cap = (f"(SELECT max({COMMON_MIN_ROWS}, CAST(COALESCE(max(rowid), 0) * {COMMON_SHARE} AS INTEGER)) "
               f"FROM {table})")
        self.prefix = (
            "WITH selective(m, none_rare) AS MATERIALIZED (SELECT COALESCE(group_concat(j.value, ' OR '), "
            "(SELECT group_concat(value, ' OR ') FROM json_each(?2))), COUNT(*) = 0 FROM json_each(?2) AS j "
            f"WHERE (SELECT COUNT(*) FROM (SELECT 1 FROM {table} WHERE {table} MATCH j.value LIMIT {cap})) < {cap}) "
        )
        self.operand = "(SELECT m FROM selective)"
        self.param = json.dumps([f'"{w}"' for w in words])
        self.column = f"{self.operand} AS selective_match, (SELECT none_rare FROM selective) AS selective_none_rare, "

    def learn(self, rows: list[dict[str, Any]]) -> None:
        """Remember the verdicts the statement's ``selective_match`` column tells: kept words are rare, the others
        common; when none is rare (all kept for want of a rarer one), all are common."""
        if self.column:
            remember(self.key, self.words, rows, self.now)


def all_common(org_id: str, table: str, words: list[str]) -> bool:
    """Whether every one of ``words`` is known (fresh) to be common in the organization's ``table``: a MATCH of
    them reads a large share of its rows whatever ``Selective`` does."""
    now = time.monotonic()
    return bool(words) and all(_verdict(org_id, table, w, now) for w in words)


def _verdict(org_id: str, table: str, word: str, now: float) -> bool | None:
    """Whether ``word`` is common in the organization's ``table``, as remembered; None when unknown or stale."""
    v = _COMMON.get((org_id, table, word))
    return v[0] if v is not None and now - v[1] < COMMON_TTL else None


def remember(key: tuple[str, str], words: list[str], rows: list[dict[str, Any]], now: float | None = None) -> None:
    """``Selective.learn`` for a caller that kept the (organization, table) key and the words, not the object: rows
    without a ``selective_match`` column (the verdicts were known) teach nothing."""
    if not rows or "selective_match" not in rows[0]:
        return
    kept = set(str(rows[0].get("selective_match") or "").split(" OR "))
    none_rare = bool(rows[0].get("selective_none_rare"))
    if all(f'"{w}"' in kept for w in words) and not none_rare:  # all rare
        return
    now = time.monotonic() if now is None else now
    for w in words:
        k = (*key, w)
        _COMMON[k] = (none_rare or f'"{w}"' not in kept, now)
        _COMMON.move_to_end(k)
    while len(_COMMON) > COMMON_CACHE:
        _COMMON.popitem(last=False)
