"""Issue 47 (7): 0 is a value, not "the default". Every generate/sample function refuses 0 (and negatives, non-ints)
for a count or a size, naming the argument and the value, where it used to read `x or default` and silently
draw the default (FLUX-mini's `height=0` drew 16x16, `flux_generate(resolution=0)` 256x256, `n=0` one image);
FLUX-mini refuses sizes its 2x2 patching cannot take with the nearest sizes it can (FluxPipeline itself
rounds them down with a logged warning only)."""
import tempfile

import pytest
import torch

from course_lib.ddpm import DDPMConfig, make_scheduler, make_unet, sample
from course_lib.flux import generate, make_flux_pipeline
from course_lib.flux import FluxMiniConfig
from course_lib.flux import flux_generate
from course_lib.lora import generate as unet_generate

TINY = FluxMiniConfig(num_layers=1, num_single_layers=1, text_layers=1)
BAD_COUNTS = [0, -1, 2.0, True, "4"]


@pytest.fixture(scope="module")
def pipe():
    return make_flux_pipeline(TINY)


@pytest.fixture(scope="module")
def unet():
    torch.manual_seed(0)
    cfg = DDPMConfig.quick(block_out_channels=(8, 16), norm_num_groups=4, num_classes=10)
    m = make_unet(cfg).eval()
    m.ddpm_config = cfg
    return m


@pytest.mark.parametrize("v", [0, -16, 16.0, True, "16"], ids=repr)
@pytest.mark.parametrize("side", ["height", "width"])
def test_flux_generate_refuses_a_size_that_is_not_a_positive_int(pipe, side, v):
    with pytest.raises(ValueError, match=rf"{side}={v!r}: .*positive multiples of 4"):
        generate(pipe, ["seven"], num_inference_steps=1, **{side: v})


@pytest.mark.parametrize("v,near", [(18, "use 16 or 20"), (2, "use 4"), (30, "use 28 or 32")])
def test_flux_sizes_off_the_patch_grid_name_the_nearest(pipe, v, near):
    with pytest.raises(ValueError, match=rf"height={v}: .*FluxPipeline would round it down.*{near}"):
        generate(pipe, ["seven"], num_inference_steps=1, height=v)
    with pytest.raises(ValueError, match=rf"resolution={v}: .*{near}"):
        flux_generate(pipe, "seven", v, num_inference_steps=1)
    assert generate(pipe, ["seven"], num_inference_steps=1, height=None).shape == (1, 1, 16, 16)


@pytest.mark.parametrize("v", BAD_COUNTS, ids=repr)
def test_flux_generate_refuses_bad_counts_by_name(pipe, v):
    for name in ("num_inference_steps", "batch_size"):
        with pytest.raises(ValueError, match=rf"{name} must be an int >= 1, got {v!r}"):
            generate(pipe, ["seven"], **{"num_inference_steps": 1, name: v})
    with pytest.raises(ValueError, match=r"seed must be an int, got 1.5"):
        generate(pipe, ["seven"], num_inference_steps=1, seed=1.5)


@pytest.mark.parametrize("v", BAD_COUNTS, ids=repr)
def test_flux_generate_of_the_lora_lessons_refuses_zero(pipe, v):
    with pytest.raises(ValueError, match=rf"n \(the number of images\) must be a positive int, got {v!r}"):
        flux_generate(pipe, "seven", 16, n=v, num_inference_steps=1)
    for name in ("num_inference_steps", "max_sequence_length"):
        with pytest.raises(ValueError, match=rf"{name} must be an int >= 1, got {v!r}"):
            flux_generate(pipe, "seven", 16, **{"num_inference_steps": 1, name: v})
    with pytest.raises(ValueError, match=rf"resolution={v!r}: .*positive multiples of 4"):
        flux_generate(pipe, "seven", v, num_inference_steps=1)


def test_flux_generate_n_with_a_list_must_match(pipe):
    with pytest.raises(ValueError, match=r"n=3 images for 2 prompts"):
        flux_generate(pipe, ["seven", "two"], 16, n=3, num_inference_steps=1)
    assert flux_generate(pipe, ["seven", "two"], 16, n=2, num_inference_steps=1).shape == (2, 1, 16, 16)
    assert flux_generate(pipe, "seven", 16, num_inference_steps=1).shape == (1, 1, 16, 16)


