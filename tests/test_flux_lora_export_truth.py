"""course_lib.flux.lora_export (notebook 76) against peft's and diffusers' own numbers: the exported file
reloads to each layer's true update (rsLoRA, rank_pattern, alpha_pattern), a reduced one to its truncated
SVD; files in the other formats diffusers converts (kohya, ComfyUI / BFL, XLabs) pass the check and load to
the update diffusers' conversion defines; files diffusers cannot convert are refused by name."""
import copy, json
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from course_lib.flux import FluxMiniConfig, make_flux_pipeline
from course_lib.flux import check_flux_lora, load_flux_lora, reduce_rank, save_flux_lora

SMALL = dict(num_layers=1, num_single_layers=1, text_layers=1)
TARGETS = ["to_q", "to_k", "to_v", "add_k_proj"]


@pytest.fixture(scope="module")
def base():
    return make_flux_pipeline(FluxMiniConfig(**SMALL))


def true_deltas(model, adapter="default"):
    """Each LoRA layer's update as peft computes it: its own `scaling[adapter]` times B @ A."""
    from peft.tuners.lora import LoraLayer
    return {n: m.scaling[adapter] * (m.lora_B[adapter].weight @ m.lora_A[adapter].weight).detach().double()
            for n, m in model.named_modules() if isinstance(m, LoraLayer) and adapter in m.lora_A}


def adapted(base, seed=0, **lora_kw):
    from peft import LoraConfig
    pipe = copy.deepcopy(base)
    pipe.transformer.add_adapter(LoraConfig(target_modules=TARGETS, init_lora_weights="gaussian", **lora_kw))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in pipe.transformer.named_parameters():
            if "lora_" in n: p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return pipe


def best(delta, k):
    U, S, Vh = torch.linalg.svd(delta, full_matrices=False)
    return (U[:, :k] * S[:k]) @ Vh[:k]


def rel(a, b): return ((a - b).norm() / b.norm()).item()


CASES = {"rslora": dict(r=4, lora_alpha=8, use_rslora=True),
         "rank_pattern": dict(r=4, lora_alpha=4, rank_pattern={"to_k": 2, "add_k_proj": 3}),
         "alpha_pattern": dict(r=4, lora_alpha=8, alpha_pattern={"to_q": 16, "add_k_proj": 1}),
         "all": dict(r=4, lora_alpha=6, use_rslora=True, rank_pattern={"to_v": 2}, alpha_pattern={"to_k": 2})}


@pytest.mark.parametrize("case", CASES)
def test_export_reloads_each_layers_true_update(base, tmp_path, case):
    """Before, the reduced file scaled every layer by one global alpha/r: an rsLoRA file 4 -> 2 came back
    sqrt(2/4) = 0.707 too weak (and still said use_rslora), an alpha_pattern layer was off even at the
    adapter's own rank, and rank=4 refused a rank_pattern adapter with a rank-2 layer."""
    pipe = adapted(base, **CASES[case])
    want = true_deltas(pipe.transformer)
    assert len({round(float(m), 6) for m in [v.norm() for v in want.values()]}) > 1
    ranks = {n: m.r["default"] for n, m in pipe.transformer.named_modules() if n in want}
    for rank in (None, 4, 2, 1):
        path = save_flux_lora(pipe, tmp_path/f"{case}-{rank}.safetensors", rank=rank)
        fresh = copy.deepcopy(base)
        load_flux_lora(fresh, path)
        got = true_deltas(fresh.transformer)
        assert got.keys() == want.keys()
        for n, d in want.items():
            k = ranks[n] if rank is None else min(rank, ranks[n])
            assert rel(got[n], best(d, k)) <= 1e-5, (case, rank, n)
        if rank is not None:
            with safe_open(str(path), "pt") as f:
                meta = json.loads(f.metadata()["lora_adapter_metadata"])
            assert meta["transformer.use_rslora"] is False and meta["transformer.r"] == rank
            assert all(m.scaling["default"] == 1.0 for n, m in fresh.transformer.named_modules() if n in got)


def test_export_matches_the_reloaded_images(base, tmp_path):
    """The same, end to end: the rsLoRA + patterns adapter exported at its own rank gives the same output."""
    from course_lib.flux import flux_generate
    pipe = adapted(base, **CASES["all"])
    fresh = copy.deepcopy(base)
    load_flux_lora(fresh, save_flux_lora(pipe, tmp_path/"a.safetensors", rank=4))
    run = lambda p: flux_generate(p, ["sks seven", "three"], 16, num_inference_steps=2, seed=3)
    assert (run(fresh) - run(pipe)).abs().max().item() <= 1e-5


