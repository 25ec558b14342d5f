"""Unit 4 (LoRA): the from-scratch layers against peft, the data set checks, the training loop on a tiny UNet,
and the adapter files (metadata, validation, atomic writes, switching, blending, merging, seeded generation)."""
import copy, json, os, warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn
from PIL import Image

from course_lib.lora import (
    LoRALinear, LoRAConv2d, inject_lora, lora_layers, merge_lora, unmerge_lora, lora_param_count)
from course_lib.lora import Augment, BucketBatchSampler, write_concept_folder
from course_lib.lora import copy_lora_to_peft
from course_lib.lora import count_parameters
from course_lib.lora import ConceptDataset, aspect_buckets, assign_bucket, read_captions, filename_captioner

# folders without caption files are made on purpose below; test_warning_when_no_caption_matches checks the warning
pytestmark = pytest.mark.filterwarnings("ignore:no caption file")


def peft_inject(model, targets, r, alpha):
    from peft import LoraConfig
    from peft.functional import inject_adapter_in_model
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return inject_adapter_in_model(LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets)), model)


class Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(24, 12)
        self.conv = nn.Conv2d(3, 6, 3, padding=1, stride=2)
    def forward(self, x, img): return self.fc(x), self.conv(img)


# ---------------------------------------------------------------- LoRA from scratch (notebook 40)

def test_untrained_adapter_is_exactly_the_base():
    torch.manual_seed(0)
    base = nn.Linear(16, 8); conv = nn.Conv2d(3, 5, 3, padding=1)
    x, img = torch.randn(4, 16), torch.randn(2, 3, 7, 7)
    assert torch.equal(LoRALinear(copy.deepcopy(base), 4, 8)(x), base(x))
    assert torch.equal(LoRAConv2d(copy.deepcopy(conv), 4, 8)(img), conv(img))


@pytest.mark.parametrize("rank,alpha", [(1, 1.0), (4, 8.0), (8, 4.0)])
def test_merged_equals_unmerged_and_unmerge_restores(rank, alpha):
    torch.manual_seed(rank)
    for layer, inp in [(LoRALinear(nn.Linear(16, 8), rank, alpha), torch.randn(5, 16)),
                       (LoRAConv2d(nn.Conv2d(3, 5, 3, padding=1), rank, alpha), torch.randn(2, 3, 6, 6))]:
        b = layer.lora_B if isinstance(layer, LoRALinear) else layer.lora_B.weight
        nn.init.normal_(b, std=0.1)
        w0 = layer.base.weight.clone()
        with torch.no_grad():
            y = layer(inp); layer.merge(); ym = layer(inp); layer.unmerge()
        assert (y - ym).abs().max() < 1e-6
        assert (layer.base.weight - w0).abs().max() < 1e-6


@pytest.mark.parametrize("rank,alpha", [(1, 1), (2, 4), (4, 8), (8, 8), (16, 4)])
def test_ours_matches_peft_with_the_same_A_and_B(rank, alpha):
    torch.manual_seed(rank)
    toy = Toy()
    ours, theirs = copy.deepcopy(toy), copy.deepcopy(toy)
    assert inject_lora(ours, ["fc", "conv"], rank, alpha) == ["fc", "conv"]
    peft_inject(theirs, ["fc", "conv"], rank, alpha)
    for m in lora_layers(ours).values():
        nn.init.normal_(m.lora_B if isinstance(m, LoRALinear) else m.lora_B.weight, std=0.2)
    copy_lora_to_peft(ours.fc, theirs.fc); copy_lora_to_peft(ours.conv, theirs.conv)
    x, img = torch.randn(7, 24), torch.randn(2, 3, 9, 9)
    with torch.no_grad():
        (y1, z1), (y2, z2) = ours(x, img), theirs(x, img)
    assert (y1 - y2).abs().max() < 1e-6 and (z1 - z2).abs().max() < 1e-6
    assert (y1 - toy.fc(x)).abs().max() > 1e-3          # the adapter does change the output
    # the merged update is the same matrix peft merges
    assert (ours.fc.delta_weight() - theirs.fc.get_delta_weight("default")).abs().max() < 1e-6
    assert (ours.conv.delta_weight() - theirs.conv.get_delta_weight("default")).abs().max() < 1e-6


