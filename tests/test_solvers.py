"""The samplers written by hand in lesson 13a (course_lib.ddpm.solvers) against diffusers, on the course
model, and against closed forms (the exact mixture's eps, scipy's energy distance)."""
import math

import numpy as np
import pytest
import torch

from course_lib.ddpm import DDPMConfig, diffusers_scheduler, load_pretrained_ddpm
from course_lib.ddpm.sampling import timestep_grid
from course_lib.ddpm.schedulers import energy_distance_unbiased, solve
from course_lib.ddpm.solvers import (
    ExactMixture, ddim_sample, dpmpp_2m_sample, heun_sample, karras_sigmas, sigma_to_t,
    vp_denoiser, vp_sigmas)


@pytest.fixture(scope="module")
def course():
    cfg = DDPMConfig()
    model = load_pretrained_ddpm(cfg).eval()
    def net(x, t):
        with torch.no_grad(): return model(x, t).sample
    x_T = torch.randn(8, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    return cfg, cfg.schedule(), net, x_T


def _loop(scheduler, x, net, **kw):
    with torch.no_grad():
        for t in scheduler.timesteps:
            x = scheduler.step(net(scheduler.scale_model_input(x, t), t), t, x, **kw).prev_sample
    return x


@pytest.mark.parametrize("eta,clip", [(0.0, False), (0.0, True), (1.0, False), (1.0, True)])
def test_ddim_matches_diffusers(course, eta, clip):
    from diffusers import DDIMScheduler
    cfg, schedule, net, x_T = course
    ref = diffusers_scheduler(schedule, DDIMScheduler, prediction_type=cfg.prediction_type,
                              timestep_spacing="trailing", clip_sample=clip)
    ref.set_timesteps(20)
    want = _loop(ref, x_T.clone(), net, eta=eta, generator=torch.Generator().manual_seed(1))
    got = ddim_sample(net, ref.alphas_cumprod, ref.timesteps, x_T.clone(), cfg.prediction_type, eta,
                      clip, torch.Generator().manual_seed(1))
    assert (got - want).abs().max() <= 1e-5


@pytest.mark.parametrize("n_steps", [5, 10, 20, 50])
def test_dpmpp_2m_matches_diffusers(course, n_steps):
    from diffusers import DPMSolverMultistepScheduler
    cfg, schedule, net, x_T = course
    grid = timestep_grid(schedule.num_train_timesteps, n_steps, "trailing").tolist()
    ref = diffusers_scheduler(schedule, DPMSolverMultistepScheduler, solver_order=2,
                              prediction_type=cfg.prediction_type, algorithm_type="dpmsolver++",
                              final_sigmas_type="zero")
    ref.set_timesteps(timesteps=grid)
    want = _loop(ref, x_T.clone(), net)
    got = dpmpp_2m_sample(net, ref.alphas_cumprod, grid, x_T.clone(), cfg.prediction_type)
    assert (got - want).abs().max() <= 1e-5


@pytest.mark.parametrize("n_levels", [10, 25])
def test_heun_matches_diffusers(course, n_levels):
    "1e-4: float32 rounding, grown by the last steps' division by small sigmas (1.1e-5 measured)."
    from diffusers import HeunDiscreteScheduler
    cfg, schedule, net, x_T = course
    ref = diffusers_scheduler(schedule, HeunDiscreteScheduler, use_karras_sigmas=True,
                              prediction_type=cfg.prediction_type, timestep_spacing="linspace")
    ref.set_timesteps(n_levels)
    want = _loop(ref, x_T.clone() * ref.init_noise_sigma, net)
    s = vp_sigmas(ref.alphas_cumprod)
    sigmas = karras_sigmas(float(s[0]), float(s[-1]), n_levels)
    assert torch.allclose(sigmas[:-1].float(), ref.sigmas[::2].float(), rtol=1e-6)
    got = heun_sample(vp_denoiser(net, ref.alphas_cumprod, cfg.prediction_type), sigmas,
                      x_T.clone() * sigmas[0].item())
    assert (got - want).abs().max() <= 1e-4


def test_sigma_to_t_is_diffusers_interpolation():
    from diffusers import HeunDiscreteScheduler
    schedule = DDPMConfig().schedule()
    ref = diffusers_scheduler(schedule, HeunDiscreteScheduler)
    log_sigmas = np.log(vp_sigmas(ref.alphas_cumprod).numpy())
    sig = np.exp(np.linspace(log_sigmas[0], log_sigmas[-1], 37))
    want = np.array([ref._sigma_to_t(s, log_sigmas) for s in sig])
    assert np.allclose(sigma_to_t(torch.from_numpy(sig), ref.alphas_cumprod).numpy(), want, atol=1e-6)


def test_exact_mixture_eps_is_minus_scaled_grad_log_density():
    g = torch.Generator().manual_seed(0)
    A = torch.randn(3, 5, 5, generator=g, dtype=torch.float64)
    mix = ExactMixture(torch.randn(3, 5, generator=g), A @ A.transpose(1, 2) + 0.1 * torch.eye(5),
                       [0.5, 0.3, 0.2])
    x = torch.randn(6, 5, generator=g, dtype=torch.float64, requires_grad=True)
    for ab in (0.99, 0.3, 1e-4):
        grad, = torch.autograd.grad(mix.log_prob(x, ab).sum(), x)
        assert torch.allclose(mix.eps(x.detach(), ab), -math.sqrt(1 - ab) * grad, atol=1e-10)
    # alpha_bar = 1: the mixture's own density, against torch.distributions
    comps = torch.distributions.MultivariateNormal(mix.means, mix.U @ torch.diag_embed(mix.lam)
                                                   @ mix.U.transpose(1, 2))
    ref = torch.distributions.MixtureSameFamily(torch.distributions.Categorical(mix.weights), comps)
    assert torch.allclose(mix.log_prob(x.detach()), ref.log_prob(x.detach()), atol=1e-9)


def test_energy_distance_against_scipy():
    from scipy.stats import energy_distance
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(50, 1, generator=g), torch.randn(70, 1, generator=g) + 0.5
    n, m = len(x), len(y)
    u = energy_distance_unbiased(x, y)
    within = lambda a: torch.cdist(a.double(), a.double()).mean().item()
    # scipy: the V-statistic's square root; the U-statistic rescales the same-set means by n/(n-1)
    v = u + within(x) * n / (n - 1) + within(y) * m / (m - 1) - within(x) - within(y)
    assert math.isclose(v, energy_distance(x[:, 0].numpy(), y[:, 0].numpy()) ** 2, rel_tol=1e-9)
    with pytest.raises(ValueError, match="at least 2"): energy_distance_unbiased(x[:1], y)


def test_solvers_reach_the_exact_mixture_and_a_bad_one_does_not():
    mix = ExactMixture([[2.5, 0.0], [-2.5, 0.0]], 0.16 * torch.eye(2).expand(2, 2, 2), [0.7, 0.3])
    schedule = DDPMConfig().schedule()
    model_fn = mix.as_model(schedule.alpha_bar)
    ref = mix.sample(800, torch.Generator().manual_seed(1))
    x_T = torch.randn(800, 2, generator=torch.Generator().manual_seed(2))
    for kind in ("ancestral", "ddim", "dpm++2m", "heun-80"):
        x, made = solve(kind, model_fn, schedule, 50, x_T.clone(),
                        generator=torch.Generator().manual_seed(3))
        assert energy_distance_unbiased(x, ref) < 0.02, kind
    x, _ = solve("ddim", model_fn, schedule, 1, x_T.clone())      # one step: the mean, no modes
    assert energy_distance_unbiased(x, ref) > 0.5


def test_heun_on_a_gaussian():
    """N(0, 1) data, whose exact denoiser is x / (1 + sigma^2): without churn the ODE's solution is
    x_T / sqrt(1 + sigma_max^2) exactly; with churn (Algorithm 2) the samples keep the variance 1
    (20,000 samples: a standard error of 0.01 on the variance)."""
    sigmas = karras_sigmas(0.002, 80.0, 200)
    x = torch.randn(20000, 1, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 80
    D = lambda x, s: x / (1 + s**2)
    # Heun: 1.3e-3 at the largest sample; Euler on the same levels: 5.5e-2
    assert (heun_sample(D, sigmas, x) - x / math.sqrt(1 + 80.0**2)).abs().max() < 5e-3
    out = heun_sample(D, sigmas, x, s_churn=40.0, generator=torch.Generator().manual_seed(1))
    assert abs(out.var().item() - 1) < 0.04 and abs(out.mean().item()) < 0.03


def test_solve_refuses_bad_input():
    schedule = DDPMConfig().schedule()
    f = lambda x, t: x
    with pytest.raises(ValueError, match="unknown solver 'euler'"):
        solve("euler", f, schedule, 10, torch.zeros(2, 2))
    with pytest.raises(ValueError, match="at least 3"): solve("heun", f, schedule, 2, torch.zeros(2, 2))
    with pytest.raises(ValueError, match="sigma_min < sigma_max"): karras_sigmas(5.0, 1.0, 10)
    with pytest.raises(ValueError, match="n must be an int >= 2"): karras_sigmas(0.1, 1.0, 1)
    with pytest.raises(ValueError, match="positive definite"):
        ExactMixture([[0.0, 0.0]], [[[1.0, 0.0], [0.0, -1.0]]], [1.0])
