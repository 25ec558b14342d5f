"""course_lib.ddpm.schedule: every `NoiseSchedule` method that takes timesteps `t` refuses one outside [0, T-1]
(lesson 10 says so), naming the value, instead of indexing `alpha_bar[-1]` (the last step) in silence."""
import inspect

import pytest
import torch

from course_lib.ddpm import NoiseSchedule

T = 10
S = NoiseSchedule(T, "linear")
x = torch.randn(2, 1, 4, 4, generator=torch.Generator().manual_seed(0))


def _takes_t(name):
    f = getattr(NoiseSchedule, name)
    return callable(f) and not name.startswith("_") and "t" in inspect.signature(f).parameters


METHODS = sorted(n for n in dir(NoiseSchedule) if _takes_t(n))


def _call(name, t):
    "Call method `name` with timesteps `t` and images of matching batch size for every other argument."
    f = getattr(S, name)
    args = {p: (t if p == "t" else x[: len(t)]) for p, a in inspect.signature(f).parameters.items()
            if p == "t" or a.default is inspect.Parameter.empty}
    return f(**args)


def test_every_method_that_takes_t_is_listed():
    assert {"q_sample", "q_step", "q_mean_variance", "posterior_mean_variance", "snr", "predict_x0",
            "velocity"} <= set(METHODS), METHODS


@pytest.mark.parametrize("name", METHODS)
@pytest.mark.parametrize("bad", [[-1, 0], [0, T], [0.5, 1.0]])
def test_out_of_range_timesteps_are_refused(name, bad):
    t = torch.tensor(bad)
    with pytest.raises(ValueError, match=r"timesteps must be integers in \[0, 9\]"):
        _call(name, t)


@pytest.mark.parametrize("name", METHODS)
def test_timesteps_in_range_are_accepted(name):
    out = _call(name, torch.tensor([0, T - 1]))
    assert all(torch.isfinite(o).all() for o in (out if isinstance(out, tuple) else (out,)))
