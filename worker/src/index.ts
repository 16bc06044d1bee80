// Memex data-plane Worker (docs/worker-protocol.md): POST /v1/rpc (HMAC-signed batches of SQL, Vectorize and
// Workers AI ops), GET /health. Bindings: CONTROL (D1), ORG (OrgStore, SQLite Durable Objects), VECTORIZE, AI.
import { NonceCache } from "./auth";
import { BindingAi, RestAi, type Ai } from "./ai";
import { bindingStores, restStores, type VectorStores } from "./vectors";
import { errorResponse, handleRpc, jsonResponse, type Deps } from "./rpc";
import { WORKER_VERSION } from "./generated/migrations";
import { PROTOCOL, type Env } from "./types";

export { OrgStore } from "./org";
export type { Env } from "./types";

const nonces = new NonceCache();

/** The real dependencies: REST to CF_EMULATOR_URL when it is set, else the bindings. */
export function depsFor(env: Env): Deps {
  const rest = !!env.CF_EMULATOR_URL;
  const vectors: VectorStores = rest ? restStores(env) : bindingStores(env);
  const ai: Ai | null = rest ? new RestAi(env) : env.AI ? new BindingAi(env.AI) : null;
  return { vectors, ai, nonces };
}

export async function route(request: Request, env: Env, deps: Deps): Promise<Response> {
  const url = new URL(request.url);
  if (url.pathname === "/health") {
    if (request.method !== "GET") return errorResponse(405, "method_not_allowed", "GET /health");
    return jsonResponse(200, { ok: true, protocol: PROTOCOL, worker_version: WORKER_VERSION });
  }
  if (url.pathname === "/v1/rpc") {
    if (request.method !== "POST") return errorResponse(405, "method_not_allowed", "POST /v1/rpc");
    return handleRpc(request, env, deps);
  }
  return errorResponse(404, "not_found", "POST /v1/rpc or GET /health");
}

export default {
  async fetch(request: Request, env: Env): Promise<Response> {
    try {
      return await route(request, env, depsFor(env));
    } catch (e) {
      return errorResponse(500, "internal_error", e instanceof Error ? e.message : String(e));
    }
  },
} satisfies ExportedHandler<Env>;
