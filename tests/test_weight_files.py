"""Files a user points at that are not what they should be (issue 47, items 2 and 3): a web page, an empty file,
a Git LFS pointer or a file cut short given as weights, a model, a checkpoint or a LoRA, alone or inside a model
folder. Every option and function that takes such a path says which file, what it is instead (with its size) or
how it is cut short, and what to do: exit status 2 on the command line, `ValueError` in the library, never a
pickle or safetensors traceback (facenet-pytorch #96, ComfyUI #6744). The files are built here; nothing is
downloaded."""
import contextlib, io

import pytest
import torch
from safetensors.torch import save_file

from course_lib.cli import main

HTML = b"<!DOCTYPE html><html><head><title>Sign in</title></head><body>Please log in</body></html>\n"
LFS = b"version https://git-lfs.github.com/spec/v1\noid sha256:4d7a\nsize 95628359\n"


def html(path):
    path.write_bytes(HTML)
    return path


def empty(path):
    path.write_bytes(b"")
    return path


def cut(path, tensors=None, metadata=None):
    "A real safetensors file cut in half (a copy that stopped early)."
    save_file(tensors or {"w": torch.randn(32, 32)}, str(path), metadata=metadata)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return path


def course(capsys, *args, says=()):
    "In-process `course ARGS`: exit status 2, each of `says` on stderr, no traceback."
    rc = main([str(a) for a in args])
    err = capsys.readouterr().err
    assert rc == 2, f"course {' '.join(map(str, args))}: exit {rc}, stderr: {err}"
    assert "Traceback" not in err, err
    for s in says: assert s in err, f"{s!r} not in: {err}"
    return err


# ------------------------------------------------------------------------- the shared check (course_lib.core.cache)

