// Ai: Workers AI model calls, over the binding (deployed) or over Cloudflare's REST wire format
// (CF_EMULATOR_URL: wrangler dev / tests, since Workers AI is never simulated locally).
import { cfRest, RestError } from "./vectors";
import { OpError } from "./values";
import type { Env } from "./types";

export interface Ai {
  run(model: string, input: Record<string, unknown>): Promise<unknown>;
}

export class BindingAi implements Ai {
  constructor(private b: NonNullable<Env["AI"]>) {}
  async run(model: string, input: Record<string, unknown>) {
    try {
      return await this.b.run(model, input);
    } catch (e) {
      throw new OpError("ai_error", `${model}: ${e instanceof Error ? e.message : String(e)}`);
    }
  }
}

export class RestAi implements Ai {
  constructor(private env: Env) {}
  async run(model: string, input: Record<string, unknown>) {
    if (!/^@[\w.-]+\/[\w.-]+\/[\w.-]+$/.test(model)) throw new OpError("bad_request", `not a model name: ${model}`);
    try {
      return (await cfRest(this.env, "POST", `/ai/run/${model}`, JSON.stringify(input))).result;
    } catch (e) {
      if (e instanceof RestError && e.code === "upstream_error") throw new OpError("ai_error", `${model}: ${e.message}`);
      throw e;
    }
  }
}

export const EMBED_BATCH = 100;

/** Embeds texts in batches of 100 (Workers AI's limit per call), concatenating the vectors in order. */
export async function embed(ai: Ai, model: string, texts: string[], pooling?: string): Promise<{ shape: [number, number]; data: number[][] }> {
  const batches: string[][] = [];
  for (let i = 0; i < texts.length; i += EMBED_BATCH) batches.push(texts.slice(i, i + EMBED_BATCH));
  const outs = await Promise.all(
    batches.map((b) => ai.run(model, pooling ? { text: b, pooling } : { text: b }) as Promise<{ data?: number[][] }>),
  );
  const data: number[][] = [];
  for (const o of outs) {
    if (!o || !Array.isArray(o.data)) throw new OpError("ai_error", `${model}: answer without data`);
    data.push(...o.data);
  }
  return { shape: [data.length, data.length ? data[0].length : 0], data };
}
