#!/usr/bin/env python3
"""Which quick-profile bars and notebook checks of units 1-3 catch an untrained model.

    python tools/untrained_bars.py [--units ddpm score eval] [--out runs/untrained] [--trained]

Each notebook of the units runs with the quick profile (injected by tests/test_notebooks.py's `quick_copy`), one
after another in this process, each in a fresh IPython shell (execnb's `CaptureShell`), with every optimizer's
step undone: a step hook of torch.optim puts each parameter back to its value before the first step, so every
model the notebooks train (the course's DDPM, 10a's two UNets, the score models, the digits NCSN) keeps its
initialisation with the configuration, batches and number of steps it would have trained with. The judge the
lessons share (the digits classifier, `load_digits_classifier()`) is trained first, before the hook: it is the
measure, not a model under test (notebook 12's quick classifier has the judge's configuration, so it loads that
one). Models and statistics go to a course cache of their own (`OUT/cache`, shipped models off), so nothing
trained is read or overwritten.

Every cell runs even after one raises, so each failing check is listed (an `assert` that raised, or a
`# NBVAL_CHECK_OUTPUT` cell whose output is not the stored one, as the tests compare it); then each bar
of the unit's `[bars.quick."<notebook>"]` (units/*/unit.toml) is checked on the figures the notebook recorded.
A bar meant to judge a model should fail here. `--trained` runs the same without the hook (every bar and check
should then hold). Writes `OUT/report.json` and prints a table; about 3 minutes for units 1-3 on 2 idle cores
(most of it 10a and 13). Not run by the tests: it is the evidence behind the bars."""
from __future__ import annotations

import argparse, json, os, sys, time, warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from run_in_process import checked, comparable   # nbval's rule for `# NBVAL_CHECK_OUTPUT` cells


def freeze_every_optimizer():
    "After every `optimizer.step()`, each parameter it holds is put back to its value before its first step."
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    def params(opt):
        return [p for g in opt.param_groups for p in g["params"]]

    def keep(opt, args, kwargs):
        for p in params(opt):
            if not hasattr(p, "_untrained_value"): p._untrained_value = p.detach().clone()

    @torch.no_grad()
    def undo(opt, args, kwargs):
        for p in params(opt): p.copy_(p._untrained_value)

    return register_optimizer_step_pre_hook(keep), register_optimizer_step_post_hook(undo)


def quick_notebook(unit, nb_path: Path, work: Path):
    "The notebook (execnb's reader) with the quick profile injected as the tests inject it (`quick_copy`)."
    from execnb.nbio import read_nb
    from test_notebooks import quick_copy
    nb = read_nb(quick_copy(unit, nb_path, work))
    for i, c in enumerate(nb.cells): c.idx_ = i
    return nb


def run_notebook(unit, nb_path: Path, out: Path) -> dict:
    "Run every cell of the quick copy (going on after a cell raises); the checks that failed and the figures."
    from execnb.shell import CaptureShell
    from course_lib.core import read_results
    work = out / nb_path.stem
    work.mkdir(parents=True, exist_ok=True)
    results = work / "results.json"
    results.unlink(missing_ok=True)
    keep = dict(os.environ)
    os.environ.update(COURSE_LIB_NOTEBOOK=nb_path.stem, COURSE_LIB_RESULTS=str(results),
                      COURSE_LIB_ARTIFACTS=str(work / "artifacts"))
    nb, shell, failed = quick_notebook(unit, nb_path, work), CaptureShell(nb_path), []
    stored = {c.idx_: comparable(c.get("outputs", [])) for c in nb.cells
              if c.cell_type == "code" and checked(c.source)}
    for c in nb.cells:
        if c.idx_ in stored: c.outputs = []

    def after(cell):
        if cell.cell_type == "code" and shell.exc is not None:
            first = next((ln.strip() for ln in cell.source.splitlines()
                          if ln.strip() and not ln.strip().startswith("#")), "?")
            failed.append({"cell": cell.idx_, "starts": first[:90],
                           "error": f"{type(shell.exc).__name__}: {str(shell.exc)[:200]}"})
            shell.exc = None
        elif cell.idx_ in stored and comparable(cell.get("outputs", [])) != stored[cell.idx_]:
            now = " ".join(text for _, text in comparable(cell.get("outputs", []))).strip()
            failed.append({"cell": cell.idx_, "starts": "# NBVAL_CHECK_OUTPUT",
                           "error": f"checked output changed: {now[:200]!r}"})

    cwd, t0 = os.getcwd(), time.time()
    os.chdir(nb_path.parent)
    try:
        shell.run_all(nb, exc_stop=False, postproc=after)
    finally:
        os.chdir(cwd)
        os.environ.clear(); os.environ.update(keep)
        import matplotlib.pyplot as plt
        plt.close("all")
    figures = read_results(results).get(nb_path.stem, {}) if results.is_file() else {}
    return {"seconds": round(time.time() - t0, 1), "failed_checks": failed, "figures": figures}


