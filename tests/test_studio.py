"""course_lib.studio (notebooks 83 and 83a-83f, `course studio`: 90j): the LoRA studio, headless (`Studio`'s methods, which the page's handlers call),
through Gradio's own Python client against a server on 127.0.0.1, after a SIGKILL mid-run, and in Chromium.
On small untrained base models (`tiny_bases`: built offline in a second), a few steps each."""
import json, os, signal, socket, subprocess, sys, textwrap, time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
import torch

pytest.importorskip("gradio", reason='the studio needs pip install "course_lib[studio]"')
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

from course_lib.flux import write_corner_folder
from course_lib.studio import Studio, build_studio, status_text, tiny_bases

ROOT = Path(__file__).resolve().parents[1]
UNET = {"rank": 2, "batch_size": 2, "prior_images": 0, "preview_every": 2}
FLUX = {"rank": 2, "alpha": 2.0, "batch_size": 2, "lr": 1e-2, "checkpoint_every": 2}


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    return sorted(write_corner_folder(tmp_path_factory.mktemp("digits"), n=4, pixels=16).glob("*.png"))


@pytest.fixture(scope="module")
def st(tmp_path_factory, digits):
    """One studio for the headless tests: a unit 4 run paused, resumed and continued, a unit 7 run."""
    s = Studio(tmp_path_factory.mktemp("studio"), tiny_bases())
    s.add_images(digits)
    s.set_captions({n: "a photo of sks digit" for n in s.captions()})
    s.start("unet", "u1", {**UNET, "steps": 4})
    s.pause()
    s.wait()
    s.start("flux", "f1", {**FLUX, "steps": 4, "trigger": "sks"}, preview_every=2)
    s.wait()
    return s


def _finish_u1(st):
    """Run `u1` to its end when this worker's studio still holds it paused: under `pytest -n 2` the tests of this
    module may be shared between two workers, each with its own `st`, so a test that needs `u1` trained cannot rely
    on `test_pause_resume_continue_with_previews` having run before it on the same worker."""
    if st.run_info("u1")["state"] == "paused":
        st.resume("u1")
        st.wait()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- headless: the functions the page calls

def test_bad_files_named_and_skipped_sizes_bucketed(tmp_path, digits):
    from PIL import Image
    s = Studio(tmp_path/"s", tiny_bases())
    with pytest.raises(ValueError, match="no training images"):
        s.start("unet", "r", {**UNET, "steps": 2})
    (tmp_path/"notes.png").write_text("not an image")
    Image.new("L", (32, 20)).save(tmp_path/"wide.png")
    rep = s.add_images([*digits[:2], tmp_path/"notes.png", tmp_path/"wide.png", tmp_path/"gone.png"])
    assert rep["added"] == ["corner_000.png", "corner_001.png", "wide.png"]
    assert [n for n, _ in rep["skipped"]] == ["notes.png", str(tmp_path/"gone.png")]
    assert "not an image" in rep["skipped"][0][1]
    rows, warn = s.image_sizes("unet")
    assert {r["bucket"] for r in rows} == {"8x8"} and {r["size"] for r in rows} == {"16x16", "32x20"}
    assert {r["bucket"] for r in s.image_sizes("flux")[0]} == {"16x16"}       # each trainer's own side
    assert len(warn) == 1 and warn[0].startswith("wide.png is 32x20")


def test_settings_refused_before_training(st):
    for bad, msg in [({"rank": 0}, "rank"), ({"rank": 17, "prior_images": 0}, "above the layer width"),
                     ({"rank": 2, "lr": "fast"}, "not a number"), ({"rnak": 2}, "did you mean 'rank'")]:
        with pytest.raises(ValueError, match=msg):
            st.start("unet", "bad", bad)
    with pytest.raises(ValueError, match="above the layer width"):
        st.start("flux", "bad", {"rank": 99})
    with pytest.raises(ValueError, match="run name"):
        st.start("unet", "../x", UNET)
    assert not (st.root/"runs"/"bad").exists()


def test_pause_resume_continue_with_previews(st):
    info = st.run_info("u1")
    assert info["state"] == "paused" and info["steps"].startswith(("1/", "2/"))
    done = len(info["history"])
    st.resume("u1")
    st.wait()
    h = st.run_info("u1")["history"]
    assert [r["step"] for r in h] == [1, 2, 3, 4] and st.run_info("u1")["state"] == "done"
    assert h[done - 1]["loss"] == info["history"][-1]["loss"]          # the checkpoint's history kept
    st.continue_run("u1", 2)
    st.wait()
    assert st.run_info("u1")["steps"] == "6/6"
    assert [p.name for p in st.previews("u1")] == ["step_000002.png", "step_000004.png", "step_000006.png"]
    assert [p.name for p in st.previews("f1")] == ["step_000002.png", "step_000004.png", "preview.png"]
    assert {r["run"]: r["state"] for r in st.runs()} == {"u1": "done", "f1": "done"}


