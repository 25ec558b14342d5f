"""A wheel that works alone: build course_lib's wheel, install it (not editable) into a folder of
its own, and run lessons copied alone into a folder outside the repository, as Colab opens them: no
file of the repository may be needed. Offline: the wheel is built without its dependencies, which
the test environment already has. The models come from the shared test cache (COURSE_LIB_HOME)."""
import os, shutil, subprocess, sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from course_lib.course import load_units
from test_notebooks import quick_copy

ROOT = Path(__file__).resolve().parent.parent
# the getting-started lesson, and a later one that loads course models (the DDPM, the digits judge)
LESSONS = ["03_getting_started.ipynb", "13_sampling.ipynb"]
PROBE = """import os, course_lib
from course_lib.course import project_root
print(course_lib.__file__)
print(os.getcwd())
try: print("in a clone:", project_root())
except FileNotFoundError: print("not in a clone")"""


def build_wheel(tmp: Path) -> Path:
    "Build the wheel from a copy of the files an sdist holds (the repository is not touched)."
    src = tmp / "src"
    src.mkdir()
    for f in ["settings.ini", "setup.py", "pyproject.toml", "README.md", "MANIFEST.in"]:
        if (ROOT / f).is_file():
            shutil.copy(ROOT / f, src / f)
    shutil.copytree(ROOT / "course_lib", src / "course_lib",
                    ignore=shutil.ignore_patterns("__pycache__"))
    env = {**os.environ, "PIP_NO_INDEX": "1"}
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps",
                    "--no-build-isolation", "-q", "-w", str(tmp / "dist")],
                   check=True, capture_output=True, env=env)
    (wheel,) = (tmp / "dist").glob("course_lib-*.whl")
    return wheel


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    "The wheel installed, not editable, into a folder of its own."
    tmp = tmp_path_factory.mktemp("wheel")
    site = tmp / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q",
                    "--target", str(site), str(build_wheel(tmp))], check=True, capture_output=True)
    assert (site / "course_lib" / "core" / "basics.py").is_file() and not (site / "units").exists()
    return site


def test_wheel_ships_the_course_models(site):
    "Every model listed in the package's provenance.json is in the installed wheel, byte for byte."
    import hashlib, json
    prov = json.loads((site / "course_lib" / "pretrained" / "provenance.json").read_text())
    for rel, entry in prov["models"].items():
        for name, f in entry["files"].items():
            p = site / "course_lib" / "pretrained" / rel
            p = p.parent / name
            assert hashlib.sha256(p.read_bytes()).hexdigest() == f["sha256"], p


def run_alone(name: str, site: Path, work: Path, monkeypatch) -> list[str]:
    """Run notebook `name` (quick profile) copied alone into `work`, in a kernel that imports
    course_lib from `site` and knows nothing of the repository; returns the text each code cell
    printed, the probe's last."""
    assert ROOT not in work.resolve().parents
    unit = next(u for u in load_units(ROOT) if any(nb.name == name for nb in u.notebooks))
    nb = nbformat.read(quick_copy(unit, ROOT / "nbs" / name, work), as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell(PROBE))
    monkeypatch.setenv("PYTHONPATH", str(site))
    monkeypatch.delenv("COURSE_LIB_ROOT", raising=False)
    monkeypatch.chdir(work)
    NotebookClient(nb, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(work)}}).execute()
    assert [p.name for p in work.iterdir() if p.suffix == ".ipynb"] == [name]
    code = [c for c in nb.cells if c.cell_type == "code"]
    return ["".join(o.get("text", "") for o in c.get("outputs", [])) for c in code]


def check_probe(printed: str, site: Path, work: Path, name: str):
    lines = printed.splitlines()
    want = str(site / "course_lib" / "__init__.py")
    assert lines[0] == want, f"{name} imported course_lib from {lines[0]}"
    assert lines[1:] == [str(work), "not in a clone"], f"{name}: {lines[1:]}"


@pytest.mark.parametrize("name", LESSONS)
def test_wheel_runs_lesson_outside_the_repository(name, site, tmp_path, monkeypatch):
    out = run_alone(name, site, tmp_path, monkeypatch)
    check_probe(out[-1], site, tmp_path, name)


@pytest.mark.parametrize("name", ["90_cli.ipynb", "91_site.ipynb", "92_contrib.ipynb"])
def test_maintainer_notebook_skips_repository_cells_outside_a_clone(name, site, tmp_path,
                                                                    monkeypatch):
    out = run_alone(name, site, tmp_path, monkeypatch)
    check_probe(out[-1], site, tmp_path, name)
    said = "".join(out[:-1])
    assert "cannot find the course repository" in said, f"{name} did not say why it skipped cells"
    assert "skipped" in said or name == "90_cli.ipynb", f"{name} printed no 'skipped' line"
