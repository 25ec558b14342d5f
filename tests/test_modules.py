"""The library as users reach it: every module imports on its own, and nothing the notebooks export refers to a
name that only a notebook cell defines.

The notebooks run every exported cell in one kernel together with the lesson's own cells, so an exported function
that uses a name imported in a non-exported cell (`import copy` in a demo cell) works in the notebook and fails in
`course_lib`. These checks look at the generated modules themselves: a fresh interpreter imports each one, and
pyflakes reads each one for undefined names and unused imports. nbdev 1's `# export` (without `|`) is silently not
exported by nbdev 2, so it is refused in every notebook. The last tests build a tiny nbdev project with each of
these defects and show that the checks catch them."""
import json, re, shutil, subprocess, sys
from pathlib import Path

import pytest
from pyflakes import api as flakes_api, messages as flakes_messages

ROOT = Path(__file__).resolve().parent.parent
# every module as a dotted name (`core.cache`; a subpackage's `__init__` as the subpackage, `core`)
MODULES = sorted(".".join(p.relative_to(ROOT / "course_lib").with_suffix("").parts).removesuffix(".__init__")
                 for p in (ROOT / "course_lib").rglob("*.py") if p.parent != ROOT / "course_lib")
NOTEBOOKS = sorted((ROOT / "nbs").glob("*.ipynb")) + sorted((ROOT / "templates").glob("*.ipynb"))
# nbdev 1 wrote directives as `# export`, `#export`, `# default_exp x`, `# hide`; nbdev 2 reads only `#| ...`
NBDEV1_DIRECTIVE = re.compile(
    r"^\s*#\s*(export|exports|exporti|default_exp|hide|hide_input|hide_output|collapse_\w+)\b.*$", re.M)
CELL_HEADER = re.compile(r"^# %% (?:\.\./)+nbs/(\S+\.ipynb) #(\w+)")


class _Collect:
    "A pyflakes reporter that keeps the messages."
    def __init__(self): self.messages, self.errors = [], []
    def flake(self, m): self.messages.append(m)
    def unexpectedError(self, filename, msg): self.errors.append(f"{filename}: {msg}")
    def syntaxError(self, filename, msg, lineno, offset, text): self.errors.append(f"{filename}:{lineno}: {msg}")


def _cell_of(lines: list[str], lineno: int) -> str:
    "The notebook cell (`NN_name.ipynb #id`) that nbdev_export wrote line `lineno` (1-based) from."
    for line in reversed(lines[:lineno]):
        m = CELL_HEADER.match(line)
        if m: return f"{m.group(1)} #{m.group(2)}"
    return "?"


def module_problems(lib: Path) -> list[str]:
    """pyflakes on every generated module of `lib`: undefined names, unused imports, `import *`, and the rest, each
    with the notebook cell it came from. One message is let through: a name imported again by the import cell of
    a later notebook that exports into the same module (each notebook must run alone, so each imports what it
    uses)."""
    found = []
    for path in sorted(lib.rglob("*.py")):
        if path.name == "_modidx.py": continue
        rep = _Collect()
        flakes_api.checkPath(str(path), rep)
        found += rep.errors
        lines = path.read_text(encoding="utf-8").splitlines()
        for m in rep.messages:
            where = _cell_of(lines, m.lineno)
            if isinstance(m, flakes_messages.RedefinedWhileUnused):
                first = _cell_of(lines, int(m.message_args[1]))
                if first.split(" #")[0] != where.split(" #")[0]: continue
            text = m.message % m.message_args
            found.append(f"{path.relative_to(lib).as_posix()}:{m.lineno}: {text}  (from nbs/{where})")
    return found


def nbdev1_directives(notebooks) -> list[str]:
    "Every code-cell line written as an nbdev 1 directive (`# export`), which nbdev 2 silently ignores."
    found = []
    for nb_path in notebooks:
        nb = json.loads(Path(nb_path).read_text(encoding="utf-8"))
        for i, cell in enumerate(nb["cells"]):
            if cell["cell_type"] != "code": continue
            src = "".join(cell["source"])
            for m in NBDEV1_DIRECTIVE.finditer(src):
                found.append(f"{Path(nb_path).name} cell {i}: {m.group(0).strip()!r} is nbdev 1 syntax, which "
                             f"nbdev 2 ignores: write '#| {m.group(1)}' instead")
    return found


