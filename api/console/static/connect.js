// "Connect an agent": ready-to-paste configuration with the organization's MCP URL and a freshly made key.
import { useState } from "./vendor/preact-htm.js";
import { html, api, ErrorBox, Snippet } from "./lib.js";

const today = () => new Date().toISOString().slice(0, 10);

export function snippets(url, key) {
  const bearer = `Bearer ${key}`;
  return {
    claude: `claude mcp add --transport http memex ${url} --header "Authorization: ${bearer}"`,
    cursor: JSON.stringify({ mcpServers: { memex: { url, headers: { Authorization: bearer } } } }, null, 2),
    vscode: JSON.stringify({ servers: { memex: { type: "http", url, headers: { Authorization: bearer } } } }, null, 2),
    inspector: `npx -y @modelcontextprotocol/inspector --cli ${url} --transport http \\\n` +
               `    --header "Authorization: ${bearer}" --method tools/list`,
    python: `# pip install "mcp>=1.24,<2" httpx   (then: python memex_agent.py)
import asyncio

import httpx
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client

URL = ${JSON.stringify(url)}
KEY = ${JSON.stringify(key)}


async def main() -> None:
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as http:
        async with streamable_http_client(URL, http_client=http) as (read, write, _):
            async with ClientSession(read, write) as session:
                await session.initialize()
                tools = await session.list_tools()
                print("tools:", ", ".join(tool.name for tool in tools.tools))
                saved = await session.call_tool("capture_thought", {"content": "Memex is connected to this agent.", "wait": True})
                print("captured:", saved.structuredContent)
                found = await session.call_tool("semantic_search", {"query": "is memex connected?"})
                for hit in (found.structuredContent or {}).get("results", []):
                    print(f"{hit['score']:.3f}  {hit['chunk_content']}")


asyncio.run(main())
`,
  };
}

export function ConnectPage({ who }) {
  const [key, setKey] = useState(null);
  const [error, setError] = useState(null);
  const [busy, setBusy] = useState(false);
  const url = who.mcp_url;
  const make = async () => {
    setBusy(true);
    setError(null);
    try {
      setKey(await api("POST", "/v1/keys", { name: `agent-${today()}`, scopes: ["read", "write"] }));
    } catch (err) {
      setError(err);
    } finally {
      setBusy(false);
    }
  };
  const s = snippets(url, key ? key.key : "<make a key above>");
  return html`<section><h1>Connect an agent</h1>
    <p>Your organization's MCP URL (Streamable HTTP): <code data-testid="mcp-url">${url}</code></p>
    <p>Give each agent a key of its own, with the read and write scopes only: it can then be revoked on the${" "}
       <a href="#/keys">Keys</a> page without touching anything else.</p>
    <div class="row">
      <button type="button" onClick=${make} disabled=${busy}>${key ? "Make another key" : "Make a key for an agent"}</button>
      ${key && html`<span class="ok" role="status">Key <strong>${key.name}</strong> made (read, write). It is filled in below and shown
        only on this page: copy what you need before leaving it.</span>`}
    </div>
    <${ErrorBox} error=${error} />
    <${Snippet} title="Claude Code" testid="snippet-claude" text=${s.claude} note="Run in a terminal; then ask Claude to remember or find something." />
    <${Snippet} title="Cursor (~/.cursor/mcp.json or .cursor/mcp.json)" testid="snippet-cursor" text=${s.cursor} />
    <${Snippet} title="VS Code (.vscode/mcp.json)" testid="snippet-vscode" text=${s.vscode} />
    <${Snippet} title="MCP Inspector" testid="snippet-inspector" text=${s.inspector}
      note=${"Needs Node.js 22.19 or later. With Node 20, npx silently resolves the old inspector 0.15.0, which has no --header " +
             "option. Without --cli (and its arguments) the inspector opens its web UI: choose Streamable HTTP, this URL, " +
             "and add the Authorization header."} />
    <${Snippet} title="Python (the mcp SDK)" testid="snippet-python" text=${s.python} note="A complete script: it lists the tools, stores a thought and finds it." />
  </section>`;
}