def test_reduce_rank_per_layer_scales_and_mixed_ranks():
    g = torch.Generator().manual_seed(1)
    sd = {"a.lora_A.weight": torch.randn(4, 6, generator=g), "a.lora_B.weight": torch.randn(5, 4, generator=g),
          "b.lora_A.weight": torch.randn(2, 6, generator=g), "b.lora_B.weight": torch.randn(5, 2, generator=g)}
    out = reduce_rank(sd, {"a": 0.5, "b": 3.0}, 3)
    assert out["a.lora_A.weight"].shape == (3, 6) and out["b.lora_A.weight"].shape == (2, 6)   # b keeps 2
    for m, s in (("a", 0.5), ("b", 3.0)):
        full = s * sd[f"{m}.lora_B.weight"] @ sd[f"{m}.lora_A.weight"]
        assert rel(out[f"{m}.lora_B.weight"] @ out[f"{m}.lora_A.weight"], best(full, 3)) <= 1e-5
    with pytest.raises(ValueError, match=r"no scale for layer 'b'"):
        reduce_rank(sd, {"a": 0.5}, 2)
    with pytest.raises(ValueError, match=r"rank must be in 1\.\.4 .*got 5"):
        reduce_rank(sd, 1.0, 5)
    with pytest.raises(ValueError, match=r"other weights: \['a.lora_magnitude_vector'\]"):
        reduce_rank({**sd, "a.lora_magnitude_vector": torch.ones(5)}, 1.0, 2)


# ------------------------------------------------------------------ files in other formats (item 5)

D = 64                                          # FLUX-mini's hidden size (SMALL): to_q is Linear(64, 64)


def factors(seed, r, out, inp):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(r, inp, generator=g) * 0.1, torch.randn(out, r, generator=g) * 0.1


def deltas_after_load(base, path):
    fresh = copy.deepcopy(base)
    load_flux_lora(fresh, path)
    return true_deltas(fresh.transformer)


@pytest.mark.parametrize("prefix", ["lora_unet_double_blocks_0_", "diffusion_model.double_blocks.0."])
def test_kohya_and_comfyui_files_load(base, tmp_path, prefix):
    """kohya / sd-scripts (`lora_unet_…`, with `.alpha`) and ComfyUI / BFL (`diffusion_model.…`) names:
    before, every key was refused as 'not a Linear layer' though diffusers converts and loads them."""
    sep = "_" if prefix.startswith("lora_unet") else "."
    name = lambda s: prefix + s.replace(".", sep)
    (qa, qb), (pa, pb), (ta, tb) = factors(0, 4, 3 * D, D), factors(1, 4, D, D), factors(2, 6, 3 * D, D)
    sd = {}
    for key, (A, B, alpha) in {"img_attn.qkv": (qa, qb, 2.0), "img_attn.proj": (pa, pb, 8.0),
                               "txt_attn.qkv": (ta, tb, 6.0)}.items():
        sd |= {f"{name(key)}.lora_down.weight": A, f"{name(key)}.lora_up.weight": B,
               f"{name(key)}.alpha": torch.tensor(alpha)}
    save_file(sd, str(tmp_path/"k.safetensors"))
    check_flux_lora(base, tmp_path/"k.safetensors")
    got = deltas_after_load(base, tmp_path/"k.safetensors")
    t = "transformer_blocks.0.attn."
    want = {f"{t}to_out.0": 8.0 / 4 * pb @ pa}
    for i, (q, a) in enumerate([("to_q", "add_q_proj"), ("to_k", "add_k_proj"), ("to_v", "add_v_proj")]):
        want[t + q] = 2.0 / 4 * qb[i * D:(i + 1) * D] @ qa       # the fused qkv split by rows
        want[t + a] = 6.0 / 6 * tb[i * D:(i + 1) * D] @ ta
    assert got.keys() == want.keys()
    assert max(rel(got[k], want[k].double()) for k in want) <= 1e-5


def test_xlabs_file_loads(base, tmp_path):
    (qa, qb), (pa, pb) = factors(3, 4, 3 * D, D), factors(4, 4, D, D)
    p = "double_blocks.0.processor."
    save_file({f"{p}qkv_lora1.down.weight": qa, f"{p}qkv_lora1.up.weight": qb,
               f"{p}proj_lora1.down.weight": pa, f"{p}proj_lora1.up.weight": pb}, str(tmp_path/"x.safetensors"))
    got = deltas_after_load(base, tmp_path/"x.safetensors")
    t = "transformer_blocks.0.attn."
    want = {f"{t}to_out.0": pb @ pa, **{t + q: qb[i * D:(i + 1) * D] @ qa
                                        for i, q in enumerate(["to_q", "to_k", "to_v"])}}
    assert got.keys() == want.keys()
    assert max(rel(got[k], want[k].double()) for k in want) <= 1e-5


