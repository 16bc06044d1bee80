"""The data-plane Worker's own checks, run by the suite (CI runs only pytest): its vitest unit tests (worker/test/:
HMAC, SQL in a Durable Object, migrations, per-organization bm25, vector and AI ops), the TypeScript type check, and
`wrangler deploy --dry-run`, which must accept the repository's wrangler.toml (bindings, Durable Object migration,
the build step that bundles migrations/org). Skipped, with the reason, without Node or worker/node_modules
(`npm ci --prefix worker`, which .ci/run does)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "worker"
if shutil.which("node") is None or shutil.which("npm") is None:
    pytest.skip("the Worker tests need Node.js and npm on PATH", allow_module_level=True)
if not (WORKER / "node_modules" / ".bin" / "wrangler").exists():
    pytest.skip("the Worker's npm packages are not installed: run `npm ci --prefix worker`", allow_module_level=True)


def _run(*args: str, cwd: Path = WORKER, timeout: int = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), cwd=cwd, capture_output=True, text=True, timeout=timeout)


def test_the_worker_unit_tests_pass():
    result = _run("npm", "test", "--silent")
    assert result.returncode == 0, f"vitest failed:\n{result.stdout[-6000:]}\n{result.stderr[-3000:]}"
    assert " passed" in result.stdout + result.stderr


def test_the_worker_type_checks():
    result = _run("npm", "run", "--silent", "typecheck")
    assert result.returncode == 0, f"tsc failed:\n{result.stdout[-4000:]}\n{result.stderr[-2000:]}"


def test_wrangler_accepts_the_repository_config(tmp_path):
    result = _run(str(WORKER / "node_modules" / ".bin" / "wrangler"), "deploy", "--dry-run", "-c", "wrangler.toml",
                  "--outdir", str(tmp_path), cwd=ROOT)
    out = result.stdout + result.stderr
    assert result.returncode == 0, f"wrangler deploy --dry-run failed:\n{out[-4000:]}"
    for binding in ("ORG", "CONTROL", "VECTORIZE", "AI"):
        assert binding in out, (binding, out[-3000:])
    assert any(p.suffix == ".js" for p in tmp_path.iterdir()), "no bundle written"
