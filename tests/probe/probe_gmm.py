"""Unit 2's closed-form mixture and score errors with the data on the accelerator (under the device probe): the
float64 density and score follow `x`'s device (on MPS, an explicit CPU step: MPS has no float64) and come back in
`x`'s device and dtype; `score_error` makes its noise levels where `x` is. On 767c4b0 each mixed devices."""
import pytest
import torch

from course_lib.core import kind
from course_lib.score import ScoreMLP, relative_score_errors, score_error
from course_lib.score import make_mixture

DEV = kind()


def test_mixture_follows_x():
    gmm = make_mixture("four")
    x = torch.randn(5, 2, device=DEV)
    for out in (gmm.log_prob(x, 0.5), gmm.score(x, torch.full((5,), 0.5, device=DEV)),
                gmm.responsibilities(x)):
        assert out.device.type == DEV and out.dtype == torch.float32
    ref = make_mixture("four").score(x.cpu(), 0.5)
    assert torch.allclose(gmm.score(x, 0.5).cpu(), ref)


def test_score_errors_of_a_model_on_the_device():
    gmm, model = make_mixture("four"), ScoreMLP(2, 16, 2).to(DEV).eval()
    x = gmm.sample(64, torch.Generator().manual_seed(0)).to(DEV)
    assert score_error(model, lambda y: gmm.score(y, 0.5), x, 0.5) > 0
    errs = relative_score_errors(model, gmm, [0.1, 1.0], n=64)
    assert len(errs) == 2 and all(e > 0 for e in errs)


def test_sample_distances_from_the_device():
    """The sample statistics of unit 2 take samples on the device: float64 on the CPU (on 767c4b0
    `sliced_wasserstein` mixed the device with its CPU directions, the others cast to float64 where MPS has none)."""
    from course_lib.score import component_weights, energy_distance, sliced_wasserstein
    gmm = make_mixture("four")
    x = gmm.sample(32, torch.Generator().manual_seed(0)).to(DEV)
    y = gmm.sample(32, torch.Generator().manual_seed(1))
    assert abs(float(component_weights(x, gmm).sum()) - 1) < 1e-12
    assert energy_distance(x, y.to(DEV)) == pytest.approx(energy_distance(x.cpu(), y))
    assert sliced_wasserstein(x, y.to(DEV)) == pytest.approx(sliced_wasserstein(x.cpu(), y))


def test_float_images_from_the_device_to_uint8():
    from course_lib.metrics import as_uint8_images
    x = torch.rand(4, 1, 8, 8, device=DEV) * 2 - 1
    u = as_uint8_images(x)
    assert u.dtype == torch.uint8 and u.shape[0] == 4


def test_generators_on_the_device_for_unit_2():
    """A generator on the device draws for the mixture's samples, Langevin, annealed Langevin and the ELBO (on
    f9f3a38 each refused it); MPS gets no float64 (sigmas given on the device)."""
    from course_lib.score import annealed_langevin, langevin
    g = torch.Generator(DEV).manual_seed(0)
    gmm = make_mixture("four")
    assert gmm.sample(5, generator=g).shape == (5, 2)
    x = torch.randn(3, 2, device=DEV)
    assert langevin(lambda y: -y, x, 0.1, 3, generator=g).device.type == DEV
    sig = torch.tensor([1.0, 0.5], device=DEV)
    out = annealed_langevin(lambda y, s: -y / s[:, None] ** 2, x, sig, n_steps_each=2, generator=g)
    assert out.device.type == DEV
