"""Issue 44 item 1: the recipe's knobs in both LoRA trainers (unit 4's `train_lora` / `train_lora_run`, unit 7's
`train_flux_lora`), each checked to change what it says: learning-rate schedules with warm-up against diffusers'
`get_scheduler`, gradient accumulation against the larger batch, EMA against its closed form, caption dropout,
epochs x repeats, FLUX's time shift against diffusers' `calculate_shift`, and aspect-ratio buckets (one bucket a
batch, sides the model can take). Tiny untrained bases: seconds each."""
import copy, math
from dataclasses import replace

import numpy as np
import pytest
import torch
from PIL import Image

from course_lib.ddpm import DDPMConfig, make_unet
from course_lib.flux import FluxMiniConfig, make_flux_pipeline
from course_lib.flux import FluxLoRAConfig, train_flux_lora, write_corner_folder
from course_lib.lora import (
    BatchPlan, ConceptDataset, LoRATrainConfig, LR_SCHEDULES, BucketBatchSampler, concept_batch, ema_by_hand,
    epoch_batches, lr_factor, micro_batches, train_lora, train_lora_run, unet_recipe_checks, write_concept_folder)

UNET = dict(rank=2, alpha=2.0, batch_size=4, prior_images=4, preview_every=0, lr=1e-2)
FLUX = dict(rank=2, alpha=2.0, batch_size=4, lr=1e-2, checkpoint_every=100)


def _unet(num_classes=10):
    cfg = DDPMConfig.quick(classes=tuple(range(9)), num_classes=num_classes, block_out_channels=(16, 32),
                           norm_num_groups=8, attention=(False, True), steps=1, image_size=16)
    torch.manual_seed(0)
    m = make_unet(cfg).eval()
    m.ddpm_config = cfg
    return m


@pytest.fixture(scope="module")
def unet():
    return _unet()


@pytest.fixture(scope="module")
def flux():
    return make_flux_pipeline(FluxMiniConfig(num_layers=1, num_single_layers=1, text_layers=1))


@pytest.fixture(scope="module")
def nines(tmp_path_factory):
    return write_concept_folder(tmp_path_factory.mktemp("lora") / "nines", n=6, pixels=16)


@pytest.fixture(scope="module")
def corners(tmp_path_factory):
    return write_corner_folder(tmp_path_factory.mktemp("flux") / "corners", n=6, pixels=16)


def _lora(model):
    return torch.cat([p.detach().flatten().clone() for n, p in model.named_parameters() if "lora_" in n])


def _unet_run(unet, nines, callback=None, **kw):
    base = copy.deepcopy(unet)
    ds = ConceptDataset(nines, size=16, buckets=kw.get("buckets", False))
    res = train_lora(base, ds, LoRATrainConfig(**{**UNET, **kw}), prior=None, progress=False, callback=callback)
    return base, res


def _flux_run(flux, folder, callback=None, run_dir=None, stop_event=None, **kw):
    pipe = copy.deepcopy(flux)
    run = train_flux_lora(pipe, folder, FluxLoRAConfig(**{**FLUX, **kw}), run_dir=run_dir, progress=False,
                          callback=callback, stop_event=stop_event)
    return pipe, run


# --- learning-rate schedules ----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", LR_SCHEDULES)
@pytest.mark.parametrize("warmup,total", [(0, 7), (3, 10), (10, 10), (4, 25)])
def test_lr_factor_is_diffusers_get_scheduler(name, warmup, total):
    from diffusers.optimization import get_scheduler
    warmup = 0 if name == "constant" else warmup
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched, lib = get_scheduler(name, opt, num_warmup_steps=warmup, num_training_steps=total), []
    for _ in range(total):
        lib.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert [lr_factor(name, s, warmup, total) for s in range(total)] == pytest.approx(lib, abs=1e-12)


def test_both_trainers_follow_the_schedule(unet, nines, flux, corners):
    kw = dict(steps=6, lr_scheduler="cosine", lr_warmup_steps=2)
    _, res = _unet_run(unet, nines, **kw)
    want = [1e-2 * lr_factor("cosine", s, 2, 6) for s in range(6)]
    assert [r["lr"] for r in res.history] == pytest.approx(want)
    _, run = _flux_run(flux, corners, **kw)
    assert [r["lr"] for r in run.history] == pytest.approx(want)
    assert len(set(want)) > 3                               # a constant rate would fail both


