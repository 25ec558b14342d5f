#!/usr/bin/env python3
"""Which ancestral step counts can unit 1's sampler table tell apart on real 28x28 MNIST? The shipped MNIST DDPM,
sampled and measured.

    python tools/mnist_preview.py [--n 128] [--steps 2 3 5 10 100 1000] [--seed 0] [--out runs/mnist-preview]

Loads the DDPM of `tools/ship_pretrained.py --only ddpm-mnist` (`DDPMConfig.mnist()`, trained on the 4,000 training
digits of `course_lib.data.mnist`) and the MNIST judge (`ClassifierConfig.mnist()`: the course's `DigitsClassifier`
on the same training split, augmented, without label smoothing, so the real digits' confident rate is not capped),
and samples `--n` images with the ancestral sampler (`make_scheduler('ancestral')`) at each of `--steps`, all from
the same noise (`--seed`). Every measure uses digits the DDPM never saw as its reference: the 500 test digits. For
each setting, for `--n` real validation digits and for uniform noise: the grey share (the share of pixels between
10% and 90% ink, against the test digits' share: blurred strokes raise it); the judge's confident rate (max
probability >= 0.9), the mean log-probability of its top class, the mean entropy (bits), the largest class share; on
the judge's 128 features against the test digits, FID (standard error by a bootstrap of the rows), the mean distance
to the nearest test digit and precision (the share of images inside some test digit's 3-nearest-neighbour ball,
Kynkaanniemi et al. 2019); and a classifier two-sample test against `--n` test digits (a small CNN's 4-fold accuracy
at telling them apart: 0.5 when it cannot, Lopez-Paz & Oquab 2017), each with its standard error. Then each setting
against the most steps, by `course_lib.core.compare.verdict` on each measure (independent samples: the ancestral
sampler draws fresh noise at every step, so sharing x_T pairs little). Prints a table and writes `OUT/preview.json`
and `OUT/samples.png`. Not run by the tests. The 1000-step run is most of the time: about 6 minutes for 128 samples
on 2 cores (337 s, 2026-12-06)."""
from __future__ import annotations

import argparse, json, math, sys, time
from pathlib import Path

from course_lib.ddpm.sampling import grey_share   # lesson 13's sharpness measure

ROOT = Path(__file__).resolve().parent.parent


def features(x, judge):
    "The judge's penultimate features `(n, 128)` float64 of images `x`."
    import torch
    with torch.no_grad():
        return torch.cat([judge.features(x[i:i + 512]) for i in range(0, len(x), 512)]).double().numpy()


def fid_with_se(f, ref, boots: int = 20) -> tuple[float, float]:
    """FID of features `f` against `ref` on the judge's features, and its standard error over a bootstrap of the
    rows of `f` (`boots` resamples)."""
    import numpy as np
    from course_lib.metrics.frechet import fid_from_features
    rng = np.random.default_rng(0)
    fids = [fid_from_features(f[rng.integers(0, len(f), len(f))], ref) for _ in range(boots)]
    return float(fid_from_features(f, ref)), float(np.std(fids, ddof=1))


def nn_measures(f, ref, k: int = 3) -> dict:
    """Mean Euclidean distance from each row of `f` to its nearest row of `ref` (and its standard error), and
    precision (Kynkaanniemi et al. 2019: the share of rows of `f` inside some row of `ref`'s `k`-nearest-neighbour
    ball, torch-fidelity's `calculate_precision_recall_full`), with sqrt(p(1-p)/n)."""
    import numpy as np
    import torch
    from torch_fidelity.metric_prc import calculate_precision_recall_full
    nearest = np.sqrt(((f[:, None, :] - ref[None, :, :]) ** 2).sum(-1)).min(1)
    p = float(calculate_precision_recall_full(torch.from_numpy(f), torch.from_numpy(ref), neighborhood=k)[0])
    return {"nn_distance": float(nearest.mean()), "nn_distance_se": float(nearest.std(ddof=1) / math.sqrt(len(f))),
            "precision": p, "precision_se": math.sqrt(p * (1 - p) / len(f))}


