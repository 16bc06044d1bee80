// OrgStore: one SQLite-backed Durable Object per organization (ORG.idFromName(org_id)). It applies
// migrations/org/*.sql (bundled at build time) on first use after an upgrade, recording them in its own
// d1_migrations table exactly as wrangler records D1 migrations, then runs the protocol's SQL ops.
import { DurableObject } from "cloudflare:workers";
import { ORG_MIGRATIONS, type Migration } from "./generated/migrations";
import { decodeParam, encodeCell, OpError } from "./values";
import { castIntegerParams } from "./sqlsplit";
import type { Env, OpResult, SqlOp, SqlResult } from "./types";

const MIGRATIONS_TABLE =
  "CREATE TABLE IF NOT EXISTS d1_migrations(id INTEGER PRIMARY KEY AUTOINCREMENT, name TEXT UNIQUE, " +
  "applied_at TIMESTAMP DEFAULT CURRENT_TIMESTAMP NOT NULL)";

export function sqlMessage(e: unknown): string {
  return e instanceof Error ? e.message : String(e);
}

/** Applies the pending migrations of `list` (each file + its d1_migrations row in one transaction). */
export function applyMigrations(storage: DurableObjectStorage, list: Migration[]): string[] {
  const sql = storage.sql;
  sql.exec(MIGRATIONS_TABLE);
  const done = new Set(sql.exec<{ name: string }>("SELECT name FROM d1_migrations").toArray().map((r) => r.name));
  const applied: string[] = [];
  for (const m of list) {
    if (done.has(m.name)) continue;
    try {
      storage.transactionSync(() => {
        sql.exec(m.sql);
        sql.exec("INSERT INTO d1_migrations (name) VALUES (?)", m.name);
      });
    } catch (e) {
      throw new OpError("migration_failed", `org migration ${m.name} failed: ${sqlMessage(e)}`);
    }
    applied.push(m.name);
  }
  return applied;
}

export class OrgStore extends DurableObject<Env> {
  private migrated = false;
  /** Overridable in tests (a later "upgrade" bundles more files). */
  migrations: Migration[] = ORG_MIGRATIONS;

  /** Runs SQL ops in order. atomic: all in one transaction, the first failure rolls every one of them back. */
  run(ops: SqlOp[], atomic: boolean): OpResult[] {
    try {
      this.ensureMigrated();
    } catch (e) {
      const err = e instanceof OpError ? e : new OpError("migration_failed", sqlMessage(e));
      return ops.map(() => ({ ok: false as const, error: { code: err.code, message: err.message } }));
    }
    const storage = this.ctx.storage;
    if (!atomic) {
      return ops.map((op) => {
        try {
          return storage.transactionSync(() => this.one(op));
        } catch (e) {
          return errorResult(e);
        }
      });
    }
    const results: OpResult[] = [];
    let failedAt = -1;
    let failure: OpResult | null = null;
    try {
      storage.transactionSync(() => {
        for (let i = 0; i < ops.length; i++) {
          try {
            results.push(this.one(ops[i]));
          } catch (e) {
            failedAt = i;
            failure = errorResult(e);
            throw e; // rolls the whole group back
          }
        }
      });
    } catch (e) {
      if (failedAt < 0) {
        failedAt = results.length;
        failure = errorResult(e);
      }
      const f = failure as unknown as { error: { code: string; message: string } };
      return ops.map((_, i) =>
        i < failedAt
          ? { ok: false, error: { code: "rolled_back", message: `rolled back: op ${i} ran, but a later op in its transaction failed (${f.error.code}: ${f.error.message})` } }
          : i === failedAt
            ? failure!
            : { ok: false, error: { code: "aborted", message: "not run: an earlier op of this atomic request failed" } },
      );
    }
    return results;
  }

  /** The applied org migrations (names, in order) — for ping and tests. */
  schema(): { applied: string[]; latest: string } {
    this.ensureMigrated();
    const rows = this.ctx.storage.sql.exec<{ name: string }>("SELECT name FROM d1_migrations ORDER BY id").toArray();
    return { applied: rows.map((r) => r.name), latest: rows.length ? rows[rows.length - 1].name : "" };
  }

  private ensureMigrated() {
    if (this.migrated) return;
    applyMigrations(this.ctx.storage, this.migrations);
    this.migrated = true;
  }

  private one(op: SqlOp): OpResult {
    const sql = this.ctx.storage.sql;
    if (op.op === "sql.script") {
      sql.exec(op.sql);
      return { ok: true };
    }
    const results: SqlResult[] = [];
    let total = (sql.exec("SELECT total_changes()").raw().next().value as unknown[])[0] as number;
    for (let k = 0; k < op.statements.length; k++) {
      const st = op.statements[k];
      let rows: unknown[][];
      let columns: string[];
      try {
        const params = (st.params ?? []).map(decodeParam);
        const cur = sql.exec(castIntegerParams(st.sql, params), ...params);
        rows = [...cur.raw()].map((r) => r.map(encodeCell));
        columns = cur.columnNames;
      } catch (e) {
        throw new StatementError(e, k);
      }
      const [t, own, last] = sql.exec("SELECT total_changes(), changes(), last_insert_rowid()").raw().next()
        .value as number[];
      // changes: the statement's delta of total_changes() (trigger and cascade rows included, as SQLite and the
      // emulator report), but only for a statement that itself changed rows: FTS5 writes out a previous statement's
      // pending rows when a later one starts, which would otherwise count as this statement's (an INSERT ... DO
      // NOTHING that inserted nothing must answer 0). A statement that is not a write never reports changes.
      results.push({ columns, rows, changes: isWrite(st.sql) && own > 0 ? t - total : 0, last_row_id: last });
      total = t;
    }
    return { ok: true, results };
  }
}

const WRITE = /^\s*(?:(?:--[^\n]*\n|\/\*[\s\S]*?\*\/)\s*)*(?:INSERT|UPDATE|DELETE|REPLACE)\b/i;
const WITH_WRITE = /^\s*(?:(?:--[^\n]*\n|\/\*[\s\S]*?\*\/)\s*)*WITH\b[\s\S]*\b(?:INSERT|UPDATE|DELETE|REPLACE)\b/i;

/** Whether a statement writes rows (INSERT, UPDATE, DELETE, REPLACE, also after a WITH clause). */
export function isWrite(statement: string): boolean {
  return WRITE.test(statement) || WITH_WRITE.test(statement);
}

/** A statement of a sql.batch failed: the error names it (0-based "statement"). */
class StatementError extends Error {
  constructor(public cause: unknown, public statement: number) {
    super(sqlMessage(cause));
  }
}

function errorResult(e: unknown): OpResult {
  const at = e instanceof StatementError ? { statement: e.statement } : {};
  const inner = e instanceof StatementError ? e.cause : e;
  if (inner instanceof OpError) return { ok: false, error: { code: inner.code, message: inner.message, ...at } };
  return { ok: false, error: { code: "sql_error", message: sqlMessage(inner), ...at } };
}
