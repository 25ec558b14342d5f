"""Shared test set-up: CPU only, a shared course cache for the run, and the list of notebooks per unit."""
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("COURSE_LIB_DEVICE", "cpu")
# `pytest -n 2` runs two notebooks at once on 2 cores: one thread each beats two threads fighting over the cores
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("COURSE_LIB_HOME", str(ROOT / ".course-test-cache"))
os.environ.setdefault("MPLBACKEND", "Agg")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ["COURSE_LIB_ROOT"] = str(ROOT)


@pytest.fixture
def root():
    return ROOT


@pytest.fixture
def widgets():
    """The `ipywidgets` module (the test is skipped without it). In tests/test_widgets_colab.py's child run
    $COURSE_LIB_EXPECT_IPYWIDGETS names the version it put first on the path: any other one fails the test."""
    W = pytest.importorskip("ipywidgets")
    want = os.environ.get("COURSE_LIB_EXPECT_IPYWIDGETS")
    assert not want or W.__version__ == want, f"ipywidgets {W.__version__} from {W.__file__}, not {want}"
    return W


def pytest_configure(config):
    """`pytest -n 2` hands out tests by work stealing (pytest-xdist's `worksteal`) rather than its default `load`.
    Under `load` each worker is sent its share in advance: the suite ended with one worker running its queue of
    library notebooks one after another for ten minutes while the other sat idle. A `--dist` given on the command
    line is kept."""
    if getattr(config.option, "dist", None) == "load" and not config.getoption("distload", False):
        config.option.dist = "worksteal"
