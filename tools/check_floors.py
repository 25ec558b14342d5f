#!/usr/bin/env python3
"""Checks the lower bounds ("floors") of settings.ini's `requirements` for the six packages whose APIs the
lessons follow closely: builds a fresh virtual environment with today's torch/torchvision and EXACTLY the
floor version of diffusers, peft, transformers, timm, accelerate and torch-fidelity (read from settings.ini,
so the check follows the file), the rest of the runtime requirements as declared, and course_lib itself
(`pip install -e . --no-deps`); then imports every course_lib module and runs the tests that exercise those
packages (unit 7, and the LoRA, timm, torch-fidelity and language-model tests). Prints a table
package | floor | installed | result, and exits non-zero when anything fails.

Usage (from anywhere; installs about 4 GB, mostly torch's CUDA wheels, from the machine's wheel folders):

    python tools/check_floors.py                 # fresh venv in ${COURSE_LIB_HOME:-.course-test-cache}/floors-venv
    python tools/check_floors.py --venv DIR      # ... in DIR (deleted and made again)
    python tools/check_floors.py --reuse         # keep an existing venv, only re-pin the packages (fast: for
                                                 # trying another floor after editing settings.ini)

Not part of the default pytest run: it installs packages. Measured on 2 shared cores: a fresh run 4-6 minutes
(3-5 of them installing torch's wheels), a --reuse run about 1.5 minutes; the tests alone take about 50 s.
tests/test_floors.py checks, cheaply, that settings.ini's floors never drop below VERIFIED_FLOORS.
Raise a floor when a lesson starts using a newer API; after lowering one, run this check and update
VERIFIED_FLOORS with what passed."""
from __future__ import annotations

import argparse, configparser, os, re, shutil, subprocess, sys, time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# torch stays at the release on this machine's disk (the project's machines install it from there)
TORCH_PINS = {"torch": "2.14.1", "torchvision": "0.29.1"}

# The floors this check has verified, and the API that needs each (the release where it first appeared).
# tests/test_floors.py fails when settings.ini declares a lower floor than these.
VERIFIED_FLOORS = {
    "diffusers": ("0.36.0", "ClassifierFreeGuidance.forward(...).pred (GuiderOutput, 0.36; 0.35 returns a tuple), "
                            "diffusers.guiders (0.35), save_lora_weights(transformer_lora_adapter_metadata=) "
                            "(0.34); load_flux_lora names its file (weight_name), which diffusers before 0.40 "
                            "needs offline"),
    "peft": ("0.18.0", "peft.functional (inject_adapter_in_model, delete_adapter(prefix=), "
                       "get/set_peft_model_state_dict): new in 0.18; 0.17 also fails to import under transformers 5"),
    "transformers": ("4.56.0", "from_pretrained(dtype=) (4.56); 4.56 and 5.x both pass"),
    "timm": ("1.0.8", "ResNet(channels=...) (course_resnet_32 in vision_registry), new in 1.0.8"),
    "accelerate": ("0.34.0", "Accelerator(cpu=, mixed_precision=), autocast, gather_object: old APIs; 0.34 passes"),
    "torch-fidelity": ("0.4.0", "FeatureExtractorBase.get_default_feature_layer_for_metric (0.3 asks the digits "
                                "extractor for Inception's '2048' features), eigvals FID"),
}
FLOOR_PACKAGES = list(VERIFIED_FLOORS)