def test_weights_problem_says_what_the_file_is(tmp_path):
    from course_lib.core import check_weights_file, file_kind, weights_problem
    good = tmp_path / "good.safetensors"
    save_file({"w": torch.zeros(4)}, str(good))
    torch.save({"w": torch.zeros(4)}, tmp_path / "good.pt")
    torch.save({"w": torch.zeros(4)}, tmp_path / "old.pt", _use_new_zipfile_serialization=False)
    assert [file_kind(tmp_path / f) for f in ("good.safetensors", "good.pt", "old.pt")] == [
        "safetensors", "zip", "pickle"]
    assert weights_problem(good) is None and weights_problem(tmp_path / "good.pt") is None
    assert weights_problem(tmp_path / "old.pt") is None
    assert "is an HTML page" in weights_problem(html(tmp_path / "w.pth"))
    assert f"{len(HTML)} bytes" in weights_problem(tmp_path / "w.pth")
    assert weights_problem(empty(tmp_path / "e.pth")) == "is empty (0 bytes)"
    (tmp_path / "lfs.bin").write_bytes(LFS)
    assert "Git LFS pointer" in weights_problem(tmp_path / "lfs.bin")
    assert "cut short" in weights_problem(cut(tmp_path / "cut.safetensors"))
    data = (tmp_path / "good.pt").read_bytes()
    (tmp_path / "cut.pt").write_bytes(data[: len(data) // 2])
    assert "zip archive cut short" in weights_problem(tmp_path / "cut.pt")
    assert "where a safetensors file is expected" in weights_problem(tmp_path / "good.pt",
                                                                           ("safetensors",))
    with pytest.raises(ValueError, match=r"w\.pth is not a usable Inception weights file: it is an HTML page"):
        check_weights_file(tmp_path / "w.pth", what="Inception weights file")
    with pytest.raises(FileNotFoundError, match="none.pth does not exist"):
        check_weights_file(tmp_path / "none.pth")


def test_folder_problem_names_the_damaged_file(tmp_path):
    from course_lib.core import check_weights_folder, folder_problem
    (tmp_path / "unet").mkdir()
    (tmp_path / "model_index.json").write_text('{"_class_name": "X"}')
    save_file({"w": torch.zeros(4)}, str(tmp_path / "unet" / "a.safetensors"))
    assert folder_problem(tmp_path) is None
    cut(tmp_path / "unet" / "b.safetensors")
    f, why = folder_problem(tmp_path)
    assert f == tmp_path / "unet" / "b.safetensors" and "cut short" in why
    (tmp_path / "model_index.json").write_text('{"_class_name": ')
    with pytest.raises(ValueError, match=r"model_index\.json is damaged: it is not valid JSON"):
        check_weights_folder(tmp_path)


# --------------------------------------------------------------------------------------------- the call sites

def test_fid_weights_that_are_a_web_page_or_empty(tmp_path, capsys, monkeypatch):
    "`course fid --extractor inception --weights W` (and $COURSE_LIB_INCEPTION_WEIGHTS): exit 2, W named."
    import numpy as np
    from PIL import Image
    imgs = tmp_path / "imgs"
    imgs.mkdir()
    for i in range(4):
        Image.fromarray(np.full((16, 16), 40 * i, np.uint8)).save(imgs / f"{i}.png")
    w = html(tmp_path / "inception.pth")
    course(capsys, "fid", imgs, imgs, "--extractor", "inception", "--weights", w,
           says=[str(w), "not a usable Inception-v3 weights file", "HTML page", f"{len(HTML)} bytes"])
    e = empty(tmp_path / "empty.pth")
    course(capsys, "fid", imgs, imgs, "--extractor", "inception", "--weights", e,
           says=[str(e), "is empty (0 bytes)"])
    monkeypatch.setenv("COURSE_LIB_INCEPTION_WEIGHTS", str(w))
    course(capsys, "fid", imgs, imgs, "--extractor", "inception", says=[str(w), "HTML page"])


def test_finetune_pretrained_that_is_not_a_checkpoint(tmp_path, capsys):
    "`course finetune --pretrained FILE`, `checkpoint_info`, `load_finetuned`."
    from course_lib.vision import checkpoint_info, load_finetuned
    (tmp_path / "data" / "a").mkdir(parents=True)
    w = html(tmp_path / "model.safetensors")
    course(capsys, "finetune", tmp_path / "data", "--model", "resnet18", "--pretrained", w, "--steps", "1",
           says=[str(w), "HTML page", f"{len(HTML)} bytes"])
    c = cut(tmp_path / "cut.safetensors")
    course(capsys, "finetune", tmp_path / "data", "--model", "resnet18", "--pretrained", c, "--steps", "1",
           says=[str(c), "cut short", "header says the tensors end at byte"])
    with pytest.raises(ValueError, match="is empty"): checkpoint_info(empty(tmp_path / "e.safetensors"))
    with pytest.raises(ValueError, match="HTML page"): load_finetuned(w)


def _tiny_lm(d):
    from transformers import GPT2Config, GPT2LMHeadModel
    from course_lib.pile import train_bpe_tokenizer
    tok = train_bpe_tokenizer(["bits per byte of a tiny model " * 4] * 3, vocab_size=280)
    cfg = GPT2Config(vocab_size=len(tok), n_positions=16, n_embd=8, n_layer=1, n_head=2,
                     bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    GPT2LMHeadModel(cfg).save_pretrained(d)
    tok.save_pretrained(d)
    return d


def test_bpb_model_folder_names_the_damaged_file(tmp_path, capsys):
    "`course bpb --model DIR`: a truncated model.safetensors, an HTML config.json, a Git LFS pointer."
    from course_lib.pile import write_jsonl_zst
    docs = tmp_path / "d.jsonl.zst"
    write_jsonl_zst(docs, [{"text": "bits per byte", "meta": {}}])
    d = _tiny_lm(tmp_path / "lm")
    st = d / "model.safetensors"
    good = st.read_bytes()
    st.write_bytes(good[: len(good) // 2])
    course(capsys, "bpb", "--model", d, docs, says=[str(st), "cut short", "header says the tensors end at byte"])
    st.write_bytes(LFS)
    course(capsys, "bpb", "--model", d, docs, says=[str(st), "Git LFS pointer"])
    st.write_bytes(good)
    html(d / "config.json")
    course(capsys, "bpb", "--model", d, docs, says=[str(d / "config.json"), "HTML page"])


def test_lora_adapter_that_is_a_web_page_empty_or_cut(tmp_path, capsys):
    "`course lora info ADAPTER` (and `generate --adapter`, through the same `read_adapter`)."
    from course_lib.lora import read_adapter
    w = html(tmp_path / "a.safetensors")
    course(capsys, "lora", "info", w, says=[str(w), "not a safetensors file", "HTML page"])
    course(capsys, "lora", "info", empty(tmp_path / "e.safetensors"), says=["is empty (0 bytes)"])
    c = cut(tmp_path / "c.safetensors", metadata={"format": "x"})
    course(capsys, "lora", "info", c, says=[str(c), "cut short"])
    with pytest.raises(ValueError, match="cut short"): read_adapter(c)


def test_load_checkpoint_says_what_the_file_is(tmp_path):
    "`core.load_checkpoint`, behind every cached model, `course lora` resume and the studio's runs."
    from course_lib.core import load_checkpoint
    with pytest.raises(ValueError, match=r"ck\.safetensors .*HTML page"): load_checkpoint(html(tmp_path / "ck.safetensors"))
    with pytest.raises(ValueError, match=r"cut short: its header says"): load_checkpoint(cut(tmp_path / "c.safetensors"))


def test_flux_and_kohya_lora_files(tmp_path):
    "The FLUX LoRA reader (`check_flux_lora`, `load_flux_lora`) and kohya's (`read_kohya_lora`, `load_exported`)."
    from course_lib.flux import check_flux_lora
    from course_lib.flux import load_exported, read_kohya_lora
    w = html(tmp_path / "lora.safetensors")
    with pytest.raises(ValueError, match=r"lora\.safetensors .*HTML page"): check_flux_lora(None, w)
    with pytest.raises(ValueError, match=r"lora\.safetensors .*HTML page"): read_kohya_lora(w)
    with pytest.raises(ValueError, match=r"lora\.safetensors .*HTML page"): load_exported(None, w, "x")
    with pytest.raises(ValueError, match="cut short"): read_kohya_lora(cut(tmp_path / "k.safetensors"))


def test_studio_adapter_file_that_is_a_web_page(tmp_path):
    from course_lib.studio import Studio, tiny_bases
    s = Studio(tmp_path / "s", tiny_bases())
    w = html(tmp_path / "mine.safetensors")
    with pytest.raises(ValueError, match=r"mine\.safetensors .*HTML page"): s.load_adapter_file("unet", w)


@pytest.fixture(scope="module")
def flux_folder(tmp_path_factory):
    "A one-block FLUX-mini pipeline saved as `save_flux_mini` writes it (built once: seconds on a CPU)."
    from course_lib.flux import FluxMiniConfig, make_flux_pipeline
    from course_lib.flux import save_flux_mini
    cfg = FluxMiniConfig(num_layers=1, num_single_layers=1, text_layers=1)
    return cfg, save_flux_mini(make_flux_pipeline(cfg), tmp_path_factory.mktemp("flux") / "pipeline")


def halve(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return path


def test_flux_mini_folder_names_the_damaged_file(flux_folder, tmp_path):
    "`open_flux_mini(folder)`: the damaged file of the pipeline, not diffusers' OSError."
    import shutil
    from course_lib.flux import open_flux_mini
    folder = shutil.copytree(flux_folder[1], tmp_path / "pipe")
    assert open_flux_mini(folder, "cpu") is not None
    st = halve(sorted((folder / "transformer").glob("*.safetensors"))[0])
    with pytest.raises(ValueError, match="cut short") as e: open_flux_mini(folder, "cpu")
    assert str(st) in str(e.value)


def test_cached_flux_mini_pipeline_names_the_damaged_file(flux_folder, tmp_path, monkeypatch):
    "`load_flux_mini`: a damaged cache entry is named down to the file, with the fix (delete, retrain=True)."
    import contextlib, shutil
    import course_lib.flux.train as ft
    cfg, saved = flux_folder
    monkeypatch.setattr(ft, "cache_dir", lambda *a: tmp_path.joinpath(*a))
    monkeypatch.setattr(ft, "cached", lambda *a, **k: contextlib.nullcontext(True))   # a cache hit
    folder = shutil.copytree(saved, tmp_path / "models" / "flux" / cfg.key() / "pipeline")
    st = halve(sorted((folder / "vae").glob("*.safetensors"))[0])
    with pytest.raises(ValueError) as e: ft.load_flux_mini(cfg, progress=False, device="cpu")
    msg = str(e.value)
    assert str(st) in msg and "cut short" in msg and "retrain=True" in msg, msg


def test_lora_generate_checks_the_adapter_files_before_the_base_loads(tmp_path, capsys, monkeypatch):
    "`course lora generate --adapter A`: a web page or an empty file is named before minutes of base loading."
    import course_lib.cli.lora as lc
    def no_base(*a, **k): raise AssertionError("the base model loaded before the adapter files were checked")
    monkeypatch.setattr(lc, "load_base", no_base)
    w = html(tmp_path / "web.safetensors")
    course(capsys, "lora", "generate", "a digit", tmp_path / "o.png", "--adapter", f"{w}=0.5",
           says=[str(w), "HTML page"])
    e = empty(tmp_path / "e.safetensors")
    course(capsys, "lora", "generate", "a digit", tmp_path / "o.png", "--adapter", e, says=[str(e), "is empty (0 bytes)"])


# ------------------------------------------------------------------------- issue 47, the new-user trial (helper B)

def _imgs(tmp_path):
    import numpy as np
    from PIL import Image
    imgs = tmp_path / "imgs"
    imgs.mkdir()
    for i in range(4):
        Image.fromarray(np.full((16, 16), 40 * i, np.uint8)).save(imgs / f"{i}.png")
    return imgs


def test_fid_weights_that_are_other_weights_or_a_plain_zip(tmp_path, capsys, monkeypatch):
    "A torch file of other weights, a model's state dict, a zip that torch.save did not write: exit 2, W named."
    import zipfile
    imgs = _imgs(tmp_path)
    other = tmp_path / "other.pth"
    torch.save({"w": torch.zeros(2)}, other)
    err = course(capsys, "fid", imgs, imgs, "--extractor", "inception", "--weights", other,
                 says=[str(other), "not Inception-v3 weights for torch-fidelity", "'w'", "Conv2d_1a_3x3"])
    assert len(err) < 1500, err
    model = tmp_path / "resnet.pth"
    torch.save(torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4)).state_dict(), model)
    err = course(capsys, "fid", imgs, imgs, "--extractor", "inception", "--weights", model,
                 says=[str(model), "not Inception-v3 weights", "missing", "unexpected"])
    assert len(err) < 1500, err
    z = tmp_path / "plain.pth"
    with zipfile.ZipFile(z, "w") as f: f.writestr("a.txt", "hello")
    course(capsys, "fid", imgs, imgs, "--extractor", "inception", "--weights", z,
           says=[str(z), "not one torch.save wrote", "a.txt"])
    monkeypatch.setenv("COURSE_LIB_INCEPTION_WEIGHTS", str(other))
    course(capsys, "fid", imgs, imgs, "--extractor", "inception", says=[str(other), "not Inception-v3 weights"])


def test_fid_statistics_file_that_is_a_web_page(tmp_path, capsys):
    imgs = _imgs(tmp_path)
    st = html(tmp_path / "stats.npz")
    err = course(capsys, "fid", imgs, st, says=[str(st), "HTML page", f"{len(HTML)} bytes"])
    assert "pickled" not in err
    e = empty(tmp_path / "e.npz")
    err = course(capsys, "fid", imgs, e, says=[str(e), "is empty (0 bytes)"])
    assert "pickled" not in err


def test_a_folder_given_as_a_file_says_it_is_a_folder(tmp_path, capsys):
    "--pretrained, course lora info, --weights: 'is a folder, not a file', not 'does not exist'."
    d = tmp_path / "lr=3e-3"
    d.mkdir()
    (tmp_path / "data" / "a").mkdir(parents=True)
    imgs = _imgs(tmp_path)
    for args in (("lora", "info", d),
                 ("finetune", tmp_path / "data", "--model", "resnet18", "--pretrained", d, "--steps", "1"),
                 ("fid", imgs, imgs, "--extractor", "inception", "--weights", d)):
        err = course(capsys, *args, says=[str(d), "is a folder, not a file"])
        assert "does not exist" not in err and "no adapter file" not in err and "no checkpoint" not in err
