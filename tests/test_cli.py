"""The `course` command: listing, running a unit (success and a failing cell), bad arguments, doctor."""
import json, os, subprocess, sys
from pathlib import Path

import nbformat
import pytest

from course_lib.cli import main, keep_checked_outputs
from course_lib.course import load_units, find_unit, Unit

ROOT = Path(__file__).resolve().parent.parent


def course(*args, env=None, cwd=None):
    return subprocess.run([sys.executable, "-c", "import sys; from course_lib.cli.course import main; sys.exit(main())", *args],
                          capture_output=True, text=True, env=env or os.environ.copy(), cwd=cwd or ROOT, timeout=600)


def make_project(tmp: Path, cells_b: list[str]) -> Path:
    "A tiny course: one unit with notebooks a (records a figure) and b (given cells)."
    (tmp / "nbs").mkdir(parents=True); (tmp / "units" / "07_tiny").mkdir(parents=True)
    def nb(path, cells):
        n = nbformat.v4.new_notebook()
        n.metadata["kernelspec"] = {"name": "python3", "language": "python", "display_name": "Python 3"}
        p = nbformat.v4.new_code_cell("steps = 1000"); p.metadata["tags"] = ["parameters"]
        n.cells = [p] + [nbformat.v4.new_code_cell(c) for c in cells]
        nbformat.write(n, path)
    nb(tmp / "nbs" / "a.ipynb", ["from course_lib.core.basics import record\nrecord('steps_seen', steps)"])
    nb(tmp / "nbs" / "b.ipynb", cells_b)
    (tmp / "units" / "07_tiny" / "unit.toml").write_text(
        '[unit]\ntitle = "Tiny"\nnotebooks = ["a.ipynb", "b.ipynb"]\n[profiles.quick]\nsteps = 3\n[profiles.full]\nsteps = 30\n')
    return tmp


def test_list_shows_units_and_notebooks():
    r = course("list")
    assert r.returncode == 0, r.stderr
    for u in load_units(ROOT):
        assert u.slug in r.stdout
        for nb in u.notebooks: assert nb.name in r.stdout


def test_unknown_unit_exits_2_with_valid_list():
    r = course("run", "no-such-unit")
    assert r.returncode == 2
    assert "unknown unit 'no-such-unit'" in r.stderr and "ddpm" in r.stderr and "all" in r.stderr


def test_unknown_profile_exits_2():
    r = course("run", "start", "--profile", "medium")
    assert r.returncode == 2 and "invalid choice: 'medium'" in r.stderr and "quick" in r.stderr


def test_no_command_and_unknown_command_exit_2():
    assert course().returncode == 2
    r = course("frobnicate")
    assert r.returncode == 2 and "invalid choice" in r.stderr


def test_find_unit_by_slug_number_and_folder():
    units = load_units(ROOT)
    assert find_unit("start", units).number == 0
    assert find_unit("0", units).slug == find_unit("00_start", units).slug == "start"
    with pytest.raises(KeyError, match="valid units"): find_unit("nope", units)


def test_doctor():
    r = course("doctor")
    assert r.returncode == 0, r.stderr
    for key in ["torch", "device", "cache_dir", "network", "bf16", "warnings", "ipywidgets", "diffusers"]:
        assert key in r.stdout


def test_doctor_tells_emulated_bf16_and_old_ipywidgets():
    """Under the device probe (a T4: bf16 only emulated) doctor says 'emulated'. The dashboards work on Colab's
    ipywidgets 7.7.1 (tests/test_widgets_colab.py) and on 8: only older ones get a warning."""
    from course_lib.cli import version_warnings
    from test_device_probe import probe_env
    r = course("doctor", env=probe_env("cuda"))
    assert r.returncode == 0, r.stderr
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("bf16"))
    assert line.split()[1] == "emulated", r.stdout
    assert any("ipywidgets 7.4.2" in w for w in version_warnings({"ipywidgets": "7.4.2"}))
    for ok in ("7.7.1", "8.1.5", "not installed"): assert version_warnings({"ipywidgets": ok}) == [], ok



