// POST /v1/rpc: authenticate, validate the whole request, then run its ops in order. Adjacent SQL ops of one
// organization go to its Durable Object in one call; adjacent control ops go to D1 together.
import { verify, NonceCache } from "./auth";
import { runControl } from "./control";
import { embed, type Ai } from "./ai";
import { OpError } from "./values";
import { ORG_MIGRATIONS, WORKER_VERSION } from "./generated/migrations";
import { fail, MAX_BODY_BYTES, MAX_OPS, ORG_ID, PROTOCOL, type Env, type OpResult, type SqlOp } from "./types";
import type { VectorStores } from "./vectors";

export interface Deps {
  vectors: VectorStores;
  ai: Ai | null;
  nonces: NonceCache;
  now?: () => number; // unix seconds
}

export class RequestError extends Error {
  constructor(public status: number, public code: string, message: string) {
    super(message);
  }
}

export function jsonResponse(status: number, body: unknown): Response {
  return new Response(JSON.stringify(body), { status, headers: { "content-type": "application/json" } });
}

export function errorResponse(status: number, code: string, message: string): Response {
  return jsonResponse(status, { error: { code, message } });
}

type Op = Record<string, unknown> & { op: string };

const isObj = (v: unknown): v is Record<string, unknown> => typeof v === "object" && v !== null && !Array.isArray(v);
const isStr = (v: unknown): v is string => typeof v === "string";
const isNumArray = (v: unknown): v is number[] => Array.isArray(v) && v.every((x) => typeof x === "number" && Number.isFinite(x));

/** Structural checks of every op before anything runs (a malformed request changes nothing). */
export function validateOp(op: unknown, i: number): Op {
  const bad = (why: string): never => {
    throw new RequestError(400, "invalid_request", `op ${i}: ${why}`);
  };
  if (!isObj(op) || !isStr(op.op)) return bad("an op is an object with a string \"op\"");
  switch (op.op) {
    case "sql.batch":
    case "sql.script": {
      if (!isStr(op.db)) bad("\"db\" is required");
      const db = op.db as string;
      if (db !== "control") {
        if (!db.startsWith("org:")) bad(`unknown db ${JSON.stringify(db).slice(0, 80)} (\"control\" or \"org:<org_id>\")`);
        if (!ORG_ID.test(db.slice(4))) throw new RequestError(400, "bad_org_id", `op ${i}: org id must match ${ORG_ID.source}`);
      }
      if (op.op === "sql.batch") {
        if (!Array.isArray(op.statements)) bad("\"statements\" must be a list");
        for (const st of op.statements as unknown[]) {
          if (!isObj(st) || !isStr(st.sql)) bad("a statement is {\"sql\": str, \"params\": [...]}");
          const s = st as Record<string, unknown>;
          if (s.params !== undefined && !Array.isArray(s.params)) bad("\"params\" must be a list");
        }
      } else if (!isStr(op.sql)) bad("\"sql\" is required");
      break;
    }
    case "vec.upsert":
      if (!isStr(op.index) || !Array.isArray(op.vectors)) bad("\"index\" and \"vectors\" are required");
      for (const v of op.vectors as unknown[]) {
        if (!isObj(v) || !isStr(v.id) || !isNumArray(v.values)) bad("a vector is {\"id\": str, \"values\": [number], ...}");
      }
      break;
    case "vec.query":
      if (!isStr(op.index) || !isNumArray(op.vector) || typeof op.top_k !== "number") bad("\"index\", \"vector\" and \"top_k\" are required");
      if (op.filter !== undefined && !isObj(op.filter)) bad("\"filter\" must be an object");
      if (op.namespace !== undefined && !isStr(op.namespace)) bad("\"namespace\" must be a string");
      break;
    case "vec.get":
    case "vec.delete":
      if (!isStr(op.index) || !Array.isArray(op.ids) || !(op.ids as unknown[]).every(isStr)) bad("\"index\" and \"ids\" (strings) are required");
      break;
    case "vec.info":
      if (!isStr(op.index)) bad("\"index\" is required");
      break;
    case "ai.embed":
      if (!isStr(op.model) || !Array.isArray(op.texts) || !(op.texts as unknown[]).every(isStr)) bad("\"model\" and \"texts\" (strings) are required");
      break;
    case "ai.run":
      if (!isStr(op.model) || !isObj(op.input)) bad("\"model\" and \"input\" (object) are required");
      break;
    case "ping":
      break;
    default:
      throw new RequestError(400, "unknown_op", `op ${i}: unknown op ${JSON.stringify(op.op).slice(0, 60)}`);
  }
  return op as Op;
}

const isSql = (op: Op) => op.op === "sql.batch" || op.op === "sql.script";

