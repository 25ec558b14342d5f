"""course_lib.exercises: every checker passes its reference, catches a typical mistake and names it, and says
"not done yet" (without raising) for an unfinished stub."""
import math
import subprocess
import sys
import zlib

import pytest
import torch

import course_lib.exercises as E

NAMES = E.exercises()
VALUES = {"snr_one", "fid_scaled"}   # exercises that ask for a number


def _stub(*args):
    raise NotImplementedError  # your code


def test_every_exercise_has_a_checker_and_a_test():
    assert len(NAMES) >= 46, NAMES
    assert set(NAMES) == {n.removeprefix("check_") for n in dir(E) if n.startswith("check_")} - {"value"}
    assert set(NAMES) == set(MISTAKES), set(NAMES) ^ set(MISTAKES)


@pytest.mark.parametrize("name", NAMES)
def test_reference_passes(name, capsys):
    r = getattr(E, f"check_{name}")(getattr(E, f"_ref_{name}"))
    assert r.passed and r.done, r.message
    assert "correct" in capsys.readouterr().out


@pytest.mark.parametrize("name", NAMES)
def test_stub_is_not_done_yet(name, capsys):
    r = getattr(E, f"check_{name}")(_stub)   # must not raise
    assert not r.passed and not r.done
    assert "not done yet" in capsys.readouterr().out


def _ab(t, a):
    return a[t].reshape(-1, *[1] * 3)


def _sqrt_lld(n, lr, d):
    return [lr * d ** (n - i) for i in range(n)]


