import { describe, expect, it } from "vitest";
import { castIntegerParams, splitSql } from "../src/sqlsplit";
import { ORG_MIGRATIONS, CONTROL_MIGRATIONS } from "../src/generated/migrations";
import { sql, uniqueOrg } from "./helpers";

describe("castIntegerParams", () => {
  it("casts integer placeholders only, leaving strings and comments alone", () => {
    expect(castIntegerParams("SELECT ?, '?', ? -- ?\n, ?", [1, "a", 2.5])).toBe("SELECT CAST(?1 AS INTEGER), '?', ?2 -- ?\n, ?3");
    expect(castIntegerParams("SELECT ?2, ?, ?1", [7, "x"])).toBe("SELECT ?2, ?3, CAST(?1 AS INTEGER)");
    expect(castIntegerParams("SELECT ?", ["no ints"])).toBe("SELECT ?");
  });

  it("makes integral numbers INTEGER in the org store and in D1, as D1's REST API does", async () => {
    const q = { sql: "SELECT typeof(?) AS a, typeof(?) AS b, typeof(?) AS c, ? AS d, '?' AS e LIMIT ?", params: [3, 3.5, true, -9007199254740991, 1] };
    for (const db of [`org:${uniqueOrg()}`, "control"]) {
      const r = await sql(db, [q]);
      expect(r[0].rows, db).toEqual([["integer", "real", "integer", -9007199254740991, "?"]]);
    }
    const db = `org:${uniqueOrg()}`;
    await sql(db, [{ sql: "CREATE TABLE k(t TEXT)" }, { sql: "INSERT INTO k VALUES (?)", params: [5] }]);
    expect((await sql(db, [{ sql: "SELECT t FROM k" }]))[0].rows).toEqual([["5"]]);
  });
});

describe("splitSql", () => {
  it("keeps trigger bodies (and CASE ... END inside them) whole", () => {
    const s = splitSql(`CREATE TABLE a(x); -- c; d
      CREATE TRIGGER t AFTER INSERT ON a BEGIN
        UPDATE a SET x = CASE WHEN new.x > 0 THEN 1 ELSE 0 END; DELETE FROM a WHERE x = ';';
      END;
      /* ; */ INSERT INTO a VALUES ('a;b');`);
    expect(s.length).toBe(3);
    expect(s[1]).toMatch(/CREATE TRIGGER t[\s\S]*END$/);
    expect(s[2]).toContain("'a;b'");
  });

  it("splits every migration file into statements SQLite accepts one by one", async () => {
    for (const m of [...ORG_MIGRATIONS, ...CONTROL_MIGRATIONS]) {
      const parts = splitSql(m.sql);
      expect(parts.length, m.name).toBeGreaterThan(0);
    }
    // the control files through the splitter + one D1 batch (what sql.script does) on a fresh org store
    const db = `org:${uniqueOrg()}`;
    for (const m of CONTROL_MIGRATIONS) {
      const r = await sql(db, splitSql(m.sql).map((s) => ({ sql: s })));
      expect(r.length).toBe(splitSql(m.sql).length);
    }
  });
});
