// The control plane: D1 through the CONTROL binding. Every sql.batch is one D1 batch() (one transaction);
// sql.script is split into statements and sent as one batch too; an atomic group of adjacent control ops is
// one batch for all of their statements.
import { castIntegerParams, splitSql } from "./sqlsplit";
import { decodeParam, encodeCell, OpError } from "./values";
import { sqlMessage } from "./org";
import { fail, type OpResult, type SqlOp, type SqlResult } from "./types";

function statementsOf(db: D1Database, op: SqlOp): D1PreparedStatement[] {
  if (op.op === "sql.script") return splitSql(op.sql).map((s) => db.prepare(s));
  return op.statements.map((st) => {
    const params = (st.params ?? []).map(decodeParam);
    return db.prepare(castIntegerParams(st.sql, params)).bind(...params);
  });
}

function toResult(r: D1Result<Record<string, unknown>>): SqlResult {
  const objs = r.results ?? [];
  // D1's batch() answers rows as objects: columns come from the first row (none when there are no rows).
  const columns = objs.length ? Object.keys(objs[0]) : [];
  return {
    columns,
    rows: objs.map((o) => columns.map((c) => encodeCell(o[c]))),
    changes: r.meta?.changes ?? 0,
    last_row_id: r.meta?.last_row_id ?? 0,
  };
}

async function runBatch(db: D1Database, stmts: D1PreparedStatement[]): Promise<SqlResult[]> {
  if (!stmts.length) return [];
  const res = await db.batch<Record<string, unknown>>(stmts);
  return res.map(toResult);
}

export async function runControl(db: D1Database, ops: SqlOp[], atomic: boolean, firstIndex: number): Promise<OpResult[]> {
  if (!atomic) {
    const out: OpResult[] = [];
    for (const op of ops) {
      try {
        const res = await runBatch(db, statementsOf(db, op));
        out.push(op.op === "sql.script" ? { ok: true } : { ok: true, results: res });
      } catch (e) {
        out.push(fail(errorCode(e), sqlMessage(e)));
      }
    }
    return out;
  }
  const counts: number[] = [];
  const all: D1PreparedStatement[] = [];
  try {
    for (const op of ops) {
      const s = statementsOf(db, op);
      counts.push(s.length);
      all.push(...s);
    }
    const res = await runBatch(db, all);
    let k = 0;
    return ops.map((op, i) => {
      const mine = res.slice(k, k + counts[i]);
      k += counts[i];
      return op.op === "sql.script" ? { ok: true } : { ok: true, results: mine };
    });
  } catch (e) {
    // D1's batch() does not say which statement failed: the group's first op carries the error.
    const where = ops.length > 1 ? `atomic D1 batch of ops ${firstIndex}..${firstIndex + ops.length - 1} failed: ` : "";
    return ops.map((_, i) =>
      i === 0
        ? fail(errorCode(e), where + sqlMessage(e))
        : fail("aborted", "rolled back or not run: the atomic D1 batch this op belonged to failed"),
    );
  }
}

function errorCode(e: unknown): string {
  return e instanceof OpError ? e.code : "sql_error";
}
