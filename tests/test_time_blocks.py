"""The Time block at the top of each lesson is rendered from the unit's recorded runs (units/NN_unit/results-*.json),
at most three lines between markers, by `course readme UNIT`; `course readme UNIT --check` fails when a block is stale,
missing or typed by hand. Tiny units in tmp_path, and copies of the real lessons (never the lessons themselves)."""
import json, os, re, shutil, subprocess, sys
from dataclasses import replace
from pathlib import Path

import nbformat
import pytest

from course_lib.course import load_units
from course_lib.course import (
    TIME_END, time_block, time_problems, time_regions, typed_time_paragraphs, write_time_blocks)

ROOT = Path(__file__).resolve().parent.parent
LESSONS = [u for u in load_units(ROOT) if not u.is_library]
TYPED = ("**Time.** Measured on a 2-core CPU: quick profile 14 s, full profile 23 s. On a Colab GPU: not measured;\n"
         "estimate about the same. Nothing is trained, so the cache saves nothing.\n<!-- cited: a run of mine -->")
RUN = {"date": "2026-12-01 10:00 UTC", "machine": "Linux, AMD EPYC, 2 CPUs", "course_lib": "0.1.0", "notebooks": {}}


def tiny_unit(tmp: Path, runs: dict[str, dict] | None = None, typed: str = TYPED):
    "A lesson unit `tiny` with notebooks `a` (a typed Time paragraph under its title) and `b`, and stored runs."
    (tmp / "units" / "07_tiny").mkdir(parents=True)
    (tmp / "nbs").mkdir()
    for name in ("a", "b"):
        n = nbformat.v4.new_notebook()
        n.cells = [nbformat.v4.new_markdown_cell(f"# Lesson {name}\n\n{typed}" if name == "a" else "# Lesson b"),
                   nbformat.v4.new_code_cell("x = 1")]
        for i, c in enumerate(n.cells):
            c.id = f"{name}{i}"
        nbformat.write(n, tmp / "nbs" / f"{name}.ipynb")
    (tmp / "units" / "07_tiny" / "unit.toml").write_text('[unit]\ntitle = "Tiny"\nnotebooks = ["a.ipynb", "b.ipynb"]\n')
    runs = {"quick": {"cache": "empty", "seconds": {"a": 14.27, "b": 3.2}},
            "full": {"cache": "21 files", "seconds": {"a": 250.37}}} if runs is None else runs
    for name, r in runs.items():
        profile = name.split("-")[0]
        (tmp / "units" / "07_tiny" / f"results-{name}.json").write_text(json.dumps({**RUN, "profile": profile, **r}))
    return load_units(tmp)[0]


def block_lines(block: str) -> list[str]:
    "The lines between a block's two markers."
    return block.splitlines()[1:-1]


def test_the_block_is_rendered_from_the_recorded_runs(tmp_path):
    u = tiny_unit(tmp_path)
    block = time_block(u, "a")
    assert block == time_block(u, "a")                                     # deterministic
    assert block.endswith(TIME_END) and len(block_lines(block)) <= 3, block
    cpu, gpu, cited = block_lines(block)
    assert cpu == ("**Time.** On a CPU (Linux, AMD EPYC, 2 CPUs): quick profile **14 s** (from an empty course cache), "
                   "full profile **4.2 min** (with 21 files in the course cache).")
    assert gpu == "On a GPU: not measured."
    assert cited.startswith("<!-- cited: units/07_tiny/results-quick.json") and "results-full.json" in cited
    assert "full profile not measured" in time_block(u, "b")               # b has no full run


def test_a_recorded_second_changes_the_block_and_the_old_one_is_stale(tmp_path):
    u = tiny_unit(tmp_path)
    assert write_time_blocks(u) == u.notebooks and time_problems(u) == []
    assert write_time_blocks(u) == []                                      # nothing left to change
    before = time_block(u, "a")
    f = u.path / "results-full.json"
    f.write_text(f.read_text().replace("250.37", "130.1"))
    assert time_block(u, "a") != before and "full profile **2.2 min**" in time_block(u, "a")
    assert time_problems(u) == [f"{u.notebooks[0]}: its Time block differs from the recorded runs "
                                "(run `course readme tiny`)"]


