"""Unit 1 (DDPM) benchmark: the overhead of `train_ddpm` against a bare training loop on the same model and
batch, sampling seconds per image for each sampler and step count, and peak memory.

    python benchmarks/ddpm.py                 # DDPMConfig.quick(), about 2-3 minutes on 2 CPU cores
    python benchmarks/ddpm.py --full          # the course model DDPMConfig()
    python benchmarks/ddpm.py --steps 100 --n 128

Target: train_ddpm's images/s at most 5% below the bare loop's (it adds Accelerate, EMA, gradient clipping,
the LR schedule, per-step reseeding and the NaN check)."""
import argparse, gc, resource, sys, time

import torch
import torch.nn.functional as F

from course_lib.ddpm import DDPMConfig, make_scheduler, make_unet, sample, train_ddpm
from course_lib.data import Digits


def peak_mb() -> float:
    "Peak memory so far: CUDA allocator peak on a GPU, else the process's peak resident set size (MB)."
    if torch.cuda.is_available(): return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def bare_loop(cfg: DDPMConfig, steps: int) -> float:
    "Images per second of the plainest loop: same model, batch, noise and loss; no EMA, clipping, schedule or Accelerate."
    torch.manual_seed(cfg.seed)
    model = make_unet(cfg).train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    sched = cfg.schedule()
    x_all = Digits("train", size=cfg.image_size).images
    g = torch.Generator().manual_seed(0)
    t0 = time.time()
    for _ in range(steps):
        x0 = x_all[torch.randint(0, len(x_all), (cfg.batch_size,), generator=g)]
        t = torch.randint(0, cfg.num_train_timesteps, (cfg.batch_size,), generator=g)
        eps = torch.randn(x0.shape, generator=g)
        target = sched.velocity(x0, eps, t) if cfg.prediction_type == "v_prediction" else eps
        loss = F.mse_loss(model(sched.q_sample(x0, t, eps), t).sample, target)
        opt.zero_grad(set_to_none=True); loss.backward(); opt.step()
        loss.item()
    return steps * cfg.batch_size / (time.time() - t0)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--full", action="store_true", help="benchmark the course model DDPMConfig() instead of DDPMConfig.quick()")
    p.add_argument("--steps", type=int, default=40, help="training steps timed per loop (after 3 warm-up steps)")
    p.add_argument("--n", type=int, default=64, help="images per sampling run")
    p.add_argument("--repeats", type=int, default=2, help="alternating repeats of each training loop (best kept)")
    a = p.parse_args(argv)
    if a.steps < 5 or a.n < 1: p.error("--steps must be >= 5 and --n >= 1")
    cfg = DDPMConfig() if a.full else DDPMConfig.quick()
    cfg = DDPMConfig(**{**cfg.to_dict(), "steps": a.steps})
    print(f"config {cfg.key()}: block_out_channels={cfg.block_out_channels}, batch {cfg.batch_size}, "
          f"{cfg.image_size}x{cfg.image_size}, torch threads {torch.get_num_threads()}")
    bare_loop(cfg, 3); train_ddpm(DDPMConfig(**{**cfg.to_dict(), "steps": 3}), progress=False)    # warm-up
    ours, bare = [], []
    for _ in range(a.repeats):                        # alternate to share out background load fairly
        bare.append(bare_loop(cfg, a.steps))
        ours.append(train_ddpm(cfg, progress=False).history["images_per_second"])
    b, o = max(bare), max(ours)
    overhead = 1 - o / b
    print("\ntraining throughput (images/s, best of repeats)")
    print(f"| loop | images/s | ratio to bare |\n|---|---|---|\n| bare loop | {b:.1f} | 1.000 |\n| train_ddpm | {o:.1f} | {o / b:.3f} |")
    print(f"overhead of train_ddpm: {100 * overhead:.1f}% (target <= 5%): {'ok' if overhead <= 0.05 else 'ABOVE TARGET'}")
    mem_train = peak_mb()

    torch.manual_seed(0)
    model = make_unet(cfg).eval()
    print(f"\nsampling {a.n} images (untrained weights: the cost does not depend on them)")
    print("| sampler | steps | s/image | ratio to DDPM ancestral, same steps |\n|---|---|---|---|")
    for steps in (10, 20, 50):
        base = None
        for kind in ("ancestral", "ddpm", "ddim", "dpm++"):
            t0 = time.time()
            sample(model, make_scheduler(kind, cfg), a.n, steps, generator=torch.Generator().manual_seed(0))
            s = (time.time() - t0) / a.n
            base = base or s
            print(f"| {kind} | {steps} | {s:.5f} | {s / base:.2f} |")
    print(f"\npeak memory: {mem_train:.0f} MB after training, {peak_mb():.0f} MB after sampling "
          f"({'CUDA allocator' if torch.cuda.is_available() else 'process peak RSS'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
