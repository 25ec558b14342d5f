"""Unit 3 (evaluation): FID / IS / KID from scratch against closed forms and torch-fidelity, bad input, the CLI."""
import io, json, contextlib, warnings

import numpy as np
import pytest
import torch

from course_lib.metrics import (
    FD_METHODS, FewSamplesWarning, check_features, feature_statistics, fid_from_features,
    fid_infinity, frechet_distance)
from course_lib.metrics import inception_score, kid
from course_lib.metrics import fidelity as metrics, io as metrics_io
from course_lib.cli import fid_main

import torch_fidelity.metric_fid as tf_fid
from torch_fidelity.metric_isc import isc_features_to_metric
from torch_fidelity.metric_kid import kid_features_to_metric


def rel(a, b): return abs(a - b) / abs(b)


def gaussians(d=48, seed=0):
    rng = np.random.default_rng(seed)
    Q, _ = np.linalg.qr(rng.standard_normal((d, d)))
    a, b = rng.uniform(0.1, 3, d), rng.uniform(0.1, 3, d)
    mu1, mu2 = rng.standard_normal(d), rng.standard_normal(d)
    exact = np.sum((mu1 - mu2) ** 2) + np.sum((np.sqrt(a) - np.sqrt(b)) ** 2)
    return mu1, (Q * a) @ Q.T, mu2, (Q * b) @ Q.T, exact


# ---------------------------------------------------------------- Fréchet distance
@pytest.mark.parametrize("method", FD_METHODS)
def test_frechet_closed_form(method):
    mu1, s1, mu2, s2, exact = gaussians()
    assert rel(frechet_distance(mu1, s1, mu2, s2, method), exact) < 1e-8


def test_frechet_closed_form_singular_covariance():
    # shared null space (dead feature units): the symmetric method takes the eigh path
    mu1, s1, mu2, s2, _ = gaussians(d=32, seed=1)
    Q, _ = np.linalg.qr(np.random.default_rng(2).standard_normal((32, 32)))
    a, b = np.r_[np.zeros(8), np.linspace(1, 4, 24)], np.r_[np.zeros(8), np.linspace(1.5, 3, 24)]
    s1, s2 = (Q * a) @ Q.T, (Q * b) @ Q.T
    exact = np.sum((mu1 - mu2) ** 2) + np.sum((np.sqrt(a) - np.sqrt(b)) ** 2)
    for m in FD_METHODS:
        assert rel(frechet_distance(mu1, s1, mu2, s2, m), exact) < 1e-7, m


def test_frechet_1d_closed_form():
    # 1-D: (mu1 - mu2)^2 + (sigma1 - sigma2)^2
    assert rel(frechet_distance([1.0], [[4.0]], [3.0], [[9.0]]), 4.0 + 1.0) < 1e-12


def test_fid_agrees_with_torch_fidelity_on_identical_features():
    g = torch.Generator().manual_seed(0)
    f1 = torch.randn(600, 64, generator=g, dtype=torch.float64) @ torch.randn(64, 64, generator=g, dtype=torch.float64) * 0.3
    f2 = torch.randn(500, 64, generator=g, dtype=torch.float64) @ torch.randn(64, 64, generator=g, dtype=torch.float64) * 0.3 + 0.1
    st1, st2 = tf_fid.fid_features_to_statistics(f1), tf_fid.fid_features_to_statistics(f2)
    ref = tf_fid.fid_statistics_to_metric(st1, st2, verbose=False)[tf_fid.KEY_METRIC_FID]
    for m in FD_METHODS:
        assert rel(fid_from_features(f1, f2, method=m), ref) < 1e-6, m
    # the same algorithm as torch-fidelity agrees to rounding
    assert rel(fid_from_features(f1, f2, method="eigvals"), ref) < 1e-10


def test_fid_of_identical_sets_is_zero_up_to_rounding():
    f = np.random.default_rng(0).standard_normal((300, 32))
    mu, s = feature_statistics(f)
    for m in FD_METHODS:
        assert abs(frechet_distance(mu, s, mu, s, m)) < 1e-8 * np.trace(s)


