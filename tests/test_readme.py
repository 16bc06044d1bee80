"""The README is executable: its shell and Python blocks run, in order, against a live ``memex serve``.

The convention, in README.md's source:

* Every fenced block names its language. ```` ```bash ````, ```` ```sh ````, ```` ```shell ```` and ```` ```python ````
  blocks RUN; any other language (``json``, ``text``...) is text. A fence with no language fails this test (it could
  be a command nobody runs).
* A block that must not run here (an install, ``memex serve`` itself, a Cloudflare account, Claude Code, the MCP
  Inspector through npx) is marked by the line just before its fence::

      <!-- readme-test: skip (the reason) -->

  The reason is required, and the marker must stand before a runnable block (a stale marker fails).
* The MCP tool table follows ``<!-- readme-test: mcp-tools -->``: its first column (the tool names) must be exactly
  what the server lists over MCP (``tools/list`` through the SDK's client) to an admin key, and its ``read`` rows
  what it lists to a read-only key.

How the blocks run: ``memex serve`` (the installed command) on a free loopback port, in a temporary folder (data in
its ``./data``, as the README says), with the offline hash embedder. Every block runs in that folder, in README
order, in one shell environment carried from block to block: shell blocks run in ``bash`` with ``set -euo pipefail``
and ``set -a`` (so a variable a block sets, ``ID=$(...)``, is there for the next block, as in one terminal), and
``curl`` runs with ``--fail-with-body`` (an example answering an error fails the test); Python blocks run as a script
with the environment the shell blocks left, and must print something (a coroutine never awaited exits 0 silently).
``MEMEX_URL`` starts at the service's address (what a reader on another
port sets); everything else comes from the README's own commands (``eval "$(memex signup ...)"``).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.conftest import stop
from tests.live import free_port
from tests.mcp_client import mcp_session

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
RUNNABLE = {"bash": "shell", "sh": "shell", "shell": "shell", "python": "python"}
SKIP = re.compile(r"^<!--\s*readme-test:\s*skip\s*(?:\((?P<reason>[^)]*)\))?\s*-->$")
TOOLS = "<!-- readme-test: mcp-tools -->"
FENCE = re.compile(r"^(?P<indent>\s*)```(?P<info>[^`]*)$")
BLOCK_SECONDS = 180


@dataclass
class Block:
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    skip: str | None  # the reason, when marked


def parse(text: str) -> tuple[list[Block], list[str]]:
    """The README's fenced blocks, and the convention's violations."""
    lines = text.splitlines()
    blocks: list[Block] = []
    problems: list[str] = []
    i = 0
    while i < len(lines):
        opened = FENCE.match(lines[i])
        if not opened:
            if SKIP.match(lines[i].strip()):
                after = next((j for j in range(i + 1, len(lines)) if lines[j].strip()), None)
                fence = FENCE.match(lines[after]) if after is not None else None
                lang = fence.group("info").strip().split(" ")[0].lower() if fence else ""
                if lang not in RUNNABLE:
                    problems.append(f"line {i + 1}: a skip marker that does not stand before a runnable block")
            i += 1
            continue
        lang = opened.group("info").strip().split(" ")[0].lower()
        indent = len(opened.group("indent"))
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), None)
        if end is None:
            problems.append(f"line {i + 1}: a fence that is never closed")
            break
        before = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        marker = SKIP.match(before)
        if not lang:
            problems.append(f"line {i + 1}: a fence without a language (bash, python, json, text...)")
        elif marker and not (marker.group("reason") or "").strip():
            problems.append(f"line {i + 1}: a skip marker without its reason")
        code = textwrap.dedent("\n".join(line[indent:] if line[:indent].isspace() else line for line in lines[i + 1:end]))
        blocks.append(Block(i + 1, lang, code + "\n", (marker.group("reason") or "").strip() if marker else None))
        i = end + 1
    return blocks, problems


def readme_tools(text: str) -> dict[str, str]:
    """The tool table after the mcp-tools marker: name -> scope."""
    lines = text.splitlines()
    start = lines.index(TOOLS)
    tools: dict[str, str] = {}
    for line in lines[start + 1:]:
        if not line.startswith("|"):
            if tools:
                break
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        name = re.fullmatch(r"`([a-z_]+)`", cells[0])
        if name:
            tools[name.group(1)] = cells[1]
    return tools


def test_every_block_is_runnable_or_marked():
    blocks, problems = parse(README.read_text(encoding="utf-8"))
    assert not problems, "\n".join(problems)
    runnable = [b for b in blocks if b.lang in RUNNABLE]
    assert len([b for b in runnable if b.skip is None]) >= 8, "the README's examples are no longer runnable blocks"
    skipped = {b.skip for b in runnable if b.skip is not None}
    assert any("serve" in reason for reason in skipped), skipped  # the install-and-serve line is the one not run here


# -- the live service -------------------------------------------------------------------------------------------


def _memex_command(bin_dir: Path) -> Path:
    """The installed ``memex`` beside this interpreter, or (a checkout run without installing) a shim that runs this
    checkout's ``api.cli`` with this interpreter."""
    installed = Path(sys.executable).parent / "memex"
    if installed.exists():
        return installed
    shim = bin_dir / "memex"
    shim.write_text(f'#!/bin/sh\nPYTHONPATH="{ROOT}${{PYTHONPATH:+:$PYTHONPATH}}" exec "{sys.executable}" -m api.cli "$@"\n')
    shim.chmod(0o755)
    return shim


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    """``memex serve`` on a free loopback port in a temporary folder; (its URL, the folder, the shell environment)."""
    if shutil.which("curl") is None or shutil.which("bash") is None:
        pytest.skip("the README's examples need bash and curl")
    home = tmp_path_factory.mktemp("readme")
    bin_dir = home / ".bin"
    bin_dir.mkdir()
    memex = _memex_command(bin_dir)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMEX_")}
    env.update(MEMEX_EMBEDDER="hash", PATH=os.pathsep.join([str(memex.parent), str(Path(sys.executable).parent),
                                                             str(bin_dir), env.get("PATH", "")]))
    port = free_port()
    log = (home / "serve.log").open("w")
    proc = subprocess.Popen([str(memex), "serve", "--host", "127.0.0.1", "--port", str(port)], cwd=home, env=env,
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail("memex serve did not start:\n" + (home / "serve.log").read_text()[-3000:])
            time.sleep(0.1)
        yield url, home, {**env, "MEMEX_URL": url}
    finally:
        stop(proc)
        log.close()


PRELUDE = """set -euo pipefail
set -a
curl() { command curl --fail-with-body --show-error "$@"; }
"""


def _run_shell(block: Block, home: Path, env: dict[str, str]) -> tuple[subprocess.CompletedProcess, dict[str, str]]:
    dump = home / ".readme-env"
    dump.unlink(missing_ok=True)
    script = f'{PRELUDE}\n{block.code}\nenv -0 > "{dump}"\n'
    done = subprocess.run(["bash", "--noprofile", "--norc", "-c", script], cwd=home, env=env, capture_output=True,
                          text=True, timeout=BLOCK_SECONDS)
    if done.returncode != 0 or not dump.exists():
        return done, env
    pairs = (item.split("=", 1) for item in dump.read_text().split("\0") if "=" in item)
    after = {k: v for k, v in pairs if not k.startswith("BASH_FUNC_") and k not in ("SHLVL", "_", "PWD", "OLDPWD")}
    return done, after


def _run_python(block: Block, home: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    script = home / f"readme_block_{block.line}.py"
    script.write_text(block.code)
    return subprocess.run([sys.executable, str(script)], cwd=home, env=env, capture_output=True, text=True,
                          timeout=BLOCK_SECONDS)


def test_the_readme_runs_in_order(service):
    url, home, env = service
    blocks, problems = parse(README.read_text(encoding="utf-8"))
    assert not problems, "\n".join(problems)
    ran = []
    for block in blocks:
        kind = RUNNABLE.get(block.lang)
        if kind is None or block.skip is not None:
            continue
        if kind == "shell":
            done, env = _run_shell(block, home, env)
        else:
            done = _run_python(block, home, env)
        assert done.returncode == 0, (
            f"README.md line {block.line} ({block.lang}) failed with exit {done.returncode}:\n{block.code}\n"
            f"--- stdout ---\n{done.stdout[-4000:]}\n--- stderr ---\n{done.stderr[-4000:]}")
        if kind == "python":  # a coroutine never awaited (main() without asyncio.run) exits 0: what it printed tells
            assert done.stdout.strip() and "RuntimeWarning" not in done.stderr, (
                f"README.md line {block.line}: the Python block printed nothing or warned:\n{done.stderr[-2000:]}")
        ran.append(block.line)
    # the sign-up exported what every later block used, and the service's answers were real ones
    assert env.get("MEMEX_KEY", "").startswith("mx_") and env.get("MEMEX_MCP_URL") == f"{url}/orgs/acme/mcp", env
    assert env["MEMEX_URL"] == url
    with httpx.Client(base_url=url, headers={"authorization": f"Bearer {env['MEMEX_KEY']}"}, timeout=30) as http:
        thought = http.get(f"/v1/thoughts/{env['ID']}").json()
        assert "Redis pool exhaustion" in thought["content"]
        assert http.get(f"/v1/thoughts/{env['SCRATCH']}").status_code == 404  # the README deleted it
        keys = {k["name"]: k for k in http.get("/v1/keys").json()["keys"]}
        assert keys["agent"]["revoked_at"] and keys["ci"]["expires_at"]  # made through the API and the CLI
    assert len(ran) >= 8, ran


async def test_the_readme_lists_the_tools_the_server_offers(service):
    url, _, _ = service
    documented = readme_tools(README.read_text(encoding="utf-8"))
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        r = await http.post("/v1/signup", json={"name": "Tool check", "slug": "tool-check"})
        assert r.status_code == 201, r.text
        admin = r.json()["api_key"]["key"]
        r = await http.post("/v1/keys", json={"name": "reader", "scopes": ["read"]},
                            headers={"authorization": f"Bearer {admin}"})
        reader = r.json()["key"]
    mcp_url = f"{url}/orgs/tool-check/mcp"
    async with mcp_session(mcp_url, {"authorization": f"Bearer {admin}"}) as session:
        every = sorted(t.name for t in (await session.list_tools()).tools)
    async with mcp_session(mcp_url, {"authorization": f"Bearer {reader}"}) as session:
        readable = sorted(t.name for t in (await session.list_tools()).tools)
    assert sorted(documented) == every, "README.md's MCP tool table differs from the server's tools/list"
    assert sorted(n for n, scope in documented.items() if scope == "read") == readable, "a tool's scope is wrong"
