// VectorStore: the Vectorize operations the protocol needs, over the binding (deployed) or over Cloudflare's
// REST wire format (CF_EMULATOR_URL: wrangler dev / tests, since miniflare does not simulate Vectorize).
import { OpError } from "./values";
import { DEFAULT_INDEX, type Env } from "./types";

export interface VectorIn {
  id: string;
  values: number[];
  namespace?: string;
  metadata?: Record<string, unknown>;
}

export interface QueryOptions {
  topK: number;
  namespace?: string;
  filter?: Record<string, unknown>;
  returnMetadata?: "none" | "indexed" | "all";
  returnValues?: boolean;
}

export interface VectorMatchOut {
  id: string;
  score: number;
  namespace?: string;
  metadata?: Record<string, unknown>;
  values?: number[];
}

export interface VectorOut {
  id: string;
  values: number[];
  namespace: string | null;
  metadata: Record<string, unknown>;
}

export interface IndexInfo {
  dimensions: number;
  vectorCount: number;
  processedUpToMutation?: string | null;
}

export interface VectorStore {
  upsert(vectors: VectorIn[]): Promise<{ mutationId: string }>;
  query(vector: number[], opts: QueryOptions): Promise<VectorMatchOut[]>;
  getByIds(ids: string[]): Promise<VectorOut[]>;
  deleteByIds(ids: string[]): Promise<{ mutationId: string }>;
  info(): Promise<IndexInfo>;
}

/** Picks the VectorStore for an index name, or null when the Worker does not know the index. */
export type VectorStores = (index: string) => VectorStore | null;

export function bindingStores(env: Env): VectorStores {
  const map: Record<string, string> = {};
  map[env.VECTORIZE_INDEX || DEFAULT_INDEX] = "VECTORIZE";
  if (env.VECTORIZE_INDEXES) Object.assign(map, JSON.parse(env.VECTORIZE_INDEXES) as Record<string, string>);
  return (index) => {
    const name = map[index];
    const b = name ? (env[name] as VectorizeIndex | undefined) : undefined;
    return b ? new BindingVectorStore(b) : null;
  };
}

export class BindingVectorStore implements VectorStore {
  constructor(private b: VectorizeIndex) {}
  async upsert(vectors: VectorIn[]) {
    const r = (await this.b.upsert(vectors as VectorizeVector[])) as unknown as { mutationId: string };
    return { mutationId: r.mutationId };
  }
  async query(vector: number[], o: QueryOptions) {
    const r = await this.b.query(vector, {
      topK: o.topK,
      namespace: o.namespace,
      filter: o.filter as VectorizeVectorMetadataFilter | undefined,
      returnMetadata: o.returnMetadata ?? "none",
      returnValues: o.returnValues ?? false,
    });
    return r.matches.map(cleanMatch);
  }
  async getByIds(ids: string[]) {
    const r = await this.b.getByIds(ids);
    return r.map((v) => ({
      id: v.id,
      values: Array.from(v.values as ArrayLike<number>),
      namespace: v.namespace ?? null,
      metadata: (v.metadata ?? {}) as Record<string, unknown>,
    }));
  }
  async deleteByIds(ids: string[]) {
    const r = (await this.b.deleteByIds(ids)) as unknown as { mutationId: string };
    return { mutationId: r.mutationId };
  }
  async info() {
    const r = (await this.b.describe()) as unknown as IndexInfo & { processedUpToMutation?: string };
    return { dimensions: r.dimensions, vectorCount: r.vectorCount, processedUpToMutation: r.processedUpToMutation ?? null };
  }
}

function cleanMatch(m: { id: string; score: number; namespace?: string; metadata?: unknown; values?: unknown }): VectorMatchOut {
  const out: VectorMatchOut = { id: m.id, score: m.score };
  if (m.namespace != null) out.namespace = m.namespace;
  if (m.metadata != null) out.metadata = m.metadata as Record<string, unknown>;
  if (m.values != null) out.values = Array.from(m.values as ArrayLike<number>);
  return out;
}

