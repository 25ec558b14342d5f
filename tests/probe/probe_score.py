"""Unit 2's SDE solvers and likelihood on the accelerator (under the device probe): every tensor they make follows
the model's device, noise comes from a generator on either device, and scipy's float64 state stays on the CPU
(so no float64 reaches an MPS device). On 767c4b0 each of these failed with a device error."""
import pytest
import torch

from course_lib.core import kind
from course_lib.score import VESDE, VPSDE, euler_maruyama_sampler, pc_sampler
from course_lib.score import ode_likelihood, ode_sampler

DEV = kind()


def score_model():
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 2).to(DEV)
    return lambda x, t: net(torch.cat([x, t[:, None]], 1)), net


@pytest.mark.parametrize("sde", [VESDE(N=8), VPSDE(N=40)], ids=["VE", "VP"])
@pytest.mark.parametrize("gen", ["cpu", "device"])
def test_sde_samplers_follow_the_model(sde, gen):
    score_fn, _ = score_model()
    g = torch.Generator(DEV if gen == "device" else "cpu").manual_seed(0)
    x = euler_maruyama_sampler(sde, score_fn, (4, 2), n_steps=5, generator=g, device=DEV)
    assert x.device.type == DEV and x.shape == (4, 2)
    x = pc_sampler(sde, score_fn, (4, 2), generator=g, device=DEV)
    assert x.device.type == DEV and torch.isfinite(x.cpu()).all()
    # the start given on the device (the API of 767c4b0, which then made its times and noise on the CPU)
    x0 = torch.randn(4, 2, device=DEV)
    assert euler_maruyama_sampler(sde, score_fn, (4, 2), n_steps=5, x=x0, generator=g).device.type == DEV
    assert pc_sampler(sde, score_fn, (4, 2), x=x0, generator=g).device.type == DEV


def test_ode_sampler_and_likelihood_on_the_device():
    sde = VPSDE(N=40)
    score_fn, _ = score_model()
    x, nfe = ode_sampler(sde, score_fn, (3, 2), generator=torch.Generator().manual_seed(0), device=DEV,
                         rtol=1e-3, atol=1e-3)
    assert x.device.type == DEV and nfe > 0
    assert ode_sampler(sde, score_fn, z=torch.randn(3, 2, device=DEV), rtol=1e-3, atol=1e-3)[0].device.type == DEV
    nll, z, nfe = ode_likelihood(sde, score_fn, x, trace="exact", rtol=1e-3, atol=1e-3)
    assert nll.shape == (3,) and torch.isfinite(nll).all() and z.device.type == DEV
    nll_h, _, _ = ode_likelihood(sde, score_fn, x, trace="hutchinson", generator=torch.Generator(DEV).manual_seed(0),
                                 rtol=1e-3, atol=1e-3)
    assert nll_h.shape == (3,)


def test_ncsn_trained_or_loaded_is_on_the_device(tmp_path, monkeypatch):
    "On 767c4b0 `load_ncsn` returned a freshly trained model on the device but a cached one on the CPU."
    from course_lib.score import NCSNConfig, load_ncsn
    monkeypatch.setenv("COURSE_LIB_HOME", str(tmp_path))
    cfg = NCSNConfig(channels=(8, 8, 8), steps=2, batch_size=4)
    for _ in ("trained", "loaded"):
        assert next(load_ncsn(cfg).parameters()).device.type == DEV


@pytest.mark.parametrize("where", ["cpu", "device"])
def test_ddpm_as_score_model_and_its_elbo(where):
    """Unit 1's network on the device as a score model (`ddpm_score_fn`) and its ELBO (`ddpm_elbo_bpd`), with the
    images on the CPU or the device: the network runs where it is, the float64 tables and sums stay on the CPU
    (on 767c4b0 both mixed devices, and the tables' float64 would have reached an MPS device)."""
    from course_lib.ddpm import DDPMConfig, make_unet
    from course_lib.score import ScheduleVPSDE, ddpm_elbo_bpd, ddpm_score_fn
    cfg = DDPMConfig(block_out_channels=(8, 16), norm_num_groups=8, num_train_timesteps=50)
    unet = make_unet(cfg).to(DEV).eval()
    schedule = cfg.schedule()
    sde = ScheduleVPSDE.from_schedule(schedule, M=10)
    x = torch.rand(2, 1, cfg.image_size, cfg.image_size) * 2 - 1
    x = x if where == "cpu" else x.to(DEV)
    with torch.no_grad():
        s = ddpm_score_fn(unet, sde, cfg.prediction_type)(x, torch.full((2,), 0.5))
    assert s.shape == x.shape and s.device == x.device
    mean, std = sde.marginal_prob(x, 0.3)
    assert mean.device == x.device
    bpd = ddpm_elbo_bpd(unet, schedule, x, cfg.prediction_type, n_t=3, generator=torch.Generator().manual_seed(0))
    assert bpd.shape == (2,) and torch.isfinite(bpd).all()


def test_schedule_sde_draws_its_own_start_and_elbo_takes_a_device_generator():
    """`ScheduleVPSDE.prior_sampling` takes the device the solvers pass (on f9f3a38 a TypeError, on the CPU too),
    and the ELBO draws with a generator on either device."""
    from course_lib.ddpm import DDPMConfig, NoiseSchedule, make_unet
    from course_lib.score import ScheduleVPSDE, ddpm_elbo_bpd
    sde = ScheduleVPSDE(NoiseSchedule(30, "linear").alpha_bar)
    for dev in ("cpu", DEV):
        x = euler_maruyama_sampler(sde, lambda y, t: -y, (2, 3), n_steps=3, device=dev)
        assert x.device.type == torch.device(dev).type and x.shape == (2, 3)
    cfg = DDPMConfig(block_out_channels=(8, 16), norm_num_groups=8, num_train_timesteps=50)
    unet = make_unet(cfg).to(DEV).eval()
    x0 = torch.rand(2, 1, cfg.image_size, cfg.image_size) * 2 - 1
    bpd = ddpm_elbo_bpd(unet, cfg.schedule(), x0, cfg.prediction_type, n_t=2,
                        generator=torch.Generator(DEV).manual_seed(0))
    assert torch.isfinite(bpd).all()
