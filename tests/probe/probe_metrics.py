"""Unit 3's features on the accelerator (under the device probe): the extractor runs on the device and the
features come back as float64 on the CPU (on 767c4b0 `extract_features` cast to float64 on the device first,
which MPS refuses)."""
import torch

from course_lib.core import kind
from course_lib.metrics import extract_features

DEV = kind()


def test_extract_features_float64_on_the_cpu():
    x = torch.randint(0, 256, (6, 1, 8, 8), dtype=torch.uint8)
    out = extract_features(x, batch_size=4)
    assert out["features"].dtype == torch.float64 and out["features"].device.type == "cpu"
    assert out["features"].shape == (6, 128) and torch.isfinite(out["logits"]).all()