/** Cloudflare's REST base for the emulator (accepts the URL with or without /client/v4). */
export function restBase(env: Env): string {
  const u = (env.CF_EMULATOR_URL ?? "").replace(/\/+$/, "");
  return u.endsWith("/client/v4") ? u : `${u}/client/v4`;
}

export class RestError extends OpError {}

/** One REST call; unwraps Cloudflare's envelope {success, errors, result}. */
export async function cfRest(env: Env, method: string, path: string, body?: BodyInit, contentType = "application/json"): Promise<{ status: number; result: unknown }> {
  const url = `${restBase(env)}/accounts/${env.CF_ACCOUNT_ID || "test-account"}${path}`;
  const headers: Record<string, string> = { authorization: `Bearer ${env.CF_API_TOKEN || "test-token"}` };
  if (body !== undefined) headers["content-type"] = contentType;
  let resp: Response;
  try {
    resp = await fetch(url, { method, headers, body });
  } catch (e) {
    throw new OpError("upstream_unreachable", `${method} ${path}: ${e instanceof Error ? e.message : String(e)}`);
  }
  const text = await resp.text();
  let env2: { success?: boolean; errors?: { code?: number; message?: string }[]; result?: unknown } = {};
  try {
    env2 = JSON.parse(text);
  } catch {
    /* not JSON */
  }
  if (!resp.ok || env2.success === false) {
    const err = env2.errors?.[0];
    const msg = `${resp.status} ${err?.code ?? ""} ${err?.message ?? text.slice(0, 200)}`.replace(/\s+/g, " ").trim();
    throw new RestError(resp.status === 429 ? "rate_limited" : "upstream_error", msg);
  }
  return { status: resp.status, result: env2.result };
}

export function restStores(env: Env): VectorStores {
  // Any well-formed index name is passed through: the emulator decides whether it exists (404 -> unknown_index).
  return (index) => (/^[a-z0-9_-]{1,64}$/.test(index) ? new RestVectorStore(env, index) : null);
}

export class RestVectorStore implements VectorStore {
  constructor(private env: Env, private index: string) {}
  private async call(method: string, tail: string, body?: BodyInit, ct?: string) {
    try {
      return (await cfRest(this.env, method, `/vectorize/v2/indexes/${this.index}${tail}`, body, ct)).result;
    } catch (e) {
      if (e instanceof RestError && e.code === "upstream_error" && e.message.startsWith("404")) {
        throw new OpError("unknown_index", `Vectorize index ${this.index}: ${e.message}`);
      }
      if (e instanceof RestError && e.code === "upstream_error") throw new OpError("vectorize_error", e.message);
      throw e;
    }
  }
  async upsert(vectors: VectorIn[]) {
    const nd = vectors.map((v) => JSON.stringify(v)).join("\n") + "\n";
    const r = (await this.call("POST", "/upsert", nd, "application/x-ndjson")) as { mutationId: string };
    return { mutationId: r.mutationId };
  }
  async query(vector: number[], o: QueryOptions) {
    const body: Record<string, unknown> = { vector, topK: o.topK, returnValues: o.returnValues ?? false, returnMetadata: o.returnMetadata ?? "none" };
    if (o.namespace !== undefined) body.namespace = o.namespace;
    if (o.filter !== undefined) body.filter = o.filter;
    const r = (await this.call("POST", "/query", JSON.stringify(body))) as { matches: VectorMatchOut[] };
    return (r.matches ?? []).map(cleanMatch);
  }
  async getByIds(ids: string[]) {
    const r = (await this.call("POST", "/get_by_ids", JSON.stringify({ ids }))) as VectorOut[];
    return (r ?? []).map((v) => ({ id: v.id, values: v.values, namespace: v.namespace ?? null, metadata: v.metadata ?? {} }));
  }
  async deleteByIds(ids: string[]) {
    const r = (await this.call("POST", "/delete_by_ids", JSON.stringify({ ids }))) as { mutationId: string };
    return { mutationId: r.mutationId };
  }
  async info() {
    const r = (await this.call("GET", "/info")) as IndexInfo;
    return { dimensions: r.dimensions, vectorCount: r.vectorCount, processedUpToMutation: r.processedUpToMutation ?? null };
  }
}
