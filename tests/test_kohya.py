"""course_lib.flux.kohya_format (notebook 81a): LoRA files in kohya's layout for unit 4's UNet and unit 7's FLUX
pipeline (written, read back, loaded by diffusers' own `load_lora_weights`), and course_lib.flux.kohya (notebook 81):
the export options with their measured cost (file size, largest output change, concept rate), scaled right for
rsLoRA and the patterns.
Small untrained models with random LoRA weights: seconds each."""
import copy

import pytest
import torch
from safetensors import safe_open

from course_lib.flux import FluxMiniConfig, generate, make_flux_pipeline
from course_lib.flux import add_flux_lora
from course_lib.flux import lora_state, save_flux_lora
from course_lib.flux import FluxLoRAConfig
from course_lib.flux import (
    export_adapter, export_options, flux_concept_judge, load_kohya_lora, model_output,
    read_kohya_lora, save_kohya_lora, unet_concept_judge)

SMALL = dict(num_layers=1, num_single_layers=1, text_layers=1)
PATTERNS = dict(use_rslora=True, rank_pattern={"to_v": 2}, alpha_pattern={"to_k": 2})


@pytest.fixture(scope="module")
def base():
    return make_flux_pipeline(FluxMiniConfig(**SMALL))


def randomize(*models, seed=0):
    "Random LoRA weights (A and B) in place of training: every layer's update is non-zero."
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in models:
            for n, p in m.named_parameters():
                if "lora_" in n: p.copy_(torch.randn(p.shape, generator=g) * 0.1)


@pytest.fixture(scope="module")
def flux(base):
    "Unit 7's adapter: rank 4, alpha 8 on the transformer's attention and the CLIP text encoder."
    pipe = copy.deepcopy(base)
    add_flux_lora(pipe, FluxLoRAConfig(rank=4, alpha=8.0, train_text_encoder=True))
    randomize(pipe.transformer, pipe.text_encoder)
    return pipe


def tiny_unet(width=16):
    from course_lib.ddpm import DDPMConfig, make_unet
    cfg = DDPMConfig.quick(classes=tuple(range(9)), num_classes=10, block_out_channels=(width, 32),
                           norm_num_groups=8, attention=(False, True), steps=1)
    torch.manual_seed(0)
    m = make_unet(cfg).eval()
    m.ddpm_config = cfg
    return m


@pytest.fixture(scope="module")
def unet():
    "Unit 4's adapter: `add_lora` rank 2, alpha 4 on its default targets, named 'concept'."
    from course_lib.lora import add_lora
    m = add_lora(tiny_unet(), 2, 4.0, adapter_name="concept")
    randomize(m, seed=1)
    return m


def keys_and_meta(path):
    with safe_open(str(path), "pt") as f:
        return list(f.keys()), f.metadata()


def test_flux_kohya_file_loads_in_diffusers_to_the_same_images(base, flux, tmp_path):
    k = save_kohya_lora(flux, tmp_path/"k.safetensors")
    d = save_flux_lora(flux, tmp_path/"d.safetensors")
    keys, meta = keys_and_meta(k)
    assert all(x.startswith(("lora_transformer_", "lora_te1_text_model_encoder_")) for x in keys)
    assert any(x.startswith("lora_te1_") for x in keys)
    ends = [x.split(".", 1)[1] for x in keys]
    assert ends.count("alpha") == ends.count("lora_down.weight") == ends.count("lora_up.weight") == len(keys) / 3
    # OneTrainer's names, not sd-scripts' (`lora_unet_double_blocks_*`): no sd-scripts `ss_*` claims
    assert not any(x.startswith(("lora_unet_double_blocks_", "lora_unet_single_blocks_")) for x in keys)
    assert [m for m in meta if m.startswith("ss_")] == []
    assert (meta["course_lib.format"], meta["course_lib.network_dim"],
            meta["course_lib.network_alpha"]) == ("kohya-style (OneTrainer names)", "4", "8.0")
    via_k, via_d = copy.deepcopy(base), copy.deepcopy(base)
    via_k.load_lora_weights(str(k))                 # diffusers' own conversion of kohya files
    via_d.load_lora_weights(str(d))
    run = lambda p: generate(p, ["sks seven", "three", "sks one"], num_inference_steps=3, seed=3)
    want, got_k, got_d = run(flux), run(via_k), run(via_d)
    assert (got_k - got_d).abs().max().item() <= 1e-5         # measured: 0 on the CPU
    assert (run(base) - want).abs().max().item() > 1e-2      # the adapter does change the images
    # the diffusers-format file reloads exactly: every weight bitwise (the images to float32 rounding)
    assert (got_d - want).abs().max().item() <= 1e-5
    orig, back = lora_state(flux), lora_state(via_d, "default_0")
    assert orig.keys() == back.keys() == {"transformer", "text_encoder"}
    for part in orig:
        assert orig[part].keys() == back[part].keys()
        assert all(torch.equal(orig[part][n], back[part][n]) for n in orig[part])


