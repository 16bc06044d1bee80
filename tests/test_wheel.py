"""The wheel works on its own: built from this tree (offline), installed into a fresh virtual environment
without the repository on sys.path, ``memex serve`` started from a directory outside the repository answers
/health, signs up, captures a thought, indexes it with the default local model and finds it by meaning.

The fresh environment gets its *dependencies* from the development environment: a ``.pth`` line names the
development site-packages. A path added by a ``.pth`` line is not itself processed as a site directory, so
the editable install's finder (which would put this repository back on the import path) is not loaded; the
test checks that ``services`` and the others resolve to the installed wheel.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
import zipfile
from pathlib import Path

import httpx
import pytest

from tests.live import free_port

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("api", "tenancy", "services", "memex_migrations")
WAIT = 90.0


def _run(cmd, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, **kw)
    assert proc.returncode == 0, (cmd, proc.stdout[-3000:], proc.stderr[-3000:])
    return proc


def _clean_env() -> dict[str, str]:
    """The caller's environment without what would point Python or Memex back at this repository."""
    return {k: v for k, v in os.environ.items()
            if not k.startswith(("MEMEX_", "PYTHON", "CLOUDFLARE_")) and k not in ("VIRTUAL_ENV",)}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """Built from a copy of the tree (an in-tree build would leave build/ and egg-info behind)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build")
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    for name in ("api", "tenancy", "services", "migrations"):
        shutil.copytree(ROOT / name, src / name, ignore=ignore)
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
          "--wheel-dir", str(tmp / "dist"), str(src)], env=_clean_env())
    (built,) = (tmp / "dist").glob("memex-*.whl")
    return built


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> Path:
    """A fresh virtual environment with the wheel installed and the development site-packages for deps."""
    env_dir = tmp_path_factory.mktemp("venv") / "env"
    _run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)])
    python = env_dir / "bin" / "python"
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "-q", str(wheel)],
         env=_clean_env())
    site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                     env=_clean_env()).stdout.strip())
    dev = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (site / "memex-test-dependencies.pth").write_text("".join(f"{p}\n" for p in sorted(dev)))
    return env_dir


def test_the_wheel_carries_the_packages_the_migrations_and_the_tokenizer(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {n.split("/")[0] for n in names} == {*PACKAGES, "memex-0.1.0.dist-info"}
    assert {f"memex_migrations/{p.name}" for p in (ROOT / "migrations").glob("*.sql")} <= names
    assert "services/adapters/assets/minilm-tokenizer.json" in names
    # ONNX's schema, through which the embedder rewrites the model's graph for int8 compute, and its license
    assert {"services/adapters/assets/onnx-ml.descriptor.binpb", "services/adapters/assets/ONNX-LICENSE"} <= names
    sources = {p.relative_to(ROOT).as_posix() for d in ("api", "tenancy", "services") for p in (ROOT / d).rglob("*.py")}
    assert sources <= names, sorted(sources - names)


def test_the_installed_packages_are_the_wheels_not_the_repository(venv, tmp_path):
    probe = ("import sys, api, services, tenancy, memex_migrations, services.adapters.onnx_embedder as e; "
             "from services.adapters.onnx_graph import int8_matmul_graph as g; "
             "print('\\n'.join([list(m.__path__)[0] for m in (api, services, tenancy, memex_migrations)] "
             "+ [str(len(e.load_tokenizer_json())), str(g(e.default_model_path().read_bytes())[1])] + sys.path))")
    out = _run([str(venv / "bin" / "python"), "-c", probe], cwd=tmp_path, env=_clean_env()).stdout.splitlines()
    files, size, converted, path = out[:4], int(out[4]), int(out[5]), out[6:]
    assert all(f.startswith(str(venv)) for f in files), files
    assert size > 100_000  # the tokenizer, read from the installed package data
    assert converted == 36  # the graph rewrite works from the installed schema (no `onnx` package)
    assert not any(p and Path(p).resolve() == ROOT for p in path), path


def test_memex_serve_from_the_wheel_captures_indexes_and_finds(venv, tmp_path):
    run_dir, data = tmp_path / "run", tmp_path / "data"
    run_dir.mkdir()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen(
        [str(venv / "bin" / "memex"), "serve", "--host", "127.0.0.1", "--port", str(port), "--data-dir", str(data)],
        cwd=run_dir, env=_clean_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    try:
        with httpx.Client(base_url=base, timeout=30) as c:
            _until(lambda: _ok(c, "/health"), proc, tmp_path, "/health never answered")
            r = c.post("/v1/signup", json={"name": "Wheel Inc", "slug": "wheel-inc"})
            assert r.status_code == 201, r.text
            headers = {"authorization": f"Bearer {r.json()['api_key']['key']}"}
            r = c.post("/v1/thoughts", json={"content": "The zebrafish aquarium heater failed on Tuesday."}, headers=headers)
            assert r.status_code == 201, r.text
            tid = r.json()["id"]
            _until(lambda: c.get(f"/v1/thoughts/{tid}", headers=headers).json()["indexing"]["state"] == "indexed",
                   proc, tmp_path, "the thought was never indexed")
            r = c.post("/v1/search", json={"query": "the fish tank warmer broke", "explain": True}, headers=headers)
            assert r.status_code == 200, r.text
            assert [h["document_id"] for h in r.json()["results"]] == [tid], r.text
        assert (data / "control.sqlite3").exists() and not (run_dir / "data").exists()
        assert len(list((data / "orgs").glob("*/memex.sqlite3"))) == 1  # the organization's own database
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
        log.close()


def _ok(c: httpx.Client, path: str) -> bool:
    try:
        return c.get(path).status_code == 200
    except httpx.TransportError:
        return False


def _until(condition, proc: subprocess.Popen, tmp: Path, what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not condition():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"{what}; memex serve said:\n{(tmp / 'serve.log').read_text()[-5000:]}")
        time.sleep(0.1)
