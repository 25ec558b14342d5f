"""Likelihoods in the data's own units (issue 43, item 4): the digits' 17 levels, their dequantisation on that
grid, the bits-per-dimension offset, the per-pixel histogram baseline, the ELBO's decoder on the grid and the
fine-tuning loop of notebook 23, each against a closed form."""
import math

import pytest
import torch

from course_lib.data import Digits
from course_lib.score import (
    bits_per_dim, dequantize_levels, finetune_on_levels, histogram_bits, ode_likelihood, to_levels)
from course_lib.score.digits import ScheduleVPSDE

K = 17


def test_to_levels_reads_the_digits_17_levels():
    x = Digits("train", size=8, dtype="uint8").images
    k = to_levels(x, K)
    assert k.dtype == torch.int64 and torch.unique(k).tolist() == list(range(K))
    # back to the stored values: round(255 k / 16)
    assert torch.equal((k.double() * 255 / 16).round().to(torch.uint8), x)
    assert to_levels(torch.tensor([0, 16, 128, 143, 255], dtype=torch.uint8)).tolist() == [0, 1, 8, 9, 16]


def test_to_levels_refuses_off_grid_and_bad_input():
    with pytest.raises(ValueError, match="pixel value 7"):
        to_levels(torch.tensor([0, 7], dtype=torch.uint8), K)
    with pytest.raises(TypeError, match="uint8"):
        to_levels(torch.zeros(3), K)
    with pytest.raises(ValueError, match="n_levels"):
        to_levels(torch.zeros(3, dtype=torch.uint8), 1)
    # 256 levels: every uint8 value is its own level
    x = torch.arange(256, dtype=torch.uint8)
    assert torch.equal(to_levels(x, 256), x.long())


def test_dequantize_levels_fills_each_bin_uniformly():
    k = torch.arange(K).repeat(4000)
    x = dequantize_levels(k, K, torch.Generator().manual_seed(0))
    assert x.dtype == torch.float32 and x.min() >= -1 and x.max() < 1
    u = (x.double() + 1) * K / 2 - k                  # the noise back: U[0, 1)
    assert u.min() >= 0 and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.01          # mean 1/2, standard error 0.0011
    assert abs(u.var().item() - 1 / 12) < 0.005       # variance 1/12


def test_dequantize_levels_refuses_bad_levels():
    with pytest.raises(TypeError, match="integer"):
        dequantize_levels(torch.zeros(3), K)
    with pytest.raises(ValueError, match=r"\[0, 17\)"):
        dequantize_levels(torch.tensor([0, 17]), K)
    with pytest.raises(ValueError, match=r"\[0, 17\)"):
        dequantize_levels(torch.tensor([-1]), K)


def test_uniform_density_scores_log2_17_exactly():
    # a density uniform on [-1, 1]^D: -log p = D log 2 for every dequantised image
    D = 64
    nll = torch.full((5,), D * math.log(2), dtype=torch.float64)
    bits = bits_per_dim(nll, D, offset=math.log2(K / 2))
    assert torch.allclose(bits, torch.full((5,), math.log2(K), dtype=torch.float64), atol=1e-12)
    assert abs(math.log2(K) - 4.08746) < 1e-5


def test_a_density_constant_on_the_bins_gives_the_discrete_bits():
    # p_j(x) = P_j(k(x)) K / 2 on each bin of width 2 / K: its dequantised bits/dim equal the discrete model's
    g = torch.Generator().manual_seed(1)
    k_train = torch.randint(0, K, (50, 1, 2, 3), generator=g)
    k_eval = torch.randint(0, K, (7, 1, 2, 3), generator=g)
    counts = torch.nn.functional.one_hot(k_train.flatten(1), K).sum(0)
    P = (counts + 1).double() / (50 + K)                                  # (D, K)
    x = dequantize_levels(k_eval, K, g).double().flatten(1)
    k_back = ((x + 1) * K / 2).floor().long()                             # the bin each x fell in
    D = x.shape[1]
    nll = -(P[torch.arange(D), k_back] * K / 2).log().sum(1)
    bits = bits_per_dim(nll, D, offset=math.log2(K / 2))
    assert torch.allclose(bits, histogram_bits(k_train, k_eval, K), atol=1e-12)


