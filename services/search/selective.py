"""The FTS5 MATCH operand of a query's words without its common ones (``Selective``): the keyword side of search
and the write-time decisions' lexical gate both use it."""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from services.search.fusion import fts_phrases

__all__ = [
    "COMMON_CACHE", "COMMON_MIN_ROWS", "COMMON_SHARE", "COMMON_TTL", "Selective", "all_common", "known_rows", "remember",
    "remember_rows",
]

if TYPE_CHECKING:
    from services.storage.scoped import OrgSql

#: The keyword side leaves out a query word found in more than this share of the searched rows (and in at
#: least COMMON_MIN_ROWS of them) when a rarer word remains (``Selective``), and a word no row holds.
COMMON_SHARE = 0.05
COMMON_MIN_ROWS = 2000
#: Whether a word is common changes slowly: the verdict (True: left out, common or held by no row; False: rare)
#: is kept per (organization, table, word) this long (seconds), for the COMMON_CACHE most recently used words of
#: the process.
COMMON_TTL = 300.0
COMMON_CACHE = 50_000
_COMMON: OrderedDict[tuple[str, str, str], tuple[bool, float]] = OrderedDict()
#: How many rows hold each common word (organization, table, word) -> (rows, when counted): the anchor of a query
#: whose words are all common is its rarest (``Selective.anchor``). Kept as long and as many as the verdicts.
_COUNTS: OrderedDict[tuple[str, str, str], tuple[int, float]] = OrderedDict()


