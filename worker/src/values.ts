// JSON <-> SQL values of the protocol: scalars as themselves, a BLOB as {"$b64": "<base64>"} both ways.

export type JsonScalar = null | number | string | boolean;
export type SqlParam = null | number | string | ArrayBuffer;
export type WireValue = null | number | string | { $b64: string };

export class OpError extends Error {
  constructor(public code: string, message: string) {
    super(message);
  }
}

export function b64encode(bytes: Uint8Array): string {
  let s = "";
  const CH = 0x8000;
  for (let i = 0; i < bytes.length; i += CH) s += String.fromCharCode(...bytes.subarray(i, i + CH));
  return btoa(s);
}

export function b64decode(text: string): Uint8Array {
  let bin: string;
  try {
    bin = atob(text);
  } catch {
    throw new OpError("bad_value", "invalid base64 in {\"$b64\"} value");
  }
  const out = new Uint8Array(bin.length);
  for (let i = 0; i < bin.length; i++) out[i] = bin.charCodeAt(i);
  return out;
}

/** A protocol param to a value SQLite bindings accept (booleans bind as 1/0, as D1 does). */
export function decodeParam(v: unknown): SqlParam {
  if (v === null || typeof v === "string") return v;
  if (typeof v === "number") {
    if (!Number.isFinite(v)) throw new OpError("bad_value", "non-finite number parameter");
    return v;
  }
  if (typeof v === "boolean") return v ? 1 : 0;
  if (typeof v === "object" && v !== null && !Array.isArray(v)) {
    const keys = Object.keys(v);
    const b = (v as Record<string, unknown>)["$b64"];
    if (keys.length === 1 && typeof b === "string") {
      const bytes = b64decode(b);
      return bytes.buffer.slice(bytes.byteOffset, bytes.byteOffset + bytes.byteLength) as ArrayBuffer;
    }
  }
  throw new OpError("bad_value", `unsupported parameter type: ${JSON.stringify(v)?.slice(0, 80)}`);
}

/** A SQL result cell to its wire form. D1 returns BLOBs as arrays of byte values, DO SQLite as ArrayBuffer. */
export function encodeCell(v: unknown): WireValue {
  if (v === null || v === undefined) return null;
  if (typeof v === "number") return Number.isFinite(v) ? v : null;
  if (typeof v === "string") return v;
  if (typeof v === "bigint") return Number(v);
  if (typeof v === "boolean") return v ? 1 : 0;
  if (v instanceof ArrayBuffer) return { $b64: b64encode(new Uint8Array(v)) };
  if (ArrayBuffer.isView(v)) return { $b64: b64encode(new Uint8Array(v.buffer, v.byteOffset, v.byteLength)) };
  if (Array.isArray(v)) return { $b64: b64encode(Uint8Array.from(v as number[])) };
  return String(v);
}
