"""The ``memex`` command as a newcomer meets it: ``memex signup`` through a running service, one duration syntax,
human output with real characters and ``--json`` for scripts, every command from any directory, and tqdm progress
bars only where someone watches. Commands run as subprocesses (``python -m api.cli``) from a folder that is not
the repository, with the hash embedder."""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import pty
import shlex
import struct
import subprocess
import sys
import tempfile
import termios
import time
from pathlib import Path

import pytest

from api import cli
from api.cli_common import parse_duration
from tests.conftest import start_live
from tests.live import free_port

ROOT = Path(__file__).resolve().parents[1]


def run(cwd: Path, *args: str, code: int = 0, env: dict[str, str] | None = None, **kw) -> subprocess.CompletedProcess:
    """``memex ARGS`` from ``cwd`` (the repository only on PYTHONPATH), no MEMEX_* setting of the caller's."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MEMEX_")}
    merged = {**clean, "MEMEX_EMBEDDER": "hash", "PYTHONPATH": str(ROOT), **(env or {})}
    out = subprocess.run([sys.executable, "-m", "api.cli", *args], cwd=cwd, env=merged, capture_output=True,
                         text=True, timeout=180, **kw)
    assert out.returncode == code, f"memex {' '.join(args)}: exit {out.returncode}\n{out.stdout}\n{out.stderr}"
    assert "Traceback" not in out.stderr, out.stderr
    return out


@pytest.fixture(scope="module")
def server():
    with tempfile.TemporaryDirectory() as tmp:
        live, ctx = start_live(Path(tmp), embedder="hash")
        try:
            yield live
        finally:
            ctx.__exit__(None, None, None)


# -- memex signup --------------------------------------------------------------------------------------------


def test_signup_prints_exports_that_eval_sets(server, tmp_path):
    out = run(tmp_path, "signup", "--name", "Acme Résumé", "--slug", "cli-acme", "--url", server.base_url)
    lines = out.stdout.strip().splitlines()
    assert [line.split("=")[0] for line in lines] == ["export MEMEX_URL", "export MEMEX_KEY", "export MEMEX_MCP_URL"]
    # what `eval "$(memex signup ...)"` leaves in the shell, used as the README uses it
    script = f'eval "$({shlex.join([sys.executable, "-m", "api.cli", "signup", "--name", "Beta", "--slug", "cli-beta"])})"\n' \
             'curl -s --fail-with-body "$MEMEX_URL/v1/org" -H "authorization: Bearer $MEMEX_KEY"\n' \
             'echo; echo "$MEMEX_MCP_URL"'
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MEMEX_URL": server.base_url}
    shell = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=tmp_path, env=env, capture_output=True,
                           text=True, timeout=120)
    assert shell.returncode == 0, shell.stderr
    org, mcp_url = shell.stdout.strip().splitlines()
    assert json.loads(org)["organization"]["slug"] == "cli-beta" and mcp_url == f"{server.base_url}/orgs/cli-beta/mcp"
    assert "signed up Beta (cli-beta)" in shell.stderr  # the note, on stderr: eval never sees it

    as_json = json.loads(run(tmp_path, "signup", "--name", "Gamma", "--slug", "cli-gamma", "--json",
                             env={"MEMEX_URL": server.base_url}).stdout)
    assert as_json["organization"]["slug"] == "cli-gamma" and as_json["api_key"]["key"].startswith("mx_")
    assert as_json["mcp_url"] == f"{server.base_url}/orgs/cli-gamma/mcp" and as_json["url"] == server.base_url


def test_signup_refused_or_unreachable_is_one_line_and_exit_1(server, tmp_path):
    taken = run(tmp_path, "signup", "--name", "Again", "--slug", "cli-acme-2", "--url", server.base_url)
    assert taken.stdout
    again = run(tmp_path, "signup", "--name", "Again", "--slug", "cli-acme-2", "--url", server.base_url, code=1)
    assert again.stdout == "" and len(again.stderr.strip().splitlines()) == 1
    assert "refused the sign-up (409)" in again.stderr and "conflict" in again.stderr
    bad = run(tmp_path, "signup", "--name", "Bad", "--slug", "No Spaces", "--url", server.base_url, code=1)
    assert "(400)" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
    down = run(tmp_path, "signup", "--name", "Down", "--slug", "cli-down", "--url", f"http://127.0.0.1:{free_port()}",
               code=1)
    assert down.stdout == "" and len(down.stderr.strip().splitlines()) == 1
    assert "cannot reach the Memex service" in down.stderr and "memex serve" in down.stderr


# -- durations ---------------------------------------------------------------------------------------------------


def test_one_duration_syntax():
    assert [parse_duration(t) for t in ("45s", "90m", "12h", "30d", "2w")] == [45, 5400, 43200, 2592000, 1209600]
    for junk in ("30", "d", "1.5h", "-3d", "0d", "30 days", "3y", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="not a duration"):
            parse_duration(junk)


def test_key_create_expires_in(tmp_path):
    data = str(tmp_path / "data")
    run(tmp_path, "org", "create", "--name", "Keys", "--slug", "keys", "--data-dir", data)
    before = int(time.time() * 1000)
    made = json.loads(run(tmp_path, "key", "create", "--org", "keys", "--name", "ci", "--expires-in", "30d", "--json",
                          "--data-dir", data).stdout)
    after = int(time.time() * 1000)
    assert before + 30 * 86_400_000 <= made["expires_at"] <= after + 30 * 86_400_000
    never = json.loads(run(tmp_path, "key", "create", "--org", "keys", "--name", "forever", "--json",
                           "--data-dir", data).stdout)
    assert never["expires_at"] is None
    junk = run(tmp_path, "key", "create", "--org", "keys", "--name", "x", "--expires-in", "30x", "--data-dir", data,
               code=2)
    assert "--expires-in" in junk.stderr and "not a duration" in junk.stderr and "90m, 12h, 30d, 2w" in junk.stderr
    run(tmp_path, "key", "create", "--org", "keys", "--name", "x", "--expires-at", "1", "--data-dir", data, code=2)
    too_long = run(tmp_path, "key", "create", "--org", "keys", "--name", "x", "--expires-in", "3651d", "--data-dir", data,
                   code=2)
    assert "at most 3650d" in too_long.stderr


# -- output ------------------------------------------------------------------------------------------------------


def test_human_output_prints_real_characters_and_json_is_for_scripts(tmp_path):
    data = str(tmp_path / "data")
    made = run(tmp_path, "org", "create", "--name", "Café Ünïcode", "--slug", "cafe", "--data-dir", data)
    assert "Café Ünïcode" in made.stdout and "\\u" not in made.stdout and "Store the key now" in made.stderr
    listed = run(tmp_path, "key", "list", "--org", "cafe", "--data-dir", data).stdout
    header, row = listed.strip().splitlines()
    assert header.split()[:4] == ["ID", "NAME", "PREFIX", "SCOPES"]
    assert "…" in row and "\\u2026" not in listed and "admin, read, write" in row and " UTC" in row
    as_json = run(tmp_path, "key", "list", "--org", "cafe", "--json", "--data-dir", data).stdout
    keys = json.loads(as_json)
    assert keys[0]["prefix"].endswith("…") and "…" in as_json  # real characters in JSON too
    assert "key_hash" not in keys[0] and "key" not in keys[0]


def _leaves(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _leaves(sub, (*path, name))
            return
    yield path, parser


def test_every_command_that_prints_data_takes_json():
    # serve and cloudflare dev print a banner and run until stopped; openapi prints the document, JSON already
    no_data = {("serve",), ("cloudflare", "dev"), ("openapi",)}
    for path, parser in _leaves(cli.build_parser()):
        options = {o for a in parser._actions for o in a.option_strings}
        if path in no_data:
            continue
        assert "--json" in options, f"memex {' '.join(path)} has no --json"


# -- any directory ---------------------------------------------------------------------------------------------


def test_openapi_outside_the_checkout(tmp_path, monkeypatch):
    out = run(tmp_path, "openapi")
    assert json.loads(out.stdout)["info"]["title"] == "Memex API" and list(tmp_path.iterdir()) == []
    run(tmp_path, "openapi", "--output", "spec.json")
    assert json.loads((tmp_path / "spec.json").read_text())["openapi"].startswith("3.")
    refused = run(tmp_path, "openapi", "--output", "no/such/folder/spec.json", code=1)
    assert refused.stderr.startswith("memex openapi: cannot write") and len(refused.stderr.strip().splitlines()) == 1
    monkeypatch.chdir(tmp_path)
    assert not cli._in_checkout()  # stdout here
    monkeypatch.chdir(ROOT / "tests")
    assert cli._in_checkout()  # the committed file, from anywhere inside the checkout


def test_every_command_works_from_another_directory(tmp_path):
    """Each command that reads the data directory, run from a folder that is neither the repository nor the data
    directory's parent: relative paths are the caller's, nothing is looked up beside the repository."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    data = ["--data-dir", str(tmp_path / "data")]
    run(elsewhere, "migrate", *data)
    run(elsewhere, "org", "create", "--name", "Far", "--slug", "far", *data)
    (elsewhere / "notes.jsonl").write_text("".join(json.dumps({"content": f"Far away note {i} about the orchard."}) + "\n"
                                                   for i in range(5)))
    imported = json.loads(run(elsewhere, "import", "notes.jsonl", "--org", "far", "--json", *data).stdout)
    assert imported["thoughts"]["created"] == 5
    status = json.loads(run(elsewhere, "migrate", "--status", "--json", *data).stdout)
    assert status["organizations"][0]["pending"] == []
    reindexed = json.loads(run(elsewhere, "reindex", "--org", "far", "--json", *data).stdout)
    assert reindexed["chunks"] >= 5
    assert "far:" in run(elsewhere, "enrich", "backfill", "--org", "far", *data).stdout
    compressed = json.loads(run(elsewhere, "conversations", "backfill-compress", "--org", "far", "--json", *data).stdout)
    assert compressed["far"]["processed"] == 0
    (elsewhere / "vault").mkdir()
    (elsewhere / "vault" / "a.md").write_text("---\ntitle: A\npublish: true\n---\n\nAn orchard note.\n")
    run(elsewhere, "kb", "create", "--org", "far", "--slug", "notes", "--upload", *data)
    synced = json.loads(run(elsewhere, "kb", "import", "--org", "far", "notes", "vault", "--json", *data).stdout)
    assert synced["state"] == "succeeded" and synced["knowledge_base"]["entries"] == 1
    listed = run(elsewhere, "kb", "list", "--org", "far", *data).stdout
    assert listed.splitlines()[0].split()[:2] == ["SLUG", "NAME"] and "notes" in listed
    run(elsewhere, "org", "export", "--org", "far", "-o", "far.jsonl", *data)
    assert (elsewhere / "far.jsonl").stat().st_size > 0
    assert sorted(p.name for p in elsewhere.iterdir()) == ["far.jsonl", "notes.jsonl", "vault"]


