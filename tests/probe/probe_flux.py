"""Unit 7 (guidance, flow matching, FLUX in miniature) on the accelerator, under the device probe (issue 27): the
samplers take a generator on either device (CPU or the model's), the FLUX-mini pipeline opens on the learner's
device (`course_lib.core.basics.get_device()`), and FLUX-mini and its LoRA train and sample there. Before the fixes a
generator on the device was refused ("Expected a 'cpu' device type for generator"), `open_flux_mini` left the
pipeline on the CPU, and the trainers mixed CPU noise into device models."""
import copy

import pytest
import torch

from course_lib.core import kind, ops_on_device

DEV = kind()
SMALL = dict(num_layers=1, num_single_layers=1, text_layers=1)


def gen(where: str, seed: int = 0) -> torch.Generator:
    return torch.Generator(DEV if where == "device" else "cpu").manual_seed(seed)


@pytest.fixture(scope="module")
def guided():
    from course_lib.ddpm import DDPMConfig, make_unet
    torch.manual_seed(0)
    cfg = DDPMConfig.quick(num_classes=11)
    m = make_unet(cfg).eval().to(DEV)
    m.ddpm_config, m.null_class = cfg, 10
    return m


@pytest.mark.parametrize("where", ["cpu", "device"])
@pytest.mark.parametrize("sampler", ["ancestral", "ddpm", "ddim", "dpm++"])
def test_sample_guided_takes_a_generator_on_either_device(guided, where, sampler):
    from course_lib.flux import sample_guided
    before = ops_on_device()
    u8, x = sample_guided(guided, 4, [0, 1, 2, 3], 3.0, 2, generator=gen(where), sampler=sampler)
    assert u8.shape == (4, 1, 8, 8) and u8.device.type == "cpu" and torch.isfinite(x).all()
    assert ops_on_device() > before
    u8n, _ = sample_guided(guided, 2, None, 2.0, 2, negative=1, generator=gen(where), sampler=sampler)
    assert u8n.shape == (2, 1, 8, 8)


@pytest.mark.parametrize("where", ["cpu", "device"])
@pytest.mark.parametrize("sampler", ["ancestral", "ddim", "dpm++"])
def test_ddpm_sample_takes_a_generator_on_either_device(where, sampler):
    "Unit 1's `sample` (lesson 13), which `sample_guided` runs."
    from course_lib.ddpm import DDPMConfig, make_scheduler, make_unet, sample
    torch.manual_seed(0)
    cfg = DDPMConfig.quick()
    model = make_unet(cfg).to(DEV)
    u8, x = sample(model, make_scheduler(sampler, cfg), 3, 3, generator=gen(where))
    assert u8.shape == (3, 1, 8, 8) and torch.isfinite(x).all()


@pytest.fixture(scope="module")
def flow():
    from course_lib.ddpm import DDPMConfig
    from course_lib.flux import FlowConfig, make_flow_model
    torch.manual_seed(0)
    cfg = FlowConfig.from_ddpm(DDPMConfig.quick(), num_classes=10, label_dropout=0.1)
    m = make_flow_model(cfg).eval()
    m.flow_config = cfg
    return m


@pytest.mark.parametrize("where", ["cpu", "device"])
def test_sample_flow_takes_a_generator_on_either_device(flow, where):
    from course_lib.flux import sample_flow
    on_dev = copy.deepcopy(flow).to(DEV)
    u8, x = sample_flow(on_dev, 4, 2, class_labels=[0, 1, 2, 3], guidance_scale=2.0, generator=gen(where))
    assert u8.shape == (4, 1, 8, 8) and x.device.type == "cpu" and torch.isfinite(x).all()
    # a CPU generator draws the same noise for a model on either device: the same samples
    ref = sample_flow(flow, 4, 2, class_labels=[0, 1, 2, 3], guidance_scale=2.0, generator=gen("cpu"))[1]
    if where == "cpu":
        assert (x - ref).abs().max() < 1e-4


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    "An untrained small FLUX-mini pipeline, saved as `load_flux_mini` caches one."
    from course_lib.flux import FluxMiniConfig, make_flux_pipeline
    from course_lib.flux import save_flux_mini
    return save_flux_mini(make_flux_pipeline(FluxMiniConfig(**SMALL)), tmp_path_factory.mktemp("fm") / "pipe")


