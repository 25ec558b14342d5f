"""`course site` reuses an executed notebook only while it is up to date: the same notebook, the same profile and
parameters, the same course_lib code (the stamp `course run` writes); each lesson page names the profile, date and
machine of its run. Tiny notebooks, no Sphinx."""
import json
from pathlib import Path

import nbformat
import pytest

import course_lib.course.site as site
import course_lib.course.run_stamps as run_stamps
from course_lib.course import load_units
from course_lib.course import stamp_matches, run_units
from course_lib.course import execute_missing, find_executed, execution_note
from course_lib.course.site import _lesson_page


def tiny_project(tmp: Path) -> Path:
    (tmp / "nbs").mkdir(parents=True); (tmp / "units" / "07_tiny").mkdir(parents=True)
    for name in ("a", "b"):
        n = nbformat.v4.new_notebook()
        n.metadata["kernelspec"] = {"name": "python3", "language": "python", "display_name": "Python 3"}
        p = nbformat.v4.new_code_cell("steps = 1000"); p.metadata["tags"] = ["parameters"]
        n.cells = [nbformat.v4.new_markdown_cell(f"# Notebook {name}"), p, nbformat.v4.new_code_cell("print(steps * 2)")]
        nbformat.write(n, tmp / "nbs" / f"{name}.ipynb")
    (tmp / "units" / "07_tiny" / "unit.toml").write_text(
        '[unit]\ntitle = "Tiny"\nnotebooks = ["a.ipynb", "b.ipynb"]\n[profiles.quick]\nsteps = 3\n[profiles.full]\nsteps = 30\n')
    return tmp


@pytest.fixture
def spy(monkeypatch):
    "The notebooks `execute_missing` executes, call by call."
    calls = []
    def counting(us, profile, out, *a, **k):
        calls.append(sorted(nb.stem for u in us for nb in u.notebooks))
        return run_units(us, profile, out, *a, **k)
    monkeypatch.setattr(site, "run_units", counting)
    return calls


def test_second_build_reuses_and_an_edit_reexecutes(tmp_path, spy):
    proj = tiny_project(tmp_path / "proj")
    out = tmp_path / "executed"
    found, failed = execute_missing(load_units(proj), "quick", [out], out, echo=lambda *a, **k: None)
    assert failed == [] and spy == [["a", "b"]] and sorted(Path(p).name for p in found.values()) == ["a.ipynb", "b.ipynb"]
    found, _ = execute_missing(load_units(proj), "quick", [out], out, echo=lambda *a, **k: None)
    assert spy == [["a", "b"]] and len(found) == 2                 # up to date: nothing executed again
    nb = nbformat.read(proj / "nbs" / "b.ipynb", as_version=4)
    nb.cells[2].source = "print(steps * 3)"
    nbformat.write(nb, proj / "nbs" / "b.ipynb")
    execute_missing(load_units(proj), "quick", [out], out, echo=lambda *a, **k: None)
    assert spy == [["a", "b"], ["b"]]                              # only the edited notebook
    nb = nbformat.read(proj / "nbs" / "a.ipynb", as_version=4)
    nb.cells[0].source = "# Notebook a, its title corrected"
    nb.cells.insert(2, nbformat.v4.new_markdown_cell("A sentence added after the run."))
    nbformat.write(nb, proj / "nbs" / "a.ipynb")
    found, _ = execute_missing(load_units(proj), "quick", [out], out, echo=lambda *a, **k: None)
    assert spy == [["a", "b"], ["b"]]                              # the text changed, not the code: reused
    u = load_units(proj)[0]
    page = _lesson_page(u, u.notebooks[0], found[str(u.notebooks[0])], "quick", {"user": "u", "repo": "r",
                        "branch": "main"}, set())
    text = [c["source"] for c in page["cells"] if c["cell_type"] == "markdown"]
    assert text[0] == "# Notebook a, its title corrected" and "A sentence added after the run." in text
    assert any("6" in "".join(o.get("text", "")) for c in page["cells"] for o in c.get("outputs", []))


def test_stamp_names_profile_params_notebook_and_code(tmp_path, monkeypatch):
    proj = tiny_project(tmp_path / "proj")
    u = load_units(proj)[0]
    a = u.notebooks[0]
    assert run_units([u], "quick", tmp_path / "q", echo=lambda *x, **k: None, notebooks=[a]) == 0
    ex = tmp_path / "q" / u.name / "a.ipynb"
    executed = json.loads(ex.read_text())
    stamp = executed["metadata"]["course_lib"]
    assert stamp["profile"] == "quick" and stamp["params"] == {"steps": 3} and stamp["machine"] and stamp["date"]
    assert find_executed(u, a, "quick", [tmp_path / "q"]) == ex
    assert find_executed(u, a, "full", [tmp_path / "q"]) is None          # another profile
    assert not stamp_matches(executed, a, "quick", {"steps": 4})           # other parameters
    monkeypatch.setattr(run_stamps, "code_version", lambda: "0123456789ab")
    assert find_executed(u, a, "quick", [tmp_path / "q"]) is None          # course_lib's code changed
    monkeypatch.undo()
    del executed["metadata"]["course_lib"]
    ex.write_text(json.dumps(executed))
    assert find_executed(u, a, "quick", [tmp_path / "q"]) is None          # no stamp: not known to be current


def test_lesson_page_names_profile_date_and_machine():
    executed = {"cells": [{"cell_type": "markdown", "source": "# Title", "metadata": {}}],
                "metadata": {"papermill": {"duration": 41.6},
                             "course_lib": {"profile": "full", "date": "2026-12-01 07:50 UTC",
                                            "machine": "Linux, AMD EPYC, 2 CPUs"}}}
    note = execution_note(executed, "full")
    assert note == ("Executed with the full profile (the lesson as meant) on 2026-12-01 07:50 UTC, "
                    "on Linux, AMD EPYC, 2 CPUs, in 42 s.")
    assert execution_note({"metadata": {}}, "quick") == \
        "Executed with the quick profile (the CI check: small runs, not the lesson's figures)."


def test_lesson_page_shows_the_note_under_the_title(tmp_path):
    proj = tiny_project(tmp_path / "proj")
    u = load_units(proj)[0]
    assert run_units([u], "full", tmp_path / "f", echo=lambda *x, **k: None, notebooks=[u.notebooks[0]]) == 0
    ex = tmp_path / "f" / u.name / "a.ipynb"
    cfg = {"git_url": "https://github.com/o/r", "branch": "main", "user": "o", "repo": "r", "title": "t",
           "description": ""}
    page = _lesson_page(u, u.notebooks[0], ex, "full", cfg, set())
    head = "".join(page["cells"][1]["source"])
    stamp = json.loads(ex.read_text())["metadata"]["course_lib"]
    assert "Executed with the full profile (the lesson as meant) on " + stamp["date"] in head
    assert stamp["machine"] in head
