"""The models that ship with the package: every file matches its provenance, every loader takes the shipped copy
on an empty cache instead of training, and the judge retrained from its provenance reaches its recorded figure."""
import json, os
from pathlib import Path

import pytest
import torch

import course_lib.ddpm.classifier, course_lib.ddpm.training, course_lib.ddpm.pretrained, course_lib.ddpm.unet, course_lib.score.ncsn, course_lib.pile.lm, course_lib.vision.transfer
import course_lib.ddpm.schedulers, course_lib.lora.train   # imported before a test patches a trainer (they bind its names)
import course_lib.flux.flow, course_lib.flux.mini, course_lib.flux.flow_training, course_lib.flux.train
import course_lib.pile.experiment
from course_lib.core import cache_dir, pretrained_dir, restore_pretrained

ROOT = Path(__file__).resolve().parent.parent
PROV = json.loads((pretrained_dir() / "provenance.json").read_text()) if (pretrained_dir() / "provenance.json").is_file() \
    else {"models": {}, "total_bytes": 0}
KINDS = {m["kind"] for m in PROV["models"].values()}


def sha256(p: Path) -> str:
    import hashlib
    return hashlib.sha256(p.read_bytes()).hexdigest()


def test_every_lesson_model_ships():
    assert KINDS == {"classifier", "ddpm", "base", "vision", "gpt2", "ddpm-quick", "base-quick", "ncsn",
                     "flow-quick", "flux-quick", "ddpm-mnist", "guided", "flow", "flux", "clean-lm",
                     "classifier-mnist", "unet-pair"}, KINDS
    # the package stays small enough for a wheel (PyPI's limit is 100 MB): measured 36.5 MB for the ten models,
    # 40.4 MB with unit 7's quick flow model and FLUX-mini (which lessons 71-73 trained in CI, three minutes under
    # the device probe), 43.2 MB with the MNIST DDPM (2.8 MB; 96 minutes of training on 2 shared CPU cores), and
    # 55.0 MB with unit 7's full-profile models (the course's full profile within its hour), 69.1 MB with lesson
    # 62a's six language models (14 MB in float16; about 16 minutes each on one CPU core), 71.2 MB with lesson 10a's
    # MNIST pair (two UNets of about 260,000 parameters in float32, and their loss curves)
    assert 0 < PROV["total_bytes"] < 75e6


