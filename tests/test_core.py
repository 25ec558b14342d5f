"""Core: seeds, device choice, atomic checkpoints (a killed write leaves nothing under the final name), results."""
import json, multiprocessing as mp, os, signal, subprocess, sys, time
from pathlib import Path

import numpy as np
import pytest
import torch

from course_lib.core import (seed_everything, get_device, cache_dir, atomic_write, save_checkpoint, load_checkpoint,
                             record, read_results)


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


def _slow_writer(path):
    from course_lib.core import atomic_write
    with atomic_write(path, "wb") as f:
        for _ in range(1000):
            f.write(b"x" * 100_000); f.flush(); time.sleep(0.01)


def test_killed_write_leaves_old_file(tmp_path):
    target = tmp_path / "model.safetensors"
    target.write_bytes(b"old complete file")
    p = mp.get_context("spawn").Process(target=_slow_writer, args=(target,))
    p.start(); time.sleep(1.5); os.kill(p.pid, signal.SIGKILL); p.join()
    assert target.read_bytes() == b"old complete file"


def test_record_and_read(monkeypatch, tmp_path):
    monkeypatch.setenv("COURSE_LIB_RESULTS", str(tmp_path / "r.json"))
    monkeypatch.setenv("COURSE_LIB_NOTEBOOK", "nb1")
    record("acc", np.float32(0.5)); record("t", torch.tensor(2.0)); record("acc2", 0.9, notebook="nb2")
    assert read_results() == {"nb1": {"acc": 0.5, "t": 2.0}, "nb2": {"acc2": 0.9}}
    with pytest.raises(TypeError, match="not JSON"): record("x", object())
    with pytest.raises(ValueError): record("", 1)
