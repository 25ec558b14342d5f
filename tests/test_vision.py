"""Unit 5 (vision): the timm registry helpers, checkpoints through timm's pretrained path, the fine-tuning
strategies, TTA/ensembles, export (TorchScript, ONNX with onnxruntime), int8, and `course finetune`.
Everything is tiny (a few steps of the course's 32x32 models) and nothing is downloaded."""
import json

import numpy as np
import pytest
import timm
import torch
import torch.nn as nn
from PIL import Image
from safetensors.torch import save_file
from timm.data import create_transform

from course_lib.data import Digits, split_indices
from course_lib.vision import (
    check_model_name, count_flops, count_params, model_data_config, normalize_images, target_task,
    save_model, create_vision_model, load_finetuned, checkpoint_info, finetune, FinetuneConfig,
    layer_groups, random_shift, tta_views, predict_logits, ensemble_logits, accuracy,
    choose_batch_size, export_onnx, export_torchscript, quantize_int8, model_size_bytes,
    evaluate, square_symmetries, label_augmented)
from course_lib.vision.folder_data import _folder_dataset
from course_lib.cli.finetune import finetune_main


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)      # tiny models: one thread is fastest and fair to the other test worker
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def src_file(tmp_path_factory):
    "A 'pretrained' 5-class course_resnet_32 checkpoint (random weights: the tests need its format, not its skill)."
    torch.manual_seed(0)
    m = timm.create_model("course_resnet_32", num_classes=5)
    return save_model(m, tmp_path_factory.mktemp("ckpt") / "src.safetensors", task="test")


@pytest.fixture(scope="module")
def few():
    return target_task("train", 4), target_task("valid")


# ---- registry, FLOPs, data config --------------------------------------------------------------------------

def test_flop_counter_matches_closed_form():
    assert count_flops(nn.Linear(64, 10), (64,)) == 2 * 64 * 10
    assert count_flops(nn.Conv2d(3, 8, 3, padding=1, bias=False), (3, 16, 16)) == 2 * 3 * 8 * 9 * 16 * 16
    m = timm.create_model("course_vit_32", num_classes=5)
    assert count_params(m) == sum(p.numel() for p in m.parameters()) and count_flops(m, (1, 32, 32)) > 0


def test_vit_flops_match_closed_form():
    "course_vit_32 by hand: 4x4 patches (64 + class token = 65 tokens), width 96, MLP 192, 4 blocks, 5 classes."
    t, d, h = 65, 96, 192
    block = 2 * t * d * 3 * d + 2 * t * d * d + 2 * t * d * h + 2 * t * h * d   # qkv, proj, fc1, fc2
    block += 2 * (2 * t * t * d)                                                # q k^T and attn v, all heads
    total = 2 * 16 * d * 64 + 4 * block + 2 * d * 5                             # patch embed, blocks, head
    assert count_flops(timm.create_model("course_vit_32", num_classes=5), (1, 32, 32)) == total


def test_course_models_are_registered_with_truthful_configs():
    assert {"course_resnet_32", "course_vit_32"} <= set(timm.list_models("course_*"))
    for name in ("course_resnet_32", "course_vit_32"):
        m = timm.create_model(name, num_classes=3)
        assert m(torch.zeros(2, 1, 32, 32)).shape == (2, 3)
        assert model_data_config(m)["input_size"] == (1, 32, 32)


def test_unknown_model_name_suggests_close_names():
    with pytest.raises(ValueError, match="resnet18"): check_model_name("resnet19")
    with pytest.raises(ValueError, match="not in the timm registry"): create_vision_model("course_resnet_33", 5)
    assert check_model_name("resnet18.a1_in1k") == "resnet18.a1_in1k"


def test_data_config_pitfall_fixed_and_matches_timm_transform():
    m = timm.create_model("resnet18", in_chans=1, num_classes=10)
    assert timm.data.resolve_model_data_config(m)["input_size"][0] == 3          # the pitfall
    cfg = model_data_config(m, img_size=32)
    assert cfg["input_size"] == (1, 32, 32) and len(cfg["mean"]) == 1
    # reference: timm's own eval transform on a PIL digit == our tensor normalisation
    d = Digits("valid", size=32, dtype="uint8")
    pil = Image.fromarray(d.images[3, 0].numpy(), "L")
    ref = create_transform(**cfg)(pil)
    ours = normalize_images(Digits("valid", size=32).images[3:4], cfg)[0]
    assert (ref - ours).abs().max().item() < 1e-5
    with pytest.raises(ValueError, match="img_size=32"):
        model_data_config(timm.create_model("vit_tiny_patch16_224"), img_size=32)


