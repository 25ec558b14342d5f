"""Issue 28 ("Every statement true"), the items of units 4, 6 and 7 and the library parts around
them: damaged files named with what to do, LoRA folders checked before the base loads, skipped lines
counted, a unit given by its folder, 0-byte compressed shards refused by every reader, times under
a minute in seconds, the site's pages showing the parameters they ran with once, settings that do
nothing said so."""
import json
import warnings

import pytest
import torch
import zstandard

torch.set_num_threads(1)


# ---- 0-byte compressed shards: every reader refuses them (item 5) ----------------------------------

@pytest.mark.parametrize("name", ["a.jsonl.zst", "B.JSONL.ZST", "c.jsonl.gz"])
def test_read_jsonl_zst_refuses_an_empty_compressed_file(tmp_path, name):
    from course_lib.pile import read_jsonl_zst, PileFormatError
    p = tmp_path / name
    p.write_bytes(b"")
    with pytest.raises(PileFormatError, match=r"empty \(0 bytes\).*re-create it"):
        list(read_jsonl_zst(p))
    with pytest.raises(PileFormatError, match=r"empty \(0 bytes\)"):
        list(read_jsonl_zst(p, errors="skip", threaded=False))


def test_an_empty_plain_jsonl_file_is_still_an_empty_shard(tmp_path):
    from course_lib.pile import read_jsonl_zst
    (tmp_path / "a.jsonl").write_bytes(b"")
    assert list(read_jsonl_zst(tmp_path / "a.jsonl")) == []


def test_the_careful_zstd_reader_refuses_an_empty_stream(tmp_path):
    from course_lib.pile import ReadStats
    from course_lib.pile.zstd_stream import _zstd_chunks, _Corrupt
    p = tmp_path / "a.zst"
    p.write_bytes(b"")
    with open(p, "rb") as fh, pytest.raises(_Corrupt, match="empty"):
        list(_zstd_chunks(fh, ReadStats()))
    p.write_bytes(zstandard.ZstdCompressor().compress(b""))   # no records, but a stream
    with open(p, "rb") as fh:
        assert list(_zstd_chunks(fh, ReadStats())) == []


def test_load_corpus_and_pile_stats_refuse_an_empty_shard(tmp_path, capsys):
    from course_lib.pile import load_corpus
    from course_lib.cli.pile import pile_main
    from course_lib.pile import PileFormatError
    (tmp_path / "a.jsonl.zst").write_bytes(b"")
    for p in (tmp_path / "a.jsonl.zst", tmp_path):
        with pytest.raises(PileFormatError, match=r"empty \(0 bytes\)"):
            list(load_corpus(p))
    assert pile_main(["stats", str(tmp_path)]) == 1
    assert "a.jsonl.zst: the file is empty (0 bytes)" in capsys.readouterr().err


# ---- course bpb --errors skip says how many lines it skipped (item 3) ------------------------------

DOCS = [{"text": "Bits per byte divides the log-likelihood by UTF-8 bytes. " * 4,
         "meta": {"pile_set_name": "A"}},
        {"text": "def f(x):\n    return x ** 2\n" * 5, "meta": {"pile_set_name": "B"}}]