def _bad_paths(tmp: Path) -> dict:
    "Each path variable set to the wrong kind of thing: a file for a folder, a folder for a file, nothing."
    a_file = tmp / "a_file"; a_file.write_text("x")
    (tmp / "a_folder").mkdir()
    return {"COURSE_LIB_HOME": str(a_file), "COURSE_LIB_ARTIFACTS": str(a_file / "sub"),
            "COURSE_LIB_RESULTS": str(tmp / "a_folder"), "COURSE_LIB_PROBE_LOG": str(a_file / "log.json"),
            "COURSE_LIB_INCEPTION_WEIGHTS": str(tmp / "missing.pth"), "COURSE_LIB_ROOT": str(tmp / "a_folder"),
            "COURSE_LIB_CHROMIUM": str(a_file)}


def test_doctor_warns_about_the_paths_the_course_uses(tmp_path):
    """COURSE_LIB_HOME naming a file (every loader then fails with CacheNotWritable) and the other path variables
    set to the wrong kind of thing: doctor warns about each, naming the variable, the path, what is wrong and what
    to do, one warning a line (exit 0, as for its other warnings)."""
    bad = _bad_paths(tmp_path)
    r = course("doctor", env=dict(os.environ, **bad))
    assert r.returncode == 0, r.stderr
    warnings = [ln.strip() for ln in r.stdout.split("warnings", 1)[1].split("cache_dir")[0].splitlines()]
    for var, path in bad.items():
        hit = [w for w in warnings if w.startswith(f"{var}={path}:")]
        assert len(hit) == 1 and f"Set {var} to" in hit[0], (var, r.stdout)
    said = {w.split("=", 1)[0]: w for w in warnings if w}
    assert "is a file, not a folder" in said["COURSE_LIB_HOME"] and "CacheNotWritable" in said["COURSE_LIB_HOME"]
    assert f"{tmp_path / 'a_file'} is a file, not a folder" in said["COURSE_LIB_ARTIFACTS"]
    assert "is a folder, not a file" in said["COURSE_LIB_RESULTS"]
    assert "does not exist" in said["COURSE_LIB_INCEPTION_WEIGHTS"]
    assert "no units/ and nbs/" in said["COURSE_LIB_ROOT"] and "not executable" in said["COURSE_LIB_CHROMIUM"]


def test_path_problems_none_when_the_paths_are_right(tmp_path):
    "Right paths (existing or creatable where the course writes) give no warning; XDG_CACHE_HOME is checked too."
    from course_lib.core import path_problems
    exe = tmp_path / "chromium"; exe.write_text("#!/bin/sh\n"); exe.chmod(0o755)
    (tmp_path / "w.pth").write_bytes(b"PK")
    good = {"COURSE_LIB_HOME": str(tmp_path / "new" / "cache"), "COURSE_LIB_ARTIFACTS": str(tmp_path),
            "COURSE_LIB_RESULTS": str(tmp_path / "r" / "results.json"), "COURSE_LIB_PROBE_LOG": str(tmp_path / "p.json"),
            "COURSE_LIB_INCEPTION_WEIGHTS": str(tmp_path / "w.pth"), "COURSE_LIB_ROOT": str(ROOT),
            "COURSE_LIB_CHROMIUM": str(exe)}
    before = sorted(tmp_path.rglob("*"))
    assert path_problems(good) == []
    assert sorted(tmp_path.rglob("*")) == before, "the check leaves nothing behind (it creates no folder)"
    (tmp_path / "xdg").write_text("a file")
    said = path_problems({"XDG_CACHE_HOME": str(tmp_path / "xdg")})
    assert len(said) == 1 and said[0].startswith(f"XDG_CACHE_HOME={tmp_path / 'xdg'}:") and "a file" in said[0]
    if os.geteuid() != 0:          # root writes anywhere: a read-only folder is only checked as a user
        ro = tmp_path / "ro"; ro.mkdir(); ro.chmod(0o555)
        assert "not writable" in path_problems({"COURSE_LIB_HOME": str(ro)})[0]