def bar_rows(unit, stem: str, figures: dict) -> list[dict]:
    "Each quick bar of the notebook: its figure's value, the bound's value, and whether it holds."
    from course_lib.course import BAR, OPS, eval_bound, unit_bars
    rows = []
    for name, bound in unit_bars(unit, "quick").get(stem, {}).items():
        op, expr = BAR.match(bound).groups()
        if name not in figures:
            rows.append({"bar": f"{name} {bound}", "value": None, "holds": None, "why": "not recorded"})
            continue
        try: limit = eval_bound(expr, figures)
        except KeyError as e:
            rows.append({"bar": f"{name} {bound}", "value": figures[name], "holds": None,
                         "why": f"{e} not recorded"})
            continue
        rows.append({"bar": f"{name} {bound}", "value": figures[name], "limit": round(limit, 4),
                     "holds": bool(OPS[op](figures[name], limit))})
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--units", nargs="+", default=["ddpm", "score", "eval"], help="unit slugs, numbers or folders")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "untrained")
    p.add_argument("--trained", action="store_true", help="no hook: the models train as usual (the baseline)")
    a = p.parse_args(argv)
    out = (a.out / ("trained" if a.trained else "untrained")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    os.environ.update(COURSE_LIB_HOME=str(out / "cache"), COURSE_LIB_NO_PRETRAINED="1")
    warnings.simplefilter("ignore")      # as the tests run them (PYTHONWARNINGS=ignore): checked outputs compare
    from course_lib.course import find_unit, load_units
    from course_lib.ddpm import load_digits_classifier
    units = load_units(ROOT)
    chosen = [find_unit(u, units) for u in a.units]
    print("training the judge (the digits classifier) before any hook ...", flush=True)
    load_digits_classifier()
    if not a.trained: freeze_every_optimizer()
    report = {"models": "trained" if a.trained else "untrained (every optimizer step undone)", "notebooks": {}}
    for unit in chosen:
        for nb_path in unit.notebooks:
            print(f"running {unit.name}/{nb_path.name} ...", flush=True)
            r = run_notebook(unit, nb_path, out)
            r["bars"] = bar_rows(unit, nb_path.stem, r.pop("figures"))
            report["notebooks"][f"{unit.name}/{nb_path.stem}"] = r
            (out / "report.json").write_text(json.dumps(report, indent=1))
    print(f"\nmodels: {report['models']}; report: {out / 'report.json'}")
    for name, r in report["notebooks"].items():
        print(f"\n{name} ({r['seconds']:.0f} s)")
        for b in r["bars"]:
            state = {True: "holds", False: "FAILS", None: "not checked"}[b["holds"]]
            detail = f"value {b['value']}" + (f", bound {b['limit']}" if "limit" in b else f" ({b.get('why')})")
            print(f"  bar   {state:11s} {b['bar']}: {detail}")
        for c in r["failed_checks"]:
            print(f"  check FAILS       cell {c['cell']} `{c['starts']}`: {c['error']}")
        if not r["bars"] and not r["failed_checks"]: print("  no bar; every check held")
    return 0


if __name__ == "__main__":
    sys.exit(main())
