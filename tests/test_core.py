"""Core: seeds, device choice, atomic checkpoints (a killed write leaves nothing under the final name), results."""
import contextlib, os, re, signal, subprocess, sys, time

import numpy as np
import pytest
import torch

from course_lib.core import (
    seed_everything, get_device, cache_dir, atomic_write, save_checkpoint, load_checkpoint, record,
    read_results)


def test_seed_everything_reproducible():
    g = seed_everything(3); a = (torch.randn(4, generator=g), np.random.rand(), torch.rand(2))
    g = seed_everything(3); b = (torch.randn(4, generator=g), np.random.rand(), torch.rand(2))
    assert torch.equal(a[0], b[0]) and a[1] == b[1] and torch.equal(a[2], b[2])
    with pytest.raises(TypeError, match="seed must be an int"): seed_everything(1.5)


def test_get_device_env_override(monkeypatch):
    monkeypatch.setenv("COURSE_LIB_DEVICE", "cpu")
    assert get_device() == torch.device("cpu")
    with pytest.raises(ValueError, match="unknown device"): get_device("tpu-ish")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"): get_device("cuda")


def test_cache_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv("COURSE_LIB_HOME", str(tmp_path / "h"))
    assert cache_dir("models") == tmp_path / "h" / "models" and (tmp_path / "h" / "models").is_dir()


def test_checkpoint_round_trip_with_optimizer(tmp_path):
    m = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    opt = torch.optim.Adam(m.parameters())
    m(torch.randn(5, 3)).sum().backward(); opt.step()
    p = save_checkpoint(tmp_path / "c.safetensors", {"model": m.state_dict(), "optimizer": opt.state_dict(),
                                                     "step": 7, "losses": [0.5, 0.25], "cfg": {"lr": 1e-3, "name": "x"}},
                        metadata={"arch": "mlp"})
    state, meta = load_checkpoint(p)
    assert state["step"] == 7 and state["losses"] == [0.5, 0.25] and state["cfg"] == {"lr": 1e-3, "name": "x"}
    assert meta["arch"] == "mlp"
    opt2 = torch.optim.Adam(m.parameters()); opt2.load_state_dict(state["optimizer"])
    assert all(isinstance(k, int) for k in state["optimizer"]["state"])
    # the file is real safetensors: readable by the safetensors library alone
    from safetensors.torch import load_file
    assert any(k.startswith("model.") for k in load_file(str(p)))


def test_load_checkpoint_errors(tmp_path):
    with pytest.raises(FileNotFoundError): load_checkpoint(tmp_path / "none.safetensors")
    (tmp_path / "bad.safetensors").write_bytes(b"not safetensors at all")
    with pytest.raises(ValueError, match="not a readable safetensors"): load_checkpoint(tmp_path / "bad.safetensors")
    with pytest.raises(TypeError, match="cannot store"): save_checkpoint(tmp_path / "x.safetensors", {"f": object()})


# A writer in a fresh interpreter (course_lib.core.basics imports without torch: it starts in ~0.3 s).
# "atomic" writes through atomic_write; "direct" is a deliberately NON-atomic writer (open the final
# path and write), run to prove that the test below catches a write that is not atomic.
_WRITER = """
import sys, time
from course_lib.core import atomic_write
path, how, pause = sys.argv[1], sys.argv[2], float(sys.argv[3])
with (atomic_write(path, "wb") if how == "atomic" else open(path, "wb")) as f:
    for _ in range(6000):
        f.write(b"x" * 10_000)
        f.flush()
        time.sleep(pause)
"""


def _start_writer(target, how, pause=0.01):
    "Start a writer and return it once some of its bytes are on disk (it is mid-write), with the file."
    before = {f for f in target.parent.iterdir() if f != target}   # leftovers of earlier writers
    p = subprocess.Popen([sys.executable, "-c", _WRITER, str(target), how, str(pause)])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for f in set(target.parent.iterdir()) - before:
            with contextlib.suppress(FileNotFoundError), open(f, "rb") as fh:
                if fh.read(1) == b"x": return p, f
        if p.poll() is not None: raise AssertionError(f"writer exited early with {p.returncode}")
        time.sleep(0.005)
    p.kill()
    raise AssertionError(f"no bytes written in {target.parent} after 30 s")


