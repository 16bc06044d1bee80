// The test build's VectorStore and Ai: in memory, deterministic.
import type { Ai } from "../src/ai";
import type { IndexInfo, QueryOptions, VectorIn, VectorMatchOut, VectorOut, VectorStore } from "../src/vectors";

export class FakeVectors implements VectorStore {
  vectors = new Map<string, VectorIn>();
  mutations = 0;
  calls: string[] = [];
  async upsert(vs: VectorIn[]) {
    this.calls.push("upsert");
    for (const v of vs) this.vectors.set(v.id, v);
    return { mutationId: `m${++this.mutations}` };
  }
  async query(vector: number[], o: QueryOptions): Promise<VectorMatchOut[]> {
    this.calls.push("query");
    const cos = (a: number[], b: number[]) => {
      let d = 0, na = 0, nb = 0;
      for (let i = 0; i < a.length; i++) { d += a[i] * b[i]; na += a[i] * a[i]; nb += b[i] * b[i]; }
      return d / Math.sqrt(na * nb || 1);
    };
    return [...this.vectors.values()]
      .filter((v) => o.namespace === undefined || v.namespace === o.namespace)
      .filter((v) => !o.filter || Object.entries(o.filter).every(([k, want]) => v.metadata?.[k] === want))
      .map((v) => {
        const m: VectorMatchOut = { id: v.id, score: cos(vector, v.values) };
        if (v.namespace) m.namespace = v.namespace;
        if (o.returnMetadata && o.returnMetadata !== "none") m.metadata = v.metadata ?? {};
        if (o.returnValues) m.values = v.values;
        return m;
      })
      .sort((a, b) => b.score - a.score)
      .slice(0, o.topK);
  }
  async getByIds(ids: string[]): Promise<VectorOut[]> {
    return ids.filter((i) => this.vectors.has(i)).map((i) => {
      const v = this.vectors.get(i)!;
      return { id: v.id, values: v.values, namespace: v.namespace ?? null, metadata: v.metadata ?? {} };
    });
  }
  async deleteByIds(ids: string[]) {
    for (const i of ids) this.vectors.delete(i);
    return { mutationId: `m${++this.mutations}` };
  }
  async info(): Promise<IndexInfo> {
    return { dimensions: 3, vectorCount: this.vectors.size, processedUpToMutation: `m${this.mutations}` };
  }
}

export class FakeAi implements Ai {
  calls: { model: string; input: Record<string, unknown> }[] = [];
  async run(model: string, input: Record<string, unknown>) {
    this.calls.push({ model, input });
    if (model.includes("bge-") && Array.isArray(input.text)) {
      const data = (input.text as string[]).map((t) => [t.length, 1, input.pooling === "cls" ? 1 : 0]);
      return { shape: [data.length, 3], data };
    }
    if (model.includes("reranker")) return { response: [{ id: 0, score: 0.9 }] };
    throw new Error(`5007: No such model ${model}`);
  }
}
