"""Moving an organization's database between stores (services/storage/move_org.py, what `memex cloudflare
migrate` runs per organization): a REST-backed deployment's D1 databases (on the Cloudflare emulator), filled
through the real API, are moved into fresh stores; every row of every table (rowids included), the keyword index
and the AUTOINCREMENT counters arrive unchanged; a run interrupted half way is completed by running again; a
destination missing a column is refused before anything is written."""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

import httpx
import pytest

from api.composition.cloudflare import api_for
from services.adapters.cloudflare import D1Database
from services.adapters.sqlite import SqliteDatabase
from services.ports import SqlDatabase
from services.storage.convert_plan import ConversionError, quote
from services.storage.migrate import ORG_DIR, apply_pending
from services.storage.move_org import database_tables, move_database
from tests.conftest import backend_live, signup
from tests.test_org_lifecycle import settle


@pytest.fixture(scope="module")
def deployment():
    """A REST-backed deployment (D1 per organization on the emulator) with two organizations' thoughts,
    conversations and a deleted thought's leftovers, settled (no job left, every vector write confirmed)."""
    with tempfile.TemporaryDirectory() as tmp, backend_live("cloudflare", Path(tmp)) as server:
        orgs = [signup(server, "move") for _ in range(2)]
        with server.client() as c:
            for n, org in enumerate(orgs):
                h = {"Authorization": f"Bearer {org.key}"}
                ids = []
                for i in range(12):
                    r = c.post("/v1/thoughts", headers=h, json={
                        "content": f"Org {n} note {i}: the heron nests by the quarry lake, ticket MX-{n}{i}",
                        "metadata": {"batch": f"t{i % 3}"}, "wait": True})
                    assert r.status_code == 201, r.text
                    ids.append(r.json()["id"])
                assert c.delete(f"/v1/thoughts/{ids[0]}", headers=h).status_code == 204
                conv = c.post("/v1/conversations", headers=h, json={"title": f"planning {n}"}).json()
                r = c.post(f"/v1/conversations/{conv['id']}/messages", headers=h, json={"messages": [
                    {"role": "user", "content": f"Where does the heron of org {n} nest?"},
                    {"role": "assistant", "content": "By the quarry lake, under the willows."}]})
                assert r.status_code in (200, 201), r.text
        for org in orgs:  # the service quiet first: a move reads the source while its worker would still confirm
            settle(server, org)  # vectors and embed the conversation, and the copy compares every row with it
        server.orgs = orgs
        yield server


async def _source(server, org_id: str) -> tuple[SqlDatabase, httpx.AsyncClient]:
    """The organization's D1 database over the REST API (its uuid from the control database's routing row)."""
    http = httpx.AsyncClient(timeout=30)
    api = api_for(server.memex.settings, http)
    control = D1Database(api, server.memex.settings.cloudflare_d1_database_id)
    route = (await control.execute("SELECT location FROM org_databases WHERE organization_id = ?", (org_id,))).rows[0]
    return D1Database(api, route["location"]), http


async def _dump(db: SqlDatabase) -> dict[str, list[dict]]:
    """Every row of every data table, rowids included, in rowid order."""
    tables = (await db.execute(
        "SELECT name, sql FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%' "
        "AND name NOT LIKE '_cf_%' AND name <> 'd1_migrations' ORDER BY name")).rows
    out = {}
    for t in tables:
        if t["name"].endswith(("_data", "_idx", "_content", "_docsize", "_config")):
            continue
        rows = (await db.execute(f"SELECT rowid AS __r, * FROM {quote(t['name'])} ORDER BY rowid")).rows
        out[t["name"]] = rows
    return out


async def _fresh_org_db(path: Path) -> SqliteDatabase:
    db = SqliteDatabase(path)
    await apply_pending(db, ORG_DIR)
    return db


