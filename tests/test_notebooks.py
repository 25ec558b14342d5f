"""Every notebook listed in a unit.toml runs top to bottom with the quick profile, under nbval.

nbval (`--nbval-lax`) fails the test when any cell raises (the notebooks' inline checks are asserts) and
compares the output of the cells marked `# NBVAL_CHECK_OUTPUT` with the output committed in the notebook.
After a run, the figures the notebook `record`ed are held to the bars of its unit's `[bars.quick."<notebook>"]`
table (unit.toml), so a method that stops working fails here and not only in the full profile.
One test per notebook, so `pytest -n 2` spreads them over the cores."""
import ast, json, os, re, subprocess, sys
from pathlib import Path

import nbformat
import pytest

from course_lib.course import load_unit, drop_flagged_cells, SKIP_FLAGS, notebook_parameters
from course_lib.core import read_results
from course_lib.course import BAR, check_bars, eval_bound, unit_bars

ROOT = Path(__file__).resolve().parent.parent
UNITS, BROKEN = [], []
for _p in sorted((ROOT / "units").iterdir()):
    if not (_p / "unit.toml").is_file(): continue
    try: UNITS.append(load_unit(_p, ROOT / "nbs"))
    except ValueError as e: BROKEN.append((_p.name, str(e)))   # reported by test_unit_files_valid
CASES = [(u, nb) for u in UNITS for nb in u.notebooks]
# The library's notebooks run several to a Python process (tests/run_in_process.py, execnb's shell, as nbdev_test
# runs them): a kernel of their own costs each about ten seconds of start-up and imports, most of its time, and the
# library has over a hundred of them. The lessons keep a kernel each (nbval), as a learner's Jupyter runs them.
ISOLATED = {"09_device_probe": "it installs the device probe, a setting of the whole process: a kernel of its own"}
IN_PROCESS = [(u, nb) for u, nb in CASES if u.is_library and nb.stem not in ISOLATED]
KERNEL_CASES = [(u, nb) for u, nb in CASES if (u, nb) not in IN_PROCESS]
N_GROUPS = 6                                   # a group takes about a minute: xdist balances them
GROUPS = [IN_PROCESS[i::N_GROUPS] for i in range(N_GROUPS)]
# The quick-profile budget is 2 minutes a notebook on 2 idle cores; the limit here is looser (CI machines are
# shared and two notebooks run at once) so that only a notebook far over budget fails.
BUDGET = int(os.environ.get("COURSE_LIB_NB_BUDGET", "360"))
# Lesson notebooks run under the device probe (tests/test_device_probe.py, course_lib.core.device_probe): the models
# sit on a stand-in CUDA device with CUDA's device rules and CPU values, so a cell that mixes a CPU tensor with
# the model fails here as on a learner's GPU, and the checked outputs still compare (the values are the CPU's).
# COURSE_LIB_NB_PROBE=off runs them on the plain CPU; =mps stands in for an Apple GPU (no float64).
NB_PROBE = os.environ.get("COURSE_LIB_NB_PROBE", "cuda")
# The lessons that run to the end under the probe (each checked with `COURSE_LIB_NB_PROBE=cuda` and plainly); the
# others still run plainly on the CPU here until their device faults are fixed (issue 27).
PROBE_LESSONS = {"03_getting_started", "10_forward_process", "10a_unet", "11_ddpm_training", "12_digits_classifier",
                 "13_sampling", "13a_samplers_by_hand", "20_score_matching", "21_langevin", "22_sde", "23_sde_digits",
                 "30_frechet_distance", "31_is_kid", "32_torch_fidelity", "33_fid_of_ddpm",
                 "40_lora_from_scratch", "41_lora_dataset", "42_lora_training", "43_lora_export",
                 "50_timm_registry", "51_transfer_learning", "52_inference_export",
                 "53_vision_checkpoints", "60_pile_format", "61_bits_per_byte", "62_tiny_gpt2",
                 "70_guidance", "71_flow_matching", "72_flux_mini", "73_flux_lora"}
