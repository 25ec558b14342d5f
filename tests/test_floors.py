"""settings.ini's floors of diffusers, peft, transformers, timm, accelerate and torch-fidelity never drop below the
releases tools/check_floors.py verified (VERIFIED_FLOORS there): an older release already on a machine satisfies a
low floor and then fails mid-lesson. Cheap and offline; the check itself (it installs the floors in a fresh venv
and runs the tests against them) is run by hand: `python tools/check_floors.py`."""
import importlib.util, re
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("check_floors", ROOT / "tools" / "check_floors.py")
CF = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(CF)


def test_settings_floors_are_at_least_the_verified_ones():
    found = CF.floors()
    assert set(found) == set(CF.VERIFIED_FLOORS)
    assert not CF.below_verified(found), "; ".join(CF.below_verified(found))
    for n, v in found.items():     # the same comparison by packaging's rules
        assert Version(v) >= Version(CF.VERIFIED_FLOORS[n][0]), n


def test_floor_is_the_lower_bound_pip_sees():
    "The `>=` the check reads is the specifier's real lower bound (no second, higher `>=`; no `==`, `~=`, `>`)."
    for req in map(Requirement, CF.requirements()):
        name = CF.norm(req.name)
        if name not in CF.VERIFIED_FLOORS: continue
        ops = sorted(s.operator for s in req.specifier)
        assert ops.count(">=") == 1 and not {"==", "~=", ">", "==="} & set(ops), f"{req}: write one '>=' floor"


def test_a_lowered_floor_is_caught(tmp_path):
    text = (ROOT / "settings.ini").read_text(encoding="utf-8")
    low = re.sub(r"(?<=\sdiffusers>=)[0-9][^\s,]*", "0.30", text)
    assert low != text
    (tmp_path / "settings.ini").write_text(low, encoding="utf-8")
    msgs = CF.below_verified(CF.floors(tmp_path / "settings.ini"))
    assert len(msgs) == 1 and msgs[0].startswith("diffusers>=0.30 is below")


def test_release_comparison():
    assert CF.release("0.40") == CF.release("0.40.0") and CF.release("1.0.8") > CF.release("1.0.3")
    assert CF.release("2.14.1+cpu") == (2, 14, 1) and CF.release("5.0") > CF.release("4.57.6")


def test_the_check_runs_tests_that_exist():
    "Renaming a test file or test must not silently shrink the floors check."
    files = {f for fs in CF.TESTS.values() for f in fs} | set(CF.EXTRA_TESTS)
    missing = sorted(f for f in files if not (ROOT / f).is_file())
    assert not missing, f"tools/check_floors.py names missing test files {missing}"
    assert set(CF.TESTS) == set(CF.VERIFIED_FLOORS) and all(CF.TESTS.values())
    for node in CF.DESELECT:
        f, _, name = node.partition("::")
        assert re.search(rf"^def {re.escape(name)}\(", (ROOT / f).read_text(encoding="utf-8"), re.M), node