def test_in_chans_mismatch_of_images_is_an_error():
    cfg = model_data_config(timm.create_model("course_resnet_32"))
    with pytest.raises(ValueError, match="in_chans mismatch"):
        normalize_images(torch.zeros(2, 3, 32, 32), cfg)
    with pytest.raises(ValueError, match="16x16"):
        normalize_images(torch.zeros(2, 1, 16, 16), cfg)


# ---- checkpoints through timm's pretrained path ------------------------------------------------------------

def test_pretrained_path_new_head_and_reload_trap(src_file):
    torch.manual_seed(0)
    ref = timm.create_model("course_resnet_32", num_classes=5).eval()   # the model src_file saved, rebuilt
    sd = {k: v for k, v in load_finetuned(src_file).state_dict().items()}
    assert sd.keys() == ref.state_dict().keys() and all(torch.equal(v, sd[k]) for k, v in ref.state_dict().items())
    x = torch.randn(3, 1, 32, 32)
    # reload with the file's class count in the overlay: identical model (head kept)
    again = load_finetuned(src_file)
    assert torch.equal(again.fc.weight, sd["fc.weight"])
    # the trap: only `file` in the overlay -> timm re-initialises the head (registered cfg says 10 classes)
    naive = timm.create_model("course_resnet_32", num_classes=5, pretrained=True,
                              pretrained_cfg_overlay=dict(file=str(src_file)))
    assert torch.equal(naive.conv1.weight, sd["conv1.weight"]) and not torch.equal(naive.fc.weight, sd["fc.weight"])
    # a new head for another class count: body loaded, head fresh with the new shape
    m7 = create_vision_model("course_resnet_32", 7, pretrained_file=src_file)
    assert m7.fc.weight.shape == (7, 256) and torch.equal(m7.conv1.weight, sd["conv1.weight"])
    m5 = create_vision_model("course_resnet_32", 5, pretrained_file=src_file, new_head=True)
    assert not torch.equal(m5.fc.weight, sd["fc.weight"])
    with torch.no_grad(): assert torch.allclose(again.eval()(x), ref(x), atol=1e-6)


def test_checkpoint_of_wrong_architecture(src_file, tmp_path):
    with pytest.raises(ValueError, match="course_resnet_32"):
        create_vision_model("course_vit_32", 5, pretrained_file=src_file)
    # no header: detected from the tensors
    plain = tmp_path / "plain.safetensors"
    save_file(timm.create_model("resnet10t", in_chans=1, num_classes=5).state_dict(), str(plain))
    with pytest.raises(ValueError, match="does not fit"):
        create_vision_model("course_resnet_32", 5, pretrained_file=plain)
    junk = tmp_path / "junk.safetensors"; junk.write_bytes(b"not safetensors")
    with pytest.raises(ValueError, match="not a safetensors"): checkpoint_info(junk)
    with pytest.raises(FileNotFoundError): create_vision_model("course_resnet_32", 5, pretrained_file=tmp_path / "none.safetensors")


def test_checkpoint_in_chans_mismatch(src_file):
    with pytest.raises(ValueError, match="in_chans mismatch.*in_chans=1"):
        create_vision_model("course_resnet_32", 5, pretrained_file=src_file, in_chans=3)


# ---- fine-tuning -------------------------------------------------------------------------------------------

def test_random_shift_is_a_translation():
    x = torch.zeros(4, 1, 8, 8); x[:, :, 3:5, 3:5] = 1
    g = torch.Generator().manual_seed(0)
    y = random_shift(x, 2, g)
    assert y.shape == x.shape and torch.equal(y.sum((1, 2, 3)), x.sum((1, 2, 3)))
    assert torch.equal(random_shift(x, 0), x)


