"""Nothing a studio user uploads or writes is lost (issue: LoRA as practitioners train it, item 2): uploads with one
name kept apart, one caption file an image, hand-edited captions kept when the captioner runs again, images captioned
and sized as the trainer sees them (16-bit, EXIF), captions in UTF-8 whatever the locale, a run that trains on a
snapshot of its data, `continue` without a checkpoint refused. The FLUX dashboard's uploads (unit 7) and the trainers'
caption reading are the same kind and are tested here too. On the studio's tiny bases (built offline in a second)."""
import io, json, os, subprocess, sys, textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("gradio", reason='the studio needs pip install "course_lib[studio]"')
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

from PIL import Image

from course_lib.flux import write_corner_folder
from course_lib.studio import Studio, StudioStore, tiny_bases

UNET = {"rank": 2, "batch_size": 2, "prior_images": 0, "preview_every": 0}


def png(seed: int, size=(16, 16), mode="L") -> bytes:
    "A small image of random pixels, as PNG bytes (another seed, other bytes)."
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, size[::-1], dtype=np.uint8), "L").convert(mode).save(buf, "PNG")
    return buf.getvalue()


class Recorder:
    "A captioner that records the images it is given and captions each with its mean grey level."
    def __init__(self, word="digit"): self.seen, self.word = [], word
    def caption(self, images):
        self.seen += images
        return [f"{self.word} {np.asarray(im.convert('L')).mean():.0f}" for im in images]


@pytest.fixture
def recorder(monkeypatch):
    import course_lib.flux.captioner
    rec = Recorder()
    monkeypatch.setattr(course_lib.flux.captioner, "get_captioner", lambda name, **kw: rec)
    return rec


def test_uploads_with_one_name_are_kept_apart(tmp_path):
    s = StudioStore(tmp_path/"s")
    rep = s.add_images([("a/x.png", png(0)), ("b/x.png", png(1)), ("my pic.png", png(2)), ("my_pic.png", png(3)),
                        ("Y.png", png(4)), ("y.png", png(5))])
    names = rep["added"]
    assert len(names) == 6 and len({n.lower() for n in names}) == 6, rep
    saved = {p.name: p.read_bytes() for p in s.images()}
    assert sorted(saved.values()) == sorted(png(i) for i in range(6))          # every upload's bytes are there
    assert ("b/x.png", "x-2.png") in rep["renamed"] and ("my_pic.png", "my_pic-2.png") in rep["renamed"]
    # a second upload of the same file: not stored twice, and said so
    again = s.add_images([("x.png", png(0))])
    assert again["added"] == [] and again["skipped"][0][0] == "x.png" and "x.png" in again["skipped"][0][1]
    assert len(s.images()) == 6
    # a later upload never replaces a file already there
    later = s.add_images([("x.png", png(9))])
    assert later["added"] == ["x-3.png"] and (s.images_dir/"x.png").read_bytes() == png(0)


def test_one_caption_file_an_image(tmp_path, recorder):
    s = StudioStore(tmp_path/"s")
    rep = s.add_images([("y.png", png(0)), ("y.jpg", png(1, mode="RGB"))])
    assert sorted(rep["added"]) == ["y-2.jpg", "y.png"] or sorted(rep["added"]) == ["y.jpg", "y-2.png"], rep
    s.set_captions({rep["added"][0]: "first", rep["added"][1]: "second"})
    assert s.captions() == {rep["added"][0]: "first", rep["added"][1]: "second"}
    # images put in the folder by hand that share a stem share a sidecar: writing either caption is refused
    (s.images_dir/"z.png").write_bytes(png(2))
    Image.open(io.BytesIO(png(3))).convert("RGB").save(s.images_dir/"z.jpg")
    with pytest.raises(ValueError, match=r"z\.jpg.*z\.png|z\.png.*z\.jpg"):
        s.set_captions({"z.png": "a caption"})
    with pytest.raises(ValueError, match=r"z\.txt"):
        s.caption_images("any")
    assert not (s.images_dir/"z.txt").exists()


