import { describe, expect, it } from "vitest";
import { runInDurableObject } from "cloudflare:test";
import { applyMigrations, isWrite, type OrgStore } from "../src/org";
import { ORG_MIGRATIONS } from "../src/generated/migrations";
import { rpc, sql, testEnv, uniqueOrg } from "./helpers";

const stub = (org: string) => testEnv.ORG.get(testEnv.ORG.idFromName(org));

describe("sql.batch on an organization's Durable Object", () => {
  it("round-trips scalars and blobs ({\"$b64\"}), with changes and last_row_id", async () => {
    const db = `org:${uniqueOrg()}`;
    const bytes = new Uint8Array([0, 1, 2, 250, 255, 128]);
    const b64 = btoa(String.fromCharCode(...bytes));
    const res = await sql(db, [
      { sql: "CREATE TABLE t(id INTEGER PRIMARY KEY, s TEXT, r REAL, b BLOB, n)" },
      { sql: "INSERT INTO t(s, r, b, n) VALUES (?, ?, ?, ?)", params: ["héllo", 2.5, { $b64: b64 }, null] },
      { sql: "INSERT INTO t(s, r, b, n) VALUES (?, ?, ?, ?)", params: ["x", 3, { $b64: "" }, true] },
      { sql: "SELECT id, s, r, b, n, typeof(r) AS tr, typeof(b) AS tb, typeof(n) AS tn FROM t ORDER BY id" },
      { sql: "UPDATE t SET s = s || '!'" },
    ]);
    expect(res[1]).toMatchObject({ changes: 1, last_row_id: 1, columns: [], rows: [] });
    expect(res[2]).toMatchObject({ changes: 1, last_row_id: 2 });
    expect(res[3].columns).toEqual(["id", "s", "r", "b", "n", "tr", "tb", "tn"]);
    expect(res[3].rows).toEqual([
      [1, "héllo", 2.5, { $b64: b64 }, null, "real", "blob", "null"],
      [2, "x", 3, { $b64: "" }, 1, "real", "blob", "integer"],
    ]);
    expect(res[4].changes).toBe(2);
    const again = await sql(db, [{ sql: "SELECT b FROM t WHERE b = ?", params: [{ $b64: b64 }] }]);
    expect(again[0].rows).toEqual([[{ $b64: b64 }]]);
  });

  it("binds integral numbers as INTEGER (LIMIT ? works)", async () => {
    const db = `org:${uniqueOrg()}`;
    const res = await sql(db, [{ sql: "SELECT typeof(?) AS a, typeof(?) AS b, 1 LIMIT ?", params: [3, 3.5, 1] }]);
    expect(res[0].rows).toEqual([["integer", "real", 1]]);
  });

  it("counts trigger and cascade rows in changes, like D1's meta.changes", async () => {
    const org = uniqueOrg();
    const db = `org:${org}`;
    const res = await sql(db, [
      { sql: "INSERT INTO chunks(organization_id, id, kind, parent_id, ordinal, content, token_count) VALUES (?, 'c1', 'thought', 'd1', 0, 'alpha', 1)", params: [org] },
    ]);
    // the row in chunks + its chunks_fts row (trigger)
    expect(res[0].changes).toBeGreaterThanOrEqual(1);
  });

  it("answers 0 changes for a write that changed nothing, even after an FTS5-indexed insert", async () => {
    const org = uniqueOrg();
    const insert = {
      sql: "INSERT INTO documents (organization_id, id, content, content_hash, created_at, updated_at) " +
        "VALUES (?, 't1', 'heron by the lake', 'h1', 1, 1) ON CONFLICT DO NOTHING",
      params: [org],
    };
    const res = await sql(`org:${org}`, [insert, insert, { sql: "SELECT COUNT(*) FROM documents", params: [] }]);
    expect(res[0].changes).toBeGreaterThanOrEqual(1); // the row, and its trigger rows
    expect(res[1].changes).toBe(0); // the same row again: nothing inserted (the importer's duplicate check)
    expect(res[2].changes).toBe(0); // a read never reports changes
    expect(res[2].rows).toEqual([[1]]);
  });

  it("tells writes from reads", () => {
    expect(isWrite("INSERT INTO t VALUES (1)")).toBe(true);
    expect(isWrite("  -- note\n update t set x = 1")).toBe(true);
    expect(isWrite("WITH k AS (SELECT 1) DELETE FROM t WHERE id IN k")).toBe(true);
    expect(isWrite("SELECT * FROM t")).toBe(false);
    expect(isWrite("WITH k AS (SELECT 1) SELECT * FROM k")).toBe(false);
  });

  it("runs one sql.batch as one transaction: a failing statement leaves nothing behind", async () => {
    const db = `org:${uniqueOrg()}`;
    await sql(db, [{ sql: "CREATE TABLE u(id TEXT PRIMARY KEY)" }]);
    const { status, json } = await rpc({
      v: 1,
      ops: [{ op: "sql.batch", db, statements: [{ sql: "INSERT INTO u VALUES ('a')" }, { sql: "INSERT INTO u VALUES ('a')" }] }],
    });
    expect(status).toBe(200);
    expect(json.results[0].ok).toBe(false);
    expect(json.results[0].error.code).toBe("sql_error");
    expect(json.results[0].error.message).toMatch(/UNIQUE constraint failed/);
    expect(json.results[0].error.statement).toBe(1);
    expect((await sql(db, [{ sql: "SELECT count(*) FROM u" }]))[0].rows).toEqual([[0]]);
  });

  it("atomic request: adjacent ops of one database roll back together, later ops are aborted", async () => {
    const db = `org:${uniqueOrg()}`;
    await sql(db, [{ sql: "CREATE TABLE u(id TEXT PRIMARY KEY)" }]);
    const { json } = await rpc({
      v: 1,
      atomic: true,
      ops: [
        { op: "sql.batch", db, statements: [{ sql: "INSERT INTO u VALUES ('a')" }] },
        { op: "sql.batch", db, statements: [{ sql: "INSERT INTO u VALUES ('b')" }, { sql: "INSERT INTO nope VALUES (1)" }] },
        { op: "sql.batch", db, statements: [{ sql: "INSERT INTO u VALUES ('c')" }] },
        { op: "ping" },
      ],
    });
    expect(json.results.map((r: any) => (r.ok ? "ok" : r.error.code))).toEqual(["rolled_back", "sql_error", "aborted", "aborted"]);
    expect(json.results[1].error.message).toMatch(/no such table: nope/);
    expect((await sql(db, [{ sql: "SELECT count(*) FROM u" }]))[0].rows).toEqual([[0]]);
  });

  it("non-atomic request: each op stands alone", async () => {
    const db = `org:${uniqueOrg()}`;
    await sql(db, [{ sql: "CREATE TABLE u(id TEXT PRIMARY KEY)" }]);
    const { json } = await rpc({
      v: 1,
      ops: [
        { op: "sql.batch", db, statements: [{ sql: "INSERT INTO u VALUES ('a')" }] },
        { op: "sql.batch", db, statements: [{ sql: "INSERT INTO nope VALUES (1)" }] },
        { op: "sql.batch", db, statements: [{ sql: "INSERT INTO u VALUES ('c')" }] },
      ],
    });
    expect(json.results.map((r: any) => r.ok)).toEqual([true, false, true]);
    expect((await sql(db, [{ sql: "SELECT id FROM u ORDER BY id" }]))[0].rows).toEqual([["a"], ["c"]]);
  });

  it("sql.script runs several statements (triggers included) atomically", async () => {
    const db = `org:${uniqueOrg()}`;
    const script = `CREATE TABLE s1(x); CREATE TABLE s2(x);
      CREATE TRIGGER s1_copy AFTER INSERT ON s1 BEGIN INSERT INTO s2 VALUES (new.x * 2); END;
      INSERT INTO s1 VALUES (21);`;
    const { json } = await rpc({ v: 1, ops: [{ op: "sql.script", db, sql: script }] });
    expect(json.results[0]).toEqual({ ok: true });
    expect((await sql(db, [{ sql: "SELECT x FROM s2" }]))[0].rows).toEqual([[42]]);
    const bad = await rpc({ v: 1, ops: [{ op: "sql.script", db, sql: "CREATE TABLE s3(x); INSERT INTO missing VALUES (1);" }] });
    expect(bad.json.results[0].ok).toBe(false);
    const t = await sql(db, [{ sql: "SELECT count(*) FROM sqlite_master WHERE name = 's3'" }]);
    expect(t[0].rows).toEqual([[0]]);
  });

  it("refuses a bad org id with 400 and runs nothing", async () => {
    for (const db of ["org:", "org:a/b", "org:" + "x".repeat(65), "org:a b", "other"]) {
      const { status, json } = await rpc({ v: 1, ops: [{ op: "ping" }, { op: "sql.batch", db, statements: [{ sql: "SELECT 1" }] }] });
      expect(status, db).toBe(400);
      expect(json.error.code).toMatch(/bad_org_id|invalid_request/);
    }
    const { json } = await rpc({ v: 1, ops: [{ op: "sql.batch", db: "org:a/b", statements: [] }] });
    expect(json.error.code).toBe("bad_org_id");
  });

  it("refuses malformed ops with 400 before running any", async () => {
    const db = `org:${uniqueOrg()}`;
    const { status, json } = await rpc({
      v: 1,
      ops: [{ op: "sql.script", db, sql: "CREATE TABLE should_not_exist(x)" }, { op: "nope" }],
    });
    expect(status).toBe(400);
    expect(json.error.code).toBe("unknown_op");
    const t = await sql(db, [{ sql: "SELECT count(*) FROM sqlite_master WHERE name = 'should_not_exist'" }]);
    expect(t[0].rows).toEqual([[0]]);
  });
});