def test_label_augmentation_joins_class_and_symmetry():
    x = torch.arange(2 * 16, dtype=torch.float32).reshape(2, 1, 4, 4)     # no symmetry: 8 distinct views
    views = square_symmetries(x, "d4")
    assert len(views) == 8 and len({tuple(v[0].flatten().tolist()) for v in views}) == 8
    assert len(square_symmetries(x, "rot4")) == 4 and torch.equal(square_symmetries(x, "none")[0], x)
    ds = label_augmented(torch.utils.data.TensorDataset(x, torch.tensor([0, 3])), "d4")
    xs, ys = ds.tensors
    assert xs.shape == (16, 1, 4, 4) and ys.tolist() == [y * 8 + k for k in range(8) for y in (0, 3)]
    assert torch.equal(xs[:2], x) and torch.equal(xs[2:4], torch.rot90(x, 1, (2, 3)))
    with pytest.raises(ValueError, match="unknown symmetries"):
        square_symmetries(x, "rot8")


def test_layer_decay_needs_timm_scheduler():
    from timm.optim import create_optimizer_v2
    from timm.scheduler import CosineLRScheduler
    m = timm.create_model("course_vit_32", num_classes=5)
    opt = create_optimizer_v2(m, "adamw", lr=1e-3, layer_decay=0.5)
    CosineLRScheduler(opt, t_initial=10, t_in_epochs=False).step_update(3)
    top = max(pg["lr"] for pg in opt.param_groups)
    for pg in opt.param_groups: assert pg["lr"] == pytest.approx(top * pg["lr_scale"], rel=1e-9)
    assert len({pg["lr_scale"] for pg in opt.param_groups}) == len(layer_groups(m))
    opt = create_optimizer_v2(m, "adamw", lr=1e-3, layer_decay=0.5)
    s = torch.optim.lr_scheduler.StepLR(opt, 1); opt.step(); s.step()
    assert len({pg["lr"] for pg in opt.param_groups}) == 1          # plain torch ignores lr_scale


def test_linear_probe_trains_only_the_head(src_file, few):
    tr, va = few
    r = finetune("course_resnet_32", tr, va, "linear", pretrained_file=src_file, config=FinetuneConfig(steps=3, eval_every=3))
    src = load_finetuned(src_file).state_dict()
    sd = r.model.state_dict()
    body = [k for k in src if not k.startswith("fc.")]
    assert all(torch.equal(sd[k], src[k]) for k in body if not k.endswith("num_batches_tracked"))
    assert not torch.equal(sd["fc.weight"], src["fc.weight"])
    assert len(r.history) == 1 and r.history[0]["step"] == 3
    xs, ys = va.tensors                                                 # the accuracy, recomputed by hand
    with torch.no_grad(): hand = (r.model.eval()(normalize_images(xs, model_data_config(r.model))).argmax(-1) == ys)
    assert r.val_acc == pytest.approx(hand.double().mean().item(), abs=1e-12) and r.history[0]["val_acc"] == r.val_acc


def test_gradual_unfreezing_starts_with_the_head(src_file, few):
    tr, _ = few
    n_groups = len(layer_groups(timm.create_model("course_resnet_32", num_classes=5)))
    assert n_groups > 2
    # 2 steps with one group unfrozen per step: the head and the last stage move, the stem does not
    r = finetune("course_resnet_32", tr, None, "gradual", pretrained_file=src_file, config=FinetuneConfig(steps=2))
    src = load_finetuned(src_file).state_dict()
    assert torch.equal(r.model.conv1.weight, src["conv1.weight"]) and torch.equal(r.model.layer1[0].conv1.weight, src["layer1.0.conv1.weight"])
    assert not torch.equal(r.model.layer4[0].conv1.weight, src["layer4.0.conv1.weight"])


