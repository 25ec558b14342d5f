"""Every `course` subcommand and every option that README.md, a units/*/README.md or `--help` documents runs
on real inputs (the `course` entry point in a subprocess, tiny settings), checked by a value that could be wrong;
every subcommand answers a bad argument with exit code 2 and a message naming the value, never a traceback;
`course freeze` refuses checked outputs that change from run to run.

Already covered elsewhere (not repeated): `course list`, `doctor`, `run UNIT --profile --out` (test_cli.py),
`course site --profile --units --out --executed` (test_site.py), `course new` with its export (test_contrib.py).
Option -> test: see the docstring of each test."""
import json, os, subprocess, sys
from pathlib import Path

import numpy as np
import nbformat
import pytest
from PIL import Image

import course_lib
from course_lib.cli import PLUGINS, main
from course_lib.pile import write_jsonl_zst

ROOT = Path(__file__).resolve().parent.parent
COURSE = [sys.executable, "-c", "import sys; from course_lib.cli.course import main; sys.exit(main())"]
DOCS = [{"text": f"document {i} " * (i + 1), "meta": {"pile_set_name": ["Pile-CC", "Github"][i % 2]}}
        for i in range(7)]


def course(*args, cwd=None, env=None, ok=True):
    "Run `course ARGS` (the entry point's code) in a subprocess; with `ok`, assert exit code 0."
    env = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    r = subprocess.run(COURSE + [str(a) for a in args], capture_output=True, text=True, cwd=cwd or ROOT,
                       env=env, timeout=300)
    if ok: assert r.returncode == 0, f"course {' '.join(map(str, args))}: exit {r.returncode}\n{r.stderr[-3000:]}"
    return r


def bad(capsys, *args, says=()):
    "In-process `course ARGS`: exit code 2, a message on stderr holding each of `says`, no traceback."
    rc = main([str(a) for a in args])
    err = capsys.readouterr().err
    assert rc == 2, f"course {' '.join(map(str, args))}: exit {rc}, stderr: {err}"
    assert "Traceback" not in err, err
    for s in says: assert s in err, f"{s!r} not in: {err}"
    return err


def digit_pngs(folder: Path, images, prefix="") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for i, im in enumerate(images):
        Image.fromarray((im * 255 / 16).astype(np.uint8)).save(folder / f"{prefix}{i:03d}.png")
    return folder


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    "scikit-learn digits as PNG folders: two disjoint sets of 130 (FID) and two class folders of 8 (finetune)."
    from sklearn.datasets import load_digits
    d = load_digits()
    tmp = tmp_path_factory.mktemp("cmd")
    a, b = digit_pngs(tmp / "a", d.images[:130]), digit_pngs(tmp / "b", d.images[130:260])
    classes = tmp / "classes"
    for c in (3, 7): digit_pngs(classes / f"d{c}", d.images[d.target == c][:8])
    return {"tmp": tmp, "a": a, "b": b, "classes": classes}


# ---------------------------------------------------------------- help and version

def test_help_lists_every_command_and_version():
    "`course --help`, `course --version`, `python -m course_lib.cli.course --version`, `course CMD --help` of each plugin."
    r = course("--help")
    for cmd in ["list", "run", "doctor", "freeze", "readme", *PLUGINS]: assert f"  {cmd} " in r.stdout, cmd
    assert course("--version").stdout.strip() == f"course_lib {course_lib.__version__}"
    r = subprocess.run([sys.executable, "-m", "course_lib.cli.course", "--version"], capture_output=True, text=True)
    assert r.stdout.strip() == f"course_lib {course_lib.__version__}", r     # it used to print nothing
    for cmd in PLUGINS:       # one process: each plugin's own parser prints its usage (argparse exits 0)
        assert main([cmd, "--help"]) == 0, cmd


# ---------------------------------------------------------------- course fid (unit 3 README)

