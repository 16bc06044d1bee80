// HMAC authentication of /v1/rpc (docs/worker-protocol.md):
//   X-Memex-Signature: v1=<hex HMAC-SHA256(secret, "<timestamp>.<nonce>.<raw body>")>
// 300 s window around the Worker's clock; nonces remembered inside the window, per isolate (best effort).

export const WINDOW_SECONDS = 300;
const NONCE = /^[A-Za-z0-9_-]{16,64}$/;
const TIMESTAMP = /^[0-9]{1,12}$/;
const SIGNATURE = /^v1=([0-9a-f]{64})$/;

export interface AuthFailure {
  status: number;
  code: string;
  message: string;
}

/** Nonces seen inside the window, with their timestamps (this isolate only). */
export class NonceCache {
  private seen = new Map<string, number>();
  private lastSweep = 0;
  constructor(private max = 200_000) {}

  /** False if the nonce was already seen inside the window; else remembers it. */
  claim(nonce: string, ts: number, now: number): boolean {
    if (now - this.lastSweep > 30 || this.seen.size >= this.max) this.sweep(now);
    if (this.seen.has(nonce)) return false;
    this.seen.set(nonce, ts);
    return true;
  }

  private sweep(now: number) {
    this.lastSweep = now;
    for (const [k, t] of this.seen) if (Math.abs(now - t) > WINDOW_SECONDS) this.seen.delete(k);
    // Still full: drop the oldest entries (Map keeps insertion order). Best effort, as documented.
    if (this.seen.size >= this.max) {
      let drop = this.seen.size - Math.floor(this.max * 0.9);
      for (const k of this.seen.keys()) {
        if (drop-- <= 0) break;
        this.seen.delete(k);
      }
    }
  }
}

const keys = new Map<string, Promise<CryptoKey>>();
function hmacKey(secret: string): Promise<CryptoKey> {
  let k = keys.get(secret);
  if (!k) {
    k = crypto.subtle.importKey("raw", new TextEncoder().encode(secret), { name: "HMAC", hash: "SHA-256" }, false, [
      "sign",
    ]);
    keys.set(secret, k);
  }
  return k;
}

function hexToBytes(hex: string): Uint8Array {
  const out = new Uint8Array(hex.length / 2);
  for (let i = 0; i < out.length; i++) out[i] = parseInt(hex.slice(2 * i, 2 * i + 2), 16);
  return out;
}

export function toHex(buf: ArrayBuffer): string {
  return [...new Uint8Array(buf)].map((b) => b.toString(16).padStart(2, "0")).join("");
}

/** The signature a client sends (used by tests and documented for clients). */
export async function sign(secret: string, timestamp: string, nonce: string, body: Uint8Array): Promise<string> {
  const key = await hmacKey(secret);
  return "v1=" + toHex(await crypto.subtle.sign("HMAC", key, signedBytes(timestamp, nonce, body)));
}

function signedBytes(timestamp: string, nonce: string, body: Uint8Array): Uint8Array {
  const head = new TextEncoder().encode(`${timestamp}.${nonce}.`);
  const all = new Uint8Array(head.length + body.length);
  all.set(head, 0);
  all.set(body, head.length);
  return all;
}

/** Null when the request is authentic and fresh; else the 401 to answer. */
export async function verify(
  headers: Headers,
  body: Uint8Array,
  secret: string,
  nonces: NonceCache,
  nowSeconds: number,
): Promise<AuthFailure | null> {
  const ts = headers.get("x-memex-timestamp") ?? "";
  const nonce = headers.get("x-memex-nonce") ?? "";
  const sig = headers.get("x-memex-signature") ?? "";
  if (!ts || !nonce || !sig) {
    return { status: 401, code: "missing_auth", message: "X-Memex-Timestamp, X-Memex-Nonce and X-Memex-Signature are required" };
  }
  const m = SIGNATURE.exec(sig);
  if (!TIMESTAMP.test(ts) || !NONCE.test(nonce) || !m) {
    return { status: 401, code: "bad_auth_headers", message: "malformed timestamp, nonce or signature header" };
  }
  const tsNum = Number(ts);
  if (Math.abs(nowSeconds - tsNum) > WINDOW_SECONDS) {
    return { status: 401, code: "stale_timestamp", message: `timestamp is more than ${WINDOW_SECONDS} s from the Worker's clock` };
  }
  const key = await hmacKey(secret);
  const expected = new Uint8Array(await crypto.subtle.sign("HMAC", key, signedBytes(ts, nonce, body)));
  const given = hexToBytes(m[1]);
  // Both are 32 bytes (the regex fixes the length), so the comparison is constant-time over the whole MAC.
  if (!crypto.subtle.timingSafeEqual(expected, given)) {
    return { status: 401, code: "bad_signature", message: "signature does not match" };
  }
  if (!nonces.claim(nonce, tsNum, nowSeconds)) {
    return { status: 401, code: "replayed_nonce", message: "nonce already used inside the replay window" };
  }
  return null;
}
