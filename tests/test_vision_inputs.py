"""Unit 5 (vision) off the lesson's path: image folders split into train/val, tiny classes, backbone-only
checkpoints, and the input size a model was trained at (checkpoint header, reload, ONNX metadata).
Issue 17, kind 3. Tiny models, a step or two of training, nothing downloaded."""
import json

import numpy as np
import pytest
import timm
import torch
from PIL import Image
from safetensors.torch import save_file
from torch.utils.data import TensorDataset

from course_lib.data import Digits, ImageFolder, split_indices
from course_lib.vision import (
    FinetuneConfig, checkpoint_info, check_checkpoint, create_vision_model, export_onnx, finetune,
    load_finetuned, model_data_config, predict_logits, save_model)
from course_lib.cli.finetune import finetune_main


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _images(root, classes=("zero", "one"), n=3, digit0=0):
    "n real digit images a class, as 32x32 greyscale PNGs under root/CLASS/."
    ds = Digits("train", size=32, dtype="uint8")
    for k, c in enumerate(classes):
        (root / c).mkdir(parents=True, exist_ok=True)
        imgs = ds.images[ds.labels == digit0 + k][:n]
        for i, im in enumerate(imgs): Image.fromarray(im[0].numpy(), "L").save(root / c / f"{i}.png")
    return root


def _tiny(n=6, size=32, c=1, k=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.rand(n, c, size, size, generator=g) * 2 - 1, torch.arange(n) % k)


# ---- image folders -----------------------------------------------------------------------------------------

def test_image_folder_refuses_a_split_layout(tmp_path):
    "ROOT/train/{zero,one} and ROOT/val/{zero,one} read as classes 'train' and 'val' before; now refused."
    root = tmp_path / "digits"
    _images(root / "train")
    _images(root / "val", n=2)
    with pytest.raises(ValueError, match=r"split into \['train', 'val'\].*ImageFolder\(.*train"):
        ImageFolder(root, labels="subfolder", channels=1)
    ds = ImageFolder(root / "train", labels="subfolder", channels=1)     # one split: its classes
    assert ds.classes == ["one", "zero"] and len(ds) == 6
    assert len(ImageFolder(root, channels=1)) == 10                     # unlabelled: every image, as before


def test_split_folders_names_and_refusals(tmp_path):
    from course_lib.data import split_folders
    a = tmp_path / "a"
    for d in ["Training/x", "validation/x", "test/x"]: (a / d).mkdir(parents=True)
    assert split_folders(a) == {"train": a / "Training", "valid": a / "validation", "test": a / "test"}
    b = tmp_path / "b"
    for d in ["cat", "dog"]: (b / d).mkdir(parents=True)
    assert split_folders(b) is None                                     # one folder per class
    (b / "train").mkdir()
    with pytest.raises(ValueError, match=r"mixes split folders \['train'\] with other folders \['cat', 'dog'\]"):
        split_folders(b)
    c = tmp_path / "c"
    for d in ["train", "val", "valid"]: (c / d).mkdir(parents=True)
    with pytest.raises(ValueError, match=r"several folders for a split \{'valid': \['val', 'valid'\]\}"):
        split_folders(c)
    d = tmp_path / "d"
    for x in ["val", "test"]: (d / x).mkdir(parents=True)
    with pytest.raises(ValueError, match="no training split"): split_folders(d)


def test_split_keeps_a_training_image_in_every_class():
    "A class of one image with valid_frac 0.6 went wholly to validation (round(0.6) = 1)."
    y = np.array([0] * 5 + [1] + [2] * 2)
    for frac in (0.2, 0.6, 0.9):
        tr, va = split_indices(y, frac, seed=0)
        assert sorted(np.concatenate([tr, va]).tolist()) == list(range(8))
        assert set(y[tr].tolist()) == {0, 1, 2}, (frac, y[tr])
    tr, va = split_indices(y, 0.6, seed=0)
    assert np.bincount(y[va], minlength=3).tolist() == [3, 0, 1]         # round(5 * 0.6), none of 1, min(1, 2 - 1)
    # larger classes are split as before (the digits' 80/20 split is unchanged): round(n * 0.2) a class
    labels = Digits("all").labels.numpy()
    tr, va = split_indices(labels, 0.2, seed=0)
    assert np.bincount(labels[va]).tolist() == [int(round(n * 0.2)) for n in np.bincount(labels)]