def test_open_flux_mini_puts_the_pipeline_on_the_device(saved):
    from course_lib.flux import generate
    from course_lib.flux import open_flux_mini
    from course_lib.flux import judge_prompt_rate
    pipe = open_flux_mini(saved)
    for name in ("transformer", "vae", "text_encoder", "text_encoder_2"):
        assert getattr(pipe, name).device.type == DEV, name
    # CLIP's position ids, a buffer transformers fills after loading on 'meta' (under the probe they were
    # uninitialised memory while `with torch.device('meta'): torch.tensor([])` gave a CPU tensor)
    ids = next(b for n, b in pipe.text_encoder.named_buffers() if n.endswith("position_ids"))
    assert torch.equal(ids.cpu(), torch.arange(ids.shape[-1])[None])
    before = ops_on_device()
    x = generate(pipe, ["seven", "bold two slanted left"], guidance_scale=2.0, num_inference_steps=2)
    assert x.shape == (2, 1, 16, 16) and x.device.type == "cpu" and ops_on_device() > before
    cpu = open_flux_mini(saved).to("cpu")
    ref = generate(cpu, ["seven", "bold two slanted left"], guidance_scale=2.0, num_inference_steps=2)
    assert (x - ref).abs().max() < 1e-4
    r = judge_prompt_rate(pipe, ["seven", "two"], num_inference_steps=2)
    assert r["n"] == 2 and 0 <= r["rate"] <= 1


def test_flux_velocity_follows_the_pipeline(saved):
    "Lesson 72's own Euler loop: `FluxVelocity` on the pipeline's device, its tables there too."
    from course_lib.flux import FluxVelocity, caption_table, encode_latents
    from course_lib.flux import open_flux_mini
    pipe = open_flux_mini(saved)
    table, pe, pooled, ids = caption_table(pipe, ["seven", "two"])
    assert pe.device.type == DEV
    vel = FluxVelocity(pipe.transformer, pe, pooled, ids)
    z = torch.randn(2, 4, 8, 8, generator=gen("cpu")).to(pipe.device)
    v = vel(z, torch.tensor(0.5, device=pipe.device), torch.tensor([0, 1]))
    assert v.shape == z.shape and v.device.type == DEV
    x0 = encode_latents(pipe, torch.zeros(3, 1, 16, 16))     # CPU images in, latents on the device
    assert x0.shape == (3, 4, 8, 8) and x0.device.type == DEV


def test_train_flux_mini_trains_on_the_device():
    from course_lib.flux import FluxMiniConfig
    from course_lib.flux import train_flux_mini
    before = ops_on_device()
    pipe = train_flux_mini(FluxMiniConfig(**SMALL, steps=2, vae_steps=2, batch_size=8), progress=False)
    assert pipe.vae.device.type == DEV and pipe.transformer.device.type == DEV
    assert len(pipe.history["vae_loss"]) == 2 and len(pipe.history["flow_loss"]) == 2
    assert ops_on_device() > before


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from course_lib.flux import write_corner_folder
    return write_corner_folder(tmp_path_factory.mktemp("corner") / "images", n=8, pixels=16)


def lora_cfg(**kw):
    from course_lib.flux import FluxLoRAConfig
    return FluxLoRAConfig(**{"rank": 4, "alpha": 4.0, "steps": 3, "batch_size": 4, "lr": 1e-2,
                             "checkpoint_every": 2, **kw})


@pytest.mark.parametrize("text_encoder", [False, True], ids=["transformer", "with-clip"])
def test_flux_lora_trains_and_reloads_on_the_device(saved, folder, tmp_path, text_encoder):
    from course_lib.flux import open_flux_mini
    from course_lib.flux import load_flux_lora, save_flux_lora
    from course_lib.flux import flux_generate, train_flux_lora
    base = open_flux_mini(saved)
    lora = copy.deepcopy(base)
    before = ops_on_device()
    run = train_flux_lora(lora, folder, lora_cfg(train_text_encoder=text_encoder), run_dir=tmp_path / "run",
                          progress=False, reg_folder=folder)
    assert run.step == 3 and ops_on_device() > before
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in run.history)
    more = train_flux_lora(lora, folder, lora_cfg(train_text_encoder=text_encoder, steps=4),
                           run_dir=tmp_path / "run", progress=False, reg_folder=folder)   # resumed
    assert more.step == 4
    path = save_flux_lora(lora, tmp_path / "lora.safetensors")
    back = copy.deepcopy(base)
    load_flux_lora(back, path)
    a = flux_generate(lora, ["sks seven", "two"], 16, num_inference_steps=2)
    b = flux_generate(back, ["sks seven", "two"], 16, num_inference_steps=2)
    assert a.device.type == "cpu" and (a - b).abs().max() < 1e-5


def test_flux_lora_on_a_bf16_base_on_the_device(saved, folder):
    "How FLUX trainers run on a GPU: a bfloat16 base, float32 LoRA weights (diffusers' cast_training_params)."
    from course_lib.flux import open_flux_mini
    from course_lib.flux import flux_generate, train_flux_lora
    pipe = open_flux_mini(saved).to(torch.bfloat16)
    run = train_flux_lora(pipe, folder, lora_cfg(), progress=False)
    lora = [p for n, p in pipe.transformer.named_parameters() if "lora_" in n]
    assert lora and all(p.dtype == torch.float32 and p.device.type == DEV for p in lora)
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in run.history)
    assert torch.isfinite(flux_generate(pipe, ["sks seven"], 16, num_inference_steps=2)).all()
