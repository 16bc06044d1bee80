import { describe, expect, it } from "vitest";
import { fakeDeps, rpc } from "./helpers";

describe("vec.* and ai.* ops (fake VectorStore / Ai of the test build)", () => {
  it("upsert, query (namespace + filter), get, info, delete", async () => {
    const deps = fakeDeps();
    const { json } = await rpc(
      {
        v: 1,
        ops: [
          {
            op: "vec.upsert",
            index: "memex-bge-768",
            vectors: [
              { id: "o1:a", values: [1, 0, 0], namespace: "o1", metadata: { kind: "thought" } },
              { id: "o1:b", values: [0, 1, 0], namespace: "o1", metadata: { kind: "conversation" } },
              { id: "o2:a", values: [1, 0, 0], namespace: "o2", metadata: { kind: "thought" } },
            ],
          },
          { op: "vec.query", index: "memex-bge-768", vector: [1, 0.1, 0], top_k: 5, namespace: "o1", return_metadata: "all" },
          { op: "vec.query", index: "memex-bge-768", vector: [1, 0.1, 0], top_k: 5, namespace: "o1", filter: { kind: "conversation" } },
          { op: "vec.get", index: "memex-bge-768", ids: ["o2:a", "missing"] },
          { op: "vec.info", index: "memex-bge-768" },
          { op: "vec.delete", index: "memex-bge-768", ids: ["o1:a"] },
          { op: "vec.query", index: "other-index", vector: [1, 0, 0], top_k: 1 },
        ],
      },
      deps,
    );
    const [up, q, qf, get, info, del, unknown] = json.results;
    expect(up).toEqual({ ok: true, mutation_id: "m1" });
    expect(q.matches.map((m: any) => m.id)).toEqual(["o1:a", "o1:b"]);
    expect(q.matches[0]).toMatchObject({ namespace: "o1", metadata: { kind: "thought" } });
    expect(qf.matches.map((m: any) => m.id)).toEqual(["o1:b"]);
    expect(qf.matches[0].metadata).toBeUndefined();
    expect(get.vectors).toEqual([{ id: "o2:a", values: [1, 0, 0], namespace: "o2", metadata: { kind: "thought" } }]);
    expect(info).toEqual({ ok: true, dimensions: 3, vector_count: 3, processed_up_to_mutation: "m1" });
    expect(del).toEqual({ ok: true, mutation_id: "m2" });
    expect(unknown).toMatchObject({ ok: false, error: { code: "unknown_index" } });
    expect(deps.vec.vectors.has("o1:a")).toBe(false);
  });

  it("ai.embed batches texts by 100 and keeps their order; ai.run passes input through", async () => {
    const deps = fakeDeps();
    const texts = Array.from({ length: 250 }, (_, i) => "x".repeat(i + 1));
    const { json } = await rpc(
      {
        v: 1,
        ops: [
          { op: "ai.embed", model: "@cf/baai/bge-base-en-v1.5", texts, pooling: "mean" },
          { op: "ai.run", model: "@cf/baai/bge-reranker-base", input: { query: "q", contexts: [{ text: "a" }] } },
          { op: "ai.run", model: "@cf/nope/nope", input: {} },
        ],
      },
      deps,
    );
    const [emb, rr, bad] = json.results;
    expect(emb.ok).toBe(true);
    expect(emb.shape).toEqual([250, 3]);
    expect(emb.data.map((v: number[]) => v[0])).toEqual(texts.map((t) => t.length));
    expect(deps.fakeAi.calls.filter((c) => c.model.includes("bge-base")).map((c) => (c.input.text as string[]).length)).toEqual([100, 100, 50]);
    expect(deps.fakeAi.calls[0].input.pooling).toBe("mean");
    expect(rr).toEqual({ ok: true, result: { response: [{ id: 0, score: 0.9 }] } });
    expect(bad.ok).toBe(false);
  });

  it("one request mixes SQL, vector and AI ops, in order", async () => {
    const deps = fakeDeps();
    const db = `org:mix_${Date.now().toString(36)}`;
    const { json } = await rpc(
      {
        v: 1,
        ops: [
          { op: "ai.embed", model: "@cf/baai/bge-base-en-v1.5", texts: ["hello"] },
          { op: "sql.batch", db, statements: [{ sql: "SELECT count(*) FROM documents" }] },
          { op: "vec.upsert", index: "memex-bge-768", vectors: [{ id: "x", values: [5, 1, 0] }] },
          { op: "ping" },
        ],
      },
      deps,
    );
    expect(json.results.map((r: any) => r.ok)).toEqual([true, true, true, true]);
    expect(json.results[1].results[0].rows).toEqual([[0]]);
  });
});