def test_full_and_scratch_and_bad_strategy(src_file, few):
    tr, va = few
    a = finetune("course_resnet_32", tr, va, "full", pretrained_file=src_file, config=FinetuneConfig(steps=2, eval_every=1))
    b = finetune("course_resnet_32", tr, va, "full", pretrained_file=src_file, config=FinetuneConfig(steps=2, eval_every=1))
    assert [h["val_acc"] for h in a.history] == [h["val_acc"] for h in b.history]     # seeded
    assert a.val_acc == evaluate(a.model, va)
    vit_file = save_model(timm.create_model("course_vit_32", num_classes=5), src_file.parent / "vit.safetensors")
    r = finetune("course_vit_32", tr, None, "lld", pretrained_file=vit_file, config=FinetuneConfig(steps=1))
    assert r.model.num_classes == 5 and r.history == []
    with pytest.raises(ValueError, match="unknown strategy"): finetune("course_resnet_32", tr, None, "best")
    with pytest.raises(ValueError, match="needs pretrained_file"): finetune("course_resnet_32", tr, None, "full")


# ---- inference and export ----------------------------------------------------------------------------------

def test_tta_views_and_ensemble():
    x = torch.randn(2, 1, 32, 32)
    assert len(tta_views(x, "none")) == 1 and len(tta_views(x, "flip+crops")) == 10
    assert torch.equal(tta_views(x, "crops")[0], x)                  # the centre crop of the padded image
    with pytest.raises(ValueError, match="unknown tta"): tta_views(x, "rotate")
    m = timm.create_model("course_resnet_32", num_classes=5).eval()
    xs = torch.rand(6, 1, 32, 32) * 2 - 1
    m2 = timm.create_model("course_resnet_32", num_classes=5).eval()     # other random weights
    with torch.no_grad():
        xn = normalize_images(xs, model_data_config(m))
        assert torch.allclose(predict_logits(m, xs), m(xn), atol=1e-6)
        assert torch.allclose(ensemble_logits([m, m2], xs), (m(xn) + m2(xn)) / 2, atol=1e-6)
    zf = predict_logits(m, xs, tta="flip")
    with torch.no_grad():
        cfg = model_data_config(m); xn = normalize_images(xs, cfg)
        assert torch.allclose(zf, (m(xn) + m(xn.flip(-1))) / 2, atol=1e-5)
    assert accuracy(torch.eye(3), torch.tensor([0, 1, 0])) == pytest.approx(2 / 3)


def test_choose_batch_size_stops_on_oom():
    calls = []
    def fn(x):
        calls.append(len(x))
        if len(x) >= 16: raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return x * 2
    best, table = choose_batch_size(fn, (1, 4, 4), candidates=(1, 2, 4, 8, 16, 32), device="cpu", min_time=0.01)
    assert sorted(table) == [1, 2, 4, 8] and best in table and 32 not in calls
    def boom(x): raise RuntimeError("shape mismatch")
    with pytest.raises(RuntimeError, match="shape mismatch"): choose_batch_size(boom, (1, 4, 4), (1,), device="cpu")


@pytest.mark.parametrize("name", ["course_resnet_32", "course_vit_32"])
def test_exports_match_pytorch(name, tmp_path):
    "The exported files, loaded here by onnxruntime and torch.jit, give the PyTorch model's logits."
    import onnx, onnxruntime as ort
    torch.manual_seed(0)
    m = timm.create_model(name, num_classes=5).eval()
    ex = torch.randn(2, 1, 32, 32)
    x = torch.rand(7, 1, 32, 32, generator=torch.Generator().manual_seed(1)) * 2 - 1   # a batch size not checked
    with torch.no_grad(): want = m(x)
    # measured (seeds 0-2, both models): ONNX max |diff| 2.1e-7 (logits ~0.1-0.4), TorchScript 0.0;
    # tolerance 1e-6 for both, about 5x the ONNX figure
    p, d = export_onnx(m, tmp_path / "m.onnx", ex, check_batch_sizes=(1, 3, 9))
    sess = ort.InferenceSession(str(p), providers=["CPUExecutionProvider"])
    assert [i.name for i in sess.get_inputs()] == ["x"] and [o.name for o in sess.get_outputs()] == ["logits"]
    got = torch.from_numpy(sess.run(None, {"x": x.numpy()})[0])
    assert got.shape == (7, 5) and (got - want).abs().max().item() < 1e-6 and d < 1e-6
    meta = {q.key: json.loads(q.value) for q in onnx.load(str(p)).metadata_props}
    assert meta["input_size"] == [1, 32, 32]
    p, d = export_torchscript(m, tmp_path / "m.pt", ex)
    with torch.no_grad(): got = torch.jit.load(str(p))(x)
    assert got.shape == (7, 5) and (got - want).abs().max().item() < 1e-6 and d < 1e-6


