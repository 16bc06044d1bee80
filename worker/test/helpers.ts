import { env, exports } from "cloudflare:workers";
import { sign, NonceCache } from "../src/auth";
import { route } from "../src/index";
import type { Deps } from "../src/rpc";
import type { Env } from "../src/types";
import { FakeAi, FakeVectors } from "./fakes";

export const SECRET = "test-secret-0123456789abcdef0123456789abcdef";
export const testEnv = env as unknown as Env;

let counter = 0;
export function nonce(): string {
  return `n${Date.now().toString(36)}x${(counter++).toString(36)}`.padEnd(20, "0");
}

export interface SignOpts {
  secret?: string;
  timestamp?: number;
  nonce?: string;
  protocol?: string;
  tamper?: boolean;
}

export async function signedRequest(body: unknown, o: SignOpts = {}): Promise<Request> {
  const raw = new TextEncoder().encode(typeof body === "string" ? body : JSON.stringify(body));
  const ts = String(o.timestamp ?? Math.floor(Date.now() / 1000));
  const n = o.nonce ?? nonce();
  let sig = await sign(o.secret ?? SECRET, ts, n, raw);
  if (o.tamper) sig = sig.slice(0, -1) + (sig.endsWith("0") ? "1" : "0");
  return new Request("https://worker.test/v1/rpc", {
    method: "POST",
    headers: {
      "content-type": "application/json",
      "x-memex-protocol": o.protocol ?? "1",
      "x-memex-timestamp": ts,
      "x-memex-nonce": n,
      "x-memex-signature": sig,
    },
    body: raw,
  });
}

/** Through the deployed entry point (the Worker's default export, real deps). */
export async function viaWorker(req: Request): Promise<Response> {
  return (exports as any).default.fetch(req);
}

/** Through the router with fake Vectorize/AI (the test build's VectorStore and Ai). */
export function fakeDeps(): Deps & { vec: FakeVectors; fakeAi: FakeAi } {
  const vec = new FakeVectors();
  const fakeAi = new FakeAi();
  return { vectors: (i) => (i === "memex-bge-768" ? vec : null), ai: fakeAi, nonces: new NonceCache(), vec, fakeAi };
}

export async function rpc(body: unknown, deps: Deps = fakeDeps()): Promise<{ status: number; json: any }> {
  const resp = await route(await signedRequest(body), testEnv, deps);
  return { status: resp.status, json: await resp.json() };
}

/** One sql.batch op's results (asserting it succeeded). */
export async function sql(db: string, statements: { sql: string; params?: unknown[] }[]): Promise<any[]> {
  const { status, json } = await rpc({ v: 1, ops: [{ op: "sql.batch", db, statements }] });
  if (status !== 200 || !json.results[0].ok) throw new Error(JSON.stringify(json));
  return json.results[0].results;
}

export function uniqueOrg(prefix = "org"): string {
  return `${prefix}_${Date.now().toString(36)}_${(counter++).toString(36)}`;
}
