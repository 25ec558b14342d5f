"""Colab and a clean install: the runtime requirements leave Colab's pinned packages alone, the
extras split the maintainer toolchain off, every lesson's install cell installs the runtime only,
and every lesson opens in Colab from its badge. Static checks (no network):
tools/check_colab_constraints.sh runs pip's resolver on the same pins."""
import configparser, json, re, shutil, subprocess, sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from course_lib.cli import main
from course_lib.course import MissingExtra, lesson_notebook, run_notebook, site_settings

ROOT = Path(__file__).resolve().parent.parent
CFG = configparser.ConfigParser(delimiters=["="], interpolation=None)
CFG.read(ROOT / "settings.ini", encoding="utf-8")
INI = CFG["DEFAULT"]
# the kernel, server and front-end packages a lesson's install must never bring or upgrade on Colab
JUPYTER = {"ipykernel", "ipython", "jupyter-client", "jupyter-server", "jupyter-core", "jupyterlab",
           "notebook", "traitlets", "nbformat", "nbclient", "papermill", "nbdev", "execnb", "ghapi",
           "fastcore"}
LESSONS = sorted([*ROOT.glob("nbs/03_*.ipynb"), *ROOT.glob("nbs/[1-6][0-9]_*.ipynb")])


def reqs(key: str) -> dict[str, Requirement]:
    return {canonicalize_name(r.name): r for r in map(Requirement, INI.get(key, "").split())}


def colab_pins() -> dict[str, Version]:
    pins = {}
    for line in (ROOT / "colab-constraints.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            r = Requirement(line)
            (spec,) = r.specifier
            assert spec.operator == "==", f"colab-constraints.txt: {line!r} is not an exact pin"
            pins[canonicalize_name(r.name)] = Version(spec.version)
    return pins


def test_constraints_pin_colab_kernel_and_torch():
    need = {"ipykernel", "notebook", "jupyter-client", "jupyter-server", "ipython", "traitlets",
            "torch", "torchvision"}
    missing = sorted(need - set(colab_pins()))
    assert not missing, f"colab-constraints.txt lacks {missing}"


def test_runtime_names_no_jupyter_package():
    named = sorted(JUPYTER & set(reqs("requirements")))
    assert not named, f"the runtime requirements name {named}: they belong in an extra"


def test_runtime_admits_every_colab_pin():
    runtime = reqs("requirements")
    shut_out = [f"{n}: requirement {runtime[n]} rejects Colab's {v}"
                for n, v in colab_pins().items()
                if n in runtime and not runtime[n].specifier.contains(v, prereleases=True)]
    assert not shut_out, "; ".join(shut_out)
    assert {"torch", "torchvision", "numpy"} <= set(runtime)     # so the check above looked at them


def test_admits_check_can_fail():
    # the check above on a requirement that would upgrade Colab's kernel: it must reject the pin
    assert not Requirement("ipykernel>=6.29").specifier.contains(colab_pins()["ipykernel"])


def test_setup_py_extras(tmp_path):
    subprocess.run([sys.executable, "setup.py", "-q", "egg_info", "--egg-base", str(tmp_path)],
                   cwd=ROOT, check=True, capture_output=True)
    extras, section = {}, ""
    for line in (tmp_path / "course_lib.egg-info" / "requires.txt").read_text().splitlines():
        if line.startswith("["):
            section = line.strip("[]")
        elif line.strip():
            extras.setdefault(section, set()).add(canonicalize_name(Requirement(line).name))
    assert not JUPYTER & extras[""], f"runtime install brings {sorted(JUPYTER & extras[''])}"
    assert {"torch", "diffusers", "timm", "transformers", "zstandard"} <= extras[""]
    assert {"papermill", "nbformat", "nbdev", "ipykernel"} <= extras["course"]
    assert {"sphinx", "myst-nb", "furo", "nbdev"} <= extras["site"]
    assert extras["course"] | extras["site"] | {"pytest", "nbval", "lm-eval"} <= extras["dev"]
    # nbdev 2 keeps its pins wherever it is installed
    for key in ("course_requirements", "site_requirements"):
        pins = {n: str(r.specifier) for n, r in reqs(key).items()}
        assert "<3" in pins["nbdev"] and "<2" in pins["fastcore"], (key, pins)
        assert "<0.2" in pins["execnb"] and "<1.1" in pins["ghapi"], (key, pins)


def install_cell(nb: Path) -> str:
    cells = json.loads(nb.read_text())["cells"]
    src = ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]
    hits = [s for s in src if re.search(r"^\s*[%!]\s*pip\s+install", s, re.M)]
    assert len(hits) == 1, f"{nb.name}: {len(hits)} install cells"
    return hits[0]