def test_every_row_moves_and_an_interrupted_move_completes(deployment, tmp_path):
    async def go():
        for org in deployment.orgs:
            src, http = await _source(deployment, org.id)
            try:
                dest = await _fresh_org_db(tmp_path / f"{org.id}.sqlite3")
                # An interrupted earlier run: some rows already there.
                tables = await database_tables(src, dest)
                assert {"documents", "chunks", "chunks_fts", "messages"} <= {t.name for t in tables}
                first = (await src.execute("SELECT * FROM documents ORDER BY rowid LIMIT 1")).rows[0]
                cols = list(first)
                await dest.execute(f"INSERT INTO documents ({', '.join(map(quote, cols))}) VALUES "
                                   f"({', '.join('?' * len(cols))})", [first[c] for c in cols])

                counts = await move_database(src, dest, where=org.id)
                assert counts["documents"] == 11 and counts["messages"] == 2, counts
                assert counts["chunks"] >= 11 and counts["chunks_fts"] == counts["chunks"], counts

                before, after = await _dump(src), await _dump(dest)
                assert before.keys() <= after.keys()
                for name, rows in before.items():
                    assert after[name] == rows, name
                # The keyword index answers the same in both.
                q = "SELECT rowid FROM chunks_fts WHERE chunks_fts MATCH 'heron' ORDER BY rowid"
                assert (await dest.execute(q)).rows == (await src.execute(q)).rows != []
                seq = "SELECT name, seq FROM sqlite_sequence ORDER BY name"
                assert (await dest.execute(seq)).rows == (await src.execute(seq)).rows

                # Running again (the routing switch was lost, say) converges on the same copy.
                assert await move_database(src, dest, where=org.id) == counts
                assert await _dump(dest) == after
                await dest.close()
            finally:
                await http.aclose()

    asyncio.run(go())


def test_a_destination_missing_a_column_is_refused_untouched(deployment, tmp_path):
    async def go():
        org = deployment.orgs[0]
        src, http = await _source(deployment, org.id)
        try:
            dest = SqliteDatabase(tmp_path / "narrow.sqlite3")
            await dest.executescript("CREATE TABLE documents (id TEXT PRIMARY KEY)")
            with pytest.raises(ConversionError, match="documents"):
                await move_database(src, dest)
            assert (await dest.execute("SELECT COUNT(*) AS n FROM documents")).rows[0]["n"] == 0
            await dest.close()
        finally:
            await http.aclose()

    asyncio.run(go())


def test_migrate_moves_every_organization_switches_its_route_and_resumes(deployment, tmp_path):
    """migrate_to_worker between real stores (D1 on the emulator -> local SQLite standing in for the Worker's
    control database and Durable Objects, both through the same port): every organization's rows, the control rows
    copied once, routing switched last, a second run skips what is done."""
    from services.storage.worker_migrate import migrate_to_worker

    async def go():
        http = httpx.AsyncClient(timeout=30)
        api = api_for(deployment.memex.settings, http)
        source_control = D1Database(api, deployment.memex.settings.cloudflare_d1_database_id)
        dest_control = SqliteDatabase(tmp_path / "control.sqlite3")
        opened: dict[str, SqliteDatabase] = {}

        def open_dest(location: str) -> SqliteDatabase:
            return opened.setdefault(location, SqliteDatabase(tmp_path / f"{location.replace(':', '_')}.sqlite3"))

        for org in deployment.orgs:
            await apply_pending(open_dest(f"org:{org.id}"), ORG_DIR)
        try:
            only = [o.id for o in deployment.orgs]
            report = await migrate_to_worker(source_control, lambda uuid: D1Database(api, uuid), dest_control, open_dest,
                                             vector_index=deployment.memex.settings.cloudflare_vectorize_index,
                                             open_scratch=SqliteDatabase, only=only)
            assert report.layout == "per-organization" and report.control == "copied"
            assert sorted(report.moved) == sorted(only)
            routes = {r["organization_id"]: r for r in (await dest_control.execute("SELECT * FROM org_databases")).rows}
            for org in deployment.orgs:
                assert routes[org.id]["backend"] == "worker" and routes[org.id]["location"] == f"org:{org.id}"
                src = D1Database(api, (await source_control.execute(
                    "SELECT location FROM org_databases WHERE organization_id = ?", (org.id,))).rows[0]["location"])
                before, after = await _dump(src), await _dump(opened[f"org:{org.id}"])
                assert before["documents"] and all(after[name] == rows for name, rows in before.items())
            keys = "SELECT id, organization_id, key_hash FROM api_keys ORDER BY id"
            assert (await dest_control.execute(keys)).rows == (await source_control.execute(keys)).rows

            again = await migrate_to_worker(source_control, lambda uuid: D1Database(api, uuid), dest_control, open_dest,
                                            vector_index=deployment.memex.settings.cloudflare_vectorize_index,
                                            open_scratch=SqliteDatabase, only=only)
            assert again.control == "already copied" and again.moved == {} and sorted(again.skipped) == sorted(only)
        finally:
            for db in opened.values():
                await db.close()
            await dest_control.close()
            await http.aclose()

    asyncio.run(go())