def test_flux_pause_resume_continue_with_previews(tmp_path, digits):
    """Unit 7's trainer through the studio: a run paused mid-way and resumed goes on from its checkpoint (every
    step once in the history, the losses before the pause kept), and a finished run continues with more steps,
    its previews every N steps."""
    s = Studio(tmp_path/"s", tiny_bases())
    s.add_images(digits)
    s.set_captions({n: "sks seven" for n in s.captions()})
    s.start("flux", "fp", {**FLUX, "steps": 400, "trigger": "sks"})
    t0 = time.time()
    while s.status().get("step", 0) < 3 and time.time() - t0 < 120: time.sleep(0.1)
    s.pause()
    s.wait()
    first = s.run_info("fp")
    assert first["state"] == "paused" and first["trainer"] == "flux"
    n = int(first["steps"].split("/")[0])
    assert 2 <= n < 400 and first["steps"].endswith("/400")
    s.resume("fp")
    t0 = time.time()
    while s.status().get("step", 0) < n + 2 and time.time() - t0 < 120: time.sleep(0.1)
    s.pause()
    s.wait()
    h = s.run_info("fp")["history"]
    assert [r["step"] for r in h] == list(range(1, len(h) + 1)) and len(h) >= n + 2     # no step lost or repeated
    assert [r["loss"] for r in h[:n]] == [r["loss"] for r in first["history"][:n]]
    s.start("flux", "fc", {**FLUX, "steps": 2, "trigger": "sks"}, preview_every=2)
    s.wait()
    s.continue_run("fc", 2)
    s.wait()
    info = s.run_info("fc")
    assert info["state"] == "done" and info["steps"] == "4/4" and [r["step"] for r in info["history"]] == [1, 2, 3, 4]
    assert {"step_000002.png", "step_000004.png"} <= {p.name for p in s.previews("fc")}


def test_one_trainer_at_a_time(st):
    st.start("unet", "u2", {**UNET, "steps": 400, "preview_every": 0})
    try:
        with pytest.raises(RuntimeError, match="one trainer at a time"):
            st.start("flux", "f2", {**FLUX, "steps": 2})
        other = Studio(st.root, tiny_bases())             # another process (or server) on the same root
        with pytest.raises(RuntimeError, match="another studio process"):
            other.start("unet", "u3", {**UNET, "steps": 2})
        s = st.status()
        assert s["state"] in ("starting", "training") and s["steps"] == 400 and s["memory_mb"] > 0
    finally:
        st.pause()
        st.wait()
    assert st.run_info("u2")["state"] == "paused"
    assert "eta" not in status_text(st.status()).lower()


def _tiny_unet_in_the_studio_only():
    "A unit 4 base that loads in the test's process and fails in any other (a trainer process)."
    if os.getpid() != int(os.environ["STUDIO_TEST_PARENT"]): raise RuntimeError("no weights in this process")
    return tiny_bases()[0].load()


def _state(pid: int) -> str | None:
    "The process's state letter (R, S, Z...), None once it is gone."
    try: return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError): return None


def test_runs_train_in_a_process_of_their_own(tmp_path, digits, monkeypatch):
    """Each run trains in a new Python process (its main thread: a trainer thread beside the page's would run
    PyTorch slower on a CPU), which ends with the run; its stderr is the run's train.log; a base that cannot
    reach such a process, or fails there, is named in a message; train_in='thread' keeps the old way."""
    from course_lib.studio import StudioBase
    with pytest.raises(ValueError, match="train_in must be 'process' or 'thread', got 'gpu'"):
        Studio(tmp_path/"x", tiny_bases(), train_in="gpu")
    s = Studio(tmp_path/"s", tiny_bases())
    s.add_images(digits)
    s.set_captions({n: "a photo of sks digit" for n in s.captions()})
    s.start("unet", "p", {**UNET, "steps": 3})
    done = s.wait()
    assert done["state"] == "done" and done["pid"] != os.getpid()
    pid = done["pid"]
    assert (s.root/"runs"/"p"/"train.log").is_file() and _state(pid) is None        # waited for, not a zombie
    assert [r["step"] for r in s.run_info("p")["history"]] == [1, 2, 3]
    unet = tiny_bases()[0]
    lam = StudioBase("unet", unet.key, lambda: unet.load(), unet.image_size)
    bad = Studio(tmp_path/"l", [lam])
    bad.add_images(digits[:2])
    bad.set_captions({n: "a photo of sks digit" for n in bad.captions()})
    with pytest.raises(ValueError, match="cannot be sent to a training process.*train_in='thread'"):
        bad.start("unet", "l", {**UNET, "steps": 2})
    assert bad.running is False and not (bad.root/"runs"/"l").exists()
    main_fn = lambda: unet.load()
    main_fn.__module__, main_fn.__qualname__ = "__main__", "load_my_base"
    m = Studio(tmp_path/"m", [StudioBase("unet", unet.key, main_fn, unet.image_size)])
    m.add_images(digits[:2])
    m.set_captions({n: "a photo of sks digit" for n in m.captions()})
    with pytest.raises(ValueError, match="'load_my_base' is defined in __main__"):
        m.start("unet", "m", {**UNET, "steps": 2})
    t = Studio(tmp_path/"t", [lam], train_in="thread")
    t.add_images(digits[:2])
    t.set_captions({n: "a photo of sks digit" for n in t.captions()})
    t.start("unet", "t", {**UNET, "steps": 2})
    assert t.wait()["state"] == "done" and "pid" not in t.status()
    monkeypatch.setenv("STUDIO_TEST_PARENT", str(os.getpid()))
    f = Studio(tmp_path/"f", [StudioBase("unet", unet.key, _tiny_unet_in_the_studio_only, unet.image_size)])
    f.add_images(digits[:2])
    f.set_captions({n: "a photo of sks digit" for n in f.captions()})
    f.start("unet", "f", {**UNET, "steps": 2})
    s = f.wait()
    assert s["state"] == "error" and "RuntimeError: no weights in this process" in s["error"]
    assert "no weights in this process" in (f.root/"runs"/"f"/"train.log").read_text()
    f.start("unet", "f2", {**UNET, "steps": 1})                       # the lock was given back
    f.wait()