@pytest.mark.parametrize("rel", sorted(PROV["models"]))
def test_shipped_files_match_their_provenance(rel):
    entry = PROV["models"][rel]
    target = pretrained_dir() / rel
    for name, f in entry["files"].items():
        p = target.parent / name
        assert p.is_file(), f"{p} listed in provenance.json is missing"
        assert p.stat().st_size == f["bytes"] and sha256(p) == f["sha256"], f"{p} differs from its provenance"
    for key in ("config", "command", "code_version", "figures", "call"): assert entry[key], (rel, key)


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    "An empty course cache, and every trainer replaced by one that fails: loading must not train."
    monkeypatch.setenv("COURSE_LIB_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("COURSE_LIB_NO_PRETRAINED", raising=False)
    def no_training(*a, **kw): raise AssertionError("trained instead of loading the shipped model")
    for mod, name in [(course_lib.ddpm.training, "train_ddpm"), (course_lib.ddpm.pretrained, "train_ddpm"),
                      (course_lib.ddpm.pretrained, "train_eps"), (course_lib.ddpm.classifier, "train_digits_classifier"),
                      (course_lib.vision.transfer, "finetune"), (course_lib.pile.lm, "train_tiny_gpt2"),
                      (course_lib.score.ncsn, "train_ncsn"), (course_lib.flux.flow_training, "train_flow"),
                      (course_lib.flux.train, "train_flux_mini"), (course_lib.pile.experiment, "train_tiny_gpt2")]:
        monkeypatch.setattr(mod, name, no_training)
    return tmp_path / "home"


def test_loaders_take_the_shipped_models_on_an_empty_cache(empty_cache):
    from course_lib.ddpm import ClassifierConfig, load_digits_classifier
    from course_lib.ddpm import DDPMConfig, load_pretrained_ddpm
    from course_lib.pile import TinyGPTConfig, tiny_gpt2
    from course_lib.lora import base_config, load_base
    from course_lib.vision import pretrained_source_model
    figures = {m["kind"] + m["call"]: m["figures"] for m in PROV["models"].values()}
    clf = load_digits_classifier(config=ClassifierConfig())
    assert clf.valid_acc == pytest.approx(figures["classifier" + "load_digits_classifier(config=ClassifierConfig())"]
                                          ["valid_acc"])
    judge = load_digits_classifier(config=ClassifierConfig.mnist())                          # MNIST's judge
    assert judge.valid_acc == pytest.approx(
        figures["classifier-mnist" + "load_digits_classifier(config=ClassifierConfig.mnist())"]["valid_acc"])
    for model in (load_pretrained_ddpm(DDPMConfig(), progress=False), load_base(base_config(), progress=False),
                  load_pretrained_ddpm(DDPMConfig.quick(), progress=False), load_base(base_config(100), progress=False)):
        assert model.history["loss"] and torch.isfinite(next(model.parameters())).all()
    for name, aug in (("course_resnet_32", "d4"), ("course_vit_32", "d4"), ("course_resnet_32", "none")):
        assert pretrained_source_model(name, steps=1000, label_augment=aug).is_file()
    from course_lib.score import NCSNConfig, load_ncsn
    ncsn = load_ncsn(NCSNConfig())                        # notebook 21's digits NCSN (3,000 steps)
    assert sum(p.numel() for p in ncsn.parameters()) > 1e6 and not ncsn.training
    from course_lib.flux import FlowConfig, load_pretrained_flow
    from course_lib.flux import FluxMiniConfig
    from course_lib.flux import load_flux_mini
    flow = load_pretrained_flow(FlowConfig.from_ddpm(DDPMConfig.quick()), progress=False)    # lesson 71, quick
    assert flow.history["loss"] and not flow.training
    from course_lib.data.mnist import MNIST
    mnist = load_pretrained_ddpm(DDPMConfig.mnist(), dataset=MNIST("train", size=28), progress=False)
    assert mnist.config.sample_size == 28 and len(mnist.history["loss"]) == DDPMConfig.mnist().steps
    # without a dataset: 28x28 means MNIST's training split, the same key (was: Digits at size 28, a ValueError
    # after the cache missed), so the shipped model loads and nothing is trained
    from course_lib.ddpm import ddpm_is_cached
    assert DDPMConfig.mnist().key() == DDPMConfig.mnist().key(MNIST("train")) and ddpm_is_cached(DDPMConfig.mnist())
    same = load_pretrained_ddpm(DDPMConfig.mnist(), progress=False)
    assert all(torch.equal(a, b) for a, b in zip(same.state_dict().values(), mnist.state_dict().values()))
    from course_lib.ddpm import UNetPairConfig, load_unet_pair                              # lesson 10a, full
    pair = [m for m in PROV["models"].values() if m["kind"] == "unet-pair"][0]
    models, history = load_unet_pair(UNetPairConfig())
    assert {len(v) for v in history["losses"].values()} == {UNetPairConfig().steps}
    for k, losses in history["losses"].items():
        assert sum(losses[-50:]) / 50 == pytest.approx(pair["figures"][f"loss_last50_{k}"])
        assert models[k].config.sample_size == 28 and not models[k].training
    for cfg in (FluxMiniConfig.quick(), FluxMiniConfig()):                                   # lessons 72, 73
        pipe = load_flux_mini(cfg, progress=False)
        assert pipe.flux_config.steps == cfg.steps and pipe.history["flow_loss"]
    flow = load_pretrained_flow(FlowConfig.from_ddpm(DDPMConfig()), progress=False)          # lesson 71, full
    assert len(flow.history["loss"]) == DDPMConfig().steps and not flow.training
    from course_lib.flux import load_guided_ddpm
    guided = load_guided_ddpm(DDPMConfig(), 0.2, progress=False)                             # lesson 70, full
    assert guided.config.num_class_embeds == 11 and len(guided.history["loss"]) == DDPMConfig().steps
    gpt2 = [m for m in PROV["models"].values() if m["kind"] == "gpt2"][0]
    model, tok, d = tiny_gpt2(TinyGPTConfig(**gpt2["config"]))
    assert model.config.n_positions == gpt2["config"]["n_positions"] and len(tok) > 256
    from course_lib.pile.experiment import CleanExperimentConfig, clean_experiment_model
    cfg = CleanExperimentConfig()                                                            # lesson 62a, full
    for name in ("raw", "cleaned"):
        for seed in cfg.seeds:
            model, tok, d = clean_experiment_model(name, seed, cfg)
            info = json.loads((d / "course_lib.json").read_text())
            assert (info["set"], info["seed"], len(tok), len(info["loss"])) == (name, seed, cfg.vocab_size, cfg.steps)


def test_no_shipped_model_when_turned_off(empty_cache, monkeypatch):
    from course_lib.ddpm import ClassifierConfig, load_digits_classifier
    monkeypatch.setenv("COURSE_LIB_NO_PRETRAINED", "1")
    with pytest.raises(AssertionError, match="trained instead of loading"):
        load_digits_classifier(config=ClassifierConfig())


def test_ddpm_is_cached_says_whether_the_loader_trains(empty_cache, monkeypatch):
    "Lessons 11 and 13 warn before training from `ddpm_is_cached`: True exactly where loading will not train."
    from course_lib.ddpm import DDPMConfig, ddpm_is_cached, load_pretrained_ddpm
    assert ddpm_is_cached(DDPMConfig()) and ddpm_is_cached(DDPMConfig.quick())     # shipped
    assert not ddpm_is_cached(DDPMConfig.quick(steps=7))                            # would train
    with pytest.raises(AssertionError, match="trained instead of loading"):
        load_pretrained_ddpm(DDPMConfig.quick(steps=7), progress=False)
    assert not ddpm_is_cached(DDPMConfig(), dataset=torch.zeros(4, 1, 8, 8))      # another dataset: another key
    monkeypatch.setenv("COURSE_LIB_NO_PRETRAINED", "1")
    assert not ddpm_is_cached(DDPMConfig())
    monkeypatch.delenv("COURSE_LIB_NO_PRETRAINED")
    load_pretrained_ddpm(DDPMConfig.quick(), progress=False)                      # now in the cache itself
    monkeypatch.setenv("COURSE_LIB_NO_PRETRAINED", "1")
    assert ddpm_is_cached(DDPMConfig.quick()) and not ddpm_is_cached(DDPMConfig())


def test_estimate_training_seconds_scales_with_the_steps(monkeypatch):
    from course_lib.ddpm import DDPMConfig, estimate_training_seconds
    calls = []
    class Fake:
        def __init__(self, cfg): self.history = {"seconds": 0.5 * cfg.steps}
    monkeypatch.setattr(course_lib.ddpm.pretrained, "train_ddpm", lambda cfg, *a, **kw: calls.append(cfg) or Fake(cfg))
    assert estimate_training_seconds(DDPMConfig(steps=1500), n_steps=4) == pytest.approx(750.0)
    assert calls[0].steps == 4 and calls[0].block_out_channels == DDPMConfig().block_out_channels


def test_restore_pretrained_only_fills_a_missing_cache_entry(empty_cache, tmp_path):
    rel = next(r for r, m in PROV["models"].items() if m["kind"] == "classifier")
    target = cache_dir() / rel
    assert restore_pretrained(target) and sha256(target) == sha256(pretrained_dir() / rel)
    target.write_bytes(b"the learner's own model")
    assert not restore_pretrained(target) and target.read_bytes() == b"the learner's own model"
    assert not restore_pretrained(tmp_path / "outside-the-cache.safetensors")
    assert not restore_pretrained(cache_dir() / "models" / "ddpm" / "no-such-key" / "ema.safetensors")


def test_the_judge_retrained_from_its_provenance_reaches_its_figure(tmp_path, monkeypatch):
    "The cheapest model (seconds) is retrained from its recorded config; the others are retrained the same way by "
    "`python tools/ship_pretrained.py` (minutes each)."
    from course_lib.ddpm import ClassifierConfig, load_digits_classifier
    monkeypatch.setenv("COURSE_LIB_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("COURSE_LIB_NO_PRETRAINED", "1")
    entry = next(m for m in PROV["models"].values() if m["kind"] == "classifier")
    clf = load_digits_classifier(config=ClassifierConfig(**entry["config"]))
    # the same seed on a CPU gives the same accuracy to the image on this machine; 0.01 (2 of 359 images) leaves
    # room for another CPU's kernels
    assert abs(clf.valid_acc - entry["figures"]["valid_acc"]) <= 0.01


def test_shipped_records_name_the_current_training_code():
    """Each shipped model carries the fingerprint of the code that trained it (so a learner's edited trainer is
    caught on the first load of a shipped copy); it must be the library's training code now."""
    import sys
    sys.path.insert(0, str(ROOT / "tools"))
    from ship_pretrained import trainer_fingerprint
    for rel, m in PROV["models"].items():
        code = trainer_fingerprint(m["kind"])
        if code is None: continue
        record = pretrained_dir() / (rel + ".cache.json")
        assert record.is_file(), f"{record} is missing: run `python tools/ship_pretrained.py --restamp`"
        shipped = json.loads(record.read_text())["code"]
        assert shipped == code, (
            f"{rel}: the training code ({m['kind']}) has changed since the shipped model was trained "
            f"(recorded {shipped}, now {code}): retrain it (tools/ship_pretrained.py --only {m['kind']}), "
            "or run `python tools/ship_pretrained.py --restamp` if the change trains the same model")


def test_the_mnist_judge_reads_the_held_out_mnist_digits(empty_cache):
    """The shipped MNIST judge (`ClassifierConfig.mnist()`, no label smoothing) on the 500 test digits, which neither
    it nor the MNIST DDPM trained on: at least 97% right, and confident (max probability >= 0.9) on at least 90% of
    them. An untrained `DigitsClassifier` (seed 0) fails both: 10% right, confident on none."""
    from course_lib.data.mnist import MNIST
    from course_lib.ddpm import ClassifierConfig, accuracy, judge_samples, load_digits_classifier
    judge = load_digits_classifier(config=ClassifierConfig.mnist())
    test = MNIST("test")
    assert accuracy(judge, test) >= 0.97
    assert judge_samples(test.images, judge)["confident_rate"] >= 0.9


def test_judge_configs_name_their_data():
    from course_lib.ddpm import ClassifierConfig, judge_data
    with pytest.raises(ValueError, match="'cifar'"):
        ClassifierConfig(data="cifar")
    mnist, digits = ClassifierConfig.mnist(), ClassifierConfig()
    assert (mnist.data, mnist.label_smoothing, ClassifierConfig.mnist(epochs=3).epochs) == ("mnist", 0.0, 3)
    assert mnist.key() != digits.key() != ClassifierConfig(seed=1).key()
    assert judge_data(mnist, "test").images.shape == (500, 1, 28, 28)
    assert judge_data(digits, "train").images.shape[-1] == 16
    # the 8x8 judge keeps the key it had before `data` existed: the name of its shipped file
    rel = next(r for r, m in PROV["models"].items() if m["kind"] == "classifier")
    assert Path(rel).stem == digits.key()
