"""course_lib.exercises.flow: every checker of unit 7 passes its reference, catches a typical mistake and
names it, and says "not done yet" for a stub."""
import pytest
import torch

import course_lib.exercises.flow as E
from course_lib.exercises import show_solution

MISTAKES = {
    "cfg_combine": (lambda c, u, w: c + w * (u - c), "swapping cond and uncond"),
    "drop_labels": (lambda y, d, n: torch.where(d, torch.zeros_like(y), y), "using 0 as the null class"),
    "flow_target": (lambda x0, e, t: (E._ref_flow_target(x0, e, t)[0], x0 - e), "wrong sign"),
    "flow_euler_step": (lambda v, t, tn, x: x + (t - tn) * v, "wrong sign"),
}


def _stub(*args):
    raise NotImplementedError


@pytest.mark.parametrize("name", sorted(MISTAKES))
def test_checker(name, capsys):
    chk, ref = getattr(E, f"check_{name}"), getattr(E, f"_ref_{name}")
    r = chk(ref)
    assert r.passed and r.done, r.message
    r = chk(_stub)
    assert not r.passed and not r.done and "not done yet" in r.message
    wrong, words = MISTAKES[name]
    r = chk(wrong)
    assert not r.passed and words in r.message, r.message
    show_solution(name)
    assert f"def _ref_{name}" in capsys.readouterr().out
