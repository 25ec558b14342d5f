"""Samplers on a learner's own step counts and options: every timestep grid is exact, every path into sampling
checks its step count, NaN never becomes an image, and scheduler options reach `scheduler.step`."""
import numpy as np
import pytest
import torch

from course_lib.ddpm import (
    DDPMConfig, SAMPLERS, SPACINGS, make_scheduler, make_unet, sample, sampler_table, timestep_grid)
from course_lib.lora import generate
from course_lib.lora import prior_set

T = 1000


@pytest.mark.parametrize("kind", SAMPLERS)
def test_every_grid_has_n_distinct_timesteps_in_range(kind):
    "All n in [1, T], every spacing: diffusers' trailing grid gives n+1 timesteps ending in -1 for 62 of them."
    bad = []
    for spacing in SPACINGS:
        for recommended in (True, False):
            sch = make_scheduler(kind, DDPMConfig(), recommended=recommended, timestep_spacing=spacing)
            for n in range(1, T + 1):
                sch.set_timesteps(n)
                ts = sch.timesteps.tolist()
                if len(ts) != n or len(set(ts)) != n or min(ts) < 0 or max(ts) > T - 1:
                    bad.append((spacing, recommended, n, len(ts), min(ts)))
    assert not bad, f"{len(bad)} bad grids for {kind}, first: {bad[:5]}"


def test_timestep_grid_matches_diffusers_where_diffusers_is_right():
    from diffusers import DDIMScheduler
    for spacing in SPACINGS:
        sch = DDIMScheduler(num_train_timesteps=T, timestep_spacing=spacing)
        for n in (1, 10, 20, 25, 50, 61, 103, 250, 999, 1000):
            sch.set_timesteps(n)
            ours = timestep_grid(T, n, spacing)
            if len(sch.timesteps) == n and sch.timesteps.min() >= 0:
                assert ours.tolist() == sch.timesteps.tolist(), (spacing, n)
            else:
                assert spacing == "trailing" and n in (61, 103), (spacing, n)   # diffusers' float-arange grid
    assert timestep_grid(T, 103, "trailing")[-1] == 9 and len(timestep_grid(T, 103, "trailing")) == 103


@pytest.fixture(scope="module")
def tiny():
    "A class-conditional UNet with random weights (8x8, 10 classes) and its config, as generate() expects."
    torch.manual_seed(0)
    cfg = DDPMConfig.quick(block_out_channels=(8, 16), norm_num_groups=4, num_classes=10)
    unet = make_unet(cfg).eval()
    unet.ddpm_config = cfg
    return unet, cfg


BAD_STEPS = [0, -3, 1001, 2.5, True, "20"]


@pytest.mark.parametrize("steps", BAD_STEPS, ids=repr)
def test_every_sampling_path_checks_its_step_count(tiny, steps):
    unet, cfg = tiny
    msg = rf"num_inference_steps must be an int in \[1, 1000\].*got {steps!r}"
    with pytest.raises(ValueError, match=msg):
        sample(unet, make_scheduler("dpm++", cfg), 2, steps, class_labels=1)
    with pytest.raises(ValueError, match=msg):
        sampler_table(unet, cfg, [("x", "ddim", steps, {})], n=2, judge=lambda u8: None)
    with pytest.raises(ValueError, match=msg):
        generate(unet, "a photo of a 3", n=2, num_inference_steps=steps)
    with pytest.raises(ValueError, match=msg):
        prior_set(unet, 2, num_inference_steps=steps)
    for kind in SAMPLERS:
        with pytest.raises(ValueError, match=msg): make_scheduler(kind, cfg).set_timesteps(steps)


@pytest.mark.parametrize("n", [0, -1, 2.0])
def test_sample_checks_the_number_of_images(tiny, n):
    unet, cfg = tiny
    with pytest.raises(ValueError, match=rf"n \(the number of images\) must be a positive int, got {n!r}"):
        sample(unet, make_scheduler("ancestral", cfg), n, 5, class_labels=1)


class _NaNModel(torch.nn.Module):
    "A denoiser that diverges: its output is NaN everywhere."
    def __init__(self, unet):
        super().__init__()
        self.unet, self.config = unet, unet.config

    def forward(self, x, t, class_labels=None):
        out = self.unet(x, t, class_labels=class_labels)
        out.sample = torch.full_like(out.sample, float("nan"))
        return out


def test_nan_samples_raise_instead_of_becoming_black_images(tiny):
    unet, cfg = tiny
    with pytest.raises(FloatingPointError, match="2 of 2 samples hold NaN"):
        sample(_NaNModel(unet), make_scheduler("ddim", cfg), 2, 3, class_labels=1)


def test_step_options_reach_the_scheduler(tiny):
    """DDIM with eta = 1 is DDPM's ancestral sampler only with `use_clipped_model_output=True` when the predicted
    x0 is clipped (both recompute eps from the clipped x0); without it the trajectories differ."""
    unet, cfg = tiny
    def run(kind, **kw):
        sch = make_scheduler(kind, cfg, recommended=False)
        g = torch.Generator().manual_seed(0)
        return sample(unet, sch, 4, 10, generator=g, class_labels=[1, 2, 3, 4], **kw)[1]
    ddpm = run("ddpm")
    same = run("ddim", eta=1.0, step_kwargs={"use_clipped_model_output": True})
    unclipped = run("ddim", eta=1.0)
    # measured: max |diff| 1.1e-6 with the clipped output (float32 round-off over 10 steps), 0.36 without;
    # tolerances 1e-5 (about 10x the round-off) and 1e-2
    assert (same - ddpm).abs().max() < 1e-5
    assert (unclipped - ddpm).abs().max() > 1e-2        # the random model's x0 is clipped: clipping matters
    with pytest.raises(ValueError, match=r"DDPMScheduler.step takes no \['use_clipped_model_output'\]"):
        run("ddpm", step_kwargs={"use_clipped_model_output": True})


def test_custom_timesteps_and_bad_spacing():
    "diffusers' own `set_timesteps(timesteps=[...])` still works; an unknown spacing is refused when built."
    cfg = DDPMConfig()
    for kind in ("ddpm", "dpm++"):
        sch = make_scheduler(kind, cfg)
        sch.set_timesteps(timesteps=[999, 500, 10])
        assert sch.timesteps.tolist() == [999, 500, 10]
    for kind in SAMPLERS:
        with pytest.raises(ValueError, match="unknown timestep_spacing 'foo'"):
            make_scheduler(kind, cfg, timestep_spacing="foo")


def test_ddim_eta_one_from_pure_noise_stays_finite(tiny):
    """At t = T-1 of the cosine schedule (alpha_bar about 2e-9) float32 made DDIM's 1 - alpha_bar_prev - sigma^2
    slightly negative with eta = 1, and every sample NaN."""
    unet, cfg = tiny
    for steps in (5, 10):
        x = sample(unet, make_scheduler("ddim", cfg), 2, steps, generator=torch.Generator().manual_seed(0),
                   class_labels=1, eta=1.0)[1]
        assert torch.isfinite(x).all()
