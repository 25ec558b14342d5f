"""Unit configuration that used to be dropped without a word (issue 17, kind 4): profile parameters that no
notebook declares, parameters assigned as tuples, tables and keys that nothing reads; and `course run` on
one notebook with the profile of the unit that lists it."""
import json
from pathlib import Path

import nbformat
import pytest

from course_lib.cli import load_unit, load_units, main, notebook_parameters


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
        "from course_lib.core import record\nrecord('lr_seen', lr)\nrecord('steps_seen', steps)"])
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
    from course_lib.cli import find_notebook
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