def c2st(x, real, folds: int = 4, epochs: int = 40, seed: int = 0) -> tuple[float, float]:
    """Classifier two-sample test (Lopez-Paz & Oquab 2017): the `folds`-fold cross-validated accuracy of a small CNN
    telling images `x` from real digits `real` (as many of each, float in [-1, 1]), and its standard error
    sqrt(a(1-a)/N). 0.5: the classifier cannot tell them apart; 1: always."""
    import numpy as np
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    X = torch.cat([x, real]).float()
    y = torch.cat([torch.zeros(len(x)), torch.ones(len(real))]).long()
    fold = torch.from_numpy(np.random.default_rng(seed).permutation(len(y)) % folds)
    right = 0
    for k in range(folds):
        torch.manual_seed(seed)
        net = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                            nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                            nn.Linear(32, 2))
        opt = torch.optim.AdamW(net.parameters(), 3e-3, weight_decay=1e-3)
        train, test = torch.nonzero(fold != k)[:, 0], torch.nonzero(fold == k)[:, 0]
        g = torch.Generator().manual_seed(seed)
        for _ in range(epochs):
            for idx in train[torch.randperm(len(train), generator=g)].split(32):
                loss = F.cross_entropy(net(X[idx]), y[idx])
                opt.zero_grad(); loss.backward(); opt.step()
        with torch.no_grad(): right += int((net(X[test]).argmax(1) == y[test]).sum())
    acc = right / len(y)
    return acc, math.sqrt(acc * (1 - acc) / len(y))


def judged(x, judge, ref, real=None, grey_ref: float | None = None) -> dict:
    """Confident rate, mean top-class log-probability, mean entropy (bits), largest class share, and, against the
    reference features `ref`, FID, nearest-neighbour distance and precision on the judge's features, and, given
    real digits `real`, the classifier two-sample test's accuracy (`c2st`), of images `x`, each with its standard
    error."""
    import torch
    import torch.nn.functional as F
    if x.dtype == torch.uint8: x = x.float() / 127.5 - 1
    grey = grey_share(x)
    with torch.no_grad():
        logp = torch.cat([F.log_softmax(judge(x[i:i + 512]), -1) for i in range(0, len(x), 512)]).double()
    top = logp.max(1).values
    conf = (top >= math.log(0.9)).double()
    ent = -(logp.exp() * logp).sum(1) / math.log(2)
    se = lambda v: float(v.std() / math.sqrt(len(v)))
    out = {"n": len(x), "confident_rate": float(conf.mean()), "confident_rate_se": se(conf),
           "top_logp": float(top.mean()), "top_logp_se": se(top), "entropy": float(ent.mean()),
           "entropy_se": se(ent), "max_share": float(torch.bincount(logp.argmax(1), minlength=10).max() / len(x))}
    if grey_ref is not None:   # the distance to the test digits' share; its standard error is the row's alone,
        # since every row is compared with the same reference and that cancels in a difference of two rows
        out["grey_share"], out["grey_gap"] = float(grey.mean()), abs(float(grey.mean()) - grey_ref)
        out["grey_share_se"] = out["grey_gap_se"] = se(grey)
    f = features(x, judge)
    out["fid"], out["fid_se"] = fid_with_se(f, ref)
    if real is not None: out["c2st"], out["c2st_se"] = c2st(x[:len(real)], real[:len(x)])
    return {**out, **nn_measures(f, ref)}


