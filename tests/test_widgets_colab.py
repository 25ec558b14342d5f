"""The dashboards' widget tests again under Colab's ipywidgets 7.7.1 (colab-constraints.txt): a child pytest
with tests/colab-widgets.txt's packages first on PYTHONPATH, which asserts the version it imports.

.ci/run installs them into $COURSE_LIB_HOME/colab-widgets; run locally, the test installs them there itself
(pip from the package registry, --no-deps, a few seconds), and skips, saying why, when pip cannot (fails
under CI=true, where .ci/run should have installed them)."""
import os, re, shutil, subprocess, sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
REQUIREMENTS = ROOT / "tests" / "colab-widgets.txt"
# every test that builds a dashboard's widgets (they take the `widgets` fixture of conftest.py)
WIDGET_TESTS = ["tests/test_flux_lora.py::test_dashboard_widgets",
                "tests/test_flux_lora.py::test_dashboard_upload_tabs_and_presets_as_a_user",
                "tests/test_flux_lora.py::test_uploaded_files_reads_ipywidgets_7_and_8",
                "tests/test_lora.py::test_dashboard_widgets_start_button"]


def pins(path):
    lines = (ln.split("#")[0].strip() for ln in path.read_text().splitlines())
    return dict(ln.split("==") for ln in lines if ln)


def colab_widgets_dir() -> Path:
    """The folder holding tests/colab-widgets.txt's packages (its copy of that file says which), installed
    now when missing or stale; skips the test when pip cannot install them (fails under CI=true)."""
    target = Path(os.environ["COURSE_LIB_HOME"]) / "colab-widgets"
    stamp = target / "requirements.txt"
    if stamp.is_file() and stamp.read_text() == REQUIREMENTS.read_text():
        return target
    shutil.rmtree(target, ignore_errors=True)
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--disable-pip-version-check"]
    r = subprocess.run([*pip, "--target", str(target), "-r", str(REQUIREMENTS)], capture_output=True, text=True)
    if r.returncode != 0:
        shutil.rmtree(target, ignore_errors=True)
        why = f"could not install Colab's ipywidgets into {target} (pip: {r.stderr.strip()[-300:]})"
        if os.environ.get("CI") == "true": pytest.fail(f"{why}: .ci/run should have installed it")
        pytest.skip(f"{why}; .ci/run installs it there")
    shutil.copy(REQUIREMENTS, stamp)
    return target


def test_colab_widgets_pin_is_colabs():
    assert pins(REQUIREMENTS)["ipywidgets"] == pins(ROOT / "colab-constraints.txt")["ipywidgets"]


def test_widget_tests_under_colabs_ipywidgets():
    want = pins(REQUIREMENTS)["ipywidgets"]
    target = colab_widgets_dir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}   # not xdist's worker
    env.update(COURSE_LIB_EXPECT_IPYWIDGETS=want,
               PYTHONPATH=os.pathsep.join(p for p in (str(target), os.environ.get("PYTHONPATH")) if p))
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
                        "-W", "ignore::DeprecationWarning", *WIDGET_TESTS],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    tail = (r.stdout + r.stderr)[-4000:]
    assert r.returncode == 0, f"under ipywidgets {want}:\n{tail}"
    passed = re.search(r"(\d+) passed", r.stdout)
    assert passed and int(passed.group(1)) == len(WIDGET_TESTS) and "skipped" not in r.stdout, tail
