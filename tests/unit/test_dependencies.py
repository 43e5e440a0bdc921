"""Every module that ``src/`` imports is a declared runtime dependency.

The test venv has the test extras too, so a runtime import that only a test extra (or
some other package's dependencies) provides works here and breaks `make demo` on a
fresh machine. Imports guarded by ``except ImportError`` are optional by design.
"""

from __future__ import annotations

import ast
import re
import sys
from importlib.metadata import packages_distributions
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: pip vendors the same parser
    from pip._vendor import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]


def _declared() -> set[str]:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return {re.split(r"[ \[<>=!~;]", d, maxsplit=1)[0].lower().replace("_", "-") for d in deps}


def _guarded(parents: list[ast.AST]) -> bool:
    return any(
        isinstance(p, ast.Try)
        and any(h.type is not None and "ImportError" in ast.unparse(h.type) for h in p.handlers)
        for p in parents
    )


def _required_imports() -> dict[str, str]:
    """Top-level module -> where it is first imported, for unguarded third-party imports."""
    found: dict[str, str] = {}
    for path in sorted((ROOT / "src").rglob("*.py")):
        stack: list[tuple[ast.AST, list[ast.AST]]] = [(ast.parse(path.read_text()), [])]
        while stack:
            node, parents = stack.pop()
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for name in names:
                top = name.split(".")[0]
                if top in sys.stdlib_module_names or top in ("dynalm", "__future__"):
                    continue
                if not _guarded(parents):
                    found.setdefault(top, f"{path.relative_to(ROOT)}:{node.lineno}")
            stack.extend((child, [*parents, node]) for child in ast.iter_child_nodes(node))
    return found


def test_every_import_of_src_is_a_declared_dependency():
    declared, provides = _declared(), packages_distributions()
    missing = []
    for module, where in _required_imports().items():
        dists = {d.lower().replace("_", "-") for d in provides.get(module, [module])}
        if not dists & declared:
            missing.append(f"{module} ({where}; provided by {', '.join(sorted(dists))})")
    assert not missing, "imported by src/ but not in [project] dependencies: " + "; ".join(missing)