def test_fid(data, tmp_path):
    """fid A A --json; A B --extractor digits --isc --kid --kid-subset-size --size --save-stats; A B.npz --json;
    A digits-train (a reference name)."""
    a, b = data["a"], data["b"]
    same = json.loads(course("fid", a, a, "--json").stdout)
    assert abs(same["fid"]) < 1e-6 and same["n_a"] == same["n_b"] == 130
    stats = tmp_path / "b.npz"
    r = course("fid", a, b, "--extractor", "digits", "--isc", "--kid", "--kid-subset-size", "50", "--size", "16",
               "--save-stats", stats)
    lines = dict(l.split(None, 1) for l in r.stdout.splitlines())
    fid_ab = float(lines["FID"].split()[0])
    assert fid_ab > 1 and "A: 130 images, B: 130 images" in lines["FID"], r.stdout
    assert 1 < float(lines["IS"].split()[0]) <= 10 and "KID" in lines
    reuse = json.loads(course("fid", a, stats, "--size", "16", "--json").stdout)
    assert abs(reuse["fid"] - fid_ab) < 1e-3 * fid_ab and reuse["n_b"] == 130   # the stored statistics of B
    ref = course("fid", a, "digits-train").stdout
    assert float(ref.split()[1]) > 0 and "A: 130 images" in ref


def test_fid_bad_arguments(data, tmp_path, capsys, monkeypatch):
    "--weights of a missing file with --extractor inception; --size 0; a missing folder."
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    missing = tmp_path / "nope.pth"
    bad(capsys, "fid", data["a"], data["b"], "--extractor", "inception", "--weights", missing, says=[str(missing)])
    bad(capsys, "fid", data["a"], data["b"], "--size", "0", says=["--size", "0"])
    bad(capsys, "fid", data["a"], tmp_path / "nothing", says=[str(tmp_path / "nothing")])


# ---------------------------------------------------------------- course finetune (unit 5 README)

def test_finetune(data, tmp_path):
    """scratch with --model --strategy --steps --batch-size --lr --layer-decay --img-size --in-chans --valid-frac
    --out --seed --device --progress; then --pretrained (its checkpoint) with --strategy lld."""
    out = tmp_path / "scratch"
    r = course("finetune", data["classes"], "--model", "course_resnet_32", "--strategy", "scratch", "--steps", "2",
               "--batch-size", "4", "--lr", "1e-3", "--layer-decay", "0.5", "--img-size", "32", "--in-chans", "1",
               "--valid-frac", "0.25", "--out", out, "--seed", "1", "--device", "cpu", "--progress")
    m = json.loads((out / "metrics.json").read_text())
    assert m["classes"] == ["d3", "d7"] and (m["n_train"], m["n_valid"]) == (12, 4), m
    assert (m["steps"], m["img_size"], m["in_chans"], m["strategy"]) == (2, 32, 1, "scratch")
    assert f"val acc {m['val_acc']:.3f}" in r.stdout and (out / "model.safetensors").is_file()
    out2 = tmp_path / "lld"
    course("finetune", data["classes"], "--model", "course_resnet_32", "--pretrained", out / "model.safetensors",
           "--strategy", "lld", "--steps", "1", "--out", out2)
    m2 = json.loads((out2 / "metrics.json").read_text())
    assert m2["strategy"] == "lld" and m2["pretrained"] == str(out / "model.safetensors") and m2["in_chans"] == 1


def test_finetune_bad_arguments(data, tmp_path, capsys):
    bad(capsys, "finetune", data["classes"], "--model", "course_resnet_32", "--img-size", "0", says=["--img-size", "0"])
    bad(capsys, "finetune", data["classes"], "--model", "course_resnet_32", "--steps", "-1", says=["-1"])
    bad(capsys, "finetune", data["classes"], "--model", "course_resnet_31", "--steps", "1", says=["course_resnet_31"])


# ---------------------------------------------------------------- course pile (unit 6 README)

def test_pile(tmp_path):
    "stats FILES --json --processes 2; stats --errors skip (table); build-mini OUT --max-mb --max-doc-kb."
    write_jsonl_zst(tmp_path / "s1.jsonl.zst", DOCS[:4])
    write_jsonl_zst(tmp_path / "s2.jsonl.zst", DOCS[4:])
    r = course("pile", "stats", tmp_path / "s1.jsonl.zst", tmp_path / "s2.jsonl.zst", "--json", "--processes", "2")
    rows = {row["pile_set_name"]: row for row in json.loads(r.stdout)["subsets"]}
    assert rows["total"]["docs"] == len(DOCS) and rows["Github"]["docs"] == 3
    assert rows["total"]["bytes"] == sum(len(d["text"].encode()) for d in DOCS)
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\nnot json\n{"text": "ok too"}\n')
    r = course("pile", "stats", tmp_path / "bad.jsonl", "--errors", "skip")
    assert "(1 bad line skipped)" in r.stdout and r.stdout.splitlines()[-2].split()[:2] == ["total", "2"]
    r = course("pile", "build-mini", tmp_path / "mini", "--max-mb", "0.01", "--max-doc-kb", "4")
    for split in ("train", "val", "test"):
        f = tmp_path / "mini" / f"{split}.jsonl.zst"
        assert f.is_file() and f"{f.stat().st_size / 1e6:.2f} MB" in r.stdout
    stats = json.loads(course("pile", "stats", tmp_path / "mini" / "train.jsonl.zst", "--json").stdout)
    manifest = json.loads((tmp_path / "mini" / "manifest.json").read_text())["train"]
    assert {r["pile_set_name"]: (r["docs"], r["bytes"]) for r in stats["subsets"][:-1]} == \
        {k: (v["docs"], v["bytes"]) for k, v in manifest.items()}


