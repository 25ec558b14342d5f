"""A unit README's figures come from a recorded run: `course readme UNIT --results PATH` stores the run
(units/NN_unit/results-PROFILE.json) and renders the table between markers; the README must equal what its stored
results render to, and no figure is typed into a table by hand."""
import json, os, subprocess, sys
from pathlib import Path

import nbformat
import pytest

from course_lib.course import load_units
from course_lib.course import (
    recorded_run, readme_regions, render_readme, hand_typed_figures, format_value, write_figures,
    stored_results, typed_prose_figures)
from course_lib.course.readme_prose import render_inline_figures

ROOT = Path(__file__).resolve().parent.parent
LESSONS = [u for u in load_units(ROOT) if not u.is_library]


def course(*args, env=None):
    return subprocess.run([sys.executable, "-c", "import sys; from course_lib.cli.course import main; sys.exit(main())", *args],
                          capture_output=True, text=True, env=env or os.environ.copy(), cwd=ROOT, timeout=600)


@pytest.mark.parametrize("unit", LESSONS, ids=lambda u: u.name)
def test_readme_figures_are_its_stored_results(unit):
    text = (unit.path / "README.md").read_text()
    regions = readme_regions(text)
    assert regions, (f"{unit.path / 'README.md'} has no table of figures rendered from a recorded run: "
                     f"`course run {unit.slug}` then `course readme {unit.slug} --results runs/{unit.slug}-PROFILE`")
    for _, _, name in regions:
        stored = json.loads((unit.path / name).read_text())
        assert stored["profile"] in name and stored["date"] and stored["machine"], (name, stored.keys())
        assert set(stored["notebooks"]) <= {nb.stem for nb in unit.notebooks}, (name, list(stored["notebooks"]))
    assert render_readme(unit, text) == text, \
        f"{unit.path / 'README.md'}: its figures differ from the stored results: run `course readme {unit.slug}`"
    assert hand_typed_figures(unit, text) == [], f"{unit.path / 'README.md'}: figures typed by hand"


ALL_UNITS = load_units(ROOT)
@pytest.mark.parametrize("unit", ALL_UNITS, ids=lambda u: u.path.name)
def test_readme_prose_types_no_figure(unit):
    typed = typed_prose_figures((unit.path / "README.md").read_text())
    assert not typed, (f"{unit.path / 'README.md'} types {len(typed)} figure(s) into its prose: render each from the "
                       "recorded run with a marker `<!-- fig full NOTEBOOK FIGURE -->value<!-- /fig -->` (`course "
                       "readme` fills it), or give its source with `<!-- cited: ... -->` in the same paragraph:\n"
                       + "\n".join(typed[:15]))


def test_prose_markers_render_from_the_stored_run_and_name_a_missing_figure(tmp_path):
    u = tiny_unit(tmp_path, {"a": {"fid": 1.18356, "by": {"x@2": 0.5}}})
    (u.path / "results-quick.json").write_text(json.dumps(
        {"profile": "quick", "date": "d", "machine": "m", "notebooks": {"a": {"fid": 1.18356, "by": {"x@2": 0.5}}}}))
    text = ("FID <!-- fig quick a fid :.2f -->9<!-- /fig --> and <!-- fig quick a by/x@2 :.0% -->?<!-- /fig -->.")
    assert render_readme(u, text) == ("FID <!-- fig quick a fid :.2f -->1.18<!-- /fig --> and "
                                      "<!-- fig quick a by/x@2 :.0% -->50%<!-- /fig -->.")
    with pytest.raises(ValueError, match="names a figure the quick run did not record: a has"):
        render_readme(u, "<!-- fig quick a kid -->1<!-- /fig -->")
    with pytest.raises(ValueError, match="names the 'full' run, but results-full.json does not exist"):
        render_readme(u, "<!-- fig full a fid -->1<!-- /fig -->")
    assert typed_prose_figures(text) == [] and typed_prose_figures("FID 1.18 here.") != []
    rows = {"a": {"table": [{"bytes": 98000}, {"bytes": 52936}]}}
    assert render_inline_figures("<!-- fig full a table/1/bytes :, -->?<!-- /fig -->", lambda p: {"notebooks": rows}) \
        == "<!-- fig full a table/1/bytes :, -->52,936<!-- /fig -->"
    with pytest.raises(ValueError, match="did not record"):
        render_inline_figures("<!-- fig full a table/2/bytes -->?<!-- /fig -->", lambda p: {"notebooks": rows})
    flat = {"notebooks": {"a": {"bpb/gzip-9/all": 1.8781}}}
    assert render_inline_figures("<!-- fig full a bpb/gzip-9/all :.3f -->?<!-- /fig -->", lambda p: flat) \
        == "<!-- fig full a bpb/gzip-9/all :.3f -->1.878<!-- /fig -->"
    spaced = {"notebooks": {"a": {"bpb/gzip-9/PyPI READMEs": 2.5189}}}
    assert render_inline_figures('<!-- fig full a "bpb/gzip-9/PyPI READMEs" :.2f -->?<!-- /fig -->', lambda p: spaced) \
        == '<!-- fig full a "bpb/gzip-9/PyPI READMEs" :.2f -->2.52<!-- /fig -->'


