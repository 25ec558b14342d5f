"""Installs the device probe (course_lib.core.device_probe) in every Python process started with this folder on
PYTHONPATH and COURSE_LIB_PROBE set ('cuda' or 'mps'): the notebook kernels of tests/test_device_probe.py."""
import os

if os.environ.get("COURSE_LIB_PROBE"):
    from course_lib.core import install
    install(os.environ["COURSE_LIB_PROBE"], bf16=os.environ.get("COURSE_LIB_PROBE_BF16", "emulated"))