def test_worker_protocol_is_json_lines():
    """A run reaches its training process as one JSON `job` line (course_lib.studio.worker): the base by its
    `source` ('module:function') or its `load` function by name with JSON arguments; other bases are refused."""
    import functools
    from course_lib.studio import StudioBase, base_spec, job_message, parse_settings, read_job
    unet = tiny_bases()[0]
    spec = base_spec(unet)
    assert spec == {"trainer": "unet", "key": unet.key, "image_size": unet.image_size,
                    "source": "course_lib.studio.settings:tiny_bases"}
    cfg = parse_settings("unet", {**UNET, "steps": 3, "target_modules": "to_q, to_k"})
    line = json.dumps(job_message("unet", spec, cfg, {"preview_every": 0}, Path("i"), Path("r")))
    job = read_job(json.loads(line))
    assert job["cfg"] == cfg and job["base"].key == unet.key and job["run_dir"] == Path("r")
    by_name = StudioBase("unet", "k", functools.partial(_tiny_unet_in_the_studio_only), 16)
    assert base_spec(by_name)["load"].endswith(":_tiny_unet_in_the_studio_only")
    partial = StudioBase("unet", "k", functools.partial(json.dumps, [1], indent=1), 16)
    assert read_job({**json.loads(line), "base": base_spec(partial)})["base"].load() == json.dumps([1], indent=1)
    with pytest.raises(ValueError, match="arguments are not JSON"):
        base_spec(StudioBase("unet", "k", functools.partial(json.dumps, object()), 16))
    with pytest.raises(ValueError, match="not a course_lib.studio.worker/1 job"):
        read_job({"type": "job", "protocol": "pickle"})


def test_private_apis_have_fallbacks(tmp_path, digits, monkeypatch):
    """filelock's `_context.lock_file_fd` (the lock's descriptor, which the training process inherits) and
    Gradio's `demo._queue.sleep_when_free` are private: without them, the studio finds the descriptor in
    /proc/self/fd and trains as before, and the page keeps Gradio's own polling."""
    from filelock import FileLock
    import course_lib.studio.page as page
    import course_lib.studio.worker as worker
    lock = FileLock(str(tmp_path/"x.lock"), thread_local=False)
    with lock:
        fd = lock._context.lock_file_fd
        monkeypatch.setattr(worker, "_filelock_fd", lambda lock: None)
        assert worker.held_lock_fd(lock) == fd
    s = Studio(tmp_path/"s", tiny_bases())
    s.add_images(digits[:2])
    s.set_captions({n: "a photo of sks digit" for n in s.captions()})
    s.start("unet", "p", {**UNET, "steps": 1})
    assert s.wait()["state"] == "done"
    monkeypatch.setattr(page, "_gradio_queue", lambda demo: None)
    demo = build_studio(tmp_path/"page", tiny_bases())
    assert page._quiet_queue(demo) is False and demo.studio.root == tmp_path/"page"


def test_loss_frame_is_the_running_mean_of_each_loss():
    import numpy as np, pandas as pd
    from course_lib.studio import loss_frame
    rng = np.random.default_rng(0)
    h = [{"step": i + 1, "loss": float(a), "concept_loss": float(b), "prior_loss": float(c)}
         for i, (a, b, c) in enumerate(rng.random((1000, 3)))]
    df = loss_frame(h)
    assert list(df.columns) == ["step", "loss", "series"] and set(df.series) == {"loss", "concept_loss", "prior_loss"}
    for k in ("loss", "concept_loss", "prior_loss"):
        part = df[df.series == k]
        ref = pd.Series([r[k] for r in h], index=[r["step"] for r in h]).rolling(25).mean()
        assert 195 <= len(part) <= 200 and part.step.iloc[0] == 25 and part.step.iloc[-1] == 1000
        np.testing.assert_allclose(part.loss.to_numpy(), ref.loc[part.step].to_numpy(), rtol=1e-12)
    flux = loss_frame([{"step": i + 1, "loss": 1.0 / (i + 1)} for i in range(10)])
    assert set(flux.series) == {"loss"} and len(flux) == 1 and flux.loss.iloc[0] == pytest.approx(np.mean(1 / np.arange(1, 11)))
    assert loss_frame([]).empty


def test_presets_refuse_unknown_keys_and_other_sizes(st, tmp_path):
    from course_lib.lora import LoRATrainConfig
    p = st.save_preset("unet", {"rank": 4, "lr": 1e-3, "target_modules": "to_q, to_k"}, "mine")
    trainer, cfg = st.load_preset(p)
    assert trainer == "unet" and cfg == LoRATrainConfig(rank=4, lr=1e-3, target_modules=("to_q", "to_k"))
    d = json.loads(p.read_text())
    for change, msg in [({"settings": {**d["settings"], "ranks": 4}}, "unknown preset key 'ranks'"),
                        ({"base": "ddpm-bigger"}, "another base model"), ({"format": "x"}, "not a studio preset")]:
        (tmp_path/"bad.json").write_text(json.dumps({**d, **change}))
        with pytest.raises(ValueError, match=msg):
            st.load_preset(tmp_path/"bad.json")