def test_files_diffusers_refuses_are_refused_by_name(base, tmp_path):
    A, B = factors(5, 4, D, D)
    cases = {   # a BFL control LoRA (diffusers' conversion wants FLUX.1's 19 + 38 blocks)
        "control.safetensors": ({"double_blocks.0.img_attn.norm.query_norm.scale": torch.ones(8),
                                 "double_blocks.0.img_attn.proj.lora_A.weight": A},
                                r"control\.safetensors is no FLUX LoRA that diffusers can read: "
                                r"its conversion failed \(KeyError"),
        # kohya for FLUX.1's single blocks (diffusers splits linear1 at 3072 rows)
        "single.safetensors": ({"lora_unet_single_blocks_0_linear1.lora_down.weight": A,
                                "lora_unet_single_blocks_0_linear1.lora_up.weight": torch.zeros(4 * D + 64, 4)},
                               r"single\.safetensors is no FLUX LoRA that diffusers can read"),
        # peft names without a model prefix: diffusers would load nothing of it, without a word
        "bare.safetensors": ({"transformer_blocks.0.attn.to_q.lora_A.weight": A,
                              "transformer_blocks.0.attn.to_q.lora_B.weight": B},
                             r"bare\.safetensors: diffusers would load these keys into neither the "
                             r"transformer nor the text encoder: \['transformer_blocks\.0\.attn\.to_q\.lora_A"),
        # kohya for a wider FLUX: converted, then the shapes say so
        "wide.safetensors": ({"lora_unet_double_blocks_0_img_attn_proj.lora_down.weight": torch.zeros(4, 96),
                              "lora_unet_double_blocks_0_img_attn_proj.lora_up.weight": torch.zeros(96, 4)},
                             r"wide\.safetensors was trained for another transformer: transformer\."
                             r"transformer_blocks\.0\.attn\.to_out\.0\.lora_A\.weight has shape \(4, 96\)")}
    for fname, (sd, msg) in cases.items():
        save_file(sd, str(tmp_path/fname))
        with pytest.raises(ValueError, match=msg):
            load_flux_lora(copy.deepcopy(base), tmp_path/fname)


def test_kohya_text_encoder_keys_renamed_then_checked(base, tmp_path):
    """A kohya text-encoder LoRA goes through diffusers' text-encoder renaming before the shape check; one
    that renaming cannot place (diffusers' own load fails on it too) is refused by name."""
    te = "lora_te1_text_model_encoder_layers_0_self_attn_"
    (qa, qb), (oa, ob) = factors(6, 4, 32, 32), factors(7, 4, 32, 32)
    sd = {f"{te}q_proj.lora_down.weight": qa, f"{te}q_proj.lora_up.weight": qb,
          f"{te}out_proj.lora_down.weight": oa, f"{te}out_proj.lora_up.weight": ob}
    save_file(sd, str(tmp_path/"te.safetensors"))
    fresh = copy.deepcopy(base)
    load_flux_lora(fresh, tmp_path/"te.safetensors")
    got, t = true_deltas(fresh.text_encoder), "encoder.layers.0.self_attn."
    assert sorted(got) == [t + "out_proj", t + "q_proj"]
    assert rel(got[t + "q_proj"], (qb @ qa).double()) <= 1e-5 and rel(got[t + "out_proj"], (ob @ oa).double()) <= 1e-5
    wide = {**sd, f"{te}q_proj.lora_down.weight": torch.zeros(4, 48)}
    save_file(wide, str(tmp_path/"te48.safetensors"))
    with pytest.raises(ValueError, match=r"te48\.safetensors was trained for another text_encoder: "
                                         r"text_encoder\.encoder\.layers\.0\.self_attn\.q_proj\.lora_A"):
        check_flux_lora(base, tmp_path/"te48.safetensors")
    save_file({k: v for k, v in sd.items() if "q_proj" in k}, str(tmp_path/"q.safetensors"))
    with pytest.raises(ValueError, match=r"q\.safetensors is no FLUX LoRA that diffusers can read: its "
                                         r"conversion failed \(ValueError: Could not automatically infer"):
        load_flux_lora(copy.deepcopy(base), tmp_path/"q.safetensors")


def test_add_flux_lora_names_a_target_that_matches_nothing(base):
    """Before, peft adapted the targets that exist and dropped a typo ("to_qq") without a word."""
    from course_lib.flux import add_flux_lora, check_lora_targets
    from course_lib.flux import FluxLoRAConfig
    pipe = copy.deepcopy(base)
    with pytest.raises(ValueError, match=r"entries \['to_qq'\] match no Linear layer of the "
                                         r"FluxTransformer2DModel; its Linear layers .*'attn\.to_q'"):
        add_flux_lora(pipe, FluxLoRAConfig(rank=2, alpha=2.0, target_modules=("to_k", "to_qq")))
    assert not getattr(pipe.transformer, "peft_config", None)
    assert FluxLoRAConfig(target_modules="to_q").target_modules == ("to_q",)   # not its characters
    add_flux_lora(pipe, FluxLoRAConfig(rank=2, alpha=2.0, target_modules=("to_q",)))
    check_lora_targets(pipe.transformer, ["to_q", "to_k"])          # adapted layers still count
