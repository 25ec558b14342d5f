"""The library's imports run one way. `course_lib` is one subpackage a unit with the course's machinery beside
them, layered bottom to top as `LAYERS` lists them: `core` and `data` at the bottom, the units in course order
(unit 3 evaluates unit 1's model, unit 4 adapts it, unit 7's studio parts reuse unit 4's files), then the
exercises, the course's own machinery (units, run records, the site), the studio and the command line on top.

The import graph is read with `ast` from every module of `course_lib` (a subpackage's `__init__` is the node
`pkg`, its modules `pkg.mod`), counting every form of import wherever it sits (at the top, inside a function,
under `TYPE_CHECKING`): `import course_lib.x.y`, `from course_lib.x import y`, `from course_lib import x`,
`from . import y`, `from ..x.y import z`. The tests fail on a cycle, on an import from a lower subpackage into
a higher one, and on a module that imports its own subpackage's `__init__` (which imports that module)."""
import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "course_lib"
LAYERS = ["core", "data", "ddpm", "score", "metrics", "lora", "vision", "pile", "flux", "exercises", "course",
          "studio", "cli"]


def module_names(pkg: Path = PKG) -> dict[str, Path]:
    "`{dotted name: file}` for every module under `pkg`, a subpackage's `__init__.py` named by the subpackage."
    out = {}
    for p in sorted(pkg.rglob("*.py")):
        parts = p.relative_to(pkg).with_suffix("").parts
        if parts[-1] == "__init__": parts = parts[:-1]
        if not parts or parts[-1] != "_modidx": out[".".join(parts) or "__init__"] = p
    return out


def _resolve(name: str, modules: set[str]) -> str | None:
    "The longest prefix of the dotted `name` (inside the package) that is a module, `None` for the package."
    parts = name.split(".") if name else []
    while parts:
        if ".".join(parts) in modules: return ".".join(parts)
        parts.pop()
    return None


def imported_modules(source: str, me: str, modules: set[str], is_package: bool = False,
                     package: str = "course_lib") -> set[str]:
    "The modules of `package` that the module `me` (source `source`) imports anywhere in its code."
    here = me.split(".") if is_package else me.split(".")[:-1]       # the package `me` sits in
    out = set()
    for n in ast.walk(ast.parse(source)):
        if isinstance(n, ast.Import):
            names = [a.name.split(".", 1)[1] for a in n.names if a.name.startswith(package + ".")]
        elif isinstance(n, ast.ImportFrom):
            if n.level:
                base = ".".join(here[:len(here) - (n.level - 1)] + ([n.module] if n.module else []))
            elif n.module == package or (n.module or "").startswith(package + "."):
                base = n.module.split(".", 1)[1] if "." in n.module else ""
            else:
                continue
            names = [".".join(filter(None, [base, a.name])) for a in n.names]
            names = [x if _resolve(x, modules) == x else base for x in names]
        else:
            continue
        for x in names:
            m = _resolve(x, modules)
            if m and m != me: out.add(m)
    return out


def import_graph(pkg: Path = PKG) -> dict[str, set[str]]:
    "`{module: modules of the package it imports}` for every module under `pkg`."
    mods = module_names(pkg)
    return {m: imported_modules(p.read_text(), m, set(mods), p.name == "__init__.py", pkg.name)
            for m, p in mods.items()}


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


def layer_problems(graph: dict[str, set[str]], layers: list[str] = LAYERS) -> list[str]:
    """Each import that runs downwards: from a subpackage into one above it in `layers`, or from a module into
    its own subpackage's `__init__`. A module outside every subpackage (other than `__init__`) is one too."""
    found = []
    for m, deps in sorted(graph.items()):
        top = m.split(".")[0]
        if m == "__init__": continue
        if top not in layers:
            found.append(f"{m} sits in no subpackage of the layers {layers}"); continue
        for d in sorted(deps):
            dtop = d.split(".")[0]
            if d == top and m != top:
                found.append(f"{m} imports its own subpackage's __init__ ({d}), which imports it")
            elif dtop in layers and layers.index(dtop) > layers.index(top):
                found.append(f"{m} ({top}) imports {d} ({dtop}), a higher layer")
    return found