def test_sd_scripts_names_cannot_hold_flux_mini_single_blocks(flux):
    """Why the FLUX files keep OneTrainer's names: the course's LoRA adapts the single blocks' to_q, to_k
    and to_v, which sd-scripts names only inside the fused `lora_unet_single_blocks_{i}_linear1` (q, k, v
    and the MLP's input), and diffusers' converter splits linear1 at FLUX.1's widths (3072 x 3 + 12288
    rows, `_convert_kohya_flux_lora_to_diffusers`), which FLUX-mini's is not. If this fails, a diffusers
    release converts other widths, and the export can write sd-scripts' names with their `ss_*`."""
    from peft.tuners.lora import LoraLayer
    from diffusers.loaders.lora_conversion_utils import _convert_kohya_flux_lora_to_diffusers
    tr = flux.transformer
    adapted = [n for n, m in tr.named_modules() if isinstance(m, LoraLayer)]
    assert {n.rsplit(".", 1)[1] for n in adapted if n.startswith("single_transformer_blocks.")} == {
        "to_q", "to_k", "to_v"}
    block, r = tr.single_transformer_blocks[0], 4
    w, mlp = block.attn.to_q.in_features, block.proj_mlp.out_features
    up = torch.zeros(3 * w + mlp, 3 * r)                 # sd-scripts' fused layout: block-diagonal
    for j in range(3): up[j * w:(j + 1) * w, j * r:(j + 1) * r] = torch.randn(w, r)
    name = "lora_unet_single_blocks_0_linear1"
    sd = {f"{name}.lora_down.weight": torch.randn(3 * r, w), f"{name}.lora_up.weight": up,
          f"{name}.alpha": torch.tensor(3.0 * 8)}
    with pytest.raises(AssertionError):                  # assert sum(dims) == up_weight.shape[0]
        _convert_kohya_flux_lora_to_diffusers(sd)


def test_unet_adapter_round_trips_through_kohya_exactly(unet, tmp_path):
    from peft.utils import get_peft_model_state_dict
    path = save_kohya_lora(unet, tmp_path/"u.safetensors", "concept")
    keys, meta = keys_and_meta(path)
    assert all(x.startswith("lora_unet_") for x in keys)
    assert "lora_unet_mid_block_attentions_0_to_out_0.alpha" in keys
    assert (meta["ss_network_module"], meta["ss_network_dim"], meta["ss_network_alpha"],
            meta["course_lib.format"]) == ("networks.lora", "2", "4.0", "kohya")
    want = get_peft_model_state_dict(unet, adapter_name="concept")
    state, info = read_kohya_lora(path)                  # names back from the file's own map
    assert state.keys() == {f"unet.{k}" for k in want}
    assert all(torch.equal(state[f"unet.{k}"], v) for k, v in want.items())
    assert set(info["alphas"].values()) == {4.0} and info["config"]["unet"]["r"] == 2
    fresh = tiny_unet()
    load_kohya_lora(fresh, path, "concept")
    got = get_peft_model_state_dict(fresh, adapter_name="concept")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    # equal weights, equal scales: the output agrees to float32 rounding (BLAS kernels may round
    # differently for tensors at other addresses; measured 6e-7 on the CPU)
    assert (model_output(fresh) - model_output(unet)).abs().max().item() <= 1e-5
    assert not torch.equal(model_output(tiny_unet()), model_output(unet))