def test_compare_export_generate(st):
    _finish_u1(st)
    rows, fig = st.compare(["u1", "f1"], rates=False)
    assert [r["run"] for r in rows] == ["u1", "f1"] and len(fig.axes) == 3     # curves + two previews
    rate = st.concept_rate("f1")
    assert 0.0 <= rate <= 1.0
    diff = st.export("f1", "diffusers")
    kohya = st.export("f1", "kohya", "fp16", rank=1)
    from safetensors import safe_open
    with safe_open(str(diff), "pt") as f:
        assert all(k.startswith("transformer.") for k in f.keys())           # diffusers' own layout
    with safe_open(str(kohya), "pt") as f:
        keys, meta = list(f.keys()), f.metadata()
    assert any(k.startswith("lora_transformer_") and k.endswith(".alpha") for k in keys)
    assert meta["course_lib.network_dim"] == "1" and "ss_network_module" not in meta   # OneTrainer's names
    with pytest.raises(ValueError, match="dtype"):
        st.export("f1", "kohya", "fp8")
    # two adapters on one loaded pipeline, switched by weight: the base is never reloaded
    base0 = st.generate("flux", "sks seven", {}, steps=2, n=2)
    pipe = st.generator("flux")[0]
    name = st.load_adapter_file("flux", kohya, "f1_kohya")
    a = st.generate("flux", "sks seven", {"f1": 1.0, name: 0.5}, steps=2, n=2)
    b = st.generate("flux", "sks seven", {"f1": 1.0}, steps=2, n=2)
    assert st.generator("flux")[0] is pipe and set(pipe.get_list_adapters()["transformer"]) == {"f1", "f1_kohya"}
    assert (a - b).abs().max() > 0 and (b - base0).abs().max() > 0
    assert torch.equal(st.generate("flux", "sks seven", {}, steps=2, n=2), base0)   # all off: the base again
    u = st.generate("unet", "a photo of sks digit", {"u1": 1.0}, steps=2, n=2)
    assert u.shape == (2, 1, 8, 8) and 0 <= u.min() and u.max() <= 1          # the tiny UNet's side
    with pytest.raises(ValueError, match="not an adapter for this flux model"):
        st.load_adapter_file("flux", st.root/"runs"/"u1"/"adapter.safetensors")
    assert {c.split(" ")[0] for _, c in st.gallery()} >= {"u1", "f1"}


def test_unet_generate_with_guidance_against_a_negative_prompt(st):
    """The unit 4 UNet's guidance: eps(negative) + w (eps(prompt) - eps(negative)) (Ho & Salimans 2022), the
    negative prompt's class standing in for the null class the base was trained without. Checked against a
    model that makes the two network calls apart and combines them by hand."""
    _finish_u1(st)
    from types import SimpleNamespace
    from torch import nn
    from course_lib.lora import encode_prompt, generate as unet_generate
    prompt, kw = "a photo of sks digit", dict(steps=2, n=2, seed=3)
    plain = st.generate("unet", prompt, {"u1": 1.0}, **kw)
    assert torch.equal(st.generate("unet", prompt, {"u1": 1.0}, negative_prompt="three", guidance=1.0, **kw), plain)
    guided = st.generate("unet", prompt, {"u1": 1.0}, negative_prompt="three", guidance=3.0, **kw)
    pipe, trig = st.generator("unet")[0], st.run_config("u1").trigger
    neg = encode_prompt("three", trig)

    class ByHand(nn.Module):
        def __init__(self):
            super().__init__()
            self.unet, self.config, self.ddpm_config = pipe, pipe.config, pipe.ddpm_config
        def forward(self, x, t, class_labels=None):
            cond = self.unet(x, t, class_labels=class_labels).sample
            away = self.unet(x, t, class_labels=torch.full_like(class_labels, neg)).sample
            return SimpleNamespace(sample=away + 3.0 * (cond - away))

    ref = (unet_generate(ByHand(), prompt, n=2, seed=3, num_inference_steps=2, trigger=trig) + 1) / 2
    torch.testing.assert_close(guided, ref, atol=1e-5, rtol=0)
    assert (guided - plain).abs().max() > 1e-3                                  # guidance changed the images
    with pytest.raises(ValueError, match="needs a negative prompt"):
        st.generate("unet", prompt, {"u1": 1.0}, guidance=3.0, **kw)
    with pytest.raises(ValueError, match="negative prompt: .*names no digit"):
        st.generate("unet", prompt, {"u1": 1.0}, negative_prompt="a banana", guidance=3.0, **kw)
    for bad in (0.5, "2"):                                                      # both bases refuse them alike
        for t, p in (("unet", prompt), ("flux", "sks seven")):
            with pytest.raises(ValueError, match="guidance_scale must be"):
                st.generate(t, p, {}, negative_prompt="three", guidance=bad, **kw)


# ---------------------------------------------------------------- the page, through Gradio's Python client

