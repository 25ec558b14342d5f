"""Every notebook listed in a unit.toml runs top to bottom with the quick profile, under nbval.

nbval (`--nbval-lax`) fails the test when any cell raises (the notebooks' inline checks are asserts) and
compares the output of the cells marked `# NBVAL_CHECK_OUTPUT` with the output committed in the notebook.
One test per notebook, so `pytest -n 2` spreads them over the cores."""
import os, subprocess, sys, tempfile
from pathlib import Path

import nbformat
import pytest

from course_lib.cli import load_units, drop_flagged_cells, SKIP_FLAGS, notebook_parameters

ROOT = Path(__file__).resolve().parent.parent
UNITS = load_units(ROOT)
CASES = [(u, nb) for u in UNITS for nb in u.notebooks]
TIMEOUT = int(os.environ.get("COURSE_LIB_NB_TIMEOUT", "900"))


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
    out = dest / nb_path.name
    nbformat.write(nb, out)
    return out


@pytest.mark.parametrize("unit,nb", CASES, ids=[f"{u.name}/{nb.name}" for u, nb in CASES])
def test_notebook_runs_quick(unit, nb, tmp_path):
    copy = quick_copy(unit, nb, tmp_path)
    env = dict(os.environ, COURSE_LIB_NOTEBOOK=nb.stem, COURSE_LIB_RESULTS=str(tmp_path / "results.json"),
               COURSE_LIB_ARTIFACTS=str(tmp_path / "artifacts"), PYTHONWARNINGS="ignore")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "--nbval-lax",
           "--nbval-current-env", f"--nbval-cell-timeout={TIMEOUT}", str(copy)]
    r = subprocess.run(cmd, env=env, cwd=str(nb.parent), capture_output=True, text=True, timeout=TIMEOUT + 120)
    if r.returncode != 0:
        pytest.fail(f"notebook {unit.name}/{nb.name} failed under the quick profile: a cell raised or a checked "
                    f"output (# NBVAL_CHECK_OUTPUT) changed. Reproduce with `course run {unit.slug} --profile quick`; "
                    f"if a checked output changed on purpose, refresh it with `course freeze nbs/{nb.name}`.\n"
                    + r.stdout[-6000:] + r.stderr[-2000:], pytrace=False)


def test_every_notebook_is_in_a_unit():
    listed = {nb.resolve() for _, nb in CASES}
    nbs = {p.resolve() for p in (ROOT / "nbs").glob("*.ipynb") if p.name != "index.ipynb"}
    missing = sorted(p.name for p in nbs - listed)
    assert not missing, f"notebooks not listed in any units/*/unit.toml (so never tested): {missing}"