def test_fid_infinity_removes_bias():
    rng = np.random.default_rng(0)
    d = 16
    gen, real = rng.standard_normal((2000, d)) + 0.05, rng.standard_normal((40000, d))
    fid_inf, ns, fids = fid_infinity(gen, real, ns=[100, 200, 400, 800, 1600, 2000], trials=3)
    true = 0.05 ** 2 * d
    assert fids[0] > fids[-1] > true
    assert abs(fid_inf - true) < abs(fids[-1] - true)


# ---------------------------------------------------------------- IS and KID
def test_inception_score_agrees_with_torch_fidelity():
    logits = torch.randn(1000, 10, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 3
    ref = isc_features_to_metric(logits, splits=10)
    m, s = inception_score(logits, splits=10)
    assert rel(m, ref["inception_score_mean"]) < 1e-5 and rel(s, ref["inception_score_std"]) < 1e-5


def test_inception_score_from_probs_equals_from_logits_and_bounds():
    logits = torch.randn(500, 10, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    a = inception_score(logits, splits=5)[0]
    b = inception_score(logits.softmax(1), splits=5)[0]
    assert rel(a, b) < 1e-10
    onehot = np.eye(10)[np.arange(1000) % 10]
    assert abs(inception_score(onehot, splits=10, probs=True, shuffle=False)[0] - 10) < 1e-6
    assert abs(inception_score(np.full((100, 10), 0.1), splits=2)[0] - 1) < 1e-12


def test_kid_agrees_with_torch_fidelity():
    g = torch.Generator().manual_seed(3)
    fa = torch.randn(400, 32, generator=g, dtype=torch.float64)
    fb = torch.randn(300, 32, generator=g, dtype=torch.float64) * 1.1 + 0.1
    ref = kid_features_to_metric(fa, fb, kid_subsets=20, kid_subset_size=200, verbose=False)
    m, s = kid(fa, fb, subsets=20, subset_size=200)
    assert rel(m, ref["kernel_inception_distance_mean"]) < 1e-6
    assert rel(s, ref["kernel_inception_distance_std"]) < 1e-6


def test_kid_is_unbiased_near_zero_for_same_distribution():
    rng = np.random.default_rng(4)
    vals = [kid(rng.standard_normal((100, 16)), rng.standard_normal((100, 16)), subsets=1, subset_size=100)[0]
            for _ in range(20)]
    assert abs(np.mean(vals)) < 3 * np.std(vals) / np.sqrt(len(vals))
    assert min(vals) < 0  # the unbiased estimator goes below 0


# ---------------------------------------------------------------- bad input
def test_fewer_than_two_samples_is_an_error():
    with pytest.raises(ValueError, match="1 sample"):
        fid_from_features(np.zeros((1, 4)), np.zeros((10, 4)))
    with pytest.raises(ValueError, match="at least 2"):
        kid(np.zeros((1, 4)), np.zeros((10, 4)))
    with pytest.raises(ValueError):
        inception_score(np.zeros((1, 10)))


def test_fewer_samples_than_dimensions_warns_with_both_numbers():
    rng = np.random.default_rng(0)
    with pytest.warns(FewSamplesWarning, match=r"20 samples for 64 feature dimensions"):
        fid_from_features(rng.standard_normal((20, 64)), rng.standard_normal((200, 64)))


def test_nan_features_are_an_error():
    f = np.ones((10, 4)); f[3, 2] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        fid_from_features(f, np.ones((10, 4)))
    with pytest.raises(ValueError, match="NaN"):
        kid(np.ones((10, 4)), f)
    with pytest.raises(ValueError, match="NaN"):
        inception_score(f)
    with pytest.raises(ValueError, match="NaN"):
        frechet_distance(np.zeros(2), np.eye(2), np.array([0, np.nan]), np.eye(2))


def test_mismatched_dimensions_are_an_error():
    with pytest.raises(ValueError, match="differ"):
        fid_from_features(np.random.rand(10, 4), np.random.rand(10, 5))
    with pytest.raises(ValueError, match="shapes do not match"):
        frechet_distance(np.zeros(3), np.eye(3), np.zeros(2), np.eye(2))


def test_kid_subset_larger_than_samples_is_clamped_with_warning():
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((50, 8)), rng.standard_normal((40, 8))
    with pytest.warns(UserWarning, match="clamped to 40"):
        m, _ = kid(a, b, subsets=3, subset_size=1000)
    assert m == kid(a, b, subsets=3, subset_size=40)[0]


def test_bad_splits_and_subsets():
    with pytest.raises(ValueError, match="splits"):
        inception_score(np.random.rand(5, 10), splits=6)
    with pytest.raises(ValueError, match="subset_size"):
        kid(np.random.rand(10, 3), np.random.rand(10, 3), subset_size=1)


# ---------------------------------------------------------------- images in, uint8 out
def test_image_normalisation_forms_agree():
    from course_lib.data import Digits
    ds = Digits("valid", size=8)
    u8 = Digits("valid", size=8, dtype="uint8").images
    ref = metrics.as_uint8_images(u8)
    assert ref.shape == (len(ds), 3, 8, 8) and ref.dtype == torch.uint8
    for src in (ds.images, (ds.images + 1) / 2, ds, ds.images.permute(0, 2, 3, 1).numpy(), ds.images[:, 0]):
        assert torch.equal(metrics.as_uint8_images(src), ref)
    it = iter(ds.images.split(50))
    assert torch.equal(metrics.as_uint8_images(lambda b: next(it), num_samples=len(ds)), ref)


def test_bad_images(tmp_path):
    from PIL import Image
    with pytest.raises(ValueError, match="NaN"):
        metrics.as_uint8_images(torch.full((4, 1, 8, 8), float("nan")))
    with pytest.raises(ValueError, match="outside"):
        metrics.as_uint8_images(torch.rand(4, 1, 8, 8) * 3)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no usable images"):
        metrics.as_uint8_images(tmp_path / "empty")
    with pytest.raises(ValueError, match="does not exist"):
        metrics.as_uint8_images(tmp_path / "missing")
    mixed = tmp_path / "mixed"; mixed.mkdir()
    for i, s in enumerate([8, 8, 16]):
        Image.fromarray(np.full((s, s), 100 + i, np.uint8)).save(mixed / f"{i}.png")
    with pytest.raises(ValueError, match="mixed sizes: 8x8 \\(2 images\\), 16x16 \\(1 image\\)"):
        metrics.as_uint8_images(mixed)
    assert metrics.as_uint8_images(mixed, size=8).shape == (3, 3, 8, 8)
    with pytest.raises(ValueError, match="mixed sizes"):
        metrics.as_uint8_images([torch.zeros(1, 8, 8), torch.zeros(1, 16, 16)])
    with pytest.raises(ValueError, match="metrics"):
        metrics.evaluate(torch.zeros(4, 1, 8, 8, dtype=torch.uint8), metrics=("fidd",))


def test_statistics_npz_roundtrip(tmp_path):
    mu, s = np.arange(3.0), np.eye(3) * 2
    p = metrics_io.save_statistics(tmp_path / "s.npz", mu, s, 10)
    st = metrics_io.load_statistics(p)
    assert np.array_equal(st["mu"], mu) and np.array_equal(st["sigma"], s) and st["n"] == 10
    np.savez(tmp_path / "bad.npz", m=mu)
    with pytest.raises(ValueError, match="no 'mu' and 'sigma'"):
        metrics_io.load_statistics(tmp_path / "bad.npz")


def test_inception_weights_missing_names_the_digits_extractor(monkeypatch, tmp_path):
    from course_lib.core import OfflineError
    monkeypatch.setenv("COURSE_LIB_INCEPTION_WEIGHTS", str(tmp_path / "nope.pth"))
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    with pytest.raises(OfflineError, match="--extractor digits"):
        metrics_io.inception_weights_path()
    with pytest.raises(FileNotFoundError):
        metrics_io.inception_weights_path(tmp_path / "nope.pth")
    torch.save({"w": torch.zeros(1)}, tmp_path / "w.pth")   # a torch.save file: a 1-byte stand-in is refused
    monkeypatch.setenv("COURSE_LIB_INCEPTION_WEIGHTS", str(tmp_path / "w.pth"))
    assert metrics_io.inception_weights_path() == tmp_path / "w.pth"


def run_cli(argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = fid_main(argv)
    return rc, out.getvalue(), err.getvalue()


def test_cli_bad_arguments(tmp_path, monkeypatch):
    monkeypatch.setenv("COURSE_LIB_INCEPTION_WEIGHTS", str(tmp_path / "nope.pth"))
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    assert run_cli([])[0] == 2
    rc, _, err = run_cli([str(tmp_path / "missing"), "digits-train"])
    assert rc == 2 and "does not exist" in err
    metrics_io.save_statistics(tmp_path / "a.npz", np.zeros(3), np.eye(3), 5)
    rc, _, err = run_cli([str(tmp_path / "a.npz"), str(tmp_path / "a.npz"), "--kid"])
    assert rc == 2 and "--kid" in err
    rc, _, err = run_cli([str(tmp_path / "a.npz"), "digits-train", "--extractor", "inception"])
    assert rc == 2 and "--extractor digits" in err
    assert run_cli(["a", "b", "--extractor", "vgg"])[0] == 2


def test_cli_npz_statistics(tmp_path):
    mu1, s1, mu2, s2, exact = gaussians(d=8)
    metrics_io.save_statistics(tmp_path / "a.npz", mu1, s1, 100)
    metrics_io.save_statistics(tmp_path / "b.npz", mu2, s2, 100)
    rc, out, _ = run_cli([str(tmp_path / "a.npz"), str(tmp_path / "b.npz"), "--json"])
    assert rc == 0 and rel(json.loads(out)["fid"], exact) < 1e-8


# ---------------------------------------------------------------- with the digits extractor (unit 1's classifier)
@pytest.fixture(scope="module")
def digits_features():
    return metrics.extract_features("digits-valid"), metrics.extract_features("digits-train")


def test_evaluate_agrees_with_from_scratch_on_identical_features(digits_features):
    fv, ft = digits_features
    r = metrics.evaluate("digits-valid", "digits-train", metrics=("fid", "isc", "kid"), kid_subsets=20,
                         kid_subset_size=200, cache_reference=False)
    assert rel(fid_from_features(fv["features"], ft["features"], method="eigvals"), r["fid"]) < 1e-6
    assert rel(fid_from_features(fv["features"], ft["features"]), r["fid"]) < 1e-4
    assert rel(inception_score(fv["logits"], splits=10)[0], r["is_mean"]) < 1e-5
    assert rel(kid(fv["features"], ft["features"], subsets=20, subset_size=200)[0], r["kid_mean"]) < 1e-6


def test_ordering_real_ddpm_noise(digits_features):
    """real-vs-real (disjoint splits) << real-vs-unit-1 samples << real-vs-noise, for FID and KID."""
    from course_lib.ddpm import DDPMConfig, load_pretrained_ddpm, make_scheduler, sample
    cfg = DDPMConfig.quick()
    model = load_pretrained_ddpm(cfg, progress=False)
    x_u8, _ = sample(model, make_scheduler("ddim", cfg), 300, 20, generator=torch.Generator().manual_seed(0))
    noise = torch.randint(0, 256, (300, 1, 8, 8), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    fid = {k: metrics.fid_of_samples(x) for k, x in [("real", metrics.as_uint8_images("digits-valid", size=8)),
                                                     ("ddpm", x_u8), ("noise", noise)]}
    assert 2 * fid["real"] < fid["ddpm"] and 2 * fid["ddpm"] < fid["noise"], fid
    ft = metrics.extract_features("digits-train", size=8)["features"]
    k = {n: kid(metrics.extract_features(x)["features"], ft, subsets=10, subset_size=300)[0]
         for n, x in [("real", metrics.as_uint8_images("digits-valid", size=8)), ("ddpm", x_u8), ("noise", noise)]}
    assert k["real"] < k["ddpm"] < k["noise"], k


def test_cli_folders(tmp_path):
    from PIL import Image
    x = metrics.as_uint8_images("digits-valid")[:150]
    for i, im in enumerate(x): Image.fromarray(im[0].numpy()).save(tmp_path / f"{i:03d}.png")
    rc, out, err = run_cli([str(tmp_path), "digits-train", "--isc", "--kid", "--kid-subset-size", "100", "--json"])
    r = json.loads(out)
    assert rc == 0 and {"fid", "is_mean", "kid_mean"} <= set(r) and r["n_a"] == 150
    assert "150 samples for 128 feature dimensions" not in err  # 150 > 128: no warning
    # the folder gives the same FID as the tensor it was written from (PNG is lossless)
    assert rel(metrics.fid_of_samples(x), r["fid"]) < 1e-9


# --- the memorisation check (lesson 33) ---------------------------------------------------------------------------
def test_nn_distances_match_sklearn_nearest_neighbors():
    from sklearn.neighbors import NearestNeighbors
    from course_lib.metrics import nn_distances
    g = torch.Generator().manual_seed(0)
    ref = torch.randint(0, 256, (300, 1, 8, 8), generator=g, dtype=torch.uint8)
    x = torch.randint(0, 256, (70, 1, 8, 8), generator=g, dtype=torch.uint8)
    ours = nn_distances(x, ref, batch_size=16)                       # several batches
    nn = NearestNeighbors(n_neighbors=1).fit(ref.flatten(1).double().numpy() / 255)
    theirs = nn.kneighbors(x.flatten(1).double().numpy() / 255)[0][:, 0]
    assert ours.dtype == torch.float64 and ours.shape == (70,)
    np.testing.assert_allclose(ours.numpy(), theirs, rtol=1e-9, atol=1e-12)
    # float images in [-1, 1] are the same pixels
    torch.testing.assert_close(nn_distances(x.float() / 127.5 - 1, ref.float() / 127.5 - 1), ours)
    # a copier is caught: copies of the reference sit at distance 0
    assert nn_distances(ref[:10], ref).max() == 0
    with pytest.raises(ValueError, match="images of two sizes"):
        nn_distances(x, torch.zeros(3, 1, 16, 16, dtype=torch.uint8))
    with pytest.raises(ValueError, match="needs images on both sides, got 0 and 300"):
        nn_distances(x[:0], ref)


# --- the MNIST judge as a feature extractor (lesson 32's default) --------------------------------------------------
def test_mnist_references_are_the_mnist_splits():
    from course_lib.data.mnist import MNIST
    for split, n in [("train", 4000), ("valid", 500), ("test", 500)]:
        x = metrics.as_uint8_images(f"mnist-{split}")
        assert x.shape == (n, 3, 28, 28) and x.dtype == torch.uint8
        assert torch.equal(x[:, :1], MNIST(split, dtype="uint8").images)
    assert metrics.as_uint8_images("ref:mnist-test").shape == (500, 3, 28, 28)
    assert metrics.as_uint8_images("mnist-test", size=16).shape == (500, 3, 16, 16)
    assert torch.equal(metrics.as_uint8_images("mnist-test", size=32)[:, :, 2:30, 2:30],
                       metrics.as_uint8_images("mnist-test"))   # 32: MNIST's own zero padding


def test_mnist_extractor_through_torch_fidelity_agrees_with_from_scratch():
    "The 'mnist' extractor is the MNIST judge's features; torch-fidelity's FID/KID on them equal ours."
    from course_lib.ddpm.classifier import ClassifierConfig, load_digits_classifier
    judge = load_digits_classifier("cpu", ClassifierConfig.mnist())
    fv, ft = (metrics.extract_features(f"mnist-{s}", "mnist") for s in ("valid", "test"))
    x = metrics.as_uint8_images("mnist-valid")[:, :1]
    with torch.no_grad():
        by_hand = judge.features(x.float() / 127.5 - 1).double()
    torch.testing.assert_close(fv["features"], by_hand, rtol=1e-6, atol=1e-6)
    digits = metrics.extract_features("mnist-valid", "digits")["features"]
    assert (digits - fv["features"]).abs().max() > 1e-3        # another judge, other features
    r = metrics.evaluate("mnist-valid", "mnist-test", metrics=("fid", "kid"), extractor="mnist",
                         kid_subsets=20, kid_subset_size=200, cache_reference=False)
    assert r["extractor"] == "mnist" and r["n_reference"] == 500
    assert rel(fid_from_features(fv["features"], ft["features"], method="eigvals"), r["fid"]) < 1e-6
    assert rel(kid(fv["features"], ft["features"], subsets=20, subset_size=200)[0], r["kid_mean"]) < 1e-6
    # the two judges' cached reference statistics do not share a file
    paths = {e: metrics_io.reference_stats_path("mnist-test", e, size=28) for e in ("digits", "mnist")}
    assert paths["digits"] != paths["mnist"]
    assert metrics_io.extractor_fingerprint("mnist") != metrics_io.extractor_fingerprint("digits")


def test_cli_mnist_extractor():
    rc, out, err = run_cli(["mnist-valid", "mnist-test", "--extractor", "mnist", "--json"])
    assert rc == 0, err
    assert rel(json.loads(out)["fid"], metrics.fid_of_samples("mnist-valid", "mnist-test", "mnist")) < 1e-9
