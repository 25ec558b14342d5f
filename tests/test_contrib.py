"""`course new`: a scaffolded notebook passes the test suite unchanged, and bad requests get exit code 2.

The end-to-end test works in a scratch copy of the project (COURSE_LIB_ROOT points `course` at it): it runs
`course new`, then the repository's own notebook and hygiene tests, inside the copy, on the new notebook."""
import json, os, shutil, subprocess, sys, tomllib
from pathlib import Path

import pytest

from course_lib.course import load_units
from course_lib.course import ScaffoldError, check_new, register_notebook

ROOT = Path(__file__).resolve().parent.parent
COURSE = [sys.executable, "-c", "import sys; from course_lib.cli.course import main; sys.exit(main())"]


def scratch_project(dest: Path, units=("00_start",)) -> Path:
    "A copy of the project with the given units (their notebooks and index), the template, the library and the tests."
    (dest / "nbs").mkdir(parents=True)
    for f in ["settings.ini", "setup.py", "pyproject.toml", "README.md", "CONTRIBUTING.md"]:
        if (ROOT / f).is_file(): shutil.copy(ROOT / f, dest / f)
    shutil.copytree(ROOT / "course_lib", dest / "course_lib", ignore=shutil.ignore_patterns("__pycache__"))
    (dest / "tests").mkdir()
    for f in ["conftest.py", "test_notebooks.py", "test_repo_hygiene.py"]: shutil.copy(ROOT / "tests" / f, dest / "tests" / f)
    shutil.copytree(ROOT / "templates", dest / "templates")
    keep = {"index.ipynb"}
    for u in load_units(ROOT):
        if u.name in units:
            shutil.copytree(u.path, dest / "units" / u.name)
            keep |= {nb.name for nb in u.notebooks}
    for p in (ROOT / "nbs").iterdir():
        if p.name in keep or p.suffix in (".yml", ".css"): shutil.copy(p, dest / "nbs" / p.name)
    return dest


def course(args, root: Path, **kw):
    return subprocess.run(COURSE + list(args), cwd=root, capture_output=True, text=True,
                          env=dict(os.environ, COURSE_LIB_ROOT=str(root)), **kw)


def test_new_notebook_passes_the_test_suite_unchanged(tmp_path):
    proj = scratch_project(tmp_path / "proj")
    r = course(["new", "05_first_lesson", "--unit", "0", "--title", "My first lesson"], proj, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    nb = proj / "nbs" / "05_first_lesson.ipynb"
    assert nb.is_file() and (proj / "course_lib" / "course" / "first_lesson.py").is_file()
    text = nb.read_text()
    assert "# My first lesson" in text and "#| default_exp course.first_lesson" in text and "__MODULE__" not in text
    assert "def noise_moments" in (proj / "course_lib" / "course" / "first_lesson.py").read_text()
    cfg = tomllib.loads((proj / "units" / "00_start" / "unit.toml").read_text())
    assert cfg["unit"]["notebooks"][-1] == "05_first_lesson.ipynb"
    assert cfg["profiles"]["quick"]["05_first_lesson"] == {"n_samples": 2000}
    # the repository's own checks, in the scratch project, on the new notebook: it runs under nbval with the
    # quick profile (its checked output matches), the export is in sync, it is clean and follows the conventions
    tests = ["tests/test_notebooks.py::test_notebook_runs_quick[00_start/05_first_lesson.ipynb]",
             "tests/test_notebooks.py::test_every_notebook_is_in_a_unit",
             "tests/test_repo_hygiene.py::test_export_in_sync",
             "tests/test_repo_hygiene.py::test_notebooks_clean",
             "tests/test_repo_hygiene.py::test_notebook_outputs_only_checked_text[05_first_lesson.ipynb]",
             "tests/test_repo_hygiene.py::test_notebook_conventions[05_first_lesson.ipynb]"]
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", *tests],
                       cwd=proj, capture_output=True, text=True, timeout=900,
                       env=dict(os.environ, COURSE_LIB_ROOT=str(proj)))
    assert r.returncode == 0 and f"{len(tests)} passed" in r.stdout, r.stdout[-6000:] + r.stderr[-2000:]