# ---- checkpoints -------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def body(tmp_path_factory):
    "A course_resnet_32 saved without its classifier (a backbone), and the model it came from."
    torch.manual_seed(0)
    m = timm.create_model("course_resnet_32", num_classes=5)
    d = tmp_path_factory.mktemp("bb")
    save_file({k: v for k, v in m.state_dict().items() if not k.startswith("fc.")}, str(d / "bb.safetensors"))
    save_file({k: v for k, v in m.state_dict().items() if k != "fc.bias"}, str(d / "half.safetensors"))
    save_model(m, d / "full.safetensors")
    return m, d


@pytest.mark.parametrize("k", [1, 5, 10, 0])
def test_backbone_checkpoint_loads_for_any_class_count(body, k):
    "10 (the registered default) failed with a raw `Missing key(s) ... fc.weight, fc.bias`."
    m, d = body
    check_checkpoint(timm.create_model("course_resnet_32", num_classes=k), d / "bb.safetensors")
    got = create_vision_model("course_resnet_32", k, pretrained_file=d / "bb.safetensors")
    assert torch.equal(got.conv1.weight, m.conv1.weight) and torch.equal(got.layer4[0].conv2.weight,
                                                                          m.layer4[0].conv2.weight)
    assert got.num_classes == k and (k == 0 or tuple(got.fc.weight.shape) == (k, 256))


@pytest.mark.parametrize("name", ["bb", "half", "full"])
@pytest.mark.parametrize("k", [5, 10])
def test_check_checkpoint_agrees_with_loading(body, name, k):
    "check_checkpoint passes exactly when loading works; what fails, fails with the same ValueError."
    _, d = body
    path = d / f"{name}.safetensors"
    try:
        check_checkpoint(timm.create_model("course_resnet_32", num_classes=k), path)
        checked = None
    except ValueError as e: checked = str(e)
    try:
        create_vision_model("course_resnet_32", k, pretrained_file=path)
        loaded = None
    except ValueError as e: loaded = str(e)
    assert checked == loaded
    assert (checked is None) == (name != "half")         # a half classifier (no fc.bias) is named, not loaded
    if name == "half": assert "only part of the classifier" in checked and "fc.bias" in checked


# ---- the input size a model was trained at -----------------------------------------------------------------

def test_vit_trained_at_another_size_reloads(tmp_path):
    "A ViT fine-tuned at another size than its default could not be reloaded (position embedding shape)."
    res = finetune("course_vit_32", _tiny(size=16), None, "scratch", num_classes=2,
                   config=FinetuneConfig(steps=1, batch_size=4, eval_every=1))
    path = save_model(res.model, tmp_path / "vit16.safetensors")
    assert json.loads(checkpoint_info(path)[1]["input_size"]) == [1, 16, 16]
    m = load_finetuned(path)
    x = torch.rand(3, 1, 16, 16) * 2 - 1
    assert model_data_config(m)["input_size"] == (1, 16, 16)
    import timm.data                                   # timm's own preprocessing reads the same size
    assert timm.data.resolve_data_config(model=m)["input_size"] == (1, 16, 16)
    assert torch.allclose(predict_logits(m, x, device="cpu"), predict_logits(res.model, x, device="cpu"))
    with pytest.raises(ValueError, match=r"img_size mismatch: .* trained on 16x16 .* built for 32x32: .*img_size=16"):
        load_finetuned(path, img_size=32)
    plain = tmp_path / "plain.safetensors"                           # no header: the size from the tensors
    save_file(res.model.state_dict(), str(plain))
    with pytest.raises(ValueError, match=r"trained on 16x16 .*img_size=16"):
        create_vision_model("course_vit_32", 2, pretrained_file=plain)


def test_cnn_trained_at_another_size_keeps_it(tmp_path):
    "resnet10t trained on 32x32 images: the header said 224 and the reloaded model refused 32x32 images."
    res = finetune("resnet10t", _tiny(size=32), None, "scratch", num_classes=2,
                   config=FinetuneConfig(steps=1, batch_size=4, eval_every=1))
    path = save_model(res.model, tmp_path / "r.safetensors")
    assert json.loads(checkpoint_info(path)[1]["input_size"]) == [1, 32, 32]
    m = load_finetuned(path)
    assert model_data_config(m)["input_size"] == (1, 32, 32) and model_data_config(m)["crop_pct"] == 1.0
    x = torch.rand(3, 1, 32, 32) * 2 - 1
    assert torch.allclose(predict_logits(m, x, device="cpu"), predict_logits(res.model, x, device="cpu"))
    assert model_data_config(load_finetuned(path, img_size=48))["input_size"] == (1, 48, 48)