def test_course_lib_imports_run_one_way():
    graph = import_graph()
    assert len(graph) > 50 and graph["cli.course"] >= {"course.units", "course.run_records"}, graph.get("cli.course")
    found = cycles(graph)
    assert not found, ("modules of course_lib import each other: "
                       + "; ".join(" -> ".join(c) for c in found))
    problems = layer_problems(graph)
    assert not problems, "imports against the layers:\n" + "\n".join(problems)


def test_every_subpackage_is_a_layer():
    pkgs = sorted(p.name for p in PKG.iterdir() if (p / "__init__.py").is_file())
    assert sorted(pkgs) == sorted(LAYERS), pkgs
    top = sorted(p.name for p in PKG.glob("*.py"))
    assert top == ["__init__.py", "_modidx.py"], f"modules at the top of course_lib: {top}"


def _write(pkg: Path, files: dict[str, str]):
    for name, text in files.items():
        (pkg / name).parent.mkdir(parents=True, exist_ok=True)
        (pkg / name).write_text(text)


def test_a_made_up_cycle_and_a_downward_import_are_found(tmp_path):
    "Every form of import makes an edge; a cycle through a lazy and a TYPE_CHECKING import is caught."
    pkg = tmp_path / "course_lib"
    _write(pkg, {"__init__.py": '__version__ = "0"\n',
                 "core/__init__.py": "from .base import x\n", "core/base.py": "import json\nx = 1\n",
                 "data/__init__.py": "", "data/low.py": "import os\nfrom ..core.base import x\n"
                                                      "def f():\n    from course_lib.data.high import g  # lazily\n",
                 "data/mid.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import course_lib.data.low\n",
                 "data/high.py": "from course_lib.data import mid\nimport course_lib.core.base as c\n",
                 "data/side.py": "from . import low\nfrom course_lib.core import x\nimport course_lib\n"})
    graph = import_graph(pkg)
    assert graph == {"__init__": set(), "core": {"core.base"}, "core.base": set(), "data": set(),
                     "data.low": {"core.base", "data.high"}, "data.mid": {"data.low"},
                     "data.high": {"data.mid", "core.base"}, "data.side": {"data.low", "core"}}, graph
    assert cycles(graph) == [["data.high", "data.low", "data.mid", "data.high"]] or \
        cycles(graph) == [["data.high", "data.mid", "data.low", "data.high"]]
    assert layer_problems(graph, ["core", "data"]) == []
    _write(pkg, {"data/mid.py": "import json\n",                        # the TYPE_CHECKING import gone: no cycle
                 "core/base.py": "def f():\n    from course_lib.data.side import y\n",   # core reaching up
                 "data/side.py": "from course_lib.data import y\n"})     # its own __init__
    graph = import_graph(pkg)
    assert cycles(graph) == []
    assert layer_problems(graph, ["core", "data"]) == [
        "core.base (core) imports data.side (data), a higher layer",
        "data.side imports its own subpackage's __init__ (data), which imports it"], layer_problems(graph)
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"e"}, "e": {"c"}}) == [["a", "b", "a"],
                                                                                     ["c", "d", "e", "c"]]


def test_no_public_name_hides_a_module():
    """A subpackage's `__init__` must not export a name that is also one of its modules: `course_lib.score.langevin`
    was the function `langevin`, so `import course_lib.score.langevin as m` gave a function and
    `monkeypatch.setattr(course_lib.score.langevin, ...)` patched nothing the trainer reads."""
    import importlib, pkgutil
    found = []
    for pkg in LAYERS:
        m = importlib.import_module(f"course_lib.{pkg}")
        found += [f"course_lib.{pkg}.{s.name}" for s in pkgutil.iter_modules(m.__path__)
                  if s.name in getattr(m, "__all__", ())]
    assert not found, f"public names that hide the module of the same name: {found}"


def test_every_module_is_under_450_lines():
    "The limit the project set itself (DESIGN.md): a module stays under 450 lines; a class that needs more is several."
    long = {m: n for m, p in module_names().items() if (n := len(p.read_text().splitlines())) >= 450}
    assert not long, f"modules of 450 lines or more: {long}"
