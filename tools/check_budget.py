#!/usr/bin/env python3
"""Does the course keep its time budget? Read from the recorded runs, not timed here.

    python tools/check_budget.py [--units-dir units]

The budget (CONTRIBUTING.md): the whole course's full profile within 60 minutes on 2 CPU cores from an empty course
cache, no notebook over 15 minutes in it, and every quick-profile notebook under 2 minutes. The figures are each
unit's recorded runs (`units/NN_*/results-full.json` and `results-quick.json`, written by `course run` and rendered
into the units' READMEs; `tools/time_course.sh` records them all on an idle machine). Prints one line a unit, the
slowest notebooks and the totals, each run's date and load average at its start (a loaded machine inflates a
time), and exits 1 when a limit is missed, naming it."""
from __future__ import annotations

import argparse, json, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FULL_TOTAL_S, FULL_NOTEBOOK_S, QUICK_NOTEBOOK_S = 60 * 60, 15 * 60, 120


def recorded(units_dir: Path, profile: str) -> dict[str, dict]:
    "`{unit folder: results}` of the lesson units' recorded runs of `profile` (the library unit has none)."
    out = {}
    for f in sorted(units_dir.glob(f"*/results-{profile}.json")):
        d = json.loads(f.read_text(encoding="utf-8"))
        if not isinstance(d.get("seconds"), dict):
            raise ValueError(f"{f} has no 'seconds' table of notebook wall times: re-record it with course run")
        out[f.parent.name] = d
    return out


def problems(full: dict[str, dict], quick: dict[str, dict], lesson_units: list[str]) -> list[str]:
    "Each missed limit, in words; empty when the budget is kept."
    bad = [f"unit {u} has no recorded {p} run" for p, runs in (("full", full), ("quick", quick))
           for u in lesson_units if u not in runs]
    total = sum(sum(d["seconds"].values()) for d in full.values())
    if total > FULL_TOTAL_S:
        bad.append(f"the full profile takes {total / 60:.1f} min in all, over {FULL_TOTAL_S / 60:.0f}")
    bad += [f"{u}/{nb} takes {s / 60:.1f} min in the full profile, over {FULL_NOTEBOOK_S / 60:.0f}"
            for u, d in full.items() for nb, s in d["seconds"].items() if s > FULL_NOTEBOOK_S]
    bad += [f"{u}/{nb} takes {s:.0f} s in the quick profile, over {QUICK_NOTEBOOK_S}"
            for u, d in quick.items() for nb, s in d["seconds"].items() if s > QUICK_NOTEBOOK_S]
    return bad


def main(argv=None) -> int:
    a = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a.add_argument("--units-dir", type=Path, default=ROOT / "units")
    args = a.parse_args(argv)
    full, quick = recorded(args.units_dir, "full"), recorded(args.units_dir, "quick")
    lessons = sorted(p.name for p in args.units_dir.iterdir()
                     if (p / "unit.toml").is_file() and not p.name.startswith("99"))
    for u in lessons:
        for prof, runs in (("full", full), ("quick", quick)):
            if u not in runs: continue
            d = runs[u]
            slow = max(d["seconds"].items(), key=lambda kv: kv[1])
            print(f"{u:<12} {prof:<5} {sum(d['seconds'].values()) / 60:5.1f} min  (slowest {slow[0]} "
                  f"{slow[1]:.0f} s; run of {d.get('date', '?')}, load {d.get('load', '?')})")
    for prof, runs in (("full", full), ("quick", quick)):
        print(f"{prof} profile, every unit: {sum(sum(d['seconds'].values()) for d in runs.values()) / 60:.1f} min")
    bad = problems(full, quick, lessons)
    for b in bad: print("over budget:", b)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
