"""timm's training recipe in `finetune` (issue 46 item 3): each FinetuneConfig field and each `course finetune`
flag does what it says, on course_resnet_32 and a few steps. Notebook 51a_finetune_recipe builds the pieces."""
import json

import numpy as np
import pytest
import timm
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import course_lib.cli.finetune as cli
import course_lib.vision.transfer as transfer
from course_lib.vision import (
    FinetuneConfig, TrainRecipe, amp_dtype, evaluate, finetune, make_mixup, next_batch, normalize_images,
    random_shift, recipe_loss, save_model, target_task, warmup_updates)


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def src_file(tmp_path_factory):
    "A 'pretrained' 5-class course_resnet_32 checkpoint (random weights: the format matters, not the skill)."
    torch.manual_seed(0)
    m = timm.create_model("course_resnet_32", num_classes=5)
    return save_model(m, tmp_path_factory.mktemp("ckpt") / "src.safetensors", task="test")


@pytest.fixture(scope="module")
def data():
    tr = target_task("train", 4)                                    # 20 images, 4 a class
    va = target_task("valid")
    return tr, TensorDataset(va.tensors[0][:20], va.tensors[1][:20])


def run(src_file, data, monkeypatch, strategy="full", val=False, **cfg):
    """finetune with `cfg`, spying on the model's training forwards (inputs, conv1's output dtype, logits),
    the learning rate of every optimiser step, the weights after every step and the loss each update
    back-propagates. Returns `(result, spy)`."""
    spy = dict(x=[], logits=[], dtype=[], lr=[], weights=[], loss=[], data_config=None)
    make_model, make_opt = transfer.create_finetune_model, transfer.finetune_optimizer

    def model_spy(*a, **k):
        model, dc = make_model(*a, **k)
        spy["data_config"] = dc
        def pre(m, args):
            if m.training: spy["x"].append(args[0].detach().clone())
        def post(m, args, out):
            if m.training: spy["logits"].append(out.detach().float().clone())
        model.register_forward_pre_hook(pre)
        model.register_forward_hook(post)
        model.conv1.register_forward_hook(
            lambda m, a, out: spy["dtype"].append(out.dtype) if m.training else None)
        return model, dc

    def opt_spy(model, *a, **k):
        opt, sched, body = make_opt(model, *a, **k)
        opt.register_step_pre_hook(lambda o, *_: spy["lr"].append(max(g["lr"] for g in o.param_groups)))
        opt.register_step_post_hook(lambda o, *_: spy["weights"].append(
            {n: v.detach().clone() for n, v in model.state_dict().items() if v.is_floating_point()}))
        return opt, sched, body

    backward_step = TrainRecipe.backward_step
    def loss_spy(self, loss, *a, **k):
        spy["loss"].append(loss.item())
        return backward_step(self, loss, *a, **k)

    monkeypatch.setattr(transfer, "create_finetune_model", model_spy)
    monkeypatch.setattr(transfer, "finetune_optimizer", opt_spy)
    monkeypatch.setattr(TrainRecipe, "backward_step", loss_spy)
    tr, va = data
    conf = FinetuneConfig(**{"steps": 3, "batch_size": 4, "eval_every": 1, **cfg})
    res = finetune("course_resnet_32", tr, va if val else None, strategy, pretrained_file=src_file,
                   config=conf)
    return res, spy


def replay(data, spy, cfg):
    "The batches `(x, y)` the loop draws before any mixing: the seeded generator replayed."
    xs, ys = data[0].tensors
    g = torch.Generator().manual_seed(cfg.get("seed", 0))
    perm, pos, out = torch.empty(0, dtype=torch.long), 0, []
    for _ in range(cfg["steps"]):
        idx, perm, pos = next_batch(len(ys), cfg["batch_size"], g, perm, pos)
        out.append((normalize_images(random_shift(xs[idx], 2, g), spy["data_config"]), ys[idx]))
    return out


def smoothed_one_hot(y, k, eps):
    return F.one_hot(y, k).float() * (1 - eps) + eps / k


# ---- the default: nothing of the recipe ----------------------------------------------------------------------

def test_default_leaves_batches_and_loss_untouched(src_file, data, monkeypatch):
    cfg = dict(steps=3, batch_size=4)
    res, spy = run(src_file, data, monkeypatch, **cfg)
    for (x, y), xin, z, loss in zip(replay(data, spy, cfg), spy["x"], spy["logits"], spy["loss"]):
        assert torch.equal(xin, x)                                   # no mixing
        assert loss == pytest.approx(F.cross_entropy(z, y).item(), abs=1e-6)     # hard-label CE
    assert spy["dtype"] == [torch.float32] * 3                       # no autocast
    last = spy["weights"][-1]
    assert all(torch.equal(res.model.state_dict()[n], v) for n, v in last.items())   # no EMA
    assert isinstance(recipe_loss(FinetuneConfig()), torch.nn.CrossEntropyLoss)
    assert make_mixup(FinetuneConfig(), 5) is None