@pytest.mark.parametrize("rank", [1, 4, 16])
def test_trainable_parameter_counts_per_rank(rank):
    from diffusers import UNet2DModel
    unet = UNet2DModel(sample_size=8, in_channels=1, out_channels=1, block_out_channels=(16, 32),
                       down_block_types=("DownBlock2D", "AttnDownBlock2D"), up_block_types=("AttnUpBlock2D", "UpBlock2D"),
                       layers_per_block=1, norm_num_groups=8, num_class_embeds=10)
    targets = ["to_q", "to_k", "to_v", "to_out.0", "time_emb_proj"]
    a, b = copy.deepcopy(unet), copy.deepcopy(unet)
    inject_lora(a, targets, rank)
    peft_inject(b, targets, rank, rank)
    n = lora_param_count(unet, targets, rank)
    assert count_parameters(a)["trainable"] == count_parameters(b)["trainable"] == n > 0
    # by hand for one layer kind: every to_q is a 32 -> 32 linear layer, so rank * (32 + 32) each
    n_q = sum(name.endswith(".to_q") for name, _ in unet.named_modules())
    assert n_q >= 2 and lora_param_count(unet, ["to_q"], rank) == n_q * rank * 64


def test_inject_lora_bad_input():
    with pytest.raises(ValueError, match=r"\[.nope.\] match no nn.Linear"): inject_lora(Toy(), ["nope"], 4)
    with pytest.raises(ValueError, match="rank"): LoRALinear(nn.Linear(3, 3), rank=0)
    with pytest.raises(TypeError): LoRALinear(nn.Conv2d(3, 3, 1))
    m = Toy(); inject_lora(m, ["fc"], 2)
    merge_lora(m); assert m.fc.merged; unmerge_lora(m); assert not m.fc.merged


def test_inject_lora_names_a_target_that_matches_nothing():
    """Before, a target matching no layer was dropped without a word when another one matched
    (here "fcc", a typo), and a string was read as its characters."""
    m = Toy()
    with pytest.raises(ValueError, match=r"entries \['fcc'\] match no nn\.Linear/nn\.Conv2d .*"
                                         r"some layer names: \['fc', 'conv'\]"):
        inject_lora(m, ["conv", "fcc"], 2)
    assert not lora_layers(m) and all(p.requires_grad for p in m.parameters())   # nothing changed
    assert inject_lora(Toy(), "fc", 2) == ["fc"]
    with pytest.raises(TypeError, match="target_modules must be a module name"): inject_lora(Toy(), [3], 2)


# ---------------------------------------------------------------- data set (notebook 41)

def test_concept_folder_and_captions(tmp_path):
    d = write_concept_folder(tmp_path / "c", n=12)
    assert len(list(d.glob("*.png"))) == 12 and len(list(d.glob("*.txt"))) == 12
    ds = ConceptDataset(d, size=8)
    assert len(ds) == 12 and set(ds.caption_sources) == {"sidecar"}
    item = ds[0]
    assert item["x"].shape == (1, 8, 8) and item["x"].dtype == torch.float32 and item["caption"] == "a photo of sks digit"
    assert -1 <= item["x"].min() and item["x"].max() <= 1
    assert ds.summary()["n_images"] == 12 and ds.summary()["n_skipped"] == 0
    with pytest.raises(ValueError): write_concept_folder(tmp_path / "x", n=0)


def test_warning_when_no_caption_matches(tmp_path):
    d = write_concept_folder(tmp_path / "my_dogs", n=3)
    with pytest.warns(UserWarning, match="no caption file"):
        caps, src = read_captions(sorted(d.glob("*.png")), ".caption")
    assert src == ["captioner"] * 3 and caps[0] == "my dogs"
    assert filename_captioner(Path("a/red_car_01.png")) == "red car"
    assert filename_captioner(Path("photos/IMG_1234.jpg")) == "photos"


