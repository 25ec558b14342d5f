"""course_lib.vision.quantize (library notebook 52a_quantize): the affine integers by hand against PyTorch's own
quantisation, and the PT2E static and quantisation-aware int8 flows on a small network."""
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from course_lib.vision.quantize import (
    minmax_qparams, quantize_affine, dequantize_affine, static_int8, qat_int8, weight_bytes, compile_cpu)

pytest.importorskip("torchao")


class Tiny(nn.Module):
    "A convolution, BatchNorm, ReLU and a Linear head on 1x8x8 images, with the data config timm models carry."
    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16)
        self.fc = nn.Linear(16 * 8 * 8, 5)
        self.pretrained_cfg = dict(input_size=(1, 8, 8), mean=(0.5,), std=(0.5,))

    def forward(self, x):
        return self.fc(F.relu(self.bn(self.conv(x))).flatten(1))


def _tiny():
    torch.manual_seed(0)
    return Tiny().eval(), torch.rand(64, 1, 8, 8) * 2 - 1


@pytest.mark.parametrize("shift", [0.0, 3.0, -3.0])
def test_affine_by_hand_matches_pytorch(shift):
    torch.manual_seed(1)
    x = torch.randn(2000) + shift
    s, z = minmax_qparams(x)
    from torch.ao.quantization.observer import MinMaxObserver
    obs = MinMaxObserver(dtype=torch.quint8, qscheme=torch.per_tensor_affine)
    obs(x)
    s_ref, z_ref = obs.calculate_qparams()
    assert s == pytest.approx(s_ref.item(), rel=1e-6) and z == int(z_ref)
    q = quantize_affine(x, s, z)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = torch.quantize_per_tensor(x, s, z, torch.quint8).int_repr().long()
    assert (q - ref).abs().max() <= 1 and (q != ref).float().mean() < 0.01   # ties may round apart
    fake = torch.fake_quantize_per_tensor_affine(x, s, z, 0, 255)
    assert (dequantize_affine(q, s, z) - fake).abs().max() <= s + 1e-6
    assert (dequantize_affine(q, s, z) - x).abs().max() <= s / 2 + 1e-5    # 0 lies in the range


def test_qparams_refuse_an_empty_integer_range():
    with pytest.raises(ValueError, match="qmin=5, qmax=5"):
        minmax_qparams(torch.ones(3), 5, 5)


def test_static_int8_stays_close_and_stores_int8():
    model, xs = _tiny()
    q = static_int8(model, xs)
    assert any("quantize_per_tensor" in str(n.target) for n in q.graph.nodes)
    with torch.no_grad():
        diff = (q(xs) - model(xs)).abs().max().item()
        scale = model(xs).abs().max().item()
    assert diff < 0.05 * scale                  # a few int8 steps of the logits' range
    assert weight_bytes(q) < 0.5 * weight_bytes(model)


def test_static_int8_refuses_bad_calibration():
    model, xs = _tiny()
    with pytest.raises(ValueError, match=r"\(0, 1, 8, 8\)"):
        static_int8(model, xs[:0])
    with pytest.raises(ValueError, match=r"\(64, 8, 8\)"):
        static_int8(model, xs[:, 0])


def test_qat_int8_trains_and_converts():
    model, xs = _tiny()
    ys = torch.randint(5, (64,))
    q, losses = qat_int8(model, xs, ys, steps=3, seed=0)
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
    assert isinstance(q, torch.fx.GraphModule)
    assert any("quantize_per_tensor" in str(n.target) for n in q.graph.nodes)
    assert weight_bytes(q) < 0.5 * weight_bytes(model)
    with pytest.raises(ValueError, match="64, 63"):
        qat_int8(model, xs, ys[:63])


def test_weight_bytes_counts_what_the_graph_reads():
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.unused = nn.Parameter(torch.ones(10)), nn.Parameter(torch.ones(100_000))
        def forward(self, x): return x * self.used
    gm = torch.fx.symbolic_trace(Two())
    assert weight_bytes(gm) < 10_000 < weight_bytes(Two())


def test_compile_cpu_matches_eager_or_says_why(monkeypatch):
    model, xs = _tiny()
    fn, how = compile_cpu(model, xs[:4])
    with torch.no_grad():
        assert torch.allclose(fn(xs[:4]), model(xs[:4]), atol=1e-4)
    assert how == "compiled" or how.startswith("eager (")
    def broken(*a, **k):
        raise RuntimeError("no C++ compiler")
    monkeypatch.setattr(torch, "compile", broken)
    fn, how = compile_cpu(model, xs[:4])
    assert how == "eager (RuntimeError: no C++ compiler)"
    with torch.no_grad():
        assert torch.equal(fn(xs[:4]), model(xs[:4]))