describe("org migrations inside the Durable Object", () => {
  it("applies every migrations/org file on first use, once, recorded in d1_migrations", async () => {
    const org = uniqueOrg();
    await sql(`org:${org}`, [{ sql: "SELECT 1" }]);
    const names = ORG_MIGRATIONS.map((m) => m.name);
    const rows = (await sql(`org:${org}`, [{ sql: "SELECT id, name, applied_at FROM d1_migrations ORDER BY id" }]))[0].rows;
    expect(rows.map((r: unknown[]) => r[1])).toEqual(names);
    expect(rows.every((r: unknown[]) => typeof r[2] === "string" && (r[2] as string).length > 0)).toBe(true);
    // the schema is there (tables of 0001 and 0002)
    const t = await sql(`org:${org}`, [{ sql: "SELECT name FROM sqlite_master WHERE name IN ('documents','chunks_fts','knowledge_entries') ORDER BY name" }]);
    expect(t[0].rows.map((r: unknown[]) => r[0])).toEqual(["chunks_fts", "documents", "knowledge_entries"]);
    // a second use (and a fresh instance of the object) applies nothing again
    await sql(`org:${org}`, [{ sql: "SELECT 1" }]);
    await runInDurableObject(stub(org), (_inst: OrgStore, state) => {
      expect(applyMigrations(state.storage, ORG_MIGRATIONS)).toEqual([]);
    });
    const again = (await sql(`org:${org}`, [{ sql: "SELECT count(*) FROM d1_migrations" }]))[0].rows;
    expect(again).toEqual([[names.length]]);
  });

  it("an upgrade that bundles a new file applies just that file, and a failing file rolls back", async () => {
    const org = uniqueOrg();
    await sql(`org:${org}`, [{ sql: "SELECT 1" }]);
    await runInDurableObject(stub(org), (_inst: OrgStore, state) => {
      const next = [...ORG_MIGRATIONS, { name: "9998_upgrade.sql", sql: "CREATE TABLE upgraded(x);\nINSERT INTO upgraded VALUES (1);" }];
      expect(applyMigrations(state.storage, next)).toEqual(["9998_upgrade.sql"]);
      expect(applyMigrations(state.storage, next)).toEqual([]);
      const broken = [...next, { name: "9999_broken.sql", sql: "CREATE TABLE half(x); INSERT INTO nowhere VALUES (1);" }];
      expect(() => applyMigrations(state.storage, broken)).toThrow(/9999_broken.sql/);
      const sqlx = state.storage.sql;
      expect(sqlx.exec("SELECT count(*) AS n FROM sqlite_master WHERE name = 'half'").one().n).toBe(0);
      expect(sqlx.exec("SELECT count(*) AS n FROM d1_migrations WHERE name = '9999_broken.sql'").one().n).toBe(0);
      expect(sqlx.exec("SELECT x FROM upgraded").one().x).toBe(1);
    });
  });
});

