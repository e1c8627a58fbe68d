"""The package's import structure: the core (`mmrl`) imports no family, and no modules import each
other in a circle. Every import counts, including those inside functions and under TYPE_CHECKING: a
lazy import hides a circle from Python, not from the next reader."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CORE = "mmrl"
FAMILIES = ("diffusion_rl", "vlm_rl", "vla_rl", "sim")


def modules() -> dict[str, Path]:
    found = {}
    for package in (CORE, *FAMILIES):
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package modules `name` imports: a `from package import x` names the submodule x where there
    is one, else the package."""

    def owner(dotted: str) -> str | None:
        while dotted and dotted not in known:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets |= {owner(alias.name) for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            targets |= {owner(f"{base}.{alias.name}") for alias in node.names}
    return {t for t in targets if t is not None and t != name}


def import_graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports_of(name, path, known) for name, path in known.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
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
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_core_imports_no_family():
    graph = import_graph()
    wrong = {
        f"{module} imports {', '.join(sorted(t for t in targets if t.split('.')[0] in FAMILIES))}"
        for module, targets in graph.items()
        if module.split(".")[0] == CORE and any(t.split(".")[0] in FAMILIES for t in targets)
    }
    assert not wrong, "the core must not import a family (register through mmrl.registry):\n" + "\n".join(
        sorted(wrong)
    )


def test_no_modules_import_each_other_in_a_circle():
    found = circles(import_graph())
    assert not found, "import circles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_the_checks_see_lazy_imports_and_circles(tmp_path):
    """The walker finds an import inside a function and under TYPE_CHECKING, and a circle of three."""
    (tmp_path / "a.py").write_text("def f():\n    from b import x\n")
    (tmp_path / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import c\n")
    (tmp_path / "c.py").write_text("import a\n")
    known = {m: tmp_path / f"{m}.py" for m in "abc"}
    graph = {m: imports_of(m, p, known) for m, p in known.items()}
    assert graph == {"a": {"b"}, "b": {"c"}, "c": {"a"}}
    assert circles(graph) == [["a", "b", "c"]]
