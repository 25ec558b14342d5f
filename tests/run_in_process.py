"""Run several notebooks one after another in this one Python process, each in a fresh IPython shell (execnb's
`CaptureShell`, as `nbdev_test` runs them), and write a JSON report: for each notebook whether a cell raised and
whether the output of each `# NBVAL_CHECK_OUTPUT` cell equals the output stored in it (nbval's rule under
`--nbval-lax`: stream text, coalesced per stream, and every non-image output's data).

    python tests/run_in_process.py REPORT.json NOTEBOOK.ipynb...

tests/test_notebooks.py runs the library's notebooks this way, a group at a time: a kernel per notebook costs
about ten seconds of start-up and imports, most of a library notebook's time. Each notebook gets its own
`COURSE_LIB_NOTEBOOK`, `COURSE_LIB_RESULTS` and `COURSE_LIB_ARTIFACTS` (beside its copy) and runs in its folder;
the whole environment is restored after it."""
import json, os, re, sys, time, traceback
from pathlib import Path

IMAGES = ("image/png", "image/jpeg", "image/svg+xml", "application/vnd.jupyter.widget-view+json")
CHECK = "NBVAL_CHECK_OUTPUT"


def checked(source: str) -> bool:
    "nbval's rule: a comment line that is exactly `# NBVAL_CHECK_OUTPUT` marks the cell."
    return any(ln.strip().startswith("#") and ln.strip().lstrip("#").strip() == CHECK for ln in source.splitlines())


def _text(v) -> str:
    return "".join(v) if isinstance(v, list) else str(v)


def comparable(outputs) -> list[tuple[str, str]]:
    "The parts of a cell's outputs that nbval compares: (stream name or MIME type, text), streams coalesced."
    streams, rest = {}, []
    for o in outputs or []:
        kind = o.get("output_type")
        if kind == "stream":
            streams[o.get("name", "stdout")] = streams.get(o.get("name", "stdout"), "") + _text(o.get("text", ""))
        elif kind in ("execute_result", "display_data"):
            rest += [(k, _text(v)) for k, v in sorted(o.get("data", {}).items()) if k not in IMAGES]
        elif kind == "error":
            rest.append(("error", o.get("ename", "") + ": " + o.get("evalue", "")))
    cleaned = {k: re.sub(r"[^\n]*\r(?!\n)", "", v) for k, v in streams.items()}
    return sorted(cleaned.items()) + rest


def run_one(path: Path) -> dict:
    from execnb.nbio import read_nb
    from execnb.shell import CaptureShell
    nb, stored = read_nb(path), {}
    for c in nb.cells:
        if c.cell_type == "code" and checked(c.source):
            stored[c.idx_] = comparable(c.get("outputs", []))
            c.outputs = []
    t0, shell, err = time.time(), CaptureShell(path), None
    cwd = os.getcwd()
    os.chdir(path.parent)
    try:
        shell.run_all(nb, exc_stop=True, preproc=lambda c: c.cell_type != "code")
    except BaseException:                                   # a cell raised: report it, go on with the next notebook
        err = shell.prettytb(fname=path) if shell.exc else traceback.format_exc()
    finally:
        os.chdir(cwd)
        import matplotlib.pyplot as plt
        plt.close("all")
    differ = []
    if err is None:
        for c in nb.cells:
            if c.idx_ in stored and comparable(c.get("outputs", [])) != stored[c.idx_]:
                first = next((ln for ln in c.source.splitlines() if ln.strip() and not ln.startswith("#")), "?")
                differ.append({"cell": c.idx_, "starts": first, "stored": stored[c.idx_],
                               "now": comparable(c.get("outputs", []))})
    return {"seconds": round(time.time() - t0, 2), "error": err, "differ": differ}


def main(report: str, notebooks: list[str]) -> int:
    keep = dict(os.environ)
    out = {}
    for nb in map(Path, notebooks):
        os.environ.update(COURSE_LIB_NOTEBOOK=nb.stem, COURSE_LIB_RESULTS=str(nb.parent / f"{nb.stem}.results.json"),
                          COURSE_LIB_ARTIFACTS=str(nb.parent / f"{nb.stem}.artifacts"))
        out[nb.name] = run_one(nb.resolve())
        os.environ.clear(); os.environ.update(keep)         # a notebook's environment changes end with it
        Path(report).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
