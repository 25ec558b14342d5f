"""course_lib.exercises.core: a checker explains every answer in words and never raises on it. A NaN or
infinite answer gets its own message (where it is; for an exercise with logs the 0·log 0 hint) before any
mistake is looked for, so that a NaN no longer "matches" a mistake that also gives NaN. Lesson 13's ancestral
step accepts both DDPM variances and says which one the learner used."""
import math

import numpy as np
import pytest
import torch

import course_lib.exercises as E
from course_lib.exercises.core import _nonfinite

VALUES = {"snr_one", "fid_scaled"}
FUNCTIONS = sorted(set(E.exercises()) - VALUES)


def _nanify(x):
    "The reference's answer with every float made NaN (ints, strings and paths left as they are)."
    if isinstance(x, torch.Tensor) and x.is_floating_point(): return torch.full_like(x, math.nan)
    if isinstance(x, float): return math.nan
    if isinstance(x, list): return [_nanify(v) for v in x]
    if isinstance(x, tuple): return tuple(_nanify(v) for v in x)
    if isinstance(x, dict): return {k: _nanify(v) for k, v in x.items()}
    return x


def _has_float(x) -> bool:
    if isinstance(x, torch.Tensor): return x.is_floating_point()
    if isinstance(x, float): return True
    if isinstance(x, (list, tuple)): return any(map(_has_float, x))
    if isinstance(x, dict): return any(map(_has_float, x.values()))
    return False


@pytest.mark.parametrize("name", FUNCTIONS)
def test_a_nan_answer_is_named_not_taken_for_a_mistake(name, capsys):
    "Was: NaN matched a mistake that also gives NaN (isclose(equal_nan=True)), and the hint named it."
    ref = getattr(E, f"_ref_{name}")
    seen = []

    def nan_answer(*args):
        out = ref(*args)
        seen.append(_has_float(out))
        return _nanify(out)
    r = getattr(E, f"check_{name}")(nan_answer)
    if not any(seen): return   # an exercise whose answer holds no float (an int, a path, names)
    assert not r.passed and r.done, r.message
    assert "not finite" in r.message and "NaN or infinite" in r.message or "is nan" in r.message, r.message
    assert "this is what" not in r.message, r.message   # no mistake named


def _is_plain_torch(p):
    "Lesson 31's is_plain, in torch: p * (log p - log p_y) is 0 * -inf = NaN on a one-hot row."
    p_y = p.mean(0, keepdim=True)
    return float(torch.exp((p * (p.log() - p_y.log())).sum(1).mean()))


