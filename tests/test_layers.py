"""The library's imports run one way: no module of `course_lib` imports (at the top, inside a function, or only
under `TYPE_CHECKING`) a module that imports it, directly or through others. The import graph is read with `ast`
from every `course_lib/*.py`: `import course_lib.x`, `import course_lib.x as y`, `from course_lib import x`,
`from course_lib.x import y`, `from . import x`, `from .x import y`."""
import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "course_lib"


def imported_modules(source: str, modules: set[str], package: str = "course_lib") -> set[str]:
    "The modules of `package` (names in `modules`, `__init__` for the package itself) that `source` imports anywhere."
    out = set()
    for n in ast.walk(ast.parse(source)):
        if isinstance(n, ast.Import):
            names = [a.name for a in n.names]
        elif isinstance(n, ast.ImportFrom):
            base = package + (f".{n.module}" if n.module else "") if n.level else (n.module or "")
            names = [f"{base}.{a.name}" for a in n.names] if base == package else [base]
        else:
            continue
        for parts in (name.split(".") for name in names):
            if parts[0] == package:           # `course_lib`, or a name of its __init__: the package itself
                out.add(parts[1] if len(parts) > 1 and parts[1] in modules else "__init__")
    return out


def import_graph(pkg: Path = PKG) -> dict[str, set[str]]:
    "`{module: modules of the package it imports}` for every `*.py` in the folder `pkg` (`__init__` included)."
    files = {p.stem: p for p in sorted(pkg.glob("*.py"))}
    graph = {m: imported_modules(p.read_text(), set(files) - {"__init__"}, pkg.name) - {m}
             for m, p in files.items()}
    if graph.get("__init__"):
        for m in graph:                      # every submodule import runs the package's __init__ first
            if m != "__init__":
                graph[m].add("__init__")
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (`[a, b, ..., a]`) through each group of modules that import each other (each strongly
    connected component of more than one module, Tarjan's algorithm), shortest first."""
    index, low, stack, on, comps = {}, {}, [], set(), []
    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(comp)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted((shortest_cycle(graph, c) for c in comps), key=len)


def shortest_cycle(graph: dict[str, set[str]], comp: set[str]) -> list[str]:
    "The shortest cycle through the first module of `comp` (breadth first, inside `comp`)."
    start = min(comp)
    paths, seen = [[start]], {start}
    while paths:
        nxt = []
        for path in paths:
            for w in sorted(graph[path[-1]] & comp):
                if w == start:
                    return path + [start]
                if w not in seen:
                    seen.add(w)
                    nxt.append(path + [w])
        paths = nxt
    raise AssertionError(f"{sorted(comp)} is not strongly connected")


def test_course_lib_imports_run_one_way():
    graph = import_graph()
    assert len(graph) > 20 and graph["cli"] >= {"units", "run_records"}, graph.get("cli")   # the parser sees imports
    found = cycles(graph)
    for c in found:
        print("import cycle: " + " -> ".join(c))
    assert not found, ("modules of course_lib import each other (a lower layer must not import a higher one, "
                       "not even inside a function or under TYPE_CHECKING): "
                       + "; ".join(" -> ".join(c) for c in found))


def test_a_made_up_cycle_is_found(tmp_path):
    "Every form of import makes an edge; a cycle through a lazy and a TYPE_CHECKING import is caught."
    pkg = tmp_path / "course_lib"
    pkg.mkdir()
    (pkg / "__init__.py").write_text('__version__ = "0"\n')
    (pkg / "low.py").write_text("import os\nfrom .core import x\n"
                                "def f():\n    from course_lib.high import g     # lazily\n")
    (pkg / "core.py").write_text("import json\n")
    (pkg / "mid.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import course_lib.low\n")
    (pkg / "high.py").write_text("from course_lib import mid\nimport course_lib.core as c\n")
    (pkg / "side.py").write_text("from . import core\nfrom course_lib.core import json\nimport course_lib\n")
    graph = import_graph(pkg)
    assert graph == {"__init__": set(), "core": set(), "low": {"core", "high"}, "mid": {"low"},
                     "high": {"mid", "core"}, "side": {"core", "__init__"}}, graph
    assert cycles(graph) == [["high", "mid", "low", "high"]]
    (pkg / "mid.py").write_text("import json\n")           # the TYPE_CHECKING import gone: no cycle
    assert cycles(import_graph(pkg)) == []
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"e"}, "e": {"c"}}) == [["a", "b", "a"],
                                                                                     ["c", "d", "e", "c"]]
