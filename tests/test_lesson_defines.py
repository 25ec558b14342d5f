"""A lesson uses what it defines (issue 41, item 6).

A lesson that builds `cfg_combine` and then imports `cfg_combine` from `course_lib` runs the library's version from
then on: a learner who edits the lesson's cell sees no change. And a lesson that calls a function several cells
before the cell that defines it runs only when the notebook was already run once (the kernel keeps the old
definition), so top to bottom it fails, or worse, silently runs a stale version. For every lesson notebook (the
units without `kind = "library"`) these tests read the code cells in order and refuse

- (a) `from course_lib... import NAME` in a cell after an earlier cell defined NAME at top level (def, class,
  assignment): use the lesson's own NAME, or import the library's under another name (`as library_NAME`);
- (b) a cell that uses, at top level, a name that only a later cell defines with def/class, directly or through a
  function it calls at top level whose body uses that name: unbound at that point, or bound only by `from
  course_lib... import NAME` (the library's copy of what the lesson builds later: a "picture first" cell drawn
  with the library's `sample_guided` under the lesson's own name). A name bound before by anything else (an
  assignment, an import from another package) is the lesson's choice and not refused. Define NAME before its
  first use, or use the library's copy under another name (`library_NAME`), say so, and check that the lesson's
  own agrees with it once written.

IPython magics and shell lines (`%...`, `!...`) are read as `pass`, as in tests/test_modules.py. The last tests
build small notebooks with each defect and show that the checks catch them."""
import ast, json, re
from pathlib import Path

import pytest

from course_lib.course.units import load_units

ROOT = Path(__file__).resolve().parent.parent
LESSONS = [nb for u in load_units(ROOT) if not u.is_library for nb in u.notebooks]


MAGIC = re.compile(r"^(\s*)[%!].*")
COMPREHENSIONS = (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)
FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)


def code_cells(nb_path: Path) -> list[tuple[int, str]]:
    "`(index among all cells, source)` of each code cell of `nb_path`, with magics and shell lines read as `pass`."
    nb = json.loads(Path(nb_path).read_text(encoding="utf-8"))
    return [(i, "\n".join(MAGIC.sub(r"\1pass", line) for line in "".join(c["source"]).splitlines()))
            for i, c in enumerate(nb["cells"]) if c["cell_type"] == "code"]


def module_all(module: str) -> set[str]:
    "The names in `__all__` of a course_lib module, read from its source (what `import *` brings in)."
    path = ROOT / "course_lib" / (module.split(".", 1)[1].replace(".", "/") + ".py") if "." in module else \
        ROOT / "course_lib" / "__init__.py"
    if not path.is_file(): path = path.with_suffix("") / "__init__.py"      # a subpackage
    if not path.is_file(): return set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in node.targets):
            return set(ast.literal_eval(node.value))
    return set()


def free_names(fn: ast.AST) -> set[str]:
    """The names the body of function `fn` reads and does not bind itself (parameters, assignments, loop and
    comprehension variables, inner functions and imports, in `fn` or a function inside it): roughly, the module
    names it needs when it is called."""
    loads, local = set(), set()
    for node in ast.walk(fn):
        if isinstance(node, ast.Name):
            (loads if isinstance(node.ctx, ast.Load) else local).add(node.id)
        elif isinstance(node, ast.arg): local.add(node.arg)
        elif isinstance(node, (*FUNCTIONS, ast.ClassDef)) and node is not fn: local.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            local |= {a.asname or a.name.split(".")[0] for a in node.names}
    return loads - local