def test_captioning_again_keeps_hand_edited_captions(tmp_path, recorder):
    s = StudioStore(tmp_path/"s")
    s.add_images([("a.png", png(0)), ("b.png", png(1)), ("c.png", png(2))])
    (s.images_dir/"c.txt").write_text("a caption the user uploaded\n", encoding="utf-8")
    first = s.caption_images("any", trigger="sks")
    assert first["c.png"] == "a caption the user uploaded" and first["a.png"].startswith("sks digit")
    s.set_captions({"b.png": "sks my own words"})                     # edited by hand in the Data tab
    s.set_captions(s.captions())                                        # "save captions" of an unedited table
    assert sorted(s.hand_captions()) == ["b.png", "c.png"]
    recorder.word = "number"
    second = s.caption_images("any", trigger="sks")
    assert second["b.png"] == "sks my own words" and second["c.png"] == "a caption the user uploaded"
    assert second["a.png"].startswith("sks number")                   # the captioner's own caption is replaced
    assert s.captions() == second
    every = s.caption_images("any", trigger="sks", replace=True)       # asked for: every caption replaced
    assert all(c.startswith("sks number") for c in every.values())


def test_images_captioned_and_sized_as_the_trainer_sees_them(tmp_path, recorder):
    from course_lib.data.images import open_image
    s = StudioStore(tmp_path/"s")
    grey = np.random.default_rng(0).integers(0, 2**16, (16, 16), dtype=np.uint16)
    buf = io.BytesIO()
    Image.fromarray(grey, "I;16").save(buf, "PNG")
    wide = Image.new("L", (48, 32), 128)
    exif = wide.getexif()
    exif[0x0112] = 6                                                   # EXIF orientation: rotate 90 degrees
    buf2 = io.BytesIO()
    wide.save(buf2, "JPEG", exif=exif.tobytes())
    s.add_images([("deep.png", buf.getvalue()), ("turned.jpg", buf2.getvalue())])
    s.caption_images("any")
    seen = dict(zip([p.name for p in s.images()], recorder.seen))
    want = open_image(s.images_dir/"deep.png", "RGB")
    assert np.array_equal(np.asarray(seen["deep.png"]), np.asarray(want))   # not white: 16-bit scaled down
    assert np.asarray(seen["deep.png"]).mean() < 200
    sizes = {r["image"]: r["size"] for r in s.image_sizes("unet")[0]}
    assert sizes["turned.jpg"] == "32x48" and seen["turned.jpg"].size == (32, 48)


def test_captions_are_utf8_in_any_locale(tmp_path):
    "A caption with an accent, written and read by the store and read by both trainers, under an ASCII locale."
    code = textwrap.dedent(f"""
        import io, locale, sys, warnings
        from PIL import Image
        from course_lib.studio import StudioStore
        from course_lib.lora.data import ConceptDataset
        from course_lib.flux.lora_train import read_concept_folder
        assert locale.getpreferredencoding(False).lower() in ("ascii", "ansi_x3.4-1968"), locale.getpreferredencoding(False)
        buf = io.BytesIO()
        Image.new("L", (16, 16), 200).save(buf, "PNG")
        s = StudioStore({str(tmp_path/'s')!r})
        s.add_images([("x.png", buf.getvalue())])
        cafe = "sks caf\\u00e9"
        s.set_captions({{"x.png": cafe}})
        assert s.captions() == {{"x.png": cafe}}, s.captions()
        assert ConceptDataset(s.images_dir, size=8).captions == [cafe]
        assert read_concept_folder(s.images_dir, 8)[1] == [cafe]
        print("ok")
    """)
    env = {**os.environ, "LC_ALL": "C", "LANG": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0",
           "PYTHONIOENCODING": "utf-8"}
    (tmp_path/"script.py").write_text(code, encoding="ascii")              # the script itself is plain ASCII
    r = subprocess.run([sys.executable, str(tmp_path/"script.py")], capture_output=True, env=env,
                       encoding="utf-8", errors="replace")
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]
    assert (tmp_path/"s"/"images"/"x.txt").read_bytes() == "sks café\n".encode("utf-8")


