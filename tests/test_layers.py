"""The packages' imports follow docs/DESIGN.md's layering: each imports only the layers below it.

Read from the source with ast, every import counts: module level, inside functions and under
``if TYPE_CHECKING``. Two checks: no import points up a layer or sideways into another package of
the same layer, and the module-level imports form no loop. Also: no function of these packages is
longer than 60 lines.
"""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, Iterator, List, Set, Tuple

REPO = Path(__file__).resolve().parents[1]

# Lower number = lower layer. A package may import its own modules and any lower layer.
LAYERS: Dict[str, int] = {
    "core": 0,
    "models": 1, "data": 1,
    "scape": 2, "sdp": 2, "evaluation": 2,
    "trainer": 3,
}


def _modules() -> Dict[str, Path]:
    found = {}
    for package in LAYERS:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def _imports(module: str, path: Path, known: Set[str]) -> Iterator[Tuple[str, int, bool]]:
    """(imported module, line, at module level) for every import of a project module."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    top_level = {id(node) for node in tree.body}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            # `from pkg import sub` imports the submodule pkg.sub where there is one
            names = [f"{prefix}.{a.name}" if f"{prefix}.{a.name}" in known else prefix for a in node.names]
        else:
            continue
        for name in names:
            if name.split(".")[0] in LAYERS:
                yield name, node.lineno, id(node) in top_level


def _resolve(name: str, known: Set[str]) -> str:
    while name not in known and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def test_no_import_points_up_or_sideways():
    modules = _modules()
    known = set(modules)
    wrong: List[str] = []
    for module, path in modules.items():
        here = module.split(".")[0]
        for name, line, _ in _imports(module, path, known):
            there = name.split(".")[0]
            if there != here and LAYERS[there] >= LAYERS[here]:
                direction = "up" if LAYERS[there] > LAYERS[here] else "sideways"
                wrong.append(f"{path.relative_to(REPO)}:{line} imports {name} ({direction}: "
                             f"{here} is layer {LAYERS[here]}, {there} layer {LAYERS[there]})")
    assert not wrong, "\n".join(wrong)


def test_module_level_imports_form_no_loop():
    modules = _modules()
    known = set(modules)
    graph = {m: sorted({_resolve(n, known) for n, _, top in _imports(m, p, known) if top} - {m})
             for m, p in modules.items()}
    state: Dict[str, int] = {}
    stack: List[str] = []
    loops: List[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in graph.get(node, []):
            if state.get(nxt) == 1:
                loops.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert not loops, "\n".join(loops)


def test_the_checker_sees_imports_inside_functions(tmp_path):
    path = tmp_path / "mod.py"
    path.write_text("import core.sync\n\ndef f():\n    from trainer.parts import build_synchronizer\n")
    found = list(_imports("scape.mod", path, {"core.sync", "trainer.parts"}))
    assert ("core.sync", 1, True) in found and ("trainer.parts", 4, False) in found


def test_no_product_function_is_longer_than_60_lines():
    long = []
    for path in sorted(p for package in LAYERS for p in (REPO / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > 60:
                    long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} has {length} lines")
    assert not long, "\n".join(long)