class Selective:
    """The FTS5 MATCH operand of a query's words (quoted, ORed) without its common ones: a word found in at least
    ``COMMON_SHARE`` of ``table``'s rows (and in at least ``COMMON_MIN_ROWS``) is left out when a rarer word
    remains. A word no row holds is left out too: it adds nothing to any row's score, and counted as rare it would
    be the whole match, so that one absent word (a typo, a name never captured) emptied the keyword side. FTS5
    scores every row a query matches before it sorts them, so the keyword side costs in proportion to the rows
    matched; a common word ("my", "time", "after" in 100k messages) matches most of them and, with an IDF under
    ln(1 + 1 / COMMON_SHARE), moves the ranking little (BM25 alone on SciFact: nDCG@10 68.66 -> 68.62;
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

    __slots__ = ("key", "words", "prefix", "operand", "param", "column", "now", "all_common", "anchored")

    def __init__(self, org_id: str, table: str, words: list[str], *, anchor: bool = True) -> None:
        """``anchor``: a query of common words only is anchored on its rarest (``anchor``); False (the write-time
        decisions' gate, which skips such queries once their words are known): all of them are matched, and the
        counts stop at the threshold."""
        self.key, self.words, self.now = (org_id, table), words, time.monotonic()
        self.prefix = self.column = ""
        #: every word known to be common (``anchor`` may then narrow the match); the match is anchored
        self.all_common = self.anchored = False
        verdicts = [_verdict(org_id, table, w, self.now) for w in words]
        if len(words) == 1 or all(v is not None for v in verdicts):
            rare = [w for w, v in zip(words, verdicts, strict=True) if not v]
            self.operand, self.param = "?2", fts_phrases(rare or words)
            self.all_common = anchor and len(words) > 1 and not rare
            return
        cap = (f"(SELECT max({COMMON_MIN_ROWS}, CAST(COALESCE(max(rowid), 0) * {COMMON_SHARE} AS INTEGER)) "
               f"FROM {table})")
        self.operand = "(SELECT m FROM selective)"
        self.param = json.dumps([f'"{w}"' for w in words])
        self.column = f"{self.operand} AS selective_match, (SELECT none_rare FROM selective) AS selective_none_rare, "
        if not anchor:
            self.prefix = (
                "WITH selective(m, none_rare) AS MATERIALIZED (SELECT COALESCE(group_concat(j.value, ' OR '), "
                "(SELECT group_concat(value, ' OR ') FROM json_each(?2))), COUNT(*) = 0 FROM json_each(?2) AS j "
                f"WHERE (SELECT COUNT(*) FROM (SELECT 1 FROM {table} WHERE {table} MATCH j.value LIMIT {cap})) "
                f"BETWEEN 1 AND {cap} - 1) "
            )
            return
        # each word's rows counted (whole: ranking common words needs their counts), then the rare words ORed, or,
        # when none is rare, the anchored match of ``anchor``: the rarest word AND (the others ORed). Words no row
        # holds are left out (they score nothing); one word held: that word; none: all of them (nothing matches).
        self.column += ("(SELECT anchored FROM selective) AS selective_anchored, "
                        "(SELECT counts FROM selective) AS selective_counts, ")
        self.prefix = (
            f"WITH counted(w, n) AS MATERIALIZED (SELECT j.value, (SELECT COUNT(*) FROM {table} WHERE {table} MATCH "
            "j.value) FROM json_each(?2) AS j), "
            "held(w, n) AS MATERIALIZED (SELECT w, n FROM counted WHERE n > 0), "
            f"rare(w) AS MATERIALIZED (SELECT w FROM held WHERE n < {cap}), "
            "shape(none_rare, anchored) AS MATERIALIZED (SELECT NOT EXISTS (SELECT 1 FROM rare), "
            "NOT EXISTS (SELECT 1 FROM rare) AND (SELECT COUNT(*) FROM held) >= 2), "
            "selective(m, none_rare, anchored, counts) AS MATERIALIZED (SELECT CASE "
            "WHEN NOT none_rare THEN (SELECT group_concat(w, ' OR ') FROM rare) "
            "WHEN NOT anchored THEN COALESCE((SELECT w FROM held), (SELECT group_concat(w, ' OR ') FROM counted)) "
            "ELSE (SELECT w FROM held ORDER BY n, w LIMIT 1) || ' AND (' || (SELECT group_concat(w, ' OR ') FROM "
            "(SELECT w FROM held ORDER BY n, w LIMIT -1 OFFSET 1)) || ')' END, "
            "none_rare, anchored, (SELECT json_group_object(w, n) FROM counted) FROM shape) "
        )

    async def anchor(self, sql: OrgSql) -> None:
        """When every word is known to be left out, match the rows holding the rarest held word and at least one
        other held one (``"rarest" AND ("w2" OR "w3" ...)``; words no row holds score nothing and are dropped),
        scored by all of them: bm25 then ranks the rows of the rarest word (a few thousand) rather than every row
        holding any of the words (most of the table), and the ranking of those rows is the same, each word being one
        phrase of the query as before. A row without the rarest word could outscore one with it, so this is
        measured, not proved: on bench_search_scale's 101,230 chunks, all 28 of 100 queries whose words were all
        common had the same top 100 as the full match, at a third of its time (bench/README.md). The words' row
        counts are one statement the first time (kept ``COMMON_TTL``). ``unanchor`` goes back to the full match
        (the caller's fallback when the anchored one returns too few)."""
        if not self.all_common:
            return
        org_id, table = self.key
        counts = {w: _count(org_id, table, w, self.now) for w in self.words}
        missing = [w for w, n in counts.items() if n is None]
        if missing:
            rows = await sql.rows(
                f"SELECT j.value AS w, (SELECT COUNT(*) FROM {table} WHERE {table} MATCH '\"' || j.value || '\"') AS n "
                "FROM json_each(?2) AS j", [json.dumps(missing)])
            for r in rows:
                counts[r["w"]] = int(r["n"])
                _remember_count(self.key, r["w"], int(r["n"]), self.now)
        held = sorted((w for w in self.words if counts.get(w)), key=lambda w: (counts[w], w))
        if len(held) < 2:  # a word no row holds scores nothing: the one word held, else all (nothing matches)
            self.param = fts_phrases(held or self.words)
            return
        self.param = f'"{held[0]}" AND ({fts_phrases(held[1:])})'
        self.anchored = True

    def anchored_in(self, rows: list[dict[str, Any]]) -> bool:
        """Whether ``rows`` came from an anchored match (``anchor``, or the statement's own counts finding every
        word held common, two or more of them)."""
        return self.anchored or bool(self.column and rows and rows[0].get("selective_anchored"))

    def unanchor(self) -> None:
        """Back to the full match of every word (the statement's counts, if it ran them, learnt first)."""
        self.prefix = self.column = ""
        self.operand, self.param, self.anchored = "?2", fts_phrases(self.words), False

    def learn(self, rows: list[dict[str, Any]]) -> None:
        """Remember the verdicts the statement's ``selective_match`` column tells: kept words are rare, the others
        left out (common, or held by no row); when none is rare (common words kept for want of a rarer one), all
        are left out."""
        if self.column:
            remember(self.key, self.words, rows, self.now)


def all_common(org_id: str, table: str, words: list[str]) -> bool:
    """Whether every one of ``words`` is known (fresh) to be left out in the organization's ``table`` (common, or
    held by no row): a MATCH of them reads a large share of its rows, or finds nothing, whatever ``Selective``
    does."""
    now = time.monotonic()
    return bool(words) and all(_verdict(org_id, table, w, now) for w in words)


def _fresh(cache: OrderedDict[tuple[str, str, str], tuple[Any, float]], key: tuple[str, str, str], now: float) -> Any:
    """What ``cache`` remembers for ``key``; None when unknown or older than ``COMMON_TTL``."""
    v = cache.get(key)
    return v[0] if v is not None and now - v[1] < COMMON_TTL else None


def _put(cache: OrderedDict[tuple[str, str, str], tuple[Any, float]], key: tuple[str, str, str], value: Any,
         now: float) -> None:
    """Remember ``value`` for ``key`` (most recent last), keeping at most ``COMMON_CACHE`` keys."""
    cache[key] = (value, now)
    cache.move_to_end(key)
    while len(cache) > COMMON_CACHE:
        cache.popitem(last=False)


def _count(org_id: str, table: str, word: str, now: float) -> int | None:
    return _fresh(_COUNTS, (org_id, table, word), now)


def _remember_count(key: tuple[str, str], word: str, n: int, now: float) -> None:
    _put(_COUNTS, (*key, word), n, now)


def known_rows(org_id: str, table: str) -> int | None:
    """The organization's row count in ``table`` as remembered by ``remember_rows`` (fresh for ``COMMON_TTL``),
    else None."""
    return _fresh(_COUNTS, (org_id, table, ""), time.monotonic())


def remember_rows(org_id: str, table: str, n: int) -> None:
    """Remember the organization's row count in ``table`` (kept with the words' counts; no word is empty)."""
    _put(_COUNTS, (org_id, table, ""), n, time.monotonic())


def _verdict(org_id: str, table: str, word: str, now: float) -> bool | None:
    """Whether ``word`` is left out in the organization's ``table`` (common, or held by no row), as remembered;
    None when unknown or stale."""
    return _fresh(_COMMON, (org_id, table, word), now)


def remember(key: tuple[str, str], words: list[str], rows: list[dict[str, Any]], now: float | None = None) -> None:
    """``Selective.learn`` for a caller that kept the (organization, table) key and the words, not the object: rows
    without a ``selective_match`` column (the verdicts were known) teach nothing."""
    if not rows or "selective_match" not in rows[0]:
        return
    now = time.monotonic() if now is None else now
    for quoted, n in json.loads(rows[0].get("selective_counts") or "{}").items():
        _remember_count(key, quoted.strip('"'), int(n), now)
    kept = set(str(rows[0].get("selective_match") or "").split(" OR "))
    none_rare = bool(rows[0].get("selective_none_rare"))
    for w in words:  # all rare too: a query of rare words then skips the counts next time
        _put(_COMMON, (*key, w), none_rare or f'"{w}"' not in kept, now)
