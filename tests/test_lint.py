"""CI runs only pytest (.ci/run): this is where ruff and mypy --strict (on the core) are enforced.

Both read their configuration from pyproject.toml ([tool.ruff], [tool.mypy]); mypy keeps its
incremental cache in .mypy_cache, so a second run takes about a second.
"""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_ruff_is_clean():
    result = _run("ruff", "check", "--no-cache", ".")
    assert result.returncode == 0, f"ruff check . failed:\n{result.stdout}{result.stderr}"


def test_mypy_strict_core_is_clean():
    result = _run("mypy")
    assert result.returncode == 0, f"mypy failed:\n{result.stdout}{result.stderr}"
