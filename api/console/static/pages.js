// The organization's pages: thoughts, search, conversations, knowledge bases, keys, usage.
import { useState } from "./vendor/preact-htm.js";
import { html, api, go, useLoad, ErrorBox, Loading, Secret, Tags, State, JsonView, fmtTime, fmtValue, shorten } from "./lib.js";

const enc = encodeURIComponent;

// a button that asks once more before doing something that cannot be undone (no window.confirm)
function Confirm({ label, confirmLabel, onConfirm, disabled }) {
  const [asking, setAsking] = useState(false);
  const [busy, setBusy] = useState(false);
  if (!asking) return html`<button type="button" class="danger" disabled=${disabled} onClick=${() => setAsking(true)}>${label}</button>`;
  const yes = async () => { setBusy(true); try { await onConfirm(); } finally { setBusy(false); setAsking(false); } };
  return html`<span class="row">
    <button type="button" class="danger" disabled=${busy} onClick=${yes}>${confirmLabel}</button>
    <button type="button" class="secondary" onClick=${() => setAsking(false)}>Cancel</button>
  </span>`;
}

// ---- thoughts ------------------------------------------------------------------------------------------

function Capture({ onSaved }) {
  const [content, setContent] = useState("");
  const [source, setSource] = useState("");
  const [error, setError] = useState(null);
  const [saved, setSaved] = useState(null);
  const submit = async (e) => {
    e.preventDefault();
    setError(null);
    try {
      const res = await api("POST", "/v1/thoughts", { content, ...(source ? { source } : {}) });
      setSaved(res);
      setContent("");
      onSaved();
    } catch (err) {
      setError(err);
    }
  };
  return html`<details><summary>Capture a thought</summary>
    <form class="stack" onSubmit=${submit}>
      <label>Markdown<textarea name="content" required value=${content} onInput=${(e) => setContent(e.target.value)} /></label>
      <label>Source (optional)<input name="source" maxlength="500" value=${source} onInput=${(e) => setSource(e.target.value)} /></label>
      <${ErrorBox} error=${error} />
      ${saved && html`<p class="ok" role="status">${saved.created ? "Saved" : "Already stored"}:${" "}
        <a href=${"#/thoughts/" + enc(saved.id)}>${saved.id}</a></p>`}
      <div><button type="submit">Save</button></div>
    </form></details>`;
}

export function ThoughtsPage() {
  const [more, setMore] = useState([]);
  const [next, setNext] = useState(null);
  const [moreError, setMoreError] = useState(null);
  const [first, error, loading, reload] = useLoad(async () => {
    const page = await api("GET", "/v1/thoughts?limit=50");
    setMore([]);
    setNext(page.next_before === null ? null : page);
    return page;
  }, []);
  const loadMore = async () => {
    try {
      const page = await api("GET", `/v1/thoughts?limit=50&before=${next.next_before}&before_id=${enc(next.next_before_id)}`);
      setMore([...more, ...page.thoughts]);
      setNext(page.next_before === null ? null : page);
    } catch (err) {
      setMoreError(err);
    }
  };
  const thoughts = first ? [...first.thoughts, ...more] : [];
  return html`<section>
    <h1>Thoughts</h1>
    <${Capture} onSaved=${reload} />
    <${ErrorBox} error=${error} />
    ${loading && !first && html`<${Loading} />`}
    ${first && !thoughts.length && html`<p class="notice">No thoughts yet. Capture one above, through the API
      (<code>POST /v1/thoughts</code>) or from an agent (see <a href="#/connect">Connect an agent</a>).</p>`}
    ${thoughts.length > 0 && html`<div class="scroll"><table data-testid="thoughts">
      <thead><tr><th scope="col">Thought</th><th scope="col">Tags</th><th scope="col">Source</th><th scope="col">Created</th></tr></thead>
      <tbody>${thoughts.map((t) => html`<tr>
        <td><a href=${"#/thoughts/" + enc(t.id)}>${shorten(t.summary || t.content, 140)}</a></td>
        <td><${Tags} tags=${t.tags} /></td><td>${t.source || ""}</td><td>${fmtTime(t.created_at)}</td></tr>`)}</tbody>
    </table></div>`}
    <${ErrorBox} error=${moreError} />
    ${next && html`<button type="button" class="secondary" onClick=${loadMore}>Older thoughts</button>`}
  </section>`;
}