def test_vit_family_not_named_vit_is_built_for_the_images():
    "finetune passed img_size only to models named '*vit*': a DeiT refused 32x32 images (built for 224)."
    res = finetune("deit_tiny_patch16_224", _tiny(n=4, size=32, c=3), None, "scratch", num_classes=2,
                   config=FinetuneConfig(steps=1, batch_size=2, eval_every=1))
    assert tuple(res.model.patch_embed.img_size) == (32, 32) and res.data_config["input_size"] == (3, 32, 32)


def test_onnx_metadata_says_what_the_graph_takes(tmp_path):
    "input_size in the ONNX metadata was the config's [3, 224, 224] while the graph took 64x64."
    import onnx
    torch.manual_seed(0)
    m = timm.create_model("resnet10t", num_classes=3).eval()
    p, _ = export_onnx(m, tmp_path / "m.onnx", torch.randn(1, 3, 64, 64), check_batch_sizes=(2,))
    proto = onnx.load(str(p))
    meta = {q.key: json.loads(q.value) for q in proto.metadata_props}
    dims = [d.dim_value or d.dim_param for d in proto.graph.input[0].type.tensor_type.shape.dim]
    assert dims == ["batch", 3, 64, 64] and meta["input_size"] == [3, 64, 64] and meta["crop_pct"] == 1.0
    assert meta["mean"] == pytest.approx([0.485, 0.456, 0.406])          # the rest of the config is kept
    with pytest.raises(ValueError, match=r"metadata input_size \[3, 224, 224\] but the graph takes \[3, 64, 64\]"):
        export_onnx(m, tmp_path / "n.onnx", torch.randn(1, 3, 64, 64), metadata=dict(input_size=[3, 224, 224]))
    assert not (tmp_path / "n.onnx").exists()


