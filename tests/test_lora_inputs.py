"""LoRA adapters on a learner's own inputs: target lists and strings, eval models, scaling settings that must
survive a save and load, files from other tools, and adapter file names."""
import json, os, struct, subprocess, sys
from pathlib import Path

import pytest
from PIL import Image
import torch

from course_lib.ddpm import DDPMConfig, make_unet
from course_lib.lora import add_lora
from course_lib.lora import LoRATrainConfig
from course_lib.lora import check_target_modules
from course_lib.lora import active_adapters
from course_lib.lora import save_adapter, load_adapter, read_adapter, set_adapters

CFG = DDPMConfig.quick(block_out_channels=(8, 16), norm_num_groups=4, num_classes=10)


def tiny_unet(seed=0):
    torch.manual_seed(seed)
    return make_unet(CFG)


def lora_layers(unet):
    from peft.tuners.lora import LoraLayer
    return {n: m for n, m in unet.named_modules() if isinstance(m, LoraLayer)}


def randomise_lora(unet, seed=1):
    "Give every lora_B a random value (peft initialises it to zero, which would hide any scaling error)."
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in unet.named_parameters():
            if "lora_B" in n: p.copy_(torch.randn(p.shape, generator=g) * 0.1)


def forward(unet, seed=2):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 1, 8, 8, generator=g)
    with torch.no_grad():
        return unet(x, torch.tensor([10, 500]), class_labels=torch.tensor([1, 2])).sample


def test_target_modules_string_is_one_name_not_its_characters():
    unet = add_lora(tiny_unet(), 4, target_modules="to_q")
    names = sorted(lora_layers(unet))
    assert names and all(n.endswith(".to_q") for n in names), names
    assert LoRATrainConfig(target_modules="to_q").target_modules == "to_q"
    assert LoRATrainConfig(target_modules=["to_q", "to_v"]).target_modules == ("to_q", "to_v")
    with pytest.raises(TypeError, match="target_modules must be a string"): LoRATrainConfig(target_modules=3)


def test_target_modules_string_as_regular_expression():
    unet = add_lora(tiny_unet(), 4, target_modules=r"mid_block\..*\.to_[kv]")
    names = sorted(lora_layers(unet))
    assert names == ["mid_block.attentions.0.to_k", "mid_block.attentions.0.to_v"], names
    with pytest.raises(ValueError, match=r"'to_qq' is neither a module name of the model \(did you mean \['to_q'"):
        add_lora(tiny_unet(), 4, target_modules="to_qq")


def test_every_unmatched_target_is_named():
    with pytest.raises(ValueError, match=r"match no module of the model: 'to_kk' \(did you mean \['to_k'"):
        add_lora(tiny_unet(), 4, target_modules=("to_q", "to_kk", "to_v"))
    with pytest.raises(ValueError, match=r"'to_kk'.*'nope'"):
        check_target_modules(tiny_unet(), ["to_kk", "nope"])


def test_new_layers_follow_the_model_mode():
    unet = add_lora(tiny_unet().eval(), 4, dropout=0.3)
    randomise_lora(unet)
    assert not any(m.training for m in unet.modules())
    assert torch.equal(forward(unet), forward(unet))          # dropout off on an eval model
    train = add_lora(tiny_unet().train(), 4, dropout=0.3)
    assert all(m.training for m in lora_layers(train).values())


@pytest.mark.parametrize("settings", [{"use_rslora": True}, {"alpha_pattern": {"to_q": 32.0}},
                                      {"rank_pattern": {"to_v": 2}}, {}], ids=str)
def test_scaling_settings_survive_the_round_trip(tmp_path, settings):
    unet = add_lora(tiny_unet(), 4, alpha=8.0, adapter_name="concept", **settings)
    randomise_lora(unet)
    want = forward(unet)
    path = save_adapter(unet, tmp_path / "a.safetensors", "concept")
    fresh = tiny_unet()
    load_adapter(fresh, path)
    # measured: 0 (the same float32 weights and scales); 1e-6 leaves room for kernel order
    assert (forward(fresh) - want).abs().max() < 1e-6
    assert active_adapters(fresh) == pytest.approx({"concept": 1.0})
    set_adapters(fresh, {"concept": 0.5})
    assert active_adapters(fresh) == pytest.approx({"concept": 0.5})


def test_settings_the_format_cannot_store_are_refused(tmp_path):
    from peft import LoraConfig
    from peft.functional import inject_adapter_in_model
    unet = inject_adapter_in_model(LoraConfig(r=4, target_modules=["to_q"], use_dora=True), tiny_unet(),
                                   adapter_name="concept")
    with pytest.raises(ValueError, match=r"uses \{'use_dora': True\}.*save_pretrained"):
        save_adapter(unet, tmp_path / "d.safetensors", "concept")
    assert not (tmp_path / "d.safetensors").exists()


def write_safetensors(path: Path, tensors: dict, metadata: dict):
    "A safetensors file written by hand, so that its metadata can hold what the library would refuse to write."
    header, off, blobs = {}, 0, []
    for k, t in tensors.items():
        b = t.contiguous().numpy().tobytes()
        header[k] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [off, off + len(b)]}
        off += len(b)
        blobs.append(b)
    header["__metadata__"] = metadata
    h = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(h)) + h + b"".join(blobs))
    return path


def test_non_string_metadata_is_named(tmp_path):
    p = write_safetensors(tmp_path / "x.safetensors", {"a.lora_A.weight": torch.zeros(4, 8)},
                          {"format": "course_lib.lora/1", "rank": 4})
    with pytest.raises(ValueError, match=r"metadata 'rank' is a int \(4\).*strings to strings"):
        read_adapter(p)