def test_histogram_bits_against_a_count_by_hand():
    g = torch.Generator().manual_seed(2)
    k_train = torch.randint(0, 5, (30, 4), generator=g)
    k_eval = torch.randint(0, 5, (3, 4), generator=g)
    want = []
    for img in k_eval:
        bits = [-math.log2(((k_train[:, j] == img[j]).sum().item() + 1) / (30 + 5)) for j in range(4)]
        want.append(sum(bits) / 4)
    assert torch.allclose(histogram_bits(k_train, k_eval, 5), torch.tensor(want, dtype=torch.float64))
    # no counts on a level: every level equally likely, log2 K bits
    flat = torch.arange(5).repeat(4, 1).T                                 # each level once per pixel
    assert torch.allclose(histogram_bits(flat, k_eval, 5), torch.full((3,), math.log2(5), dtype=torch.float64))


def test_histogram_bits_refuses_mismatched_input():
    with pytest.raises(ValueError, match="shapes differ"):
        histogram_bits(torch.zeros(3, 4, dtype=torch.long), torch.zeros(2, 5, dtype=torch.long), K)
    with pytest.raises(ValueError, match="k_eval"):
        histogram_bits(torch.zeros(3, 4, dtype=torch.long), torch.full((2, 4), K), K)


class _ExactGaussianEps(torch.nn.Module):
    "The exact noise prediction E[eps | x_t] of data N(0, s2 I) on `schedule`: sqrt(1 - ab) x_t / (ab s2 + 1 - ab)."
    def __init__(self, schedule, s2):
        super().__init__()
        self.ab, self.s2 = schedule.alpha_bar, s2
    def forward(self, x, t):
        from types import SimpleNamespace
        ab = self.ab[t.long().cpu()].to(x).reshape(-1, *[1] * (x.dim() - 1))
        return SimpleNamespace(sample=(1 - ab).sqrt() * x / (ab * self.s2 + 1 - ab))


def _gaussian_chain_elbo(schedule, s2):
    """The expected negative ELBO (nats per dimension) of DDPM's chain with the exact noise prediction for data
    N(0, s2 I), continuous decoder: L_T + sum_t beta_t / (2 alpha_t (1 - ab_{t-1})) Var(eps | x_t) + L_0, each in
    closed form."""
    ab, b = schedule.alpha_bar, schedule.betas
    a = ab[-1]
    L_T = 0.5 * (a * s2 + (1 - a) - 1 - math.log(1 - a))
    t = torch.arange(1, len(ab))
    var_eps = ab[t] * s2 / (ab[t] * s2 + 1 - ab[t])                    # E (E[eps | x_t] - eps)^2
    L_mid = (b[t] / (2 * (1 - b[t]) * (1 - ab[t - 1])) * var_eps).sum()
    var_x0 = s2 * b[0] / ((1 - b[0]) * s2 + b[0])                      # Var(x0 | x1): the decoder's error
    L_0 = 0.5 * math.log(2 * math.pi * b[0]) + var_x0 / (2 * b[0])
    return float(L_T + L_mid + L_0)


