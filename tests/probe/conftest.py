"""Set-up of the probe tests: they run only inside a process where the device probe is installed."""
import os

import pytest

os.environ.setdefault("COURSE_LIB_HOME", os.path.join(os.path.dirname(__file__), "..", "..", ".course-test-cache"))
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MPLBACKEND", "Agg")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def pytest_collection_modifyitems(config, items):
    "A probe_*.py test collected in a process without the probe (a typo'd command line) is an error, not a pass."
    from course_lib.core import device_probe
    probe_items = [i for i in items if i.path.name.startswith("probe_")]
    if probe_items and device_probe.kind() is None:
        raise pytest.UsageError("tests/probe/probe_*.py run under the device probe only: use "
                                "tests/test_device_probe.py")