def test_flux_dashboard_uploads_are_kept_apart(tmp_path):
    "Unit 7's dashboard saves uploads the same way: nothing overwritten, one caption file an image."
    from course_lib.flux.dashboard import FluxLoRADashboard
    from course_lib.flux.lora_train import FluxLoRAConfig
    dash = FluxLoRADashboard(None, tmp_path/"runs", tmp_path/"imgs", FluxLoRAConfig(trigger="sks"), headless=True)
    first = dash.add_images([("x.png", png(0)), ("x.jpg", png(1, mode="RGB"))], "a digit")
    (tmp_path/"imgs"/"x.txt").write_text("sks edited by hand\n", encoding="utf-8")
    second = dash.add_images([("x.png", png(2))], "another digit")
    files = sorted(p.name for p in (tmp_path/"imgs").iterdir())
    assert len({p.stem for p in first + second}) == 3, files
    assert (tmp_path/"imgs"/"x.png").read_bytes() == png(0)
    assert (tmp_path/"imgs"/"x.txt").read_text(encoding="utf-8") == "sks edited by hand\n"
    assert second[0].with_suffix(".txt").read_text(encoding="utf-8") == "sks another digit\n"


@pytest.fixture
def studio(tmp_path):
    s = Studio(tmp_path/"s", tiny_bases(), train_in="thread")
    s.add_images(sorted(write_corner_folder(tmp_path/"digits", n=4, pixels=16).glob("*.png")))
    s.set_captions({n: "a photo of sks digit" for n in s.captions()})
    return s


def test_a_run_trains_on_a_snapshot_of_its_data(studio):
    studio.start("unet", "r", {**UNET, "steps": 2})
    studio.wait()
    assert studio.run_info("r")["state"] == "done"
    d = studio.root/"runs"/"r"
    data = json.loads((d/"studio.json").read_text(encoding="utf-8"))["data"]
    assert sorted(data) == sorted(p.name for p in studio.images())
    before = {p.name: p.read_bytes() for p in studio.run_images("r")}
    # the user edits a caption, then removes every image of the Data tab
    studio.set_captions({studio.images()[0].name: "a photo of digit seven"})
    studio.clear_images()
    studio.continue_run("r", 2)                                  # trains on the run's own data
    studio.wait()
    assert studio.run_info("r")["state"] == "done" and studio.run_info("r")["steps"] == "4/4", studio.status()
    assert {p.name: p.read_bytes() for p in studio.run_images("r")} == before
    from course_lib.lora.base import read_captions
    assert set(read_captions(studio.run_images("r"))[0]) == {"a photo of sks digit"}


def test_continue_without_a_checkpoint_is_refused_and_keeps_the_adapter(studio):
    studio.start("unet", "r", {**UNET, "steps": 2})
    studio.wait()
    d = studio.root/"runs"/"r"
    adapter = (d/"adapter.safetensors").read_bytes()
    (d/"checkpoint.safetensors").unlink()
    for go in (lambda: studio.continue_run("r", 2), lambda: studio.resume("r")):
        with pytest.raises(ValueError, match="checkpoint"):
            go()
    assert (d/"adapter.safetensors").read_bytes() == adapter and not studio.running


def test_trainers_warn_when_images_share_a_caption_file(tmp_path):
    "Unit 4's and unit 7's trainers read captions with `read_captions`: a shared sidecar is named, not silent."
    from course_lib.lora.base import read_captions
    for name, i in (("y.png", 0), ("y.jpg", 1), ("z.png", 2)):
        Image.open(io.BytesIO(png(i))).convert("RGB").save(tmp_path/name)
    (tmp_path/"y.txt").write_text("sks seven\n", encoding="utf-8")
    files = sorted(tmp_path.glob("*.[pj][np]g"))
    with pytest.warns(UserWarning, match=r"y\.jpg and y\.png share one caption file, y\.txt"):
        caps, _ = read_captions(files)
    assert caps[:2] == ["sks seven", "sks seven"]


def test_no_images_and_no_steps_are_refused_on_both_bases(tmp_path):
    "0 images or 0 sampling steps is never a default: `generate` names the value on each base."
    s = Studio(tmp_path/"s", tiny_bases(), train_in="thread")
    for trainer, prompt in (("flux", "sks seven"), ("unet", "a photo of digit seven")):
        with pytest.raises(ValueError, match="n .the number of images. must be a positive int, got 0"):
            s.generate(trainer, prompt, {}, steps=2, n=0)
        with pytest.raises(ValueError, match="num_inference_steps must be an int"):
            s.generate(trainer, prompt, {}, steps=0, n=2)