def test_bad_folders(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="empty"): ConceptDataset(tmp_path / "empty", size=8)
    bad = tmp_path / "bad"; bad.mkdir()
    (bad / "zero.png").write_bytes(b"")
    (bad / "fake.jpg").write_text("not an image")
    good = write_concept_folder(tmp_path / "g", n=1)
    (bad / "trunc.png").write_bytes((good / "9_000.png").read_bytes()[:50])
    with pytest.raises(ValueError, match="all 3 files were skipped") as e: ConceptDataset(bad, size=8)
    assert "zero.png" in str(e.value) and "trunc.png" in str(e.value)
    small = tmp_path / "small"; small.mkdir()
    Image.fromarray(np.zeros((4, 4), np.uint8)).save(small / "a.png")
    with pytest.raises(ValueError, match="smaller than the training size"): ConceptDataset(small, size=8)
    assert len(ConceptDataset(small, size=8, upscale_small=True)) == 1
    with pytest.raises(FileNotFoundError): ConceptDataset(tmp_path / "missing", size=8)
    with pytest.raises(ValueError, match="multiple of 4"): ConceptDataset(good, size=10)


def test_mixed_folder_skips_and_reports(tmp_path):
    d = write_concept_folder(tmp_path / "c", n=5)
    (d / "zero.png").write_bytes(b"")
    Image.fromarray(np.zeros((5, 5), np.uint8)).save(d / "tiny.png")
    ds = ConceptDataset(d, size=8)
    assert len(ds) == 5 and sorted(p.name for p, _ in ds.report.skipped) == ["tiny.png", "zero.png"]


def test_exif_orientation_and_modes(tmp_path):
    im = Image.new("RGB", (16, 8), (255, 0, 0))
    exif = Image.Exif(); exif[0x0112] = 6          # rotate 90 degrees on display
    im.save(tmp_path / "rot.jpg", exif=exif.tobytes())
    Image.new("RGBA", (8, 8), (0, 0, 0, 0)).save(tmp_path / "alpha.png")
    Image.new("P", (12, 12)).save(tmp_path / "pal.png")
    ds = ConceptDataset(tmp_path, size=8, channels=3)
    sizes = dict(zip([f.name for f in ds.files], ds.sizes))
    assert sizes["rot.jpg"] == (8, 16)                      # width and height swapped by the EXIF tag
    alpha = ds[[f.name for f in ds.files].index("alpha.png")]["x"]
    assert torch.allclose(alpha, torch.ones_like(alpha))   # transparent -> white
    assert all(ds[i]["x"].shape == (3, 8, 8) for i in range(len(ds)))


def test_buckets_and_augment(tmp_path):
    bk = aspect_buckets(16)
    assert (16, 16) in bk and all(w * h <= 256 and w % 4 == 0 and h % 4 == 0 for w, h in bk)
    assert assign_bucket(40, 20, bk)[0] > assign_bucket(40, 20, bk)[1]
    d = tmp_path / "b"; d.mkdir()
    for i in range(3): Image.fromarray(np.full((20, 40), 80 * i, np.uint8)).save(d / f"w{i}.png")
    for i in range(2): Image.fromarray(np.full((20, 20), 50 * i, np.uint8)).save(d / f"s{i}.png")
    ds = ConceptDataset(d, size=16, buckets=True)
    batches = list(BucketBatchSampler(ds, 2))
    assert sorted(len(b) for b in batches) == [1, 2, 2]
    assert all(len({ds.buckets[i] for i in b}) == 1 for b in batches)
    x = torch.rand(1, 8, 8) * 2 - 1
    aug = Augment(crop_scale=0.7, brightness=0.1, contrast=0.3)
    a1, a2 = aug(x, torch.Generator().manual_seed(1)), aug(x, torch.Generator().manual_seed(1))
    assert torch.equal(a1, a2) and not torch.equal(a1, x) and a1.abs().max() <= 1
    assert torch.equal(Augment(hflip=1.0)(x), x.flip(-1)) and torch.equal(Augment()(x), x)