class _Events:
    """Reads the top-level code of a cell, in the order it runs, into events: `("bind", name, kind, detail)` (kind
    def, class, assignment, other or import; detail: the function's free names, the import's module), `("load",
    name)` and `("call", name)` (a call of a plain name). Function and lambda bodies are not read (they run when
    called: `free_names`), comprehension variables are not loads."""
    def __init__(self): self.events = []

    def bind(self, name, kind, detail=None): self.events.append(("bind", name, kind, detail))

    def expr(self, node, kind="assignment", hidden=frozenset()):
        if node is None: return
        if isinstance(node, ast.Lambda):
            for d in node.args.defaults + [d for d in node.args.kw_defaults if d]: self.expr(d, kind, hidden)
            return
        if isinstance(node, COMPREHENSIONS):
            hidden = hidden | {n.id for g in node.generators for n in ast.walk(g.target) if isinstance(n, ast.Name)}
        if isinstance(node, ast.Name):
            if node.id in hidden: return
            if isinstance(node.ctx, ast.Load): self.events.append(("load", node.id))
            else: self.bind(node.id, kind)
            return
        if isinstance(node, ast.NamedExpr):
            self.expr(node.value, kind, hidden)
            self.bind(node.target.id, "assignment")
            return
        for child in ast.iter_child_nodes(node): self.expr(child, kind, hidden)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id not in hidden:
            self.events.append(("call", node.func.id))

    def body(self, stmts):
        for s in stmts: self.stmt(s)

    def signature(self, s):
        "What runs when `def`/`class` statement `s` runs: decorators, defaults, annotations, bases."
        for d in s.decorator_list: self.expr(d)
        if isinstance(s, ast.ClassDef):
            for b in s.bases + [k.value for k in s.keywords]: self.expr(b)
            return
        a = s.args
        for d in a.defaults + [d for d in a.kw_defaults if d]: self.expr(d)
        for arg in a.posonlyargs + a.args + a.kwonlyargs + [a.vararg, a.kwarg]:
            if arg is not None: self.expr(arg.annotation)
        self.expr(s.returns)

    def stmt(self, s):
        if isinstance(s, FUNCTIONS):
            self.signature(s)
            self.bind(s.name, "def", free_names(s))
        elif isinstance(s, ast.ClassDef):
            self.signature(s)
            inner = _Events()            # the class body runs now, in its own namespace
            inner.body(s.body)
            local = {e[1] for e in inner.events if e[0] == "bind"}
            self.events += [e for e in inner.events if e[0] != "bind" and e[1] not in local]
            self.bind(s.name, "class")
        elif isinstance(s, ast.Import):
            for a in s.names: self.bind(a.asname or a.name.split(".")[0], "import")
        elif isinstance(s, ast.ImportFrom):
            module = "." * s.level + (s.module or "")
            for a in s.names:
                if a.name != "*": self.bind(a.asname or a.name, "import", (module, a.name))
                elif module.startswith("course_lib"):
                    for name in sorted(module_all(module)): self.bind(name, "import", (module, "*"))
        elif isinstance(s, (ast.If, ast.While)):
            self.expr(s.test)
            self.body(s.body + s.orelse)
        elif isinstance(s, (ast.For, ast.AsyncFor)):
            self.expr(s.iter)
            self.expr(s.target, "other")
            self.body(s.body + s.orelse)
        elif isinstance(s, (ast.With, ast.AsyncWith)):
            for item in s.items:
                self.expr(item.context_expr)
                self.expr(item.optional_vars, "other")
            self.body(s.body)
        elif isinstance(s, (ast.Try, getattr(ast, "TryStar", ast.Try))):
            self.body(s.body)
            for h in s.handlers:
                self.expr(h.type)
                if h.name: self.bind(h.name, "other")
                self.body(h.body)
            self.body(s.orelse + s.finalbody)
        elif isinstance(s, ast.Match):
            self.expr(s.subject)
            for case in s.cases:
                for node in ast.walk(case.pattern):
                    if isinstance(node, ast.MatchValue): self.expr(node.value)
                    for name in (getattr(node, "name", None), getattr(node, "rest", None)):
                        if isinstance(name, str): self.bind(name, "other")
                self.expr(case.guard)
                self.body(case.body)
        elif isinstance(s, ast.Assign):
            self.expr(s.value)
            for t in s.targets: self.expr(t)
        elif isinstance(s, ast.AnnAssign):
            self.expr(s.value)
            self.expr(s.annotation)
            self.expr(s.target)
        elif isinstance(s, ast.AugAssign):
            self.expr(s.value)
            if isinstance(s.target, ast.Name): self.events.append(("load", s.target.id))
            self.expr(s.target)
        elif isinstance(s, (ast.Global, ast.Nonlocal, ast.Delete)):
            pass
        else:
            self.expr(s)