# ---- mixup and cutmix ----------------------------------------------------------------------------------------

def test_mixup_trains_on_convex_combinations_with_soft_targets(src_file, data, monkeypatch):
    from timm.loss import SoftTargetCrossEntropy
    targets, forward = [], SoftTargetCrossEntropy.forward
    monkeypatch.setattr(SoftTargetCrossEntropy, "forward",
                        lambda self, x, t: targets.append(t.clone()) or forward(self, x, t))
    cfg, eps = dict(steps=3, batch_size=4, mixup_alpha=0.4, label_smoothing=0.1), 0.1
    _, spy = run(src_file, data, monkeypatch, **cfg)
    assert len(targets) == 3
    lams = []
    for (x, y), xin, t, z, loss in zip(replay(data, spy, cfg), spy["x"], targets, spy["logits"], spy["loss"]):
        d = x - x.flip(0)
        lam = ((xin - x.flip(0)) * d).sum() / (d * d).sum()          # least squares; exact if convex
        assert torch.allclose(xin, lam * x + (1 - lam) * x.flip(0), atol=1e-5)
        y1 = smoothed_one_hot(y, 5, eps)
        assert t.shape == (4, 5) and t.dtype == torch.float32
        assert torch.allclose(t, lam * y1 + (1 - lam) * y1.flip(0), atol=1e-5)
        assert loss == pytest.approx(-(t * F.log_softmax(z, -1)).sum(-1).mean().item(), abs=1e-5)
        lams.append(lam.item())
    assert any(0.01 < v < 0.99 for v in lams), lams                  # really mixed


def test_cutmix_pastes_a_box_of_the_partner_image(src_file, data, monkeypatch):
    from timm.loss import SoftTargetCrossEntropy
    targets, forward = [], SoftTargetCrossEntropy.forward
    monkeypatch.setattr(SoftTargetCrossEntropy, "forward",
                        lambda self, x, t: targets.append(t.clone()) or forward(self, x, t))
    cfg = dict(steps=3, batch_size=4, cutmix_alpha=1.0)
    _, spy = run(src_file, data, monkeypatch, **cfg)
    pasted = 0
    for (x, y), xin, t in zip(replay(data, spy, cfg), spy["x"], targets):
        assert ((xin - x).abs() * (xin - x.flip(0)).abs()).max() == 0     # each pixel from one of the two
        y1, y2 = F.one_hot(y, 5).float(), F.one_hot(y.flip(0), 5).float()
        if torch.equal(y1, y2): continue
        lam = ((t - y2) * (y1 - y2)).sum() / ((y1 - y2) ** 2).sum()
        assert torch.allclose(t, lam * y1 + (1 - lam) * y2, atol=1e-6)
        moved = ((xin - x).abs().sum((0, 1)) > 0).nonzero()            # pixels taken from the partner
        if len(moved):
            box = (moved.max(0).values - moved.min(0).values + 1).prod().item()
            assert box <= (1 - lam.item()) * 32 * 32 + 1e-3           # inside a box of area share 1 - lam
            pasted += 1
    assert pasted


def test_mixup_off_and_on_in_the_recipe():
    x, y = torch.randn(4, 1, 8, 8), torch.tensor([0, 1, 2, 3])
    mix = make_mixup(FinetuneConfig(mixup_alpha=1e4, batch_size=4), 4)   # lam ~ Beta(1e4, 1e4): 0.5
    np.random.seed(0)
    xm, t = mix(x.clone(), y)
    assert torch.allclose(xm, 0.5 * (x + x.flip(0)), atol=0.02)
    assert torch.allclose(t, 0.5 * (F.one_hot(y, 4) + F.one_hot(y.flip(0), 4)).float(), atol=0.02)
    assert TrainRecipe(torch.nn.CrossEntropyLoss()).mix(x, y) == (x, y)


# ---- label smoothing -----------------------------------------------------------------------------------------

