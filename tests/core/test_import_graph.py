"""The package's import structure: no import cycle among scalify's modules, no module
importing another's private names, and every module imports on its own in a fresh
interpreter."""
from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "scalify"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The scalify modules `name` imports, at module level or inside functions.

    `import a.b.c` and `from a.b import c` import `a.b.c` when it is a module (else `a.b`);
    `from scalify import x` imports `scalify` (its __init__) unless `x` is a submodule."""
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import
                pkg = name.split(".") if is_pkg else name.split(".")[:-1]
                pkg = pkg[: len(pkg) - (node.level - 1)]
                base = ".".join(pkg + ([base] if base else []))
            targets = []
            for a in node.names:
                sub = f"{base}.{a.name}"
                targets.append(sub if sub in modules else base)
        else:
            continue
        for t in targets:
            while t and t not in modules:  # `import scalify.x.attr` -> the module part
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as [a, b, ..., a], or None (iterative depth-first search)."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    for root in sorted(graph):
        if root in state:
            continue
        stack = [(root, iter(sorted(graph[root])))]
        path = [root]
        state[root] = 1
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                state[node] = 2
                stack.pop()
                path.pop()
            elif state.get(child) == 1:
                return path[path.index(child):] + [child]
            elif child not in state:
                state[child] = 1
                path.append(child)
                stack.append((child, iter(sorted(graph[child]))))
    return None


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_graph_sees_function_level_and_package_imports():
    graph = import_graph()
    assert "scalify.core.registry" in graph["scalify.rules.elementwise"]
    assert "scalify.rules" in graph["scalify"]  # the package registers the rules
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle():
    cycle = _find_cycle(import_graph())
    assert cycle is None, "import cycle among scalify's modules: " + " -> ".join(cycle)


def test_rule_modules_do_not_import_the_package_or_the_interpreter():
    """Rules register into scalify.core.registry; only the rules that interpret a sub-jaxpr
    (call-like primitives) or run scalify eagerly import the interpreter."""
    interpreting = {"scalify.rules.control_flow", "scalify.rules.collectives",
                    "scalify.ops.custom_scale", "scalify.ops._common"}
    graph = import_graph()
    for name, deps in graph.items():
        if name != "scalify":
            assert "scalify" not in deps, f"{name} imports the scalify package"
        if name.startswith(("scalify.rules.", "scalify.ops.", "scalify.nn.", "scalify.optim.",
                            "scalify.quant.")) and name not in interpreting:
            assert "scalify.interpreter" not in deps, f"{name} imports the interpreter"
    assert not {d for d in graph["scalify.interpreter"] if d.startswith(("scalify.rules", "scalify.ops"))}


# Nodes of the picture in docs/architecture.md: module prefix -> node.
_DOC_NODES = {"scalify.recipes": "recipes", "scalify.nn": "nn", "scalify.optim": "optim", "scalify.distributed": "dist",
              "scalify.inspect": "inspect", "scalify.ops": "ops", "scalify.rules": "rules",
              "scalify.interpreter": "interp", "scalify.outer_ad": "outer",
              "scalify.quant": "quant", "scalify.core": "core", "scalify.frameworks": "frameworks"}


def _doc_node(module: str) -> str:
    for prefix, node in _DOC_NODES.items():
        if module == prefix or module.startswith(prefix + "."):
            return node
    assert module == "scalify", f"{module} has no node in docs/architecture.md's picture"
    return "init"


def test_architecture_picture_matches_the_imports():
    text = (ROOT / "docs" / "architecture.md").read_text()
    picture = re.search(r"```mermaid\n(.*?)```", text, re.S).group(1)
    drawn = {(a, b.strip()) for a, bs in re.findall(r"^\s*(\w+) --> (.*)$", picture, re.M)
             for b in bs.split("&")}
    actual = {(_doc_node(m), _doc_node(d)) for m, deps in import_graph().items() for d in deps}
    actual = {(a, b) for a, b in actual if a != b}
    assert drawn == actual, (f"docs/architecture.md draws {sorted(drawn - actual)} that are not "
                             f"imports and misses {sorted(actual - drawn)}: update the picture")


# Importing `scalify.x.y` runs scalify/__init__.py first, which imports most modules: for
# those, importing them alone is importing `scalify` alone. Every other module is imported
# after a fresh `import scalify` alone (sys.modules cleared of scalify's modules).
_IMPORT_EACH = """
import importlib, sys

def fresh(name):
    for m in [m for m in sys.modules if m == "scalify" or m.startswith("scalify.")]:
        del sys.modules[m]
    importlib.import_module(name)

failed = []
try:
    fresh("scalify")
except Exception as e:
    failed.append(f"scalify: {type(e).__name__}: {e}")
loaded = set(sys.modules)
for name in sys.argv[1:]:
    if name in loaded:
        continue
    try:
        fresh(name)
    except Exception as e:
        failed.append(f"{name}: {type(e).__name__}: {e}")
print("\\n".join(failed))
sys.exit(1 if failed else 0)
"""


def test_each_module_imports_alone():
    names = sorted(_modules())
    proc = subprocess.run([sys.executable, "-c", _IMPORT_EACH, *names], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_no_module_imports_the_private_names_of_another():
    """A helper two modules share is public in one of them (a rule author may use it too):
    no `from scalify.x import _name` anywhere in the package."""
    private = []
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("scalify"):
                private += [f"{name}: from {node.module} import {a.name}" for a in node.names
                            if a.name.startswith("_")]
    assert not private, "\n".join(private)