MISTAKES = {   # name: (a learner's typical wrong answer, words the message must contain)
    "to_float": (lambda x: x.float() / 255, "dividing by 255"),
    "noisy_image": (lambda x0, eps, a: a * x0 + (1 - a) * eps, "missing square root"),
    "alpha_bar": (lambda b: torch.cumprod(b, 0), "multiplying the betas"),
    "q_sample": (lambda x0, t, eps, a: _ab(t - 1, a).sqrt() * x0 + (1 - _ab(t - 1, a)).sqrt() * eps,
                 "off-by-one timestep"),
    "snr_one": (lambda: 500, "outside"),
    "ddpm_loss": (lambda m, x0, t, eps, a: ((eps - m(x0, t)) ** 2).mean(), "clean x_0"),
    "ema_update": (lambda e, p, d: [d * pi + (1 - d) * ei for ei, pi in zip(e, p)], "swapped"),
    "shift": (lambda x, dy, dx: torch.roll(x, (dy, dx), (2, 3)), "torch.roll"),
    "accuracy": (lambda lo, la: (lo.argmax(0) == la).float().mean().item(), "dim 0"),
    "ancestral_step": (lambda e, t, x, z, b: (x - b[t] / (1 - torch.cumprod(1 - b, 0)[t]).sqrt() * e)
                       / (1 - b[t]).sqrt() + b[t].sqrt() * z, "adding noise at t = 0"),
    "ddim_step": (lambda e, t, tp, x, a: a[tp].sqrt() * (x - (1 - a[t]).sqrt() * e) / a[t].sqrt()
                  + (1 - a[tp]).sqrt() * e, "alpha_bar[T-1]"),
    # lesson 13a, samplers by hand
    "karras_sigmas": (lambda a, b, n, r: E._ref_karras_sigmas(a, b, n, r)[:-1], "no final sigma = 0"),
    "heun_step": (lambda x, s, sn, D: x + (sn - s) * (x - D(x, s)) / s, "Euler step alone"),
    # lesson 10a, the UNet by hand
    "timestep_embedding": (lambda t, d: E._ref_timestep_embedding(t, d).roll(d // 2, -1), "sines first"),
    "add_time": (lambda h, e, w, b: h + (e @ w.T + b)[:, :, None, None], "missing SiLU"),
    "attention": (lambda q, k, v: (q @ k.transpose(-1, -2)).softmax(-1) @ v, "1 / sqrt(d)"),
    "group_norm": (lambda x, G: torch.nn.functional.instance_norm(x), "InstanceNorm"),
    "masked_attention": (lambda q, k, v, m: ((q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5).softmax(-1) * m) @ v,
                         "zeroing the weights after the softmax"),
    # lesson 10, the chain's variance and a schedule's betas
    "chain_variance": (lambda b: torch.cumsum(b, 0), "adding the betas"),
    "betas_from_alpha_bar": (lambda ab: 1 - ab / ab.roll(1), "wrapping around at t = 0"),
    "gaussian_score": (lambda x, mu, s: -(x - mu) / s, "sigma instead of sigma^2"),
    "dsm_loss": (lambda f, x0, s, z: 0.5 * (s[:, None] * f(x0 + s[:, None] * z, s) + z).pow(2).mean(),
                 "averaging over dimensions"),
    "langevin_step": (lambda x, s, h, z: x + h / 2 * s + h * z, "missing square root"),
    "annealed_step_sizes": (lambda s, lr: lr * s / s[-1], "not squared"),
    "vp_marginal": (lambda x0, t, lo, hi: E._ref_vp_marginal(x0, t, lo, hi)[0:1]
                    + (E._ref_vp_marginal(x0, t, lo, hi)[1] ** 2,), "missing square root"),
    "reverse_sde_step": (lambda x, s, t, dt, z, lo, hi: x + (0.5 * (lo + t * (hi - lo)) * x
                         - (lo + t * (hi - lo)) * s) * dt + math.sqrt((lo + t * (hi - lo)) * dt) * z,
                         "wrong sign"),
    "eps_to_score": (lambda e, t, a: -e / (1 - a[t]).reshape(-1, 1, 1, 1), "missing square root"),
    "bits_per_dim": (lambda n, d: n / d + 7, "natural log"),
    "frechet_gaussians": (lambda m1, s1, m2, s2: float(((m1 - m2) ** 2).sum() + s1.trace() + s2.trace()
                          - 2 * (s1 @ s2).trace()), "missing square root"),
    "feature_stats": (lambda f: (f.mean(0), (f - f.mean(0)) @ (f - f.mean(0)).T / (len(f) - 1)),
                      "transposed matrix"),
    "fid_scaled": (lambda: 16.0, "outside"),
    "inception_score": (lambda p: float((p * (p.log2() - p.mean(0, keepdim=True).log2())).sum(1)
                                        .mean().exp()), "log base 2"),
    "mmd2_unbiased": (lambda a, b, c: float(a.mean() + b.mean() - 2 * c.mean()), "biased"),
    "to_uint8_rgb": (lambda x: ((x + 1) * 127.5).clamp(0, 255).to(torch.uint8).repeat(1, 3 // x.shape[1],
                     1, 1), "truncating"),
    "knn_precision": (lambda r, f, k: float((torch.cdist(f, r) <= torch.cdist(r, r).kthvalue(k, 1)
                      .values[None]).any(1).float().mean()), "its own neighbour"),
    "fid_infinity": (lambda ns, fs: fs[-1] if ns[-1] == max(ns) else fs[0], "largest N"),
    "std_error": (lambda v: float(torch.tensor(v).std() / len(v)), "missing square root"),
    "lora_forward": (lambda x, W, b, A, B, al, r: x @ W.T + b + x @ A.T @ B.T, "alpha / r scaling"),
    "lora_merge": (lambda W, A, B, al, r: W + al / r * (A.T @ B.T), "transposed"),
    "lora_params": (lambda s, r: sum(r * o * i for o, i in s), "full matrix"),
    "caption_path": (lambda p, e: type(p)(str(p) + e), "appending the extension"),
    "assign_bucket": (lambda w, h, b: E._ref_assign_bucket(h, w, b), "height / width"),
    "trainable_share": (lambda m: E._ref_trainable_share(m) / 100, "fraction instead of a percentage"),
    "freeze_except_lora": (lambda m: m.requires_grad_(False), "freezing the LoRA weights too"),
    "lora_blend": (lambda W, d, w: E._ref_lora_blend(W, d, [x / len(w) for x in w]), "averaging"),
    "lora_unmerge": (lambda W, A, B, al, r: W - B @ A, "alpha / r scaling"),
    "conv_macs": (lambda ci, co, k, h, w, g: co * h * w * ci * k * k, "forgetting groups"),
    "adapt_input_conv": (lambda w, c: w.mean(1, keepdim=True) if c == 1 else w, "averaging the RGB"),
    "lld_groups": (_sqrt_lld, "off-by-one exponent"),
    "ncm_predict": (lambda f, l, q, c: l[torch.cdist(q, f).argmin(1)], "1-NN"),
    "tta_probs": (lambda l: l.mean(0).softmax(-1), "averaging the logits"),
    "quantize_int8": (lambda w: (w / (w.abs().max() / 127)).trunc() * (w.abs().max() / 127), "truncating"),
    "split_by_subset": (lambda rs: E._ref_split_by_subset([r for r in rs if "meta" in r]), "without `meta`"),
    "subset_bytes": (lambda rs: {k: sum(map(len, v)) for k, v in E._ref_split_by_subset(rs).items()},
                     "characters"),
    "bpb": (lambda ll, t: -ll / len(t.encode("utf-8")), "natural log"),
    "zlib_bpb": (lambda t: len(zlib.compress(t.encode("utf-8"), 9)) / len(t.encode("utf-8")), "8 bits"),
    "bpb_per_subset": (None, "averaging per-document"),
    "gpt2_params": (lambda v, p, d, n: E._ref_gpt2_params(v, p, d, n) + v * d, "tied LM head"),
}


def _mean_of_docs(ds):
    per = {}
    for n, t, s in ds:
        per.setdefault(n, []).append(E._ref_bpb(s, t))
    return {k: sum(v) / len(v) for k, v in per.items()}


MISTAKES["bpb_per_subset"] = (_mean_of_docs, "averaging per-document")


def _char_jaccard(a, b, n):
    A, B = ({t[i:i + n] for i in range(max(1, len(t) - n + 1))} for t in (a, b))
    return len(A & B) / len(A | B)


# lesson 62a (cleaning the Pile): checkers in exercises_pile
MISTAKES.update({
    "shingle_jaccard": (_char_jaccard, "characters, not of words"),
    "lsh_probability": (lambda s, b, r: 1 - (1 - s ** b) ** r, "swapping bands and rows"),
})

# unit 7 (guidance, flow matching, FLUX in miniature and its LoRA): checkers in exercises_flow, flux_parts
MISTAKES.update({
    "cfg_combine": (lambda c, u, w: c + w * (u - c), "swapping cond and uncond"),
    "drop_labels": (lambda y, d, n: torch.where(d, torch.zeros_like(y), y), "using 0 as the null class"),
    "flow_target": (lambda x0, e, t: (E._ref_flow_target(x0, e, t)[0], x0 - e), "wrong sign"),
    "flow_euler_step": (lambda v, t, tn, x: x + (t - tn) * v, "wrong sign"),
    "flux_pack_latents": (lambda z: z.flatten(2).transpose(1, 2).reshape(z.shape[0], -1, 4 * z.shape[1]),
                          "flattening pixels, not 2x2 patches"),
    "digit_slant": (lambda x: -E._ref_digit_slant(x), "the sign flipped"),
    "flux_lora_update": (lambda x, W, b, A, B, a: x @ W.T + b + x @ A.T @ B.T, "forgetting the scale alpha / r"),
    "svd_rank": (lambda A, B, s, k: E._ref_svd_rank(A, B, 1.0, k), "forgetting the scale"),
    "peft_targets": (lambda ns, ts: [n for n in ns if any(t in n for t in ts)], "matching a substring"),
})


@pytest.mark.parametrize("name", sorted(MISTAKES))
def test_typical_mistake_is_caught_and_named(name, capsys):
    wrong, words = MISTAKES[name]
    r = getattr(E, f"check_{name}")(wrong)
    assert not r.passed and r.done
    assert words in r.message, r.message
    assert r.message in capsys.readouterr().out


def test_facade_lists_every_checker_and_the_machinery():
    checkers = {n for n in dir(E) if n.startswith("check_")}
    assert checkers <= set(E.__all__), checkers - set(E.__all__)
    assert {"check", "check_value", "show_solution", "exercises", "register_solution", "solutions"} <= set(E.__all__)


UNIT7 = ("cfg_combine", "drop_labels", "flow_target", "flow_euler_step", "flux_pack_latents", "digit_slant",
         "flux_lora_update", "svd_rank")


def test_unit7_checkers_and_solutions_come_from_the_facade_alone():
    "In a fresh interpreter, `course_lib.exercises` alone gives unit 7's checkers and `show_solution` knows them."
    code = ("from course_lib.exercises import show_solution, exercises\n"
            f"from course_lib.exercises import {', '.join('check_' + n for n in UNIT7)}\n"
            f"for n in {UNIT7!r}:\n    show_solution(n)\n"
            "print('listed', sorted(set(exercises()) & set(" + repr(UNIT7) + ")))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    for n in UNIT7:
        assert f"def _ref_{n}(" in r.stdout, (n, r.stdout[-2000:])
    assert f"listed {sorted(UNIT7)}" in r.stdout, r.stdout[-500:]
    assert {f"check_{n}" for n in UNIT7} <= set(E.__all__), set(E.__all__)


def test_show_solution_prints_the_reference_without_its_decorator(capsys):
    E.show_solution("check_q_sample")
    out = capsys.readouterr().out
    assert out.startswith("def _ref_q_sample(") and "register_solution" not in out
    with pytest.raises(ValueError, match="no exercise named 'nope'.*q_sample"):
        E.show_solution("nope")


def test_a_new_unit_registers_its_solutions(capsys):
    "What a unit's module does on import: `@register_solution` on each `_ref_<name>`, then it is listed."
    from course_lib.exercises import register_solution, solutions

    def _ref_toy_double(x):
        return 2 * x

    def other():
        return 0

    _ref_toy_double.__module__ = "course_lib.exercises_toy"
    other.__name__, other.__module__ = "_ref_toy_double", "course_lib.exercises_other"
    try:
        assert register_solution(_ref_toy_double) is _ref_toy_double
        assert "toy_double" in E.exercises() and E._ref_toy_double is _ref_toy_double
        E.show_solution("toy_double")
        assert "return 2 * x" in capsys.readouterr().out
        with pytest.raises(ValueError, match="already has a reference solution in course_lib.exercises_toy"):
            register_solution(other)
        with pytest.raises(ValueError, match="named _ref_<exercise>"):
            register_solution(lambda x: x)
    finally:
        solutions.pop("toy_double", None)
    assert "toy_double" not in E.exercises()
