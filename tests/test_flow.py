"""course_lib.flux.flow: the Euler sampler matches diffusers' FlowMatchEulerDiscreteScheduler step by step, the
training pair and time sampling are right, training lowers the loss, and bad input is refused by name."""
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from course_lib.ddpm import DDPMConfig
from course_lib.flux import euler_sample, euler_step, flow_grid, interpolate, sample_time, velocity_target
from course_lib.flux import FlowConfig, make_flow_model, sample_flow, train_flow


def _field(x, t, cond=None):
    "A smooth nonlinear velocity field standing in for a network."
    return torch.tanh(x * (1 + t.reshape(-1, *[1] * (x.ndim - 1)))) - 0.3 * x


@pytest.mark.parametrize("shift", [1.0, 3.0])
@pytest.mark.parametrize("n", [1, 7, 20, 50])
def test_euler_matches_diffusers_over_a_trajectory(n, shift):
    sch = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=shift)
    sch.set_timesteps(n)
    grid = flow_grid(n, shift)
    assert (grid - sch.sigmas).abs().max() <= 1e-6
    x_lib = x_ours = torch.randn(8, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    worst = 0.0
    for i, ts in enumerate(sch.timesteps):
        x_lib = sch.step(_field(x_lib, (ts / 1000).expand(8)), ts, x_lib).prev_sample
        x_ours = euler_step(_field(x_ours, grid[i].expand(8)), grid[i], grid[i + 1], x_ours)
        worst = max(worst, (x_ours - x_lib).abs().max().item())
    assert worst <= 1e-5, worst
    ours = euler_sample(_field, torch.randn(8, 1, 8, 8, generator=torch.Generator().manual_seed(0)), n,
                        shift=shift)
    assert (ours - x_lib).abs().max() <= 1e-5


def test_training_pair_and_times():
    x0, e = torch.randn(4, 1, 8, 8), torch.randn(4, 1, 8, 8)
    t = torch.tensor([0.0, 0.25, 0.5, 1.0])
    xt = interpolate(x0, e, t)
    assert torch.allclose(xt[0], x0[0]) and torch.allclose(xt[3], e[3])
    assert torch.allclose(velocity_target(x0, e), e - x0)
    u = sample_time(20000, generator=torch.Generator().manual_seed(0))
    assert 0 < u.min() and u.max() < 1 and abs(u.median() - 0.5) < 0.02
    # logit-normal puts less mass near the ends than uniform
    assert ((u < 0.1) | (u > 0.9)).float().mean() < 0.1


def test_train_flow_lowers_the_loss_and_samples():
    cfg = FlowConfig.from_ddpm(DDPMConfig.quick(), steps=40, warmup_steps=5, num_classes=10, label_dropout=0.2)
    m = train_flow(cfg, progress=False)
    loss = m.history["loss"]
    assert sum(loss[-10:]) < 0.8 * sum(loss[:10]), loss
    u8, x = sample_flow(m, 6, 2, class_labels=[0, 1, 2, 3, 4, 5], guidance_scale=2.0,
                        generator=torch.Generator().manual_seed(0))
    assert u8.shape == (6, 1, 8, 8) and u8.dtype == torch.uint8 and x.abs().max() <= 1


def test_same_network_as_the_ddpm():
    base = DDPMConfig.quick()
    a = sum(p.numel() for p in make_flow_model(FlowConfig.from_ddpm(base)).parameters())
    from course_lib.ddpm import make_unet
    assert a == sum(p.numel() for p in make_unet(base).parameters())
    assert FlowConfig.from_ddpm(base).key() != FlowConfig.from_ddpm(base, logit_std=0.5).key()


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    cfg = FlowConfig.from_ddpm(DDPMConfig.quick(), num_classes=10, label_dropout=0.1)
    m = make_flow_model(cfg).eval()
    m.flow_config = cfg
    return m


@pytest.mark.parametrize("kw,words", [
    ({"guidance_scale": 0.5}, "guidance_scale must be >= 1"),
    ({"class_labels": 12}, "unknown class 12"),
    ({"class_labels": -1}, "unknown class -1"),
    ({"num_steps": 0}, "num_steps (Euler steps) must be an int >= 1, got 0"),
    ({"n": 0}, "n must be an int >= 1, got 0"),
])
def test_bad_input_is_named(tiny, kw, words):
    args = {"n": 2, "num_steps": 2, "class_labels": 1, **kw}
    with pytest.raises(ValueError) as e:
        sample_flow(tiny, **args)
    assert words in str(e.value) and "0.5" in str(e.value) if "guidance" in words else words in str(e.value)


def test_bad_config_is_named():
    with pytest.raises(ValueError, match="time_sampling 'normal'"):
        FlowConfig(time_sampling="normal")
    with pytest.raises(ValueError, match="label_dropout=0.1 needs a class-conditional"):
        FlowConfig(label_dropout=0.1)
    with pytest.raises(ValueError, match="num_steps"):
        flow_grid(0)


# ---------------------------------------------------------------- FLUX's dynamic shift (issue 47, 8)

@pytest.mark.parametrize("mu", [0.0, 0.5, 0.7956, 1.15, 1.8, -0.3])
@pytest.mark.parametrize("n", [1, 4, 20, 50])
def test_dynamic_shift_grid_matches_diffusers(n, mu):
    "flow_grid(n, mu=mu) is FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True).set_timesteps(n, mu=mu)."
    from course_lib.flux import flow_grid
    sch = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, use_dynamic_shifting=True, base_shift=0.5,
                                          max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096)
    sch.set_timesteps(n, mu=mu)
    grid = flow_grid(n, mu=mu)
    assert grid.dtype == torch.float32 and grid.shape == (n + 1,)
    assert (grid - sch.sigmas).abs().max() <= 1e-6
    assert (grid[:-1] * 1000 - sch.timesteps).abs().max() <= 1e-6 * 1000      # 1e-6 of T
    x_lib = torch.randn(8, 1, 8, 8, generator=torch.Generator().manual_seed(1))
    for ts in sch.timesteps:
        x_lib = sch.step(_field(x_lib, (ts / 1000).expand(8)), ts, x_lib).prev_sample
    ours = euler_sample(_field, torch.randn(8, 1, 8, 8, generator=torch.Generator().manual_seed(1)), n, mu=mu)
    assert (ours - x_lib).abs().max() <= 1e-5