def test_flux_pause_and_resume_with_schedule_and_ema_equal_one_run(flux, corners, tmp_path):
    """The scheduler is moved on to the resumed step and the EMA's state comes back from the checkpoint."""
    import threading
    kw = dict(steps=5, lr_scheduler="linear", lr_warmup_steps=2, ema_decay=0.8)
    one, _ = _flux_run(flux, corners, run_dir=tmp_path / "one", **kw)
    stop = threading.Event()
    pipe, run = _flux_run(flux, corners, run_dir=tmp_path / "two", stop_event=stop,
                          callback=lambda row: stop.set() if row["step"] == 2 else None, **kw)
    assert run.stopped and run.step == 2
    two, run = _flux_run(flux, corners, run_dir=tmp_path / "two", **kw)
    assert run.step == 5 and [r["lr"] for r in run.history] == pytest.approx(
        [1e-2 * lr_factor("linear", s, 2, 5) for s in range(5)])
    assert torch.allclose(_lora(one.transformer), _lora(two.transformer), atol=1e-6)


def test_unet_run_resume_with_ema_equals_one_run(unet, nines, tmp_path):
    import threading
    cfg = LoRATrainConfig(**{**UNET, "prior_images": 0}, steps=4, ema_decay=0.7, lr_scheduler="cosine",
                          lr_warmup_steps=1)
    one = train_lora_run(unet, nines, cfg, tmp_path / "one", checkpoint_every=1)
    again = train_lora_run(unet, nines, cfg, tmp_path / "again", checkpoint_every=1)
    assert torch.equal(_lora(one.model), _lora(again.model))        # seeded: the adapter's A was not
    stop = threading.Event()
    run = train_lora_run(unet, nines, cfg, tmp_path / "two", checkpoint_every=1, stop_event=stop,
                         callback=lambda row, _: stop.set() if row["step"] == 2 else None)
    assert run.stopped
    two = train_lora_run(unet, nines, cfg, tmp_path / "two", checkpoint_every=1)
    assert torch.allclose(_lora(one.model), _lora(two.model), atol=1e-6)
    assert [r["lr"] for r in two.history] == pytest.approx([r["lr"] for r in one.history])


# --- gradient accumulation ----------------------------------------------------------------------------------
def test_micro_batches_cover_the_batch():
    for n, k in [(8, 1), (8, 3), (5, 5), (3, 8)]:
        parts = micro_batches(n, k)
        assert sum(w for _, w in parts) == pytest.approx(1)
        assert [i for s, _ in parts for i in range(n)[s]] == list(range(n))


def test_unet_grad_accumulation_is_the_larger_batch(unet, nines):
    big, _ = _unet_run(unet, nines, steps=2, batch_size=4, grad_accum=1)
    acc, _ = _unet_run(unet, nines, steps=2, batch_size=2, grad_accum=2)
    small, _ = _unet_run(unet, nines, steps=2, batch_size=2, grad_accum=1)
    assert torch.allclose(_lora(big), _lora(acc), atol=1e-5), (_lora(big) - _lora(acc)).abs().max()
    assert not torch.allclose(_lora(big), _lora(small), atol=1e-3)       # the smaller batch alone differs


def test_flux_grad_accumulation_is_the_larger_batch(flux, corners):
    big, _ = _flux_run(flux, corners, steps=2, batch_size=4, grad_accum=1)
    acc, _ = _flux_run(flux, corners, steps=2, batch_size=1, grad_accum=4)
    small, _ = _flux_run(flux, corners, steps=2, batch_size=1, grad_accum=1)
    assert torch.allclose(_lora(big.transformer), _lora(acc.transformer), atol=1e-5)
    assert not torch.allclose(_lora(big.transformer), _lora(small.transformer), atol=1e-3)


# --- EMA ----------------------------------------------------------------------------------------------------
def test_ema_in_both_trainers_is_the_average_of_the_trajectory(unet, nines, flux, corners):
    base, traj = copy.deepcopy(unet), []
    train_lora(base, ConceptDataset(nines, size=16), LoRATrainConfig(**UNET, steps=6, ema_decay=0.8), prior=None,
               progress=False, callback=lambda row, _: traj.append(_lora(base)))
    assert torch.allclose(_lora(base), ema_by_hand(traj, 0.8), atol=1e-6)
    assert not torch.allclose(_lora(base), traj[-1], atol=1e-4)          # not the last step's weights
    pipe = copy.deepcopy(flux)
    traj = []
    train_flux_lora(pipe, corners, FluxLoRAConfig(**FLUX, steps=6, ema_decay=0.8), progress=False,
                    callback=lambda row: traj.append(_lora(pipe.transformer)))
    assert torch.allclose(_lora(pipe.transformer), ema_by_hand(traj, 0.8), atol=1e-6)
    assert not torch.allclose(_lora(pipe.transformer), traj[-1], atol=1e-4)