# the tests that exercise each package (paths relative to the repository root)
TESTS = {
    "diffusers": ["tests/test_guidance.py", "tests/test_flow.py", "tests/test_flux.py", "tests/test_flux_lora.py"],
    "peft": ["tests/test_lora.py", "tests/test_flux_lora.py"],
    "transformers": ["tests/test_flux.py", "tests/test_flux_lora.py", "tests/test_lm_checkpoints.py",
                     "tests/test_bpb.py"],
    "timm": ["tests/test_vision.py"],
    "accelerate": ["tests/test_flow.py", "tests/test_lora.py", "tests/test_lm_checkpoints.py", "tests/test_bpb.py"],
    "torch-fidelity": ["tests/test_metrics.py"],
}
EXTRA_TESTS = ["tests/test_flow_exercises.py"]      # unit 7, no floor package of its own
# tests that need a [dev] package the floors venv does not install (lm-eval: the harness comparison)
DESELECT = ["tests/test_bpb.py::test_windows_match_the_harness", "tests/test_bpb.py::test_bpb_equals_lm_evaluation_harness"]
TEST_ENV = {"COURSE_LIB_HOME": str(ROOT / ".course-test-cache"), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
            "MPLBACKEND": "Agg", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false", "COURSE_LIB_DEVICE": "cpu"}


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def release(v: str) -> tuple[int, ...]:
    "'0.36' -> (0, 36), '1.0.3' -> (1, 0, 3), trailing zeros dropped (so '0.36' == '0.36.0'), local part ignored."
    parts = [int(x) for x in re.match(r"^\d+(?:\.\d+)*", v.split("+")[0]).group(0).split(".")]
    while len(parts) > 1 and parts[-1] == 0: parts.pop()
    return tuple(parts)


def requirements(settings: Path = ROOT / "settings.ini") -> list[str]:
    "The `requirements` of settings.ini, one specifier string each."
    cfg = configparser.ConfigParser(delimiters=["="], interpolation=None)
    cfg.read(settings, encoding="utf-8")
    return cfg["DEFAULT"].get("requirements", "").split()


def floors(settings: Path = ROOT / "settings.ini") -> dict[str, str]:
    """{package: floor} for FLOOR_PACKAGES, the version of each one's `>=` in settings.ini's requirements.
    Raises ValueError for a package without one."""
    found = {}
    for req in requirements(settings):
        m = re.match(r"^([A-Za-z0-9._-]+)(.*)$", req)
        name, spec = norm(m.group(1)), m.group(2)
        if name in FLOOR_PACKAGES:
            lo = re.search(r">=\s*([0-9][^,;\s]*)", spec)
            if not lo: raise ValueError(f"settings.ini: {req!r} has no '>=' floor")
            found[name] = lo.group(1)
    missing = [p for p in FLOOR_PACKAGES if p not in found]
    if missing: raise ValueError(f"settings.ini's requirements do not name {missing}")
    return found


def below_verified(found: dict[str, str]) -> list[str]:
    "The floors in `found` ({package: floor}) that are lower than VERIFIED_FLOORS, as messages."
    return [f"{n}>={v} is below {VERIFIED_FLOORS[n][0]}, the lowest release that passes: {VERIFIED_FLOORS[n][1]}"
            for n, v in found.items() if n in VERIFIED_FLOORS and release(v) < release(VERIFIED_FLOORS[n][0])]


def _run(cmd, log, **kw) -> int:
    print("$", " ".join(map(str, cmd)), flush=True)
    with open(log, "a") as f:
        f.write("$ " + " ".join(map(str, cmd)) + "\n"); f.flush()
        return subprocess.run(list(map(str, cmd)), stdout=f, stderr=subprocess.STDOUT, **kw).returncode


def _tail(log, n=30) -> str:
    return "\n".join(Path(log).read_text(errors="replace").splitlines()[-n:])


def build_venv(venv: Path, reuse: bool, pins: dict[str, str], log: Path) -> None:
    py = venv / "bin" / "python"
    if not (reuse and py.exists()):
        shutil.rmtree(venv, ignore_errors=True)
        venv.parent.mkdir(parents=True, exist_ok=True)
        if _run([sys.executable, "-m", "venv", venv], log): sys.exit(f"could not create {venv}:\n{_tail(log)}")
    cons = venv / "floors-constraints.txt"
    cons.write_text("".join(f"{n}=={v}\n" for n, v in {**TORCH_PINS, **pins}.items()))
    reqs = requirements() + ["pytest"]
    if _run([py, "-m", "pip", "install", "-q", "-c", cons, *reqs], log):
        sys.exit(f"pip could not install the floors (a floor that is no released version? a conflict?); "
                 f"the end of {log}:\n{_tail(log)}")
    if _run([py, "-m", "pip", "install", "-q", "--no-deps", "-e", ROOT], log):
        sys.exit(f"pip install -e . failed; the end of {log}:\n{_tail(log)}")


def installed(py: Path, names) -> dict[str, str]:
    code = ("import importlib.metadata as m, sys\n"
            "for n in sys.argv[1:]:\n"
            "    try: print(n, m.version(n))\n"
            "    except m.PackageNotFoundError: print(n, '-')\n")
    out = subprocess.run([str(py), "-c", code, *names], capture_output=True, text=True, check=True).stdout
    return dict(line.split() for line in out.splitlines())


def import_all(py: Path, env) -> list[str]:
    "Import every course_lib module (as tests/test_modules.py lists them) in the venv: the failures."
    lib = ROOT / "course_lib"
    modules = sorted(".".join(p.relative_to(lib).with_suffix("").parts).removesuffix(".__init__")
                     for p in lib.rglob("*.py") if p.parent != lib)
    # a module that needs an optional extra ([pile], [studio]: not installed here) is skipped, not failed
    extras = sorted(extra_modules())
    code = ("import importlib, sys, traceback\n"
            "extras = set(sys.argv[1].split(','))\n"
            "for m in sys.argv[2:]:\n"
            "    try: importlib.import_module('course_lib.' + m)\n"
            "    except ModuleNotFoundError as e:\n"
            "        top = (e.name or '').split('.')[0]\n"
            "        print(f'SKIP {m}: needs {top}' if top in extras else f'{m}: {e}')\n"
            "    except BaseException as e: print(f'{m}: {type(e).__name__}: {e}'.splitlines()[0])\n")
    r = subprocess.run([str(py), "-c", code, ",".join(extras), *modules], capture_output=True, text=True,
                       env=env, cwd="/")
    lines = [l for l in r.stdout.splitlines() if l.strip()]
    skipped = [l[5:] for l in lines if l.startswith("SKIP ")]
    bad = [l for l in lines if not l.startswith("SKIP ")]
    if r.returncode: bad.append(f"(the import run exited {r.returncode}: {r.stderr.strip()[-300:]})")
    print(f"imports: {len(modules) - len(bad) - len(skipped)}/{len(modules)} course_lib modules import"
          + (f"; skipped, their extra not installed: {'; '.join(skipped)}" if skipped else ""))
    return bad


def extra_modules() -> set[str]:
    "Import names of the packages of settings.ini's optional extras ([studio], [pile]), which this venv lacks."
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "settings.ini")
    names = set()
    for key in ("studio_requirements", "pile_requirements"):
        for spec in cfg["DEFAULT"].get(key, "").split():
            names.add(re.split(r"[<>=!~\[; ]", spec, maxsplit=1)[0].replace("-", "_").lower())
    return names