# ---------------------------------------------------------------- training and adapter files (notebooks 42, 43)

@pytest.fixture(scope="module")
def tiny_base():
    from course_lib.ddpm import DDPMConfig, make_unet
    cfg = DDPMConfig.quick(classes=tuple(range(9)), num_classes=10, block_out_channels=(16, 32), norm_num_groups=8,
                           attention=(False, True), steps=1)
    torch.manual_seed(0)
    m = make_unet(cfg).eval()
    m.ddpm_config = cfg
    return m


@pytest.fixture(scope="module")
def trained(tiny_base, tmp_path_factory):
    from course_lib.lora import LoRATrainConfig, train_lora
    tmp = tmp_path_factory.mktemp("lora")
    ds = ConceptDataset(write_concept_folder(tmp / "nines", n=8), size=8)
    model = copy.deepcopy(tiny_base)
    cfg = LoRATrainConfig(rank=2, alpha=4.0, steps=3, batch_size=4, prior_images=4, preview_every=0, lr=1e-2)
    res = train_lora(model, ds, cfg, log=tmp / "log", progress=False)
    return model, res, ds, tmp


def test_encode_prompt():
    from course_lib.lora import encode_prompt
    assert encode_prompt("a photo of sks digit") == 9 and encode_prompt("A Photo of SKS") == 9
    assert encode_prompt("digit three") == 3 and encode_prompt("a 7, drawn") == 7
    with pytest.raises(ValueError, match="names no digit"): encode_prompt("a photo of digit nine")
    with pytest.raises(ValueError): encode_prompt("a cat")


def test_train_lora_only_trains_the_adapter(tiny_base, trained):
    model, res, ds, tmp = trained
    assert len(res.history) == 3 and all(np.isfinite(r["loss"]) for r in res.history)
    assert res.trainable == sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    sd0 = tiny_base.state_dict()
    for k, v in model.state_dict().items():
        if "lora_" not in k: assert torch.equal(v, sd0[k.replace(".base_layer", "")]), k
    assert any(v.abs().sum() > 0 for k, v in model.state_dict().items() if "lora_B" in k)   # B moved off zero
    rows = [json.loads(l) for l in (tmp / "log.jsonl").read_text().splitlines()]
    csv_lines = (tmp / "log.csv").read_text().splitlines()
    assert len(rows) == 3 and len(csv_lines) == 4 and csv_lines[0].startswith("step,loss")


def test_peak_memory_counts_live_storages_once(tiny_base, trained):
    from course_lib.lora import PeakMemory
    with PeakMemory() as pm:
        a = torch.zeros(1000)                  # 4000 bytes
        b = torch.ones(500)                    # 2000 bytes
        v = a[10:]; v.add_(1)                  # a view and an in-place op: no new storage
        del a, v                               # freed: 4000 bytes less
        c = b * 2                              # 2000 bytes
    assert pm.peak == 6000 and pm.live == 4000
    model, res, ds, tmp = trained
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    assert res.peak_memory_bytes > weights and res.s_per_step > 0


def test_dashboard_headless_and_bad_size(tiny_base, trained):
    from course_lib.lora import LoRATrainConfig, train_lora
    from course_lib.lora import LoRADashboard
    _, _, ds, tmp = trained
    d = LoRADashboard(tiny_base, ds, LoRATrainConfig(steps=2, batch_size=2, prior_images=0, preview_every=2), headless=True)
    r = d.wait()
    assert len(r.history) == 2 and len(r.previews) == 1 and r.previews[0][1].shape == (8, 1, 8, 8)
    assert "lora_" not in " ".join(n for n, _ in tiny_base.named_parameters())   # the base was copied, not changed
    ds16 = ConceptDataset(ds.folder, size=16)
    with pytest.raises(ValueError, match="ConceptDataset\\(size=8\\)"): train_lora(copy.deepcopy(tiny_base), ds16)
    with pytest.raises(ValueError, match="rank"): LoRATrainConfig(rank=0)