def test_label_smoothing_loss_is_the_closed_form(src_file, data, monkeypatch):
    eps, cfg = 0.3, dict(steps=2, batch_size=4)
    _, spy = run(src_file, data, monkeypatch, label_smoothing=eps, **cfg)
    for (x, y), z, loss in zip(replay(data, spy, cfg), spy["logits"], spy["loss"]):
        logp = F.log_softmax(z, -1)
        ce = -logp.gather(1, y[:, None])[:, 0]
        closed = ((1 - eps) * ce + eps * -logp.mean(-1)).mean().item()
        assert loss == pytest.approx(closed, abs=1e-6)
        assert abs(closed - ce.mean().item()) > 1e-4                  # smoothing changed the loss
    z, y = torch.tensor([[2.0, 0.0, -1.0]]), torch.tensor([0])        # and on a fixed batch
    logp = z.log_softmax(-1)
    closed = (1 - eps) * -logp[0, 0] + eps * -logp.mean()
    assert recipe_loss(FinetuneConfig(label_smoothing=eps))(z, y).item() == pytest.approx(closed.item(), abs=1e-6)


# ---- warm-up in epochs ---------------------------------------------------------------------------------------

def test_warmup_epochs_follow_timms_cosine_scheduler(src_file, data, monkeypatch):
    from timm.scheduler import CosineLRScheduler
    lr, steps, bs, epochs = 2e-3, 20, 4, 3                            # 20 images: 5 updates an epoch
    _, spy = run(src_file, data, monkeypatch, steps=steps, batch_size=bs, warmup_epochs=epochs)
    assert warmup_updates(FinetuneConfig(steps=steps, batch_size=bs, warmup_epochs=epochs), 20) == 15

    def by_hand(warmup_t):
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
        sched = CosineLRScheduler(opt, t_initial=steps, warmup_t=warmup_t, warmup_lr_init=lr * 0.01,
                                  lr_min=lr * 0.01, t_in_epochs=False)
        out = []
        for k in range(1, steps + 1):
            out.append(opt.param_groups[0]["lr"])
            sched.step_update(k)
        return out

    assert spy["lr"] == pytest.approx(by_hand(15), rel=1e-12)
    assert spy["lr"][0] == pytest.approx(lr * 0.01)
    first_epoch = spy["lr"][:5]
    assert all(a < b for a, b in zip(first_epoch, first_epoch[1:]))     # rising through the first epoch
    assert spy["lr"] != pytest.approx(by_hand(10), rel=1e-6)             # not the default 10 updates


# ---- EMA of the weights --------------------------------------------------------------------------------------

def test_ema_is_timms_average_of_the_trajectory_and_is_delivered(src_file, data, monkeypatch):
    decay = 0.9
    res, spy = run(src_file, data, monkeypatch, val=True, steps=4, batch_size=4, ema_decay=decay)
    ema = None
    for t, w in enumerate(spy["weights"], start=1):                  # ModelEmaV3, use_warmup=True
        d = 0.0 if t == 1 else min(decay, 1 - t ** (-2 / 3))
        ema = dict(w) if ema is None else {n: d * ema[n] + (1 - d) * w[n] for n in w}
    got = res.model.state_dict()
    assert max((got[n] - ema[n]).abs().max().item() for n in ema) < 1e-5
    last = spy["weights"][-1]
    assert max((got[n] - last[n]).abs().max().item() for n in last) > 1e-3   # not the last weights
    assert res.val_acc == evaluate(res.model, data[1])                 # the EMA is what was evaluated


# ---- mixed precision -----------------------------------------------------------------------------------------

def test_amp_runs_the_forward_under_autocast(src_file, data, monkeypatch):
    res, spy = run(src_file, data, monkeypatch, steps=2, batch_size=4, amp=True)
    assert spy["dtype"] == [torch.bfloat16] * 2                      # CPU autocast: bfloat16
    assert all(p.dtype == torch.float32 for p in res.model.parameters())
    assert amp_dtype("cpu") == torch.bfloat16 and amp_dtype("cuda") == torch.float16
    with pytest.raises(ValueError, match="amp=True.*'meta'"): amp_dtype("meta")


# ---- the config's checks -------------------------------------------------------------------------------------

@pytest.mark.parametrize("bad, field", [
    (dict(ema_decay=1.0), "ema_decay"), (dict(ema_decay=-0.1), "ema_decay"),
    (dict(mixup_alpha=-0.2), "mixup_alpha"), (dict(mixup_alpha=float("nan")), "mixup_alpha"),
    (dict(cutmix_alpha=-1), "cutmix_alpha"), (dict(label_smoothing=1.0), "label_smoothing"),
    (dict(warmup_epochs=1.5), "warmup_epochs"), (dict(warmup_epochs=-1), "warmup_epochs"),
    (dict(amp="yes"), "amp"), (dict(mixup_alpha=0.2, batch_size=5), "batch_size=5")])
def test_config_refuses_bad_values(bad, field):
    value = repr(next(iter(bad.values())))
    with pytest.raises(ValueError, match=field) as e: FinetuneConfig(**bad)
    assert field in str(e.value) and (value in str(e.value) or "batch_size" in field)