def tiny_unit(tmp: Path, figures: dict):
    "A unit folder with one notebook `a`, and a `course run` folder whose results.json holds `figures`."
    (tmp / "units" / "07_tiny").mkdir(parents=True); (tmp / "nbs").mkdir(); (tmp / "run").mkdir()
    n = nbformat.v4.new_notebook()
    p = nbformat.v4.new_code_cell("steps = 1000"); p.metadata["tags"] = ["parameters"]
    n.cells = [p, nbformat.v4.new_code_cell("from course_lib.core.basics import record\nrecord('steps_seen', steps)")]
    nbformat.write(n, tmp / "nbs" / "a.ipynb")
    (tmp / "units" / "07_tiny" / "unit.toml").write_text(
        '[unit]\ntitle = "Tiny"\nnotebooks = ["a.ipynb"]\n[profiles.quick]\nsteps = 3\n[profiles.full]\nsteps = 30\n')
    (tmp / "units" / "07_tiny" / "README.md").write_text("# Tiny\n\nSome prose.\n")
    (tmp / "run" / "results.json").write_text(json.dumps(figures))
    return load_units(tmp)[0]


def test_recorded_run_needs_profile_date_and_machine(tmp_path):
    u = tiny_unit(tmp_path, {"a": {"fid": 1.18356}, "other": {"x": 1}})
    with pytest.raises(ValueError, match="lacks profile, date, machine: give --profile ... --date ... --machine"):
        recorded_run(u, tmp_path / "run")
    run = recorded_run(u, tmp_path / "run" / "results.json", profile="quick", date="2026-12-01", machine="a laptop")
    assert run["notebooks"] == {"a": {"fid": 1.18356}}          # another unit's notebook is left out
    (tmp_path / "run" / "run.json").write_text(json.dumps({"profile": "full", "date": "d", "machine": "m"}))
    with pytest.raises(ValueError, match="says profile = 'full', not 'quick'"):
        recorded_run(u, tmp_path / "run", profile="quick")
    with pytest.raises(ValueError, match="holds no figure of unit 'tiny'"):
        (tmp_path / "run" / "results.json").write_text(json.dumps({"other": {"x": 1}}))
        recorded_run(u, tmp_path / "run")


def test_format_value():
    assert format_value(1.18356) == "1.184" and format_value(64) == "64" and format_value(True) == "True"
    assert format_value([0.5, 0.25]) == "0.5 / 0.25" and format_value({"w1": 0.7}) == "w1: 0.7"
    assert format_value("a|b") == "a\\|b"
    assert format_value(list(range(100)), width=20).endswith("…") and len(format_value(list(range(100)), width=20)) == 20