@pytest.fixture(scope="module")
def server(tmp_path_factory, digits):
    demo = build_studio(tmp_path_factory.mktemp("served"), tiny_bases())
    _, url, _ = demo.launch(server_name="127.0.0.1", server_port=free_port(), prevent_thread_lock=True,
                            quiet=True)
    yield demo, url
    demo.close()


def test_served_queue_does_not_poll_every_millisecond(server):
    """Gradio's queue, idle, looks for work every 1 ms by default: 3.8% of a core for a studio doing nothing,
    which slows the training process beside it on 2 cores (benchmarks/studio.py). The served studio's queue
    looks every 20 ms at most often, and its clicks still run (the client tests below)."""
    demo, _ = server
    q = demo._queue
    assert q.sleep_when_free >= 0.02, q.sleep_when_free
    assert q.progress_update_sleep_when_free >= 0.1, q.progress_update_sleep_when_free


def test_client_bad_input_gives_messages(server, digits, tmp_path):
    from gradio_client import Client, handle_file
    demo, url = server
    c = Client(url, verbose=False)
    (tmp_path/"notes.txt").write_text("not an image")
    msg, table = c.predict([handle_file(str(digits[0])), handle_file(str(tmp_path/"notes.txt"))],
                           api_name="/upload_images")
    assert "added 1 image" in msg and "skipped **notes.txt**: not an image" in msg
    assert [r[0] for r in table["data"]] == ["corner_000.png"]
    form = {k: v for k, v in zip(*_form(demo))}
    for change, expect in [({"unet-rank": 0}, "rank must be"), ({"unet-rank": 64}, "above the layer width")]:
        out = c.predict("unet", "bad", 2, "", *{**form, **change}.values(), api_name="/start")
        assert out.startswith("**error**") and expect in out and "Traceback" not in out
    out = c.predict("unet", "no-captions", 2, "", *{**form, "unet-rank": 2}.values(), api_name="/start")
    assert out.startswith("**error**: corner_000.png: prompt") and "names no digit" in out
    preset = demo.studio.save_preset("unet", {"rank": 2}, "small")
    (tmp_path/"big.json").write_text(preset.read_text().replace(demo.studio.bases["unet"].key, "ddpm-big"))
    out = c.predict(handle_file(str(tmp_path/"big.json")), api_name="/load_preset")
    assert out[0].startswith("**error**: big.json was made for another base model (ddpm-big)")
    from course_lib.studio import Studio as S
    other = S(tmp_path/"other", tiny_bases())
    other.add_images(digits)
    other.set_captions({n: "sks" for n in other.captions()})
    other.start("unet", "u", {**UNET, "steps": 1})
    other.wait()
    out = c.predict("flux", handle_file(str(other.root/"runs"/"u"/"adapter.safetensors")), api_name="/load_adapter")
    assert out.startswith("**error**: adapter.safetensors is not an adapter for this flux model")


def _form(demo):
    "The Train tab's form: element ids and default values, in the order /start takes them."
    comps = [b for b in demo.blocks.values() if getattr(b, "elem_id", None) and b.elem_id.split("-")[0] in
             ("unet", "flux") and b.elem_id not in ("unet", "flux")]
    ids = [b.elem_id for b in comps]
    return ids, [b.value for b in comps]


def _caption_all(c, digits, text="a photo of sks digit"):
    "Upload the digits and write each one's caption through the page's table."
    from gradio_client import handle_file
    table = c.predict([handle_file(str(p)) for p in digits], api_name="/upload_images")[1]
    rows = [[r[0], r[1], r[2], text] for r in table["data"]]
    assert c.predict({"headers": table["headers"], "data": rows, "metadata": None},
                     api_name="/save_captions") == f"saved {len(rows)} caption(s)"


def test_client_train_pause_resume_export_generate(server, digits):
    from gradio_client import Client
    demo, url = server
    c = Client(url, verbose=False)
    _caption_all(c, digits)
    assert set(demo.studio.captions().values()) == {"a photo of sks digit"}
    form = dict(zip(*_form(demo)))
    form.update({"unet-rank": 2, "unet-steps": 300, "unet-batch_size": 2, "unet-prior_images": 0})
    assert c.predict("unet", "web-1", 0, "", *form.values(), api_name="/start") == "started web-1 (unet)"
    busy = c.predict("unet", "web-2", 0, "", *form.values(), api_name="/start")
    assert "one trainer at a time" in busy
    t0 = time.time()
    while demo.studio.status().get("step", 0) < 3 and time.time() - t0 < 60: time.sleep(0.2)
    status, curve = c.predict(api_name="/status")[:2]
    assert status.startswith("web-1 (unet): training, step") and "ETA" in status and "MB" in status
    assert curve["columns"] == ["step", "loss", "series"] and {r[2] for r in curve["data"]} >= {"loss"}
    assert c.predict(api_name="/pause").startswith("pausing web-1")
    demo.studio.wait()
    assert "paused" in c.predict(api_name="/status")[0]
    choices, table = c.predict(api_name="/runs")
    assert [r[:3] for r in table["data"]] == [["web-1", "unet", "paused"]]
    msg, path = c.predict("web-1", "kohya", "fp32", 0, api_name="/export")
    assert msg.startswith("wrote web-1-kohya-fp32.safetensors") and Path(path).is_file()
    msg, image, gallery = c.predict("unet", "a photo of sks digit", "", 3, 0, 1.0, 2, None, None, "web-1=0.8",
                                    api_name="/generate")
    assert msg == "generated with web-1=0.8" and Path(image).is_file()
    msg = c.predict("unet", "sks", "", 2, 0, 1.0, 2, None, None, "web-1=lots", api_name="/generate")[0]
    assert msg.startswith("**error**") and "WEIGHT a number" in msg
    msg = c.predict("unet", "sks", "", 2, 0, 1.0, 2, 16, 16, "", api_name="/generate")[0]
    assert msg.startswith("**error**") and "only its own size" in msg


