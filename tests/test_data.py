"""The data module: the embedded digits and the folder loader's edge cases."""
import numpy as np
import pytest
import torch
from PIL import Image

from course_lib.core import OfflineError
from course_lib.data import (
    Digits, ImageFolder, scan_image_folder, open_image, to_float, to_uint8, load_torchvision)


def test_digits_split_is_stratified_and_deterministic():
    tr, va = Digits("train"), Digits("valid")
    assert len(tr) + len(va) == 1797
    assert torch.equal(Digits("valid").labels, va.labels)
    counts = torch.bincount(va.labels)
    assert counts.min() >= 34 and counts.max() <= 38   # 20% of each class (174-183 images per class)


@pytest.mark.parametrize("size,channels,dtype", [(8, 1, "float"), (16, 3, "uint8"), (32, 1, "uint8")])
def test_digits_shapes_and_ranges(size, channels, dtype):
    d = Digits("all", size=size, channels=channels, dtype=dtype)
    x, y = d[5]
    assert x.shape == (channels, size, size)
    if dtype == "float":                   # exactly the uint8 pixels mapped to [-1, 1]
        u8 = Digits("all", size=size, channels=channels, dtype="uint8").images
        assert x.dtype == torch.float32 and torch.equal(d.images, u8.float() / 127.5 - 1)
    else: assert x.dtype == torch.uint8 and int(d.images.max()) == 255


def test_digits_classes_filter():
    d = Digits("train", classes=[3, 7])
    assert set(d.labels.tolist()) == {3, 7}


@pytest.mark.parametrize("kw,msg", [({"size": 12}, "size=12"), ({"split": "test"}, "split='test'"),
                                     ({"channels": 2}, "channels=2"), ({"dtype": "half"}, "dtype='half'"),
                                     ({"classes": [11]}, "digits 0-9")])
def test_digits_bad_arguments(kw, msg):
    with pytest.raises(ValueError, match=msg.replace("(", r"\(").replace(")", r"\)")): Digits(**kw)


def test_float_uint8_round_trip():
    u = Digits("all", dtype="uint8").images
    assert torch.equal(to_uint8(to_float(u)), u)
    with pytest.raises(TypeError): to_float(u.float())



def test_folder_with_corrupt_truncated_empty_and_non_image(tmp_path):
    Image.fromarray(np.full((20, 20, 3), 100, np.uint8)).save(tmp_path / "good.png")
    Image.fromarray(np.full((20, 20, 3), 50, np.uint8)).save(tmp_path / "good.jpg")
    data = (tmp_path / "good.jpg").read_bytes()
    (tmp_path / "truncated.jpg").write_bytes(data[: len(data) // 2])
    (tmp_path / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"garbage" * 10)
    (tmp_path / "zero.webp").write_bytes(b"")
    (tmp_path / "readme.txt").write_text("hello")
    (tmp_path / "fake.png").write_text("not really a png")
    with pytest.warns(UserWarning, match="skipped"):
        ds = ImageFolder(tmp_path, size=8)
    assert sorted(p.name for p in ds.files) == ["good.jpg", "good.png"]
    reasons = {p.name: why for p, why in ds.report.skipped}
    assert set(reasons) == {"truncated.jpg", "corrupt.png", "zero.webp", "readme.txt", "fake.png"}
    assert "0 bytes" in reasons["zero.webp"] and "extension" in reasons["readme.txt"]
    assert ds[0].shape == (3, 8, 8)


def test_empty_folder_and_missing_folder(tmp_path):
    with pytest.raises(ValueError, match="no usable images"): ImageFolder(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"): ImageFolder(tmp_path / "nope")
    (tmp_path / "f.png").write_bytes(b"x")
    with pytest.raises(NotADirectoryError): scan_image_folder(tmp_path / "f.png")


def test_modes_are_converted(tmp_path):
    rgba = np.zeros((10, 10, 4), np.uint8); rgba[..., 3] = 0                     # fully transparent -> white
    Image.fromarray(rgba, "RGBA").save(tmp_path / "rgba.png")
    Image.fromarray(np.full((10, 10, 3), 30, np.uint8)).convert("P").save(tmp_path / "pal.gif")
    Image.fromarray(np.full((10, 10, 3), 200, np.uint8)).convert("CMYK").save(tmp_path / "cmyk.jpg")
    Image.fromarray(np.full((10, 10), 65535, np.uint16)).save(tmp_path / "deep.png")
    assert np.asarray(open_image(tmp_path / "rgba.png")).min() == 255
    assert open_image(tmp_path / "pal.gif").mode == "RGB"
    assert open_image(tmp_path / "cmyk.jpg").mode == "RGB"
    assert np.asarray(open_image(tmp_path / "deep.png", "L")).min() == 255


def test_exif_orientation_applied(tmp_path):
    a = np.zeros((10, 20, 3), np.uint8)                                        # 20 wide, 10 high
    im = Image.fromarray(a); exif = im.getexif(); exif[0x0112] = 6             # rotate 90 degrees
    im.save(tmp_path / "rot.jpg", exif=exif)
    assert open_image(tmp_path / "rot.jpg").size == (10, 20)


def test_subfolder_labels(tmp_path):
    for cls in ["cat", "dog"]:
        (tmp_path / cls).mkdir()
        for i in range(2): Image.fromarray(np.full((9, 9, 3), i * 50, np.uint8)).save(tmp_path / cls / f"{i}.png")
    ds = ImageFolder(tmp_path, size=4, labels="subfolder", dtype="uint8")
    assert ds.classes == ["cat", "dog"] and sorted(ds.targets) == [0, 0, 1, 1]
    x, y = ds[0]
    assert x.dtype == torch.uint8 and x.shape == (3, 4, 4)


def test_offline_loader_names_embedded_alternative(tmp_path):
    with pytest.raises(OfflineError, match="Digits"):
        load_torchvision("fashion_mnist", root=tmp_path, download=False)
    with pytest.raises(ValueError, match="unknown data set"):
        load_torchvision("imagenet", root=tmp_path)
