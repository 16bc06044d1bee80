"""The relevance floor: after fusion, drop the candidates whose evidence is weak on both sides (a low cosine and
few of the query's content words), since fusion normalises each side by its best score and so, without a floor,
the best of nothing looks like a perfect match. Measured in bench/README.md (calibrate_floor.py).
"""

from __future__ import annotations

import json
import math

from services.search.fusion import Candidate
from services.search.selective import known_rows, remember_rows
from services.storage.scoped import OrgSql

__all__ = ["relevance_floor", "KEYWORD_COVERAGE_FLOOR", "DF_CAP"]

#: The relevance floor's keyword side: a hit whose vector evidence is weak (cosine below the embedder's
#: ``relevance_floor``) is kept only when its text holds at least this share of the query's content words.
KEYWORD_COVERAGE_FLOOR = 2 / 3
#: Document frequencies for the floor's IDF weights are counted up to this (a word in more documents is common).
DF_CAP = 1000
#: An organization's row count (the idf's N) is remembered from this many rows: below it, counting is cheap and
#: a young organization's N changes fast.
REMEMBER_ROWS_FROM = 1000


async def relevance_floor(sql: OrgSql, floor: float | None, terms: list[str], ranked: list[Candidate],
                          vector_cut: float | None) -> list[Candidate]:
    """Drop candidates whose evidence is weak on both sides. A cosine at the embedder's ``relevance_floor``
    keeps a candidate on its own, and so does ``KEYWORD_COVERAGE_FLOOR`` of the query's content words (IDF
    weighted) in its text; below both, the two add up in proportion: ``cosine / floor + coverage /
    KEYWORD_COVERAGE_FLOOR >= 1``. A candidate the vector side did not return has a cosine of at most
    ``vector_cut`` (the lowest it returned, when it was cut at its depth), counted as its cosine; without a
    bound (an exhaustive vector list: it is not indexed yet) only its keywords count. Fusion normalises each side by
    its best score, so without a floor the best of nothing looks like a perfect match. An embedder without
    a calibrated floor (``relevance_floor`` None) keeps everything."""
    if floor is None:
        return ranked
    for c in ranked:
        cosine = c.vector_score if c.vector_score is not None else vector_cut
        c.evidence = "vector" if cosine is not None and cosine >= floor else None
    weak = [c for c in ranked if c.evidence is None]
    if not weak:
        return ranked
    coverage = await _coverage(sql, terms, weak)
    for c in weak:
        c.coverage = coverage.get((c.kind, c.parent_id if c.kind == "thought" else c.chunk_id), 0.0)
        cosine = c.vector_score if c.vector_score is not None else (vector_cut or 0.0)
        # each side counts in proportion: a fair cosine needs fewer of the query's words, and none at all
        # needs KEYWORD_COVERAGE_FLOOR of them
        if max(cosine, 0.0) / floor + c.coverage / KEYWORD_COVERAGE_FLOOR >= 1.0:
            c.evidence = "vector+keyword" if cosine > 0 and c.coverage > 0 else "keyword"
    return [c for c in ranked if c.evidence is not None]