@pytest.fixture(scope="module")
def tiny_lm(tmp_path_factory):
    "A random GPT-2 with 32 positions and its BPE tokenizer, saved to a directory."
    from transformers import GPT2Config, GPT2LMHeadModel
    from course_lib.pile import train_bpe_tokenizer
    torch.manual_seed(0)
    tok = train_bpe_tokenizer([d["text"] for d in DOCS] * 3, vocab_size=300)
    cfg = GPT2Config(vocab_size=len(tok), n_positions=32, n_embd=16, n_layer=1, n_head=2,
                     bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    d = tmp_path_factory.mktemp("tiny-lm")
    GPT2LMHeadModel(cfg).save_pretrained(d)
    tok.save_pretrained(d)
    return d


def test_bpb_errors_skip_says_how_many_lines_it_skipped(tiny_lm, tmp_path, capsys):
    from course_lib.cli.bpb import bpb_main
    payload = (b"{not json\n" + b"".join(json.dumps(r).encode() + b"\n" for r in DOCS)
               + b'{"meta": {}}\n' + b"[1, 2\n")
    f = tmp_path / "bad.jsonl.zst"
    f.write_bytes(zstandard.ZstdCompressor().compress(payload))
    assert bpb_main(["--model", str(tiny_lm), str(f), "--errors", "skip"]) == 0
    err = capsys.readouterr().err
    assert "skipped 3 bad line(s)" in err and "line 1" in err, err
    assert bpb_main(["--model", str(tiny_lm), str(f), "--errors", "skip", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["skipped_lines"] == 3


# ---- course run units/00_start: a unit given by its folder (item 4) --------------------------------

@pytest.mark.parametrize("key", ["units/00_start", "units/00_start/", "./units/00_start"])
def test_find_unit_takes_a_unit_folder_path(key):
    from course_lib.course import find_unit, load_units, project_root
    units = load_units()
    assert find_unit(key, units).name == "00_start"
    assert find_unit(str(project_root() / "units" / "07_flux"), units).name == "07_flux"
    with pytest.raises(KeyError, match=r"unknown unit 'units/nope'.*a unit's folder"):
        find_unit("units/nope", units)


def test_course_run_takes_a_unit_folder_and_names_its_output_after_the_unit(monkeypatch):
    import course_lib.cli.course as cli
    seen = {}
    def fake_run_units(chosen, profile, out, timeout, notebooks=None):
        seen.update(units=[u.name for u in chosen], out=out)
        return 0
    monkeypatch.setattr(cli, "run_units", fake_run_units)
    assert cli.main(["run", "units/00_start/", "--profile", "quick"]) == 0
    assert seen["units"] == ["00_start"] and seen["out"].name == "00_start-quick"


# ---- times: never "about 0 min" (item 7) ----------------------------------------------------------

def test_format_duration_says_seconds_under_a_minute_and_a_half():
    from course_lib.course import format_duration
    assert format_duration(0.2) == "under 1 s"
    assert format_duration(25) == "25 s" and format_duration(89.4) == "89 s"
    assert format_duration(613) == "10.2 min"
    for bad in (-1, float("nan"), float("inf"), "5"):
        with pytest.raises(ValueError, match="a duration is a finite number of seconds"):
            format_duration(bad)


def test_site_unit_table_times_use_format_duration():
    from course_lib.course.site_pages import _minutes
    assert _minutes(0.3) == "under 1 s" and _minutes(45) == "45 s" and _minutes(600) == "10.0 min"


# ---- the site's pages show the parameters that ran, once (item 9) ---------------------------------

def _page_notebooks():
    src = {"cells": [{"cell_type": "markdown", "source": "# t", "metadata": {}},
                     {"cell_type": "code", "source": "seed = 0\nsteps = 3000  # training steps",
                      "metadata": {"tags": ["parameters"]}, "outputs": []},
                     {"cell_type": "code", "source": "print(steps)", "metadata": {},
                      "outputs": []}], "metadata": {}}
    injected = {"cell_type": "code", "source": "# Parameters\nseed = 0\nsteps = 300\n",
                "metadata": {"tags": ["injected-parameters"]}, "outputs": []}
    out = {"output_type": "stream", "name": "stdout", "text": "300\n"}
    ex = {"cells": [src["cells"][0], src["cells"][1], injected, {**src["cells"][2], "outputs": [out]}],
          "metadata": {"papermill": {"exception": False}}}
    return src, ex


def test_a_page_shows_the_parameters_it_ran_with_once():
    from course_lib.course import executed_matches, with_current_text
    src, ex = _page_notebooks()
    assert executed_matches(ex, src)
    page = with_current_text(ex, src)
    code = [c["source"] for c in page["cells"] if c["cell_type"] == "code"]
    assert not any("injected-parameters" in c.get("metadata", {}).get("tags", [])
                   for c in page["cells"])
    assert code[0] == "seed = 0\nsteps = 300  # training steps, notebook default: 3000", code
    assert len(code) == 2 and page["cells"][-1]["outputs"][0]["text"] == "300\n"


def test_merge_parameters_adds_values_the_cell_does_not_set():
    from course_lib.course import merge_parameters
    merged = merge_parameters("a = (1,\n     2)\nb = 'x'", "c = 3\na = [5]\n")
    assert merged == "a = [5]  # notebook default: see the notebook\nb = 'x'\nc = 3  # set by the run"


# ---- LoRA training folders checked before the base loads (item 2) ---------------------------------

def _folder(tmp_path, name="my_dog", captions=None, n=3):
    from PIL import Image
    d = tmp_path / name
    d.mkdir()
    for i in range(n):
        Image.new("L", (16, 16), 40 * i).save(d / f"{i:04d}.png")
        if captions is not None: (d / f"{i:04d}.txt").write_text(captions[i % len(captions)])
    return d


def test_a_folder_without_captions_is_refused_naming_the_missing_caption_files(tmp_path):
    from course_lib.lora import check_lora_folder
    d = _folder(tmp_path)
    with pytest.warns(UserWarning, match="no caption file"), pytest.raises(
            ValueError, match=r"3 of 3 images have no caption file \(e\.g\. 0000\.txt\).*"
                              r"'my dog'.*write a caption file beside each image"):
        check_lora_folder(d, "sks")


def test_captions_without_the_trigger_are_refused_by_the_folder_check(tmp_path):
    from course_lib.lora import check_lora_folder
    d = _folder(tmp_path, captions=["a photo of sks digit", "a four"])
    assert check_lora_folder(d, "sks") == {"images": 3, "caption_files": 3, "with_trigger": 2}
    with pytest.raises(ValueError, match=r"the trigger 'zwx' is in none of the 3 captions.*--trigger"):
        check_lora_folder(d, "zwx")
    with pytest.raises(ValueError, match=r"1 of 3 captions name neither the trigger 'sks' nor a "
                                         r"digit.*0001\.png: 'a cat'"):
        check_lora_folder(_folder(tmp_path, "cats", captions=["sks digit", "a cat"]), "sks")


def test_train_lora_names_a_caption_it_cannot_read_before_loading_a_prior(tmp_path):
    "train_lora used to fail inside encode_prompt on the folder-name caption ('my dog')."
    from course_lib.lora import ConceptDataset
    from course_lib.lora import LoRATrainConfig
    from course_lib.lora import check_captions
    with pytest.warns(UserWarning):
        ds = ConceptDataset(_folder(tmp_path), size=16)
    with pytest.raises(ValueError, match="have no caption file"):
        check_captions(ds.captions, ds.caption_sources, ds.files, "sks", require_trigger=False)
    with pytest.warns(UserWarning, match="the trigger 'zwx' is in none"):
        check_captions(["a four"], ["sidecar"], [tmp_path / "a.png"], "zwx", require_trigger=False)
    import inspect, course_lib.lora.train as lt, course_lib.lora.base as lb
    src = inspect.getsource(lt._prepare)       # the captions are read before the prior set is drawn
    assert -1 < src.find("concept_labels(") < src.find("prior_set(")
    assert "check_captions(" in inspect.getsource(lb.concept_labels)


@pytest.mark.parametrize("bad", [-1, 2.5, True])
def test_negative_or_fractional_prior_images_are_refused_naming_the_value(bad):
    from course_lib.lora import LoRATrainConfig
    with pytest.raises(ValueError, match=rf"prior_images must be an int >= 0 \(0: off\), got {bad!r}"):
        LoRATrainConfig(prior_images=bad)


def test_adapter_spec_with_a_weight_that_is_not_a_number_names_the_spec():
    from course_lib.lora import parse_adapter_spec
    assert parse_adapter_spec("a/b.safetensors") == ("a/b.safetensors", 1.0)
    assert parse_adapter_spec("x=y.safetensors=0.5") == ("x=y.safetensors", 0.5)
    for spec in ("X=abc", "X=nan", "=0.5"):
        with pytest.raises(ValueError, match=rf"--adapter '{spec}': no file .* write PATH or PATH=WEIGHT"):
            parse_adapter_spec(spec)


def test_settings_without_effect_in_a_lora_config_are_named():
    from course_lib.lora import LoRATrainConfig
    with pytest.warns(UserWarning, match=r"rank=4, alpha=4\.0 has no effect: full_finetune=True"):
        LoRATrainConfig(full_finetune=True, rank=4, alpha=4.0)
    with pytest.warns(UserWarning, match=r"prior_weight=0\.5 has no effect: prior_images=0"):
        LoRATrainConfig(prior_images=0, prior_weight=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        LoRATrainConfig(rank=4, alpha=4.0, prior_images=0)


def test_lora_data_docstrings_name_the_right_tools():
    from course_lib.lora import Augment
    from course_lib.lora import ConceptDataset
    assert "ai-toolkit's `trigger_word`" in ConceptDataset.__doc__
    assert "keep_tokens' habit" not in ConceptDataset.__doc__
    assert "additive" in Augment.__doc__ and "multiplies" in Augment.__doc__


# ---- a damaged file is named, with what to do, never a parser's traceback (item 1) ----------------

def test_a_damaged_flux_lora_file_is_named_before_diffusers_reads_it(tmp_path):
    from course_lib.flux.lora_export import _lora_shapes
    from course_lib.flux import check_flux_lora
    bad = tmp_path / "lora.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{\"a\": ")       # a cut-off header
    with pytest.raises(ValueError, match=r"lora\.safetensors is not a readable safetensors LoRA "
                                         r"file .*Download or export it again"):
        _lora_shapes(bad)
    with pytest.raises(ValueError, match="not a readable safetensors LoRA file"):
        check_flux_lora(None, bad)     # refused before the pipeline is looked at


@pytest.mark.parametrize("damage", ["weights", "config", "tokenizer"])
def test_a_damaged_model_directory_is_named_with_what_to_do(tiny_lm, tmp_path, damage, capsys):
    import shutil
    from course_lib.pile import load_local_lm
    from course_lib.cli.bpb import bpb_main
    d = tmp_path / "lm"
    shutil.copytree(tiny_lm, d)
    name = {"weights": "model.safetensors", "config": "config.json",
            "tokenizer": "tokenizer.json"}[damage]
    (d / name).write_bytes((d / name).read_bytes()[:40])
    with pytest.raises(ValueError, match=rf"{d}: the model directory is damaged or incomplete "
                                         rf"\(.*\): save the model again"):
        load_local_lm(d)
    (tmp_path / "a.jsonl").write_text(json.dumps(DOCS[0]) + "\n")
    assert bpb_main(["--model", str(d), str(tmp_path / "a.jsonl")]) == 2
    assert "the model directory is damaged" in capsys.readouterr().err


def test_a_damaged_cached_tiny_gpt2_says_delete_or_retrain(tiny_lm, tmp_path, monkeypatch):
    import shutil
    import course_lib.pile.lm as lm
    d = tmp_path / "pile" / f"tiny-gpt2-{lm.TinyGPTConfig().key()}"
    shutil.copytree(tiny_lm, d)
    (d / "model.safetensors").write_bytes(b"\x00" * 12)
    monkeypatch.setattr(lm, "cache_dir", lambda *a: tmp_path / "pile")
    monkeypatch.setattr(lm, "restore_pretrained", lambda d: None)
    import course_lib.core.cache as cache
    monkeypatch.setattr(cache, "check_cached", lambda *a, **k: None)
    with pytest.raises(ValueError, match=r"damaged or incomplete.*delete .*tiny_gpt2\(retrain=True\)"):
        lm.tiny_gpt2()


# ---- nb40: the scale alpha/r and the usual defaults (item 6) ---------------------------------------

def test_nb40_states_the_scale_of_each_default_and_rslora():
    from pathlib import Path
    from peft import LoraConfig
    import course_lib
    root = Path(course_lib.__file__).parents[1]            # the checkout whose library is tested
    nb = json.loads((root / "nbs/40_lora_from_scratch.ipynb").read_text())
    md = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")
    assert "you need not retune the learning rate" not in md.replace("\n", " ")
    assert "only with $\\alpha$ fixed" in md
    assert f"peft's `LoraConfig` has `lora_alpha={LoraConfig().lora_alpha}`" in md   # as installed
    assert "`network_alpha=1`" in md and "`lora_alpha=args.rank`" in md
    assert "Kalajdzievski 2023" in md and "\\alpha/\\sqrt{r}" in md and "<!-- cited:" in md


# ---- settings that do nothing say so (item 10) ----------------------------------------------------

class _Out:
    def __init__(self, sample): self.sample = sample


class _ToyUNet(torch.nn.Module):
    "Returns the class label as the noise prediction: enough to see which branch won."
    def __init__(self):
        super().__init__()
        from types import SimpleNamespace
        self.config = SimpleNamespace(in_channels=1, sample_size=8, num_class_embeds=11)
    def forward(self, x, t, class_labels=None):
        return _Out(torch.zeros_like(x) + class_labels.view(-1, 1, 1, 1).float() / 10)


def test_guidance_settings_without_effect_are_named():
    from course_lib.flux.checks import warn_no_effect
    from course_lib.flux import GuidedUNet
    with pytest.warns(UserWarning, match=r"negative=3 has no effect at guidance_scale=1"):
        warn_no_effect(1.0, [1], 3)
    with pytest.warns(UserWarning, match=r"guidance_scale=3.0 has no effect without a prompt"):
        warn_no_effect(3.0, None, None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_no_effect(3.0, [1], 3)
        warn_no_effect(1.0, None, None)
    x, y = torch.zeros(1, 1, 8, 8), torch.tensor([1])     # the warnings are true: at w = 1 the
    out = GuidedUNet(_ToyUNet(), 1.0, negative=3)(x, 0, y).sample   # negative changes nothing
    assert torch.allclose(out, _ToyUNet()(x, 0, y).sample)


def test_sample_guided_warns_for_a_negative_at_guidance_one(monkeypatch):
    import course_lib.flux.guidance as g
    monkeypatch.setattr(g, "sample", lambda *a, **k: "sampled")
    monkeypatch.setattr(g, "make_scheduler", lambda *a, **k: None)
    model = _ToyUNet()
    model.null_class, model.ddpm_config = 10, None
    with pytest.warns(UserWarning, match="negative=2 has no effect"):
        assert g.sample_guided(model, 2, [1, 1], guidance_scale=1.0, negative=2) == "sampled"


# ---- NEED THE LEAD'S CHANGE in nbs/43_lora_export.ipynb (read_adapter, _lora_train, _lora_generate)

def _adapter_file(tmp_path, **meta):
    from safetensors.torch import save_file
    from course_lib.lora import ADAPTER_FORMAT
    m = {"format": ADAPTER_FORMAT, "base_hash": "abc", "rank": "2", "alpha": "2",
         "target_modules": '["to_q"]', **meta}
    p = tmp_path / "a.safetensors"
    save_file({"mid.to_q.lora_A.weight": torch.zeros(2, 4),
               "mid.to_q.lora_B.weight": torch.zeros(4, 2)}, str(p), metadata=m)
    return p


@pytest.mark.parametrize("key, value, what", [("rank", "two", "an integer"),
                                              ("alpha", "x", "a number"),
                                              ("target_modules", "[to_q", "JSON"),
                                              ("use_rslora", "yes", "JSON")])
def test_lead43_malformed_adapter_metadata_is_named(tmp_path, capsys, key, value, what):
    from course_lib.lora import read_adapter
    from course_lib.cli.lora import lora_main
    p = _adapter_file(tmp_path, **{key: value})
    import re
    with pytest.raises(ValueError, match=rf"a\.safetensors: adapter metadata '{key}' is "
                                         rf"'{re.escape(value)}', not {what}.*re-export"):
        read_adapter(p)
    assert lora_main(["info", str(p)]) == 2
    assert f"metadata '{key}'" in capsys.readouterr().err


def _refuse_base(monkeypatch):
    import course_lib.cli.lora as io
    def no_base(*a, **k): raise AssertionError("the base model was loaded before the check")
    monkeypatch.setattr(io, "load_base", no_base)


def test_lead43_lora_train_checks_the_folder_and_settings_before_the_base(tmp_path, monkeypatch,
                                                                         capsys):
    from course_lib.cli.lora import lora_main
    _refuse_base(monkeypatch)
    d = _folder(tmp_path)                                      # images, no caption files
    with pytest.warns(UserWarning):
        assert lora_main(["train", str(d), str(tmp_path / "o.safetensors")]) == 2
    assert "have no caption file" in capsys.readouterr().err
    d2 = _folder(tmp_path, "ok", captions=["a photo of sks digit"])
    assert lora_main(["train", str(d2), str(tmp_path / "o.safetensors"), "--trigger", "zwx"]) == 2
    assert "the trigger 'zwx' is in none" in capsys.readouterr().err
    argv = ["train", str(d2), str(tmp_path / "o.safetensors"), "--prior-images", "-1"]
    assert lora_main(argv) == 2
    assert "prior_images must be an int >= 0 (0: off), got -1" in capsys.readouterr().err


def test_lead43_lora_generate_names_a_bad_adapter_weight(tmp_path, monkeypatch, capsys):
    from course_lib.cli.lora import lora_main
    _refuse_base(monkeypatch)
    assert lora_main(["generate", "a sks digit", str(tmp_path / "o.png"), "--adapter", "X=abc"]) == 2
    err = capsys.readouterr().err
    assert "--adapter 'X=abc': no file 'X=abc' exists" in err and "write PATH or PATH=WEIGHT" in err