def test_dashboard_widgets_start_button(tiny_base, trained, widgets):
    "The controls as a user sets them, then the start button: loss curve, preview grid and status filled in."
    from course_lib.lora import LoRATrainConfig
    from course_lib.lora import LoRADashboard
    _, _, ds, _ = trained
    d = LoRADashboard(tiny_base, ds, LoRATrainConfig(prior_images=0), headless=False, autostart=False)
    assert isinstance(d.ui, widgets.HBox) and d.button.description == "start"
    for k, v in {"rank": 2, "steps": 2, "batch_size": 2, "preview_every": 2}.items(): d.w[k].value = v
    d.button.click()
    r = d.wait()
    assert len(r.history) == 2 and r.config["rank"] == 2 and len(r.previews) == 1
    assert d.status.value.startswith("done: 2 steps"), d.status.value
    assert d.curve.value[:4] == d.grid.value[:4] == b"\x89PNG" and d.button.description == "start"


def test_adapter_roundtrip_and_seeded_generation(tiny_base, trained):
    from course_lib.lora import save_adapter, load_adapter, read_adapter, set_adapters
    from course_lib.lora import generate
    model, res, ds, tmp = trained
    path = save_adapter(model, tmp / "a.safetensors", "concept", base_model="tiny", trigger="sks",
                        training_config=res.config, dataset=ds.summary())
    t, meta = read_adapter(path)
    for k in ("format", "base_model", "base_hash", "rank", "alpha", "target_modules", "trigger", "training_config",
              "dataset", "course_lib_version", "peft_version"):
        assert k in meta, k
    assert meta["rank"] == 2 and meta["alpha"] == 4.0 and meta["dataset"]["n_images"] == 8
    fresh = copy.deepcopy(tiny_base)
    load_adapter(fresh, path)
    g1 = generate(model, "a photo of sks digit", n=3, seed=5, num_inference_steps=4)
    g2 = generate(fresh, "a photo of sks digit", n=3, seed=5, num_inference_steps=4)
    g3 = generate(fresh, "a photo of sks digit", n=3, seed=5, num_inference_steps=4)
    assert torch.equal(g2, g3) and (g1 - g2).abs().max() < 1e-5
    assert not torch.equal(g2, generate(fresh, "a photo of sks digit", n=3, seed=6, num_inference_steps=4))
    set_adapters(fresh, {})
    assert torch.equal(generate(fresh, "digit two", n=2, seed=1, num_inference_steps=3),
                       generate(tiny_base, "digit two", n=2, seed=1, num_inference_steps=3))


def test_switch_blend_merge(tiny_base, trained):
    from course_lib.lora import (
        set_adapters, active_adapters, merge_adapters, unmerge_adapters, adapter_names,
        remove_adapter)
    from course_lib.lora import save_adapter, load_adapter
    model, res, ds, tmp = trained
    path = save_adapter(model, tmp / "b.safetensors", "concept")
    m = copy.deepcopy(tiny_base)
    load_adapter(m, path, "one"); load_adapter(m, path, "two")
    assert adapter_names(m) == ["one", "two"] and active_adapters(m) == {"two": 1.0}
    x, t, y = torch.randn(2, 1, 8, 8), torch.tensor([10, 500]), torch.tensor([9, 3])
    with torch.no_grad():
        base_out = tiny_base(x, t, class_labels=y).sample
        set_adapters(m, "one"); one = m(x, t, class_labels=y).sample
        set_adapters(m, {"one": 0.5, "two": 0.5}); blend = m(x, t, class_labels=y).sample
        set_adapters(m, {"one": 0.0}); zero = m(x, t, class_labels=y).sample
        set_adapters(m, {"one": 1.0, "two": 1.0}); unmerged = m(x, t, class_labels=y).sample
        merge_adapters(m); merged = m(x, t, class_labels=y).sample
        with pytest.raises(RuntimeError, match="merged"): set_adapters(m, "one")
        unmerge_adapters(m)
    assert (blend - one).abs().max() < 1e-5            # two copies of one adapter at 0.5 each == one at 1.0
    assert (zero - base_out).abs().max() < 1e-6
    assert (merged - unmerged).abs().max() < 1e-4
    # layer level: the update scales linearly with the blend weight
    lay = m.mid_block.attentions[0].to_q
    h = torch.randn(3, lay.in_features)
    set_adapters(m, {"one": 1.0}); d1 = lay(h) - lay.base_layer(h)
    set_adapters(m, {"one": 2.0}); d2 = lay(h) - lay.base_layer(h)
    assert (d2 - 2 * d1).abs().max() < 1e-5
    with pytest.raises(ValueError, match="unknown adapter"): set_adapters(m, "three")
    remove_adapter(m, "two"); assert adapter_names(m) == ["one"]
    with pytest.raises(ValueError, match="already has"): load_adapter(m, path, "one")