def test_int8_quantisation_shrinks_a_vit():
    torch.manual_seed(0)
    m = timm.create_model("course_vit_32", num_classes=5).eval()
    q = quantize_int8(m)
    x = torch.randn(4, 1, 32, 32)
    assert model_size_bytes(q) < 0.6 * model_size_bytes(m)
    # max |int8 - float| logit: measured 0.013-0.020 over seeds 0-4 (logits up to ~0.4); tolerance 0.04, 2x.
    # Above 1e-4 too: the int8 model is really another model
    with torch.no_grad(): err = (q(x) - m(x)).abs().max().item()
    assert 1e-4 < err < 0.04, err


# ---- the command line --------------------------------------------------------------------------------------

def _folder(root, classes=(5, 6), n=5, corrupt=True):
    ds = Digits("train", size=32, dtype="uint8", classes=list(classes))
    for c in classes:
        (root / f"d{c}").mkdir(parents=True, exist_ok=True)
        imgs = ds.images[ds.labels == c][:n]
        for i, im in enumerate(imgs): Image.fromarray(im[0].numpy(), "L").save(root / f"d{c}" / f"{i}.png")
    if corrupt: (root / f"d{classes[0]}" / "broken.png").write_bytes(b"\x89PNG truncated")
    return root


def test_course_finetune_on_a_folder(tmp_path, src_file, capsys):
    from course_lib.cli import main
    folder = _folder(tmp_path / "imgs")
    out = tmp_path / "out"
    rc = main(["finetune", str(folder), "--model", "course_resnet_32", "--pretrained", str(src_file),
               "--strategy", "lld", "--steps", "3", "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 0, err
    assert "broken.png" in err
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["classes"] == ["d5", "d6"] and metrics["n_train"] + metrics["n_valid"] == 10
    assert [s["file"] for s in metrics["skipped"]] == ["d5/broken.png"]
    m = load_finetuned(out / "model.safetensors")
    x, y, _, _ = _folder_dataset(folder, 32, 1)                      # the validation split, rebuilt here
    _, va = split_indices(y.numpy(), 0.2, 0)
    with torch.no_grad(): hand = (m.eval()(normalize_images(x[va], model_data_config(m))).argmax(-1) == y[va])
    assert len(va) == metrics["n_valid"] and metrics["val_acc"] == pytest.approx(hand.double().mean().item())
    assert m.num_classes == 2 and json.loads(checkpoint_info(out / "model.safetensors")[1]["classes"]) == ["d5", "d6"]
    # a generic timm model from scratch, 3 channels
    rc = finetune_main([str(folder), "--model", "resnet10t", "--img-size", "32", "--in-chans", "3", "--steps", "1",
                        "--out", str(tmp_path / "out3")])
    assert rc == 0, capsys.readouterr().err


@pytest.mark.parametrize("case,msg", [
    ("empty_class", "no usable image"), ("bad_name", "did you mean"), ("in_chans", "in_chans mismatch"),
    ("wrong_arch", "course_resnet_32"), ("no_pretrained", "needs --pretrained"), ("missing_dir", "not a folder")])
def test_course_finetune_bad_input(case, msg, tmp_path, src_file, capsys):
    folder = _folder(tmp_path / "imgs", corrupt=False)
    args = [str(folder), "--model", "course_resnet_32", "--steps", "1", "--out", str(tmp_path / "o")]
    if case == "empty_class": (folder / "d7").mkdir(); (folder / "d7" / "x.png").write_bytes(b"")
    if case == "bad_name": args[2] = "course_resnet_31"
    if case == "in_chans": args += ["--pretrained", str(src_file), "--in-chans", "3"]
    if case == "wrong_arch": args[2] = "course_vit_32"; args += ["--pretrained", str(src_file)]
    if case == "no_pretrained": args += ["--strategy", "linear"]
    if case == "missing_dir": args[0] = str(tmp_path / "nothing")
    assert finetune_main(args) == 2
    assert msg in capsys.readouterr().err