SUBPACKAGES = sorted({m.split(".")[0] for m in MODULES})


@pytest.mark.parametrize("package", SUBPACKAGES)
def test_modules_import_alone(package):
    """A fresh interpreter imports the subpackage with nothing else of course_lib imported first, then each of its
    modules. Importing any module of a subpackage runs the subpackage's `__init__` first, which imports its
    modules in its own order, so one interpreter a subpackage sees what one a module would (and a module the
    `__init__` leaves out is imported on its own after it)."""
    mods = [m for m in MODULES if m == package or m.startswith(package + ".")]
    code = "import importlib\n" + "".join(f"importlib.import_module('course_lib.{m}')\n" for m in mods)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=str(ROOT), timeout=300)
    assert r.returncode == 0, (f"importing `course_lib.{package}` and its modules fails in a fresh interpreter:\n"
                               f"{r.stderr[-3000:]}")


def test_modules_have_no_undefined_names_or_unused_imports():
    found = module_problems(ROOT / "course_lib")
    assert not found, ("pyflakes finds problems in the generated library (fix them in the notebook cell named, "
                       "then run nbdev_export):\n" + "\n".join(found))


def test_no_nbdev1_directives():
    found = nbdev1_directives(NOTEBOOKS)
    assert not found, "\n".join(found)


# --- the checks catch what they are meant to catch -----------------------------------------------------------

def _cell(src: str) -> dict:
    return {"cell_type": "code", "execution_count": None, "id": f"c{abs(hash(src)) % 10**8:08d}",
            "metadata": {}, "outputs": [], "source": src}