function Facts({ rows }) {
  return html`<table class="kv"><tbody>${rows.filter(Boolean).map(([k, v]) => html`<tr><th scope="row">${k}</th><td>${v}</td></tr>`)}</tbody></table>`;
}

export function ThoughtPage({ id }) {
  const [notice, setNotice] = useState(null);
  const [actionError, setActionError] = useState(null);
  const [t, error, loading, reload] = useLoad(() => api("GET", `/v1/thoughts/${enc(id)}`), [id]);
  const [hist, histError, , reloadHist] = useLoad(() => api("GET", `/v1/thoughts/${enc(id)}/history`), [id]);
  if (error) return html`<section><h1>Thought</h1><${ErrorBox} error=${error} /><p><a href="#/thoughts">All thoughts</a></p></section>`;
  if (loading && !t) return html`<${Loading} what="the thought" />`;
  const del = async () => {
    setActionError(null);
    try {
      await api("DELETE", `/v1/thoughts/${enc(id)}`);
      go("thoughts");
    } catch (err) {
      setActionError(err);
    }
  };
  const restore = async (entry) => {
    setActionError(null);
    try {
      const res = await api("POST", `/v1/thoughts/${enc(id)}/history/${enc(entry.id)}/restore`);
      setNotice(html`Restored as <a href=${"#/thoughts/" + enc(res.id)}>${res.id}</a>.`);
      reloadHist();
      reload();
    } catch (err) {
      setActionError(err);
    }
  };
  const d = t.decision;
  return html`<section>
    <p><a href="#/thoughts">← All thoughts</a></p>
    <h1>${t.summary || "Thought"}</h1>
    <pre data-testid="content">${t.content}</pre>
    <${Facts} rows=${[
      ["Id", html`<code>${t.id}</code>`],
      ["Created", fmtTime(t.created_at)], ["Updated", fmtTime(t.updated_at)],
      ["Source", t.source || "—"], ["Tags", html`<${Tags} tags=${t.tags} />`],
      ["Importance", t.importance ?? "—"],
      ["Enrichment", t.enrichment ? html`<${State} value=${t.enrichment} />` : "—"],
      d && ["Write-time decision", html`${d.action}${d.reason ? ": " + d.reason : ""}${d.related_id
        ? html` (<a href=${"#/thoughts/" + enc(d.related_id)}>related</a>)` : ""}`],
      ["Indexing", html`<${State} value=${t.indexing.state} /> (${t.indexing.chunks_indexed} of ${t.indexing.chunks_total} chunks)`],
      ["Uses", `${t.uses ?? 0}${t.last_used_at ? ", last " + fmtTime(t.last_used_at) : ""}`],
      ["Metadata", Object.keys(t.metadata || {}).length ? html`<${JsonView} value=${t.metadata} />` : "—"],
    ]} />
    ${notice && html`<p class="ok" role="status">${notice}</p>`}
    <${ErrorBox} error=${actionError} />
    <div class="row"><${Confirm} label="Delete this thought" confirmLabel="Delete for good" onConfirm=${del} /></div>
    ${t.links && t.links.length > 0 && html`<h2>Links</h2><ul>${t.links.map((l) => html`<li>${l.kind} (${l.direction}):${" "}
      <a href=${"#/thoughts/" + enc(l.thought_id)}>${l.thought_id}</a>${l.reason ? " — " + l.reason : ""}</li>`)}</ul>`}
    <h2>Chunks</h2>
    <div class="scroll"><table data-testid="chunks">
      <thead><tr><th scope="col">#</th><th scope="col">Tokens</th><th scope="col">Indexed</th><th scope="col">Content</th></tr></thead>
      <tbody>${t.chunks.map((c) => html`<tr><td class="num">${c.ordinal}</td><td class="num">${c.token_count}</td>
        <td>${c.indexed ? "yes" : "no"}</td><td>${shorten(c.content, 400)}</td></tr>`)}</tbody>
    </table></div>
    <h2>History</h2>
    <${ErrorBox} error=${histError} />
    ${hist && !hist.entries.length && html`<p class="muted">No originals: nothing was merged into or replaced by this thought.</p>`}
    ${hist && hist.entries.length > 0 && html`<div class="scroll"><table data-testid="history">
      <thead><tr><th scope="col">When</th><th scope="col">Action</th><th scope="col">Reason</th><th scope="col">Original</th><th scope="col"></th></tr></thead>
      <tbody>${hist.entries.map((h) => html`<tr><td>${fmtTime(h.created_at)}</td><td>${h.action}</td><td>${h.reason || ""}</td>
        <td>${shorten(h.content, 240)}</td>
        <td><button type="button" class="secondary" onClick=${() => restore(h)}>Restore</button></td></tr>`)}</tbody>
    </table></div>`}
  </section>`;
}

