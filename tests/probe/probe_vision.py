"""Unit 5's evaluation and export on the accelerator (under the device probe): inputs follow the model's device
(on 767c4b0 `evaluate` and `predict_logits` sent them to `get_device()`, so a model kept on the CPU failed on a
machine with a GPU), and the exports of a model on the device are faithful CPU graphs."""
import pytest
import timm
import torch
from torch.utils.data import TensorDataset

import course_lib.vision.registry  # noqa: F401  (registers the course's timm models)
from course_lib.core import kind
from course_lib.vision import export_onnx, export_torchscript, predict_logits
from course_lib.vision import evaluate

DEV = kind()


def model(where):
    torch.manual_seed(0)
    return timm.create_model("course_resnet_32", num_classes=3).eval().to(where)


@pytest.mark.parametrize("where", ["cpu", "device"])
def test_evaluation_follows_the_model(where):
    m = model("cpu" if where == "cpu" else DEV)
    x, y = torch.rand(6, 1, 32, 32) * 2 - 1, torch.tensor([0, 1, 2, 0, 1, 2])
    acc = evaluate(m, TensorDataset(x, y), batch_size=4)
    assert 0 <= acc <= 1
    logits = predict_logits(m, x, batch_size=4, tta="flip")
    assert logits.shape == (6, 3) and logits.device.type == "cpu"


def test_exports_of_a_model_on_the_device(tmp_path):
    m = model(DEV)
    example = torch.rand(2, 1, 32, 32, device=DEV)
    _, d_ts = export_torchscript(m, tmp_path / "m.pt", example)
    _, d_onnx = export_onnx(m, tmp_path / "m.onnx", example)
    assert d_ts <= 1e-4 and d_onnx <= 1e-4
