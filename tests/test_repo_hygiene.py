"""The library is what nbdev_export makes of the notebooks, and the notebooks are clean and small."""
import json, shutil, subprocess, sys
from pathlib import Path

import nbformat
import pytest

from course_lib.cli import is_checked, TEXT_MIMES, write_readme

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "nbs").glob("*.ipynb"))
MAX_BYTES = 100_000


def _tree(d: Path) -> dict:
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*.py"))}


def test_export_in_sync(tmp_path):
    for name in ["settings.ini", "nbs", "course_lib"]:
        src = ROOT / name
        (shutil.copytree if src.is_dir() else shutil.copy)(src, tmp_path / name)
    r = subprocess.run([sys.executable, "-c", "from nbdev.doclinks import nbdev_export; nbdev_export()"],
                       cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    before, after = _tree(ROOT / "course_lib"), _tree(tmp_path / "course_lib")
    changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
    assert not changed, (f"notebooks and library are out of sync: nbdev_export changes {changed}. "
                         "Run `nbdev_export` (or `nbdev_prepare`) and commit nbs/ and course_lib/ together.")


def test_notebooks_clean(tmp_path):
    shutil.copytree(ROOT / "nbs", tmp_path / "nbs")
    shutil.copy(ROOT / "settings.ini", tmp_path / "settings.ini")
    r = subprocess.run([sys.executable, "-c", "from nbdev.clean import nbdev_clean; nbdev_clean()"],
                       cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    dirty = [p.name for p in NOTEBOOKS if p.read_bytes() != (tmp_path / "nbs" / p.name).read_bytes()]
    assert not dirty, f"notebooks not clean (stored metadata or execution counts): {dirty}. Run `nbdev_clean` and commit."


@pytest.mark.parametrize("nb_path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_outputs_only_checked_text(nb_path):
    size = nb_path.stat().st_size
    assert size < MAX_BYTES, f"{nb_path.name} is {size} bytes (limit {MAX_BYTES}): strip outputs with `course freeze nbs/{nb_path.name}`"
    nb = nbformat.read(nb_path, as_version=4)
    for i, c in enumerate(nb.cells):
        if c.cell_type != "code" or not c.outputs: continue
        assert is_checked(c), (f"{nb_path.name} cell {i} has stored outputs but is not marked # NBVAL_CHECK_OUTPUT: "
                               f"run `course freeze nbs/{nb_path.name}` to keep only checked outputs")
        for o in c.outputs:
            assert o.output_type in ("stream", "execute_result", "display_data"), f"{nb_path.name} cell {i}: {o.output_type} output stored"
            if o.output_type == "stream": assert o.name == "stdout", f"{nb_path.name} cell {i}: stderr stored"
            else:
                bad = set(o.get("data", {})) - set(TEXT_MIMES)
                assert not bad, f"{nb_path.name} cell {i} stores {sorted(bad)} output (images/widgets/HTML are not committed)"


@pytest.mark.parametrize("nb_path", [p for p in NOTEBOOKS if p.name != "index.ipynb"], ids=lambda p: p.name)
def test_notebook_conventions(nb_path):
    nb = nbformat.read(nb_path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert any("parameters" in c.metadata.get("tags", []) for c in code), f"{nb_path.name}: no cell tagged 'parameters'"
    assert any("google.colab" in c.source for c in code[:3]), f"{nb_path.name}: the first cells must install course_lib on Colab"
    assert any("seed" in c.source for c in code), f"{nb_path.name}: no seed"


def test_readme_in_sync(tmp_path):
    shutil.copytree(ROOT / "nbs", tmp_path / "nbs")
    (tmp_path / "units").mkdir()
    write_readme(tmp_path)
    assert (tmp_path / "README.md").read_text() == (ROOT / "README.md").read_text(), \
        "README.md is out of date with nbs/index.ipynb: run `course readme` and commit"


def test_readme_python_version_matches_package():
    "The README's 'Python X.Y+' is the package's `min_python` (pip refuses older Pythons with its own message)."
    import configparser, re
    cfg = configparser.ConfigParser(delimiters=["="])
    cfg.read(ROOT / "settings.ini", encoding="utf-8")
    min_python = cfg["DEFAULT"]["min_python"]
    for doc in [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "units").glob("*/README.md"))]:
        for v in re.findall(r"Python (\d+\.\d+)\+", doc.read_text(encoding="utf-8")):
            assert v == min_python, f"{doc.name} says Python {v}+ but settings.ini has min_python = {min_python}"
    assert re.search(rf"Python {re.escape(min_python)}\+", (ROOT / "README.md").read_text()), \
        "README.md does not state the minimum Python version"


def test_readme_lists_every_lesson_unit_and_types_no_unit_count():
    "The README's unit table has a row for each lesson unit (unit 7 was once missing) and no typed count of units."
    import re
    from course_lib.course import load_units
    text = (ROOT / "README.md").read_text()
    rows = {int(n): link for n, link in re.findall(r"^\| (\d+) \| \[[^]]+\]\(units/([^/]+)/README\.md\)", text, re.M)}
    lessons = {u.number: u.name for u in load_units(ROOT) if not u.is_library}
    assert rows == lessons, f"README's unit table {rows} differs from the units {lessons}"
    words = "one two three four five six seven eight nine ten".split()
    typed = re.findall(rf"\b({'|'.join(words)}) units\b", text, re.I)
    assert not typed, f"README types a count of units ({typed}); the table is the count"
