"""The device probe (course_lib.core.device_probe): the library's entry points and the lessons on a stand-in accelerator.

The files tests/probe/probe_*.py run in a separate pytest process in which the probe is installed (through
tests/probe_site/sitecustomize.py): there `torch.cuda.is_available()` is True, models moved to 'cuda' hold
`ProbeTensor`s (CPU values, CUDA's device rules), and any operation that mixes them with a CPU tensor fails with
CUDA's "Expected all tensors to be on the same device". The same files run once more as an Apple GPU ('mps': no
float64 either). The lesson notebooks run under the probe in tests/test_notebooks.py.

What the probe cannot prove: that CUDA or MPS kernels exist or agree numerically (every value is computed by the
CPU), memory use, speed, streams and asynchronous errors, and mixed precision (autocast is off without a driver)."""
import json, os, subprocess, sys
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
    code = ("import torch, course_lib.core.device_probe as p; x = torch.nn.Linear(2, 2).to('cuda').weight; "
            "print(torch.cuda.is_available(), type(x).__name__, p.kind())")
    r = subprocess.run([sys.executable, "-c", code], env=probe_env("cuda"), capture_output=True, text=True,
                       timeout=300)
    assert r.stdout.split() == ["True", "ProbeTensor", "cuda"], r.stdout + r.stderr[-3000:]


CONVERSIONS = r'''
import torch
dev = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
emb, head = torch.nn.Embedding(5, 4), torch.nn.Linear(4, 5, bias=False)
head.weight = emb.weight
tied = torch.nn.ModuleList([emb, head])
params = [*m.parameters(), emb.weight]
values = [p.detach().clone() for p in params]
m.to(dev), tied.to(dev)
keep = [m(torch.randn(2, 4, device=dev)), head(emb(torch.tensor([1, 2], device=dev)))]
m(torch.randn(2, 4, device=dev)).sum().backward()
for step in ("double", "cpu", "to dev", "float64 cpu"):
    {"double": lambda: (m.double(), tied.double()), "cpu": lambda: (m.to("cpu"), tied.to("cpu")),
     "to dev": lambda: (m.to(dev), tied.to(dev)),
     "float64 cpu": lambda: (m.to("cpu", torch.float64), tied.cpu())}[step]()
    where = "cpu" if "cpu" in step else dev
    assert m[0].weight.device.type == tied[0].weight.device.type == where, step
    keep.append(m(torch.randn(2, 4, device=where, dtype=torch.float64)))   # the graph stays alive
    now = [*m.parameters(), emb.weight]
    assert len(now) == len(params) and all(a is b for a, b in zip(now, params)), f"{step}: new Parameters"
    assert tied[0].weight is tied[1].weight, f"{step}: tied weights came apart"
    assert m[0].weight.grad is not None and m[0].weight.grad.device == m[0].weight.device, step
assert all(torch.equal(p.detach().cpu().float(), v) for p, v in zip(params, values))
assert not torch.__future__.get_swap_module_params_on_conversion()
print("ok", dev, m[0].weight.dtype, m[0].weight.device)
'''


@pytest.mark.parametrize("probe", [None, "cuda"])
def test_conversions_with_a_live_graph(probe, tmp_path):
    """`.double()`, `.to('cpu')`, `.to('cuda')` after a forward pass whose output is still held work under the
    probe as on a GPU: Parameters keep their identity (tied weights stay tied) and their gradients follow, and
    torch's process-wide swap flag stays off (it made `Module._apply` refuse: "Couldn't swap Linear.weight")."""
    env = probe_env(probe) if probe else dict(os.environ, PYTHONWARNINGS="ignore")
    r = subprocess.run([sys.executable, "-c", CONVERSIONS], env=env, cwd=str(tmp_path), capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.startswith("ok"), r.stdout + r.stderr[-3000:]
    if probe: assert r.stdout.split()[1:] == ["cuda", "torch.float64", "cpu"], r.stdout


def test_probe_log_in_a_folder_not_made_yet(tmp_path):
    "COURSE_LIB_PROBE_LOG in a folder that does not exist yet (doctor calls it usable): the log makes it."
    log = tmp_path / "logs" / "probe.json"
    code = "import torch; torch.ones(2, device='cuda').sum(); print('ran')"
    r = subprocess.run([sys.executable, "-c", code], env=probe_env("cuda", COURSE_LIB_PROBE_LOG=str(log)),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.split() == ["ran"], r.stdout + r.stderr[-3000:]
    assert json.loads(log.read_text())["ops_on_device"] >= 1
