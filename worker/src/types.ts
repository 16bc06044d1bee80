// Wire types of protocol version 1 (docs/worker-protocol.md).
import type { OrgStore } from "./org";

export const PROTOCOL = 1;
export const MAX_OPS = 500;
export const MAX_BODY_BYTES = 32 * 1024 * 1024;
export const ORG_ID = /^[A-Za-z0-9_-]{1,64}$/;
export const DEFAULT_INDEX = "memex-bge-768";

export interface Env {
  CONTROL: D1Database;
  ORG: DurableObjectNamespace<OrgStore>;
  VECTORIZE?: VectorizeIndex;
  AI?: { run(model: string, input: unknown): Promise<unknown> };
  MEMEX_WORKER_SECRET?: string;
  /** Set (wrangler dev / tests): Vectorize and Workers AI go over Cloudflare's REST wire format to this base URL. */
  CF_EMULATOR_URL?: string;
  CF_ACCOUNT_ID?: string;
  CF_API_TOKEN?: string;
  /** The index name env.VECTORIZE is bound to (default memex-bge-768). */
  VECTORIZE_INDEX?: string;
  /** JSON object {"<index name>": "<binding name>"} for further Vectorize bindings. */
  VECTORIZE_INDEXES?: string;
  [key: string]: unknown;
}

export interface Statement {
  sql: string;
  params?: unknown[];
}

export type SqlOp =
  | { op: "sql.batch"; db: string; statements: Statement[] }
  | { op: "sql.script"; db: string; sql: string };

export interface ErrorBody {
  code: string;
  message: string;
  /** sql.batch on an organization's store: the 0-based index of the statement that failed. */
  statement?: number;
}

export type OpResult = ({ ok: true } & Record<string, unknown>) | { ok: false; error: ErrorBody };

export interface SqlResult {
  columns: string[];
  rows: unknown[][];
  changes: number;
  last_row_id: number;
}

export function fail(code: string, message: string): OpResult {
  return { ok: false, error: { code, message } };
}
