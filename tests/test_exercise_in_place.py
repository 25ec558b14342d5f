"""Issue 47, item 9: an answer that changes its inputs in place is caught by every checker, even when the value
it returns is right (`x0.mul_(...).add_(...)` returned by `my_q_sample` passed, and the learner's x0 was gone).
The message names the argument, where it changed (the first element, its old and new value) and what to write
instead. An exercise whose input is meant to be updated (the EMA's running averages) passes and says so."""
import math

import numpy as np
import pytest
import torch

import course_lib.exercises as E

NAMES = E.exercises()


def _ab(t, a):
    return a[t].reshape(-1, 1, 1, 1)


def _ddim_in_place(eps, t, t_prev, xt, ab):
    a_prev = ab[t_prev] if t_prev >= 0 else torch.ones(())
    x0_hat = xt.sub_((1 - ab[t]).sqrt() * eps).div_(ab[t].sqrt())
    return x0_hat.mul_(a_prev.sqrt()).add_((1 - a_prev).sqrt() * eps)


def _group_norm_in_place(x, groups):
    z = x.view(x.shape[0], groups, -1)
    z.sub_(z.mean(-1, keepdim=True)).div_((z.var(-1, unbiased=False, keepdim=True) + 1e-5).sqrt())
    return x


def _feature_stats_in_place(f):
    mu = f.mean(0)
    d = f.sub_(mu)
    return mu, d.T @ d / (len(f) - 1)


def _quantize_in_place(w):
    s = w.abs().max() / 127
    return torch.zeros_like(w) if s == 0 else w.div_(s).round_().clamp_(-127, 127).mul_(s)


def _uint8_in_place(x):
    u = x.add_(1).mul_(127.5).round_().clamp_(0, 255).to(torch.uint8)
    return u.repeat(1, 3, 1, 1) if u.shape[1] == 1 else u


def _blend_in_place(W, deltas, weights):
    for d, w in zip(deltas, weights): W.add_(w * d)
    return W


def _split_in_place(records):
    out = {}
    for r in records:
        out.setdefault(r.setdefault("meta", {}).setdefault("pile_set_name", "unknown"), []).append(r["text"])
    return out


def _bpb_sorted_in_place(docs):
    docs.sort()   # grouping by sorting: the caller's list is reordered
    return E._ref_bpb_per_subset(docs)


IN_PLACE = {   # name: (a right answer that changes an input in place, the argument it changes)
    "q_sample": (lambda x0, t, eps, a: x0.mul_(_ab(t, a).sqrt()).add_((1 - _ab(t, a)).sqrt() * eps), "x0"),
    "noisy_image": (lambda x0, eps, a: x0.mul_(math.sqrt(a)).add_(math.sqrt(1 - a) * eps), "x0"),
    "alpha_bar": (lambda betas: torch.cumprod(betas.neg_().add_(1), 0), "betas"),
    "add_time": (lambda h, emb, w, b: h.add_((torch.nn.functional.silu(emb) @ w.T + b)[:, :, None, None]), "h"),
    "group_norm": (_group_norm_in_place, "x"),
    "ddim_step": (_ddim_in_place, "xt"),
    "ema_update": (lambda ema, params, d: [p.mul_(1 - d).add_(d * e) for e, p in zip(ema, params)], "params"),
    "gaussian_score": (lambda x, mu, s: x.sub_(mu).div_(-s ** 2), "x"),
    "langevin_step": (lambda x, s, h, z: x.add_(h / 2 * s).add_(math.sqrt(h) * z), "x"),
    "eps_to_score": (lambda eps, t, a: eps.div_(-_ab(t, 1 - a).sqrt()), "eps"),
    "bits_per_dim": (lambda nll, d: nll.div_(d * math.log(2)).add_(7), "nll"),
    "feature_stats": (_feature_stats_in_place, "f"),
    "to_uint8_rgb": (_uint8_in_place, "x"),
    "lora_merge": (lambda W, A, B, al, r: W.add_(al / r * (B @ A)), "W"),
    "lora_unmerge": (lambda Wm, A, B, al, r: Wm.sub_(al / r * (B @ A)), "Wm"),
    "lora_blend": (_blend_in_place, "W"),
    "quantize_int8": (_quantize_in_place, "w"),
    "cfg_combine": (lambda c, u, w: u.add_(w * (c - u)), "u"),
    "flow_euler_step": (lambda v, t, tn, x: x.add_((tn - t) * v), "x"),
    "split_by_subset": (_split_in_place, "records"),
    "bpb_per_subset": (_bpb_sorted_in_place, "docs"),
}


