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
