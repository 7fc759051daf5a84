"""The package's shape: small files, no import circles (type-only imports included), and the
training loop knows nothing of Ray (the cluster wraps the loop's objects)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).parent.parent / "compactrl"
MAX_LINES = 500


def _sources() -> dict[str, str]:
    """Module name -> its source, for every module of the package."""
    out = {}
    for p in PACKAGE.rglob("*.py"):
        name = ".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = p.read_text()
    return out


def _imports(sources: dict[str, str]) -> dict[str, set[str]]:
    """Module -> the compactrl modules it imports, anywhere in it (functions and TYPE_CHECKING too)."""

    def resolve(name: str) -> str | None:
        while name and name not in sources:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for m, text in sources.items():
        found = set()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("compactrl"):
                found |= {resolve(f"{node.module}.{a.name}") for a in node.names}
            elif isinstance(node, ast.Import):
                found |= {resolve(a.name) for a in node.names if a.name.startswith("compactrl")}
        graph[m] = found - {None, m}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while not comp or comp[-1] != v:
                comp.append(stack.pop())
                on.discard(comp[-1])
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_module_is_over_500_lines():
    lines = {str(p.relative_to(PACKAGE)): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    assert not {p: n for p, n in lines.items() if n > MAX_LINES}, "split these modules"


def test_no_import_circle_and_the_loop_imports_nothing_of_the_cluster():
    graph = _imports(_sources())
    assert not _cycles(graph)
    rl = {m: ts for m, ts in graph.items() if m.startswith("compactrl.rl")}
    assert not [(m, t) for m, ts in rl.items() for t in ts if t.startswith("compactrl.cluster")]


def test_the_checks_find_a_circle_closed_by_a_type_only_import():
    """Negative control: two made-up modules, one importing the other only for type checking."""
    sources = {
        "compactrl.a": "from compactrl.b import B\n",
        "compactrl.b": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from compactrl.a import A\n",
        "compactrl.c": "def f():\n    import compactrl.a\n",
    }
    graph = _imports(sources)
    a, b = "compactrl.a", "compactrl.b"
    assert graph == {a: {b}, b: {a}, "compactrl.c": {a}}
    assert _cycles(graph) == [["compactrl.a", "compactrl.b"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