describe("FTS5 and bm25 per organization", () => {
  const insertChunk = (org: string, id: string, content: string) => ({
    sql: "INSERT INTO chunks(organization_id, id, kind, parent_id, ordinal, content, token_count) VALUES (?, ?, 'thought', ?, 0, ?, 1)",
    params: [org, id, id, content],
  });
  const bm25 = (org: string) =>
    sql(`org:${org}`, [
      { sql: "SELECT rowid, bm25(chunks_fts) AS score FROM chunks_fts WHERE chunks_fts MATCH ? ORDER BY rowid", params: ["zebra"] },
    ]).then((r) => r[0].rows);

  it("an FTS5 table with bm25 works in a Durable Object", async () => {
    const org = uniqueOrg();
    await sql(`org:${org}`, [
      { sql: "CREATE VIRTUAL TABLE probe USING fts5(body)" },
      { sql: "INSERT INTO probe(body) VALUES ('the zebra runs'), ('a horse'), ('zebra zebra zebra')" },
    ]);
    const r = await sql(`org:${org}`, [{ sql: "SELECT body, bm25(probe) FROM probe WHERE probe MATCH 'zebra' ORDER BY bm25(probe)" }]);
    expect(r[0].rows.map((x: unknown[]) => x[0])).toEqual(["zebra zebra zebra", "the zebra runs"]);
    expect(r[0].rows.every((x: unknown[]) => typeof x[1] === "number" && (x[1] as number) < 0)).toBe(true);
  });

  it("org B's writes leave org A's bm25 scores unchanged", async () => {
    const a = uniqueOrg("a");
    const b = uniqueOrg("b");
    await sql(`org:${a}`, [insertChunk(a, "a1", "the zebra crossed the road"), insertChunk(a, "a2", "a horse in a field"), insertChunk(a, "a3", "zebra stripes")]);
    await sql(`org:${b}`, [insertChunk(b, "b0", "zebra")]);
    const before = await bm25(a);
    expect(before.length).toBe(2);
    // B writes many documents with and without the term: A's document frequencies and lengths do not move
    const many = Array.from({ length: 60 }, (_, i) => insertChunk(b, `b${i + 1}`, i % 2 ? "zebra zebra zebra herd" : "unrelated words only here"));
    await sql(`org:${b}`, many);
    expect(await bm25(a)).toEqual(before);
    // and B's own scores did change (its statistics are its own)
    const bScores = await bm25(b);
    expect(bScores.length).toBe(31);
    // A's write does change A's scores (the control: the comparison can fail)
    await sql(`org:${a}`, [insertChunk(a, "a4", "zebra zebra zebra zebra")]);
    expect(await bm25(a)).not.toEqual(before);
  });
});

