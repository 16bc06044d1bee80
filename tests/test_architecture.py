"""Dependencies point one way: api -> tenancy, services; tenancy -> services' ports, models, errors;
services never import api or tenancy, and never adapters (only the wiring chooses adapters)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def _files(package: str):
    return sorted((ROOT / package).rglob("*.py"))


def test_services_do_not_import_api_tenancy_or_adapters():
    for f in _files("services"):
        rel = f.relative_to(ROOT).as_posix()
        for mod in _imports(f):
            assert not mod.startswith(("api", "tenancy")), f"{rel} imports {mod}"
            if not rel.startswith("services/adapters/"):
                assert not mod.startswith("services.adapters"), f"{rel} imports an adapter ({mod})"


def test_tenancy_uses_only_ports_models_errors_and_scoped_handles():
    # services.storage.stores: the OrgStores protocol (sign-up provisions the organization's database)
    allowed = ("services.ports", "services.errors", "services.storage.scoped", "services.ids", "services.models",
               "services.storage.stores")
    for f in _files("tenancy"):
        for mod in _imports(f):
            assert not mod.startswith("api"), f"{f.name} imports {mod}"
            if mod.startswith("services"):
                assert mod.startswith(allowed), f"{f.name} imports {mod}"


def test_only_the_composition_root_picks_adapters():
    for f in _files("api"):
        mods = _imports(f)
        if f.parent.name != "composition":
            assert not any(m.startswith("services.adapters") for m in mods), f"api/{f.name} imports an adapter"