def test_onnx_export_is_the_dynamo_exporter_with_a_named_fallback():
    """export_onnx used the TorchScript-based exporter only (issue 46): it now runs the dynamo exporter (opset 18,
    the batch axis named `batch`), and where torch.export refuses a model it warns with torch.export's own error and
    traces instead."""
    import warnings
    import onnx, onnxruntime as ort
    from course_lib.vision.export_checks import onnx_bytes
    m = timm.create_model("course_resnet_32", num_classes=3).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)                   # no fallback for a course model
        proto = onnx.load_from_string(onnx_bytes(m, torch.randn(2, 1, 32, 32), 18))
    assert {o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")} == {18}
    assert proto.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "batch"

    class Gate(torch.nn.Module):
        def forward(self, x): return x.flatten(1) * 2 if x.mean() > 0 else -x.flatten(1)
    with pytest.warns(UserWarning, match=r"dynamo ONNX exporter failed \(GuardOnDataDependentSymNode: .*data-dep"):
        b = onnx_bytes(Gate(), torch.ones(2, 1, 4, 4), 18)
    sess = ort.InferenceSession(b, providers=["CPUExecutionProvider"])
    assert sess.run(None, {"x": np.ones((3, 1, 4, 4), np.float32)})[0].shape == (3, 16)      # traced, batch dynamic


# ---- course finetune ---------------------------------------------------------------------------------------

def test_course_finetune_uses_a_train_val_split(tmp_path, capsys):
    "ROOT/train/{zero,one} + ROOT/val/{zero,one} trained a two-class model of classes ['train', 'val']."
    root = tmp_path / "digits"
    _images(root / "train")
    _images(root / "val", n=2)
    _images(root / "test", n=1)
    out = tmp_path / "out"
    assert finetune_main([str(root), "--model", "course_resnet_32", "--steps", "1", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    m = json.loads((out / "metrics.json").read_text())
    assert m["classes"] == ["one", "zero"] and (m["n_train"], m["n_valid"]) == (6, 4)
    assert m["valid_from"] == "val" and m["splits"] == {"train": "train", "valid": "val", "test": "test"}
    assert "test/ was not used" in err
    # refusals, each naming what is wrong
    args = ["--model", "course_resnet_32", "--steps", "1", "--out", str(tmp_path / "o")]
    assert finetune_main([str(root), "--valid-frac", "0.3", *args]) == 2
    assert "has its own validation split val/: drop --valid-frac" in capsys.readouterr().err
    _images(root / "val", classes=("two",), n=1, digit0=2)
    assert finetune_main([str(root), *args]) == 2
    assert "class folder(s) ['two'] that" in capsys.readouterr().err
    _images(root / "cat")
    assert finetune_main([str(root), *args]) == 2
    assert "mixes split folders ['test', 'train', 'val'] with other folders ['cat']" in capsys.readouterr().err


def test_course_finetune_keeps_a_training_image_per_class(tmp_path, capsys):
    "One image in class 'one' and --valid-frac 0.6: it went to validation, 0.857 was reported, no warning."
    root = _images(tmp_path / "f", classes=("zero",), n=5)
    _images(root, classes=("one",), n=1, digit0=1)
    out = tmp_path / "out"
    rc = finetune_main([str(root), "--model", "course_resnet_32", "--steps", "1", "--valid-frac", "0.6",
                        "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 0, err
    m = json.loads((out / "metrics.json").read_text())
    assert (m["n_train"], m["n_valid"]) == (3, 3) and m["classes_without_valid"] == ["one"]   # 2 + 1, round(3.0)
    assert "class(es) ['one'] have no validation image" in err


def test_course_finetune_vit_img_size_is_saved_and_reused(tmp_path, capsys):
    "A ViT trained with --img-size did not reload; a checkpoint's size was ignored by --pretrained."
    root = _images(tmp_path / "f")
    out = tmp_path / "out"
    args = [str(root), "--model", "course_vit_32", "--steps", "1", "--img-size", "16", "--out", str(out)]
    assert finetune_main(args) == 0, capsys.readouterr().err
    m = load_finetuned(out / "model.safetensors")
    assert model_data_config(m)["input_size"] == (1, 16, 16)
    assert json.loads(checkpoint_info(out / "model.safetensors")[1]["input_size"]) == [1, 16, 16]
    args = [str(root), "--model", "course_vit_32", "--steps", "1", "--pretrained", str(out / "model.safetensors"),
            "--out", str(tmp_path / "again")]
    assert finetune_main(args) == 0, capsys.readouterr().err          # 16x16 from the checkpoint's header
    assert json.loads((tmp_path / "again" / "metrics.json").read_text())["img_size"] == 16
    assert finetune_main(args[:-2] + ["--img-size", "32", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "img_size mismatch" in err and "create it with img_size=16" in err


# ---- the input checks of course_lib.vision.checks (library notebook 55) ------------------------------------

def test_malformed_img_size_is_refused_by_the_data_config():
    "model_data_config took img_size=0 and (32, 32, 1) and returned a config no image fits; now refused."
    m = timm.create_model("course_resnet_32")
    for bad in (0, (32, 32, 1)):
        with pytest.raises(ValueError, match="img_size must be an int or"): model_data_config(m, img_size=bad)
    assert model_data_config(m, img_size=(24, 16))["input_size"] == (1, 24, 16)


def test_finetune_argument_checks_name_the_fix():
    from course_lib.vision import check_finetune_inputs, dataset_tensors
    ds = _tiny(n=4, size=8)
    with pytest.raises(ValueError, match="unknown strategy 'ful'"): finetune("course_resnet_32", ds, strategy="ful")
    with pytest.raises(ValueError, match="needs pretrained_file"): finetune("course_resnet_32", ds, strategy="lld")
    with pytest.raises(ValueError, match="steps must be >= 1"):
        finetune("course_resnet_32", ds, strategy="scratch", config=FinetuneConfig(steps=0))
    with pytest.raises(ValueError, match="not in the timm registry"):
        finetune("course_resnet_23", ds, strategy="scratch")
    with pytest.raises(ValueError, match="empty"):
        check_finetune_inputs("course_resnet_32", TensorDataset(torch.zeros(0, 1, 8, 8), torch.zeros(0)),
                              "scratch", ("scratch",), None, None, 1)
    items = [(x, int(y)) for x, y in ds]                       # any (x, y) dataset, not only a TensorDataset
    xs, ys = dataset_tensors(items)
    assert torch.equal(xs, ds.tensors[0]) and ys.dtype == torch.long and ys.tolist() == ds.tensors[1].tolist()
    _, _, k, kw = check_finetune_inputs("course_resnet_32", items, "scratch", ("scratch",), None, None, 1)
    assert k == 2 and kw == {"in_chans": 1, "img_size": 8}


def test_next_batch_walks_epochs_and_samples_small_sets():
    from course_lib.vision import next_batch
    g, perm, pos, seen = torch.Generator().manual_seed(0), torch.empty(0, dtype=torch.long), 0, []
    for _ in range(5):
        idx, perm, pos = next_batch(10, 5, g, perm, pos)
        seen.append(sorted(idx.tolist()))
    assert sorted(seen[0] + seen[1]) == list(range(10)) and sorted(seen[2] + seen[3]) == list(range(10))
    small, _, _ = next_batch(3, 8, g, torch.empty(0, dtype=torch.long), 0)
    assert len(small) == 8 and set(small.tolist()) <= {0, 1, 2}
