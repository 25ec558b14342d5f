"""The device probe (course_lib.device_probe): the library's entry points and the lessons on a stand-in accelerator.

The files tests/probe/probe_*.py run in a separate pytest process in which the probe is installed (through
tests/probe_site/sitecustomize.py): there `torch.cuda.is_available()` is True, models moved to 'cuda' hold
`ProbeTensor`s (CPU values, CUDA's device rules), and any operation that mixes them with a CPU tensor fails with
CUDA's "Expected all tensors to be on the same device". The same files run once more as an Apple GPU ('mps': no
float64 either). The lesson notebooks run under the probe in tests/test_notebooks.py.

What the probe cannot prove: that CUDA or MPS kernels exist or agree numerically (every value is computed by the
CPU), memory use, speed, streams and asynchronous errors, and mixed precision (autocast is off without a driver)."""
import os, subprocess, sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROBE_FILES = sorted(str(p) for p in (ROOT / "tests" / "probe").glob("probe_*.py"))


def probe_env(kind: str, **extra) -> dict:
    "The environment of a process that runs under the device probe standing in for `kind` ('cuda' or 'mps')."
    site = str(ROOT / "tests" / "probe_site")
    path = os.pathsep.join([site] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    return dict(os.environ, COURSE_LIB_PROBE=kind, COURSE_LIB_DEVICE=kind, PYTHONPATH=path,
                PYTHONWARNINGS="ignore", **extra)


@pytest.mark.parametrize("kind", ["cuda", "mps"])
def test_entry_points_under_probe(kind, tmp_path):
    "Every tests/probe/probe_*.py test passes with the probe standing in for `kind`."
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "-o",
           "python_files=probe_*.py", "--rootdir", str(ROOT / "tests" / "probe"), *PROBE_FILES]
    r = subprocess.run(cmd, env=probe_env(kind), cwd=str(tmp_path), capture_output=True, text=True, timeout=1500)
    assert r.returncode == 0, f"under the {kind} probe:\n" + (r.stdout + r.stderr)[-8000:]


def test_probe_is_installed_in_the_child(tmp_path):
    code = ("import torch, course_lib.device_probe as p; x = torch.nn.Linear(2, 2).to('cuda').weight; "
            "print(torch.cuda.is_available(), type(x).__name__, p.kind())")
    r = subprocess.run([sys.executable, "-c", code], env=probe_env("cuda"), capture_output=True, text=True,
                       timeout=300)
    assert r.stdout.split() == ["True", "ProbeTensor", "cuda"], r.stdout + r.stderr[-3000:]