def _kill(p):
    os.kill(p.pid, signal.SIGKILL)
    p.wait()


@pytest.mark.parametrize("how", ["atomic", "direct"])
def test_killed_write_leaves_old_file(tmp_path, how):
    target = tmp_path / "model.safetensors"
    target.write_bytes(b"old complete file")
    p, written = _start_writer(target, how)
    _kill(p)                                   # SIGKILL while the writer is writing
    assert p.returncode == -signal.SIGKILL
    if how == "direct":                        # the machinery detects a non-atomic write...
        assert written == target and target.read_bytes()[:1] == b"x"
    else:                                      # ...and atomic_write keeps the old file
        assert written != target and written.stat().st_size > 0
        assert target.read_bytes() == b"old complete file"


def test_atomic_write_removes_stale_tmp_files(tmp_path):
    target, other = tmp_path / "m.bin", tmp_path / "m.bin.1"
    target.write_bytes(b"old")
    live, live_tmp = _start_writer(target, "atomic", pause=60)   # a writer still running
    try:
        p, dead_tmp = _start_writer(target, "atomic")
        _kill(p)                               # a killed writer leaves its temporary file...
        p, other_tmp = _start_writer(other, "atomic")
        _kill(p)                               # (one of another target, whose name starts alike)
        assert dead_tmp.exists() and other_tmp.exists() and live_tmp.exists()
        with atomic_write(target, "wb") as f: f.write(b"new")
        assert not dead_tmp.exists()           # ...which the next write to the target removes,
        assert live_tmp.exists() and other_tmp.exists()     # but not a running writer's file
        assert target.read_bytes() == b"new"
        os.utime(live_tmp, (time.time() - 2 * 86400,) * 2)  # untouched for two days: stale
        with atomic_write(target, "wb") as f: f.write(b"newer")
        assert not live_tmp.exists() and other_tmp.exists()
    finally:
        _kill(live)
    names = sorted(f.name for f in tmp_path.iterdir())
    assert names == sorted([target.name, other_tmp.name]), names


def test_record_and_read(monkeypatch, tmp_path):
    monkeypatch.setenv("COURSE_LIB_RESULTS", str(tmp_path / "r.json"))
    monkeypatch.setenv("COURSE_LIB_NOTEBOOK", "nb1")
    record("acc", np.float32(0.5)); record("t", torch.tensor(2.0)); record("acc2", 0.9, notebook="nb2")
    assert read_results() == {"nb1": {"acc": 0.5, "t": 2.0}, "nb2": {"acc2": 0.9}}
    with pytest.raises(TypeError, match="not JSON"): record("x", object())
    with pytest.raises(ValueError): record("", 1)


# ---- worker processes ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("platform, methods, want", [
    ("linux", ["fork", "spawn", "forkserver"], "fork"), ("linux", ("spawn", "forkserver"), "forkserver"),
    ("darwin", ["spawn", "fork", "forkserver"], "forkserver"), ("win32", ["spawn"], "spawn"),
    ("linux", {"spawn"}, "spawn")])
def test_start_method_forks_on_linux_only(monkeypatch, platform, methods, want):
    from course_lib.core import start_method
    monkeypatch.setattr(sys, "platform", platform)
    assert start_method(methods) == want


@pytest.mark.parametrize("methods, err, says", [
    ("forkserver", TypeError, "'forkserver'"), (0, TypeError, "got 0"), ([1], TypeError, "[1]"),
    ([], ValueError, "[]"), (["FORK"], ValueError, "['FORK']")])
def test_start_method_names_bad_methods(methods, err, says):
    "A bare str is not read letter by letter ('fork' in 'forkserver'); no usable method is an error, not spawn."
    from course_lib.core import start_method
    with pytest.raises(err, match=re.escape(says)): start_method(methods)


def test_forking_beside_threads_silences_only_the_fork_warning():
    import warnings
    from course_lib.core import forking_beside_threads
    msg = "This process (pid=1) is multi-threaded, use of fork() may lead to deadlocks in the child."
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with forking_beside_threads(): warnings.warn(msg, DeprecationWarning)
        with pytest.raises(DeprecationWarning): warnings.warn(msg, DeprecationWarning)
        with forking_beside_threads(), pytest.raises(UserWarning): warnings.warn("another", UserWarning)
