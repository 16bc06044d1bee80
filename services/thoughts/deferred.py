"""Write-time decisions made by the job worker, for captures acknowledged before theirs (the default).

A capture is acknowledged once it is durable and keyword-searchable, its decision ``pending``
(``documents.decision``). The worker's embedding stage (services.search.indexing.EmbedStage) calls ``decide_round``
with each round's embedded chunks before writing their vectors: for every thought of the round still pending, in
the order they were captured, its first chunk's vector (in hand: no second model run) is decided as a capture that
waited would be (services.thoughts.decisions), against the organization's thoughts and the ones captured before it
in the same round. Without a language model the lexical gate asks first, for the whole round in one SQL batch, so
a round of unrelated notes costs one query and no vector lookups.

What each outcome does:

* created, flagged, kept_both: recorded on the thought;
* contradiction: recorded, and the link to the contradicted thought written;
* duplicate: the new thought goes to the existing one's history (``merged``, the reason saying it was a duplicate:
  ``restore`` brings it back) and its vectors are never written;
* replace: the old thought goes to the new one's history;
* merge: the new thought takes the merged text (its own original content and the old thought go to its history)
  and its chunks are embedded again.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable

import msgspec
import numpy as np

from services.ids import new_id, now_ms
from services.ports import Embedder, Statement
from services.search.indexing import BeforeUpsert, Decided, enqueue_embed
from services.storage.scoped import OrgSql, OrgVectors
from services.thoughts import supersede
from services.thoughts.decisions import CANDIDATE_MIN, Decisions, Plan, Prefetched
from services.thoughts.thoughts import PENDING, decision_of

__all__ = ["deferred_decisions"]

log = logging.getLogger("memex.decisions")


def deferred_decisions(factory: Callable[[OrgSql, OrgVectors], Decisions | None],
                       wake: Callable[[str], None] = lambda org_id: None) -> BeforeUpsert:
    """The embedding stage's hook: ``factory`` makes the organization's ``Decisions`` (None: decisions are off);
    ``wake(org_id)`` tells the worker a merge queued its thought's new chunks.

    Round trips for a round (on D1 each is an API request): one SQL batch reads the round's pending thoughts and
    asks the lexical gate for all of them; the index is queried once for each thought the gate lets through (none
    without the gate's say-so), then one SQL read fetches every candidate those queries found. The decisions that
    only record something (created, flagged, kept both, a contradiction) are returned as statements, run by the
    stage in the batch that marks the round's chunks indexed; a duplicate, a replace or a merge runs at once (the
    records decided before it written first, in their order)."""

    async def hook(sql: OrgSql, vectors: OrgVectors, rows: list[dict], matrix: np.ndarray) -> Decided:
        first = {r["parent_id"]: i for i, r in enumerate(rows) if r["kind"] == "thought" and r["ordinal"] == 0}
        if not first:
            return Decided()
        ids = list(first)
        decisions = factory(sql, vectors)
        if decisions is None:  # turned off since these were captured
            return Decided(statements=[sql.stmt(
                "UPDATE documents SET decision = NULL WHERE organization_id = ?1 AND decision = ?2 "
                "AND id IN (SELECT value FROM json_each(?3))", PENDING, json.dumps(ids))])
        texts = [rows[first[i]]["content"] for i in ids]
        gate = decisions.plausible_stmts(texts, ids) if decisions.gated else []
        results = await sql.batch([sql.stmt(
            "SELECT d.id, d.content, d.source, d.metadata, d.created_at, (SELECT COUNT(*) FROM chunks c "
            "WHERE c.organization_id = ?1 AND c.kind = 'thought' AND c.parent_id = d.id) AS chunks FROM documents d "
            "WHERE d.organization_id = ?1 AND d.decision = ?2 AND d.id IN (SELECT value FROM json_each(?3)) "
            "ORDER BY d.created_at, d.id", PENDING, json.dumps(ids)), *(st for st in gate if st is not None)])
        docs = results[0].rows
        if not docs:
            return Decided()
        if decisions.gated:
            close_of = dict(zip(ids, decisions.plausible_results(texts, gate, results[1:]), strict=True))
            closes = [close_of[d["id"]] for d in docs]
        else:
            closes = [None] * len(docs)
        in_hand = {r["content"]: matrix[i] for i, r in enumerate(rows)}
        prefetched = await _prefetch(decisions, docs, closes, {d["id"]: matrix[first[d["id"]]] for d in docs}, in_hand)
        out = Decided()
        earlier: list[tuple[str, np.ndarray]] = []
        for doc, close in zip(docs, closes, strict=True):
            vector = matrix[first[doc["id"]]]
            try:
                plan = await decisions.decide_embedded(doc["content"], vector, multi_chunk=doc["chunks"] > 1, close=close,
                                                       extra=earlier, own_id=doc["id"], prefetched=prefetched)
                kept = await _apply(sql, vectors, decisions.embedder, doc, plan, out.statements)
                if plan.action == "merge":
                    wake(sql.org_id)
            except Exception as exc:  # never lose the thought over its decision: keep it, say why
                log.warning("deferred decision for %s failed: %s", doc["id"], exc)
                plan = Plan("keep_both", None, f"the decision failed ({type(exc).__name__}); kept")
                kept = await _apply(sql, vectors, decisions.embedder, doc, plan, out.statements)
            if plan.action in _SUPERSEDING and prefetched is not None:
                # thoughts read for the round may have gone or changed: later decisions read them again
                prefetched = Prefetched(prefetched.matches, {}, set(), prefetched.texts)
            if kept:
                earlier.append((doc["id"], vector))
            else:
                out.skip |= {r["id"] for r in rows if r["parent_id"] == doc["id"]}
        return out

    return hook


#: The outcomes that change other thoughts (or this one) at once, rather than only recording a decision.
_SUPERSEDING = ("duplicate", "replace", "merge")


async def _prefetch(decisions: Decisions, docs: list[dict], closes: list, vectors: dict[str, np.ndarray],
                    in_hand: dict[str, np.ndarray]) -> Prefetched | None:
    """What the round's decisions need, fetched at once: the index's matches of every thought the gate let through,
    the vectors of the gate's close thoughts that are not searchable yet (one embedding call; ``in_hand``: text ->
    the round's own vectors), and the rows of every thought a decision may compare with (one read): its matches,
    the round's thoughts close to it, the gate's pending ones."""
    asks = [d["id"] for d, close in zip(docs, closes, strict=True) if close is None or close]
    if not asks:
        return None
    pending = {d["id"]: [(pid, text) for pid, text, not_searchable in (close or ()) if not_searchable]
               for d, close in zip(docs, closes, strict=True)}
    also: set[str] = {pid for found in pending.values() for pid, _ in found}
    for a in asks:  # the round's other thoughts near enough to be candidates (their vectors are in hand)
        also |= {d["id"] for d in docs if d["id"] != a and float(np.dot(vectors[a], vectors[d["id"]])) >= CANDIDATE_MIN}
    # an index whose concurrent queries share requests (the Worker's) takes the round's queries all at once
    concurrency = int(getattr(getattr(decisions.vectors, "index", None), "query_concurrency", 4))
    return await decisions.prefetch([(a, vectors[a]) for a in asks], also, pending, in_hand, concurrency=concurrency)


async def _apply(sql: OrgSql, vectors: OrgVectors, embedder: Embedder, doc: dict, plan: Plan,
                 deferred: list[Statement]) -> bool:
    """Carry out one thought's decision; False when the thought itself went to the history (its chunks' vectors
    are not to be written). A decision that only records something adds its statements to ``deferred``; one that
    supersedes runs now, after the statements deferred so far."""
    now = now_ms()
    doc_id = doc["id"]
    if plan.action in _SUPERSEDING and deferred:
        await sql.batch(list(deferred))
        deferred.clear()
    if plan.action == "duplicate":
        gone = Plan("duplicate", doc_id, f"duplicate of {plan.related_id}: {plan.reason}", plan.similarity)
        await supersede.supersede(sql, vectors, plan.related_id, gone, now, None, action="merged")
        return False
    if plan.action == "merge":
        stored, plan = await supersede.merged(sql, embedder, plan, doc["source"], json.loads(doc["metadata"] or "{}"),
                                              max_metadata_bytes=16 * 1024)
        if stored is not None:
            await _take_merged(sql, vectors, embedder, doc, stored, plan, now)
            return False  # its current chunks hold the text it no longer has: the merged text's are queued
    stmts = [_record(sql, doc_id, plan)]
    if plan.action == "contradiction":
        stmts.append(sql.stmt(
            "INSERT INTO thought_links (organization_id, from_id, to_id, kind, reason, created_at) "
            "SELECT ?1, ?2, ?3, 'contradicts', ?4, ?5 WHERE EXISTS (SELECT 1 FROM documents WHERE organization_id = ?1 "
            "AND id = ?3) AND EXISTS (SELECT 1 FROM documents WHERE organization_id = ?1 AND id = ?2) "
            "ON CONFLICT DO NOTHING", doc_id, plan.related_id, plan.reason, now))
    if plan.action != "replace":
        deferred.extend(stmts)
        return True
    await sql.batch(stmts)
    try:
        await supersede.supersede(sql, vectors, doc_id, plan, now, None)
    except Exception:
        log.warning("could not replace %s by %s", plan.related_id, doc_id, exc_info=True)
        await sql.batch([_record(sql, doc_id, Plan("keep_both", plan.related_id, "replace failed; kept both",
                                                    plan.similarity))])
    return True


def _record(sql: OrgSql, doc_id: str, plan: Plan) -> Statement:
    return sql.stmt("UPDATE documents SET decision = ?3 WHERE organization_id = ?1 AND id = ?2", doc_id,
                    msgspec.json.encode(decision_of(plan)).decode())


async def _take_merged(sql: OrgSql, vectors: OrgVectors, embedder: Embedder, doc: dict, stored: supersede.Stored,
                       plan: Plan, now: int) -> None:
    """The new thought becomes the merge: its own text goes to its history (the incoming content), it takes the
    merged text and new chunks (embedded next round), and the old thought goes to its history."""
    content, digest, source, meta_json, pieces = stored
    doc_id = doc["id"]
    original = await sql.one("SELECT content, content_hash, source, metadata FROM documents WHERE organization_id = ?1 "
                             "AND id = ?2", [doc_id])
    if original is None:
        return
    stmts = [
        sql.stmt("UPDATE documents SET content = ?3, content_hash = ?4, source = ?5, metadata = ?6, updated_at = ?7 "
                 "WHERE organization_id = ?1 AND id = ?2", doc_id, content, digest, source, meta_json, now),
        _record(sql, doc_id, plan),
        sql.stmt("DELETE FROM chunks WHERE organization_id = ?1 AND kind = 'thought' AND parent_id = ?2", doc_id),
    ]
    stmts += [sql.stmt(
        "INSERT INTO chunks (organization_id, id, kind, parent_id, ordinal, content, token_count) "
        "VALUES (?1, ?2, 'thought', ?3, ?4, ?5, ?6)", new_id(), doc_id, i, piece, embedder.count_tokens(piece))
        for i, piece in enumerate(pieces)]
    stmts.append(enqueue_embed(sql, doc_id, now, only_if_parent_in="documents"))
    await sql.batch(stmts)
    incoming = (original["content"], original["content_hash"], original["source"], original["metadata"])
    await supersede.supersede(sql, vectors, doc_id, plan, now, incoming)