export async function handleRpc(request: Request, env: Env, deps: Deps): Promise<Response> {
  const secret = env.MEMEX_WORKER_SECRET ?? "";
  if (new TextEncoder().encode(secret).length < 32) {
    return errorResponse(500, "misconfigured", "MEMEX_WORKER_SECRET is not set (at least 32 bytes)");
  }
  if (request.headers.get("x-memex-protocol") !== String(PROTOCOL)) {
    return errorResponse(400, "unsupported_protocol", `this Worker speaks protocol ${PROTOCOL} (X-Memex-Protocol)`);
  }
  const declared = Number(request.headers.get("content-length") ?? "0");
  if (declared > MAX_BODY_BYTES) return errorResponse(413, "too_large", `body over ${MAX_BODY_BYTES} bytes`);
  const body = new Uint8Array(await request.arrayBuffer());
  if (body.length > MAX_BODY_BYTES) return errorResponse(413, "too_large", `body over ${MAX_BODY_BYTES} bytes`);
  const now = deps.now ? deps.now() : Math.floor(Date.now() / 1000);
  const denied = await verify(request.headers, body, secret, deps.nonces, now);
  if (denied) return errorResponse(denied.status, denied.code, denied.message);

  let parsed: unknown;
  try {
    parsed = JSON.parse(new TextDecoder().decode(body));
  } catch {
    return errorResponse(400, "invalid_json", "body is not JSON");
  }
  if (!isObj(parsed)) return errorResponse(400, "invalid_request", "body is {\"v\": 1, \"ops\": [...]}");
  if (parsed.v !== PROTOCOL) return errorResponse(400, "unsupported_protocol", `body "v" must be ${PROTOCOL}`);
  if (!Array.isArray(parsed.ops)) return errorResponse(400, "invalid_request", "\"ops\" must be a list");
  if (parsed.ops.length > MAX_OPS) return errorResponse(400, "too_many_ops", `at most ${MAX_OPS} ops per request`);
  const atomic = parsed.atomic === true;
  let ops: Op[];
  try {
    ops = parsed.ops.map(validateOp);
  } catch (e) {
    if (e instanceof RequestError) return errorResponse(e.status, e.code, e.message);
    throw e;
  }
  const results = await runOps(ops, atomic, env, deps);
  return jsonResponse(200, { v: PROTOCOL, results });
}

export async function runOps(ops: Op[], atomic: boolean, env: Env, deps: Deps): Promise<OpResult[]> {
  const results: OpResult[] = [];
  let i = 0;
  const failed = () => atomic && results.some((r) => !r.ok);
  while (i < ops.length) {
    if (failed()) {
      results.push(fail("aborted", "not run: an earlier op of this atomic request failed"));
      i++;
      continue;
    }
    const op = ops[i];
    if (isSql(op)) {
      const db = op.db as string;
      let j = i + 1;
      while (j < ops.length && isSql(ops[j]) && ops[j].db === db) j++;
      const group = ops.slice(i, j) as unknown as SqlOp[];
      let out: OpResult[];
      try {
        if (db === "control") {
          out = await runControl(env.CONTROL, group, atomic, i);
        } else {
          const stub = env.ORG.get(env.ORG.idFromName(db.slice(4)));
          out = (await stub.run(group, atomic)) as OpResult[];
        }
      } catch (e) {
        const msg = e instanceof Error ? e.message : String(e);
        out = group.map((_, k) => (k === 0 ? fail("storage_unavailable", `${db}: ${msg}`) : fail("aborted", "not run")));
      }
      results.push(...out);
      i = j;
      continue;
    }
    try {
      results.push(await runOne(op, env, deps));
    } catch (e) {
      if (e instanceof OpError) results.push(fail(e.code, e.message));
      else results.push(fail("internal_error", e instanceof Error ? e.message : String(e)));
    }
    i++;
  }
  return results;
}

async function runOne(op: Op, env: Env, deps: Deps): Promise<OpResult> {
  const store = () => {
    const s = deps.vectors(op.index as string);
    if (!s) throw new OpError("unknown_index", `this Worker has no Vectorize binding for index ${JSON.stringify(op.index)}`);
    return s;
  };
  const ai = () => {
    if (!deps.ai) throw new OpError("ai_unavailable", "this Worker has no Workers AI binding and no CF_EMULATOR_URL");
    return deps.ai;
  };
  switch (op.op) {
    case "vec.upsert": {
      const r = await store().upsert(op.vectors as never);
      return { ok: true, mutation_id: r.mutationId };
    }
    case "vec.query": {
      const matches = await store().query(op.vector as number[], {
        topK: op.top_k as number,
        namespace: op.namespace as string | undefined,
        filter: op.filter as Record<string, unknown> | undefined,
        returnMetadata: (op.return_metadata as "none" | "indexed" | "all" | undefined) ?? "none",
        returnValues: (op.return_values as boolean | undefined) ?? false,
      });
      return { ok: true, matches };
    }
    case "vec.get":
      return { ok: true, vectors: await store().getByIds(op.ids as string[]) };
    case "vec.delete": {
      const r = await store().deleteByIds(op.ids as string[]);
      return { ok: true, mutation_id: r.mutationId };
    }
    case "vec.info": {
      const r = await store().info();
      const out: OpResult = { ok: true, dimensions: r.dimensions, vector_count: r.vectorCount };
      if (r.processedUpToMutation != null) out.processed_up_to_mutation = r.processedUpToMutation;
      return out;
    }
    case "ai.embed": {
      const texts = op.texts as string[];
      if (!texts.length) return { ok: true, shape: [0, 0], data: [] };
      const r = await embed(ai(), op.model as string, texts, op.pooling as string | undefined);
      return { ok: true, shape: r.shape, data: r.data };
    }
    case "ai.run":
      return { ok: true, result: await ai().run(op.model as string, op.input as Record<string, unknown>) };
    case "ping":
      return {
        ok: true,
        protocol: PROTOCOL,
        worker_version: WORKER_VERSION,
        org_schema_version: ORG_MIGRATIONS.length ? ORG_MIGRATIONS[ORG_MIGRATIONS.length - 1].name : "",
      };
  }
  throw new OpError("unknown_op", op.op);
}
