"""The course's time budget, read from the recorded runs (`tools/check_budget.py`): the whole full profile within an
hour on 2 cores, no notebook over 15 minutes, quick notebooks under 2 minutes. Nothing is timed here."""
import json, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
from check_budget import main, problems, recorded  # noqa: E402


def test_the_recorded_runs_keep_the_budget(capsys):
    assert main([]) == 0, capsys.readouterr().out


def test_the_check_names_what_is_over(tmp_path):
    "A run over each limit, and a unit without a recorded run, are each named."
    runs = (("01_a", {"x": 14 * 60.0, "y": 16 * 60.0}, {"x": 30.0, "y": 119.0}),
            ("02_b", {"z": 15 * 60.0, "w": 15 * 60.0, "v": 7 * 60.0}, {"z": 121.0}))
    for unit, full, quick in runs:
        (tmp_path / unit).mkdir()
        for prof, secs in (("full", full), ("quick", quick)):
            (tmp_path / unit / f"results-{prof}.json").write_text(json.dumps({"seconds": secs, "load": 0.1}))
    bad = problems(recorded(tmp_path, "full"), recorded(tmp_path, "quick"), ["01_a", "02_b", "03_c"])
    assert bad == ["unit 03_c has no recorded full run", "unit 03_c has no recorded quick run",
                   "the full profile takes 67.0 min in all, over 60",
                   "01_a/y takes 16.0 min in the full profile, over 15",
                   "02_b/z takes 121 s in the quick profile, over 120"], bad