def test_client_unit4_concept_rate_and_export_options(tmp_path, digits):
    """Unit 4's rows of the table through the page: the Runs tab's concept rate (the digits classifier on the
    run's samples for the trigger) and the Export tab's "measure the options" button (every format x dtype x
    rank with its size, maximum output change and concept rate), each equal to the headless call's figure."""
    from gradio_client import Client
    demo = build_studio(tmp_path/"studio", tiny_bases())
    _, url, _ = demo.launch(server_name="127.0.0.1", server_port=free_port(), prevent_thread_lock=True, quiet=True)
    try:
        c = Client(url, verbose=False)
        _caption_all(c, digits)
        form = dict(zip(*_form(demo)))
        form.update({"unet-rank": 2, "unet-steps": 2, "unet-batch_size": 2, "unet-prior_images": 0})
        assert c.predict("unet", "u4", 0, "", *form.values(), api_name="/start") == "started u4 (unet)"
        demo.studio.wait()
        assert c.predict(api_name="/runs")[0]["choices"] == [["u4", "u4"]]     # "refresh" lists the run to pick
        msg, table, _ = c.predict(["u4"], True, api_name="/compare")
        row = dict(zip(table["headers"], table["data"][0]))
        assert msg == "1 run(s)" and row["run"] == "u4" and row["trainer"] == "unet"
        rate = demo.studio.concept_rate("u4")
        assert 0.0 <= rate <= 1.0 and float(row["concept_rate"]) == round(rate, 3)
        msg, opts = c.predict("u4", api_name="/export_options")
        rows = [dict(zip(opts["headers"], r)) for r in opts["data"]]
        assert msg == "8 option(s)" and len(rows) == 8       # 2 formats x (fp32, fp16, bf16 at rank 2, fp32 at 1)
        assert {(r["format"], r["dtype"], int(r["rank"])) for r in rows} == {
            (f, d, k) for f in ("diffusers", "kohya") for d, k in [("fp32", 2), ("fp16", 2), ("bf16", 2), ("fp32", 1)]}
        by = {(r["format"], r["dtype"], int(r["rank"])): r for r in rows}
        full = by[("diffusers", "fp32", 2)]
        assert float(full["max_output_change"]) <= 1e-6                   # the run's own adapter, reloaded
        assert float(full["concept_rate"]) == pytest.approx(rate, abs=1e-9)
        from safetensors.torch import load_file
        folder = demo.studio.root/"exports"/"u4-options"
        payload = lambda r: sum(t.numel() * t.element_size() for k, t in load_file(folder/r["path"]).items()
                                if not k.endswith(".alpha"))         # kohya's alphas stay float32 scalars
        for f in ("diffusers", "kohya"):                                   # half the bytes per weight
            assert int(by[(f, "fp16", 2)]["bytes"]) < int(by[(f, "fp32", 2)]["bytes"])
            assert payload(by[(f, "fp16", 2)]) * 2 == payload(by[(f, "fp32", 2)])
            assert 0 < float(by[(f, "bf16", 2)]["max_output_change"])     # rounding changes the output a little
        assert payload(by[("diffusers", "fp32", 1)]) * 2 == payload(by[("diffusers", "fp32", 2)])   # rank 2 -> 1
        assert sorted(p.name for p in folder.glob("*.safetensors")) == \
            sorted(Path(r["path"]).name for r in rows)
    finally:
        demo.close()


# ---------------------------------------------------------------- nothing lost: SIGKILL mid-run, then a restart

SERVE = textwrap.dedent("""
    import sys
    from course_lib.studio import build_studio, tiny_bases
    demo = build_studio(sys.argv[1], tiny_bases())
    demo.launch(server_name="127.0.0.1", server_port=int(sys.argv[2]), quiet=True)
""")


def _serve(root: Path, port: int):
    env = {**os.environ, "GRADIO_ANALYTICS_ENABLED": "False"}
    p = subprocess.Popen([sys.executable, "-c", SERVE, str(root), str(port)], env=env, cwd=ROOT,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    t0 = time.time()
    while time.time() - t0 < 120:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1): return p
        except OSError: time.sleep(0.3)
        assert p.poll() is None, p.stderr.read().decode()[-2000:]
    p.kill()
    raise AssertionError("the studio server did not start in 120 s")


def _children(pid: int) -> list[int]:
    "The processes whose parent is `pid` (from /proc)."
    out = []
    for st in Path("/proc").glob("[0-9]*/stat"):
        try: f = st.read_text().rsplit(")", 1)[1].split()
        except OSError: continue
        if int(f[1]) == pid: out.append(int(st.parent.name))
    return out