def test_elbo_of_the_exact_model_of_a_gaussian_matches_its_closed_form():
    # data N(0, s2 I), continuous: DDPM's chain with the exact posterior-mean eps. With n_t = N - 1 strata every
    # timestep is drawn once, so the Monte Carlo ELBO must match the closed form up to the noise of eps and x0;
    # with n_levels the decoder is a density and the bits carry the offset log2(K / 2). The ELBO bounds the NLL:
    # it stays above the exact entropy, and here (the cosine schedule's big first steps in log SNR) well above.
    from course_lib.ddpm import NoiseSchedule
    from course_lib.score import ddpm_elbo_bpd
    s2, D = 0.3, 4
    for name in ["cosine", "linear"]:
        schedule = NoiseSchedule(1000, name)
        g = torch.Generator().manual_seed(4)
        x = torch.randn(2000, 1, 2, 2, generator=g) * math.sqrt(s2)
        bits = ddpm_elbo_bpd(_ExactGaussianEps(schedule, s2), schedule, x, "epsilon", n_t=999, generator=g,
                             n_levels=K)
        want = _gaussian_chain_elbo(schedule, s2) / math.log(2) + math.log2(K / 2)
        se = (bits.std() / len(bits) ** 0.5).item()
        assert abs(bits.mean().item() - want) < 3 * se, (name, bits.mean().item(), want, se)
        entropy = 0.5 * math.log(2 * math.pi * math.e * s2) / math.log(2) + math.log2(K / 2)
        assert want > entropy


def test_ode_bits_of_a_gaussian_on_the_cosine_schedule():
    # data N(0, s^2 I): the VP SDE's marginal is N(0, (ab s^2 + 1 - ab) I), its score exact, the NLL closed-form
    from course_lib.ddpm import NoiseSchedule
    schedule = NoiseSchedule(1000, "cosine")
    sde = ScheduleVPSDE.from_schedule(schedule, T=1 - 1 / 1000)
    s2 = 0.3
    D = 4
    def score(x, t):
        ab = sde.alpha_bar(t).to(x).reshape(-1, 1)
        return -x / (ab * s2 + 1 - ab)
    x = (torch.randn(32, D, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * math.sqrt(s2))
    nll, _, _ = ode_likelihood(sde, score, x, trace="exact", rtol=1e-6, atol=1e-6, eps=1e-3, dtype=torch.float64)
    exact = 0.5 * D * math.log(2 * math.pi * s2) + x.pow(2).sum(1) / (2 * s2)
    # the ODE starts at eps = 1e-3, where the marginal variance is s2 ab + 1 - ab, a hair above s2
    assert (nll - exact).abs().max() < 0.01 * exact.abs().mean()
    off = math.log2(K / 2)
    assert torch.allclose(bits_per_dim(nll, D, off), exact / (D * math.log(2)) + off, atol=0.01)


def _tiny_unet():
    from course_lib.ddpm import DDPMConfig, make_unet
    torch.manual_seed(0)
    return make_unet(DDPMConfig.quick()).eval()


def test_finetune_on_levels_trains_a_copy():
    from course_lib.ddpm import DDPMConfig
    cfg = DDPMConfig.quick()
    model = _tiny_unet()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    k = to_levels(Digits("train", size=8, dtype="uint8").images[:64], K)
    g = torch.Generator().manual_seed(0)
    same = finetune_on_levels(model, cfg.schedule(), k, K, steps=0, batch_size=8, progress=False, generator=g)
    assert same.history["loss"] == [] and not same.training
    assert all(torch.equal(p, before[n]) for n, p in same.named_parameters())
    ft = finetune_on_levels(model, cfg.schedule(), k, K, steps=3, batch_size=8, progress=False, generator=g)
    assert len(ft.history["loss"]) == 3 and all(math.isfinite(v) for v in ft.history["loss"])
    assert any(not torch.equal(p, before[n]) for n, p in ft.named_parameters())
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())   # the model is left as it was


def test_finetune_on_levels_refuses_bad_settings():
    from course_lib.ddpm import DDPMConfig
    k = torch.zeros(4, 1, 8, 8, dtype=torch.long)
    for kw in [{"steps": -1}, {"batch_size": 0}, {"lr": 0.0}]:
        with pytest.raises(ValueError, match="need steps"):
            finetune_on_levels(_tiny_unet(), DDPMConfig.quick().schedule(), k, K, progress=False, **kw)