@pytest.fixture(scope="module")
def broken_project(tmp_path_factory):
    """A tiny nbdev project whose notebook has the two defects of the `course lora train` bug: an exported function
    that uses `copy`, imported only in a non-exported cell, and a function marked with nbdev 1's `# export`."""
    tmp = tmp_path_factory.mktemp("proj")
    ini = (ROOT / "settings.ini").read_text().replace("lib_name = course_lib", "lib_name = tinylib")
    ini = ini.replace("lib_path = course_lib", "lib_path = tinylib").replace("repo = course_lib", "repo = tinylib")
    (tmp / "settings.ini").write_text(ini)
    (tmp / "nbs").mkdir()
    nb = {"cells": [_cell("#| default_exp tiny"), _cell("import copy"),
                    _cell("#| export\ndef duplicate(x):\n    return copy.deepcopy(x)"),
                    _cell("# export\ndef forgotten():\n    return 1")],
          "metadata": {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"}},
          "nbformat": 4, "nbformat_minor": 5}
    (tmp / "nbs" / "00_tiny.ipynb").write_text(json.dumps(nb, indent=1))
    r = subprocess.run([sys.executable, "-c", "from nbdev.doclinks import nbdev_export; nbdev_export()"],
                       cwd=tmp, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return tmp


def test_check_catches_name_imported_only_in_a_lesson_cell(broken_project):
    found = module_problems(broken_project / "tinylib")
    assert any("undefined name 'copy'" in f and "00_tiny.ipynb" in f for f in found), found


def test_check_catches_nbdev1_export(broken_project):
    module = (broken_project / "tinylib" / "tiny.py").read_text()
    assert "def duplicate" in module and "def forgotten" not in module   # silently not exported by nbdev 2
    found = nbdev1_directives(sorted((broken_project / "nbs").glob("*.ipynb")))
    assert len(found) == 1 and "'# export'" in found[0] and "'#| export'" in found[0], found


def test_check_catches_unused_import(tmp_path):
    (tmp_path / "m.py").write_text("# %% ../nbs/00_x.ipynb #abc\nimport json, os\n\nprint(os.sep)\n")
    found = module_problems(tmp_path)
    assert len(found) == 1 and "'json' imported but unused" in found[0] and "00_x.ipynb #abc" in found[0], found


def notebook_undefined_names(nb_path: Path) -> list[str]:
    """pyflakes on all code cells of a notebook read as one script (as a kernel runs them top to bottom): the names
    a cell uses that no earlier cell defines. IPython magics and shell lines are read as `pass`."""
    nb = json.loads(nb_path.read_text(encoding="utf-8"))
    lines = []
    for cell in nb["cells"]:
        if cell["cell_type"] != "code": continue
        lines += [re.sub(r"^(\s*)[%!].*", r"\1pass", line) for line in "".join(cell["source"]).splitlines()]
        lines.append("")
    rep = _Collect()
    flakes_api.check("\n".join(lines), nb_path.name, rep)
    found = [f"{nb_path.name}: {m.message % m.message_args}" for m in rep.messages
             if isinstance(m, flakes_messages.UndefinedName)]
    for m in rep.messages:      # `from course_lib.x import *` gives only the names in x's __all__
        if isinstance(m, flakes_messages.ImportStarUsage):
            name, sources = m.message_args
            if not any(name in _module_all(mod) for mod in sources.split(", ")):
                found.append(f"{nb_path.name}: undefined name {name!r} (not in the __all__ of {sources})")
    return rep.errors + found


def _module_all(module: str) -> set[str]:
    "The names in `__all__` of a course_lib module, read from its source (other modules: every name)."
    import ast
    if not module.startswith("course_lib."): return _EVERYTHING
    path = ROOT / "course_lib" / (module.split(".", 1)[1].replace(".", "/") + ".py")
    if not path.is_file(): path = path.with_suffix("") / "__init__.py"      # a subpackage
    if not path.is_file(): return set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in node.targets):
            return set(ast.literal_eval(node.value))
    return set()


class _Everything(set):
    def __contains__(self, item): return True


_EVERYTHING = _Everything()


@pytest.mark.parametrize("nb_path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_uses_no_undefined_name(nb_path):
    found = notebook_undefined_names(nb_path)
    assert not found, "\n".join(found)


def test_notebook_check_catches_a_missing_import(tmp_path):
    nb = {"cells": [_cell("x = 1"), _cell("from course_lib.core import *\nseed_everything(0)\nrecord_x(1)"),
                    _cell("if True:\n    %time y = x\nprint(np.zeros(3))")],
          "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    (tmp_path / "a.ipynb").write_text(json.dumps(nb))
    found = notebook_undefined_names(tmp_path / "a.ipynb")
    assert sorted(found) == ["a.ipynb: undefined name 'np' (not in the __all__ of course_lib.core)",
                             "a.ipynb: undefined name 'record_x' (not in the __all__ of course_lib.core)"], found


def test_subpackages_import_without_the_optional_extras():
    """`pip install course_lib` without `[pile]` or `[studio]`: every subpackage still imports (unit 6's lessons 60-62
    need `course_lib.pile` but not datatrove); only a name that needs an extra fails, on first use, naming it. The
    subpackage layout first broke this: `course_lib.pile`'s `__init__` imported datatrove for every lesson."""
    import configparser
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "settings.ini")
    extras = sorted({re.split(r"[<>=!~\[; ]", s, maxsplit=1)[0].replace("-", "_").lower()
                     for key in ("studio_requirements", "pile_requirements") for s in cfg["DEFAULT"][key].split()})
    code = ("import importlib, importlib.abc, sys\n"
            f"BLOCK = {extras!r}\n"
            "class Block(importlib.abc.MetaPathFinder):\n"
            "    def find_spec(self, name, path, target=None):\n"
            "        if name.split('.')[0] in BLOCK: raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
            "sys.meta_path.insert(0, Block())\n"
            f"for pkg in {SUBPACKAGES!r}: importlib.import_module('course_lib.' + pkg)\n"
            "import course_lib.pile as pile\n"
            "try: pile.run_clean\n"
            "except ModuleNotFoundError as e: assert \"course_lib[pile]\" in str(e), e\n"
            "else: raise AssertionError('run_clean imported with datatrove blocked')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=str(ROOT), timeout=300)
    assert r.returncode == 0, f"a subpackage needs an optional extra to import:\n{r.stderr[-3000:]}"