# --- caption dropout ----------------------------------------------------------------------------------------
def test_unet_caption_dropout_needs_a_null_class_and_uses_it(unet, nines):
    ds = ConceptDataset(nines, size=16)
    with pytest.raises(ValueError, match=r"caption_dropout=0\.5 needs a null class"):
        unet_recipe_checks(unet, ds, LoRATrainConfig(**UNET, caption_dropout=0.5))
    wide = _unet(num_classes=11)                             # class 10: the empty prompt
    cfg = LoRATrainConfig(**UNET, caption_dropout=0.5)
    null = unet_recipe_checks(wide, ds, cfg)
    labels = torch.full((len(ds.files),), 9)
    g = torch.Generator().manual_seed(0)
    ys = torch.cat([concept_batch(ds, labels, torch.arange(6), g, cfg, null)[1] for _ in range(100)])
    assert set(ys.tolist()) == {9, 10} and abs((ys == 10).float().mean().item() - 0.5) < 0.05
    g = torch.Generator().manual_seed(0)
    assert (concept_batch(ds, labels, torch.arange(6), g, replace(cfg, caption_dropout=0.0), None)[1] == 9).all()


def test_flux_caption_dropout_trains_on_the_empty_prompt(flux, corners):
    from course_lib.flux.lora_train import _batch, _prepare_data
    cfg = FluxLoRAConfig(**FLUX, caption_dropout=0.5)
    data = _prepare_data(flux, corners, cfg)
    b = _batch(data, cfg, torch.Generator().manual_seed(3), torch.arange(6))
    emb = b["text"][0]
    empty = (emb == data["empty"][0]).flatten(1).all(1)
    own = (emb == data["embeds"]).flatten(1).all(1)
    assert empty.any() and own.any() and (empty ^ own).all()
    b0 = _batch(data, replace(cfg, caption_dropout=0.0), torch.Generator().manual_seed(3), torch.arange(6))
    assert torch.equal(b0["text"][0], data["embeds"])


# --- epochs and repeats -------------------------------------------------------------------------------------
def test_epoch_batches_are_bucket_batch_samplers(nines):
    ds = ConceptDataset(nines, size=16, repeats=3)
    sampler = BucketBatchSampler(ds, batch_size=4, seed=5)
    for epoch in range(2):
        sampler.epoch = epoch
        want = [[i % len(ds.files) for i in b] for b in sampler._batches()]
        assert epoch_batches(ds.buckets, 3, 4, 5, epoch) == want


def test_epochs_and_repeats_set_the_steps_and_the_images_seen(unet, nines, flux, corners, tmp_path):
    plan = BatchPlan(["a"] * 6, batch_size=4, steps=999, epochs=2, repeats=3)
    assert plan.steps == 2 * math.ceil(6 * 3 / 4)
    seen = torch.cat([plan.indices(s, None) for s in range(1, plan.steps + 1)])
    assert torch.bincount(seen).tolist() == [6] * 6               # each image epochs x repeats times
    _, res = _unet_run(unet, nines, epochs=2, repeats=3, steps=1)
    assert len(res.history) == 10 and res.config["steps"] == 10
    run = train_lora_run(unet, nines, LoRATrainConfig(**UNET, epochs=1, repeats=2), tmp_path / "u")
    assert run.step == 3
    _, run = _flux_run(flux, corners, epochs=2, repeats=2)
    assert run.step == 6


# --- FLUX's time shift --------------------------------------------------------------------------------------
def test_flux_time_shift_static_and_by_resolution(flux, corners):
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift
    from course_lib.flux import dynamic_shift_time, sample_time, shift_time
    from course_lib.flux.lora_train import _batch, _prepare_data
    data = _prepare_data(flux, corners, FluxLoRAConfig(**FLUX))
    L = data["x0"][0].shape[0]
    t_of = lambda cfg: _batch(data, cfg, torch.Generator().manual_seed(1), torch.arange(6))["t"]
    t0 = sample_time(6, "logit-normal", generator=torch.Generator().manual_seed(1))
    assert torch.equal(t_of(FluxLoRAConfig(**FLUX)), t0)
    assert torch.allclose(t_of(FluxLoRAConfig(**FLUX, time_shift=3.0)), 3 * t0 / (1 + 2 * t0))
    mu = calculate_shift(L, 256, 4096, 0.5, 1.15)                          # diffusers' FLUX pipeline
    want = math.exp(mu) / (math.exp(mu) + (1 / t0.double() - 1))
    assert torch.allclose(t_of(FluxLoRAConfig(**FLUX, time_shift="auto")).double(), want, atol=1e-6)
    assert not torch.allclose(shift_time(t0, 3.0), t0)
    with pytest.raises(ValueError, match="time_shift must be a number > 0"):
        FluxLoRAConfig(time_shift="fast")