def test_kohya_file_for_another_architecture_names_the_keys(base, flux, unet, tmp_path):
    u = save_kohya_lora(unet, tmp_path/"u.safetensors", "concept")
    f = save_kohya_lora(flux, tmp_path/"f.safetensors")
    pipe = copy.deepcopy(base)
    with pytest.raises(ValueError, match=r"u\.safetensors does not fit this model: \d+ of its kohya "
                                         r"layers name no layer of it: \['lora_unet_down_blocks_"):
        load_kohya_lora(pipe, u)
    assert not getattr(pipe.transformer, "peft_config", None)            # left as it was
    m = tiny_unet()
    with pytest.raises(ValueError, match=r"f\.safetensors does not fit this model: \d+ of its kohya "
                                         r"layers name no layer of it: \['lora_te1_text_model_"):
        load_kohya_lora(m, f)
    wide = tiny_unet(width=24)                      # the same layer names, other widths
    with pytest.raises(ValueError, match=r"u\.safetensors was trained for another unet: lora_unet_"
                                         r"\S+_time_emb_proj\.lora_down\.weight has shape \(2, 64\), but "
                                         r"unet\.\S+ here is Linear\(in_features=96"):
        load_kohya_lora(wide, u)
    assert not getattr(m, "peft_config", None) and not getattr(wide, "peft_config", None)
    with pytest.raises(ValueError, match=r"d\.safetensors is not in kohya's layout"):
        read_kohya_lora(save_flux_lora(flux, tmp_path/"d.safetensors"))


def test_bad_export_requests_are_refused_by_name(flux, unet, tmp_path):
    with pytest.raises(ValueError, match=r"rank must be in 1\.\.4"):
        save_kohya_lora(flux, tmp_path/"a.safetensors", rank=5)
    with pytest.raises(ValueError, match=r"rank must be in 1\.\.2"):
        export_adapter(unet, tmp_path/"a.safetensors", "diffusers", "concept", rank=0)
    with pytest.raises(ValueError, match=r"no adapter 'nope' in this UNet2DModel; adapters: \['concept'\]"):
        save_kohya_lora(unet, tmp_path/"a.safetensors", "nope")
    with pytest.raises(ValueError, match=r"written as \.safetensors, got 'a\.pt'"):
        save_kohya_lora(unet, tmp_path/"a.pt", "concept")
    with pytest.raises(ValueError, match=r"format must be one of \('diffusers', 'kohya'\)"):
        export_adapter(unet, tmp_path/"a.safetensors", "ckpt", "concept")
    with pytest.raises(ValueError, match=r"unknown dtype in \[\('fp8', None\)\]"):
        export_options(unet, "concept", options=[("fp8", None)], folder=tmp_path)


def test_export_options_measure_size_output_change_and_concept_rate(flux, tmp_path):
    before, out0 = lora_state(flux), model_output(flux)
    grads = [p.requires_grad for p in flux.transformer.parameters()]
    nbytes = sum(v.numel() * 4 for sd in before.values() for v in sd.values())
    judge = flux_concept_judge(n=4, num_inference_steps=2)
    rate0 = judge(flux)
    rows = export_options(flux, judge=judge, folder=tmp_path)
    opts = [("fp32", 4), ("fp16", 4), ("bf16", 4), ("fp32", 2)]
    assert [(r["format"], r["dtype"], r["rank"]) for r in rows] == [
        (f, d, r) for f in ("diffusers", "kohya") for d, r in opts]
    by = {(r["format"], r["dtype"], r["rank"]): r for r in rows}
    for f in ("diffusers", "kohya"):
        full, f16, b16, half = (by[(f, *o)] for o in opts)
        assert full["max_output_change"] <= 1e-5 and full["concept_rate"] == rate0
        assert 0 < f16["max_output_change"] < b16["max_output_change"] < 0.1   # bf16: 3 bits fewer
        assert half["max_output_change"] > 10 * b16["max_output_change"]      # rank 2 of 4 random
        # half the bytes of the weights saved (the header, the same in each, dominates this tiny file)
        assert full["bytes"] - f16["bytes"] >= 0.45 * nbytes and full["bytes"] - half["bytes"] >= 0.45 * nbytes
        assert all(r["bytes"] == r["path"].stat().st_size for r in (full, f16, b16, half))
        assert all(0.0 <= r["concept_rate"] <= 1.0 for r in (full, f16, b16, half))
    # the model is left as it was: one adapter, active, the same weights and output
    assert list(flux.transformer.peft_config) == ["default"] == list(flux.text_encoder.peft_config)
    after = lora_state(flux)
    assert all(torch.equal(before[p][n], after[p][n]) for p in before for n in before[p])
    assert torch.equal(model_output(flux), out0)
    assert grads == [p.requires_grad for p in flux.transformer.parameters()]