# COURSE_LIB_NB_PROBE_EXTRA=51_transfer_learning,72_flux_mini tries more lessons under the probe (while fixing them)
PROBE_LESSONS |= {s for s in os.environ.get("COURSE_LIB_NB_PROBE_EXTRA", "").split(",") if s}
# Lessons that may leave the accelerator idle under the probe, and why; every other probed lesson must run
# operations on it (a lesson that trains or samples does that work on the learner's accelerator)
CPU_ONLY = {
    "03_getting_started": "a tour of the course: it trains and samples nothing",
    "10_forward_process": "the forward process on a few images: closed-form arithmetic, no model",
    "20_score_matching": "a 2-D score MLP of a few thousand parameters: too small to keep a GPU busy (it says so)",
    "22_sde": "the solvers on the 2-D toy score model of 20, too small to keep a GPU busy (the lesson says so); "
              "the solvers on images are probed in tests/probe/probe_score.py and run in 23",
    "40_lora_from_scratch": "the LoRA arithmetic on one small linear layer and a parameter count: nothing to speed up",
    "41_lora_dataset": "builds the concept's image set (files and a caption list): no model",
    "50_timm_registry": "the model registry: it builds models and counts parameters and FLOPs, nothing trains",
    "53_vision_checkpoints": "saves and reloads checkpoints (a library notebook): the file format, no training",
    "60_pile_format": "reads and counts jsonl.zst documents: no tensors",
    "61_bits_per_byte": "the BPB arithmetic with compressors and an untrained toy GPT-2 on a few documents; the "
                        "trained model of 62 scores on the accelerator",
}
# Probed lessons that still leave the accelerator idle (their models stay on the CPU): to move onto it (issue 27)
IDLE_TODAY: set[str] = set()


def quick_copy(unit, nb_path: Path, dest: Path) -> Path:
    """The notebook with the quick profile's values injected after its `parameters` cell and the cells flagged
    gpu/net/slow removed (as nbdev_test does), written to `dest`; stored outputs are kept for nbval."""
    nb = nbformat.read(nb_path, as_version=4)
    drop_flagged_cells(nb, set(SKIP_FLAGS))
    params = {k: v for k, v in unit.params(nb_path, "quick").items() if k in notebook_parameters(nb_path)}
    idx = next((i for i, c in enumerate(nb.cells) if "parameters" in c.get("metadata", {}).get("tags", [])), None)
    if params:
        assert idx is not None, f"{nb_path.name} has profile parameters but no cell tagged 'parameters'"
        cell = nbformat.v4.new_code_cell("# Parameters injected by the tests (quick profile)\n" +
                                         "\n".join(f"{k} = {v!r}" for k, v in params.items()))
        cell.metadata["tags"] = ["injected-parameters"]
        nb.cells.insert(idx + 1, cell)
    # nbdev_clean stores no execution counts, and nbval treats a cell without one as never run: number the
    # code cells in the copy so the checked outputs are compared
    for i, c in enumerate(c for c in nb.cells if c.cell_type == "code"):
        c.execution_count = i + 1
    out = dest / nb_path.name
    nbformat.write(nb, out)
    return out


# --- why a notebook failed, from nbval's report -----------------------------------------------------------------
# nbval words both failures "Notebook cell execution failed"; the line under it tells them apart:
# "Cell N: Cell outputs differ" (a # NBVAL_CHECK_OUTPUT cell printed something else) or
# "Cell N: Cell execution caused an exception" (a cell raised; the notebooks' checks are asserts).
ANSI = re.compile(r"\x1b\[[0-9;]*m")
NBVAL_CELL = re.compile(r"Cell \d+: Cell (outputs differ|execution caused an exception)"
                        r"\s*Input:\s*\n(.*?)\n\s*Traceback:", re.S)