def test_other_tools_files_are_recognised(tmp_path):
    kohya = write_safetensors(
        tmp_path / "k.safetensors",
        {"lora_unet_down_blocks_0_attentions_0_proj_in.lora_down.weight": torch.zeros(4, 8),
         "lora_unet_down_blocks_0_attentions_0_proj_in.lora_up.weight": torch.zeros(8, 4)},
        {"ss_network_dim": "4", "ss_network_alpha": "1.0"})
    with pytest.raises(ValueError, match=r"kohya-ss \(sd-scripts\) LoRA.*ss_network_dim.*course_lib.lora/1"):
        load_adapter(tiny_unet(), kohya)
    diffusers = write_safetensors(tmp_path / "d.safetensors",
                                  {"unet.mid_block.attentions.0.to_q.lora_A.weight": torch.zeros(4, 8)}, {})
    with pytest.raises(ValueError, match=r"a diffusers LoRA, as save_lora_weights writes it"):
        read_adapter(diffusers)


def test_any_legal_file_name_loads(tmp_path):
    unet = add_lora(tiny_unet(), 4, adapter_name="concept")
    a = save_adapter(unet, tmp_path / "style.v2.safetensors", "concept")
    fresh = tiny_unet()
    meta = load_adapter(fresh, a, adapter_name=None)
    assert meta["adapter_name"] == "concept"
    meta2 = load_adapter(fresh, a, adapter_name="style_v2")
    assert meta2["adapter_name"] == "style_v2"
    with pytest.raises(ValueError, match=r"adapter_name must be letters, digits.*got 'style\.v2'"):
        load_adapter(tiny_unet(), a, adapter_name="style.v2")


def test_course_lora_generate_takes_any_legal_file_name(tmp_path):
    "`--adapter style.v2.safetensors` failed with a KeyError (peft adapter names cannot hold '.')."
    from course_lib.lora import base_config, load_base
    base = load_base(base_config(2), progress=False)                 # a 2-step base: cached, seconds to train
    add_lora(base, 2, adapter_name="concept")
    randomise_lora(base)
    a = save_adapter(base, tmp_path / "a" / "style.v2.safetensors", "concept")
    b = save_adapter(base, tmp_path / "b" / "style.v2.safetensors", "concept")
    out = tmp_path / "grid.png"
    r = subprocess.run([sys.executable, "-m", "course_lib.cli.course", "lora", "generate", "a photo of a 3", str(out),
                        "--adapter", str(a), "--adapter", f"{b}=0.5", "--n", "2", "--steps", "2",
                        "--base-steps", "2"], capture_output=True, text=True, timeout=600, env=os.environ.copy())
    assert r.returncode == 0, r.stderr[-2000:]
    assert out.is_file() and Image.open(out).size[0] > 0


def test_adapters_on_different_layers_are_all_seen():
    "Adapter A on to_q and B on time_emb_proj: the first LoRA layer holds only B, yet both exist."
    from course_lib.lora import adapter_names, remove_adapter
    unet = add_lora(tiny_unet(), 2, target_modules=["to_q"], adapter_name="A")
    add_lora(unet, 2, target_modules=["time_emb_proj"], adapter_name="B")
    assert adapter_names(unet) == ["A", "B"]
    set_adapters(unet, {"A": 1.0, "B": 0.5})
    assert active_adapters(unet) == pytest.approx({"A": 1.0, "B": 0.5})
    remove_adapter(unet, "A")
    assert adapter_names(unet) == ["B"]


def test_adding_an_adapter_under_a_taken_name_is_refused():
    unet = add_lora(tiny_unet(), 2, adapter_name="concept")
    randomise_lora(unet)
    before = forward(unet)
    with pytest.raises(ValueError, match=r"already has an adapter 'concept'"):
        add_lora(unet, 4, adapter_name="concept")
    assert torch.equal(forward(unet), before)            # the trained weights are untouched


def test_course_lora_generate_on_another_base_names_the_flag(tmp_path):
    "The message advised check_base=False, which the command line has no way to pass."
    from course_lib.lora import base_config, load_base
    base = load_base(base_config(2), progress=False)
    add_lora(base, 2, adapter_name="concept")
    a = save_adapter(base, tmp_path / "a.safetensors", "concept")
    r = subprocess.run([sys.executable, "-m", "course_lib.cli.course", "lora", "generate", "a photo of a 3",
                        str(tmp_path / "g.png"), "--adapter", str(a), "--n", "1", "--steps", "2",
                        "--base-steps", "3"], capture_output=True, text=True, timeout=600, env=os.environ.copy())
    assert r.returncode == 2 and "pass the --base-steps the adapter was trained with" in r.stderr, r.stderr
    assert "check_base" not in r.stderr and "Traceback" not in r.stderr


def test_file_formats_keep_their_names_when_modules_move():
    """The format names written into users' files (adapters, presets) are part of those files, not module paths:
    the subpackage layout renamed `course_lib.lora` to `course_lib.lora.layers` and, with a text replace, the
    adapter format too, so every adapter and preset saved before could no longer be read."""
    from course_lib.lora.files import ADAPTER_FORMAT
    from course_lib.lora.run import LORA_PRESET_FORMAT
    from course_lib.flux.lora_train import PRESET_FORMAT
    from course_lib.studio.store import STUDIO_PRESET
    assert (ADAPTER_FORMAT, LORA_PRESET_FORMAT, PRESET_FORMAT, STUDIO_PRESET) == (
        "course_lib.lora/1", "course_lib.lora.preset/1", "course_lib.flux_lora.preset/1", "course_lib.studio.preset/1")