def test_course_run_then_readme_renders_and_checks(tmp_path):
    u = tiny_unit(tmp_path / "proj", {})
    env = dict(os.environ, COURSE_LIB_ROOT=str(tmp_path / "proj"))
    out = tmp_path / "out"
    r = course("run", "tiny", "--profile", "quick", "--out", str(out), env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    info = json.loads((out / "run.json").read_text())
    assert info["profile"] == "quick" and info["date"].startswith("20") and "CPU" in info["machine"]
    r = course("readme", "tiny", "--results", str(out / "results.json"), env=env)
    assert r.returncode == 0, r.stderr
    readme = u.path / "README.md"
    text = readme.read_text()
    assert text.startswith("# Tiny\n\nSome prose.\n")
    assert "| a | `steps_seen` | 3 |" in text and "Figures of a recorded by `course run` with the quick profile" in text
    assert info["date"] in text and info["machine"] in text
    stored = json.loads(stored_results(u, "quick").read_text())
    assert stored["notebooks"] == {"a": {"steps_seen": 3}} and stored["profile"] == "quick"
    assert course("readme", "tiny", "--check", env=env).returncode == 0
    readme.write_text(text.replace("| 3 |", "| 4 |"))                   # an edited figure
    r = course("readme", "tiny", "--check", env=env)
    assert r.returncode == 1 and "differ from the stored results" in r.stderr
    assert course("readme", "tiny", env=env).returncode == 0 and readme.read_text() == text   # rendered again
    readme.write_text(text + "\n| notebook | figure | value |\n|---|---|---|\n| a | `steps_seen` | 3.0 |\n")
    r = course("readme", "tiny", "--check", env=env)
    assert r.returncode == 1 and "a figure typed by hand: | a | `steps_seen` | 3.0 |" in r.stderr


def test_a_new_run_replaces_the_region_of_its_profile(tmp_path):
    u = tiny_unit(tmp_path, {"a": {"fid": 1.174}})
    write_figures(u, tmp_path / "run", profile="quick", date="2026-11-30", machine="m1")
    (tmp_path / "run" / "results.json").write_text(json.dumps({"a": {"fid": 1.184}}))
    write_figures(u, tmp_path / "run", profile="full", date="2026-12-01", machine="m2")
    text = (u.path / "README.md").read_text()
    assert [r[2] for r in readme_regions(text)] == ["results-quick.json", "results-full.json"]
    assert "full profile (the lesson as meant)" in text and "on 2026-12-01, on m2" in text
    (tmp_path / "run" / "results.json").write_text(json.dumps({"a": {"fid": 1.19}}))
    write_figures(u, tmp_path / "run", profile="quick", date="2026-12-02", machine="m3")
    text = (u.path / "README.md").read_text()
    assert [r[2] for r in readme_regions(text)] == ["results-quick.json", "results-full.json"]
    assert "1.19 |" in text and "1.184 |" in text and "1.174" not in text and "m1" not in text
    assert text.count("## Figures of a recorded run") == 1 and render_readme(u, text) == text


def test_hand_typed_figures_spares_meaning_tables(tmp_path):
    u = tiny_unit(tmp_path, {"a": {"fid": 1.174, "n": 64}})
    write_figures(u, tmp_path / "run", profile="quick", date="2026-12-01", machine="m")
    text = (u.path / "README.md").read_text()
    meaning = "| figure | notebook | meaning |\n|---|---|---|\n| `fid` | 30 | FID of validation against training digits |\n"
    assert hand_typed_figures(u, text + meaning) == []                 # a notebook's number is not a figure
    typed = "| `fid` / `n` | **1.174** / 64 |\n"
    assert hand_typed_figures(u, text + typed) == [typed.strip()]


def test_the_readme_gives_each_notebooks_time_and_the_cache_it_ran_from(tmp_path):
    "A unit's times come from the recorded run too (timings.json), with the cache and load they ran at."
    u = tiny_unit(tmp_path / "proj", {})
    home = tmp_path / "home"
    env = dict(os.environ, COURSE_LIB_ROOT=str(tmp_path / "proj"), COURSE_LIB_HOME=str(home))
    out = tmp_path / "out"
    assert course("run", "tiny", "--profile", "quick", "--out", str(out), env=env).returncode == 0
    info = json.loads((out / "run.json").read_text())
    assert info["cache"] == "empty" and isinstance(info["load"], float)
    secs = json.loads((out / "timings.json").read_text())["a"]["seconds"]
    run = recorded_run(u, out)
    assert run["seconds"] == {"a": secs} and secs > 0
    write_figures(u, out)
    text = (u.path / "README.md").read_text()
    assert f"Wall time of this run (course cache at the start: empty, load average {info['load']:g}): " \
           f"a {secs / 60:.1f} min, **{secs / 60:.1f} min** in all." in text
    assert render_readme(u, text) == text                                # rendered again from the stored run
    (home / "models").mkdir(parents=True)
    (home / "models" / "m.safetensors").write_bytes(b"x")
    assert course("run", "tiny", "--profile", "quick", "--out", str(out), env=env).returncode == 0
    assert json.loads((out / "run.json").read_text())["cache"] == "1 file"
    json.dump({"a": {"status": "failed", "cell": 1}}, (out / "timings.json").open("w"))
    assert "seconds" not in recorded_run(u, out)                           # only notebooks that ran to the end


def test_course_run_and_the_readme_say_which_bars_hold(tmp_path):
    "`course run` checks the bars of its profile after each notebook; the README counts them for its run."
    u = tiny_unit(tmp_path / "proj", {})
    toml = u.path / "unit.toml"
    toml.write_text(toml.read_text() + '[bars.quick."a"]\nsteps_seen = ">= 3"\n')
    env = dict(os.environ, COURSE_LIB_ROOT=str(tmp_path / "proj"), COURSE_LIB_HOME=str(tmp_path / "home"))
    out = tmp_path / "out"
    r = course("run", "tiny", "--profile", "quick", "--out", str(out), env=env)
    assert r.returncode == 0 and "bars (quick): 1 of 1 met" in r.stdout, r.stdout + r.stderr
    write_figures(u, out)
    assert "**1 of 1 met**." in (u.path / "README.md").read_text()
    toml.write_text(toml.read_text() + 'other = "< 1"\n')
    r = course("run", "tiny", "--profile", "quick", "--out", str(out), env=env)
    assert "bars (quick): 1 of 2 met" in r.stdout and "MISSED 07_tiny/a: the notebook recorded no figure 'other'" in r.stdout
    toml.write_text(toml.read_text().replace('">= 3"', '">= 4"'))
    r = course("run", "tiny", "--profile", "quick", "--out", str(out), env=env)
    assert "MISSED 07_tiny/a: steps_seen = 3 misses the bar >= 4" in r.stdout, r.stdout
    write_figures(u, out)
    text = (u.path / "README.md").read_text()
    assert "**0 of 2 met**.\n- missed: a: steps_seen = 3 misses the bar >= 4" in text
    assert "- missed: a: the notebook recorded no figure 'other'" in text and render_readme(u, text) == text


def test_a_second_run_that_finds_everything_cached_is_stored_apart_and_timed(tmp_path):
    """`course run` keeps how many files each notebook added to the course cache; a unit's run that added none to
    a non-empty cache is its cached (second) run: `course readme --results RUN --cached` checks that, stores it in
    results-PROFILE-cached.json, leaves the README's figures as the first run's, and the Time block gives its
    time beside the first run's. A run that added files is refused as a cached run."""
    from course_lib.course import time_block
    u = tiny_unit(tmp_path / "proj", {})
    nb = nbformat.read(tmp_path / "proj" / "nbs" / "a.ipynb", as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell(
        "from course_lib.core.basics import cache_dir\n"
        "p = cache_dir() / 'tiny' / 'model.bin'\n"
        "if not p.exists():\n    p.parent.mkdir(parents=True, exist_ok=True); p.write_bytes(b'weights')"))
    nbformat.write(nb, tmp_path / "proj" / "nbs" / "a.ipynb")
    env = dict(os.environ, COURSE_LIB_ROOT=str(tmp_path / "proj"), COURSE_LIB_HOME=str(tmp_path / "home"))
    cold, warm = tmp_path / "cold", tmp_path / "warm"
    for out in (cold, warm):
        r = course("run", "tiny", "--profile", "quick", "--out", str(out), env=env)
        assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads((cold / "timings.json").read_text())["a"]["cache_added"] == 1
    assert json.loads((warm / "timings.json").read_text())["a"]["cache_added"] == 0
    assert "cached" not in recorded_run(u, cold) and recorded_run(u, warm, cached=True)["cached"] is True
    with pytest.raises(ValueError, match="is not a cached run: the course cache was empty at its start"):
        recorded_run(u, cold, cached=True)
    (tmp_path / "home" / "tiny" / "model.bin").unlink()                    # the cache not empty, the model gone
    (tmp_path / "home" / "other.txt").write_text("x")
    rebuilt = tmp_path / "rebuilt"
    assert course("run", "tiny", "--profile", "quick", "--out", str(rebuilt), env=env).returncode == 0
    r = course("readme", "tiny", "--results", str(rebuilt), "--cached", env=env)
    assert r.returncode == 2 and "is not a cached run: a added 1 file(s) to the course cache" in r.stderr
    assert not stored_results(u, "quick", cached=True).exists()
    assert course("readme", "tiny", "--results", str(cold), env=env).returncode == 0
    readme = (u.path / "README.md").read_text()
    first = stored_results(u, "quick").read_text()
    r = course("readme", "tiny", "--results", str(warm), "--cached", env=env)
    assert r.returncode == 0, r.stderr
    assert stored_results(u, "quick").read_text() == first                  # the first run stays the README's
    assert (u.path / "README.md").read_text() == readme
    again = json.loads(stored_results(u, "quick", cached=True).read_text())
    assert again["cached"] is True and again["cache"] == "1 file" and again["seconds"]["a"] > 0
    block = time_block(u, "a")
    secs = json.loads(first)["seconds"]["a"]
    from course_lib.course import format_duration
    assert (f"quick profile **{format_duration(secs)}** (run again, the cache full: "
            f"**{format_duration(again['seconds']['a'])}**)") in block
    assert "results-quick-cached.json" in block
    assert course("readme", "tiny", "--check", env=env).returncode == 0