def test_pile_bad_arguments(tmp_path, capsys):
    bad(capsys, "pile", "stats", tmp_path / "missing.jsonl.zst", says=["missing.jsonl.zst"])
    bad(capsys, "pile", "stats", tmp_path, "--processes", "0", says=["--processes", "0"])
    bad(capsys, "pile", "build-mini", tmp_path / "m", "--max-mb", "-1", says=["--max-mb", "-1"])
    assert not (tmp_path / "m").exists()


# ---------------------------------------------------------------- course bpb (unit 6 README)

@pytest.fixture(scope="module")
def tiny_lm(tmp_path_factory):
    "A random 2-layer GPT-2 with a BPE tokenizer trained on DOCS, saved as a Hugging Face directory (as test_bpb)."
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    from course_lib.pile import train_bpe_tokenizer
    torch.manual_seed(0)
    tok = train_bpe_tokenizer([d["text"] for d in DOCS] * 3, vocab_size=300)
    cfg = GPT2Config(vocab_size=len(tok), n_positions=32, n_embd=32, n_layer=2, n_head=2,
                     bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    d = tmp_path_factory.mktemp("tiny-lm")
    GPT2LMHeadModel(cfg).save_pretrained(d)
    tok.save_pretrained(d)
    data = d / "docs.jsonl.zst"
    write_jsonl_zst(data, DOCS)
    return d, data


def test_bpb(tiny_lm):
    "--model DIR FILE --window --stride --batch-size --max-docs --compressors --json."
    d, data = tiny_lm
    r = course("bpb", "--model", d, data, "--window", "16", "--stride", "8", "--batch-size", "2", "--max-docs", "5",
               "--compressors", "--json")
    out = json.loads(r.stdout)
    rows = {row["pile_set_name"]: row for row in out["subsets"]}
    assert (out["window"], out["stride"]) == (16, 8)
    assert rows["all"]["docs"] == 5 and rows["all"]["bytes"] == sum(len(x["text"].encode()) for x in DOCS[:5])
    assert 0 < rows["all"]["bpb"] < 30 and set(out["compressors"]) == {"gzip-9", "bz2-9", "lzma-9e", "zstd-19"}


def test_bpb_bad_arguments(tiny_lm, tmp_path, capsys):
    d, data = tiny_lm
    bad(capsys, "bpb", "--model", d, data, "--window", "64", says=["--window 64", "32"])
    bad(capsys, "bpb", "--model", d, data, "--window", "16", "--stride", "20", says=["--stride 20"])
    bad(capsys, "bpb", "--model", tmp_path, data, says=[str(tmp_path), "config.json"])


# ---------------------------------------------------------------- course lora (`course lora --help`)

def test_lora_train_info_generate(tmp_path):
    """train FOLDER OUT --rank --alpha --lr --steps --batch-size --prior-images --trigger --base-steps --log;
    info ADAPTER; generate PROMPT OUT --adapter PATH=WEIGHT --n --seed --steps --base-steps."""
    from course_lib.lora import write_concept_folder
    folder = write_concept_folder(tmp_path / "concept", n=4, pixels=16, trigger="zqx")
    ada = tmp_path / "zqx.safetensors"
    r = course("lora", "train", folder, ada, "--rank", "2", "--alpha", "4", "--lr", "0.01", "--steps", "2",
               "--batch-size", "2", "--prior-images", "2", "--trigger", "zqx", "--base-steps", "2",
               "--log", tmp_path / "log")
    assert f"wrote {ada}" in r.stdout and "after 2 steps" in r.stdout and ada.is_file()
    assert len((tmp_path / "log.csv").read_text().splitlines()) == 3          # header + 2 steps
    meta = json.loads(course("lora", "info", ada).stdout)
    assert (meta["rank"], meta["alpha"], meta["trigger"]) == (2, 4.0, "zqx")
    assert meta["dataset"]["n_images"] == 4 and meta["training_config"]["steps"] == 2
    png = tmp_path / "grid.png"
    course("lora", "generate", "a photo of zqx digit", png, "--adapter", f"{ada}=0.5", "--n", "2", "--seed", "1",
           "--steps", "2", "--base-steps", "2")
    with Image.open(png) as im: w, h = im.size
    assert h == 40 and w == 76, im.size        # 2 images of 16 px, upscaled 4x, in one row with padding


def test_lora_bad_arguments(tmp_path, capsys):
    (tmp_path / "fake.safetensors").write_text("not an adapter")
    bad(capsys, "lora", "info", tmp_path / "fake.safetensors", says=["fake.safetensors", "not a safetensors file"])
    bad(capsys, "lora", "generate", "digit three", tmp_path / "x.png", "--steps", "0", "--base-steps", "2",
        says=["--steps 0"])
    bad(capsys, "lora", "train", tmp_path / "none", tmp_path / "o.safetensors", "--base-steps", "2",
        says=[str(tmp_path / "none")])


# ---------------------------------------------------------------- course new, readme, run --timeout, freeze

def small_project(tmp: Path) -> Path:
    "A course with unit 0 (one notebook), the notebook template and an index notebook for `course readme`."
    for d in ["nbs", "course_lib", "units/00_start", "templates"]: (tmp / d).mkdir(parents=True)
    (tmp / "templates" / "notebook.ipynb").write_bytes((ROOT / "templates" / "notebook.ipynb").read_bytes())
    (tmp / "nbs" / "03_getting_started.ipynb").write_text("{}")
    (tmp / "course_lib" / "core.py").write_text("")
    (tmp / "course_lib" / "course").mkdir()             # the subpackage `course new --module course.x` exports into
    (tmp / "course_lib" / "course" / "__init__.py").write_text("")
    (tmp / "units" / "00_start" / "unit.toml").write_text('[unit]\nnotebooks = ["03_getting_started.ipynb"]\n')
    return tmp


def test_new_and_readme(tmp_path):
    "new NOTEBOOK --unit --title --module --no-export; readme."
    proj = small_project(tmp_path / "proj")
    env = {"COURSE_LIB_ROOT": str(proj)}
    r = course("new", "04_my_lesson", "--unit", "0", "--title", "A lesson", "--module", "course.mine", "--no-export",
               env=env)
    assert "exports course_lib/course/mine.py" in r.stdout and not (proj / "course_lib" / "course" / "mine.py").exists()
    nb = nbformat.read(proj / "nbs" / "04_my_lesson.ipynb", as_version=4)
    assert nb.cells[0].source.startswith("# A lesson") and any("#| default_exp course.mine" in c.source for c in nb.cells)
    assert "04_my_lesson.ipynb" in (proj / "units" / "00_start" / "unit.toml").read_text()
    index = nbformat.v4.new_notebook()
    index.cells = [nbformat.v4.new_markdown_cell("# My course\n\nSome words."), nbformat.v4.new_code_cell("!course list")]
    nbformat.write(index, proj / "nbs" / "index.ipynb")
    r = course("readme", env=env)
    assert r.stdout.strip() == f"wrote {proj / 'README.md'}"
    assert "Some words.\n\n```sh\ncourse list\n```" in (proj / "README.md").read_text()


def test_readme_and_freeze_bad_arguments(tmp_path):
    "In a subprocess: no nbs/index.ipynb for `readme`, a missing notebook for `freeze` (both raised before)."
    proj = small_project(tmp_path / "proj")
    for args, says in [(["readme"], "index.ipynb"), (["freeze", proj / "nbs" / "nope.ipynb"], "nope.ipynb")]:
        r = course(*args, env={"COURSE_LIB_ROOT": str(proj)}, ok=False)
        assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_core_commands_bad_arguments(capsys):
    "list, doctor, run, new and site, in process."
    bad(capsys, "list", "extra", says=["extra"])
    bad(capsys, "doctor", "--bogus", says=["--bogus"])
    bad(capsys, "run", "no-such-unit", "--timeout", "0", says=["--timeout", "0"])   # checked before the unit
    bad(capsys, "new", "first", "--unit", "0", says=["'first'"])
    bad(capsys, "site", "--units", "no-such-unit", says=["no-such-unit"])


def tiny_project(tmp: Path, notebooks: dict[str, list[str]]) -> Path:
    "A course with unit 07_tiny: `notebooks` {name: cell sources}, a `steps` parameter (quick 3, full 30)."
    (tmp / "nbs").mkdir(parents=True)
    (tmp / "units" / "07_tiny").mkdir(parents=True)
    for name, cells in notebooks.items():
        nb = nbformat.v4.new_notebook()
        nb.metadata["kernelspec"] = {"name": "python3", "language": "python", "display_name": "Python 3"}
        p = nbformat.v4.new_code_cell("steps = 1000")
        p.metadata["tags"] = ["parameters"]
        nb.cells = [p] + [nbformat.v4.new_code_cell(c) for c in cells]
        nbformat.write(nb, tmp / "nbs" / name)
    names = ", ".join(f'"{n}"' for n in notebooks)
    (tmp / "units" / "07_tiny" / "unit.toml").write_text(
        f'[unit]\nnotebooks = [{names}]\n[profiles.quick]\nsteps = 3\n[profiles.full]\nsteps = 30\n')
    return tmp


def test_run_all_with_timeout(tmp_path):
    "run all --timeout: a cell over the timeout is reported like a failing cell (it used to end in a traceback)."
    proj = tiny_project(tmp_path / "proj", {"a.ipynb": ["x = steps"], "b.ipynb": ["import time\ntime.sleep(30)"]})
    out = tmp_path / "out"
    r = course("run", "all", "--timeout", "2", "--out", out, env={"COURSE_LIB_ROOT": str(proj)}, ok=False)
    assert r.returncode == 1, r.stderr[-3000:]
    assert "FAILED: 07_tiny/b.ipynb, cell 1: CellTimeoutError" in r.stdout and "(2 s)" in r.stdout, r.stdout
    times = json.loads((out / "timings.json").read_text())
    assert times["a"]["status"] == "ok" and times["b"] == {"status": "failed", "cell": 1}


def test_freeze_keeps_stable_outputs_and_refuses_unstable_ones(tmp_path):
    """freeze NOTEBOOK... --profile full: a stable checked output is stored (from the full profile); a checked
    output with a memory address is refused, naming the notebook, the cell and the text, and the file is kept."""
    proj = tiny_project(tmp_path / "proj", {
        "good.ipynb": ["# NBVAL_CHECK_OUTPUT\nprint(steps)", "print('not checked')"],
        "addr.ipynb": ["# NBVAL_CHECK_OUTPUT\nprint(object())"]})
    good, addr = proj / "nbs" / "good.ipynb", proj / "nbs" / "addr.ipynb"
    before = addr.read_bytes()
    r = course("freeze", good, addr, "--profile", "full", env={"COURSE_LIB_ROOT": str(proj)}, ok=False)
    assert r.returncode == 1 and f"froze {good}" in r.stdout, r.stdout + r.stderr
    cells = nbformat.read(good, as_version=4).cells
    assert [o.text for o in cells[1].outputs] == ["30\n"] and cells[2].outputs == []
    assert "addr.ipynb: cell 1" in r.stderr and "<object object at 0x" in r.stderr and "memory address" in r.stderr
    assert "Traceback" not in r.stderr and addr.read_bytes() == before


@pytest.mark.parametrize("text,kind", [
    ("<__main__.Model object at 0x7f3a2c1d0e50>\n", "a memory address"),
    ("<Figure size 640x480 with 1 Axes>", "a figure's repr"),
    ("trained in 1.23 s\n", "a timing"), ("100%|##| 10/10 [00:01<00:00, 9.52it/s]\n", "a timing"),
    ("steps 30, loss 0.5, 12 samples\n", None)])
def test_unstable_outputs(text, kind):
    "What freeze refuses: addresses, figure reprs and timings, in stdout or in a text/plain result; not plain figures."
    from course_lib.cli import unstable_outputs
    nb = nbformat.v4.new_notebook()
    c = nbformat.v4.new_code_cell("# NBVAL_CHECK_OUTPUT\nx")
    c.outputs = [nbformat.v4.new_output("execute_result", data={"text/plain": text}, execution_count=1)]
    plain = nbformat.v4.new_code_cell("x")
    plain.outputs = [nbformat.v4.new_output("stream", name="stdout", text=text)]
    nb.cells = [plain, c]
    assert unstable_outputs(nb) == ([(1, kind, text.strip())] if kind else [])
