"""What the device probe (course_lib.core.device_probe) costs: every operation of a probed process passes through
Python, so the lessons the tests run under the probe take longer than on the plain CPU.

    python benchmarks/device_probe.py [--steps 30]

Each row times the same training step (a small diffusers UNet2DModel on a batch of 64 8x8 images: forward,
backward, AdamW) in a process of its own (the probe is a setting of the whole process): on the plain CPU, under
the probe, and under the probe with its per-op bookkeeping written as it first was (torch.utils._pytree over every
call's arguments and results, PyTorch's `return_and_correct_aliasing` after every op), the baseline the probe's
notebook (09_device_probe) compares against. `x cpu` is the row's time over the plain CPU's. Run it alone: other
processes on the cores change the figures."""
import argparse, json, subprocess, sys

CHILD = r"""
import json, sys, time, torch
mode, steps = sys.argv[1], int(sys.argv[2])
dev = "cpu"
if mode != "cpu":
    import course_lib.core.device_probe as p
    if mode == "probe-pytree":
        from torch.utils._pytree import tree_flatten, tree_map
        p._leaves = lambda args, kwargs: tree_flatten((args, kwargs))[0]
        p._unwrap = lambda a: tree_map(lambda x: x.elem if isinstance(x, p.ProbeTensor) else x, a)
        p._wrap = lambda o: tree_map(lambda x: p.ProbeTensor(x) if type(x) is torch.Tensor else x, o)
        p._aliases = lambda func: "other"
    p.install("cuda", "native")
    dev = "cuda"
from diffusers import UNet2DModel
torch.manual_seed(0)
m = UNet2DModel(sample_size=8, in_channels=1, out_channels=1, block_out_channels=(32, 64), layers_per_block=1,
                down_block_types=("DownBlock2D", "AttnDownBlock2D"), up_block_types=("AttnUpBlock2D", "UpBlock2D"),
                norm_num_groups=8).to(dev)
opt = torch.optim.AdamW(m.parameters(), 1e-3)
x = torch.randn(64, 1, 8, 8, device=dev)
def step():
    t = torch.randint(0, 1000, (64,), device=dev)
    loss = (m(x, t).sample - x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item()
for _ in range(3): step()
t0 = time.perf_counter()
for _ in range(steps): step()
print(json.dumps({"ms": (time.perf_counter() - t0) / steps * 1000}))
"""

ROWS = [("cpu", "plain CPU"), ("probe", "under the probe"), ("probe-pytree", "probe, pytree bookkeeping")]


def main(argv=None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    a = p.parse_args(argv)
    ms = {}
    for mode, _ in ROWS:
        r = subprocess.run([sys.executable, "-c", CHILD, mode, str(a.steps)], capture_output=True, text=True,
                           check=True)
        ms[mode] = json.loads(r.stdout.strip().splitlines()[-1])["ms"]
    print(f"{'training step':28s} {'ms':>8s} {'x cpu':>7s}")
    for mode, name in ROWS:
        print(f"{name:28s} {ms[mode]:8.1f} {ms[mode] / ms['cpu']:7.2f}")
    return ms


if __name__ == "__main__":
    main()