def failure_reason(out: str, nb_name: str, slug: str) -> str:
    "What nbval's output `out` says went wrong in notebook `nb_name` of unit `slug`, and what to do about it."
    out = ANSI.sub("", out)
    cells = {"differ": [], "raised": []}
    for m in NBVAL_CELL.finditer(out):
        code = [ln.strip() for ln in m.group(2).splitlines() if ln.strip() and not ln.strip().startswith("#")]
        cells["differ" if m.group(1) == "outputs differ" else "raised"].append(f"`{code[0] if code else '?'}`")
    if cells["differ"] and not cells["raised"]:
        return (f"checked output changed: the output of the cell(s) starting {', '.join(cells['differ'])} "
                f"(# NBVAL_CHECK_OUTPUT) of {nb_name} no longer matches the committed one. If the change is intended, "
                f"store the new output with `course freeze nbs/{nb_name}` and commit it")
    also = f" (and the checked output of {', '.join(cells['differ'])} changed)" if cells["differ"] else ""
    where = f"the cell starting {', '.join(cells['raised'])}" if cells["raised"] else "a cell"
    return (f"{where} of {nb_name} raised under the quick profile{also}. Reproduce with "
            f"`course run {slug} --profile quick` and read the executed notebook under runs/")


# --- the quality bars of a unit: [bars.<profile>."<notebook stem>"] name = "<op> <expression>" -------------------
# (course_lib.course.run_records: `course run` checks them too, and the README tables count them)


@pytest.mark.parametrize("unit,nb", KERNEL_CASES, ids=[f"{u.name}/{nb.name}" for u, nb in KERNEL_CASES])
def test_notebook_runs_quick(unit, nb, tmp_path):
    copy = quick_copy(unit, nb, tmp_path)
    env = dict(os.environ, COURSE_LIB_NOTEBOOK=nb.stem, COURSE_LIB_RESULTS=str(tmp_path / "results.json"),
               COURSE_LIB_ARTIFACTS=str(tmp_path / "artifacts"), PYTHONWARNINGS="ignore")
    probe = NB_PROBE if NB_PROBE != "off" and nb.stem in PROBE_LESSONS else None
    if probe:
        from test_device_probe import probe_env
        env = probe_env(probe, **{k: env[k] for k in ("COURSE_LIB_NOTEBOOK", "COURSE_LIB_RESULTS",
                                                       "COURSE_LIB_ARTIFACTS")},
                        COURSE_LIB_PROBE_LOG=str(tmp_path / "probe.json"),
                        # a GPU with native bf16: the trainers then pick bf16, whose autocast is inert without a
                        # driver (fp16's GradScaler cannot unscale probe tensors); the emulated-bf16 choice (a T4)
                        # is tested in tests/probe/probe_unit1.py
                        COURSE_LIB_PROBE_BF16="native")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "--nbval-lax",
           "--nbval-current-env", f"--nbval-cell-timeout={BUDGET}", str(copy)]
    try:
        r = subprocess.run(cmd, env=env, cwd=str(nb.parent), capture_output=True, text=True, timeout=BUDGET)
    except subprocess.TimeoutExpired:
        pytest.fail(f"notebook {unit.name}/{nb.name} exceeds the quick-profile time budget: still running after "
                    f"{BUDGET} s (budget: 2 minutes on 2 cores). Lower its values in [profiles.quick] of "
                    f"units/{unit.name}/unit.toml, then time it with `course run {unit.slug} --profile quick`.",
                    pytrace=False)
    if r.returncode != 0:
        out = r.stdout + r.stderr
        why = failure_reason(out, nb.name, unit.slug)
        pytest.fail(f"notebook {unit.name}/{nb.name} failed: {why}.\n" + out[-6000:], pytrace=False)
    if probe and nb.stem not in CPU_ONLY and nb.stem not in IDLE_TODAY:
        log = json.loads((tmp_path / "probe.json").read_text()) if (tmp_path / "probe.json").exists() else {}
        assert log.get("ops_on_device", 0) > 0, (
            f"notebook {unit.name}/{nb.name} ran no operation on the {probe} probe device ({log or 'no probe log'}): a "
            f"lesson that trains or samples should do it on the learner's accelerator (or be listed in CPU_ONLY "
            f"with the reason)")
    bars = unit_bars(unit, "quick").get(nb.stem, {})
    figures = read_results(tmp_path / "results.json").get(nb.stem, {})
    bad = check_bars(bars, figures, f"{unit.name}/{nb.stem} (quick profile)")
    if bad:
        pytest.fail(f"a headline figure misses its bar (units/{unit.name}/unit.toml, [bars.quick.\"{nb.stem}\"]; the "
                    f"bounds come from seeds 0-2, see the comments there). Reproduce with "
                    f"`course run {unit.slug} --profile quick`:\n" + "\n".join(bad), pytrace=False)