# -- progress bars ------------------------------------------------------------------------------------------------


def _with_a_terminal(cwd: Path, *args: str, env: dict[str, str]) -> tuple[str, str]:
    """Run ``memex ARGS`` with stderr on a pseudo-terminal; (stdout, what the terminal showed)."""
    main, secondary = pty.openpty()
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))  # a terminal has a size
    try:
        proc = subprocess.Popen([sys.executable, "-m", "api.cli", *args], cwd=cwd, env=env, stdout=subprocess.PIPE,
                                stderr=secondary, text=True)
        os.close(secondary)
        shown = b""
        while True:
            try:
                chunk = os.read(main, 65536)
            except OSError:  # the terminal's other end closed: the command is done
                break
            if not chunk:
                break
            shown += chunk
        stdout = proc.stdout.read() if proc.stdout else ""
        assert proc.wait(timeout=180) == 0, shown.decode(errors="replace")
    finally:
        os.close(main)
    return stdout, shown.decode(errors="replace")


def test_progress_bars_on_a_terminal_only(tmp_path):
    data = ["--data-dir", str(tmp_path / "data")]
    run(tmp_path, "org", "create", "--name", "Bars", "--slug", "bars", *data)
    (tmp_path / "n.jsonl").write_text("".join(json.dumps({"content": f"Bar note {i}."}) + "\n" for i in range(20)))
    piped = run(tmp_path, "import", "n.jsonl", "--org", "bars", *data)
    assert "%|" not in piped.stderr  # stderr is no terminal: no bar
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("MEMEX_")}, "MEMEX_EMBEDDER": "hash",
           "PYTHONPATH": str(ROOT)}
    _, shown = _with_a_terminal(tmp_path, "import", "n.jsonl", "--org", "bars", *data, env=env)
    assert "import bars: 100%|" in shown and "indexing:" in shown  # tqdm's bars
    stdout, shown = _with_a_terminal(tmp_path, "import", "n.jsonl", "--org", "bars", "--json", *data, env=env)
    assert "%|" not in shown and json.loads(stdout)["thoughts"]["existing"] == 20  # --json: no bar
    forced = run(tmp_path, "import", "n.jsonl", "--org", "bars", *data, env={"MEMEX_PROGRESS": "always"})
    assert "import bars: 100%|" in forced.stderr