# --- aspect-ratio buckets -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    "Nine real digits: three square, three padded wide (3:2), three padded tall (2:3), each captioned."
    from course_lib.data.images import Digits
    d = tmp_path_factory.mktemp("mixed") / "mixed"
    d.mkdir()
    ds = Digits("train", size=16, dtype="uint8")
    for i in range(9):
        a = ds.images[i, 0].numpy()
        if i % 3 == 1: a = np.pad(a, ((0, 0), (4, 4)))
        if i % 3 == 2: a = np.pad(a, ((4, 4), (0, 0)))
        Image.fromarray(a, "L").save(d / f"d{i}.png")
        (d / f"d{i}.txt").write_text("a photo of sks digit\n")
    return d


def test_unet_buckets_one_bucket_a_batch(unet, mixed):
    _, res = _unet_run(unet, mixed, steps=12, buckets=True)
    assert {r["bucket"] for r in res.history} == {"16x16", "20x12", "12x20"}
    with pytest.raises(ValueError, match=r"buckets=True, but the data set was built with buckets=False"):
        train_lora(copy.deepcopy(unet), ConceptDataset(mixed, size=16), LoRATrainConfig(**UNET, buckets=True),
                   progress=False)
    deep = copy.deepcopy(unet)
    deep.ddpm_config = replace(unet.ddpm_config, block_out_channels=(16, 32, 32, 32), attention=None)
    with pytest.raises(ValueError, match=r"bucket 12x20: this UNet needs sides that are multiples of 8"):
        unet_recipe_checks(deep, ConceptDataset(mixed, size=16, buckets=True), LoRATrainConfig(buckets=True))


def test_flux_buckets_one_bucket_a_batch(flux, mixed):
    from course_lib.flux.lora_train import _prepare_data
    cfg = FluxLoRAConfig(**FLUX, buckets=True, steps=8)
    data = _prepare_data(flux, mixed, cfg)
    assert set(data["buckets"]) == {(16, 16), (20, 12), (12, 20)}
    m = 2 * flux.vae_scale_factor
    assert all(w % m == 0 and h % m == 0 for w, h in data["buckets"])
    shapes = []
    pipe = copy.deepcopy(flux)
    from course_lib.flux import lora_train
    real = lora_train._loss
    def spy(p, d, b, sl, c):
        shapes.append(tuple(b["ids"].shape))
        return real(p, d, b, sl, c)
    lora_train._loss = spy
    try: train_flux_lora(pipe, mixed, cfg, progress=False)
    finally: lora_train._loss = real
    assert len(set(shapes)) >= 2                                    # batches of several buckets, each stacked


# --- course lora train: the same knobs as flags ---------------------------------------------------------------
def test_course_lora_train_takes_the_recipe_flags(mixed, tmp_path, capsys):
    from course_lib.cli.lora import lora_main
    from course_lib.lora import read_adapter
    out = tmp_path / "a.safetensors"
    assert lora_main(["train", str(mixed), str(out), "--lr-warmup-steps", "3"]) == 2
    assert "lr_warmup_steps=3 has no effect with lr_scheduler='constant'" in capsys.readouterr().err
    rc = lora_main(["train", str(mixed), str(out), "--prior-images", "0", "--batch-size", "3", "--buckets",
                    "--epochs", "1", "--repeats", "2", "--lr-scheduler", "cosine", "--lr-warmup-steps", "1",
                    "--log", str(tmp_path / "log")])
    assert rc == 0, capsys.readouterr().err
    rows = (tmp_path / "log.jsonl").read_text().splitlines()
    assert len(rows) == 6                                    # 3 buckets of 3 images x 2 repeats, batches of 3
    training = read_adapter(out)[1]["training_config"]
    assert training["buckets"] is True and training["epochs"] == 1 and training["steps"] == 6
