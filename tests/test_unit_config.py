"""Unit configuration that used to be dropped without a word (issue 17, kind 4): profile parameters that no
notebook declares, parameters assigned as tuples, tables and keys that nothing reads; and `course run` on
one notebook with the profile of the unit that lists it."""
import json
from pathlib import Path

import nbformat
import pytest

from course_lib.course import load_unit, load_units, notebook_parameters
from course_lib.cli import main


def _nb(path: Path, params: str, cells=()):
    n = nbformat.v4.new_notebook()
    n.metadata["kernelspec"] = {"name": "python3", "language": "python", "display_name": "Python 3"}
    p = nbformat.v4.new_code_cell(params)
    p.metadata["tags"] = ["parameters"]
    n.cells = [p] + [nbformat.v4.new_code_cell(c) for c in cells]
    nbformat.write(n, str(path))
    return path


def _project(tmp: Path, toml: str) -> Path:
    "Unit 07_tiny: a.ipynb assigns `lr, steps` as a tuple and records them; b.ipynb assigns `n_samples`."
    (tmp / "nbs").mkdir(parents=True)
    (tmp / "units" / "07_tiny").mkdir(parents=True)
    _nb(tmp / "nbs" / "a.ipynb", "lr, steps = 0.1, 1000", [
        "from course_lib.core.basics import record\nrecord('lr_seen', lr)\nrecord('steps_seen', steps)"])
    _nb(tmp / "nbs" / "b.ipynb", "n_samples = 10\nseed = 0", ["raise RuntimeError('b must not run')"])
    (tmp / "units" / "07_tiny" / "unit.toml").write_text(
        '[unit]\ntitle = "Tiny"\nnotebooks = ["a.ipynb", "b.ipynb"]\n' + toml)
    return tmp


def test_notebook_parameters_tuples_chains_and_magics(tmp_path):
    "`lr, steps = 0.1, 10` declared nothing; a magic in the cell was a SyntaxError."
    nb = _nb(tmp_path / "p.ipynb", "%matplotlib inline\nlr, steps = 0.1, 10\n(a, [b, *rest]) = 1, (2, 3, 4)\n"
                                   "x = y = 0\nz: int = 3\nobj.attr = 1\nd['k'] = 2\nprint(lr)")
    assert notebook_parameters(nb) == {"lr", "steps", "a", "b", "rest", "x", "y", "z"}


OK_TOML = '[profiles.quick]\nsteps = 3\nseed = 1\n[profiles.quick."a"]\nlr = 0.5\n[profiles.full]\nsteps = 30\n' \
          '[bars.quick."a"]\nsteps_seen = ">= 1"\n'


def test_declared_parameters_pass_and_reach_only_their_notebooks(tmp_path):
    "steps (a only) and seed (b only) are unit-wide keys some notebook declares; [bars] is not a profile."
    unit = load_unit(_project(tmp_path, OK_TOML) / "units" / "07_tiny")
    assert unit.params(unit.notebooks[0], "quick") == {"steps": 3, "seed": 1, "lr": 0.5}
    assert unit.params(unit.notebooks[1], "full") == {"steps": 30}


