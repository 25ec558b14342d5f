"""Set-up of the probe tests: they run only inside a process where the device probe is installed."""
import os

import pytest

os.environ.setdefault("COURSE_LIB_HOME", os.path.join(os.path.dirname(__file__), "..", "..", ".course-test-cache"))
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MPLBACKEND", "Agg")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def pytest_collection_modifyitems(config, items):
    from course_lib import device_probe
    if device_probe.kind() is None:
        raise pytest.UsageError("tests/probe runs under the device probe only: use tests/test_device_probe.py")
