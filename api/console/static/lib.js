// Shared pieces of the console: the API client, the session, and small components.
import { html, useState, useEffect, useCallback } from "./vendor/preact-htm.js";

export { html };

const KEY = "memex.key";  // sessionStorage only: gone when the tab closes, never in a URL or localStorage

export const session = {
  key: () => sessionStorage.getItem(KEY),
  set: (k) => sessionStorage.setItem(KEY, k),
  clear: () => sessionStorage.removeItem(KEY),
};

export class ApiError extends Error {
  constructor(status, code, message, details, requestId) {
    super(message);
    this.requestId = requestId;
    this.status = status;
    this.code = code;
    this.details = details;
  }
}

// fetch a JSON API route; every error becomes an ApiError carrying the API's error.message
export async function api(method, path, body, { key = session.key() } = {}) {
  const headers = { accept: "application/json" };
  if (key) headers.authorization = `Bearer ${key}`;
  if (body !== undefined) headers["content-type"] = "application/json";
  let res;
  try {
    res = await fetch(path, { method, headers, body: body === undefined ? undefined : JSON.stringify(body),
                              credentials: "omit", cache: "no-store" });
  } catch (e) {
    throw new ApiError(0, "network", `The service could not be reached (${e.message}).`, null);
  }
  if (res.status === 204) return null;
  const text = await res.text();
  let data = null;
  try { data = text ? JSON.parse(text) : null; } catch { data = null; }
  if (!res.ok) {
    const err = data && data.error;
    throw new ApiError(res.status, err ? err.code : "http_" + res.status,
                       err && err.message ? err.message : `${res.status} ${res.statusText}`, err ? err.details : null,
                       (err && err.request_id) || res.headers.get("x-request-id"));
  }
  return data;
}

// [data, error, loading, reload] for a loader run on mount and whenever deps change
export function useLoad(loader, deps) {
  const [state, setState] = useState({ data: null, error: null, loading: true });
  const run = useCallback(() => {
    let live = true;
    setState((s) => ({ ...s, loading: true }));
    loader().then((data) => live && setState({ data, error: null, loading: false }),
                  (error) => live && setState({ data: null, error, loading: false }));
    return () => { live = false; };
  }, deps);
  useEffect(run, [run]);
  return [state.data, state.error, state.loading, run];
}

export function ErrorBox({ error }) {
  if (!error) return null;
  return html`<p class="error" role="alert">${error.message || String(error)}${error.requestId
    ? html` <span class="muted">(request ${error.requestId})</span>` : ""}</p>`;
}

export function Loading({ what = "" }) {
  return html`<p class="muted" aria-live="polite">Loading${what ? " " + what : ""}…</p>`;
}

export function fmtTime(ms) {
  if (ms === null || ms === undefined) return "—";
  const d = new Date(ms);
  return isNaN(d) ? String(ms) : d.toLocaleString();
}

export function shorten(text, n = 160) {
  if (!text) return "";
  const one = text.replace(/\s+/g, " ").trim();
  return one.length > n ? one.slice(0, n - 1) + "…" : one;
}

export async function copyText(text) {
  try {
    await navigator.clipboard.writeText(text);
    return true;
  } catch {
    return false;
  }
}

export function CopyButton({ text, label = "Copy" }) {
  const [done, setDone] = useState(null);
  const click = async () => setDone((await copyText(text)) ? "Copied" : "Select and copy by hand");
  return html`<button type="button" class="secondary" onClick=${click}>${done || label}</button>`;
}

// a secret shown once, with a copy button
export function Secret({ value, label }) {
  return html`<div class="secret">
    <code data-testid="secret" aria-label=${label || "secret"}>${value}</code>
    <${CopyButton} text=${value} label="Copy key" />
  </div>`;
}

export function Snippet({ title, text, note, testid }) {
  return html`<section>
    <h3>${title}</h3>
    ${note && html`<p class="muted">${note}</p>`}
    <div class="snippet"><pre data-testid=${testid}>${text}</pre><${CopyButton} text=${text} /></div>
  </section>`;
}

export function Tags({ tags }) {
  if (!tags || !tags.length) return null;
  return html`<span class="tags">${tags.map((t) => html`<span>${t}</span>`)}</span>`;
}

export function State({ value }) {
  return html`<span class=${"state-" + value}>${value}</span>`;
}

// ---- generic rendering of any JSON (usage, limits, unknown fields) -------------------------------------

function scalar(v) {
  if (v === null || v === undefined) return "—";
  if (typeof v === "boolean") return v ? "yes" : "no";
  if (typeof v === "number") return Number.isInteger(v) ? v.toLocaleString() : v.toLocaleString(undefined, { maximumFractionDigits: 4 });
  return String(v);
}

const isObj = (v) => v !== null && typeof v === "object" && !Array.isArray(v);

export function JsonView({ value, caption }) {
  if (Array.isArray(value)) {
    if (!value.length) return html`<p class="muted">none</p>`;
    if (value.every(isObj)) {
      const cols = [...new Set(value.flatMap((r) => Object.keys(r)))];
      return html`<div class="scroll"><table>
        ${caption && html`<caption>${caption}</caption>`}
        <thead><tr>${cols.map((c) => html`<th scope="col">${c}</th>`)}</tr></thead>
        <tbody>${value.map((r) => html`<tr>${cols.map((c) => html`<td>${cell(r[c])}</td>`)}</tr>`)}</tbody>
      </table></div>`;
    }
    return html`<span>${value.map(scalar).join(", ")}</span>`;
  }
  if (isObj(value)) {
    const entries = Object.entries(value);
    if (!entries.length) return html`<p class="muted">none</p>`;
    return html`<div class="scroll"><table class="kv">
      ${caption && html`<caption>${caption}</caption>`}
      <tbody>${entries.map(([k, v]) => html`<tr><th scope="row">${k}</th><td>${cell(v)}</td></tr>`)}</tbody>
    </table></div>`;
  }
  return html`<span>${scalar(value)}</span>`;
}

function cell(v) {
  return isObj(v) || (Array.isArray(v) && v.some((x) => x !== null && typeof x === "object"))
    ? html`<${JsonView} value=${v} />`
    : Array.isArray(v) ? v.map(scalar).join(", ") : scalar(v);
}

export function fmtValue(v) {
  if (isObj(v) || Array.isArray(v)) return Array.isArray(v) && !v.some(isObj) ? v.map(scalar).join(", ") || "—" : JSON.stringify(v);
  return scalar(v);
}

export const go = (path) => { location.hash = "#/" + path; };