def run_tests(py: Path, env, files, log: Path) -> tuple[dict[str, tuple[int, int]], list[tuple[str, str]]]:
    "pytest on `files`: ({file: (passed-or-skipped, failed-or-error)}, [(failed test id, its message)])."
    xml = log.with_suffix(".junit.xml")
    xml.unlink(missing_ok=True)
    _run([py, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}",
          *[f"--deselect={d}" for d in DESELECT], *files], log, env=env, cwd=ROOT)
    res, failures = {f: [0, 0] for f in files}, []
    if xml.exists():
        for case in ET.parse(xml).iter("testcase"):
            parts = (case.get("classname") or case.get("name") or "").split(".")
            f = case.get("file") or "tests/" + (parts[1] if len(parts) > 1 else parts[0]) + ".py"
            f = f if f.startswith("tests/") else "tests/" + Path(f).name
            bad = [c for c in case if c.tag in ("failure", "error")]
            if f in res: res[f][bool(bad)] += 1
            for c in bad:
                failures.append((f"{f}::{case.get('name')}", (c.get("message") or "") + "\n" + (c.text or "")))
    for f, (ok, bad) in res.items():
        if ok + bad == 0: res[f] = [0, 1]          # nothing ran (collection error): a failure
    return {f: tuple(v) for f, v in res.items()}, failures


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    home = Path(os.environ.get("COURSE_LIB_HOME", ROOT / ".course-test-cache"))
    ap.add_argument("--venv", type=Path, default=home / "floors-venv", help="the virtual environment (made again)")
    ap.add_argument("--reuse", action="store_true", help="keep an existing venv: only re-pin packages")
    a = ap.parse_args(argv)
    t0 = time.monotonic()
    pins = floors()
    venv = a.venv.resolve()
    log = venv.parent / "floors-check.log"
    venv.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("")
    print(f"floors from settings.ini: {pins}; venv {venv}; log {log}", flush=True)
    build_venv(venv, a.reuse, pins, log)
    t_install = time.monotonic() - t0
    py = venv / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env.update(TEST_ENV, PATH=f"{venv / 'bin'}:{env.get('PATH', '')}")
    have = installed(py, [*FLOOR_PACKAGES, *TORCH_PINS])
    bad_imports = import_all(py, env)
    files = list(dict.fromkeys([f for p in FLOOR_PACKAGES for f in TESTS[p]] + EXTRA_TESTS))
    res, failures = run_tests(py, env, files, log)
    rows, ok = [], not bad_imports
    for n in [*FLOOR_PACKAGES, *TORCH_PINS]:
        want = pins.get(n, TORCH_PINS.get(n))
        failed = [Path(f).name for f in TESTS.get(n, []) if res[f][1]]
        passed = sum(res[f][0] for f in TESTS.get(n, []))
        if have.get(n, "-") == "-" or release(have[n]) != release(want): result = f"FAIL: installed {have.get(n)}, not {want}"
        elif failed: result = f"FAIL ({', '.join(failed)})"
        elif n in TORCH_PINS: result = "pinned"
        else: result = f"ok ({passed} tests)"
        ok &= not result.startswith("FAIL")
        rows.append((n, want if n in pins else f"=={want}", have.get(n, "-"), result))
    for f in EXTRA_TESTS:
        ok &= not res[f][1]
    w = [max(len(r[i]) for r in rows + [("package", "floor", "installed", "result")]) for i in range(4)]
    print()
    for r in [("package", "floor", "installed", "result"), tuple("-" * x for x in w), *rows]:
        print("  ".join(c.ljust(x) for c, x in zip(r, w)).rstrip())
    print()
    for m in bad_imports: print(f"import FAILED: {m}")
    n_ok, n_bad = sum(v[0] for v in res.values()), sum(v[1] for v in res.values())
    print(f"tests: {n_ok} passed/skipped, {n_bad} failed in {len(files)} files"
          + "".join(f"\n  FAILED in {f}: {v[1]}" for f, v in res.items() if v[1]))
    for name, text in failures:     # the log goes with the temporary folder: what failed is printed here
        print(f"\n--- {name}\n" + "\n".join(text.strip().splitlines()[-40:]))
    print(f"time: {time.monotonic() - t0:.0f} s ({t_install:.0f} s installing); log: {log}")
    print("OK: the floors in settings.ini pass" if ok else "FAIL: see above and the log")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