def lesson_problems(nb_path: Path) -> list[str]:
    "The problems (a) and (b) of the module docstring in notebook `nb_path`, one message each."
    name, found, events = Path(nb_path).name, [], []
    for i, src in code_cells(nb_path):
        try: tree = ast.parse(src)
        except SyntaxError as e:
            found.append(f"{name} cell {i}: does not parse ({e.msg}, line {e.lineno})")
            continue
        reader = _Events()
        reader.body(tree.body)
        events += [(i, e) for e in reader.events]
    # where each name is defined with def/class: (event number, cell, kind)
    defined = {}
    for k, (i, e) in enumerate(events):
        if e[0] == "bind" and e[2] in ("def", "class"): defined.setdefault(e[1], []).append((k, i, e[2]))
    bound, functions, seen = {}, {}, set()       # name -> (cell, kind, the import's (module, name) or None)

    def library_copy(n):
        "True when `n` is bound only by `from course_lib... import n` (the library's copy of the lesson's `n`)."
        cell, kind, detail = bound[n]
        return kind == "import" and detail is not None and detail[0].startswith("course_lib") \
            and detail[1] in (n, "*")

    def too_early(k, i, used, via=""):
        later = [(j, kind) for at, j, kind in defined.get(used, ()) if at > k]
        if not later or (used in bound and not library_copy(used)) or (i, used) in seen: return
        seen.add((i, used))
        (j, kind), fix = later[0], f"define {used!r} before its first use"
        if used in bound:
            what = (f"the library's {used!r} (imported by cell {bound[used][0]}), before cell {j} defines the "
                    f"lesson's own ({kind}): a learner's edit of cell {j} does not reach this cell")
            fix += (f", or use the library's under another name (`from {bound[used][2][0]} import {used} as "
                    f"library_{used}`), say so, and check that both agree")
        else:
            what = (f"{used!r} before cell {j} defines it ({kind}): run top to bottom, this cell fails (or runs an "
                    "old definition the kernel kept)")
        found.append(f"{name} cell {i}: {via}uses {what}; {fix}")

    def through(k, i, fn, chain):
        "Check the free names of the function `fn` that cell `i` calls (and of the functions those call)."
        for used in sorted(functions.get(fn, ())):
            if used in functions and used not in chain: through(k, i, used, chain + [used])
            too_early(k, i, used, "calls " + " -> ".join(repr(c) for c in chain) + ", which ")

    for k, (i, e) in enumerate(events):
        if e[0] == "load": too_early(k, i, e[1])
        elif e[0] == "call": through(k, i, e[1], [e[1]])
        else:
            _, n, kind, detail = e
            if kind == "import" and detail and detail[0].startswith("course_lib") and n in bound \
                    and bound[n][1] != "import":
                (module, what), (j, was, _) = detail, bound[n]
                found.append(f"{name} cell {i}: `from {module} import {what}` replaces {n!r}, which cell {j} "
                             f"defined ({was}): from here on the lesson runs the library's {n!r}, and a learner's "
                             f"edit of cell {j} changes nothing. Use the lesson's own {n!r} (drop the import), or "
                             f"import the library's under another name (`from {module} import {n} as "
                             f"library_{n}`) and check that both agree")
            bound[n] = (i, kind, detail)
            if kind == "def": functions[n] = detail
            else: functions.pop(n, None)
    return found


@pytest.mark.parametrize("nb_path", LESSONS, ids=lambda p: p.stem)
def test_lesson_uses_what_it_defines(nb_path):
    found = lesson_problems(nb_path)
    assert not found, "\n".join(found)


def test_there_are_lessons():
    assert len(LESSONS) > 20 and all(p.is_file() for p in LESSONS)


# --- the checks catch their defects, on made-up notebooks ---