@pytest.fixture
def small(tmp_path, monkeypatch):
    "A scratch project with unit 0's unit.toml and the template only (no notebook execution, no export)."
    proj = tmp_path / "proj"
    for d in ["nbs", "course_lib", "units/00_start", "units/01_ddpm", "templates"]: (proj / d).mkdir(parents=True)
    shutil.copy(ROOT / "templates" / "notebook.ipynb", proj / "templates")
    (proj / "nbs" / "03_getting_started.ipynb").write_text("{}")
    for pkg in ["core", "ddpm"]:                      # two subpackages, one with a module
        (proj / "course_lib" / pkg).mkdir()
        (proj / "course_lib" / pkg / "__init__.py").write_text("")
    (proj / "course_lib" / "core" / "basics.py").write_text("")
    (proj / "units" / "00_start" / "unit.toml").write_text('[unit]\ntitle = "Start"\nnotebooks = ["03_getting_started.ipynb"]\n')
    (proj / "units" / "01_ddpm" / "unit.toml").write_text(
        '# the DDPM unit\n[unit]\ntitle = "DDPM"\nnotebooks = [\n  "10_a.ipynb",  # forward\n]\n\n[profiles.quick]\nseed = 0\n')
    (proj / "nbs" / "10_a.ipynb").write_text("{}")
    monkeypatch.setenv("COURSE_LIB_ROOT", str(proj))
    return proj


def test_new_registers_in_a_unit_keeping_its_layout(small, capsys):
    from course_lib.cli.new import new_main
    assert new_main(["11_guidance", "--unit", "ddpm", "--no-export"]) == 0
    text = (small / "units" / "01_ddpm" / "unit.toml").read_text()
    assert text.startswith("# the DDPM unit\n") and '"10_a.ipynb",  # forward\n  "11_guidance.ipynb",\n]' in text
    cfg = tomllib.loads(text)
    assert cfg["unit"]["notebooks"] == ["10_a.ipynb", "11_guidance.ipynb"]
    assert cfg["profiles"]["quick"] == {"seed": 0, "11_guidance": {"n_samples": 2000}}
    nb = json.loads((small / "nbs" / "11_guidance.ipynb").read_text())
    ids = [c["id"] for c in nb["cells"]]
    tpl_ids = [c["id"] for c in json.loads((small / "templates" / "notebook.ipynb").read_text())["cells"]]
    assert len(set(ids)) == len(ids) and not set(ids) & set(tpl_ids), "cell ids must be fresh"
    assert nb["cells"][0]["source"][0] == "# Guidance\n"
    assert not list(small.rglob("*.tmp")), "atomic writes left a temporary file"


@pytest.mark.parametrize("args,msg", [
    (["03_getting_started", "--unit", "0"], "already exists"),
    (["04_x", "--unit", "9"], "unknown unit '9'"),
    (["first", "--unit", "0"], "bad notebook name"),
    (["04_First", "--unit", "0"], "bad notebook name"),
    (["../04_x", "--unit", "0"], "bad notebook name"),
    (["18_x", "--unit", "0"], "does not fit unit 0"),
    (["03_other", "--unit", "0"], "number 03 is taken"),
    (["06_x", "--unit", "0", "--module", "core.basics"], "course_lib/core/basics.py already exists"),
    (["06_x", "--unit", "0", "--module", "core"], "bad module name 'core'"),
    (["06_x", "--unit", "0", "--module", "nowhere.x"], "no subpackage 'nowhere'"),
    (["06_x", "--unit", "0", "--module", "class"], "bad module name"),
    (["04_x"], "required: --unit"),
])
def test_new_rejects_bad_requests(small, capsys, args, msg):
    from course_lib.cli.new import new_main
    before = {p: p.read_bytes() for p in small.rglob("*") if p.is_file()}
    assert new_main(args) == 2
    assert msg in capsys.readouterr().err
    assert {p: p.read_bytes() for p in small.rglob("*") if p.is_file()} == before, "a failed `course new` changed files"


def test_register_notebook_variants():
    one = register_notebook('[unit]\nnotebooks = ["10_a.ipynb"]  # order\n[profiles.quick]\nn = 1\n', "11_b.ipynb", {"n_samples": 5})
    assert '["10_a.ipynb", "11_b.ipynb"]  # order' in one
    assert tomllib.loads(one)["profiles"]["quick"] == {"n": 1, "11_b": {"n_samples": 5}}
    empty = register_notebook('[unit]\ntitle = "X"\n', "70_a.ipynb")
    assert tomllib.loads(empty)["unit"] == {"title": "X", "notebooks": ["70_a.ipynb"]}
    with pytest.raises(ScaffoldError, match="does not parse"):
        register_notebook("[unit\n", "10_a.ipynb")
