"""course_lib.flux.mini: captions measured from pixels, FLUX's packing, an offline seeded FluxPipeline whose output our
own Euler loop reproduces, save/load round trips, training lowers the loss, and bad input refused by name."""
import warnings

import pytest
import torch
from diffusers import FluxPipeline

from course_lib.data import Digits
from course_lib.flux import euler_step
from course_lib.flux import FluxMiniConfig, open_flux_mini, save_flux_mini
from course_lib.exercises.flow import _ref_digit_slant
from course_lib.exercises import check_digit_slant, check_flux_pack_latents
from course_lib.flux import caption_digits, ink_mass, slant
from course_lib.flux import (
    FluxVelocity, caption_table, generate, latent_ids, make_flux_pipeline, pack_latents,
    unpack_latents)
from course_lib.flux import judge_prompt_rate, prompt_digit, train_flux_mini

TINY = FluxMiniConfig(steps=30, vae_steps=10, batch_size=32, warmup_steps=5)


@pytest.fixture(scope="module")
def pipe():
    return make_flux_pipeline(TINY)


def test_captions_follow_the_pixels():
    ds = Digits("all", size=16)
    caps = caption_digits(ds.images, ds.labels)
    names = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
    assert all(names[y] in c.split() for c, y in zip(caps, ds.labels.tolist()))
    ink, sl = ink_mass(ds.images), slant(ds.images)
    bold = torch.tensor(["bold" in c for c in caps])
    thin = torch.tensor(["thin" in c for c in caps])
    right = torch.tensor(["right" in c for c in caps])
    left = torch.tensor(["left" in c for c in caps])
    for d in range(10):                      # thirds within each class
        k = ds.labels == d
        assert ink[k & bold].min() > ink[k & thin].max()
        assert sl[k & right].min() > sl[k & left].max()
    assert 0.25 < bold.double().mean() < 0.4 and 0.25 < right.double().mean() < 0.4
    with pytest.raises(ValueError, match="3 images but 2 labels"):
        caption_digits(ds.images[:3], ds.labels[:2])
    with pytest.raises(ValueError, match="0..9"):
        caption_digits(ds.images[:2], torch.tensor([1, 10]))