@pytest.mark.parametrize("toml,says", [
    ('[profiles.quick."b"]\nn_sampels = 5\n',
     ["'n_sampels' in [profiles.quick.\"b\"]", "b.ipynb's parameters cell does not assign it",
      "did you mean 'n_samples'"]),
    ('[profiles.quick]\nstep = 3\n', ["'step' in [profiles.quick]: no notebook of the unit", "'steps'"]),
    ('[profiles.full."c"]\nlr = 1\n', ['[profiles.full."c"] names no notebook of the unit']),
    ('[profiles.quik]\nsteps = 1\n', ["[profiles.quik] is not a profile"]),
])
def test_undeclared_profile_parameters_are_errors(tmp_path, toml, says, monkeypatch, capsys):
    "They were dropped: the run reported success with `params: {}`."
    proj = _project(tmp_path, toml)
    monkeypatch.setenv("COURSE_LIB_ROOT", str(proj))
    monkeypatch.chdir(proj)
    assert main(["run", "tiny", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    for s in says: assert s in err, err
    assert "unit.toml" in err and not (tmp_path / "out" / "07_tiny").exists()   # nothing ran


def test_unknown_unit_key_is_an_error(tmp_path):
    proj = _project(tmp_path, "")
    f = proj / "units" / "07_tiny" / "unit.toml"
    f.write_text(f.read_text().replace("notebooks =", "notebook = []\nnotebooks ="))
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['notebook'\] in \[unit\]"):
        load_unit(f.parent)


def test_course_run_one_notebook_with_its_units_profile(tmp_path, monkeypatch, capsys):
    "`course run nbs/a.ipynb` was an unknown unit; tuple parameters could not be overridden."
    proj = _project(tmp_path, OK_TOML)
    monkeypatch.setenv("COURSE_LIB_ROOT", str(proj))
    monkeypatch.chdir(proj)
    out = tmp_path / "out"
    assert main(["run", "nbs/a.ipynb", "--profile", "quick", "--out", str(out)]) == 0, capsys.readouterr()
    assert json.loads((out / "results.json").read_text()) == {"a": {"lr_seen": 0.5, "steps_seen": 3}}
    times = json.loads((out / "timings.json").read_text())
    assert list(times) == ["a"] and times["a"]["params"] == {"steps": 3, "lr": 0.5}     # b did not run
    assert "[1/1] 07_tiny/a.ipynb (quick)" in capsys.readouterr().out


def test_find_notebook_by_path_name_and_stem(tmp_path, monkeypatch, capsys):
    from course_lib.course import find_notebook
    proj = _project(tmp_path, OK_TOML)
    units = load_units(proj)
    a = proj / "nbs" / "a.ipynb"
    for key in [str(a), "a.ipynb", "a", "nbs/a.ipynb"]:
        u, nb = find_notebook(key, units)
        assert u.name == "07_tiny" and nb.resolve() == a.resolve(), key
    (tmp_path / "elsewhere").mkdir()
    copy = _nb(tmp_path / "elsewhere" / "a.ipynb", "lr = 1")
    assert find_notebook(str(copy), units)[1] == copy             # a learner's copy runs with a's profile
    stray = _nb(proj / "nbs" / "z.ipynb", "k = 1")
    with pytest.raises(KeyError, match="no unit lists the notebook 'z.ipynb'"): find_notebook(str(stray), units)
    monkeypatch.setenv("COURSE_LIB_ROOT", str(proj))
    assert main(["run", str(stray)]) == 2 and "no unit lists" in capsys.readouterr().err
    assert main(["run", "nope"]) == 2 and "unknown unit 'nope'" in capsys.readouterr().err


# ---------------------------------------------------------------- the library's own unit (kind = "library")

def test_unit_kind_library_is_read_and_unknown_kinds_refused(tmp_path):
    "`kind` was an unknown [unit] key; a misspelt kind, or `prerequisites` (which the site reads), were not told apart."
    proj = _project(tmp_path, "")
    f = proj / "units" / "07_tiny" / "unit.toml"
    text = f.read_text()
    assert load_unit(f.parent).kind == "lesson" and not load_unit(f.parent).is_library
    f.write_text(text.replace("[unit]\n", '[unit]\nkind = "library"\nprerequisites = ["unit 1"]\n'))
    assert load_unit(f.parent).is_library
    f.write_text(text.replace("[unit]\n", '[unit]\nkind = "libary"\n'))
    with pytest.raises(ValueError, match=r"kind = 'libary' in \[unit\] is not a kind of unit .*did you mean 'library'"):
        load_unit(f.parent)
    f.write_text(text.replace("[unit]\n", '[unit]\nknd = "library"\n'))
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['knd'\] in \[unit\].*did you mean 'kind'"):
        load_unit(f.parent)


def test_library_notebooks_are_their_own_unit_after_the_lessons(capsys):
    "Unit 0 listed the library's notebooks (core, data, cli, site, ...) as the learner's first lesson."
    from course_lib.course import find_unit
    root = Path(__file__).resolve().parent.parent
    units = load_units(root)
    start, library = find_unit("start", units), find_unit("library", units)
    assert [nb.name for nb in start.notebooks] == ["03_getting_started.ipynb"] and start.kind == "lesson"
    assert library.is_library and units[-1] is library and [u for u in units if u.is_library] == [library]
    names = {nb.name for nb in library.notebooks}
    assert {"00_core.ipynb", "05_units.ipynb", "90_cli.ipynb", "91_site.ipynb", "92_contrib.ipynb"} <= names
    listed = {nb.name for u in units if not u.is_library for nb in u.notebooks}
    assert not names & listed, f"library notebooks also in a lesson unit: {sorted(names & listed)}"
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    head = out.index("the library's own notebooks")
    assert out.index(" start ") < head < out.index("00_core.ipynb"), out


def test_course_run_all_runs_the_library_last(tmp_path, monkeypatch, capsys):
    "`course run all` runs every unit in order of number: the lessons, then the library (unit 99)."
    proj = _project(tmp_path, OK_TOML)
    (proj / "units" / "99_lib").mkdir()
    _nb(proj / "nbs" / "00_lib.ipynb", "seed = 0", ["from course_lib.core.basics import record\nrecord('ran', 1)"])
    (proj / "units" / "99_lib" / "unit.toml").write_text('[unit]\nkind = "library"\nnotebooks = ["00_lib.ipynb"]\n')
    (proj / "units" / "07_tiny" / "unit.toml").write_text(
        '[unit]\ntitle = "Tiny"\nnotebooks = ["a.ipynb"]\n[profiles.quick]\nsteps = 3\n')
    monkeypatch.setenv("COURSE_LIB_ROOT", str(proj))
    monkeypatch.chdir(proj)
    assert main(["run", "all", "--out", str(tmp_path / "out")]) == 0, capsys.readouterr()
    out = capsys.readouterr().out
    assert out.index("[1/2] 07_tiny/a.ipynb") < out.index("[2/2] 99_lib/00_lib.ipynb"), out
