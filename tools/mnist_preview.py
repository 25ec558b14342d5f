#!/usr/bin/env python3
"""Does real 28x28 MNIST give unit 1's sampler table room to rank? The shipped MNIST DDPM, sampled and judged.

    python tools/mnist_preview.py [--n 256] [--steps 10 100 1000] [--out runs/mnist-preview]

Loads the DDPM of `tools/ship_pretrained.py --only ddpm-mnist` (`DDPM_MNIST`, trained on the 4,000 training digits
of `course_lib.data.mnist`), trains a judge of its own (the course's `DigitsClassifier` on the same training split,
augmented, without label smoothing, so a confident rate of the real digits is not capped by the smoothing), and
samples `--n` images with the ancestral sampler (`make_scheduler('ancestral')`) at each of `--steps`, all from the
same noise. For each, and for the held-out test digits: the judge's confident rate (max probability >= 0.9), the
mean log-probability of its top class, the mean entropy, the largest class share and FID on the judge's
features against the training digits (bootstrap standard error), each with its standard error; uniform noise
as a row of its own (a classifier is confident on noise: its confident rate alone cannot catch a bad model); then
the verdicts
(`course_lib.core.compare.verdict`) of the fewest steps against the most and of the most against the real digits.
Prints a table and writes `OUT/preview.json` and `OUT/samples.png`. The evidence behind moving lessons 11-13 to MNIST;
not run by the tests. About 10 minutes on 2 idle cores at the defaults (most of it the 1000 steps)."""
from __future__ import annotations

import argparse, json, math, sys, time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))


def train_judge(epochs: int = 15, seed: int = 0):
    "A `DigitsClassifier` trained on MNIST's training split (augmented; no label smoothing), and its test accuracy."
    import torch
    import torch.nn.functional as F
    from course_lib.data.mnist import MNIST
    from course_lib.ddpm.classifier import DigitsClassifier, accuracy, augment
    torch.manual_seed(seed)
    train, test = MNIST("train"), MNIST("test")
    model, g = DigitsClassifier(), torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=1e-4)
    steps = epochs * math.ceil(len(train) / 64)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, 3e-3, total_steps=steps)
    model.train()
    for _ in range(epochs):
        for idx in torch.randperm(len(train), generator=g).split(64):
            loss = F.cross_entropy(model(augment(train.images[idx], g)), train.labels[idx])
            opt.zero_grad(); loss.backward(); opt.step(); sched.step()
    model.eval()
    return model, accuracy(model, test)


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