describe("the control database (D1 binding CONTROL)", () => {
  it("has its migrations applied and runs batches atomically", async () => {
    const m = await sql("control", [{ sql: "SELECT name FROM d1_migrations ORDER BY id" }]);
    expect(m[0].rows.length).toBeGreaterThanOrEqual(3);
    const { json } = await rpc({
      v: 1,
      atomic: true,
      ops: [
        { op: "sql.script", db: "control", sql: "CREATE TABLE IF NOT EXISTS ctest(id TEXT PRIMARY KEY, b BLOB);" },
        { op: "sql.batch", db: "control", statements: [{ sql: "INSERT INTO ctest VALUES ('x', ?)", params: [{ $b64: "AAEC" }] }] },
        { op: "sql.batch", db: "control", statements: [{ sql: "INSERT INTO ctest VALUES ('x', NULL)" }] },
      ],
    });
    expect(json.results.map((r: any) => (r.ok ? "ok" : r.error.code))).toEqual(["sql_error", "aborted", "aborted"]);
    // nothing of the group stayed (not even the CREATE TABLE)
    const t = await sql("control", [{ sql: "SELECT count(*) FROM sqlite_master WHERE name = 'ctest'" }]);
    expect(t[0].rows).toEqual([[0]]);
    const ok = await rpc({
      v: 1,
      ops: [
        { op: "sql.script", db: "control", sql: "CREATE TABLE IF NOT EXISTS ctest(id TEXT PRIMARY KEY, b BLOB);" },
        { op: "sql.batch", db: "control", statements: [{ sql: "INSERT INTO ctest VALUES ('y', ?)", params: [{ $b64: "AAEC" }] }, { sql: "SELECT id, b FROM ctest" }] },
      ],
    });
    expect(ok.json.results[1].results[0]).toMatchObject({ changes: 1 });
    expect(ok.json.results[1].results[1]).toMatchObject({ columns: ["id", "b"], rows: [["y", { $b64: "AAEC" }]] });
  });
});
