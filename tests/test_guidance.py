"""course_lib.flux.guidance: the guided prediction is diffusers' rule, label dropout drops the asked share, the
guided UNet runs with unit 1's samplers, and bad input is refused naming the value."""
import pytest
import torch

from course_lib.ddpm import DDPMConfig, make_unet
from course_lib.flux import (
    GuidedUNet, cfg_combine, drop_labels, label_dropout_dataset, mean_se, sample_guided)


def test_cfg_combine_is_diffusers_guider():
    from diffusers.guiders import ClassifierFreeGuidance
    c, u = torch.randn(2, 3, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    for w in (1.0, 2.0, 7.5):
        ref = ClassifierFreeGuidance(guidance_scale=w).forward(c, u).pred
        assert torch.allclose(cfg_combine(c, u, w), ref, atol=1e-6)
    # w = 1: the conditional prediction, w = 0: the unconditional one (to float32 round-off)
    assert torch.allclose(cfg_combine(c, u, 1.0), c, atol=1e-6)
    assert torch.allclose(cfg_combine(c, u, 0.0), u, atol=1e-6)


def test_label_dropout():
    y = drop_labels(torch.arange(10).repeat(2000), 0.2, 10, generator=torch.Generator().manual_seed(0))
    assert abs((y == 10).float().mean().item() - 0.2) < 0.01
    ds = type("D", (), {"images": torch.zeros(5, 1, 8, 8), "labels": torch.arange(5)})()
    d = label_dropout_dataset(ds, 0.2)
    assert d.images.shape == (50, 1, 8, 8) and (d.labels == 10).sum() == 10
    with pytest.raises(ValueError, match="multiple of 0.1 in \\[0, 1\\), got 0.15"):
        label_dropout_dataset(ds, 0.15)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = DDPMConfig.quick(num_classes=11)
    m = make_unet(cfg).eval()
    m.ddpm_config, m.null_class = cfg, 10
    return m


def test_guided_sampling_runs(model):
    u8, x = sample_guided(model, 4, [0, 1, 2, 3], 3.0, 2, generator=torch.Generator().manual_seed(0))
    assert u8.shape == (4, 1, 8, 8)
    u8n, _ = sample_guided(model, 4, None, 2.0, 2, negative=1, generator=torch.Generator().manual_seed(0))
    assert u8n.shape == (4, 1, 8, 8)
    # scale 1 without a negative is the conditional model alone: one network call per step
    g = GuidedUNet(model, 1.0)
    x, t, y = torch.randn(2, 1, 8, 8), torch.tensor(500), torch.tensor([3, 4])
    assert torch.allclose(g(x, t, y).sample, model(x, t, class_labels=y).sample)


@pytest.mark.parametrize("kw,words", [
    ({"guidance_scale": 0.5}, "guidance_scale must be a number >= 1 for classifier-free guidance"),
    ({"class_labels": 10}, "unknown class 10"),
    ({"class_labels": [1, 12]}, "unknown class 12"),
    ({"negative": 11}, "unknown negative class 11"),
    ({"num_steps": 0}, "num_steps must be an int >= 1, got 0"),
])
def test_bad_input_is_named(model, kw, words):
    args = {"n": 2, "class_labels": 1, "guidance_scale": 2.0, "num_steps": 2, **kw}
    with pytest.raises(ValueError) as e:
        sample_guided(model, **args)
    assert words in str(e.value)
    if "guidance_scale" in kw: assert "0.5" in str(e.value)


def test_mean_se():
    m, se = mean_se([0.2, 0.4, 0.6])
    assert abs(m - 0.4) < 1e-12 and abs(se - 0.2 / 3 ** 0.5) < 1e-12
    assert mean_se([0.3]) == (0.3, 0.0)
