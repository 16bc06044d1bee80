// Splits a SQL script into statements on top-level semicolons: quotes, comments and the BEGIN ... END body of
// CREATE TRIGGER are respected (CASE ... END nests inside it). Used where a script must become a D1 batch
// (the control database's sql.script), so that it runs as one transaction.

export function splitSql(script: string): string[] {
  const out: string[] = [];
  let start = 0;
  let depth = 0; // open BEGIN (trigger body) / CASE blocks
  let words: string[] = []; // first words of the current statement
  let i = 0;
  const n = script.length;
  const flush = (end: number) => {
    const s = script.slice(start, end).trim();
    if (stripComments(s).trim()) out.push(s);
    start = end + 1;
    depth = 0;
    words = [];
  };
  while (i < n) {
    const c = script[i];
    if (c === "-" && script[i + 1] === "-") {
      const e = script.indexOf("\n", i);
      i = e < 0 ? n : e + 1;
    } else if (c === "/" && script[i + 1] === "*") {
      const e = script.indexOf("*/", i + 2);
      i = e < 0 ? n : e + 2;
    } else if (c === "'" || c === '"' || c === "`" || c === "[") {
      const close = c === "[" ? "]" : c;
      let j = i + 1;
      while (j < n) {
        if (script[j] === close) {
          if (close !== "]" && script[j + 1] === close) { j += 2; continue; }
          break;
        }
        j++;
      }
      i = j + 1;
    } else if (/[A-Za-z_]/.test(c)) {
      let j = i + 1;
      while (j < n && /[A-Za-z0-9_$]/.test(script[j])) j++;
      const w = script.slice(i, j).toUpperCase();
      if (words.length < 4) words.push(w);
      const isTrigger = words[0] === "CREATE" && (words[1] === "TRIGGER" || words[2] === "TRIGGER");
      if (w === "CASE" || (w === "BEGIN" && isTrigger)) depth++;
      else if (w === "END" && depth > 0) depth--;
      i = j;
    } else if (c === ";" && depth === 0) {
      flush(i);
      i++;
    } else {
      i++;
    }
  }
  flush(n);
  return out;
}

function stripComments(s: string): string {
  return s.replace(/--[^\n]*/g, "").replace(/\/\*[\s\S]*?\*\//g, "");
}

/**
 * SQLite bindings in workerd (Durable Object `sql.exec`, and miniflare's D1) bind every JavaScript number as REAL,
 * so `3` would be stored as 3.0 (and as the text '3.0' in a TEXT column). The protocol keeps D1's REST meaning —
 * an integral number is an INTEGER — by rewriting each placeholder whose parameter is a safe integer to
 * `CAST(?N AS INTEGER)` (exact for |n| <= 2^53). Other placeholders become `?N` with the same N, so the params
 * array is unchanged. Strings, comments and quoted identifiers are left alone.
 */
export function castIntegerParams(sql: string, params: unknown[]): string {
  if (!params.some((p) => typeof p === "number" && Number.isSafeInteger(p))) return sql;
  let out = "";
  let last = 0;
  let next = 1; // the number a bare "?" takes: one more than the largest assigned so far
  let i = 0;
  const n = sql.length;
  while (i < n) {
    const c = sql[i];
    if (c === "-" && sql[i + 1] === "-") {
      const e = sql.indexOf("\n", i);
      i = e < 0 ? n : e + 1;
    } else if (c === "/" && sql[i + 1] === "*") {
      const e = sql.indexOf("*/", i + 2);
      i = e < 0 ? n : e + 2;
    } else if (c === "'" || c === '"' || c === "`" || c === "[") {
      const close = c === "[" ? "]" : c;
      let j = i + 1;
      while (j < n) {
        if (sql[j] === close) {
          if (close !== "]" && sql[j + 1] === close) { j += 2; continue; }
          break;
        }
        j++;
      }
      i = j + 1;
    } else if (c === "?") {
      let j = i + 1;
      while (j < n && sql[j] >= "0" && sql[j] <= "9") j++;
      const num = j > i + 1 ? Number(sql.slice(i + 1, j)) : next;
      next = Math.max(next, num + 1);
      const p = params[num - 1];
      const rep = typeof p === "number" && Number.isSafeInteger(p) ? `CAST(?${num} AS INTEGER)` : `?${num}`;
      out += sql.slice(last, i) + rep;
      last = j;
      i = j;
    } else {
      i++;
    }
  }
  return out + sql.slice(last);
}
