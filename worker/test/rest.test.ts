// The REST implementations of VectorStore and Ai (used with CF_EMULATOR_URL) speak Cloudflare's wire format.
// The upstream here is a stand-in for the emulator (the real one is exercised by the wrangler dev smoke run).
import { afterEach, describe, expect, it, vi } from "vitest";
import { RestVectorStore } from "../src/vectors";
import { RestAi, embed } from "../src/ai";
import type { Env } from "../src/types";

const env = { CF_EMULATOR_URL: "http://emu.test:1/client/v4/", CF_ACCOUNT_ID: "acc", CF_API_TOKEN: "tok" } as unknown as Env;
type Seen = { url: string; method: string; auth: string | null; type: string | null; body: string };

function upstream(answer: (s: Seen) => [number, unknown]) {
  const seen: Seen[] = [];
  vi.spyOn(globalThis, "fetch").mockImplementation(async (input: RequestInfo | URL, init?: RequestInit) => {
    const req = new Request(input as RequestInfo, init);
    const s = { url: req.url, method: req.method, auth: req.headers.get("authorization"), type: req.headers.get("content-type"), body: new TextDecoder().decode(await req.arrayBuffer()) };
    seen.push(s);
    const [status, body] = answer(s);
    return new Response(JSON.stringify(body), { status, headers: { "content-type": "application/json" } });
  });
  return seen;
}
const ok = (result: unknown): [number, unknown] => [200, { success: true, errors: [], messages: [], result }];

afterEach(() => vi.restoreAllMocks());

describe("REST VectorStore / Ai", () => {
  it("upserts NDJSON and queries with Cloudflare's field names", async () => {
    const seen = upstream((s) => (s.url.endsWith("/upsert") ? ok({ mutationId: "mu1" }) : ok({ count: 1, matches: [{ id: "a", score: 0.5, namespace: "o1" }] })));
    const store = new RestVectorStore(env, "idx");
    expect(await store.upsert([{ id: "a", values: [1, 2], namespace: "o1", metadata: { kind: "t" } }, { id: "b", values: [3, 4] }])).toEqual({ mutationId: "mu1" });
    expect(seen[0]).toMatchObject({ url: "http://emu.test:1/client/v4/accounts/acc/vectorize/v2/indexes/idx/upsert", method: "POST", auth: "Bearer tok", type: "application/x-ndjson" });
    expect(seen[0].body.trim().split("\n").map((l) => JSON.parse(l))).toEqual([{ id: "a", values: [1, 2], namespace: "o1", metadata: { kind: "t" } }, { id: "b", values: [3, 4] }]);
    const m = await store.query([1, 0], { topK: 3, namespace: "o1", filter: { kind: "t" }, returnMetadata: "indexed" });
    expect(m).toEqual([{ id: "a", score: 0.5, namespace: "o1" }]);
    expect(JSON.parse(seen[1].body)).toEqual({ vector: [1, 0], topK: 3, namespace: "o1", filter: { kind: "t" }, returnValues: false, returnMetadata: "indexed" });
  });

  it("maps a missing index to unknown_index and a 429 to rate_limited", async () => {
    upstream((s) => (s.url.includes("/nope/") ? [404, { success: false, errors: [{ code: 40004, message: "no such index" }], result: null }] : [429, { success: false, errors: [{ code: 971, message: "slow down" }], result: null }]));
    await expect(new RestVectorStore(env, "nope").info()).rejects.toMatchObject({ code: "unknown_index" });
    await expect(new RestVectorStore(env, "idx").info()).rejects.toMatchObject({ code: "rate_limited" });
  });

  it("runs models at /ai/run/<model> and embeds in batches of 100", async () => {
    const seen = upstream((s) => {
      const texts = JSON.parse(s.body).text as string[];
      return ok({ shape: [texts.length, 1], data: texts.map((t) => [Number(t)]) });
    });
    const texts = Array.from({ length: 130 }, (_, i) => String(i));
    const r = await embed(new RestAi(env), "@cf/baai/bge-base-en-v1.5", texts, "cls");
    expect(r.shape).toEqual([130, 1]);
    expect(r.data.map((v) => v[0])).toEqual(texts.map(Number));
    expect(seen.map((s) => s.url)).toEqual(Array(2).fill("http://emu.test:1/client/v4/accounts/acc/ai/run/@cf/baai/bge-base-en-v1.5"));
    expect(JSON.parse(seen[0].body).pooling).toBe("cls");
  });
});
