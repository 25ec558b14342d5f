#!/usr/bin/env python3
"""Run a unit's profile again with other sampling seeds and store each run beside the unit, for its README.

    python tools/seed_runs.py flux --seeds 1 2                # -> units/07_flux/results-quick-seed1.json, -seed2
    python tools/seed_runs.py flux --seeds 1 --profile full

Each run is `course run UNIT --profile PROFILE` (`course_lib.course.run_units`) with the profile's `seed` set to
the seed, and a notebook parameter `seeds` (a list of sampling seeds, as notebook 70's sweep has) moved to the
next block of as many seeds (seed 1 of `seeds = [0, 1]` runs `[2, 3]`), so no two runs share a draw. The models
the notebooks load from the course cache are those of seed 0's run (their configs carry their own seeds); a
notebook that trains with the lesson's `seed` (73's LoRA) trains again. The run's figures go to
`units/UNIT/results-PROFILE-seedN.json` (`course_lib.course.recorded_run`), which a README quotes with a marker
`<!-- fig PROFILE-seedN NOTEBOOK FIGURE -->` (`course readme UNIT` renders it); the run itself to
`runs/UNIT-PROFILE-seedN`."""
from __future__ import annotations

import argparse, copy, json, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def seeded_unit(unit, profile: str, seed: int):
    "A copy of `unit` whose `profile` runs with sampling seed `seed` (and its `seeds` lists moved along)."
    from course_lib.course import notebook_parameters
    u = copy.deepcopy(unit)
    prof = u.profiles[profile]
    prof["seed"] = seed
    for nb in u.notebooks:
        seeds = unit.params(nb, profile).get("seeds")
        if seeds is None and "seeds" in notebook_parameters(nb):
            raise ValueError(f"{nb.name} takes a list `seeds` that the {profile} profile does not set: set it in "
                             "unit.toml, so each seed's run can move it")
        if seeds is not None:
            prof.setdefault(nb.stem, {})["seeds"] = [s + seed * len(seeds) for s in seeds]
    return u


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("unit", help="a unit's slug, number or folder")
    p.add_argument("--seeds", nargs="+", type=int, required=True, help="sampling seeds other than 0")
    p.add_argument("--profile", default="quick", choices=("quick", "full"))
    a = p.parse_args(argv)
    from course_lib.course import find_unit, load_units, recorded_run, run_units
    unit = find_unit(a.unit, load_units(ROOT))
    if 0 in a.seeds:
        p.error("seed 0 is the unit's own run: `course run` it and store it with `course readme`")
    for seed in a.seeds:
        out = ROOT / "runs" / f"{unit.slug}-{a.profile}-seed{seed}"
        if run_units([seeded_unit(unit, a.profile, seed)], a.profile, out) != 0:
            print(f"the {a.profile} run with seed {seed} failed: nothing stored", file=sys.stderr)
            return 1
        dest = unit.path / f"results-{a.profile}-seed{seed}.json"
        run = {**recorded_run(unit, out), "seed": seed}
        tmp = dest.with_suffix(".tmp")
        tmp.write_text(json.dumps(run, indent=1, sort_keys=False) + "\n")
        tmp.replace(dest)
        print(f"stored {dest.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