def test_migrate_a_shared_database_splits_it_by_organization(tmp_path):
    """The release before per-organization databases kept every organization in one database: migrate_to_worker
    copies its control rows once and each live organization's rows into that organization's store (a deleted
    organization's leftovers stay behind), routing rows written last; the second run moves nothing."""
    from services.storage.worker_migrate import migrate_to_worker
    from tests.test_convert_legacy import ORG_A, ORG_B, build_legacy

    async def go():
        legacy_dir = tmp_path / "legacy"
        legacy_dir.mkdir()
        await build_legacy(legacy_dir)
        legacy = SqliteDatabase(legacy_dir / "memex.sqlite3")
        dest_control = SqliteDatabase(tmp_path / "control.sqlite3")
        opened: dict[str, SqliteDatabase] = {}

        def open_dest(location: str) -> SqliteDatabase:
            return opened.setdefault(location, SqliteDatabase(tmp_path / f"{location.replace(':', '_')}.sqlite3"))

        for org in (ORG_A, ORG_B):
            await apply_pending(open_dest(f"org:{org}"), ORG_DIR)
        try:
            report = await migrate_to_worker(legacy, lambda uuid: legacy, dest_control, open_dest,
                                             vector_index="memex-test", open_scratch=SqliteDatabase)
            assert report.layout == "shared" and report.control == "copied"
            assert sorted(report.moved) == sorted([ORG_A, ORG_B])
            for org in (ORG_A, ORG_B):
                db = opened[f"org:{org}"]
                for table in ("documents", "chunks", "messages"):
                    want = (await legacy.execute(f"SELECT COUNT(*) AS n FROM {table} WHERE organization_id = ?",
                                                 (org,))).rows[0]["n"]
                    got = (await db.execute(f"SELECT COUNT(*) AS n FROM {table}")).rows[0]["n"]
                    assert got == want, (org, table)
                    assert got or table == "messages", (org, table)
                ids = "SELECT id, content FROM documents WHERE organization_id = ? ORDER BY id"
                assert (await db.execute(ids, (org,))).rows == (await legacy.execute(ids, (org,))).rows
            routes = (await dest_control.execute("SELECT organization_id, backend, location FROM org_databases "
                                                 "ORDER BY organization_id")).rows
            assert routes == [{"organization_id": o, "backend": "worker", "location": f"org:{o}"}
                              for o in sorted([ORG_A, ORG_B])]
            again = await migrate_to_worker(legacy, lambda uuid: legacy, dest_control, open_dest,
                                            vector_index="memex-test", open_scratch=SqliteDatabase)
            assert again.moved == {} and sorted(again.skipped) == sorted([ORG_A, ORG_B])
        finally:
            for db in opened.values():
                await db.close()
            await dest_control.close()
            await legacy.close()

    asyncio.run(go())
