"""Every trainer of the course trains when it is called under `torch.no_grad()` or `torch.inference_mode()`: a
cached-model loader (the judge behind `judge_samples`, the course DDPM, the LoRA base) trains on a cache miss
wherever it is called from. Each runs a couple of steps of a tiny configuration and must change the weights."""
import copy

import pytest
import torch

from course_lib.ddpm import ClassifierConfig, load_digits_classifier, train_digits_classifier
from course_lib.ddpm import DDPMConfig, make_unet, train_ddpm
from course_lib.pile import TinyGPTConfig, train_tiny_gpt2
from course_lib.lora import write_concept_folder
from course_lib.lora import ConceptDataset
from course_lib.lora import LoRATrainConfig, train_lora
from course_lib.score import NCSNConfig, train_ncsn
from course_lib.score import ToyScoreConfig, train_toy_score
from course_lib.vision import FinetuneConfig, finetune, target_task

CONTEXTS = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}
TINY_DDPM = dict(block_out_channels=(8, 16), norm_num_groups=4, steps=2, batch_size=8, warmup_steps=1,
                 checkpoint_every=1000)


def weights(model):
    return [p.detach().clone() for p in model.parameters()]


def changed(before, model):
    return any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


@pytest.mark.parametrize("ctx", CONTEXTS)
def test_digits_classifier_trains_under(ctx, tmp_path, monkeypatch):
    "The reported case: `judge_samples` is @torch.no_grad() and trains the judge on an empty cache."
    monkeypatch.setenv("COURSE_LIB_HOME", str(tmp_path))
    with CONTEXTS[ctx]():
        clf = load_digits_classifier(config=ClassifierConfig(epochs=1, width=4))
    assert 0.1 < clf.valid_acc <= 1.0                    # trained: above chance (0.1) after one epoch


@pytest.mark.parametrize("ctx", CONTEXTS)
def test_ddpm_trains_under(ctx, tmp_path):
    torch.manual_seed(0)
    init = weights(make_unet(DDPMConfig.quick(**TINY_DDPM)))
    with CONTEXTS[ctx]():
        model = train_ddpm(DDPMConfig.quick(**TINY_DDPM), checkpoint_dir=tmp_path, progress=False)
    assert changed(init, model)


@pytest.mark.parametrize("ctx", CONTEXTS)
def test_lora_trains_under(ctx, tmp_path):
    torch.manual_seed(0)
    cfg = DDPMConfig.quick(**{**TINY_DDPM, "num_classes": 10})
    unet = make_unet(cfg)
    unet.ddpm_config = cfg
    ds = ConceptDataset(write_concept_folder(tmp_path / "concept", n=4, pixels=8), size=8)
    with CONTEXTS[ctx]():
        res = train_lora(unet, ds, LoRATrainConfig(rank=2, alpha=2.0, steps=2, batch_size=2, prior_images=0,
                                                   preview_every=0), progress=False)
    lora_b = [p for n, p in unet.named_parameters() if "lora_B" in n]
    assert len(res.history) == 2 and any(p.abs().sum() > 0 for p in lora_b)   # lora_B starts at zero


@pytest.mark.parametrize("ctx", CONTEXTS)
def test_score_models_train_under(ctx):
    with CONTEXTS[ctx]():
        toy, toy_losses = train_toy_score(ToyScoreConfig(steps=2, batch_size=16, n_data=64, hidden=8))
        ncsn, ncsn_losses = train_ncsn(NCSNConfig(steps=2, batch_size=8, channels=(8, 16)))
    assert len(toy_losses) == 2 and len(ncsn_losses) == 2
    assert all(torch.isfinite(torch.tensor(toy_losses + ncsn_losses)))


@pytest.mark.parametrize("ctx", CONTEXTS)
def test_finetune_trains_under(ctx):
    ds = target_task("train", n_per_class=2)
    with CONTEXTS[ctx]():
        res = finetune("course_resnet_32", ds, ds, "scratch",
                       config=FinetuneConfig(steps=2, batch_size=4, eval_every=2, device="cpu"))
    assert res.history


@pytest.mark.parametrize("ctx", CONTEXTS)
def test_tiny_gpt2_trains_under(ctx):
    texts = ["The Pile is a dataset of diverse text for language modelling. " * 20] * 8
    cfg = TinyGPTConfig(vocab_size=300, n_positions=16, n_embd=16, n_layer=1, n_head=2, steps=2, batch_size=2,
                        warmup=1)
    with CONTEXTS[ctx]():
        model, tok, history = train_tiny_gpt2(texts, cfg)
    assert len(history["loss"]) == 2 and history["loss"][0] > 0