@pytest.mark.parametrize("nb", LESSONS, ids=lambda p: p.stem)
def test_install_cell_installs_runtime_only(nb):
    lines = [ln.strip() for ln in install_cell(nb).splitlines() if "pip" in ln and "install" in ln]
    assert lines == [f"%pip install -q git+{INI['git_url']}"], f"{nb.name}: {lines}"


def test_install_cell_check_rejects_an_upgrade(tmp_path):
    nb = tmp_path / "x.ipynb"
    src = f"%pip install -q -U git+{INI['git_url']}#egg=course_lib[dev]"
    cell = {"cell_type": "code", "source": src}
    nb.write_text(json.dumps({"cells": [cell]}))
    with pytest.raises(AssertionError):
        test_install_cell_installs_runtime_only(nb)


BADGE = re.compile(r"\[!\[Open [Ii]n Colab\]"
                   r"\(https://colab\.research\.google\.com/assets/colab-badge\.svg\)\]\(([^)]*)\)")


@pytest.mark.parametrize("nb", LESSONS, ids=lambda p: p.stem)
def test_lesson_has_colab_badge(nb):
    first = next(c for c in json.loads(nb.read_text())["cells"] if c["cell_type"] == "markdown")
    links = BADGE.findall("".join(first["source"]))
    want = (f"https://colab.research.google.com/github/{INI['user']}/{INI['repo']}"
            f"/blob/{INI['branch']}/nbs/{nb.name}")
    assert links == [want], f"{nb.name}: badge links {links}, want [{want}]"


def test_lessons_cover_every_unit():
    assert len(LESSONS) >= 20 and {p.name[0] for p in LESSONS} == set("0123456")


def test_site_page_shows_one_badge():
    nb = ROOT / "nbs" / "13_sampling.ipynb"
    page = lesson_notebook(json.loads(nb.read_text()), nb.name, site_settings(ROOT))
    md = "\n".join(c["source"] for c in page["cells"] if c["cell_type"] == "markdown")
    assert md.count("colab.research.google.com/github/") == 1, md[:800]
    assert "colab.research.google.com/assets" not in md     # the offline site has its own image


def test_missing_extra_names_the_install(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "papermill", None)      # as if only the runtime were installed
    want = r'papermill is not installed.*pip install "course_lib\[course\]"'
    with pytest.raises(MissingExtra, match=want):
        run_notebook(ROOT / "nbs" / "03_getting_started.ipynb", tmp_path / "out.ipynb")
    assert main(["run", "start", "--profile", "quick", "--out", str(tmp_path / "runs")]) == 2
    err = capsys.readouterr().err
    assert "course run: error: papermill is not installed" in err, err
    assert 'pip install "course_lib[course]"' in err, err


def test_scaffolded_lesson_has_its_badge(tmp_path):
    from course_lib.course import load_unit, load_units
    from course_lib.course import scaffold
    (tmp_path / "nbs").mkdir()
    shutil.copy(ROOT / "settings.ini", tmp_path / "settings.ini")
    shutil.copytree(ROOT / "templates", tmp_path / "templates")
    unit = next(u for u in load_units(ROOT) if u.number == 1)
    shutil.copytree(unit.path, tmp_path / "units" / unit.name)
    unit = load_unit(tmp_path / "units" / unit.name, nbs=ROOT / "nbs")
    nb = scaffold(tmp_path, unit, "14_new_lesson", "new_lesson")
    assert "__COLAB__" not in nb.read_text()
    test_lesson_has_colab_badge(nb)
