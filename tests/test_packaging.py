"""pyproject's explicit package list keeps up with the tree: a package folder missing from it would be left
out of the wheel (and found only when running from a checkout)."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOP = ("api", "tenancy", "services")


def _setuptools() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]


def _package_folders() -> set[str]:
    """Every folder under api/, tenancy/, services/ (themselves included) that holds Python modules."""
    found = set()
    for top in TOP:
        for py in (ROOT / top).rglob("*.py"):
            rel = py.parent.relative_to(ROOT)
            if "__pycache__" not in rel.parts:
                found.add(".".join(rel.parts))
    return found


def test_every_package_folder_is_listed():
    listed = set(_setuptools()["packages"])
    missing = sorted(_package_folders() - listed)
    assert not missing, f"add to [tool.setuptools] packages in pyproject.toml: {missing}"


def test_every_listed_package_exists():
    cfg = _setuptools()
    dirs = cfg.get("package-dir", {})
    for name in cfg["packages"]:
        folder = ROOT / dirs.get(name, name.replace(".", "/"))
        assert folder.is_dir(), f"pyproject lists {name}, but {folder} does not exist"


def test_package_data_patterns_match_files():
    cfg = _setuptools()
    dirs = cfg.get("package-dir", {})
    for name, patterns in cfg.get("package-data", {}).items():
        folder = ROOT / dirs.get(name, name.replace(".", "/"))
        for pattern in patterns:
            assert list(folder.glob(pattern)), f"package-data {name}: {pattern} matches nothing in {folder}"