def test_memory_bytes_reads_ru_maxrss_in_each_systems_unit(monkeypatch):
    "Linux reports the peak resident set in KiB, macOS in bytes: the studio's memory column is bytes on both."
    import resource, types
    from course_lib.studio import worker
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(resource, "getrusage", lambda who: types.SimpleNamespace(ru_maxrss=300_000))
    for platform, want in (("linux", 300_000 * 1024), ("darwin", 300_000)):
        monkeypatch.setattr(sys, "platform", platform)
        assert worker.memory_bytes() == want


def test_every_setting_is_labelled_in_words_with_its_help_and_default(tmp_path):
    "The Train tab: each trainer setting has a label in words and a line of help naming it and its default; one field a setting."
    from course_lib.studio import build_studio
    from course_lib.studio.settings import TRAINERS, settings_fields
    demo = build_studio(tmp_path/"s", tiny_bases())
    fields = {b.elem_id: b for b in demo.blocks.values() if getattr(b, "elem_id", None)
              and b.elem_id.split("-")[0] in TRAINERS and b.elem_id not in TRAINERS}
    for trainer in TRAINERS:
        for k, v in settings_fields(trainer).items():
            if k == "preview_every":                     # set once, above both forms
                assert f"{trainer}-{k}" not in fields
                continue
            f = fields[f"{trainer}-{k}"]
            assert f.label != k and " " in f"{f.label} x", (k, f.label)
            shown = ", ".join(v) if isinstance(v, tuple) else "empty" if v is None else v
            assert f.info.endswith(f"({k}, default {shown})") and len(f.info) > len(k) + 20, (k, f.info)
    every = [b for b in demo.blocks.values() if getattr(b, "elem_id", None) == "every"]
    assert len(every) == 1 and "preview" in every[0].label


def test_example_concepts_for_each_base(tmp_path):
    "One click adds a base's example concept with its captions; a second click adds nothing and replaces nothing."
    s = StudioStore(tmp_path/"s", tiny_bases())
    s.add_images([("9_000.png", png(0))])                             # the user's own file of that name stays
    rep = s.add_examples("unet")
    assert len(rep["added"]) == 40 and ("9_000.png", "9_000-2.png") in rep["renamed"]
    assert (s.images_dir/"9_000.png").read_bytes() == png(0) and s.captions()["9_000.png"] == ""
    caps = s.captions()
    assert {caps[n] for n in rep["added"]} == {"a photo of sks digit"}
    again = s.add_examples("unet")
    assert again["added"] == [] and len(again["skipped"]) == 40 and len(s.images()) == 41
    flux = s.add_examples("flux")
    side = {b.trainer: b.image_size for b in s.bases.values()}["flux"]
    assert len(flux["added"]) == 24 and all(s.captions()[n].startswith("sks ") for n in flux["added"])
    assert {Image.open(s.images_dir/n).size for n in flux["added"]} == {(side, side)}


def test_generate_takes_a_size_on_flux_and_the_gallery_builds_the_mix(tmp_path):
    "The Generate tab's number of images and size, and a clicked adapter added to the mix at the slider's weight."
    from course_lib.studio.tab_generate import _with_adapter
    s = Studio(tmp_path/"s", tiny_bases(), train_in="thread")
    side = {b.trainer: b.image_size for b in s.bases.values()}
    x = s.generate("flux", "sks seven", {}, steps=2, n=3, width=2 * side["flux"], height=side["flux"])
    assert x.shape == (3, 1, side["flux"], 2 * side["flux"])
    assert s.generate("flux", "sks seven", {}, steps=2, n=1).shape[-2:] == (side["flux"], side["flux"])
    with pytest.raises(ValueError, match="sizes must be positive multiples of"):
        s.generate("flux", "sks seven", {}, steps=2, n=1, width=side["flux"] + 3)
    with pytest.raises(ValueError, match="only its own size"):
        s.generate("unet", "a photo of digit seven", {}, steps=2, n=1, width=2 * side["unet"])
    assert _with_adapter("", "a", 1.0) == "a=1"
    assert _with_adapter("a=1, b=0.5", "a", 0.25) == "b=0.5, a=0.25"
    assert _with_adapter("a=1", "b", 0.75) == "a=1, b=0.75"