@pytest.mark.parametrize("name", sorted(IN_PLACE))
def test_a_right_answer_that_changes_its_input_in_place_fails_and_says_where(name, capsys):
    fn, arg = IN_PLACE[name]
    r = getattr(E, f"check_{name}")(fn)
    assert not r.passed and r.done, r.message
    assert "your answer is right on the case" in r.message, r.message
    assert f"changed its input `{arg}` in place" in r.message, r.message
    assert "was " in r.message and "now " in r.message, r.message
    assert "Hint:" in r.message, r.message
    assert r.message in capsys.readouterr().out


def test_q_sample_in_place_names_the_element_the_old_and_new_value_and_the_fix():
    r = E.check_q_sample(IN_PLACE["q_sample"][0])
    assert "on the case 'random timesteps'" in r.message, r.message
    assert "`x0` at index (0, 0, 0, 0): was " in r.message, r.message
    assert "64 of 64 elements changed" in r.message, r.message
    assert "`x0 * a + b`, not `x0.mul_(a).add_(b)`" in r.message, r.message
    assert "x0 = x0.clone()" in r.message, r.message


def test_the_ema_may_update_its_averages_in_place_and_is_told_so():
    "An EMA is updated in place (course_lib's own ema_update does): it passes, with a note; params may not change."
    ok = E.check_ema_update(lambda e, p, d: [ei.mul_(d).add_((1 - d) * pi) for ei, pi in zip(e, p)])
    assert ok.passed, ok.message
    assert "updated `e` in place" in ok.message and "allowed here" in ok.message, ok.message
    ref = E.check_ema_update(E._ref_ema_update)
    assert ref.passed and "in place" not in ref.message, ref.message


@pytest.mark.parametrize("name", NAMES)
def test_no_reference_changes_its_inputs(name):
    "The reference goes through the learner's path: a reference editing its inputs would fail here."
    if name in {"snr_one", "fid_scaled"}: return   # exercises that ask for a number
    r = getattr(E, f"check_{name}")(getattr(E, f"_ref_{name}"))
    assert r.passed and "in place" not in r.message, r.message


def test_numpy_arrays_nested_containers_and_modules_are_watched():
    def times_two(x):
        x *= 2
        return x
    a = E.check(times_two, lambda x: 2 * x, [("three numbers", (np.arange(3.0),))], name="double")
    assert not a.passed and "`x` at index (1,): was 1, now 2" in a.message, a.message
    assert "x = x.copy()" in a.message, a.message

    def scale_weight(m):
        with torch.no_grad(): m.weight.mul_(2)
        return float(m.weight.detach().sum())
    net = torch.nn.Linear(3, 2)
    b = E.check(scale_weight, lambda m: float(2 * m.weight.detach().sum()), [("a Linear", (net,))], name="wsum")
    assert not b.passed and "changed its input `m` in place" in b.message, b.message
    assert "`m['weight']` at index (0, 0)" in b.message and "copy.deepcopy(m)" in b.message, b.message

    def append(xs):
        xs.append(torch.zeros(1))
        return len(xs) - 1
    c = E.check(append, lambda xs: len(xs), [("two tensors", ([torch.ones(1), torch.ones(2)],))], name="count")
    assert not c.passed and "`xs` had 2 items, now 3" in c.message, c.message


def test_a_wrong_answer_that_also_edits_its_input_says_both():
    r = E.check_q_sample(lambda x0, t, eps, a: x0.mul_(2))
    assert not r.passed and "not right yet on the case" in r.message, r.message
    assert "changed its input `x0` in place" in r.message and "at index (0, 0, 0, 0): was" in r.message, r.message


def test_the_checker_own_inputs_are_untouched_and_names_come_from_the_reference():
    "A learner's `*args` function: the arguments are named as the reference names them."
    def edit_all(*args):
        for a in args:
            if isinstance(a, torch.Tensor) and a.is_floating_point(): a.add_(1.0)
        return E._ref_langevin_step(*(a - 1 if isinstance(a, torch.Tensor) else a for a in args))
    r = E.check_langevin_step(edit_all)
    assert not r.passed and "changed its inputs `x`, `score` and `z` in place" in r.message, r.message


def test_a_checker_allowing_an_argument_the_reference_lacks_is_refused():
    "A typo in `in_place` would silently fail every learner who updates that argument in place."
    with pytest.raises(ValueError, match=r"in_place names \['emma'\].*arguments of .*\(ema, params, decay\)"):
        E.check(E._ref_ema_update, E._ref_ema_update, [("one", ([torch.ones(1)], [torch.ones(1)], 0.5))],
                in_place={"emma": "a typo"})


def test_a_change_below_six_digits_shows_the_values_that_differ():
    "An in-place `eps.add_(1e-7)` is caught, and its message shows two different numbers."
    from course_lib.exercises.core import _first_change
    before = torch.tensor([-0.569248123])
    msg = _first_change(before, before + 1e-7, "eps")
    was, now = msg.split("was ")[1].split(", now ")
    assert was != now.split(",")[0], msg