@pytest.mark.parametrize("group", range(N_GROUPS), ids=[f"library-{i}" for i in range(N_GROUPS)])
def test_library_notebooks_run_quick_in_process(group, tmp_path):
    """Each library notebook of the group runs top to bottom with the quick profile (a cell that raises fails it),
    the output of its `# NBVAL_CHECK_OUTPUT` cells equals the stored one, and it stays within the time budget."""
    cases, copies = GROUPS[group], []
    for unit, nb in cases:
        (tmp_path / nb.stem).mkdir()
        copies.append(str(quick_copy(unit, nb, tmp_path / nb.stem)))
    report = tmp_path / "report.json"
    cmd = [sys.executable, str(ROOT / "tests" / "run_in_process.py"), str(report), *copies]
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    try:
        r = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=2 * BUDGET)
        tail = (r.stdout + r.stderr)[-3000:]
    except subprocess.TimeoutExpired:
        tail = f"the group was still running after {2 * BUDGET} s"
    done = json.loads(report.read_text()) if report.is_file() else {}
    bad = [f"{nb.name} did not finish: {tail}" for _, nb in cases if nb.name not in done]
    for name, res in done.items():
        where = f"reproduce with `python tests/run_in_process.py report.json nbs/{name}` or in Jupyter"
        if res["error"]:
            bad.append(f"{name}: a cell raised under the quick profile ({where}):\n{res['error'][-2500:]}")
        for d in res["differ"]:
            bad.append(f"{name}: checked output changed: the cell starting `{d['starts']}` (# NBVAL_CHECK_OUTPUT) "
                       f"printed {d['now']!r}, stored {d['stored']!r}. If intended: `course freeze nbs/{name}`")
        if res["seconds"] > BUDGET:
            bad.append(f"{name} exceeds the quick-profile time budget: {res['seconds']:.0f} s > {BUDGET} s")
    assert not bad, "\n\n".join(bad)


def test_every_notebook_is_in_a_unit():
    listed = {nb.resolve() for _, nb in CASES}
    nbs = {p.resolve() for p in (ROOT / "nbs").glob("*.ipynb") if p.name != "index.ipynb"}
    missing = sorted(p.name for p in nbs - listed)
    assert not missing, f"notebooks not listed in any units/*/unit.toml (so never tested): {missing}"


@pytest.mark.parametrize("name", [b[0] for b in BROKEN] or ["(all units)"])
def test_unit_files_valid(name):
    errors = [msg for n, msg in BROKEN if n == name]
    assert not errors, errors[0]


def _nbval(tmp_path, name: str, cells) -> str:
    "Run a tiny notebook of `cells` (source, stored stdout or None) under nbval as the notebook test does; its output."
    nb = nbformat.v4.new_notebook()
    for i, (src, stored) in enumerate(cells):
        c = nbformat.v4.new_code_cell(src, execution_count=i + 1)
        if stored is not None: c.outputs = [nbformat.v4.new_output("stream", name="stdout", text=stored)]
        nb.cells.append(c)
    path = tmp_path / name
    nbformat.write(nb, path)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "--nbval-lax",
           "--nbval-current-env", str(path)]
    r = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0, f"{name} should fail under nbval:\n{r.stdout[-2000:]}"
    return r.stdout + r.stderr


def test_failure_reason_tells_changed_output_from_raised_cell(tmp_path):
    changed = _nbval(tmp_path, "changed.ipynb", [("x = 2", None), ("# NBVAL_CHECK_OUTPUT\nprint(x + 1)", "4\n")])
    raised = _nbval(tmp_path, "raised.ipynb", [("x = 2", None), ("assert x == 3, f'x is {x}'", None)])
    why = failure_reason(changed, "changed.ipynb", "ddpm")
    assert why.startswith("checked output changed") and "course freeze nbs/changed.ipynb" in why, why
    assert "`print(x + 1)`" in why, why
    why = failure_reason(raised, "raised.ipynb", "ddpm")
    assert "raised under the quick profile" in why and "course run ddpm --profile quick" in why, why
    assert "the cell starting `assert x == 3, f'x is {x}'`" in why, why
    assert "checked output changed" not in why and "course freeze" not in why, why


