"""The layering, read from the code (ast): the import graph of api/, tenancy/ and services/ has no cycle and every
arrow points down.

Every import counts: at module level, inside functions (a cycle hidden in a function-level import is still a
cycle) and under ``if TYPE_CHECKING:`` (a type is a dependency too; a Protocol breaks such a loop).

    api  ->  tenancy  ->  services
    api.composition   the composition root: the only importer of services.adapters (and of the settings'
                      choices of adapter); it imports api.settings, itself and services
    services:
      kernel          services.errors, ids, models, ports, background: imports nothing else of ours
      storage         services.storage: the kernel
      text            services.text: the kernel
      jobs            services.jobs: storage and the kernel
      domains         search < enrichment < thoughts < conversations < knowledge < bundle: the kernel, storage, text, jobs
                      and the domains before them (never one after them: bundle may import thoughts, thoughts
                      never the bundle)
      adapters        services.adapters: the kernel and their own package (a module of
                      services/adapters/cloudflare/ only that package; a module directly in services/adapters/
                      only its siblings there)
    tenancy           the kernel and storage (ports, handles bound to an organization, the OrgStores protocol)

A module that fits no layer (a new package under services/) fails until it is given one here.
"""

from __future__ import annotations

import ast
from itertools import pairwise
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOPS = ("api", "tenancy", "services")

KERNEL = {"services", "services.errors", "services.ids", "services.models", "services.ports", "services.background"}
DOMAINS = ("search", "enrichment", "thoughts", "conversations", "knowledge", "bundle")
COMPOSITION = "api.composition"


# -- the graph ----------------------------------------------------------------------------------------------


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    found = {}
    for top in TOPS:
        for path in sorted((ROOT / top).rglob("*.py")):
            if "__pycache__" not in path.parts:
                found[_module_name(path)] = path
    return found


MODULES = _modules()


def _ours(name: str) -> str | None:
    """The module of ours that an import of ``name`` loads (the longest known prefix), or None."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def _imports(module: str) -> dict[str, int]:
    """Modules of ours that ``module`` imports -> the line of the first such import."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            # ``from package import module`` imports the module; ``from module import name``, the module
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        for name in names:
            target = _ours(name)
            if target is not None and target != module:
                found.setdefault(target, node.lineno)
    return found


GRAPH = {module: _imports(module) for module in MODULES}


def _cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One cycle (as a path that returns to its start) per strongly connected component of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def connect(v: str) -> None:  # Tarjan
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            connect(v)

    cycles = []
    for component in components:
        start = min(component)
        paths = {start: [start]}
        todo = [start]
        while todo:  # breadth first inside the component, back to the start
            v = todo.pop(0)
            for w in sorted(graph[v]):
                if w == start:
                    cycles.append(paths[v] + [start])
                    todo = []
                    break
                if w in component and w not in paths:
                    paths[w] = paths[v] + [w]
                    todo.append(w)
    return cycles


# -- the layers -----------------------------------------------------------------------------------------------


def _layer(module: str) -> str | None:
    if module == COMPOSITION or module.startswith(COMPOSITION + "."):
        return "composition"
    top = module.split(".")[0]
    if top in ("api", "tenancy"):
        return top
    if module in KERNEL:
        return "kernel"
    second = module.split(".")[1]
    if second == "adapters":
        return "adapters"
    if second in ("storage", "text", "jobs") or second in DOMAINS:
        return second
    return None


def _adapter_package(module: str) -> str:
    """The package an adapter module belongs to: services.adapters.cloudflare, or services.adapters itself."""
    return module if module in MODULES and MODULES[module].name == "__init__.py" else module.rpartition(".")[0]