def test_export_options_for_the_unet_with_its_concept_rate(unet, tmp_path):
    from course_lib.lora import concept_report
    judge = unet_concept_judge(n=8, num_inference_steps=4)
    rows = export_options(unet, "concept", options=[("fp32", None), ("bf16", None), ("fp32", 1)],
                          judge=judge, folder=tmp_path)
    assert len(rows) == 6 and {r["format"] for r in rows} == {"diffusers", "kohya"}
    rate = concept_report(unet, n=8, num_inference_steps=4)["concept_rate"]
    for r in rows:
        assert 0.0 <= r["concept_rate"] <= 1.0
        if (r["dtype"], r["rank"]) == ("fp32", 2):
            assert r["max_output_change"] <= 1e-5 and r["concept_rate"] == rate
        else:
            assert r["max_output_change"] > 0
    from course_lib.lora import read_adapter
    t, meta = read_adapter(tmp_path/"concept-diffusers-fp32-r1.safetensors")
    assert meta["rank"] == 1 and meta["alpha"] == 1.0 and not meta["use_rslora"]
    assert list(unet.peft_config) == ["concept"]


def rslora_model(base, kind):
    from peft import LoraConfig
    if kind == "flux":
        model = copy.deepcopy(base)
        model.transformer.add_adapter(LoraConfig(r=4, lora_alpha=6, target_modules=["to_q", "to_k", "to_v"],
                                                 init_lora_weights="gaussian", **PATTERNS))
        randomize(model.transformer, seed=2)
        return model, model.transformer
    from course_lib.lora import add_lora
    model = add_lora(tiny_unet(), 4, 6.0, ["to_q", "to_k", "to_v"], **PATTERNS)
    randomize(model, seed=2)
    return model, model


@pytest.mark.parametrize("kind", ["flux", "unet"])
def test_reduced_adapter_at_full_rank_keeps_rslora_and_pattern_scales(base, kind, tmp_path):
    """A reduced export stores each layer's update with its own scale folded in (rsLoRA alpha/sqrt(r), the
    rank_pattern and alpha_pattern entries). Reduced to the adapter's own rank it must give the adapter's
    output, in both formats; scaled by one global alpha/r it would be far off (the last check shows how far)."""
    model, lora_model = rslora_model(base, kind)
    rows = export_options(model, options=[("fp32", None), ("fp32", 4), ("fp32", 2)], folder=tmp_path)
    assert len(rows) == 6
    for r in rows:
        if r["rank"] == 4: assert r["max_output_change"] <= 1e-5, r
        else: assert r["max_output_change"] > 1e-4, r
    ref = model_output(model)
    from peft.tuners.lora import LoraLayer
    layers = [m for m in lora_model.modules() if isinstance(m, LoraLayer)]
    assert len({m.scaling["default"] for m in layers}) == 3          # rsLoRA, the rank and alpha patterns
    for m in layers: m.scaling["default"] = 6 / 4                     # the wrong scale: alpha / r
    assert (model_output(model) - ref).abs().max().item() > 100 * 1e-5
