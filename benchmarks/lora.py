"""LoRA against full fine-tuning of unit 4's base UNet: trainable parameters, file size, training state, peak
memory (the tensors of one training step measured by `course_lib.lora.metrics.PeakMemory` plus the weights, as in
notebook 42; and the peak RSS of a fresh process, or the CUDA peak on a GPU) and seconds per step, with ratios to
full fine-tuning measured in the same run. The base weights are random (timing and memory do not depend on them).

    python benchmarks/lora.py [--steps 20] [--batch-size 16] [--rank 8]
"""
import argparse, json, os, resource, subprocess, sys, time


def one(mode: str, steps: int, batch_size: int, rank: int) -> dict:
    import copy, torch
    from course_lib.ddpm import make_unet
    from course_lib.lora import add_lora, LORA_TARGETS
    from course_lib.lora import base_config
    from course_lib.lora import adapter_file_bytes, PeakMemory
    from course_lib.core import get_device
    dev = get_device()
    cfg = base_config(1)
    torch.manual_seed(0)
    unet = make_unet(cfg).to(dev)
    base_n = sum(p.numel() for p in unet.parameters())
    if mode == "lora": add_lora(unet, rank, float(rank), LORA_TARGETS)
    else: unet.requires_grad_(True)
    params = [p for p in unet.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    x = torch.randn(batch_size, 1, cfg.image_size, cfg.image_size, device=dev)
    y = torch.randint(0, 9, (batch_size,), device=dev)
    t = torch.randint(0, 1000, (batch_size,), device=dev)
    if dev.type == "cuda": torch.cuda.reset_peak_memory_stats()
    weights = sum(p.numel() * p.element_size() for p in unet.parameters())
    with PeakMemory() as pm:                                   # one step, tracked (slow: not timed)
        loss = (unet(x, t, class_labels=y).sample - x).pow(2).mean()
        loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
    for i in range(steps + 3):
        if i == 3: t0 = time.perf_counter()
        loss = (unet(x, t, class_labels=y).sample - x).pow(2).mean()
        loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
    if dev.type == "cuda": torch.cuda.synchronize()
    sps = (time.perf_counter() - t0) / steps
    state = sum(p.numel() * p.element_size() * 2 for p in params)
    state += sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.ndim)
    peak = torch.cuda.max_memory_allocated() if dev.type == "cuda" else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"mode": mode, "trainable": sum(p.numel() for p in params), "base": base_n, "s_per_step": sps,
            "file_bytes": adapter_file_bytes(unet, full=mode == "full"), "train_state_bytes": state,
            "step_peak_bytes": weights + pm.peak, "peak_bytes": peak,
            "device": str(dev)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20); p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--rank", type=int, default=8); p.add_argument("--one", choices=["lora", "full"], help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.one:
        print(json.dumps(one(a.one, a.steps, a.batch_size, a.rank))); return 0
    rows = {}
    for mode in ("full", "lora"):      # each in a fresh process, so that peak RSS is its own
        out = subprocess.run([sys.executable, __file__, "--one", mode, "--steps", str(a.steps), "--batch-size",
                              str(a.batch_size), "--rank", str(a.rank)], capture_output=True, text=True, check=True)
        rows[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    f, l = rows["full"], rows["lora"]
    print(f"unit 4 base UNet ({f['base']:,} parameters), batch {a.batch_size}, {a.steps} steps, rank {a.rank}, {f['device']}")
    print(f"{'':<22} {'full':>12} {'LoRA':>12} {'LoRA/full':>10}")
    for k, label, scale in [("trainable", "trainable params", 1), ("file_bytes", "file (KB)", 1024),
                            ("train_state_bytes", "train state (MB)", 2**20),
                            ("step_peak_bytes", "peak tensors (MB)", 2**20),
                            ("peak_bytes", "peak RSS/CUDA (MB)", 2**20),
                            ("s_per_step", "s / step", 1)]:
        print(f"{label:<22} {f[k] / scale:>12.4g} {l[k] / scale:>12.4g} {l[k] / f[k]:>10.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
