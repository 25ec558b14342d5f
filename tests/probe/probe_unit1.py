"""Unit 1's library under the device probe (issue 27): tensors follow the model they meet."""
import math

import pytest
import torch

from course_lib.core import kind

DEV = kind()


@pytest.mark.skipif(DEV != "cuda", reason="bf16 emulation is a CUDA question")
def test_auto_precision_ignores_emulated_bf16():
    from course_lib.ddpm.training import _resolve_mixed_precision
    from course_lib.vision import bf16_supported
    assert not torch.cuda.is_bf16_supported(including_emulation=False)   # the probe: emulated
    assert _resolve_mixed_precision("auto", torch.device("cuda")) == "fp16"
    assert not bf16_supported(torch.device("cuda"))


def test_resumed_ddpm_optimizer_state_is_on_the_device(tmp_path):
    from course_lib.ddpm import DDPMConfig, train_ddpm
    cfg = DDPMConfig.quick(steps=2, batch_size=8, mixed_precision="no")
    train_ddpm(cfg, checkpoint_dir=tmp_path, progress=False)
    m = train_ddpm(DDPMConfig.quick(steps=3, batch_size=8, mixed_precision="no"),
                   checkpoint_dir=tmp_path, progress=False)
    assert len(m.history["loss"]) == 3
    assert next(m.parameters()).device.type == DEV


def test_fp16_on_an_emulated_bf16_gpu_trains_and_checkpoints_its_scaler(tmp_path):
    """Where bf16 is only emulated (a T4: the probe's default), 'auto' picks fp16 with a GradScaler, which calls
    `Tensor.to(copy=True)`; the scaler's state is checkpointed (on f9f3a38 the probe refused `copy=`)."""
    if DEV != "cuda" or torch.cuda.is_bf16_supported(including_emulation=False):
        pytest.skip("fp16 with a loss scaler is the CUDA choice without native bf16")
    from accelerate.state import AcceleratorState, PartialState
    from course_lib.ddpm import DDPMConfig, read_checkpoint, train_ddpm
    AcceleratorState._reset_state(True); PartialState._reset_state()     # an earlier test chose no mixed precision
    cfg = DDPMConfig(image_size=8, block_out_channels=(8, 16), norm_num_groups=8, num_train_timesteps=30,
                     steps=3, batch_size=8, warmup_steps=1, checkpoint_every=2)
    m = train_ddpm(cfg, dataset=torch.rand(32, 1, 8, 8) * 2 - 1, checkpoint_dir=tmp_path, progress=False)
    assert len(m.history["loss"]) == 3 and all(math.isfinite(v) for v in m.history["loss"])
    assert read_checkpoint(tmp_path)[0]["grad_scaler"]["_growth_tracker"] == 3
