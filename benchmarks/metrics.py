"""Unit 3 (evaluation) benchmark: the Fréchet distance on Inception-sized (2048-d) statistics with our
symmetric method and torch-fidelity's eigvals method against `scipy.linalg.sqrtm` (pytorch-fid's / TTUR's
route), and feature extraction in images per second (our direct loop against torch-fidelity's pipeline).

    python benchmarks/metrics.py                  # 2048-d, about 1-2 minutes on 2 idle CPU cores
    python benchmarks/metrics.py --dim 512        # smaller, for a quick look
    python benchmarks/metrics.py --threads 1      # pin BLAS/torch to one thread (fairer on a loaded machine)

Target: the symmetric method at least 5x faster than sqrtm at 2048-d, with the same result within 1e-6 relative."""
import argparse, os, sys, time


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dim", type=int, default=2048, help="feature dimension of the statistics")
    p.add_argument("--repeats", type=int, default=1, help="timed repeats per method (best kept)")
    p.add_argument("--threads", type=int, default=None, help="BLAS / torch threads (default: the library defaults)")
    p.add_argument("--batch-size", type=int, default=256, help="feature extraction batch size")
    a = p.parse_args(argv)
    if a.threads:
        for v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"): os.environ[v] = str(a.threads)
    import numpy as np, torch
    if a.threads: torch.set_num_threads(a.threads)
    from course_lib.frechet import FD_METHODS, frechet_distance

    # ---- Fréchet distance on d-dimensional statistics (covariances of ReLU-like features, full rank)
    rng = np.random.default_rng(0)
    d = a.dim
    A = np.abs(rng.standard_normal((d + d // 2, d)))
    B = np.abs(rng.standard_normal((d + d // 2, d)) * 1.05 + 0.02)
    mu1, mu2 = A.mean(0), B.mean(0)
    s1, s2 = np.cov(A, rowvar=False), np.cov(B, rowvar=False)
    times, vals = {}, {}
    for m in ("sqrtm", "eigvals", "symmetric"):          # baseline first
        best = float("inf")
        for _ in range(a.repeats):
            t0 = time.perf_counter(); vals[m] = frechet_distance(mu1, s1, mu2, s2, m); best = min(best, time.perf_counter() - t0)
        times[m] = best
    print(f"Fréchet distance, {d}-d statistics (baseline: scipy.linalg.sqrtm)")
    print(f"{'method':>10} {'seconds':>9} {'speed-up':>9} {'FID':>16} {'rel. diff':>10}")
    for m in ("sqrtm", "eigvals", "symmetric"):
        print(f"{m:>10} {times[m]:9.3f} {times['sqrtm'] / times[m]:8.1f}x {vals[m]:16.8f} "
              f"{abs(vals[m] - vals['sqrtm']) / abs(vals['sqrtm']):10.2e}")
    speedup = times["sqrtm"] / times["symmetric"]
    same = abs(vals["symmetric"] - vals["sqrtm"]) / abs(vals["sqrtm"]) < 1e-6
    print(f"target >= 5x at equal result (1e-6): {'met' if speedup >= 5 and same else 'NOT met'} "
          f"({speedup:.1f}x, equal: {same})\n")

    # ---- feature extraction, images per second
    import torch_fidelity
    from course_lib.metrics import DIGITS_EXTRACTOR, UInt8Images, as_uint8_images, get_extractor
    x = as_uint8_images("digits-all")
    fe = get_extractor("digits", device="cpu")
    with torch.no_grad(): fe(x[:64])                      # warm-up
    t0 = time.perf_counter()
    with torch.no_grad():
        for b in x.split(a.batch_size): fe(b)
    ours = len(x) / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    torch_fidelity.calculate_metrics(input1=UInt8Images(x), isc=True, feature_extractor=DIGITS_EXTRACTOR, cuda=False,
                                     batch_size=a.batch_size, save_cpu_ram=True, cache=False, verbose=False, isc_splits=10)
    tf = len(x) / (time.perf_counter() - t0)
    print(f"feature extraction, digits extractor, {len(x)} images of 16x16, batch {a.batch_size} (baseline: torch-fidelity pipeline)")
    print(f"{'pipeline':>24} {'images/s':>10} {'ratio':>7}")
    print(f"{'torch-fidelity (IS)':>24} {tf:10.0f} {1.0:6.2f}x")
    print(f"{'direct extractor loop':>24} {ours:10.0f} {ours / tf:6.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