@pytest.mark.parametrize("v", [0, -1, 2.0, True], ids=repr)
def test_unit4_generate_refuses_zero_images(unet, v):
    with pytest.raises(ValueError, match=rf"n \(the number of images\) must be a positive int, got {v!r}"):
        unet_generate(unet, "a photo of a 3", n=v, num_inference_steps=2)
    with pytest.raises(ValueError, match=r"n=3 images for 2 prompts"):
        unet_generate(unet, ["a photo of a 3", "a photo of a 4"], n=3, num_inference_steps=2)
    assert unet_generate(unet, "a photo of a 3", num_inference_steps=2).shape[0] == 1


@pytest.mark.parametrize("v", [0, -2, 2.0, True], ids=repr)
def test_unit1_sample_refuses_a_zero_batch(unet, v):
    with pytest.raises(ValueError, match=rf"batch_size must be an int >= 1 \(None: all 3 at once\), got {v!r}"):
        sample(unet, make_scheduler("ddim", unet.ddpm_config), 3, 2, class_labels=1, batch_size=v)
    u8, _ = sample(unet, make_scheduler("ddim", unet.ddpm_config), 3, 2, class_labels=1, batch_size=None)
    assert len(u8) == 3


@pytest.mark.parametrize("v", [0, -2, 2.0], ids=repr)
def test_sample_flow_refuses_a_zero_batch(v):
    from course_lib.flux import FlowConfig, make_flow_model, sample_flow
    cfg = FlowConfig.from_ddpm(DDPMConfig.quick(block_out_channels=(8, 16), norm_num_groups=4))
    m = make_flow_model(cfg).eval()
    m.flow_config = cfg
    with pytest.raises(ValueError, match=rf"batch_size must be an int >= 1, got {v!r}"):
        sample_flow(m, 2, 1, batch_size=v)


def test_studio_generate_refuses_zero(tmp_path):
    pytest.importorskip("gradio", reason='the studio needs pip install "course_lib[studio]"')
    from course_lib.studio import Studio, build_studio, tiny_bases
    st = Studio(tmp_path / "s", tiny_bases())
    for trainer, prompt in (("unet", "a photo of digit three"), ("flux", "seven")):
        with pytest.raises(ValueError, match=r"n \(the number of images\) must be a positive int, got 0"):
            st.generate(trainer, prompt, {}, steps=2, n=0)
        with pytest.raises(ValueError, match=r"num_inference_steps must be an int .*got 0"):
            st.generate(trainer, prompt, {}, steps=0, n=1)
    # the page: an emptied box is the default, a 0 is a 0 (refused with its name, not read as the default)
    demo = build_studio(tempfile.mkdtemp(dir=tmp_path), tiny_bases())
    fns = demo.fns.values() if isinstance(demo.fns, dict) else demo.fns
    run = next(f.fn for f in fns if f.api_name == "generate")
    # arguments: base, prompt, negative prompt, images, seed, guidance, steps, width, height, adapters
    msg = run("unet", "a photo of digit three", "", 2, 0, 0, 2, 0, 0, "")[0]
    assert msg.startswith("**error**") and "guidance_scale must be" in msg and "got 0" in msg, msg
    msg = run("unet", "a photo of digit three", "", 2, 0, 1.0, 0, 0, 0, "")[0]
    assert msg.startswith("**error**") and "num_inference_steps must be" in msg and "got 0" in msg, msg
    msg = run("unet", "a photo of digit three", "", 0, 0, 1.0, 2, 0, 0, "")[0]
    assert msg.startswith("**error**") and "n (the number of images) must be a positive int, got 0" in msg, msg
    assert run("unet", "a photo of digit three", "", None, None, None, 2, None, None, "")[0].startswith("generated")
    # width and height: 0 (the box's default) is the base's own size, another size on the UNet is refused
    assert run("unet", "a photo of digit three", "", 2, 0, 1.0, 2, 0, 0, "")[0].startswith("generated")
    msg = run("unet", "a photo of digit three", "", 2, 0, 1.0, 2, 16, 16, "")[0]
    assert msg.startswith("**error**") and "only its own size" in msg, msg


@pytest.mark.parametrize("v", [0, -8, 16.0, True], ids=repr)
@pytest.mark.parametrize("name", ["resolution", "max_sequence_length"])
def test_flux_lora_config_refuses_zero_for_an_optional_size(name, v):
    "0 used to pass and then read as None (`cfg.resolution or ...`): the default is None, 0 is refused by name."
    from course_lib.flux import FluxLoRAConfig
    with pytest.raises(ValueError, match=rf"{name} must be None \(the default\) or an int >= 1, got {v!r}"):
        FluxLoRAConfig(**{name: v})
    assert getattr(FluxLoRAConfig(**{name: None}), name) is None
