"""Converting a single-database data directory (the previous release's memex.sqlite3 + vectors.sqlite3) into the
control database plus one database and vector file per organization (services/storage/convert.py), through
``Memex.start``: every row of every table, the keyword indexes, the AUTOINCREMENT counters and the vectors arrive
unchanged; a crash mid-conversion leaves the legacy files and the next start converts fully; a converted
directory is left alone; the converted service serves the old data with the old keys over HTTP."""

from __future__ import annotations

import asyncio
import base64
import gzip
import json
import logging
import shutil
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
import pytest

from api.app import create_app
from api.settings import Settings
from api.wiring import Memex
from services.adapters.hash_embedder import HashEmbedder
from services.adapters.local_vectors import LocalVectorIndex
from services.adapters.sqlite import SqliteDatabase
from services.storage.migrate import CONTROL_DIR, LEGACY_DIR, ORG_DIR, apply_pending, discover
from services.ports import Statement, Vector
from services.storage import convert, convert_copy
from services.search.indexing import chunk_metadata
from tenancy.keys import KeyManager
from tests.live import serve

ORG_A = "org_00000000000000aa"
ORG_B = "org_00000000000000bb"
ORG_GONE = "org_00000000000000cc"  # deleted before the conversion: its leftovers belong to no organization
T0 = 1_760_000_000_000
#: Words per organization for keyword queries (each appears in that organization's thoughts and chunks).
WORDS = {ORG_A: ["quokka", "lighthouse", "budget", "migration"], ORG_B: ["zeppelin", "lighthouse", "tariff"]}
#: Tables the converter deliberately does not copy as rows.
NOT_ROWS = {"sqlite_sequence", "d1_migrations"}


@dataclass
class Legacy:
    data_dir: Path
    keys: dict[str, str] = field(default_factory=dict)  # name -> raw key
    docs: dict[str, list[str]] = field(default_factory=dict)


def _gzip64(text: str) -> str:
    return base64.b64encode(gzip.compress(text.encode())).decode()