MEASURES = {"grey_gap": False, "fid": False, "nn_distance": False, "precision": True, "c2st": False, "entropy": False,
            "top_logp": True,
            "confident_rate": True}   # measure: higher is better


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("--n", type=int, default=128, help="samples per sampler setting")
    p.add_argument("--steps", type=int, nargs="+", default=[2, 3, 5, 10, 100, 1000])
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "mnist-preview")
    p.add_argument("--seed", type=int, default=0, help="the seed of the samplers' noise (another seed: fresh samples)")
    a = p.parse_args(argv)
    import torch
    from course_lib.core.compare import verdict
    from course_lib.data.mnist import MNIST
    from course_lib.ddpm import DDPMConfig, load_pretrained_ddpm, make_scheduler, sample
    from course_lib.ddpm import ddpm_is_cached
    cfg, data = DDPMConfig.mnist(), MNIST("train", size=28)
    if not ddpm_is_cached(cfg, dataset=data):
        sys.exit("the MNIST DDPM is neither shipped nor cached: COURSE_LIB_HOME=<scratch> python "
                 "tools/ship_pretrained.py --only ddpm-mnist")
    a.out.mkdir(parents=True, exist_ok=True)
    from course_lib.ddpm import ClassifierConfig, accuracy, load_digits_classifier
    judge = load_digits_classifier(config=ClassifierConfig.mnist())
    test = MNIST("test")
    acc = accuracy(judge, test)
    print(f"judge: test accuracy {acc:.4f}", flush=True)
    model = load_pretrained_ddpm(cfg, dataset=data, progress=False)
    ref = features(test.images, judge)            # the reference of FID, NN distance and precision
    valid = MNIST("valid").images                 # both splits sorted by class: draw at random
    pick = torch.randperm(len(valid), generator=torch.Generator().manual_seed(0))[:a.n]
    real = test.images[torch.randperm(len(test), generator=torch.Generator().manual_seed(1))[:a.n]]   # C2ST's
    grey_ref = float(grey_share(test.images).mean())
    rows = {"real validation digits": judged(valid[pick], judge, ref, real, grey_ref),
            "uniform noise": judged(torch.rand(a.n, 1, 28, 28, generator=torch.Generator().manual_seed(0)) * 2 - 1,
                                    judge, ref, real, grey_ref)}
    shown = {}
    for steps in sorted(a.steps):
        t1 = time.time()
        x, _ = sample(model, make_scheduler("ancestral", cfg), a.n, steps,
                      generator=torch.Generator().manual_seed(a.seed))
        seconds = round(time.time() - t1, 1)
        rows[f"ancestral {steps} steps"] = {**judged(x, judge, ref, real, grey_ref), "seconds": seconds}
        shown[steps] = x[:32].float() / 255
        print(f"ancestral {steps} steps: {time.time() - t1:.0f} s", flush=True)
    hi = f"ancestral {max(a.steps)} steps"
    verdicts = {f"{key}: {name} vs {hi}": verdict(name, r[key], r[key + "_se"], hi, rows[hi][key],
                                                   rows[hi][key + "_se"], higher_is_better=better)
                for key, better in MEASURES.items() for name, r in rows.items() if name != hi}
    out = {"judge_test_accuracy": acc, "n": a.n, "seed": a.seed, "grey_share_test_digits": grey_ref,
           "reference": "MNIST('test'): 500 digits the DDPM never saw",
           "config": cfg.to_dict(),
           "rows": rows, "verdicts": verdicts}
    (a.out / "preview.json").write_text(json.dumps(out, indent=1))
    import matplotlib; matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(len(shown), 1, figsize=(12, 1.6 * len(shown)))
    for ax, (steps, x) in zip(axes if len(shown) > 1 else [axes], shown.items()):
        ax.imshow(torch.cat(list(x[:, 0]), 1).numpy(), cmap="gray"); ax.set_axis_off()
        ax.set_title(f"ancestral, {steps} steps", fontsize=9)
    fig.savefig(a.out / "samples.png", dpi=100, bbox_inches="tight")
    cols = [("grey share", "grey_share", 3), ("confident", "confident_rate", 3), ("top log p", "top_logp", 3),
            ("entropy", "entropy", 3),
            ("FID", "fid", 1), ("NN distance", "nn_distance", 2), ("precision", "precision", 3), ("C2ST", "c2st", 3)]
    print(f"\n{'':<24}{'n':>5}" + "".join(f"{c:>18}" for c, _, _ in cols) + f"{'max share':>11}")
    for k, r in rows.items():
        print(f"{k:<24}{r['n']:>5}" + "".join(f"{r[m]:>10.{d}f} ± {r[m + '_se']:<5.{d}f}" for _, m, d in cols)
              + f"{r['max_share']:>11.3f}")
    print(f"\ngrey share of the 500 test digits: {grey_ref:.3f}; the column below is the distance to it")
    print(f"z of each row against {hi} (positive: the row is better; > 2 in size: the run separates them)")
    print(f"{'':<24}" + "".join(f"{c:>13}" for c, _, _ in cols))
    for k, r in rows.items():
        if k == hi: continue
        gap = lambda m: "grey_gap" if m == "grey_share" else m   # the grey share's column: its distance to real
        zs = [(r[gap(m)] - rows[hi][gap(m)]) / math.hypot(r[m + "_se"], rows[hi][m + "_se"])
              * (1 if MEASURES[gap(m)] else -1) for _, m, _ in cols]
        print(f"{k:<24}" + "".join(f"{z:>13.1f}" for z in zs))
    print(f"\nwritten {a.out / 'preview.json'} and {a.out / 'samples.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
