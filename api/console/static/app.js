// The Memex console: sign up, sign in with a key, and the organization's pages. Routes live in the URL's
// fragment (#/thoughts, #/keys, ...); the key never does (it stays in sessionStorage).
import { html, render, useState, useEffect } from "./vendor/preact-htm.js";
import { api, session, go, ErrorBox, Loading, Secret } from "./lib.js";
import { ThoughtsPage, ThoughtPage, SearchPage, ConversationsPage, ConversationPage, KnowledgePage,
         KnowledgeBasePage, KeysPage, UsagePage } from "./pages.js";
import { ConnectPage } from "./connect.js";

const NAV = [
  ["thoughts", "Thoughts"], ["search", "Search"], ["conversations", "Conversations"], ["knowledge", "Knowledge bases"],
  ["keys", "Keys"], ["usage", "Usage"], ["connect", "Connect an agent"],
];

function useRoute() {
  const parse = () => location.hash.replace(/^#\/?/, "").split("/").filter(Boolean).map(decodeURIComponent);
  const [route, setRoute] = useState(parse());
  useEffect(() => {
    const on = () => { setRoute(parse()); window.scrollTo(0, 0); };
    addEventListener("hashchange", on);
    return () => removeEventListener("hashchange", on);
  }, []);
  return route;
}

function SignUp({ onSignedIn }) {
  const [name, setName] = useState("");
  const [slug, setSlug] = useState("");
  const [slugEdited, setSlugEdited] = useState(false);
  const [error, setError] = useState(null);
  const [busy, setBusy] = useState(false);
  const [created, setCreated] = useState(null);
  const suggest = (n) => n.toLowerCase().normalize("NFKD").replace(/[^a-z0-9]+/g, "-").replace(/^[^a-z]+|-+$/g, "").slice(0, 40);
  const submit = async (e) => {
    e.preventDefault();
    setBusy(true);
    setError(null);
    try {
      setCreated(await api("POST", "/v1/signup", { name, slug }, { key: null }));
    } catch (err) {
      setError(err);
    } finally {
      setBusy(false);
    }
  };
  if (created) {
    return html`<section aria-labelledby="signed-up">
      <h2 id="signed-up">${created.organization.name} is ready</h2>
      <p>This is the organization's first key (scopes: ${created.api_key.scopes.join(", ")}).${" "}
         <strong>It is shown this once:</strong> copy it to a password manager now. Memex keeps only its hash.</p>
      <${Secret} value=${created.api_key.key} label="your new API key" />
      <p>MCP URL for your agents: <code>${created.mcp_url}</code></p>
      <p><button type="button" onClick=${() => onSignedIn(created.api_key.key)}>I have copied it: open the console</button></p>
    </section>`;
  }
  return html`<form class="stack" onSubmit=${submit} aria-labelledby="signup-title">
    <h2 id="signup-title">Create an organization</h2>
    <label>Organization name
      <input name="name" required maxlength="200" value=${name}
             onInput=${(e) => { setName(e.target.value); if (!slugEdited) setSlug(suggest(e.target.value)); }} /></label>
    <label>Slug (in your MCP URL: 3-40 of a-z, 0-9 and single hyphens, starting with a letter)
      <input name="slug" required minlength="3" maxlength="40" pattern="[a-z](-?[a-z0-9])+" value=${slug}
             onInput=${(e) => { setSlug(e.target.value); setSlugEdited(true); }} /></label>
    <${ErrorBox} error=${error} />
    <div><button type="submit" disabled=${busy}>Sign up</button></div>
  </form>`;
}

function SignIn({ onSignedIn, error: outer }) {
  const [key, setKey] = useState("");
  const [error, setError] = useState(null);
  const submit = async (e) => {
    e.preventDefault();
    setError(null);
    try {
      await api("GET", "/v1/org", undefined, { key: key.trim() });
      onSignedIn(key.trim());
    } catch (err) {
      setError(err);
    }
  };
  return html`<form class="stack" onSubmit=${submit} aria-labelledby="signin-title">
    <h2 id="signin-title">Sign in with an API key</h2>
    <label>API key
      <input name="key" type="password" autocomplete="off" spellcheck=${false} required placeholder="mx_…"
             value=${key} onInput=${(e) => setKey(e.target.value)} /></label>
    <p class="muted">The key stays in this browser tab (session storage) and is sent only to this service, in the
       Authorization header. Closing the tab or signing out forgets it.</p>
    <${ErrorBox} error=${error || outer} />
    <div><button type="submit">Sign in</button></div>
  </form>`;
}

function Welcome({ onSignedIn, error }) {
  return html`<main>
    <h1>Memex</h1>
    <p>Memory for AI agents: your team's notes and conversations, found again by meaning and keywords, shared with
       your agents over MCP. API reference: <a href="/docs">/docs</a>.</p>
    <div class="columns">
      <div><${SignIn} onSignedIn=${onSignedIn} error=${error} /></div>
      <div><${SignUp} onSignedIn=${onSignedIn} /></div>
    </div>
  </main>`;
}

function Page({ route, who }) {
  const [name, arg] = route;
  switch (name) {
    case "thoughts": return arg ? html`<${ThoughtPage} id=${arg} />` : html`<${ThoughtsPage} />`;
    case "search": return html`<${SearchPage} />`;
    case "conversations": return arg ? html`<${ConversationPage} id=${arg} />` : html`<${ConversationsPage} />`;
    case "knowledge": return arg ? html`<${KnowledgeBasePage} kb=${arg} sync=${route[2]} />` : html`<${KnowledgePage} />`;
    case "keys": return html`<${KeysPage} who=${who} />`;
    case "usage": return html`<${UsagePage} />`;
    case "connect": return html`<${ConnectPage} who=${who} />`;
    default: return html`<${ThoughtsPage} />`;
  }
}

function App() {
  const route = useRoute();
  const [who, setWho] = useState(null);
  const [error, setError] = useState(null);
  const [checking, setChecking] = useState(!!session.key());

  const load = async () => {
    if (!session.key()) { setChecking(false); return; }
    try {
      setWho(await api("GET", "/v1/org"));
    } catch (err) {
      session.clear();
      setError(err);
    } finally {
      setChecking(false);
    }
  };
  useEffect(() => { load(); }, []);

  const signedIn = (key) => {
    session.set(key);
    setError(null);
    setChecking(true);
    if (!location.hash || location.hash === "#/") go("thoughts");
    load();
  };
  const signOut = () => {
    session.clear();
    setWho(null);
    go("");
  };

  if (checking) return html`<main><${Loading} what="your organization" /></main>`;
  if (!who) return html`<${Welcome} onSignedIn=${signedIn} error=${error} />`;
  const current = route[0] || "thoughts";
  return html`<div>
    <header class="top">
      <a class="brand" href="#/thoughts">Memex</a>
      <nav aria-label="Console"><ul>
        ${NAV.map(([path, label]) => html`<li><a href=${"#/" + path}
          aria-current=${current === path ? "page" : undefined}>${label}</a></li>`)}
      </ul></nav>
      <div class="who"><span data-testid="org">${who.organization.name} (${who.organization.slug})</span>
        <button type="button" class="secondary" onClick=${signOut}>Sign out</button></div>
    </header>
    <main><${Page} route=${route.length ? route : ["thoughts"]} who=${who} /></main>
  </div>`;
}

const root = document.getElementById("app");
root.textContent = "";  // the "Loading" placeholder of index.html
render(html`<${App} />`, root);