# ---- course finetune -----------------------------------------------------------------------------------------

def test_cli_flags_reach_the_config(tmp_path, monkeypatch):
    from PIL import Image
    for c in ("a", "b"):
        (tmp_path / "d" / c).mkdir(parents=True)
        for i in range(3):
            Image.fromarray(np.full((32, 32), 40 * i, np.uint8), "L").save(tmp_path / "d" / c / f"{i}.png")
    seen = {}
    def fake(*a, config=None, **k):
        seen["config"] = config
        raise ValueError("stopped by the test")
    monkeypatch.setattr(cli, "finetune", fake)
    rc = cli.finetune_main([str(tmp_path / "d"), "--model", "course_resnet_32", "--in-chans", "1",
                            "--img-size", "32", "--batch-size", "8", "--ema", "0.999", "--mixup", "0.8",
                            "--cutmix", "1.0", "--smoothing", "0.1", "--warmup-epochs", "5", "--amp"])
    c = seen["config"]
    assert rc == 2 and (c.ema_decay, c.mixup_alpha, c.cutmix_alpha, c.label_smoothing, c.warmup_epochs,
                        c.amp) == (0.999, 0.8, 1.0, 0.1, 5, True)
    rc = cli.finetune_main([str(tmp_path / "d"), "--model", "course_resnet_32", "--in-chans", "1"])
    c = seen["config"]
    assert (c.ema_decay, c.mixup_alpha, c.cutmix_alpha, c.label_smoothing, c.warmup_epochs, c.amp) == (
        0.0, 0.0, 0.0, 0.0, 0, False)
    help_text = cli._finetune_parser().format_help()
    for flag in ("--ema DECAY", "--mixup ALPHA", "--cutmix ALPHA", "--smoothing EPS", "--warmup-epochs N",
                 "--amp"):
        assert flag in help_text


@pytest.mark.parametrize("args, flag, value", [
    (["--ema", "1.5"], "--ema", "1.5"), (["--mixup", "-1"], "--mixup", "-1"),
    (["--cutmix", "-0.5"], "--cutmix", "-0.5"), (["--smoothing", "1"], "--smoothing", "1"),
    (["--warmup-epochs", "-2"], "--warmup-epochs", "-2"),
    (["--mixup", "0.2", "--batch-size", "3"], "--mixup", "batch_size=3")])
def test_cli_bad_value_exits_2_naming_it(tmp_path, capsys, args, flag, value):
    rc = cli.finetune_main([str(tmp_path / "nowhere"), "--model", "course_resnet_32", *args])
    err = capsys.readouterr().err
    assert rc == 2 and f"course finetune: {flag}:" in err and value in err, err


def test_cli_records_the_recipe(tmp_path):
    from PIL import Image
    for c in ("a", "b"):
        (tmp_path / "d" / c).mkdir(parents=True)
        for i in range(4):
            Image.fromarray(np.full((32, 32), 30 * i + (c == "b") * 100, np.uint8), "L").save(
                tmp_path / "d" / c / f"{i}.png")
    rc = cli.finetune_main([str(tmp_path / "d"), "--model", "course_resnet_32", "--in-chans", "1",
                            "--img-size", "32", "--steps", "2", "--batch-size", "4", "--ema", "0.9",
                            "--smoothing", "0.1", "--out", str(tmp_path / "out")])
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert rc == 0 and metrics["recipe"] == dict(ema_decay=0.9, mixup_alpha=0.0, cutmix_alpha=0.0,
                                                 label_smoothing=0.1, warmup_epochs=0, amp=False)


# ---- training throughput (a measurement, never asserted on its value) ----------------------------------------

@pytest.mark.parametrize("amp", [None, torch.bfloat16])
def test_train_images_per_second_is_positive_and_leaves_the_model_as_it_was(amp):
    from course_lib.vision.recipe import train_images_per_second
    torch.manual_seed(0)
    m = timm.create_model("course_resnet_32", num_classes=5).eval()
    m.fc.weight.grad = torch.ones_like(m.fc.weight)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    ips = train_images_per_second(m, 4, amp_dtype=amp, min_time=0.0, warmup=1)
    assert isinstance(ips, float) and np.isfinite(ips) and ips > 0
    assert not m.training
    assert all(torch.equal(v, m.state_dict()[k]) for k, v in before.items())     # weights and BN stats
    assert torch.equal(m.fc.weight.grad, torch.ones_like(m.fc.weight))
    assert all(p.grad is None for n, p in m.named_parameters() if n != "fc.weight")
    with pytest.raises(ValueError, match="batch_size"):
        train_images_per_second(m, 0)