def judged(x, judge, ref=None) -> dict:
    """Confident rate, mean top-class log-probability, mean entropy (bits) and, given the training digits'
    features `ref`, FID on the judge's features, of images `x`, each with its standard error."""
    import torch
    import torch.nn.functional as F
    if x.dtype == torch.uint8: x = x.float() / 127.5 - 1
    with torch.no_grad():
        logp = torch.cat([F.log_softmax(judge(x[i:i + 512]), -1) for i in range(0, len(x), 512)]).double()
    top = logp.max(1).values
    conf = (top >= math.log(0.9)).double()
    ent = -(logp.exp() * logp).sum(1) / math.log(2)
    se = lambda v: float(v.std() / math.sqrt(len(v)))
    out = {"n": len(x), "confident_rate": float(conf.mean()), "confident_rate_se": se(conf),
           "top_logp": float(top.mean()), "top_logp_se": se(top), "entropy": float(ent.mean()),
           "entropy_se": se(ent), "max_share": float(torch.bincount(logp.argmax(1), minlength=10).max() / len(x))}
    if ref is not None: out["fid"], out["fid_se"] = fid_with_se(features(x, judge), ref)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=256, help="samples per sampler setting")
    p.add_argument("--steps", type=int, nargs="+", default=[10, 100, 1000])
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "mnist-preview")
    a = p.parse_args(argv)
    import torch
    from ship_pretrained import DDPM_MNIST
    from course_lib.core.compare import verdict
    from course_lib.data.mnist import MNIST
    from course_lib.ddpm import DDPMConfig, load_pretrained_ddpm, make_scheduler, sample
    from course_lib.ddpm import ddpm_is_cached
    cfg, data = DDPMConfig(**DDPM_MNIST), MNIST("train", size=28)
    if not ddpm_is_cached(cfg, dataset=data):
        sys.exit("the MNIST DDPM is neither shipped nor cached: COURSE_LIB_HOME=<scratch> python "
                 "tools/ship_pretrained.py --only ddpm-mnist")
    a.out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    judge, acc = train_judge()
    print(f"judge: test accuracy {acc:.4f} ({time.time() - t0:.0f} s)", flush=True)
    model = load_pretrained_ddpm(cfg, dataset=data, progress=False)
    ref = features(data.images, judge)
    test = MNIST("test").images
    rows = {"real test digits": judged(test[torch.randperm(len(test), generator=torch.Generator().manual_seed(0))[:a.n]],
                                       judge, ref),
            "uniform noise": judged(torch.rand(a.n, 1, 28, 28, generator=torch.Generator().manual_seed(0)) * 2 - 1,
                                    judge, ref)}
    shown = {}
    for steps in a.steps:
        t1 = time.time()
        x, _ = sample(model, make_scheduler("ancestral", cfg), a.n, steps, generator=torch.Generator().manual_seed(0))
        rows[f"ancestral {steps} steps"] = {**judged(x, judge, ref), "seconds": round(time.time() - t1, 1)}
        shown[steps] = x[:32].float() / 255
        print(f"ancestral {steps}: {rows[f'ancestral {steps} steps']}", flush=True)
    lo, hi = f"ancestral {min(a.steps)} steps", f"ancestral {max(a.steps)} steps"
    verdicts = {}
    for key in ("confident_rate", "top_logp", "fid"):
        better = key != "fid"
        verdicts[f"{key}: fewest vs most steps"] = verdict(lo, rows[lo][key], rows[lo][key + "_se"],
                                                           hi, rows[hi][key], rows[hi][key + "_se"],
                                                           higher_is_better=better)
        verdicts[f"{key}: most steps vs real"] = verdict(hi, rows[hi][key], rows[hi][key + "_se"], "real digits",
                                                         rows["real test digits"][key],
                                                         rows["real test digits"][key + "_se"],
                                                         higher_is_better=better)
    out = {"judge_test_accuracy": acc, "config": {k: list(v) if isinstance(v, tuple) else v
                                                   for k, v in DDPM_MNIST.items()},
           "rows": rows, "verdicts": verdicts}
    (a.out / "preview.json").write_text(json.dumps(out, indent=1))
    import matplotlib; matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(len(shown), 1, figsize=(12, 1.6 * len(shown)))
    for ax, (steps, x) in zip(axes if len(shown) > 1 else [axes], shown.items()):
        ax.imshow(torch.cat(list(x[:, 0]), 1).numpy(), cmap="gray"); ax.set_axis_off()
        ax.set_title(f"ancestral, {steps} steps", fontsize=9)
    fig.savefig(a.out / "samples.png", dpi=100, bbox_inches="tight")
    print(f"\n{'':<22}{'n':>6}{'confident':>18}{'top log p':>20}{'entropy (bits)':>20}{'max share':>11}"
          f"{'FID (judge)':>20}")
    for k, r in rows.items():
        print(f"{k:<22}{r['n']:>6}{r['confident_rate']:>10.3f} ± {r['confident_rate_se']:.3f}"
              f"{r['top_logp']:>12.3f} ± {r['top_logp_se']:.3f}{r['entropy']:>12.3f} ± {r['entropy_se']:.3f}"
              f"{r['max_share']:>11.3f}{r['fid']:>12.2f} ± {r['fid_se']:.2f}")
    print()
    for k, v in verdicts.items(): print(f"{k}: {v}")
    print(f"\nwritten {a.out / 'preview.json'} and {a.out / 'samples.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