def test_check_bars_names_figure_value_and_bound():
    figs = {"lora": 0.30, "base": 0.25, "bpb": 5.1}
    bars = {"lora": ">= base + 0.2", "bpb": "< 8"}
    bad = check_bars(bars, figs, "04_lora/42 (quick profile)")
    assert bad == ["04_lora/42 (quick profile): lora = 0.3 misses the bar >= base + 0.2 = 0.45 (base = 0.25)"], bad
    assert check_bars(bars, dict(figs, lora=0.5), "w") == []
    assert "recorded no figure 'lora'" in check_bars(bars, {"bpb": 5.1}, "w")[0]
    assert "did not record" in check_bars({"bpb": "< 8 * uniform"}, figs, "w")[0]
    assert "is not '<op> <expression>'" in check_bars({"bpb": "8"}, figs, "w")[0]
    assert "is not a number" in check_bars({"best": "> 0"}, {"best": "linear"}, "w")[0]


@pytest.mark.parametrize("unit", UNITS, ids=[u.name for u in UNITS])
@pytest.mark.parametrize("profile", ["quick", "full"])
def test_bars_declared_valid(unit, profile):
    "Every bar names a notebook of its unit and is `<op> <expression>` over numbers and figure names."
    stems = {nb.stem for nb in unit.notebooks}
    for stem, bars in unit_bars(unit, profile).items():
        assert stem in stems, (f"units/{unit.name}/unit.toml: [bars.{profile}.{stem!r}] names no notebook of the unit "
                               f"{sorted(stems)}")
        for name, bound in bars.items():
            m = BAR.match(bound) if isinstance(bound, str) else None
            assert m, f"units/{unit.name}/unit.toml: bar {stem}.{name} = {bound!r} is not a string '<op> <expression>'"
            names = {n.id for n in ast.walk(ast.parse(m.group(2), mode="eval")) if isinstance(n, ast.Name)}
            eval_bound(m.group(2), dict.fromkeys(names, 1.0))


def test_in_process_runner_reports_a_raised_cell_and_a_changed_checked_output(tmp_path):
    "The library's runner (tests/run_in_process.py) fails what nbval fails, and only that."
    def notebook(name, cells):
        nb = nbformat.v4.new_notebook()
        for src, stored in cells:
            c = nbformat.v4.new_code_cell(src)
            if stored is not None: c.outputs = [nbformat.v4.new_output("stream", name="stdout", text=stored)]
            nb.cells.append(c)
        nbformat.write(nb, tmp_path / name)
        return str(tmp_path / name)
    good = notebook("good.ipynb", [("x = 2", None), ("# NBVAL_CHECK_OUTPUT\nprint(x + 1)", "3\n"),
                                   ("print('not checked', id(x))", "other\n"),
                                   ("s = '# NBVAL_CHECK_OUTPUT'\nprint(s)", None)])
    changed = notebook("changed.ipynb", [("x = 2", None), ("# NBVAL_CHECK_OUTPUT\nprint(x + 1)", "4\n")])
    raised = notebook("raised.ipynb", [("x = 2", None), ("assert x == 3, f'x is {x}'", None)])
    report = tmp_path / "report.json"
    subprocess.run([sys.executable, str(ROOT / "tests" / "run_in_process.py"), str(report), good, changed, raised],
                   cwd=ROOT, check=True, timeout=300)
    rep = json.loads(report.read_text())
    assert rep["good.ipynb"]["error"] is None and rep["good.ipynb"]["differ"] == []
    assert rep["changed.ipynb"]["error"] is None
    assert [d["now"] for d in rep["changed.ipynb"]["differ"]] == [[["stdout", "3\n"]]]
    assert "AssertionError" in rep["raised.ipynb"]["error"] and "x is 2" in rep["raised.ipynb"]["error"]
