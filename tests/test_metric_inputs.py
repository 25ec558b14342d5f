"""Metrics on unusual sets: an undefined metric raises with the numbers, every source goes through one resize
pipeline, a sampling function's value range is decided once, and transparent images are read as the standard
tools read them."""
import contextlib, io, json, warnings

import numpy as np
import pytest
import torch
from PIL import Image

from course_lib.data import Digits
from course_lib.metrics import inception_score
from course_lib.cli import fid_main
from course_lib.metrics import as_uint8_images, evaluate


def run_fid(*args):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = fid_main([str(a) for a in args])
    return rc, out.getvalue(), err.getvalue()


def write_pngs(folder, images, mode="L"):
    "uint8 `(N, H, W)` (mode L) or `(N, H, W, 4)` (RGBA) arrays as PNG files."
    folder.mkdir(parents=True, exist_ok=True)
    for i, im in enumerate(images): Image.fromarray(np.asarray(im, np.uint8), mode).save(folder / f"{i:04d}.png")
    return folder


@pytest.fixture(scope="module")
def train_pngs(tmp_path_factory):
    "The 1,438 training digits as their native 8x8 scans, written as PNG files."
    x = Digits("train", size=8, dtype="uint8").images[:, 0].numpy()
    return write_pngs(tmp_path_factory.mktemp("train8"), x), len(x)


def test_inception_score_needs_two_images_a_split():
    logits = torch.randn(5, 10, generator=torch.Generator().manual_seed(0)).numpy()
    with pytest.raises(ValueError, match=r"splits=10 must be an int in \[1, N // 2 = 2\] for N=5"):
        inception_score(logits, splits=10)
    with pytest.raises(ValueError, match=r"splits=5 .* each split needs at least 2"):
        inception_score(logits, splits=5)
    mean, std = inception_score(logits, splits=2)
    assert mean > 1.0 and np.isfinite(std)


def test_evaluate_refuses_is_on_five_images():
    x = Digits("valid", size=16, dtype="uint8").images[:5]
    with pytest.raises(ValueError, match=r"isc_splits=10 with 5 generated images.*isc_splits <= 2"):
        evaluate(x, metrics=("isc",))
    assert evaluate(x, metrics=("isc",), isc_splits=2)["is_mean"] > 1.0


def test_course_fid_isc_on_five_images_is_not_one(tmp_path):
    x = Digits("valid", size=8, dtype="uint8").images[:5, 0].numpy()
    folder = write_pngs(tmp_path / "five", x)
    rc, out, err = run_fid(folder, "digits-train", "--isc", "--json")
    assert rc == 0, err
    res = json.loads(out)
    assert res["is_mean"] > 1.0 and "IS over 5 images: 2 splits of 2" in err
    rc, _, err = run_fid(write_pngs(tmp_path / "three", x[:3]), "digits-train", "--isc")
    assert rc == 2 and "--isc needs at least 4 images in A" in err


def test_one_resize_pipeline_for_folders_tensors_and_references(train_pngs):
    """The training digits as 8x8 PNG files against their own reference statistics: 0 at every size (FID 2.03
    at size 16 when folders were resized with another filter than references)."""
    folder, n = train_pngs
    for size in ("16", "32"):
        rc, out, err = run_fid(folder, "digits-train", "--size", size, "--json")
        assert rc == 0, err
        res = json.loads(out)
        assert res["n_a"] == n and abs(res["fid"]) < 1e-6, (size, res)
    rc, out, err = run_fid(folder, "digits-train", "--json")         # no --size: the reference at A's size
    assert rc == 0 and abs(json.loads(out)["fid"]) < 1e-6, (out, err)
    x = as_uint8_images(folder, size=16)
    assert torch.equal(x, as_uint8_images("digits-train", size=16)) or \
        torch.equal(x.sort(0).values, as_uint8_images("digits-train", size=16).sort(0).values)


def test_mixed_sizes_message_names_the_flag(tmp_path):
    folder = write_pngs(tmp_path / "mixed", [np.zeros((8, 8)), np.zeros((9, 9))])
    rc, _, err = run_fid(folder, "digits-train")
    assert rc == 2 and "--size N" in err and "8x8 (1 image)" in err


def test_sampling_function_value_range_decided_once():
    "0.5 must be the same uint8 in every batch, whether or not the batch happens to hold a negative value."
    calls = []
    def sampler(bs):
        x = torch.full((bs, 1, 4, 4), 0.5)
        if not calls: x[0, 0, 0, 0] = -1.0              # only the first batch shows that the range is [-1, 1]
        calls.append(bs)
        return x
    u8 = as_uint8_images(sampler, num_samples=6, batch_size=2)
    assert len(calls) == 3
    values = sorted(set(u8.flatten().tolist()))
    assert values == [0, 191], values                    # (0.5 + 1) / 2 * 255 = 191.25 -> 191 in every batch


def test_transparent_images_drop_alpha_as_torch_fidelity(tmp_path):
    x = Digits("valid", size=8, dtype="uint8").images[:20, 0].numpy()
    rgba = np.stack([x, x, x, np.where(x > 0, 255, 0)], -1)
    transparent = write_pngs(tmp_path / "rgba", rgba, "RGBA")
    opaque = write_pngs(tmp_path / "grey", x)
    with pytest.warns(UserWarning, match=r"20 image\(s\) .* alpha channel .* dropped"):
        got = as_uint8_images(transparent)
    assert torch.equal(got, as_uint8_images(opaque))
    with warnings.catch_warnings():
        warnings.simplefilter("error")                  # no alpha warning for opaque files
        as_uint8_images(opaque)