def _refusal(source: str, target: str) -> str | None:
    """Why ``source`` may not import ``target`` (None: it may)."""
    src, dst = _layer(source), _layer(target)
    if src is None:
        return f"{source} is in no layer: place its package in tests/test_architecture.py"
    if dst is None:
        return f"{target} is in no layer: place its package in tests/test_architecture.py"
    if dst == "adapters" and src not in ("composition", "adapters"):
        return "only the composition root (api.composition) imports adapters"
    if src == "composition":
        if dst in ("api", "tenancy") and target != "api.settings":
            return "the composition root imports api.settings, itself and services only"
        return None
    if src == "api":
        return None
    if src == "tenancy":
        return None if dst in ("tenancy", "kernel", "storage") else "tenancy imports itself, the kernel and storage only"
    # services
    if dst in ("api", "composition", "tenancy"):
        return "services never import api or tenancy"
    if src == "kernel":
        return None if dst == "kernel" else "the kernel (errors, ids, models, ports) imports nothing else of ours"
    if src == "adapters":
        if dst == "kernel":
            return None
        own = _adapter_package(source)
        if _adapter_package(target) == own or target == own:
            return None
        return f"an adapter imports the kernel and its own package ({own}) only"
    if src in ("storage", "text"):
        return None if dst in (src, "kernel") else f"{src} imports itself and the kernel only"
    if src == "jobs":
        return None if dst in ("jobs", "storage", "kernel") else "jobs imports itself, storage and the kernel only"
    # a domain package
    if dst in ("kernel", "storage", "text", "jobs", src):
        return None
    if dst in DOMAINS and DOMAINS.index(dst) < DOMAINS.index(src):
        return None
    return f"the domain {src} may use only the domains before it ({', '.join(DOMAINS[:DOMAINS.index(src)]) or 'none'})"


# -- the tests --------------------------------------------------------------------------------------------------


def test_the_graph_is_read():
    assert "api.cli_common" in GRAPH["api.cli"] and "services.ports" in GRAPH["services.storage.scoped"]
    # function-level imports count: api.cli builds its parser with the area commands imported inside a function
    assert "api.org_lifecycle_cli" in GRAPH["api.cli"]


def test_no_module_imports_itself_back():
    cycles = _cycles(GRAPH)
    assert not cycles, "import cycles (each listed as a path back to its start, with the import's line):\n" + "\n".join(
        "  " + " -> ".join(f"{a} (line {GRAPH[a][b]})" for a, b in pairwise(cycle)) + f" -> {cycle[-1]}"
        for cycle in cycles
    )


def test_every_arrow_points_down():
    wrong = [
        f"  {source} (line {line}) imports {target}: {why}"
        for source in sorted(GRAPH)
        for target, line in sorted(GRAPH[source].items())
        if (why := _refusal(source, target)) is not None
    ]
    assert not wrong, "imports against the layering:\n" + "\n".join(wrong)


def test_the_rules_refuse_what_they_should():
    """The rules themselves, on imports that must never appear."""
    assert _refusal("services.thoughts.thoughts", "services.adapters.sqlite")
    assert _refusal("api.routes", "services.adapters.sqlite")
    assert _refusal("services.storage.stores", "services.thoughts.thoughts")
    assert _refusal("services.models", "services.storage.scoped")
    assert _refusal("services.search.search", "services.thoughts.thoughts")
    assert _refusal("services.thoughts.thoughts", "services.bundle.importer")
    assert _refusal("services.jobs.worker", "services.search.indexing")
    assert _refusal("services.adapters.llm", "services.adapters.cloudflare.workers_ai")
    assert _refusal("services.adapters.cloudflare.workers_ai", "services.adapters.onnx_embedder")
    assert _refusal("services.adapters.sqlite", "services.storage.scoped")
    assert _refusal("tenancy.keys", "api.settings")
    assert _refusal("tenancy.keys", "services.thoughts.thoughts")
    assert _refusal("services.ports", "api.settings")
    assert _refusal("api.composition.backend", "api.wiring")
    assert _refusal("services.nowhere.x", "services.ports")  # a package placed in no layer
    assert _refusal("services.thoughts.thoughts", "services.search.indexing") is None
    assert _refusal("api.composition.backend", "services.adapters.sqlite") is None