def test_sigkill_mid_run_then_restart_resumes(tmp_path, digits):
    from gradio_client import Client
    from course_lib.core import load_checkpoint
    root, port = tmp_path/"studio", free_port()
    p = _serve(root, port)
    try:
        c = Client(f"http://127.0.0.1:{port}/", verbose=False)
        _caption_all(c, digits)
        demo_form = dict(zip(*_form(build_studio(tmp_path/"unused", tiny_bases()))))
        demo_form.update({"unet-rank": 2, "unet-steps": 100000, "unet-batch_size": 2, "unet-prior_images": 0})
        assert c.predict("unet", "killed", 0, "", *demo_form.values(), api_name="/start").startswith("started")
        ck = root/"runs"/"killed"/"checkpoint.safetensors"
        t0 = time.time()
        while not ck.is_file() and time.time() - t0 < 120: time.sleep(0.2)
        assert ck.is_file(), "no checkpoint after 120 s"
        trainers = _children(p.pid)
        assert len(trainers) == 1, trainers                     # the run trains in a process of its own
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    t0 = time.time()                  # the server gone, its trainer checkpoints after its step and exits
    while _state(trainers[0]) not in (None, "Z") and time.time() - t0 < 60: time.sleep(0.2)
    assert _state(trainers[0]) in (None, "Z"), "the trainer outlived its studio by 60 s"
    step = load_checkpoint(ck)[0]["step"]
    assert step >= 25 and (root/"runs"/"killed"/"preset.json").is_file()
    p = _serve(root, port)
    try:
        c = Client(f"http://127.0.0.1:{port}/", verbose=False)
        table = c.predict(api_name="/runs")[1]["data"]
        assert [r[:4] for r in table] == [["killed", "unet", "paused", f"{step}/100000"]]
        assert c.predict("killed", api_name="/resume") == "resuming killed"       # the lock died with the process
        t0 = time.time()
        while f"step {step + 2}/" not in (s := c.predict(api_name="/status")[0]) and time.time() - t0 < 60:
            time.sleep(0.3)
        assert s.startswith("killed (unet): training"), s
        c.predict(api_name="/pause")
        t0 = time.time()
        while "paused" not in c.predict(api_name="/status")[0] and time.time() - t0 < 60: time.sleep(0.3)
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    h = load_checkpoint(ck)[0]["history"]
    assert [r["step"] for r in h] == list(range(1, len(h) + 1)) and len(h) > step


# ---------------------------------------------------------------- in a real browser (Chromium, Playwright)

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--disable-quic"]
ARTIFACTS = ROOT/"test-artifacts"/"studio"


def _chromium() -> str | None:
    import shutil
    for c in [os.environ.get("COURSE_LIB_CHROMIUM"), "chromium", "chromium-browser", "google-chrome"]:
        if c and shutil.which(c): return shutil.which(c)
    return None


def _no_browser(why: str):
    "Skip locally, fail in CI (`CI=true`: .ci/run installs Chromium), as tests/test_site.py does."
    if os.environ.get("CI", "").strip().lower() in ("1", "true", "yes"):
        pytest.fail(f"the studio's browser test cannot run in CI: {why}", pytrace=False)
    pytest.skip(f"browser test skipped: {why}")


