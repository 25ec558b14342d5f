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