async def _coverage(sql: OrgSql, terms: list[str], candidates: list[Candidate]) -> dict[tuple[str, str], float]:
    """IDF-weighted share of ``terms`` each candidate's text holds, by FTS5 itself (same tokenizer and
    stemming as the keyword side): whole documents for thoughts, the chunk for other kinds. A word the
    organization rarely writes weighs more than a common one, and a word it never wrote most: a query's
    unknown words ("Lisbon flights") are missing evidence, its common ones ("how", "set", "up") are noise.
    idf = ln(1 + (N - df + 0.5) / (df + 0.5)), df counted up to DF_CAP. Two statements per table (one once N is
    remembered). The database is this organization's own (one per organization), so the FTS tables are read
    without a per-row organization check, which reads each matching row's stored columns: at 134k chunks, five
    words of which three common, 172 -> 84 ms. The candidates' FTS rowids are looked up first (a few dozen
    key lookups), and each word's matching rowids are then tested against them, rather than each matching row
    being joined to its key row and then filtered (at 101k chunks, 30 candidates, 200 queries: 11.5 -> 3.8 ms
    p50, the same rows; bench/README.md)."""
    if not terms:
        return {}
    quoted = json.dumps([f'"{t}"' for t in terms])
    out: dict[tuple[str, str], float] = {}
    docs = [c.parent_id for c in candidates if c.kind == "thought"]
    if docs:
        shares = await _weighted_coverage(
            sql, quoted, docs, "documents_fts", "SELECT COUNT(*) AS n FROM documents WHERE organization_id = ?1",
            "WITH wanted(pk, id) AS MATERIALIZED (SELECT k.pk, k.document_id FROM json_each(?3) AS d "
            "CROSS JOIN documents_fts_keys AS k ON k.organization_id = ?1 AND k.document_id = d.value) "
            "SELECT j.key AS term, wanted.id AS id FROM json_each(?2) AS j "
            "JOIN documents_fts ON documents_fts MATCH j.value JOIN wanted ON wanted.pk = documents_fts.rowid + 0",
        )
        out.update({("thought", d): share for d, share in shares.items()})
    chunks = {c.chunk_id: c.kind for c in candidates if c.kind != "thought"}
    if chunks:
        shares = await _weighted_coverage(
            sql, quoted, list(chunks), "chunks_fts", "SELECT COUNT(*) AS n FROM chunks WHERE organization_id = ?1",
            "WITH wanted(pk, id) AS MATERIALIZED (SELECT c.pk, c.id FROM json_each(?3) AS d "
            "CROSS JOIN chunks AS c ON c.organization_id = ?1 AND c.id = d.value) "
            "SELECT j.key AS term, wanted.id AS id FROM json_each(?2) AS j "
            "JOIN chunks_fts ON chunks_fts MATCH j.value JOIN wanted ON wanted.pk = chunks_fts.rowid + 0",
        )
        out.update({(chunks[c], c): share for c, share in shares.items()})
    return out


async def _weighted_coverage(
    sql: OrgSql, quoted: str, ids: list[str], table: str, count_sql: str, match_sql: str,
) -> dict[str, float]:
    """For each of ``ids``, the IDF-weighted share of the quoted terms ``match_sql`` finds in its text."""
    idf = await _idf(sql, quoted, table, count_sql)
    matched: dict[str, set[int]] = {}
    for r in await sql.rows(match_sql, [quoted, json.dumps(ids)]):
        matched.setdefault(r["id"], set()).add(r["term"])
    total = sum(idf) or 1.0
    return {i: sum(idf[t] for t in found) / total for i, found in matched.items()}


async def _idf(sql: OrgSql, quoted: str, table: str, count_sql: str) -> list[float]:
    """Each term's inverse document frequency in this organization's ``table`` (documents_fts or chunks_fts). The
    row count N of a large organization is remembered for ``COMMON_TTL`` like the words' counts (counting 53k
    documents takes ~5 ms); N is never taken below a word's df, so a remembered N cannot make an idf negative."""
    n = known_rows(sql.org_id, table)
    if n is None:
        n = (await sql.one(count_sql, []))["n"]
        if n >= REMEMBER_ROWS_FROM:
            remember_rows(sql.org_id, table, n)
    rows = await sql.rows(
        f"SELECT j.key AS term, (SELECT COUNT(*) FROM (SELECT 1 FROM {table} WHERE {table} MATCH j.value "
        f"LIMIT {DF_CAP})) AS df FROM json_each(?2) AS j",
        [quoted],
    )
    df = {r["term"]: r["df"] for r in rows}
    n = max([n, *df.values()])
    return [math.log(1 + (n - df.get(i, 0) + 0.5) / (df.get(i, 0) + 0.5)) for i in range(len(json.loads(quoted)))]
