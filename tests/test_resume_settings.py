"""Issue 47 item 1: a resumed run whose settings differ from its checkpoint's uses the new value (the learning rate
written into the optimizer after its state is loaded; more steps) and says so, or refuses a setting that changes the
network, the objective or the data; the checkpoint's header records what trained (pytorch/examples #816,
composer #3154). One test per resumable trainer: train_ddpm, course lora's train_lora_run, train_flux_lora."""
import copy, json
from dataclasses import replace

import pytest
import torch

from course_lib.core import load_checkpoint
from course_lib.ddpm import CheckpointMismatch, DDPMConfig, read_checkpoint, train_ddpm

TINY = dict(block_out_channels=(8, 16), norm_num_groups=8, batch_size=8, warmup_steps=1, lr_schedule="constant")


def _lrs(path):
    return [g["lr"] for g in load_checkpoint(path)[0]["optimizer"]["param_groups"]]


def test_train_ddpm_resume_takes_the_new_lr_and_says_so(tmp_path):
    """Before the fix the optimizer state loaded from the checkpoint carried lr 3e-3 (and the LambdaLR its base lr) into
    steps 5-8 while the header said 1e-4."""
    a = DDPMConfig(**TINY, steps=4, checkpoint_every=4, lr=3e-3)
    train_ddpm(a, checkpoint_dir=tmp_path, progress=False)
    b = replace(a, steps=8, lr=1e-4, weight_decay=0.01)
    seen = []
    with pytest.warns(UserWarning, match=r"step 4 .*lr 0\.003 -> 0\.0001.*weight_decay 0\.0 -> 0\.01"):
        train_ddpm(b, checkpoint_dir=tmp_path, progress=False, callback=lambda s, l: seen.append(s))
    assert seen == [4, 5, 6, 7]
    state, meta = read_checkpoint(tmp_path)
    groups = state["optimizer"]["param_groups"]
    assert all(g["lr"] == pytest.approx(1e-4) and g["weight_decay"] == 0.01 for g in groups), groups
    assert meta["config"]["lr"] == 1e-4
    changes = json.loads(meta["changes"])                     # the header says what trained before step 4
    assert changes == [{"step": 4, "steps": [4, 8], "lr": [0.003, 0.0001], "weight_decay": [0.0, 0.01]}]


def test_train_ddpm_resume_same_settings_is_quiet(tmp_path, recwarn):
    a = DDPMConfig(**TINY, steps=2, checkpoint_every=2)
    train_ddpm(a, checkpoint_dir=tmp_path, progress=False)
    train_ddpm(replace(a, steps=3), checkpoint_dir=tmp_path, progress=False)     # more steps: no warning
    assert not [w for w in recwarn if "changed settings" in str(w.message)]
    assert json.loads(read_checkpoint(tmp_path)[1]["changes"]) == [{"step": 2, "steps": [2, 3]}]


@pytest.mark.parametrize("field,value", [("prediction_type", "epsilon"), ("beta_schedule", "linear"),
                                         ("classes", (1, 2))])
def test_train_ddpm_resume_refuses_another_objective_or_data(tmp_path, field, value):
    a = DDPMConfig(**TINY, steps=2, checkpoint_every=2)
    train_ddpm(a, checkpoint_dir=tmp_path, progress=False)
    with pytest.raises(CheckpointMismatch, match=rf"{field}=.* there, .* requested"):
        train_ddpm(replace(a, steps=4, **{field: value}), checkpoint_dir=tmp_path, progress=False)


# --- course lora train (notebook 49) -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def lora_base():
    from course_lib.ddpm import make_unet
    cfg = DDPMConfig.quick(classes=tuple(range(9)), num_classes=10, block_out_channels=(16, 32), norm_num_groups=8,
                           attention=(False, True), steps=1)
    torch.manual_seed(0)
    m = make_unet(cfg).eval()
    m.ddpm_config = cfg
    return m


@pytest.fixture(scope="module")
def lora_folder(tmp_path_factory):
    from course_lib.lora import write_concept_folder
    return write_concept_folder(tmp_path_factory.mktemp("lora") / "nines", n=8)


def test_lora_run_resume_takes_the_new_lr_and_says_so(lora_base, lora_folder, tmp_path):
    from course_lib.lora import train_lora_run
    from course_lib.lora import LoRATrainConfig
    a = LoRATrainConfig(rank=2, alpha=4.0, steps=2, batch_size=4, prior_images=0, preview_every=0, lr=1e-2)
    train_lora_run(lora_base, lora_folder, a, tmp_path, checkpoint_every=2)
    with pytest.warns(UserWarning, match=r"lr 0\.01 -> 0\.0001"):
        train_lora_run(lora_base, lora_folder, replace(a, steps=4, lr=1e-4), tmp_path, checkpoint_every=2)
    ck = tmp_path / "checkpoint.safetensors"
    assert all(lr == pytest.approx(1e-4) for lr in _lrs(ck)), _lrs(ck)
    meta = load_checkpoint(ck)[1]
    assert json.loads(meta["changes"]) == [{"step": 2, "lr": [0.01, 0.0001], "steps": [2, 4]}]
    with pytest.raises(ValueError, match=r"prior_images=0 \(now 4\)"):       # another prior set: other data
        train_lora_run(lora_base, lora_folder, replace(a, steps=6, prior_images=4), tmp_path)
    other = copy.deepcopy(lora_base)
    other.ddpm_config = replace(lora_base.ddpm_config, steps=2)                # another base model
    with pytest.raises(ValueError, match=r"base model"):
        train_lora_run(other, lora_folder, replace(a, steps=6), tmp_path)


# --- FLUX LoRA (notebook 77): already writes the lr; the header records the change ----------------------------
def test_flux_lora_resume_takes_the_new_lr_and_says_so(tmp_path):
    from course_lib.flux import FluxMiniConfig, make_flux_pipeline
    from course_lib.flux import FluxLoRAConfig, train_flux_lora, write_corner_folder
    base = make_flux_pipeline(FluxMiniConfig(num_layers=1, num_single_layers=1, text_layers=1))
    folder = write_corner_folder(tmp_path / "images", n=4, pixels=16)
    a = FluxLoRAConfig(rank=2, alpha=2.0, steps=2, batch_size=2, lr=1e-2, checkpoint_every=2)
    train_flux_lora(copy.deepcopy(base), folder, a, run_dir=tmp_path / "r", progress=False)
    with pytest.warns(UserWarning, match=r"lr 0\.01 -> 0\.0001"):
        train_flux_lora(copy.deepcopy(base), folder, replace(a, steps=3, lr=1e-4), run_dir=tmp_path / "r",
                        progress=False)
    ck = tmp_path / "r" / "checkpoint.safetensors"
    assert all(lr == pytest.approx(1e-4) for lr in _lrs(ck))
    assert json.loads(load_checkpoint(ck)[1]["changes"]) == [{"step": 2, "lr": [0.01, 0.0001], "steps": [2, 3]}]


def test_train_ddpm_resume_past_the_requested_steps_says_nothing_is_trained(tmp_path):
    "A checkpoint at step 4 asked for steps=2 used to return the step-4 model without a word."
    a = DDPMConfig(**TINY, steps=4, checkpoint_every=4)
    train_ddpm(a, checkpoint_dir=tmp_path, progress=False)
    seen = []
    with pytest.warns(UserWarning, match=r"at step 4, past steps=2: nothing is trained"):
        train_ddpm(replace(a, steps=2), checkpoint_dir=tmp_path, progress=False,
                   callback=lambda s, l: seen.append(s))
    assert seen == [] and read_checkpoint(tmp_path)[0]["step"] == 4
