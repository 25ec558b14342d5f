"""Unit 1's library under the device probe (issue 27): tensors follow the model they meet."""
import pytest
import torch

from course_lib.device_probe import kind

DEV = kind()


@pytest.mark.skipif(DEV != "cuda", reason="bf16 emulation is a CUDA question")
def test_auto_precision_ignores_emulated_bf16():
    from course_lib.ddpm_training import _resolve_mixed_precision
    from course_lib.vision import bf16_supported
    assert not torch.cuda.is_bf16_supported(including_emulation=False)   # the probe: emulated
    assert _resolve_mixed_precision("auto", torch.device("cuda")) == "fp16"
    assert not bf16_supported(torch.device("cuda"))


def test_resumed_ddpm_optimizer_state_is_on_the_device(tmp_path):
    from course_lib.ddpm_training import DDPMConfig, train_ddpm
    cfg = DDPMConfig.quick(steps=2, batch_size=8, mixed_precision="no")
    train_ddpm(cfg, checkpoint_dir=tmp_path, progress=False)
    m = train_ddpm(DDPMConfig.quick(steps=3, batch_size=8, mixed_precision="no"),
                   checkpoint_dir=tmp_path, progress=False)
    assert len(m.history["loss"]) == 3
    assert next(m.parameters()).device.type == DEV
