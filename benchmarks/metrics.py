"""Unit 3 (evaluation) benchmark: the Fréchet distance on Inception-sized (2048-d) statistics with our
symmetric method and torch-fidelity's eigvals method against `scipy.linalg.sqrtm` (pytorch-fid's / TTUR's
route), and feature extraction in images per second through the paths the course takes (`extract_features`,
behind `course fid`; `evaluate`) against torch-fidelity's own pipeline on the same extractor.

    python benchmarks/metrics.py                  # 2048-d, about 1-2 minutes on 2 idle CPU cores
    python benchmarks/metrics.py --dim 512        # smaller, for a quick look
    python benchmarks/metrics.py --threads 1      # pin BLAS/torch to one thread (fairer on a loaded machine)

Targets: the symmetric method at least 5x faster than sqrtm at 2048-d, with the same result within 1e-6
relative; every course path at least as fast as torch-fidelity's pipeline (ratio >= 1.0, within noise).
Feature extraction is timed interleaved, `--repeats` rounds (best of each kept), so that a busy machine
slows every path alike."""
import argparse, os, sys, time


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dim", type=int, default=2048, help="feature dimension of the statistics")
    p.add_argument("--repeats", type=int, default=5, help="timed rounds per method (best kept)")
    p.add_argument("--threads", type=int, default=None, help="BLAS / torch threads (default: the library defaults)")
    p.add_argument("--batch-size", type=int, default=256, help="feature extraction batch size")
    a = p.parse_args(argv)
    if a.threads:
        for v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"): os.environ[v] = str(a.threads)
    import numpy as np, torch
    if a.threads: torch.set_num_threads(a.threads)
    from course_lib.metrics import frechet_distance

    # ---- Fréchet distance on d-dimensional statistics (covariances of ReLU-like features, full rank)
    rng = np.random.default_rng(0)
    d = a.dim
    A = np.abs(rng.standard_normal((d + d // 2, d)))
    B = np.abs(rng.standard_normal((d + d // 2, d)) * 1.05 + 0.02)
    mu1, mu2 = A.mean(0), B.mean(0)
    s1, s2 = np.cov(A, rowvar=False), np.cov(B, rowvar=False)
    times, vals = {}, {}
    for m in ("sqrtm", "eigvals", "symmetric"):          # baseline first
        t0 = time.perf_counter()
        vals[m] = frechet_distance(mu1, s1, mu2, s2, m)
        times[m] = time.perf_counter() - t0
    print(f"Fréchet distance, {d}-d statistics (baseline: scipy.linalg.sqrtm)")
    print(f"{'method':>10} {'seconds':>9} {'speed-up':>9} {'FID':>16} {'rel. diff':>10}")
    for m in ("sqrtm", "eigvals", "symmetric"):
        print(f"{m:>10} {times[m]:9.3f} {times['sqrtm'] / times[m]:8.1f}x {vals[m]:16.8f} "
              f"{abs(vals[m] - vals['sqrtm']) / abs(vals['sqrtm']):10.2e}")
    speedup = times["sqrtm"] / times["symmetric"]
    same = abs(vals["symmetric"] - vals["sqrtm"]) / abs(vals["sqrtm"]) < 1e-6
    print(f"target >= 5x at equal result (1e-6): {'met' if speedup >= 5 and same else 'NOT met'} "
          f"({speedup:.1f}x, equal: {same})\n")

    # ---- feature extraction, images per second, through each path
    import torch_fidelity
    from course_lib.metrics import DIGITS_EXTRACTOR, UInt8Images, as_uint8_images, evaluate, extract_features
    x = as_uint8_images("digits-all")
    bs = a.batch_size
    paths = {
        "torch-fidelity (FID+IS)": lambda: torch_fidelity.calculate_metrics(
            input1=UInt8Images(x), input2=UInt8Images(x), fid=True, isc=True, feature_extractor=DIGITS_EXTRACTOR,
            cuda=False, batch_size=bs, save_cpu_ram=True, cache=False, verbose=False, isc_splits=10),
        "evaluate (FID+IS)": lambda: evaluate(x, x, metrics=("fid", "isc"), batch_size=bs, cache_reference=False),
        "extract_features x2": lambda: [extract_features(x, batch_size=bs) for _ in range(2)],
    }
    for f in paths.values(): f()                          # warm-up: models loaded, kernels chosen
    best = {k: float("inf") for k in paths}
    for _ in range(a.repeats):                            # interleaved rounds
        for k, f in paths.items():
            t0 = time.perf_counter(); f(); best[k] = min(best[k], time.perf_counter() - t0)
    base = "torch-fidelity (FID+IS)"
    n = 2 * len(x)                                        # every path extracts features of both sets
    print(f"feature extraction, digits extractor, 2 x {len(x)} images of 16x16, batch {bs}, "
          f"best of {a.repeats} (baseline: torch-fidelity's pipeline)")
    print(f"{'path':>26} {'images/s':>10} {'ratio':>7}")
    for k in paths: print(f"{k:>26} {n / best[k]:10.0f} {best[base] / best[k]:6.2f}x")
    slow = [k for k in paths if best[base] / best[k] < 0.9]
    print(f"target: every path >= torch-fidelity's speed (0.9x noise margin): {'NOT met: ' + str(slow) if slow else 'met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