@pytest.mark.parametrize("seq_len", [1, 16, 256, 1024, 4096, 8192])
def test_calculate_shift_is_fluxpipelines(seq_len):
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift as theirs
    from course_lib.flux import calculate_shift
    assert calculate_shift(seq_len) == pytest.approx(theirs(seq_len), abs=1e-12)
    kw = dict(base_seq_len=64, max_seq_len=1024, base_shift=0.3, max_shift=1.5)
    assert calculate_shift(seq_len, **kw) == pytest.approx(theirs(seq_len, 64, 1024, 0.3, 1.5), abs=1e-12)


def test_dynamic_shift_is_sd3s_shift_with_s_exp_mu():
    "e^mu / (e^mu + 1/t - 1) = s t / (1 + (s - 1) t) with s = e^mu: only t_min differs between the two grids."
    import math
    from course_lib.flux import dynamic_shift_time, shift_time
    t = torch.linspace(0.01, 1, 50, dtype=torch.float64)
    assert torch.allclose(dynamic_shift_time(t, 0.7), shift_time(t, math.exp(0.7)), atol=1e-12)


def test_dynamic_shift_bad_input_is_named():
    from course_lib.flux import calculate_shift
    with pytest.raises(ValueError, match=r"pass shift=3.0 or mu=0.5, not both"):
        flow_grid(4, 3.0, mu=0.5)
    for bad in (float("nan"), float("inf"), "1"):
        with pytest.raises(ValueError, match=r"mu must be a finite number"):
            flow_grid(4, mu=bad)
    for bad in (0, -4, 2.5, True):
        with pytest.raises(ValueError, match=rf"image_seq_len must be an int >= 1, got {bad!r}"):
            calculate_shift(bad)
    with pytest.raises(ValueError, match=r"max_seq_len=256 must be above base_seq_len=256"):
        calculate_shift(16, base_seq_len=256, max_seq_len=256)


def test_flux_mini_samples_on_fluxpipelines_static_grid():
    """What flux.generate's docstring says: FLUX-mini's scheduler is static (shift 1, no dynamic shifting), so the
    mu FluxPipeline computes changes nothing and the grid is FluxPipeline's own linspace(1, 1/n, n), then 0."""
    from course_lib.flux import generate, make_flux_pipeline
    from course_lib.flux import FluxMiniConfig
    pipe = make_flux_pipeline(FluxMiniConfig(num_layers=1, num_single_layers=1, text_layers=1))
    assert not pipe.scheduler.config.use_dynamic_shifting and pipe.scheduler.config.shift == 1.0
    generate(pipe, ["seven"], num_inference_steps=5)
    want = torch.cat([torch.linspace(1, 1 / 5, 5), torch.zeros(1)])
    assert (pipe.scheduler.sigmas.cpu() - want).abs().max() <= 1e-6