def _notebook(tmp_path: Path, *cells: str) -> Path:
    "A notebook of a markdown cell then one code cell per string of `cells`."
    nb = {"cells": [{"cell_type": "markdown", "metadata": {}, "source": ["# A lesson"]}] +
          [{"cell_type": "code", "metadata": {}, "execution_count": None, "outputs": [], "source": [c]}
           for c in cells], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    path = tmp_path / "99_made_up.ipynb"
    path.write_text(json.dumps(nb), encoding="utf-8")
    return path


GUIDANCE = "def cfg_combine(uncond, cond, scale):\n    return uncond + scale * (cond - uncond)"


def test_catches_a_reimport_of_a_lesson_function(tmp_path):
    nb = _notebook(tmp_path, GUIDANCE, "from course_lib.flux.guidance import cfg_combine, drop_labels\n"
                   "cfg_combine(0.0, 1.0, 3.0)")
    found = lesson_problems(nb)
    assert len(found) == 1, found
    assert "cell 2" in found[0] and "'cfg_combine'" in found[0] and "cell 1" in found[0], found


def test_catches_a_reimport_of_a_lesson_class_and_value(tmp_path):
    nb = _notebook(tmp_path, "class GuidedUNet:\n    pass", "SCALE = 3.0",
                   "import torch\nfrom course_lib.flux import GuidedUNet, SCALE as SCALE")
    found = lesson_problems(nb)
    assert len(found) == 2 and "'GuidedUNet'" in found[0] and "'SCALE'" in found[1], found


def test_catches_a_star_import_over_a_lesson_function(tmp_path):
    nb = _notebook(tmp_path, GUIDANCE, "from course_lib.flux import *")
    found = lesson_problems(nb)
    assert len(found) == 1 and "'cfg_combine'" in found[0], found


def test_lets_the_library_in_under_another_name(tmp_path):
    nb = _notebook(tmp_path, GUIDANCE, "from course_lib.flux import cfg_combine as library_cfg_combine\n"
                   "assert cfg_combine(0.0, 1.0, 3.0) == library_cfg_combine(0.0, 1.0, 3.0)",
                   "from torch import nn as cfg_combine_nn\nfrom course_lib.flux import drop_labels")
    assert lesson_problems(nb) == []


def test_catches_a_use_of_the_librarys_copy_before_the_lessons_own(tmp_path):
    "The picture first, drawn with the library's `cfg_combine` under the lesson's own name, defined only later."
    nb = _notebook(tmp_path, "from course_lib.flux import cfg_combine\ncfg_combine(0.0, 1.0, 3.0)", GUIDANCE,
                   "cfg_combine(0.0, 1.0, 3.0)")
    found = lesson_problems(nb)
    assert len(found) == 1, found
    assert "cell 1" in found[0] and "'cfg_combine'" in found[0] and "cell 2" in found[0], found


def test_catches_a_call_that_reaches_the_librarys_copy(tmp_path):
    nb = _notebook(tmp_path, "from course_lib.flux import cfg_combine",
                   "def sample():\n    return cfg_combine(0, 1, 3)", "sample()", GUIDANCE)
    found = lesson_problems(nb)
    assert len(found) == 1 and "cell 3" in found[0] and "'sample'" in found[0], found


def test_lets_the_library_in_under_another_name_before_the_lessons_own(tmp_path):
    nb = _notebook(tmp_path, "from course_lib.flux import cfg_combine as library_cfg_combine\n"
                   "picture = library_cfg_combine(0.0, 1.0, 3.0)", GUIDANCE,
                   "assert cfg_combine(0.0, 1.0, 3.0) == picture")
    assert lesson_problems(nb) == []


def test_lets_a_lesson_define_over_another_packages_name(tmp_path):
    "`floor` from `math` first, the lesson's own `floor` later: a name the lesson builds anew, not a copy."
    nb = _notebook(tmp_path, "from math import floor\nfloor(1.5)", "def floor(x):\n    return int(x // 1)",
                   "floor(2.5)")
    assert lesson_problems(nb) == []


def test_lets_a_lesson_use_the_library_after_its_own_was_replaced(tmp_path):
    "Cell 3 is refused by (a); the use in cell 4 is the library's, with no definition after it: not (b) again."
    nb = _notebook(tmp_path, "from course_lib.flux import cfg_combine", GUIDANCE,
                   "from course_lib.flux import cfg_combine", "cfg_combine(0.0, 1.0, 3.0)")
    found = lesson_problems(nb)
    assert len(found) == 1 and "cell 3" in found[0] and "replaces" in found[0], found


def test_catches_a_use_before_the_definition(tmp_path):
    nb = _notebook(tmp_path, "import torch", "x = torch.zeros(3)\nguided = cfg_combine(x, x + 1, 3.0)", GUIDANCE)
    found = lesson_problems(nb)
    assert len(found) == 1, found
    assert "cell 2" in found[0] and "'cfg_combine'" in found[0] and "cell 3" in found[0], found


def test_catches_a_use_before_the_definition_in_the_same_cell(tmp_path):
    nb = _notebook(tmp_path, "print(Net())\nclass Net:\n    pass")
    found = lesson_problems(nb)
    assert len(found) == 1 and "'Net'" in found[0], found


def test_catches_a_use_through_a_function_called_too_early(tmp_path):
    nb = _notebook(tmp_path, "def sample(n):\n    return [cfg_combine(0.0, 1.0, 3.0) for _ in range(n)]",
                   "samples = sample(4)", GUIDANCE)
    found = lesson_problems(nb)
    assert len(found) == 1, found
    assert "cell 2" in found[0] and "'sample'" in found[0] and "'cfg_combine'" in found[0], found


def test_catches_a_use_through_a_chain_of_calls(tmp_path):
    nb = _notebook(tmp_path, "def inner():\n    return cfg_combine(0.0, 1.0, 3.0)",
                   "def outer():\n    return inner()", "if True:\n    print(outer())", GUIDANCE)
    found = lesson_problems(nb)
    assert len(found) == 1 and "'cfg_combine'" in found[0] and "cell 3" in found[0], found


def test_lets_a_function_use_a_later_definition_when_called_after_it(tmp_path):
    nb = _notebook(tmp_path, "def sample(n):\n    return [cfg_combine(0.0, 1.0, 3.0) for _ in range(n)]",
                   GUIDANCE, "samples = sample(4)",
                   "def later():\n    return Helper()\nclass Helper:\n    pass\nlater()")
    assert lesson_problems(nb) == []


def test_reads_around_magics_locals_and_imports(tmp_path):
    nb = _notebook(tmp_path, "%matplotlib inline\n!pip list\n%%time",
                   "%%capture\nfrom torch import nn\nnn",
                   "squares = [step * step for step in range(3)]\nf = lambda: later_fn()\n"
                   "for i in range(2):\n    pass\nprint(i, squares)",
                   "def step():\n    pass", "def later_fn():\n    pass", "def nn():\n    pass")
    assert lesson_problems(nb) == []
