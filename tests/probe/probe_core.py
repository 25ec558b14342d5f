"""The probe's own rules (run under the probe by tests/test_device_probe.py): each rule fails as the real device
would, and values are the CPU's."""
import pytest
import torch

from course_lib.core import ProbeTensor, kind, ops_on_device

DEV = kind()


def test_tensors_made_or_moved_there_report_the_device():
    x = torch.randn(3, 4, device=DEV)
    assert isinstance(x, ProbeTensor) and x.device.type == DEV
    assert torch.tensor([1.0, 2.0], device=DEV).device.type == DEV
    assert torch.zeros(2).to(DEV).device.type == DEV
    lin = torch.nn.Linear(4, 2).to(DEV)
    assert lin.weight.device.type == DEV


def test_mixing_a_cpu_tensor_fails_as_on_the_device():
    lin = torch.nn.Linear(4, 2).to(DEV)
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        lin(torch.randn(3, 4))
    x = torch.randn(3, 4, device=DEV)
    with pytest.raises(RuntimeError, match="same device"):
        torch.cat([x, torch.randn(3, 4)])
    # what CUDA allows: 0-dim CPU tensors as scalars, CPU indices, copies across devices
    assert (x * torch.tensor(2.0)).device.type == DEV
    assert x[torch.tensor([0, 2])].shape == (2, 4)
    y = torch.empty(3, 4)
    y.copy_(x)
    assert torch.equal(y, x.cpu())


def test_numpy_needs_cpu_first():
    x = torch.randn(3, device=DEV)
    with pytest.raises(TypeError, match="Use Tensor.cpu"):
        x.numpy()
    assert x.cpu().numpy().shape == (3,)


def test_generators_must_match_the_draw():
    g = torch.Generator(DEV).manual_seed(0)
    assert g.device.type == DEV and isinstance(g, torch.Generator)
    with pytest.raises(RuntimeError, match="device type for generator"):
        torch.randn(3, generator=g)
    with pytest.raises(RuntimeError, match="device type for generator"):
        torch.randn(3, generator=torch.Generator().manual_seed(0), device=DEV)
    a = torch.randn(3, generator=torch.Generator(DEV).manual_seed(1), device=DEV)
    b = torch.randn(3, generator=torch.Generator().manual_seed(1))
    assert torch.equal(a.cpu(), b), "the probe computes the CPU's values"


def test_autograd_and_optimizer_step_on_the_device():
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 2).to(DEV)
    before = lin.weight.detach().cpu().clone()
    opt = torch.optim.AdamW(lin.parameters(), lr=0.1)
    n = ops_on_device()
    lin(torch.randn(8, 4, device=DEV)).pow(2).mean().backward()
    opt.step()
    assert lin.weight.grad.device.type == DEV
    assert not torch.equal(before, lin.weight.detach().cpu())
    assert ops_on_device() > n


def test_in_place_on_a_view_reaches_the_base():
    x = torch.zeros(2, 3, device=DEV)
    x[0].add_(5.0)
    assert x.cpu()[0].tolist() == [5.0, 5.0, 5.0] and x.cpu()[1].tolist() == [0.0, 0.0, 0.0]


def test_in_place_views_and_out_ops_return_what_the_device_returns():
    "The probe's fast paths (in-place ops return their first argument; views, out= and list ops) as on a GPU."
    x, o = torch.ones(2, 3, device=DEV), torch.empty(2, 3, device=DEV)
    assert x.add_(1.0) is x and x.mul_(2.0) is x and x.cpu().eq(4.0).all()
    assert torch.add(x, 1.0, out=o) is o and o.cpu().eq(5.0).all()
    v = x.view(-1)
    assert v.device.type == DEV and v.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    v[0] = -1.0
    assert x.cpu()[0, 0] == -1.0, "a write through a view reaches its base"
    parts = torch.split(torch.arange(6.0, device=DEV), [2, 4])
    assert type(parts) is tuple and [p.device.type for p in parts] == [DEV, DEV]
    assert torch.cat(list(parts)).cpu().tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    y = torch.zeros(3, device=DEV)
    torch._foreach_add_([y, y], 1.0)
    assert y.cpu().tolist() == [2.0, 2.0, 2.0]


@pytest.mark.skipif(DEV != "mps", reason="MPS rule")
def test_no_float64_on_mps():
    with pytest.raises(TypeError, match="float64"):
        torch.ones(2, dtype=torch.float64, device=DEV)
    with pytest.raises(TypeError, match="float64"):
        torch.ones(2, device=DEV).double()


def test_tied_weights_stay_tied_when_moved():
    "As on a GPU, `Module.to` keeps each Parameter object, so a tied output layer (GPT-2's) stays tied."
    emb, head = torch.nn.Embedding(5, 3), torch.nn.Linear(3, 5, bias=False)
    head.weight = emb.weight
    m = torch.nn.ModuleList([emb, head]).to(DEV)
    assert m[0].weight is m[1].weight and m[0].weight.device.type == DEV


def test_storage_identity_for_safetensors():
    w = torch.nn.Linear(3, 3).to(DEV).weight
    assert w.untyped_storage().data_ptr() == w.data_ptr() != 0


def test_deepcopy_of_a_model_on_the_device():
    import copy
    m = torch.nn.Linear(3, 2).to(DEV)
    c = copy.deepcopy(m)
    assert c.weight.device.type == DEV and c.weight is not m.weight
    assert torch.equal(c.weight.detach().cpu(), m.weight.detach().cpu()) and isinstance(c.weight, torch.nn.Parameter)
    with torch.no_grad(): c.weight.add_(1.0)
    assert not torch.equal(c.weight.detach().cpu(), m.weight.detach().cpu())


def test_accelerate_finds_the_device():
    "accelerate asks `torch.accelerator` first (1.16): it must name the probe's device, not the build's."
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, PartialState
    AcceleratorState._reset_state(True); PartialState._reset_state()
    assert Accelerator().device.type == DEV
    if hasattr(torch, "accelerator"):
        assert torch.accelerator.current_accelerator().type == DEV


def test_data_assignment_across_devices():
    "`x.data = y` works between the CPU and the device, as on CUDA (timm's `freeze_batch_norm_2d` does it)."
    w = torch.nn.Parameter(torch.zeros(3))
    w.data = torch.ones(3, device=DEV)
    assert isinstance(w, torch.nn.Parameter) and w.requires_grad and w.device.type == DEV
    assert w.sum().item() == 3
    from timm.layers import freeze_batch_norm_2d
    bn = torch.nn.BatchNorm2d(3).to(DEV)
    frozen = freeze_batch_norm_2d(bn)
    assert frozen.weight.device.type == DEV
    assert frozen(torch.randn(2, 3, 4, 4, device=DEV)).device.type == DEV


def test_a_pinning_data_loader():
    "A DataLoader with pin_memory=True (torch-fidelity's on CUDA) yields batches that move to the device."
    dl = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.arange(6.0)), batch_size=3,
                                     pin_memory=True)
    assert [b.to(DEV).sum().item() for (b,) in dl] == [3.0, 12.0]


def test_to_with_copy():
    "`Tensor.to(..., copy=True)` (fp16's GradScaler calls it) works on both sides, as on CUDA."
    x = torch.ones(2)
    assert x.to("cpu", copy=True) is not x and x.to(DEV, copy=True).device.type == DEV
    y = torch.ones(2, device=DEV)
    z = y.to(DEV, copy=True)
    z.add_(1)
    assert y.sum().item() == 2 and z.sum().item() == 4