// ---- search --------------------------------------------------------------------------------------------

function ExplainTable({ hits }) {
  const rows = [...new Set(hits.flatMap((h) => Object.keys(h.explain || {})))].filter((k) => k !== "formula");
  if (!rows.length) return null;
  const formula = hits.map((h) => h.explain && h.explain.formula).find(Boolean);
  return html`<div class="scroll"><table class="explain" data-testid="explain">
    <caption>Why each result ranked where it did${formula ? ": " + formula : ""}</caption>
    <thead><tr><th scope="col">Factor</th>${hits.map((h, i) => html`<th scope="col" title=${h.document_id}>#${i + 1}</th>`)}</tr></thead>
    <tbody>${rows.map((r) => html`<tr><th scope="row">${r}</th>${hits.map((h) => html`<td class="num">${
      h.explain && r in h.explain ? fmtValue(h.explain[r]) : ""}</td>`)}</tr>`)}</tbody>
  </table></div>`;
}

function Messages({ messages, best }) {
  return (messages || []).map((m) => html`<div class=${"msg" + (m.sequence === best ? " best" : "")}>
    <div class="meta">#${m.sequence} · ${m.role} · ${fmtTime(m.created_at)}${m.session ? " · session " + m.session : ""}
      ${"content_encoding" in m ? html` <${Compression} value=${m.content_encoding} />` : ""}</div>
    <div>${m.content}</div></div>`);
}

function Compression({ value }) {
  const text = value === "gzip+base64" ? "stored compressed (gzip)" : value === "raw" ? "stored raw (small)" : "stored uncompressed (legacy)";
  return html`<span class="mark" title=${"content_encoding: " + (value ?? "null")}>${text}</span>`;
}

function Hit({ hit, rank }) {
  const link = hit.kind === "thought" ? "#/thoughts/" + enc(hit.document_id)
    : hit.kind === "conversation" ? "#/conversations/" + enc(hit.conversation_id || hit.document_id) : null;
  const title = hit.summary || (hit.kind === "conversation" ? "Conversation" : shorten(hit.chunk_content, 100));
  return html`<li>
    <div class="row"><strong>#${rank}</strong><span class="mark">${hit.kind}</span>
      ${link ? html`<a href=${link}>${title}</a>` : html`<span>${title}</span>`}
      <span class="muted">score ${hit.score.toFixed(4)}</span><${Tags} tags=${hit.tags} /></div>
    ${hit.kind === "conversation" && hit.messages ? html`<${Messages} messages=${hit.messages} best=${hit.best_sequence} />`
      : html`<p>${shorten(hit.chunk_content, 400)}</p>`}
  </li>`;
}

export function SearchForm({ kinds: fixedKinds, conversationId, label = "Search" }) {
  const [query, setQuery] = useState("");
  const [kinds, setKinds] = useState(fixedKinds || ["thought"]);
  const [explain, setExplain] = useState(true);
  const [result, setResult] = useState(null);
  const [error, setError] = useState(null);
  const [busy, setBusy] = useState(false);
  const toggle = (k) => setKinds(kinds.includes(k) ? kinds.filter((x) => x !== k) : [...kinds, k]);
  const submit = async (e) => {
    e.preventDefault();
    setBusy(true);
    setError(null);
    try {
      const body = { query, kinds, explain, top_k: 10, ...(conversationId ? { conversation_id: conversationId } : {}) };
      setResult(await api("POST", "/v1/search", body));
    } catch (err) {
      setError(err);
      setResult(null);
    } finally {
      setBusy(false);
    }
  };
  return html`<div>
    <form class="inline" role="search" onSubmit=${submit}>
      <label>Query<input type="search" name="query" required maxlength="4000" value=${query} onInput=${(e) => setQuery(e.target.value)} /></label>
      ${!fixedKinds && html`<fieldset><legend>In</legend>
        <label class="check"><input type="checkbox" checked=${kinds.includes("thought")} onChange=${() => toggle("thought")} />Thoughts</label>
        <label class="check"><input type="checkbox" checked=${kinds.includes("conversation")} onChange=${() => toggle("conversation")} />Conversations</label>
      </fieldset>`}
      <label class="check"><input type="checkbox" name="explain" checked=${explain} onChange=${() => setExplain(!explain)} />Explain the ranking</label>
      <button type="submit" disabled=${busy || !kinds.length}>${label}</button>
    </form>
    <${ErrorBox} error=${error} />
    ${result && html`<div aria-live="polite">
      <p class="muted" data-testid="result-count">${result.results.length} result${result.results.length === 1 ? "" : "s"} for “${result.query}”</p>
      <ul class="results">${result.results.map((h, i) => html`<${Hit} hit=${h} rank=${i + 1} />`)}</ul>
      ${result.results.length > 0 && explain && html`<h2>Ranking</h2><${ExplainTable} hits=${result.results} />`}
    </div>`}
  </div>`;
}

export function SearchPage() {
  return html`<section><h1>Search</h1>
    <p class="muted">Hybrid keyword + vector search over this organization's memory; weak matches are left out.</p>
    <${SearchForm} /></section>`;
}

// ---- conversations -------------------------------------------------------------------------------------

export function ConversationsPage() {
  const [more, setMore] = useState([]);
  const [next, setNext] = useState(null);
  const [first, error, loading] = useLoad(async () => {
    const page = await api("GET", "/v1/conversations?limit=50");
    setMore([]);
    setNext(page.next_before);
    return page;
  }, []);
  const [moreError, setMoreError] = useState(null);
  const loadMore = async () => {
    try {
      const page = await api("GET", `/v1/conversations?limit=50&before=${enc(next)}`);
      setMore([...more, ...page.conversations]);
      setNext(page.next_before);
    } catch (err) {
      setMoreError(err);
    }
  };
  const list = first ? [...first.conversations, ...more] : [];
  return html`<section><h1>Conversations</h1>
    <${SearchForm} kinds=${["conversation"]} label="Search conversations" />
    <h2>Most recently active</h2>
    <${ErrorBox} error=${error} />
    ${loading && !first && html`<${Loading} />`}
    ${first && !list.length && html`<p class="notice">No conversations yet: agents append them with the conversation
      tools, software with <code>POST /v1/conversations</code>.</p>`}
    ${list.length > 0 && html`<div class="scroll"><table data-testid="conversations">
      <thead><tr><th scope="col">Title</th><th scope="col">Messages</th><th scope="col">Last active</th><th scope="col">Created</th></tr></thead>
      <tbody>${list.map((c) => html`<tr><td><a href=${"#/conversations/" + enc(c.id)}>${c.title || c.id}</a></td>
        <td class="num">${c.message_count}</td><td>${fmtTime(c.updated_at)}</td><td>${fmtTime(c.created_at)}</td></tr>`)}</tbody>
    </table></div>`}
    <${ErrorBox} error=${moreError} />
    ${next && html`<button type="button" class="secondary" onClick=${loadMore}>Older conversations</button>`}
  </section>`;
}

export function ConversationPage({ id }) {
  const [more, setMore] = useState([]);
  const [next, setNext] = useState(null);
  const [moreError, setMoreError] = useState(null);
  const [c, error, loading] = useLoad(async () => {
    const detail = await api("GET", `/v1/conversations/${enc(id)}?limit=100`);
    setMore([]);
    setNext(detail.next_from);
    return detail;
  }, [id]);
  if (error) return html`<section><h1>Conversation</h1><${ErrorBox} error=${error} /><p><a href="#/conversations">All conversations</a></p></section>`;
  if (loading && !c) return html`<${Loading} what="the conversation" />`;
  const loadMore = async () => {
    try {
      const page = await api("GET", `/v1/conversations/${enc(id)}/messages?from=${next}&limit=100`);
      setMore([...more, ...page.messages]);
      setNext(page.next_from);
    } catch (err) {
      setMoreError(err);
    }
  };
  return html`<section>
    <p><a href="#/conversations">← All conversations</a></p>
    <h1>${c.title || "Conversation"}</h1>
    <p class="muted">${c.message_count} messages · started ${fmtTime(c.created_at)} · indexing${" "}
      <${State} value=${c.indexing.state} /> (${c.indexing.chunks_indexed} of ${c.indexing.chunks_total} chunks)</p>
    <h2>Search in this conversation</h2>
    <${SearchForm} kinds=${["conversation"]} conversationId=${c.id} label="Search" />
    <h2>Messages</h2>
    <div data-testid="messages"><${Messages} messages=${[...c.messages, ...more]} /></div>
    <${ErrorBox} error=${moreError} />
    ${next && html`<button type="button" class="secondary" onClick=${loadMore}>Later messages</button>`}
  </section>`;
}

// ---- knowledge bases -----------------------------------------------------------------------------------

// a sync's files that failed (its per-file errors are in the sync's own view)
const failedFiles = (s) => { const n = (s.counts && s.counts.failed) || 0; return n ? `${n} file${n === 1 ? "" : "s"} failed` : "none"; };

export function KnowledgePage() {
  const [data, error, loading] = useLoad(() => api("GET", "/v1/knowledge-bases"), []);
  return html`<section><h1>Knowledge bases</h1>
    <${ErrorBox} error=${error} />
    ${loading && !data && html`<${Loading} />`}
    ${data && !data.knowledge_bases.length && html`<p class="notice">This organization has no knowledge base. A knowledge base
      is a markdown vault synced from git or uploaded as an archive: see <code>POST /v1/knowledge-bases</code> in the${" "}
      <a href="/docs">API docs</a>.</p>`}
    ${data && data.knowledge_bases.length > 0 && html`<div class="scroll"><table data-testid="knowledge-bases">
      <thead><tr><th scope="col">Knowledge base</th><th scope="col">Visibility</th><th scope="col">Entries</th>
        <th scope="col">Searchable chunks</th><th scope="col">Last sync</th><th scope="col">Problems</th><th scope="col">Synced</th></tr></thead>
      <tbody>${data.knowledge_bases.map((kb) => html`<tr>
        <td><a href=${"#/knowledge/" + enc(kb.slug)}>${kb.name || kb.slug}</a></td><td>${kb.visibility}</td>
        <td class="num">${kb.entries}</td><td class="num">${kb.chunks_searchable} / ${kb.chunks}</td>
        <td>${kb.last_sync ? html`<${State} value=${kb.last_sync.state} />` : "never"}</td>
        <td>${kb.last_sync ? kb.last_sync.error || failedFiles(kb.last_sync) : ""}</td>
        <td>${fmtTime(kb.last_synced_at)}</td></tr>`)}</tbody>
    </table></div>`}
  </section>`;
}

function SyncView({ kb, id }) {
  const [s, error] = useLoad(() => api("GET", `/v1/knowledge-bases/${enc(kb)}/syncs/${enc(id)}`), [kb, id]);
  if (error) return html`<${ErrorBox} error=${error} />`;
  if (!s) return html`<${Loading} what="the sync" />`;
  return html`<section data-testid="sync"><h2>Sync ${s.id}</h2>
    <${Facts} rows=${[["State", html`<${State} value=${s.state} />`], ["Trigger", s.trigger], ["Mode", s.mode || "—"],
      ["Commit", s.commit ? html`<code>${s.commit}</code>` : "—"], ["Files", `${s.files_done} of ${s.files_total ?? "?"}`],
      ["Started", fmtTime(s.started_at)], ["Finished", fmtTime(s.finished_at)], s.error && ["Error", html`<span class="error">${s.error}</span>`]]} />
    <h3>Counts</h3><${JsonView} value=${s.counts} />
    <h3>Per-file errors</h3><${JsonView} value=${s.errors || []} />
    <h3>Warnings</h3><${JsonView} value=${s.warnings || []} />
    <h3>Skipped</h3><${JsonView} value=${s.skipped || []} />
    <h3>Unresolved links</h3><${JsonView} value=${s.unresolved_links || []} />
  </section>`;
}

export function KnowledgeBasePage({ kb: slug, sync }) {
  const [kb, error] = useLoad(() => api("GET", `/v1/knowledge-bases/${enc(slug)}`), [slug]);
  const [syncs, syncsError, , reloadSyncs] = useLoad(() => api("GET", `/v1/knowledge-bases/${enc(slug)}/syncs`), [slug]);
  const [actionError, setActionError] = useState(null);
  if (error) return html`<section><h1>Knowledge base</h1><${ErrorBox} error=${error} /></section>`;
  if (!kb) return html`<${Loading} what="the knowledge base" />`;
  const syncNow = async () => {
    setActionError(null);
    try {
      await api("POST", `/v1/knowledge-bases/${enc(slug)}/sync`, {});
      reloadSyncs();
    } catch (err) {
      setActionError(err);
    }
  };
  return html`<section>
    <p><a href="#/knowledge">← All knowledge bases</a></p>
    <h1>${kb.name || kb.slug}</h1>
    <${Facts} rows=${[["Slug", kb.slug], ["Visibility", kb.visibility], ["Document tier", kb.document_tier],
      ["Source", html`<${JsonView} value=${kb.source} />`], ["Entries", kb.entries],
      ["Searchable chunks", `${kb.chunks_searchable} of ${kb.chunks}`], ["Last commit", kb.last_commit || "—"],
      ["Last synced", fmtTime(kb.last_synced_at)], ["Public API", html`<code>${kb.api_path}</code>`], ["MCP", html`<code>${kb.mcp_path}</code>`]]} />
    ${kb.source && kb.source.type === "git" && html`<div class="row"><button type="button" onClick=${syncNow}>Sync now</button></div>`}
    <${ErrorBox} error=${actionError} />
    <h2>Syncs</h2>
    <${ErrorBox} error=${syncsError} />
    ${syncs && html`<div class="scroll"><table data-testid="syncs">
      <thead><tr><th scope="col">Queued</th><th scope="col">State</th><th scope="col">Trigger</th><th scope="col">Counts</th><th scope="col">Problems</th></tr></thead>
      <tbody>${syncs.syncs.map((s) => html`<tr><td><a href=${`#/knowledge/${enc(slug)}/${enc(s.id)}`}>${fmtTime(s.created_at)}</a></td>
        <td><${State} value=${s.state} /></td><td>${s.trigger}</td>
        <td>${Object.entries(s.counts || {}).filter(([, v]) => v).map(([k, v]) => `${k} ${v}`).join(", ") || "—"}</td>
        <td>${s.error || failedFiles(s)}</td></tr>`)}</tbody>
    </table></div>`}
    ${sync && html`<${SyncView} kb=${slug} id=${sync} />`}
  </section>`;
}

// ---- keys ----------------------------------------------------------------------------------------------

const EXPIRY = [["0", "never"], ["86400", "1 day"], ["604800", "7 days"], ["2592000", "30 days"], ["7776000", "90 days"],
                ["31536000", "1 year"]];

function keyState(k) {
  if (k.revoked_at) return "revoked";
  if (k.expires_at && k.expires_at <= Date.now()) return "expired";
  return "active";
}

export function KeysPage({ who }) {
  const [name, setName] = useState("");
  const [scopes, setScopes] = useState(["read", "write"]);
  const [expiry, setExpiry] = useState("0");
  const [created, setCreated] = useState(null);
  const [formError, setFormError] = useState(null);
  const [actionError, setActionError] = useState(null);
  const [data, error, loading, reload] = useLoad(() => api("GET", "/v1/keys"), []);
  const toggle = (s) => setScopes(scopes.includes(s) ? scopes.filter((x) => x !== s) : [...scopes, s]);
  const create = async (e) => {
    e.preventDefault();
    setFormError(null);
    try {
      setCreated(await api("POST", "/v1/keys", { name, scopes, expires_in_seconds: Number(expiry) }));
      setName("");
      reload();
    } catch (err) {
      setFormError(err);
    }
  };
  const revoke = async (k) => {
    setActionError(null);
    try {
      await api("DELETE", `/v1/keys/${enc(k.id)}`);
      reload();
    } catch (err) {
      setActionError(err);
    }
  };
  return html`<section><h1>API keys</h1>
    <form class="stack" onSubmit=${create} aria-labelledby="new-key">
      <h2 id="new-key">New key</h2>
      <label>Name<input name="key-name" required maxlength="100" value=${name} onInput=${(e) => setName(e.target.value)} /></label>
      <fieldset><legend>Scopes</legend>
        ${["read", "write", "admin"].map((s) => html`<label class="check"><input type="checkbox" name=${"scope-" + s}
          checked=${scopes.includes(s)} onChange=${() => toggle(s)} />${s}</label>`)}
        <p class="muted">read: search and fetch · write: capture, append, delete · admin: everything, keys included</p>
      </fieldset>
      <label>Expires after<select name="expiry" value=${expiry} onChange=${(e) => setExpiry(e.target.value)}>
        ${EXPIRY.map(([v, l]) => html`<option value=${v}>${l}</option>`)}</select></label>
      <${ErrorBox} error=${formError} />
      <div><button type="submit" disabled=${!scopes.length}>Create key</button></div>
    </form>
    ${created && html`<div class="notice" role="status"><p>Key <strong>${created.name}</strong> created. It is shown this
      once: copy it now.</p><${Secret} value=${created.key} label="the new key" /></div>`}
    <h2>Keys</h2>
    <${ErrorBox} error=${error || actionError} />
    ${loading && !data && html`<${Loading} />`}
    ${data && html`<div class="scroll"><table data-testid="keys">
      <thead><tr><th scope="col">Name</th><th scope="col">Prefix</th><th scope="col">Scopes</th><th scope="col">Created</th>
        <th scope="col">Expires</th><th scope="col">Last used</th><th scope="col">State</th><th scope="col"></th></tr></thead>
      <tbody>${data.keys.map((k) => {
        const state = keyState(k);
        const mine = who.principal === "key:" + k.id;
        return html`<tr data-key=${k.id}><td>${k.name}${mine ? html` <span class="mark">this session</span>` : ""}</td>
          <td><code>${k.prefix}</code></td><td>${k.scopes.join(", ")}</td><td>${fmtTime(k.created_at)}</td>
          <td>${k.expires_at ? fmtTime(k.expires_at) : "never"}</td><td>${fmtTime(k.last_used_at)}</td>
          <td><${State} value=${state} /></td>
          <td>${state === "active" && html`<${Confirm} label="Revoke" confirmLabel=${mine ? "Revoke (signs you out)" : "Revoke now"}
            onConfirm=${() => revoke(k)} />`}</td></tr>`;
      })}</tbody>
    </table></div>`}
  </section>`;
}

// ---- usage ---------------------------------------------------------------------------------------------

export function UsagePage() {
  const [data, error, loading] = useLoad(() => api("GET", "/v1/usage"), []);
  const isObj = (v) => v !== null && typeof v === "object";
  let body = null;
  if (error && error.status === 404) {
    body = html`<p class="notice">This service does not report usage yet.</p>`;
  } else if (error) {
    body = html`<${ErrorBox} error=${error} />`;
  } else if (data && isObj(data) && !Array.isArray(data)) {
    const scalars = Object.fromEntries(Object.entries(data).filter(([, v]) => !isObj(v)));
    const nested = Object.entries(data).filter(([, v]) => isObj(v));
    body = html`<div data-testid="usage">
      ${Object.keys(scalars).length > 0 && html`<${JsonView} value=${scalars} />`}
      ${nested.map(([k, v]) => html`<h2>${k.replace(/_/g, " ")}</h2><${JsonView} value=${v} />`)}</div>`;
  } else if (data) {
    body = html`<div data-testid="usage"><${JsonView} value=${data} /></div>`;
  }
  return html`<section><h1>Usage and limits</h1>${loading && !data && !error ? html`<${Loading} />` : body}</section>`;
}