async def build_legacy(data_dir: Path) -> Legacy:
    """A data directory of the previous release: migrations/legacy/* applied, every table filled for two live
    organizations (interleaved, so rowids and keys interleave) and one deleted organization's leftovers."""
    out = Legacy(data_dir)
    db = SqliteDatabase(data_dir / "memex.sqlite3")
    emb = HashEmbedder()
    index = LocalVectorIndex(data_dir / "vectors.sqlite3", dimensions=emb.dimensions, model=emb.model_id)
    try:
        assert await apply_pending(db, LEGACY_DIR)
        s = Statement
        await db.batch([
            s("INSERT INTO organizations (id, slug, name, status, created_at) VALUES (?, ?, ?, 'active', ?)",
              (org, slug, name, T0 + i))
            for i, (org, slug, name) in enumerate([(ORG_A, "alpha", "Alpha Inc"), (ORG_B, "beta", "Beta LLC"),
                                                   (ORG_GONE, "gone", "Gone Ltd")])
        ])
        keys = KeyManager(db)
        for name, org, scopes in [("a-main", ORG_A, ["read", "write"]), ("a-revoked", ORG_A, ["read"]),
                                  ("a-admin", ORG_A, ["admin", "read", "write"]), ("b-main", ORG_B, ["read", "write"]),
                                  ("gone", ORG_GONE, ["read"])]:
            issued, stmt = await keys.prepare(org, name=name, scopes=scopes,
                                              expires_at=T0 * 2 if name == "a-admin" else None)
            await db.batch([stmt])
            out.keys[name] = issued.raw
            out.keys[name + ":id"] = issued.record.id
        await db.execute("UPDATE api_keys SET revoked_at = ? WHERE id = ?", (T0 + 50, out.keys["a-revoked:id"]))
        await db.execute("UPDATE api_keys SET last_used_at = ? WHERE id = ?", (T0 + 60, out.keys["a-main:id"]))
        await db.execute("UPDATE organizations SET status = 'suspended' WHERE id = ?", (ORG_B,))
        await db.execute("UPDATE organizations SET status = 'active' WHERE id = ?", (ORG_B,))
        await db.batch([
            s("INSERT INTO memberships (organization_id, email, role, created_at) VALUES (?, ?, ?, ?)", row)
            for row in [(ORG_A, "alice@example.com", "owner", T0), (ORG_A, "ann@example.com", "viewer", T0 + 1),
                        (ORG_B, "bob@example.com", "admin", T0 + 2), (ORG_GONE, "gus@example.com", "owner", T0)]
        ] + [
            s("INSERT INTO service_tokens (organization_id, common_name, name, scopes, created_at) VALUES (?, ?, ?, ?, ?)",
              row)
            for row in [(ORG_A, "ci.access", "ci", '["read","write"]', T0), (ORG_B, "ci.access", "ci-b", '["read"]', T0),
                        (ORG_B, "etl.access", "etl", '["write"]', T0 + 3)]
        ] + [
            s("INSERT INTO llm_usage (organization_id, day, calls, tokens, refused) VALUES (?, ?, ?, ?, ?)", row)
            for row in [(ORG_A, "2025-10-01", 12, 3400, 0), (ORG_A, "2025-10-02", 500, 200000, 7),
                        (ORG_B, "2025-10-01", 3, 900, 0), (ORG_GONE, "2025-09-30", 1, 10, 0)]
        ])

        docs = [  # (org, id, content, tags, summary, importance, enrichment_state)
            (ORG_A, "docA1", "The quokka census starts at the lighthouse on Monday.", '["wildlife","census"]',
             "Quokka census at the lighthouse", 4, "llm"),
            (ORG_B, "docB1", "Zeppelin hangar lease renews in March; the lighthouse crew pays the tariff.",
             '["lease","zeppelin"]', None, None, None),
            (ORG_A, "docA2", "Budget review: the migration to per-organization databases needs two sprints.",
             '["budget","planning"]', "Two sprints for the migration", 3, "extractive"),
            (ORG_B, "docB2", "Tariff tables for the zeppelin freight, revised.", '["tariff"]', None, 2, "failed"),
            (ORG_A, "docA3", "A scratch thought deleted before the upgrade (quokka).", '["scratch"]', None, None, None),
            (ORG_A, "docA4", "Lighthouse lamp maintenance: replace the budget bulbs every quarter.", None, None, None,
             "skipped_budget"),
            (ORG_GONE, "docC1", "A thought of a deleted organization about the lighthouse.", '["gone"]', None, None, None),
        ]
        for i, (org, did, content, tags, summary, importance, state) in enumerate(docs):
            await db.execute(
                "INSERT INTO documents (organization_id, id, content, content_hash, source, metadata, summary, tags, "
                "created_at, updated_at, importance, enrichment_state, enriched_at, recall_count, use_weight, use_count, "
                "last_used_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (org, did, content, f"hash-{did}", "slack" if i % 2 else None,
                 json.dumps({"project": "memex", "n": i, "nested": {"ok": True}}), summary, tags, T0 + 10 * i,
                 T0 + 10 * i + 5, importance, state, T0 + 10 * i + 7 if state else None, i, 1.5 * i, i // 2,
                 T0 + 99 if i % 3 == 0 else None))
            out.docs.setdefault(org, []).append(did)
        await db.execute("UPDATE documents SET tags = ? WHERE organization_id = ? AND id = ?",
                         ('["wildlife","census","island"]', ORG_A, "docA1"))  # tag_counts moves by trigger

        chunks = []  # (org, id, kind, parent, ordinal, content, start, end, indexed, mutation)
        for org, did, content, *_ in docs:
            halves = [content[: len(content) // 2], content[len(content) // 2:]]
            for ordinal, piece in enumerate(halves):
                chunks.append((org, f"ch-{did}-{ordinal}", "thought", did, ordinal, piece, None, None,
                               None if did == "docA4" else T0 + 200, "m-17" if did == "docB2" else None))

        convs = {ORG_A: "convA", ORG_B: "convB", ORG_GONE: "convC"}
        said = {
            ORG_A: [("user", "Where is the quokka census?", "raw", "s1"),
                    ("assistant", "At the lighthouse, Monday morning, with the budget approved. " * 4, "gzip+base64", "s1"),
                    ("user", "Thanks, noted for the migration plan.", None, None)],
            ORG_B: [("user", "Is the zeppelin tariff final?", "raw", "2025-10-01"),
                    ("assistant", "Yes, the tariff is final.", "raw", "2025-10-01")],
            ORG_GONE: [("user", "lighthouse?", "raw", None)],
        }
        for org, cid in convs.items():
            msgs = said[org]
            await db.execute(
                "INSERT INTO conversations (organization_id, id, title, metadata, message_count, last_sequence, "
                "append_token, created_at, updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (org, cid, f"chat {cid}", '{"channel":"web"}', len(msgs), len(msgs), "tok-" + cid, T0 + 300, T0 + 330))
            for seq, (role, text, enc, session) in enumerate(msgs, 1):
                stored = _gzip64(text) if enc == "gzip+base64" else text
                await db.execute(
                    "INSERT INTO messages (organization_id, id, conversation_id, sequence, role, content, "
                    "content_encoding, metadata, client_id, created_at, session) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (org, f"msg-{cid}-{seq}", cid, seq, role, stored, enc, '{"lang":"en"}',
                     f"client-{seq}" if seq != 2 else None, T0 + 300 + seq, session))
                chunks.append((org, f"turn-{cid}-{seq}", "turn", cid, seq, f"[{role}]: {text}", seq, seq, T0 + 400, None))
            window = "\n".join(f"[{r}]: {t}" for r, t, _, _ in msgs)
            chunks.append((org, f"win-{cid}-0", "conversation", cid, 0, window, 1, len(msgs), T0 + 400, None))
        chunks.sort(key=lambda c: (c[4], c[0]))  # interleave organizations' pks
        for org, cid, kind, parent, ordinal, content, start, end, indexed, mutation in chunks:
            await db.execute(
                "INSERT INTO chunks (organization_id, id, kind, parent_id, ordinal, content, token_count, start_sequence, "
                "end_sequence, indexed_at, vector_mutation) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (org, cid, kind, parent, ordinal, content, emb.count_tokens(content), start, end, indexed, mutation))

        await db.batch([
            s("INSERT INTO conversation_idempotency (organization_id, key, conversation_id, request_hash, response, "
              "created_at) VALUES (?, ?, ?, ?, ?, ?)", (org, f"idem-{org[-2:]}", convs[org], "f" * 64,
                                                        '{"appended":2}', T0 + 340))
            for org in (ORG_A, ORG_B)
        ] + [
            s("INSERT INTO jobs (organization_id, kind, target_id, state, attempts, run_after, locked_until, "
              "last_error, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", row)
            for row in [(ORG_A, "embed", "docA4", "pending", 0, T0 + 500, None, None, T0 + 500),
                        (ORG_B, "enrich", "docB2", "failed", 5, T0 + 510, None, "model timed out", T0 + 501),
                        (ORG_A, "enrich", "docA2", "done", 1, T0 + 520, T0 + 530, None, T0 + 502),
                        (ORG_B, "embed", "convB", "pending", 1, T0 + 540, T0 + 600, "busy", T0 + 503),
                        (ORG_A, "embed", "docA1", "done", 1, T0 + 550, None, None, T0 + 504),
                        (ORG_GONE, "backfill", "all", "pending", 0, T0, None, None, T0)]
        ] + [
            s("INSERT INTO enrichment_backfill (organization_id, pass, cursor, seed, processed, started_at, updated_at) "
              "VALUES (?, ?, ?, ?, ?, ?, ?)", row)
            for row in [(ORG_A, 2, "docA2", '{"budget":2,"wildlife":1}', 3, T0 + 600, T0 + 610),
                        (ORG_GONE, 1, "", "{}", 0, T0, T0)]
        ] + [
            s("INSERT INTO thought_history (organization_id, id, thought_id, original_id, action, reason, content, "
              "content_hash, source, metadata, summary, tags, original_created_at, original_updated_at, created_at) "
              "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", row)
            for row in [(ORG_A, "hist-a1", "docA2", "docOld", "merged", "same budget topic", "Old budget note",
                         "hash-old", None, "{}", "old", '["budget"]', T0 - 100, T0 - 90, T0 + 700),
                        (ORG_A, "hist-a2", "docA2", None, "merged", None, "Incoming budget detail", "hash-in", "cli",
                         '{"k":1}', None, None, T0 - 80, T0 - 80, T0 + 701),
                        (ORG_B, "hist-b1", "docB2", "docB0", "replaced", "newer tariff", "Tariff v1", "hash-b0", None,
                         "{}", None, '["tariff"]', T0 - 70, T0 - 60, T0 + 702)]
        ] + [
            s("INSERT INTO thought_links (organization_id, from_id, to_id, kind, reason, created_at) "
              "VALUES (?, ?, ?, 'contradicts', ?, ?)", row)
            for row in [(ORG_A, "docA4", "docA2", "bulbs vs budget", T0 + 800), (ORG_A, "docA1", "docA3", None, T0 + 801)]
        ])

        # vectors of every indexed chunk, as the worker wrote them (namespace = organization, id = org:chunk)
        rows = (await db.execute("SELECT c.*, d.tags FROM chunks c LEFT JOIN documents d ON d.organization_id = "
                                 "c.organization_id AND d.id = c.parent_id AND c.kind = 'thought' "
                                 "WHERE c.indexed_at IS NOT NULL ORDER BY c.pk")).rows
        values = await emb.embed([r["content"] for r in rows])
        await index.upsert([Vector(f"{r['organization_id']}:{r['id']}", values[i], r["organization_id"],
                                   {**chunk_metadata(r), "organization_id": r["organization_id"]})
                            for i, r in enumerate(rows)])

        # the life of a deployment: a thought deleted (its chunks, keyword rows, tags, links and jobs go by
        # trigger), jobs finished and pruned (the counter stays ahead), an organization deleted (what cascades
        # goes; its jobs, backfill state and vectors stay behind)
        await db.execute("DELETE FROM documents WHERE organization_id = ? AND id = ?", (ORG_A, "docA3"))
        await index.delete_by_ids([f"{ORG_A}:ch-docA3-0", f"{ORG_A}:ch-docA3-1"])
        await db.execute("DELETE FROM jobs WHERE id = (SELECT MAX(id) FROM jobs WHERE organization_id = ?)", (ORG_A,))
        for _ in range(3):
            await db.execute("INSERT INTO jobs (organization_id, kind, target_id, run_after, created_at) "
                             "VALUES (?, 'embed', 'x', 0, 0)", (ORG_B,))
        await db.execute("DELETE FROM jobs WHERE target_id = 'x'")
        await db.execute("DELETE FROM organizations WHERE id = ?", (ORG_GONE,))
        out.docs[ORG_A].remove("docA3")
    finally:
        await index.close()
        await db.close()
    return out


def _settings(data_dir: Path) -> Settings:
    return Settings(data_dir=data_dir, embedder="hash", run_worker=False, signup_rate_per_hour=100_000,
                    auth_failures_per_minute=100_000, key_rate_per_minute=1_000_000, org_rate_per_minute=1_000_000,
                    auth_address_failures_per_minute=100_000)


async def _start(data_dir: Path) -> list[str]:
    memex = Memex(_settings(data_dir))
    try:
        return await memex.start(worker=False)
    finally:
        await memex.stop()


# -- comparing the converted layout with the legacy files -----------------------------------------------------


def _connect(path: Path) -> sqlite3.Connection:
    assert path.exists(), path
    conn = sqlite3.connect(path)
    conn.row_factory = sqlite3.Row
    return conn


def _tables(conn: sqlite3.Connection) -> dict[str, str]:
    return {r["name"]: r["sql"] for r in conn.execute("SELECT name, sql FROM sqlite_master WHERE type = 'table'")}


def _columns(conn: sqlite3.Connection, table: str) -> list[str]:
    return [r["name"] for r in conn.execute(f'PRAGMA table_info("{table}")')]


#: Columns organization migrations after 0001 added to legacy tables: the converter leaves them to their defaults.
LATER_COLUMNS = {"documents": {"decision"}}


def _rows(conn: sqlite3.Connection, table: str, org: str | None = None) -> list[tuple]:
    """Every row with every legacy column and its rowid, in a stable order (rowid)."""
    cols = ", ".join(f'"{c}"' for c in sorted(set(_columns(conn, table)) - LATER_COLUMNS.get(table, set())))
    where = " WHERE organization_id = ?" if org else ""
    return [tuple(r) for r in conn.execute(f'SELECT rowid, {cols} FROM "{table}"{where} ORDER BY rowid',
                                           (org,) if org else ())]


def _copied_tables(legacy: sqlite3.Connection) -> list[str]:
    tables = _tables(legacy)
    fts = [n for n, sql in tables.items() if "USING fts5" in sql]
    shadows = {f"{n}_{s}" for n in fts for s in ("data", "idx", "content", "docsize", "config")}
    return sorted(n for n in tables if n not in NOT_ROWS and n not in shadows)


def assert_converted(data_dir: Path, legacy_path: Path) -> None:
    """Every row of every table, rowids included; the schemas; the counters; FTS matches; routing; vectors."""
    legacy = _connect(legacy_path)
    control = _connect(data_dir / "control.sqlite3")
    orgs = {org: _connect(data_dir / "orgs" / org / "memex.sqlite3") for org in (ORG_A, ORG_B)}
    fresh_dir = data_dir.parent / (data_dir.name + "-fresh")
    fresh_dir.mkdir(exist_ok=True)
    try:
        fresh_db = SqliteDatabase(fresh_dir / "org.sqlite3")
        asyncio.run(_migrate_and_close(fresh_db))
        fresh = _connect(fresh_dir / "org.sqlite3")
        org_schema = {(r["type"], r["name"], r["sql"]) for r in fresh.execute("SELECT type, name, sql FROM sqlite_master")}
        fresh.close()

        control_tables, org_tables = set(_tables(control)), set(_tables(orgs[ORG_A]))
        copied = _copied_tables(legacy)
        assert {"documents", "chunks", "chunks_fts", "documents_fts", "documents_fts_keys", "jobs", "messages",
                "organizations", "api_keys", "key_revocations"} <= set(copied)
        for table in copied:
            assert (table in control_tables) != (table in org_tables), table
            new = control if table in control_tables else orgs[ORG_A]
            # the same columns, and those later migrations added (empty on every converted row)
            assert sorted(_columns(new, table)) == sorted(set(_columns(legacy, table)) | LATER_COLUMNS.get(table, set())), table
            for column in LATER_COLUMNS.get(table, ()):
                assert new.execute(f'SELECT COUNT(*) FROM "{table}" WHERE "{column}" IS NOT NULL').fetchone()[0] == 0
            if table in control_tables:
                old_rows = _rows(legacy, table)
                if "organization_id" in _columns(legacy, table) and table not in ("llm_usage", "key_revocations"):
                    old_rows = [r for r in old_rows if ORG_GONE not in r]  # cascaded away with its organization
                assert _rows(control, table) == old_rows and old_rows, table
            else:
                for org, conn in orgs.items():
                    expected = _rows(legacy, table, org)
                    assert _rows(conn, table) == expected, (table, org)
                assert any(_rows(legacy, table, org) for org in orgs), f"the test leaves {table} empty"
        # each organization database has exactly the organization schema (triggers re-created as they were)
        for org, conn in orgs.items():
            schema = {(r["type"], r["name"], r["sql"]) for r in conn.execute("SELECT type, name, sql FROM sqlite_master")}
            assert schema == org_schema, org
            assert [r[0] for r in conn.execute("SELECT name FROM d1_migrations")] == [m.name for m in discover(ORG_DIR)]

        # AUTOINCREMENT counters continue from the legacy ones
        legacy_seq = dict(legacy.execute("SELECT name, seq FROM sqlite_sequence").fetchall())
        assert legacy_seq["jobs"] > legacy.execute("SELECT MAX(id) FROM jobs").fetchone()[0]
        for conn in orgs.values():
            assert dict(conn.execute("SELECT name, seq FROM sqlite_sequence"))["jobs"] == legacy_seq["jobs"]
        assert dict(control.execute("SELECT name, seq FROM sqlite_sequence"))["key_revocations"] == \
            legacy_seq["key_revocations"]

        # keyword search finds the same rows, per organization
        for org, conn in orgs.items():
            for word in WORDS[org] + ["quokka", "zeppelin", "census"]:
                for fts in ("chunks_fts", "documents_fts"):
                    old = [r[0] for r in legacy.execute(
                        f"SELECT rowid FROM {fts} WHERE {fts} MATCH ? AND organization_id = ? ORDER BY rowid", (word, org))]
                    new = [r[0] for r in conn.execute(f"SELECT rowid FROM {fts} WHERE {fts} MATCH ? ORDER BY rowid", (word,))]
                    assert new == old, (org, fts, word)
                    if word in WORDS[org] and fts == "chunks_fts":
                        assert new, (org, word)
            assert conn.execute("SELECT COUNT(*) FROM documents_fts").fetchone()[0] == \
                conn.execute("SELECT COUNT(*) FROM documents").fetchone()[0]
            assert conn.execute("SELECT COUNT(*) FROM chunks_fts").fetchone()[0] == \
                conn.execute("SELECT COUNT(*) FROM chunks").fetchone()[0]

        # nothing of the deleted organization was carried over
        for conn in [control, *orgs.values()]:
            for table in _tables(conn):
                if "organization_id" in _columns(conn, table) and table not in ("llm_usage", "key_revocations"):
                    assert not conn.execute(f'SELECT 1 FROM "{table}" WHERE organization_id = ?', (ORG_GONE,)).fetchall()
        assert not (data_dir / "orgs" / ORG_GONE).exists()

        # one routing row per organization
        routes = {r["organization_id"]: dict(r) for r in control.execute("SELECT * FROM org_databases")}
        latest = discover(ORG_DIR)[-1].name
        assert set(routes) == {ORG_A, ORG_B}
        for org, route in routes.items():
            assert (route["backend"], route["location"], route["schema_version"]) == ("sqlite", org, latest)
    finally:
        for conn in [legacy, control, *orgs.values()]:
            conn.close()
        shutil.rmtree(fresh_dir, ignore_errors=True)
    asyncio.run(_assert_vectors(data_dir, legacy_path.with_name("vectors.sqlite3.pre-per-org")))


async def _migrate_and_close(db: SqliteDatabase) -> None:
    await apply_pending(db, ORG_DIR)
    await db.close()


async def _assert_vectors(data_dir: Path, legacy_vectors: Path) -> None:
    emb = HashEmbedder()
    old = LocalVectorIndex(legacy_vectors, dimensions=emb.dimensions, model=emb.model_id)
    try:
        for org in (ORG_A, ORG_B):
            new = LocalVectorIndex(data_dir / "orgs" / org / "vectors.sqlite3", dimensions=emb.dimensions,
                                   model=emb.model_id)
            try:
                ids = await old.ids_in_namespace(org)
                assert ids and await new.ids_in_namespace(org) == ids
                assert (await new.info()).vector_count == len(ids)
                before = {v.id: v for v in await old.get_by_ids(sorted(ids))}
                after = {v.id: v for v in await new.get_by_ids(sorted(ids))}
                assert before.keys() == after.keys()
                for vid, v in before.items():
                    w = after[vid]
                    assert w.namespace == v.namespace == org and vid.startswith(org + ":")
                    assert np.asarray(w.values, dtype=np.float32).tobytes() == np.asarray(v.values, dtype=np.float32).tobytes()
                    assert dict(w.metadata) == dict(v.metadata)
            finally:
                await new.close()
        assert await old.ids_in_namespace(ORG_GONE)  # still in the backup, never carried over
    finally:
        await old.close()


def _snapshot(path: Path) -> bytes:
    return path.read_bytes()


# -- the tests --------------------------------------------------------------------------------------


def test_conversion_copies_every_row_and_vector(tmp_path, caplog):
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    asyncio.run(build_legacy(data_dir))
    caplog.set_level(logging.INFO, logger="memex.convert")
    applied = asyncio.run(_start(data_dir))
    assert applied == []  # the converted control database arrived migrated

    # the legacy files are kept, renamed, as the backup; nothing is left in staging
    assert not (data_dir / "memex.sqlite3").exists() and not (data_dir / "vectors.sqlite3").exists()
    assert (data_dir / "memex.sqlite3.pre-per-org").exists() and (data_dir / "vectors.sqlite3.pre-per-org").exists()
    assert not (data_dir / ".converting").exists()
    assert_converted(data_dir, data_dir / "memex.sqlite3.pre-per-org")

    text = caplog.text
    assert "organizations converted: 2/2" in text
    assert "pre-per-org" in text and "backup" in text
    # the deleted organization's leftovers are named, not silently dropped
    assert "rows of jobs belong to no organization" in text
    assert "rows of enrichment_backfill belong to no organization" in text
    assert "vectors are in no organization's namespace" in text

    # starting again converts nothing and changes nothing
    before = {p: _snapshot(p) for p in (data_dir / "memex.sqlite3.pre-per-org", data_dir / "vectors.sqlite3.pre-per-org")}

    async def refuse(*a, **k):
        raise AssertionError("converted twice")

    mp = pytest.MonkeyPatch()
    try:
        mp.setattr(convert, "convert_data_dir", refuse)
        assert asyncio.run(_start(data_dir)) == []
    finally:
        mp.undo()
    assert {p: _snapshot(p) for p in before} == before
    assert_converted(data_dir, data_dir / "memex.sqlite3.pre-per-org")


def test_conversion_in_small_pages(tmp_path, monkeypatch):
    """Pages of two rows, statements of at most 7 parameters (one row each for wide tables), a batch per
    statement: the keyset paging (row values over organization-leading indexes, rowids, FTS by keys) and the
    statement splitting lose nothing."""
    monkeypatch.setattr(convert_copy, "ROWS_PER_BATCH", 2)
    monkeypatch.setattr(convert_copy, "MAX_PARAMS", 7)
    monkeypatch.setattr(convert_copy, "BATCH_BYTES", 50)
    monkeypatch.setattr(convert, "VECTORS_PER_BATCH", 3)
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    asyncio.run(build_legacy(data_dir))
    asyncio.run(_start(data_dir))
    assert_converted(data_dir, data_dir / "memex.sqlite3.pre-per-org")


def test_crash_mid_conversion_leaves_the_legacy_files_and_the_next_start_converts(tmp_path, monkeypatch):
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    asyncio.run(build_legacy(data_dir))
    seen = []

    def crash(org_id, done, total):
        seen.append((org_id, done, total))
        raise RuntimeError("power cut")

    monkeypatch.setattr(convert, "after_organization", crash)
    with pytest.raises(RuntimeError, match="power cut"):
        asyncio.run(_start(data_dir))
    assert seen == [(ORG_A, 1, 2)]
    # the legacy files are where they were; the half-built layout is only in staging; control is still blank
    assert (data_dir / "memex.sqlite3").exists() and (data_dir / "vectors.sqlite3").exists()
    assert not (data_dir / "memex.sqlite3.pre-per-org").exists()
    assert (data_dir / ".converting" / "orgs" / ORG_A / "memex.sqlite3").exists()
    assert not (data_dir / "orgs").exists()
    assert convert._blank(data_dir / "control.sqlite3")
    # as if a crash had also come between the two renames: an orgs/ beside an unconverted layout
    (data_dir / "orgs" / ORG_A).mkdir(parents=True)
    (data_dir / "orgs" / ORG_A / "memex.sqlite3").write_bytes(b"half")

    monkeypatch.undo()
    assert asyncio.run(_start(data_dir)) == []
    assert_converted(data_dir, data_dir / "memex.sqlite3.pre-per-org")

    # a crash after the control database landed, before the backups: the next start only finishes the renames
    for name in ("memex.sqlite3", "vectors.sqlite3"):
        (data_dir / f"{name}.pre-per-org").rename(data_dir / name)
    (data_dir / ".converting").mkdir()
    control = _snapshot(data_dir / "control.sqlite3")
    asyncio.run(_start(data_dir))
    assert not (data_dir / ".converting").exists() and not (data_dir / "memex.sqlite3").exists()
    assert (data_dir / "memex.sqlite3.pre-per-org").exists() and (data_dir / "vectors.sqlite3.pre-per-org").exists()
    assert _snapshot(data_dir / "control.sqlite3") == control


def test_a_directory_of_an_older_release_is_migrated_first(tmp_path):
    """A legacy database stopped at 0004 (before documents_fts, the 0009 rebuild and revocations) is brought to
    0010 first, then converted; a directory without organizations converts to an empty layout."""
    data_dir = tmp_path / "data"
    old_dir = tmp_path / "legacy-0004"
    old_dir.mkdir(parents=True)
    data_dir.mkdir()
    for m in discover(LEGACY_DIR)[:4]:
        shutil.copy(m.path, old_dir / m.name)

    async def build():
        db = SqliteDatabase(data_dir / "memex.sqlite3")
        assert len(await apply_pending(db, old_dir)) == 4
        await db.batch([
            Statement("INSERT INTO organizations (id, slug, name, created_at) VALUES (?, 'alpha', 'Alpha', ?)", (ORG_A, T0)),
            Statement("INSERT INTO documents (organization_id, id, content, content_hash, tags, created_at, updated_at) "
                      "VALUES (?, 'old1', 'An old quokka note', 'h1', '[\"old\"]', ?, ?)", (ORG_A, T0, T0)),
            Statement("INSERT INTO chunks (organization_id, id, kind, parent_id, ordinal, content, token_count) "
                      "VALUES (?, 'c-old1', 'thought', 'old1', 0, 'An old quokka note', 4)", (ORG_A,)),
        ])
        await db.close()

    asyncio.run(build())
    asyncio.run(_start(data_dir))
    backup = _connect(data_dir / "memex.sqlite3.pre-per-org")
    org = _connect(data_dir / "orgs" / ORG_A / "memex.sqlite3")
    try:
        assert [r[0] for r in backup.execute("SELECT name FROM d1_migrations ORDER BY id")] == \
            [m.name for m in discover(LEGACY_DIR)]
        assert [tuple(r) for r in org.execute("SELECT document_id FROM documents_fts WHERE documents_fts MATCH 'quokka'")] \
            == [("old1",)]
        assert [tuple(r) for r in org.execute("SELECT tag, uses FROM tag_counts")] == [("old", 1)]
        assert [r[0] for r in org.execute("SELECT rowid FROM chunks_fts WHERE chunks_fts MATCH 'quokka'")] == \
            [r[0] for r in backup.execute("SELECT rowid FROM chunks_fts WHERE chunks_fts MATCH 'quokka'")]
    finally:
        backup.close()
        org.close()

    empty = tmp_path / "empty"
    empty.mkdir()
    asyncio.run(_migrate_legacy_and_close(SqliteDatabase(empty / "memex.sqlite3")))
    asyncio.run(_start(empty))
    control = _connect(empty / "control.sqlite3")
    try:
        assert control.execute("SELECT COUNT(*) FROM org_databases").fetchone()[0] == 0
        assert control.execute("SELECT COUNT(*) FROM d1_migrations").fetchone()[0] == len(discover(CONTROL_DIR))
    finally:
        control.close()
    assert (empty / "orgs").is_dir() and not list((empty / "orgs").iterdir())
    assert (empty / "memex.sqlite3.pre-per-org").exists() and not (empty / "vectors.sqlite3.pre-per-org").exists()


async def _migrate_legacy_and_close(db: SqliteDatabase) -> None:
    await apply_pending(db, LEGACY_DIR)
    await db.close()


def test_a_writer_still_using_the_legacy_database_stops_the_conversion(tmp_path, monkeypatch):
    """An older server still writing to memex.sqlite3 would lose what it writes during the copy: the conversion
    refuses instead, moving nothing, and goes through once the writer is gone."""
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    asyncio.run(build_legacy(data_dir))
    monkeypatch.setattr(convert, "LEGACY_LOCK_WAIT", 0.2)
    writer = sqlite3.connect(data_dir / "memex.sqlite3", isolation_level=None)
    try:
        writer.execute("BEGIN IMMEDIATE")
        writer.execute("UPDATE llm_usage SET calls = calls + 1 WHERE organization_id = ?", (ORG_A,))
        with pytest.raises(convert.ConversionError, match="another process"):
            asyncio.run(_start(data_dir))
        assert not (data_dir / "orgs").exists() and convert._blank(data_dir / "control.sqlite3")
        writer.execute("COMMIT")
    finally:
        writer.close()
    asyncio.run(_start(data_dir))
    assert_converted(data_dir, data_dir / "memex.sqlite3.pre-per-org")


def test_a_lost_column_stops_the_conversion_before_anything_moves(tmp_path):
    data_dir = tmp_path / "data"
    data_dir.mkdir()

    async def build():
        db = SqliteDatabase(data_dir / "memex.sqlite3")
        await apply_pending(db, LEGACY_DIR)
        await db.execute("ALTER TABLE documents ADD COLUMN color TEXT")
        await db.execute("CREATE TABLE operator_notes (id INTEGER PRIMARY KEY, note TEXT)")
        await db.close()

    asyncio.run(build())
    with pytest.raises(convert.ConversionError) as err:
        asyncio.run(_start(data_dir))
    assert "'color'" in str(err.value) and "operator_notes" in str(err.value)
    assert (data_dir / "memex.sqlite3").exists() and not (data_dir / "orgs").exists()
    assert convert._blank(data_dir / "control.sqlite3")


def test_converted_data_is_served_over_http_with_the_old_keys(tmp_path):
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    legacy = asyncio.run(build_legacy(data_dir))
    memex = Memex(_settings(data_dir))
    with serve(create_app(memex=memex, start_worker=False)) as base:  # the lifespan's start converts
        assert (data_dir / "memex.sqlite3.pre-per-org").exists()

        def client(key: str) -> httpx.Client:
            return httpx.Client(base_url=base, timeout=30, headers={"Authorization": f"Bearer {key}"})

        with client(legacy.keys["a-main"]) as a:
            r = a.get("/v1/org")
            assert r.status_code == 200, r.text
            assert ORG_A in r.text
            r = a.post("/v1/search", json={"query": "quokka census", "min_score": 0})
            assert r.status_code == 200, r.text
            ids = [h["document_id"] for h in r.json()["results"]]
            assert "docA1" in ids, r.json()
            r = a.get("/v1/thoughts/docA2")
            assert r.status_code == 200 and "per-organization databases" in r.text, r.text
            # writes land in the converted database: triggers and counters work there
            r = a.post("/v1/thoughts", json={"content": "Quokka census moved to Tuesday at the pier."})
            assert r.status_code == 201, r.text
            new_id = r.json()["id"]
        with client(legacy.keys["b-main"]) as b:
            r = b.post("/v1/search", json={"query": "quokka census", "min_score": 0})
            assert r.status_code == 200, r.text
            assert not {h["document_id"] for h in r.json()["results"]} & {"docA1", "docA2", new_id}
            r = b.post("/v1/search", json={"query": "zeppelin tariff", "min_score": 0})
            assert {"docB1", "docB2"} & {h["document_id"] for h in r.json()["results"]}, r.json()
        with client(legacy.keys["a-revoked"]) as revoked:
            assert revoked.get("/v1/org").status_code == 401
        with client(legacy.keys["gone"]) as gone:
            assert gone.get("/v1/org").status_code == 401

    conn = _connect(data_dir / "orgs" / ORG_A / "memex.sqlite3")
    try:
        legacy_conn = _connect(data_dir / "memex.sqlite3.pre-per-org")
        seq = legacy_conn.execute("SELECT seq FROM sqlite_sequence WHERE name = 'jobs'").fetchone()[0]
        legacy_conn.close()
        new_jobs = [r[0] for r in conn.execute("SELECT id FROM jobs WHERE target_id = ?", (new_id,))]
        assert new_jobs and min(new_jobs) > seq  # job ids continue past every legacy id
        hits = [r[0] for r in conn.execute(
            "SELECT k.document_id FROM documents_fts JOIN documents_fts_keys k ON k.pk = documents_fts.rowid "
            "WHERE documents_fts MATCH 'pier'")]
        assert hits == [new_id]  # the re-created triggers index new thoughts
    finally:
        conn.close()