def test_run_writes_results_and_injects_profile(tmp_path):
    proj = make_project(tmp_path / "proj", ["x = steps * 2\nassert x == 6, x"])
    env = dict(os.environ, COURSE_LIB_ROOT=str(proj))
    out = tmp_path / "out"
    r = course("run", "tiny", "--profile", "quick", "--out", str(out), env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads((out / "results.json").read_text())
    assert res == {"a": {"steps_seen": 3}}
    assert (out / "07_tiny" / "a.ipynb").is_file() and (out / "07_tiny" / "b.ipynb").is_file()
    assert "steps_seen" in r.stdout and "[2/2]" in r.stdout
    times = json.loads((out / "timings.json").read_text())
    assert times["a"]["status"] == "ok" and times["a"]["params"] == {"steps": 3}


def test_run_stops_on_failing_cell_and_keeps_results(tmp_path):
    proj = make_project(tmp_path / "proj", ["y = 1", "raise ValueError('boom in b')", "z = 2"])
    env = dict(os.environ, COURSE_LIB_ROOT=str(proj))
    out = tmp_path / "out"
    r = course("run", "7", "--out", str(out), env=env)
    assert r.returncode == 1
    assert "FAILED: 07_tiny/b.ipynb, cell 2: ValueError: boom in b" in r.stdout
    assert json.loads((out / "results.json").read_text()) == {"a": {"steps_seen": 3}}
    assert (out / "07_tiny" / "b.ipynb").is_file()   # the executed notebook with its traceback


def test_bad_unit_toml_is_reported(tmp_path):
    proj = make_project(tmp_path / "proj", ["pass"])
    (proj / "units" / "07_tiny" / "unit.toml").write_text('[unit]\nnotebooks = ["missing.ipynb"]\n')
    r = course("list", env=dict(os.environ, COURSE_LIB_ROOT=str(proj)))
    assert r.returncode == 2 and "missing.ipynb" in r.stderr


def test_keep_checked_outputs_strips_images():
    nb = nbformat.v4.new_notebook()
    checked = nbformat.v4.new_code_cell("# NBVAL_CHECK_OUTPUT\nprint(1)")
    checked.outputs = [nbformat.v4.new_output("stream", name="stdout", text="1\n"),
                       nbformat.v4.new_output("display_data", data={"image/png": "AAAA", "text/plain": "<Figure>"})]
    plain = nbformat.v4.new_code_cell("2")
    plain.outputs = [nbformat.v4.new_output("execute_result", data={"text/plain": "2"}, execution_count=3)]
    nb.cells = [checked, plain]
    keep_checked_outputs(nb)
    assert [o.output_type for o in nb.cells[0].outputs] == ["stream", "display_data"]
    assert set(nb.cells[0].outputs[1].data) == {"text/plain"}
    assert nb.cells[1].outputs == []


def test_the_course_command_loads_only_what_its_subcommand_needs():
    """`course` imports `course_lib.cli` at every call; its names load on first use, so `course --help` and `course
    doctor` do not import Gradio, diffusers, torch-fidelity or datatrove (which cost seconds a call), and each public
    name still resolves to the function of its module."""
    import subprocess, sys
    code = ("import sys, course_lib.cli.course\n"
            "heavy = [m for m in ('gradio', 'diffusers', 'torch_fidelity', 'datatrove', 'timm') if m in sys.modules]\n"
            "assert not heavy, heavy\n"
            "import course_lib.cli as cli\n"
            "for n in cli.__all__: assert getattr(cli, n) is getattr(sys.modules[getattr(cli, n).__module__ if callable("
            "getattr(cli, n)) else 'course_lib.cli.' + cli._LAZY[n]], n), n\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
