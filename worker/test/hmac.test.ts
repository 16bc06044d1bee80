import { describe, expect, it } from "vitest";
import { signedRequest, viaWorker, nonce, SECRET } from "./helpers";

const PING = { v: 1, ops: [{ op: "ping" }] };

describe("HMAC authentication of /v1/rpc", () => {
  it("accepts a good signature and answers ping", async () => {
    const r = await viaWorker(await signedRequest(PING));
    expect(r.status).toBe(200);
    const j: any = await r.json();
    expect(j.v).toBe(1);
    expect(j.results[0]).toMatchObject({ ok: true, protocol: 1, org_schema_version: expect.stringMatching(/^\d{4}_/) });
  });

  it("refuses a bad signature with 401", async () => {
    const r = await viaWorker(await signedRequest(PING, { tamper: true }));
    expect(r.status).toBe(401);
    expect(((await r.json()) as any).error.code).toBe("bad_signature");
  });

  it("refuses a signature made with another secret", async () => {
    const r = await viaWorker(await signedRequest(PING, { secret: SECRET + "x" }));
    expect(r.status).toBe(401);
  });

  it("refuses a body changed after signing", async () => {
    const req = await signedRequest(PING);
    const forged = new Request(req.url, { method: "POST", headers: req.headers, body: JSON.stringify({ v: 1, ops: [] }) });
    const r = await viaWorker(forged);
    expect(r.status).toBe(401);
  });

  it("refuses a timestamp outside the 300 s window, either side", async () => {
    const now = Math.floor(Date.now() / 1000);
    for (const ts of [now - 301, now + 301]) {
      const r = await viaWorker(await signedRequest(PING, { timestamp: ts }));
      expect(r.status).toBe(401);
      expect(((await r.json()) as any).error.code).toBe("stale_timestamp");
    }
    const ok = await viaWorker(await signedRequest(PING, { timestamp: now - 250 }));
    expect(ok.status).toBe(200);
  });

  it("refuses a replayed nonce", async () => {
    const n = nonce();
    const first = await viaWorker(await signedRequest(PING, { nonce: n }));
    expect(first.status).toBe(200);
    const again = await viaWorker(await signedRequest(PING, { nonce: n }));
    expect(again.status).toBe(401);
    expect(((await again.json()) as any).error.code).toBe("replayed_nonce");
  });

  it("a forged request does not burn the nonce of a real one", async () => {
    const n = nonce();
    expect((await viaWorker(await signedRequest(PING, { nonce: n, tamper: true }))).status).toBe(401);
    expect((await viaWorker(await signedRequest(PING, { nonce: n }))).status).toBe(200);
  });

  it("answers a wrong protocol version with 400 unsupported_protocol", async () => {
    const r = await viaWorker(await signedRequest(PING, { protocol: "2" }));
    expect(r.status).toBe(400);
    expect(((await r.json()) as any).error.code).toBe("unsupported_protocol");
    const r2 = await viaWorker(await signedRequest({ v: 2, ops: [] }));
    expect(r2.status).toBe(400);
    expect(((await r2.json()) as any).error.code).toBe("unsupported_protocol");
  });

  it("refuses missing auth headers and malformed nonces", async () => {
    const r = await viaWorker(new Request("https://w/v1/rpc", { method: "POST", headers: { "x-memex-protocol": "1" }, body: "{}" }));
    expect(r.status).toBe(401);
    const short = await viaWorker(await signedRequest(PING, { nonce: "short" }));
    expect(short.status).toBe(401);
  });

  it("serves GET /health without auth", async () => {
    const r = await viaWorker(new Request("https://w/health"));
    expect(r.status).toBe(200);
    expect(await r.json()).toMatchObject({ ok: true, protocol: 1 });
  });
});