def test_browser_end_to_end(tmp_path, digits):
    """Upload 4 images and a wide one, caption them, add the one-click example set, train a few steps, pause,
    resume, train a second run on aspect-ratio buckets with a sample prompt previewed, compare the two runs,
    export both formats, generate with two adapters at two weights: in Chromium, with a screenshot of each tab in
    test-artifacts/studio/."""
    exe = _chromium()
    if exe is None: _no_browser("no Chromium found (apt-get install chromium, or set COURSE_LIB_CHROMIUM)")
    from playwright.sync_api import expect, sync_playwright
    demo = build_studio(tmp_path/"studio", tiny_bases())
    _, url, _ = demo.launch(server_name="127.0.0.1", server_port=free_port(), prevent_thread_lock=True, quiet=True)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    pw = sync_playwright().start()
    try:
        browser = pw.chromium.launch(executable_path=exe, headless=True, args=CHROMIUM_FLAGS)
        page = browser.new_page(viewport={"width": 1280, "height": 1000})
        errors = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(url)
        expect(page.get_by_text("LoRA studio").first).to_be_visible(timeout=60_000)
        status = lambda el: expect(page.locator(f"#{el}"))
        # Data: upload, caption with the course's captioner
        wide = tmp_path/"wide.png"                                     # a 2:1 picture among squares
        Image.fromarray(np.tile(np.linspace(0, 255, 40, dtype=np.uint8), (20, 1)), "L").save(wide)
        page.locator("#upload input[type=file]").set_input_files([str(p) for p in digits] + [str(wide)])
        status("data-status").to_contain_text("added 5 image(s)", timeout=60_000)
        expect(page.locator("#captions")).to_contain_text("8x8 (with buckets: 10x6)")
        page.locator("#caption").click()
        status("data-status").to_contain_text("captioned 5 image(s)", timeout=120_000)
        expect(page.locator("#captions")).to_contain_text("sks")
        page.locator("#examples-unet").click()                         # the one-click example concept
        status("data-status").to_contain_text("example image(s) with their captions", timeout=60_000)
        n_examples = len(demo.studio.images()) - 5
        assert n_examples > 0
        page.screenshot(path=str(ARTIFACTS/"data.png"), full_page=True)
        # Train: a long run paused and resumed, then a short second run
        page.get_by_role("tab", name="Train").click()
        for k, v in {"unet-rank": 2, "unet-steps": 400, "unet-batch_size": 2, "unet-prior_images": 0}.items():
            page.locator(f"#{k} input").fill(str(v))
        page.locator("#every input").fill("0")
        page.locator("#start").click()
        status("train-status").to_contain_text("run-1 (unet): training, step", timeout=60_000)
        page.locator("#pause").click()
        status("train-status").to_contain_text("paused", timeout=60_000)
        page.locator("#resume").click()
        status("train-status").to_contain_text("training", timeout=60_000)
        page.screenshot(path=str(ARTIFACTS/"train.png"), full_page=True)
        page.locator("#pause").click()
        status("train-status").to_contain_text("paused", timeout=60_000)
        page.locator("#run-name input, #run-name textarea").first.fill("run-2")
        page.locator("#unet-steps input").fill("3")
        page.locator("#unet-buckets input").check()                    # the wide image keeps its shape
        page.locator("#every input").fill("3")
        page.locator("#sample-prompts textarea").fill("a photo of sks digit --d 7 --s 4")
        page.locator("#start").click()
        status("train-status").to_contain_text("run-2 (unet): done, step 3/3", timeout=60_000)
        run2 = tmp_path/"studio"/"runs"/"run-2"
        assert (run2/"previews"/"step_000003.png").is_file()
        said = json.loads((run2/"studio.json").read_text())
        assert said["preview_prompts"] == ["a photo of sks digit --d 7 --s 4"]
        assert json.loads((run2/"preset.json").read_text())["buckets"] is True
        # Runs: both side by side
        page.get_by_role("tab", name="Runs").click()
        page.locator("#refresh").click()
        expect(page.locator("#runs-table")).to_contain_text("run-2", timeout=30_000)
        for r in ("run-1", "run-2"):
            page.locator("#run-pick input").fill(r)
            page.locator("#run-pick input").press("Enter")
        page.keyboard.press("Escape")
        page.locator("#compare").click()
        status("runs-status").to_contain_text("2 run(s)", timeout=60_000)
        page.screenshot(path=str(ARTIFACTS/"runs.png"), full_page=True)
        # Export: both formats
        page.get_by_role("tab", name="Export").click()
        page.locator("#export-run input").fill("run-1")
        page.locator("#export-run input").press("Enter")
        page.locator("#export").click()
        status("export-status").to_contain_text("wrote run-1-diffusers-fp32.safetensors", timeout=60_000)
        page.locator("#fmt").get_by_text("kohya-style (FLUX: OneTrainer names)").click()   # the honest name
        page.locator("#export").click()
        status("export-status").to_contain_text("wrote run-1-kohya-fp32.safetensors", timeout=60_000)
        page.screenshot(path=str(ARTIFACTS/"export.png"), full_page=True)
        # Generate: two adapters at their weights
        page.get_by_role("tab", name="Generate").click()
        page.locator("#adapters input, #adapters textarea").first.fill("run-1=1.0, run-2=0.5")
        page.locator("#generate").click()
        status("gen-status").to_contain_text("generated with run-1=1.0, run-2=0.5", timeout=120_000)
        expect(page.locator("#samples img").first).to_be_visible()
        page.screenshot(path=str(ARTIFACTS/"generate.png"), full_page=True)
        assert not errors, errors
        browser.close()
    finally:
        pw.stop()
        demo.close()
    assert (tmp_path/"studio"/"exports"/"run-1-kohya-fp32.safetensors").is_file()
    assert demo.studio.run_info("run-1")["state"] == "paused"


def test_course_studio_command(monkeypatch, tmp_path, capsys):
    "`course studio`: --help documents it, 127.0.0.1 and Gradio's port (None: $GRADIO_SERVER_PORT, else 7860) by default."
    import course_lib.cli.studio as studio
    from course_lib.cli import main
    assert main(["studio", "--help"]) == 0
    out = capsys.readouterr().out
    assert all(k in out for k in ("--root", "--host", "--port", "GRADIO_SERVER_PORT", "default 127.0.0.1"))
    assert main(["studio", "--port", "many"]) == 2
    seen = {}

    class Fake:
        def __init__(self, root): self.studio = type("S", (), {"root": root})()
        def launch(self, **kw): seen.update(kw)
    monkeypatch.setattr(studio, "build_studio", Fake)
    assert main(["studio", "--root", str(tmp_path)]) == 0
    assert seen == {"server_name": "127.0.0.1", "server_port": None}
    assert main(["studio", "--root", str(tmp_path), "--host", "0.0.0.0", "--port", "7999"]) == 0
    assert seen == {"server_name": "0.0.0.0", "server_port": 7999}


def test_space_files():
    "space/app.py builds the same app; space/README.md carries the Space's front matter."
    app, readme = (ROOT/"space"/"app.py").read_text(), (ROOT/"space"/"README.md").read_text()
    assert "from course_lib.studio import build_studio" in app and "demo.launch(" in app
    front = readme.split("---")[1]
    for k in ("sdk: gradio", "app_file: app.py", "sdk_version:", "title:"):
        assert k in front, k
    assert "course_lib[studio]" in (ROOT/"space"/"requirements.txt").read_text()
