"""Every notebook listed in a unit.toml runs top to bottom with the quick profile, under nbval.

nbval (`--nbval-lax`) fails the test when any cell raises (the notebooks' inline checks are asserts) and
compares the output of the cells marked `# NBVAL_CHECK_OUTPUT` with the output committed in the notebook.
One test per notebook, so `pytest -n 2` spreads them over the cores."""
import os, subprocess, sys, tempfile
from pathlib import Path

import nbformat
import pytest

from course_lib.cli import load_unit, drop_flagged_cells, SKIP_FLAGS, notebook_parameters

ROOT = Path(__file__).resolve().parent.parent
UNITS, BROKEN = [], []
for _p in sorted((ROOT / "units").iterdir()):
    if not (_p / "unit.toml").is_file(): continue
    try: UNITS.append(load_unit(_p, ROOT / "nbs"))
    except ValueError as e: BROKEN.append((_p.name, str(e)))   # reported by test_unit_files_valid
CASES = [(u, nb) for u in UNITS for nb in u.notebooks]
# The quick-profile budget is 2 minutes a notebook on 2 idle cores; the limit here is looser (CI machines are
# shared and two notebooks run at once) so that only a notebook far over budget fails.
BUDGET = int(os.environ.get("COURSE_LIB_NB_BUDGET", "360"))


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


@pytest.mark.parametrize("unit,nb", CASES, ids=[f"{u.name}/{nb.name}" for u, nb in CASES])
def test_notebook_runs_quick(unit, nb, tmp_path):
    copy = quick_copy(unit, nb, tmp_path)
    env = dict(os.environ, COURSE_LIB_NOTEBOOK=nb.stem, COURSE_LIB_RESULTS=str(tmp_path / "results.json"),
               COURSE_LIB_ARTIFACTS=str(tmp_path / "artifacts"), PYTHONWARNINGS="ignore")
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
        if "Cell outputs differ" in out and "Notebook cell execution failed" not in out:
            why = (f"a checked output (# NBVAL_CHECK_OUTPUT) of {nb.name} no longer matches the committed one. If the "
                   f"change is intended, store the new output with `course freeze nbs/{nb.name}` and commit it")
        else:
            why = (f"a cell of {nb.name} raised under the quick profile. Reproduce with "
                   f"`course run {unit.slug} --profile quick` and read the executed notebook under runs/")
        pytest.fail(f"notebook {unit.name}/{nb.name} failed: {why}.\n" + out[-6000:], pytrace=False)


def test_every_notebook_is_in_a_unit():
    listed = {nb.resolve() for _, nb in CASES}
    nbs = {p.resolve() for p in (ROOT / "nbs").glob("*.ipynb") if p.name != "index.ipynb"}
    missing = sorted(p.name for p in nbs - listed)
    assert not missing, f"notebooks not listed in any units/*/unit.toml (so never tested): {missing}"


@pytest.mark.parametrize("name", [b[0] for b in BROKEN] or ["(all units)"])
def test_unit_files_valid(name):
    errors = [msg for n, msg in BROKEN if n == name]
    assert not errors, errors[0]