def _is_plain_numpy(p):
    "Lesson 31's is_plain as the lesson writes it (NumPy), given the checker's tensors."
    p = np.asarray(p)
    p_y = p.mean(axis=0, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        kl = (p * (np.log(p) - np.log(p_y))).sum(axis=1)
    return float(np.exp(kl.mean()))


@pytest.mark.parametrize("fn", [_is_plain_torch, _is_plain_numpy])
def test_lesson_31_is_plain_on_a_one_hot_case(fn):
    "Was: 'Hint: this is what forgetting the exp ... gives' (the mean KL is NaN too)."
    r = E.check_inception_score(fn)
    assert not r.passed and "confident and balanced" in r.message, r.message
    assert "not finite" in r.message and "forgetting the exp" not in r.message, r.message
    assert "0·log 0 = 0: use torch.xlogy / torch.special.xlogy" in r.message, r.message


def test_the_log_hint_only_where_the_exercise_takes_logs():
    r = E.check_q_sample(lambda x0, t, eps, a: torch.full_like(x0, math.inf))
    assert "not finite" in r.message and "xlogy" not in r.message, r.message
    assert "64 of 64 elements" in r.message and "index (0, 0, 0, 0)" in r.message, r.message
    r = E.check_snr_one(math.nan)
    assert not r.passed and "not a finite number" in r.message, r.message


def test_nonfinite_names_where():
    assert _nonfinite(torch.tensor([1.0, 2.0])) is None and _nonfinite([1, "a", None]) is None
    assert _nonfinite(torch.tensor([1.0, math.inf])) == \
        "1 of 2 elements are NaN or infinite, the first at index (1,) (inf)"
    assert "in [1]['b']" in _nonfinite([0.5, {"a": 1.0, "b": np.array([math.nan])}])
    assert _nonfinite(np.float32(math.nan)) == "the value is nan"


def test_ancestral_step_accepts_beta_tilde_and_says_which():
    "Was: sigma_t^2 = tilde beta_t (lesson 13's posterior variance) failed the checker."
    from course_lib.exercises.ddpm import _ancestral
    tilde = E.check_ancestral_step(lambda e, t, x, z, b: _ancestral(e, t, x, z, b, posterior=True))
    assert tilde.passed, tilde.message
    assert "you used sigma_t^2 = tilde beta_t (the posterior variance)" in tilde.message
    beta = E.check_ancestral_step(E._ref_ancestral_step)
    assert beta.passed and "you used sigma_t^2 = beta_t (Algorithm 2)" in beta.message, beta.message
    assert "tilde" in beta.message   # the other accepted choice is named too


def test_ancestral_step_tilde_cross_checked_with_diffusers():
    "tilde beta_t is diffusers' DDPMScheduler variance 'fixed_small' (same z, no clipping)."
    from diffusers import DDPMScheduler
    from course_lib.exercises.ddpm import _ancestral
    betas = torch.linspace(1e-4, 0.02, 50)
    s = DDPMScheduler(num_train_timesteps=50, trained_betas=betas.numpy(), variance_type="fixed_small",
                      clip_sample=False)
    s.set_timesteps(50)
    g = torch.Generator().manual_seed(0)
    eps, xt = torch.randn(2, 1, 4, 4, generator=g), torch.randn(2, 1, 4, 4, generator=g)
    for t in (30, 1):
        z = torch.randn(eps.shape, generator=torch.Generator().manual_seed(t))
        want = s.step(eps, t, xt, generator=torch.Generator().manual_seed(t)).prev_sample
        got = _ancestral(eps, t, xt, z, betas, posterior=True)
        assert torch.allclose(got, want, atol=2e-4), (t, (got - want).abs().max())   # float32 paths differ


def test_variants_must_be_the_same_on_every_case():
    "`check(variants=...)`: one accepted answer on one case and another on the next is not accepted."
    double, triple = (lambda x: 2 * x), (lambda x: 3 * x)
    cases = [("one", (torch.ones(2),)), ("zero", (torch.zeros(2),)), ("two", (2 * torch.ones(2),))]
    variants = {"doubling": double, "tripling": triple}
    ok = E.check(triple, double, cases, variants=variants, name="toy")
    assert ok.passed and "you used tripling" in ok.message, ok.message
    mixed = E.check(lambda x: 2 * x if x.sum() < 3 else 3 * x, double, cases, variants=variants, name="toy")
    assert not mixed.passed and "on the case 'two' your answer is tripling" in mixed.message, mixed.message
    assert "pick one" in mixed.message


BAD_ANSWERS = {   # a learner's odd return value: what the message must say (None: anything in words)
    "None": (lambda *a: None, None),
    "a list": (lambda *a: [1.0, 2.0], None),
    "a numpy array": (lambda *a: np.zeros(3), None),
    "an int": (lambda *a: 3, None),
    "a str": (lambda *a: "x", None),
    "an object": (lambda *a: object(), None),
    "a tensor on the meta device": (lambda *a: torch.zeros(2, 3, device="meta"), None),
    "a wrong shape": (lambda *a: torch.zeros(7, 7, 7), None),
    "a complex tensor": (lambda *a: torch.zeros(1, dtype=torch.complex64), None),
    "a tensor that needs grad": (lambda *a: torch.zeros(5, requires_grad=True), None),
}


def _edit_inputs(*args):
    "Changes every float tensor it is given in place, and returns the first argument."
    for a in args:
        if isinstance(a, torch.Tensor) and a.is_floating_point(): a.add_(1.0)
    return args[0]


@pytest.mark.parametrize("what", sorted(BAD_ANSWERS))
@pytest.mark.parametrize("name", FUNCTIONS)
def test_a_checker_never_raises_on_an_answer(name, what, capsys):
    fn, words = BAD_ANSWERS[what]
    r = getattr(E, f"check_{name}")(fn)   # must not raise
    assert isinstance(r.message, str) and r.message.startswith(name) and r.done
    assert r.message in capsys.readouterr().out


def _to_meta(x):
    "The reference's answer with its tensors on the meta device (right shape and dtype, no values)."
    if isinstance(x, torch.Tensor): return x.to("meta")
    if isinstance(x, (list, tuple)): return type(x)(_to_meta(v) for v in x)
    if isinstance(x, dict): return {k: _to_meta(v) for k, v in x.items()}
    return x


@pytest.mark.parametrize("name", FUNCTIONS)
def test_the_right_shape_on_another_device_is_explained(name):
    "Was: torch.isclose raised on a meta (or CUDA) tensor against the CPU reference."
    ref, seen = getattr(E, f"_ref_{name}"), []

    def on_meta(*args):
        out = ref(*args)
        seen.append(_to_meta(out) is not out and isinstance(out, torch.Tensor))
        return _to_meta(out)
    r = getattr(E, f"check_{name}")(on_meta)   # must not raise
    if any(seen):
        assert not r.passed and "wrong device" in r.message and "meta" in r.message, r.message


@pytest.mark.parametrize("name", FUNCTIONS)
def test_an_answer_that_edits_its_inputs_is_explained(name, capsys):
    r = getattr(E, f"check_{name}")(_edit_inputs)   # must not raise
    assert not r.passed and r.done, r.message


@pytest.mark.parametrize("value", [None, "500", [1, 2], np.zeros(3), torch.tensor([1.0, 2.0]), math.inf])
@pytest.mark.parametrize("name", sorted(VALUES))
def test_a_value_checker_never_raises(name, value):
    r = getattr(E, f"check_{name}")(value)
    assert not r.passed and isinstance(r.message, str)


def test_specific_answers_in_words():
    d = E.check_q_sample(lambda x0, t, eps, a: torch.zeros_like(x0, device="meta"))
    assert "wrong device: expected a tensor on cpu, got one on meta" in d.message, d.message
    assert "expected a function" in E.check_q_sample(None).message
    n = E.check_accuracy(lambda lo, la: torch.tensor([0.5, 0.5]))
    assert "expected one number, got a Tensor of shape (2,)" in n.message, n.message
    m = E.check_q_sample(lambda x0, t, eps, a: x0.mul_(2))
    assert "changed its input `x0` in place" in m.message, m.message
    ok = E.check_ema_update(lambda e, p, d: [ei.mul_(d).add_((1 - d) * pi) for ei, pi in zip(e, p)])
    assert ok.passed, ok.message   # an in-place EMA is right (its averages may change; a note says so)
    f = E.check_freeze_except_lora(lambda m: [p.requires_grad_("lora_" in n) for n, p in m.named_parameters()])
    assert f.passed, f.message     # a list returned: the model changed in place counts
