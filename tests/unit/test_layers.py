"""The layering of DESIGN.md, read from the source's own imports (every ``import`` of
``src/dynalm``, those inside functions and under ``TYPE_CHECKING`` too): dependencies point
downward only (serve -> engine -> ir -> core -> kernel; models -> ir/core; store beside
models, known to the server and the CLI only), and no module imports itself back through
others. ``errors``, ``files`` and ``flags`` (the one parser of numbers, sizes and durations)
are shared by all."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import dynalm

SRC = Path(dynalm.__file__).parent

# What each layer may import of DynaLM besides itself, errors, files and the package root.
ALLOWED = {
    "kernel": set(),  # DynaKernel: nothing else of DynaLM
    "core": {"kernel"},  # devices know buffers, kernels and memory: no graph, no runtime
    "ir": {"core", "kernel"},  # binding a graph to a device's kernels is ir/lower's
    "models": {"ir", "core"},  # file formats and families: no runtime
    "store": set(),  # the model store knows no engine, no model, no device
    # a device is its way to the kernels; the server lists, pulls and loads the store's
    # models (the engine never does: test_the_engine_knows_no_server_and_no_store)
    "runtime": {"models", "ir", "core", "store"},
    "app": {"runtime", "store", "models", "ir", "core"},  # cli.py, bench.py, show.py
}


def _module(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    """Module -> the DynaLM modules it imports (a name imported from a package that is a
    module of its own counts as that module)."""
    modules = {_module(p): p for p in SRC.rglob("*.py")}

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, set[str]] = {}
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                names = [base, *(f"{base}.{a.name}" for a in node.names)]
            else:
                continue
            found |= {m for n in names if n.startswith("dynalm") and (m := resolve(n))}
        edges[module] = found - {module}
    return edges


def _layer(module: str) -> str:
    parts = module.split(".")
    if len(parts) < 2 or parts[1] in ("errors", "files", "flags"):
        return "shared"
    return parts[1] if parts[1] in ALLOWED else "app"


IMPORTS = _imports()


def test_no_import_circle() -> None:
    """Tarjan's strongly connected components of the import graph: each a single module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in IMPORTS[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for module in IMPORTS:
        if module not in index:
            visit(module)
    assert not circles, f"import circles: {circles}"


@pytest.mark.parametrize("layer", list(ALLOWED))
def test_a_layer_imports_only_what_lies_below_it(layer: str) -> None:
    wrong = sorted(
        f"{module} imports {target}"
        for module, targets in IMPORTS.items()
        if _layer(module) == layer
        for target in targets
        if _layer(target) not in {layer, "shared", *ALLOWED[layer]}
    )
    assert not wrong, "\n".join(wrong)


def test_the_engine_knows_no_server_and_no_store() -> None:
    wrong = sorted(
        f"{module} imports {target}"
        for module, targets in IMPORTS.items()
        if module.startswith("dynalm.runtime.") and not module.startswith("dynalm.runtime.serve")
        for target in targets
        if target.startswith(("dynalm.runtime.serve", "dynalm.store"))
    )
    assert not wrong, "\n".join(wrong)


def test_the_rules_see_every_layer() -> None:
    """A new top-level package needs a rule (else it would pass as 'app')."""
    packages = {p.name for p in SRC.iterdir() if (p / "__init__.py").is_file()}
    assert packages == set(ALLOWED) - {"app"}


def test_module_names_are_unique() -> None:
    """A name means one thing: no two modules share one (core's bound kernels and kernel's
    programs were both attention, matmul, ...)."""
    seen: dict[str, list[str]] = {}
    for path in SRC.rglob("*.py"):
        if path.name != "__init__.py":
            seen.setdefault(path.stem, []).append(str(path.relative_to(SRC)))
    assert not {name: paths for name, paths in seen.items() if len(paths) > 1}