def test_a_gpu_run_gets_its_own_line(tmp_path):
    gpu = {"cache": "empty", "machine": "Linux, AMD EPYC, 16 CPUs, GPU NVIDIA H200", "seconds": {"a": 4.1}}
    u = tiny_unit(tmp_path, {"quick": {"cache": "empty", "seconds": {"a": 14.27}}, "full-gpu": gpu})
    cpu_line, gpu_line, cited = block_lines(time_block(u, "a"))
    assert cpu_line.endswith("quick profile **14 s**, full profile not measured, from an empty course cache.")
    assert gpu_line == ("On a GPU (Linux, AMD EPYC, 16 CPUs, GPU NVIDIA H200): quick profile not measured, "
                        "full profile **4 s**, from an empty course cache.")
    assert "results-full-gpu.json" in cited


def test_a_lesson_no_run_timed_says_so(tmp_path):
    u = tiny_unit(tmp_path, {})
    block = time_block(u, "a")
    assert len(block_lines(block)) <= 3 and "Not measured yet: no recorded run of unit `tiny` timed this" in block
    assert "`course run tiny --profile quick`" in block and "course readme tiny --results runs/tiny-quick" in block


def test_typed_paragraph_is_replaced_and_its_untimed_prose_kept(tmp_path):
    u = tiny_unit(tmp_path)
    write_time_blocks(u)
    a, b = (nbformat.read(nb, as_version=4) for nb in u.notebooks)
    text = a.cells[0].source
    assert text.startswith("# Lesson a\n\n<!-- time: rendered") and typed_time_paragraphs(text) == []
    assert text.endswith(f"{TIME_END}\n\nNothing is trained, so the cache saves nothing.")       # kept as prose
    assert "14 s." not in text and "my run" not in text and "Colab" not in text
    assert b.cells[0].source == "# Lesson b" and time_regions(b.cells[1].source) and len(b.cells) == 3
    assert [c.source for c in a.cells[1:]] == ["x = 1"]                  # nothing else changed


def course(*args, env):
    return subprocess.run([sys.executable, "-c", "import sys; from course_lib.cli.course import main; sys.exit(main())", *args],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)


def test_course_readme_renders_and_check_fails_on_typed_stale_or_missing(tmp_path):
    u = tiny_unit(tmp_path)
    env = dict(os.environ, COURSE_LIB_ROOT=str(tmp_path))
    r = course("readme", "tiny", "--check", env=env)
    assert r.returncode == 1 and "a.ipynb: a Time paragraph typed by hand" in r.stderr, r.stderr
    assert "b.ipynb: no Time block" in r.stderr
    r = course("readme", "all", env=env)
    assert r.returncode == 0 and "a.ipynb (its Time block)" in r.stdout, r.stdout + r.stderr
    assert course("readme", "all", "--check", env=env).returncode == 0
    nb = u.notebooks[0]
    rendered = nb.read_text()
    nb.write_text(rendered.replace("**14 s**", "**12 s**"))                   # a block edited by hand
    r = course("readme", "all", "--check", env=env)
    assert r.returncode == 1 and "a.ipynb: its Time block differs from the recorded runs" in r.stderr
    assert course("readme", "tiny", env=env).returncode == 0 and nb.read_text() == rendered


def test_rendering_copies_of_the_lessons(tmp_path):
    "The real lessons, copied: one block each, at most three lines, cited, and nothing but markdown changed."
    for u in LESSONS:
        (tmp_path / u.name).mkdir()
        for f in u.path.glob("results-*.json"):
            shutil.copy(f, tmp_path / u.name)
        copies = [shutil.copy(nb, tmp_path / nb.name) for nb in u.notebooks]
        cu = replace(u, path=tmp_path / u.name, notebooks=[Path(p) for p in copies])
        write_time_blocks(cu)
        assert time_problems(cu) == [], time_problems(cu)
        for old, new in zip(u.notebooks, cu.notebooks):
            before, after = json.loads(old.read_text()), json.loads(new.read_text())
            code = [[c["source"] for c in n["cells"] if c["cell_type"] == "code"] for n in (before, after)]
            assert code[0] == code[1], new.name
            md = ["".join(c["source"]) for c in after["cells"] if c["cell_type"] == "markdown"]
            blocks = [t[s:e] for t in md for s, e in time_regions(t)]
            assert len(blocks) == 1 and len(block_lines(blocks[0])) <= 3, (new.name, blocks)
            decimal = re.compile(r"(?<![\w.\-/#:])\d+\.\d+(?![\w.])")
            assert not [t for t in md if decimal.search(t) and "<!-- cited:" not in t and "time:" in t], new.name


@pytest.mark.parametrize("unit", LESSONS, ids=lambda u: u.name)
def test_every_lesson_shows_its_rendered_time_block(unit):
    problems = time_problems(unit)
    assert not problems, "\n".join(problems) + f"\n(run `course readme {unit.slug}`)"