def test_adapter_files_bad_input(tiny_base, trained, monkeypatch):
    from safetensors.torch import save_file, load_file
    from course_lib.lora import save_adapter, load_adapter, read_adapter
    from course_lib.cli.lora import lora_main
    model, res, ds, tmp = trained
    good = save_adapter(model, tmp / "good.safetensors", "concept", trigger="sks")
    t, meta = read_adapter(good)
    as_meta = lambda m: {k: v if isinstance(v, str) else json.dumps(v) for k, v in m.items()}
    # not safetensors: a torch.save pickle under a .safetensors name, and plain text
    torch.save(load_file(good), tmp / "p.safetensors")
    with pytest.raises(ValueError, match="not a safetensors file.*zip"): load_adapter(copy.deepcopy(tiny_base), tmp / "p.safetensors")
    (tmp / "t.safetensors").write_text("hello")
    with pytest.raises(ValueError, match="not a safetensors file"): read_adapter(tmp / "t.safetensors")
    # missing alpha
    save_file(t, tmp / "na.safetensors", metadata=as_meta({k: v for k, v in meta.items() if k != "alpha"}))
    with pytest.raises(ValueError, match="missing \\['alpha'\\].*wrong strength"): read_adapter(tmp / "na.safetensors")
    # wrong base model
    other = copy.deepcopy(tiny_base)
    with torch.no_grad(): next(other.parameters()).add_(1e-3)
    with pytest.raises(ValueError, match="weight hash"): load_adapter(other, good)
    # rank mismatch, missing keys: and the model is left unchanged
    t1 = {k: (v[:1] if ".lora_A." in k else v[:, :1] if ".lora_B." in k else v).contiguous() for k, v in t.items()}
    save_file(t1, tmp / "r.safetensors", metadata=as_meta(meta))
    fresh = copy.deepcopy(tiny_base)
    with pytest.raises(ValueError, match="rank"): load_adapter(fresh, tmp / "r.safetensors")
    save_file(dict(list(t.items())[2:]), tmp / "k.safetensors", metadata=as_meta(meta))
    with pytest.raises(ValueError, match="missing keys"): load_adapter(fresh, tmp / "k.safetensors")
    assert "lora_" not in " ".join(n for n, _ in fresh.named_parameters())
    # only .safetensors, and never a partial file under the final name
    with pytest.raises(ValueError, match="safetensors only"): save_adapter(model, tmp / "x.pt", "concept")
    def boom(*a, **k): raise OSError("disk full")
    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError): save_adapter(model, tmp / "partial.safetensors", "concept")
    monkeypatch.undo()
    assert not (tmp / "partial.safetensors").exists()
    assert not [p for p in tmp.iterdir() if p.name.startswith(".partial")]
    # the command line: bad arguments and bad files exit 2
    assert lora_main(["info", str(tmp / "p.safetensors")]) == 2
    assert lora_main(["bogus"]) == 2 and lora_main(["train", str(tmp / "nope"), str(tmp / "o.pt")]) == 2
    assert lora_main(["info", str(good)]) == 0