def test_sample_prompts_parse_as_sd_scripts_writes_them():
    from course_lib.lora.run import parse_sample_prompt
    assert parse_sample_prompt("a photo of sks digit --d 42 --w 16 --h 32 --l 3.5 --s 20 --n blurry, ugly") == {
        "prompt": "a photo of sks digit", "seed": 42, "width": 16, "height": 32, "guidance": 3.5, "steps": 20,
        "negative": "blurry, ugly"}
    assert parse_sample_prompt("  sks seven  ") == {"prompt": "sks seven"}
    for bad, why in [("--d 3", "prompt comes first"), ("x --q 1", "unknown flag --q"), ("x --d", "--d .seed. needs"),
                     ("x --s 0", "--s .steps. needs a number >= 1"), ("x --w abc", "--w .width."),
                     ("x --l 0.5", "--l .guidance.")]:
        with pytest.raises(ValueError, match=why):
            parse_sample_prompt(bad)


def _grid_size(n: int, h: int, w: int, nrow: int, upscale: int = 4) -> tuple[int, int]:
    from course_lib.data.plots import image_grid
    g = image_grid(torch.zeros(n, 1, h, w), nrow)
    return g.shape[1] * upscale, g.shape[0] * upscale


def test_previews_draw_the_sample_prompts_each_with_its_settings(studio):
    "Kept with the run, checked before training; unit 4: a row of 4 a prompt; FLUX: one image a prompt at its size."
    side = {b.trainer: b.image_size for b in studio.bases.values()}
    for trainer, bad, why in (("unet", "a photo of sks digit --w 32", "own size|without guidance"),
                              ("flux", "sks seven --w 19", "multiples of"), ("unet", "x --q 2", "unknown flag")):
        cfg = {**UNET, "steps": 2} if trainer == "unet" else {"rank": 2, "steps": 2, "batch_size": 2}
        with pytest.raises(ValueError, match=why):
            studio.start(trainer, f"bad-{trainer}", cfg, 2, [bad])
        assert not (studio.root/"runs"/f"bad-{trainer}"/"checkpoint.safetensors").exists()
    prompts = ["a photo of sks digit --d 3 --s 3", "a photo of digit seven --d 4"]
    studio.start("unet", "u", {**UNET, "steps": 2}, 2, prompts)
    studio.wait()
    assert json.loads((studio.root/"runs"/"u"/"studio.json").read_text())["preview_prompts"] == prompts
    assert Image.open(studio.previews("u")[-1]).size == _grid_size(8, side["unet"], side["unet"], nrow=4)
    f = side["flux"]
    studio.start("flux", "f", {"rank": 2, "steps": 2, "batch_size": 2, "trigger": "sks"}, 2,
                 [f"sks seven --w {2 * f} --d 3 --l 2 --n sks one", "sks one --s 3"])
    studio.wait()
    assert studio.run_info("f")["state"] == "done", studio.status()
    want = _grid_size(2, f, 2 * f, nrow=8)
    assert Image.open(studio.root/"runs"/"f"/"preview.png").size == want
    assert Image.open(studio.previews("f")[0]).size == want


def test_a_click_on_the_gallery_adds_that_adapter_and_its_trigger(studio):
    "Gradio hands the click to `pick` (its `evt` is typed as an object Gradio recognises), which fills the mix."
    import types
    import gradio as gr
    from gradio.utils import get_type_hints
    from course_lib.studio.tab_generate import _generate_handlers
    studio.start("unet", "r", {**UNET, "steps": 2, "preview_every": 2})
    studio.wait()
    pick = _generate_handlers(studio, gr)["pick"]
    assert get_type_hints(pick)["evt"] is gr.SelectData
    i = [c.split(" ")[0] for _, c in studio.gallery()].index("r")
    assert pick("other=1", 0.5, "a photo of digit seven", types.SimpleNamespace(index=i)) == (
        "other=1, r=0.5", "sks a photo of digit seven", "unet")