def test_slant_sign_and_uint8():
    bar = torch.full((2, 1, 16, 16), -1.0)
    for i in range(16):
        bar[0, 0, i, 12 - i // 2] = 1.0     # top to the right: leaning right
        bar[1, 0, i, 3 + i // 2] = 1.0
    s = slant(bar)
    assert s[0] > 0.3 and s[1] < -0.3
    u8 = ((bar + 1) * 127.5).round().to(torch.uint8)
    assert torch.allclose(slant(u8), s, atol=1e-4)
    with pytest.raises(ValueError, match=r"\(B, 1, H, W\)"):
        slant(torch.zeros(2, 16, 16))


def test_packing_matches_the_pipeline():
    z = torch.randn(3, 4, 8, 6)
    assert torch.equal(pack_latents(z), FluxPipeline._pack_latents(z, 3, 4, 8, 6))
    assert torch.equal(unpack_latents(pack_latents(z), 8, 6), z)
    assert torch.equal(latent_ids(8, 6), FluxPipeline._prepare_latent_image_ids(3, 4, 3, "cpu", torch.float32))


def test_pipeline_is_seeded_and_offline(pipe):
    other = make_flux_pipeline(TINY)
    for a, b in zip(pipe.transformer.parameters(), other.transformer.parameters()):
        assert torch.equal(a, b)
    x = generate(pipe, ["bold seven", "two"], guidance_scale=2.0, num_inference_steps=3, seed=4)
    assert x.shape == (2, 1, 16, 16) and x.min() >= -1 and x.max() <= 1
    assert torch.equal(x, generate(other, ["bold seven", "two"], 2.0, 3, seed=4))
    assert not torch.equal(x, generate(pipe, ["bold seven", "two"], 2.0, 3, seed=5))


def test_our_euler_loop_is_the_pipeline(pipe):
    "FluxVelocity + course_lib.flux.flow.euler_step on the pipeline's sigmas, true CFG, VAE decode == FluxPipeline."
    prompts, w, n = ["bold seven", "thin two slanted left"], 2.5, 5
    table, pe, pooled, ids = caption_table(pipe, prompts)
    vel = FluxVelocity(pipe.transformer, pe, pooled, ids)
    cond = torch.tensor([table.index(p) for p in prompts])
    z = torch.randn(2, TINY.latent_channels, 8, 8, generator=torch.Generator().manual_seed(3))
    sig = torch.cat([torch.linspace(1, 1 / n, n), torch.zeros(1)])
    with torch.no_grad():
        for i in range(n):
            v_c, v_0 = vel(z, sig[i], cond), vel(z, sig[i], None)
            z = euler_step(v_0 + w * (v_c - v_0), sig[i].item(), sig[i + 1].item(), z)
        cfg = pipe.vae.config
        ours = pipe.vae.decode(z / cfg.scaling_factor + cfg.shift_factor).sample.clamp(-1, 1)
    lib = generate(pipe, prompts, guidance_scale=w, num_inference_steps=n, seed=3)
    assert (ours - lib).abs().max() < 1e-5


def test_save_and_load_give_the_same_images(pipe, tmp_path):
    save_flux_mini(pipe, tmp_path / "p")
    back = FluxPipeline.from_pretrained(tmp_path / "p")
    back.set_progress_bar_config(disable=True)
    mine = open_flux_mini(tmp_path / "p")
    assert mine.flux_config == TINY
    kw = dict(guidance_scale=3.0, num_inference_steps=4, seed=1, negative_prompt="one")
    a = generate(pipe, ["eight slanted right", "four"], **kw)
    assert torch.equal(a, generate(back, ["eight slanted right", "four"], **kw))
    assert torch.equal(a, generate(mine, ["eight slanted right", "four"], **kw))


def test_long_prompt_is_truncated_with_both_lengths(pipe):
    long = "bold seven slanted right seven seven seven seven"
    with pytest.warns(UserWarning, match=r"10 tokens long, the text encoders take 8: it is truncated to 8"):
        x = generate(pipe, [long], num_inference_steps=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y = generate(pipe, ["bold seven slanted right seven"], num_inference_steps=2)   # 7 tokens: fits
    with pytest.warns(UserWarning, match=r"11 tokens long, the text encoders take 8"):
        z = generate(pipe, [long + " nine"], num_inference_steps=2)
    assert torch.equal(x, z) and x.shape == y.shape


def test_empty_prompt_is_the_unconditional_model(pipe):
    "'' is caption dropout's null: guiding it against the default negative '' changes nothing."
    a = generate(pipe, ["", ""], guidance_scale=4.0, num_inference_steps=3, seed=2)
    b = generate(pipe, ["", ""], guidance_scale=1.0, num_inference_steps=3, seed=2)
    assert torch.allclose(a, b, atol=1e-6)
    for bad in ([], [3], None):
        with pytest.raises(ValueError, match="non-empty list of strings"):
            generate(pipe, bad, num_inference_steps=2)


@pytest.mark.parametrize("w", [0.5, 0, -1.0])
def test_guidance_below_one_refused(pipe, w):
    with pytest.raises(ValueError, match=rf"guidance_scale must be a number >= 1.*got {w}"):
        generate(pipe, ["seven"], guidance_scale=w, num_inference_steps=2)


@pytest.mark.parametrize("size", [18, 2, 30])
def test_size_the_patching_cannot_take_refused(pipe, size):
    with pytest.raises(ValueError, match=rf"height={size}: .*multiples of 4"):
        generate(pipe, ["seven"], num_inference_steps=2, height=size)
    with pytest.raises(ValueError, match=rf"width={size}: .*multiples of 4"):
        generate(pipe, ["seven"], num_inference_steps=2, width=size)
    assert generate(pipe, ["seven"], num_inference_steps=1, height=24, width=8).shape == (1, 1, 24, 8)


def test_config_refuses_what_cannot_fit():
    with pytest.raises(ValueError, match="image_size=18 must be a multiple of 4"):
        FluxMiniConfig(image_size=18)
    with pytest.raises(ValueError, match="axes_dims_rope"):
        FluxMiniConfig(axes_dims_rope=(4, 4, 4))
    with pytest.raises(ValueError, match="caption_dropout"):
        FluxMiniConfig(caption_dropout=1.0)
    assert FluxMiniConfig.quick().steps < FluxMiniConfig().steps
    assert FluxMiniConfig.quick().key() != FluxMiniConfig().key()


def test_judge_prompt_rate_and_prompt_digit(pipe):
    r = judge_prompt_rate(pipe, ["seven", "bold two"], 2.0, 2)
    assert r["n"] == 2 and r["labels"].tolist() == [7, 2] and r["images"].dtype == torch.uint8
    assert 0 <= r["rate"] <= 1 and abs(sum(r["class_shares"]) - 1) < 1e-9
    assert prompt_digit("Thin Seven, slanted left") == 7
    with pytest.raises(ValueError, match="names 0 digits"):
        prompt_digit("bold")
    with pytest.raises(ValueError, match="names 2 digits"):
        prompt_digit("one two")


def test_training_lowers_the_loss():
    p = train_flux_mini(TINY, progress=False)
    h = p.history
    assert len(h["flow_loss"]) == TINY.steps and len(h["vae_loss"]) == TINY.vae_steps
    assert sum(h["flow_loss"][-10:]) < sum(h["flow_loss"][:10])
    z = torch.cat([p.vae.encode(Digits("train", size=16).images[:256]).latent_dist.mean]).detach()
    zn = (z - p.vae.config.shift_factor) * p.vae.config.scaling_factor
    assert abs(zn.mean()) < 0.2 and 0.7 < zn.std() < 1.3       # latents normalised as the flow sees them


def test_exercise_checkers():
    assert check_flux_pack_latents(pack_latents).passed
    bad = lambda z: z.flatten(2).transpose(1, 2).reshape(z.shape[0], -1, 4 * z.shape[1])   # noqa: E731
    r = check_flux_pack_latents(bad)
    assert not r.passed and "flattening pixels, not 2x2 patches" in r.message
    assert check_digit_slant(_ref_digit_slant).passed
    r = check_digit_slant(lambda x: -_ref_digit_slant(x))
    assert not r.passed and "sign flipped" in r.message

    def stub(x):
        raise NotImplementedError
    assert not check_digit_slant(stub).done


def test_quiet_loading_leaves_the_progress_bars_as_it_found_them():
    "A learner who turned the loading bars off keeps them off after a course loader (they were turned back on)."
    from diffusers.utils import logging as dlog
    from transformers.utils import logging as tlog
    from course_lib.flux import quiet_loading
    try:
        for on in (False, True):
            for log in (dlog, tlog): log.enable_progress_bar() if on else log.disable_progress_bar()
            with quiet_loading(): assert not dlog.is_progress_bar_enabled() and not tlog.is_progress_bar_enabled()
            assert dlog.is_progress_bar_enabled() is on and tlog.is_progress_bar_enabled() is on, on
    finally:
        dlog.enable_progress_bar(); tlog.enable_progress_bar()
