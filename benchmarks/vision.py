"""Inference throughput of a course vision model: images/s for eager fp32, channels_last, bf16 autocast,
TorchScript and ONNX Runtime at batch sizes 1 to 256, with ratios against eager fp32 measured in the same run,
and a check that `course_lib.vision.inference.choose_batch_size` picks a batch size within 10% of the best throughput.
With `--quant` (CPU only), int8 beside them: dynamic int8 of the Linear layers (eager) and static int8 by torchao's
PT2E flow compiled with Inductor, against eager and compiled fp32, with the int8/fp32 ratios in the same execution
mode. The static model is calibrated on random images: its latency is what is measured here, not its accuracy
(lesson 52 measures both on real images).

    python benchmarks/vision.py                        # course_resnet_32 on the default device
    python benchmarks/vision.py --model course_vit_32 --threads 1 --min-time 0.5
    python benchmarks/vision.py --quant --threads 1 --batch-sizes 1,8,64
    python benchmarks/vision.py --train --batch-sizes 8,32,128,256

With --train: training throughput instead (forward, cross-entropy, backward and an AdamW step on random batches, as
timm's benchmark.py measures it, `course_lib.vision.recipe.train_images_per_second`) in fp32 and, where the device
has it (`bf16_supported`), under bf16 autocast, with the bf16 / fp32 ratio per batch size measured in the same run.

"""
import argparse, copy, sys, tempfile, warnings
from pathlib import Path

import torch

from course_lib.core import get_device
from course_lib.vision import (
    bf16_supported, choose_batch_size, export_onnx, export_torchscript, images_per_second,
    model_data_config, onnx_session)
from course_lib.vision.recipe import train_images_per_second
import timm


def train_table(model, sizes, device, min_time) -> int:
    "Print training images/s per batch size in fp32 and bf16 autocast (where supported), and their ratio."
    precisions = {"fp32": None}
    if bf16_supported(device): precisions["bf16 autocast"] = torch.bfloat16
    else: print(f"# bf16 autocast skipped: {device} has no native bfloat16 (bf16_supported)")
    table = {p: {} for p in precisions}
    for b in sizes:                                   # the precisions side by side, batch size by batch size
        for p, dtype in precisions.items():
            try: table[p][b] = train_images_per_second(model, b, dtype, min_time=min_time)
            except RuntimeError as e:
                if "out of memory" not in str(e).lower(): raise
    print(f"{'precision':<15}" + "".join(f"{b:>10}" for b in sizes))
    for p, row in table.items():
        print(f"{p:<15}" + "".join(f"{row[b]:>10.0f}" if b in row else f"{'-':>10}" for b in sizes))
    if "bf16 autocast" in table:
        bf, fp = table["bf16 autocast"], table["fp32"]
        print(f"{'bf16 / fp32':<15}" + "".join(f"{bf[b] / fp[b]:>10.2f}" if b in bf and b in fp else f"{'-':>10}"
                                               for b in sizes))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="course_resnet_32")
    p.add_argument("--batch-sizes", default="1,2,4,8,16,32,64,128,256")
    p.add_argument("--min-time", type=float, default=0.4, help="seconds of timing per measurement")
    p.add_argument("--threads", type=int, default=None, help="torch and onnxruntime CPU threads (default: torch's)")
    p.add_argument("--device", default=None)
    p.add_argument("--quant", action="store_true", help="add dynamic and static int8 (CPU only)")
    p.add_argument("--train", action="store_true",
                   help="training throughput (forward, backward, AdamW step) in fp32 and bf16 instead of inference")
    a = p.parse_args(argv)
    if a.threads: torch.set_num_threads(a.threads)
    threads = torch.get_num_threads()
    device = get_device(a.device)
    sizes = [int(b) for b in a.batch_sizes.split(",")]
    if a.quant and device.type != "cpu":
        p.error(f"--quant measures CPU int8 kernels, and the device is {device}: add --device cpu")
    torch.manual_seed(0)
    model = timm.create_model(a.model, num_classes=10).eval().to(device)
    shape = model_data_config(model)["input_size"]
    ex = torch.randn(2, *shape)
    if a.train:
        print(f"# {a.model}, input {tuple(shape)}, device {device}, {threads} CPU thread(s); training images/s "
              "(forward + cross-entropy + backward + AdamW step, random batches)")
        return train_table(model, sizes, device, a.min_time)

    def eager(m, amp=None, cl=False):
        if cl: m = copy.deepcopy(m).to(memory_format=torch.channels_last)
        def fn(x):
            if cl: x = x.contiguous(memory_format=torch.channels_last)
            with torch.no_grad(), torch.autocast(device.type, dtype=amp, enabled=amp is not None):
                return m(x)
        return fn

    tmp = Path(tempfile.mkdtemp())
    variants = {"eager fp32": (eager(model), device), "channels_last": (eager(model, cl=True), device)}
    if bf16_supported(device): variants["bf16 autocast"] = (eager(model, amp=torch.bfloat16), device)
    ts_path, ts_diff = export_torchscript(model, tmp / "m.pt", ex)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ts = torch.jit.load(str(ts_path)).to(device)
    def ts_fn(x):
        with torch.no_grad(): return ts(x)
    variants["TorchScript"] = (ts_fn, device)
    onnx_path, onnx_diff = export_onnx(model, tmp / "m.onnx", ex)
    sess = onnx_session(onnx_path, threads=threads if device.type == "cpu" else None)
    variants["ONNX Runtime"] = (lambda x: sess.run(None, {"x": x.numpy()}), torch.device("cpu"))
    if a.quant: variants.update(int8_variants(model, shape, eager))

    table = {}
    for name, (fn, dev) in variants.items():
        table[name] = {}
        for b in sizes:
            x = torch.randn(b, *shape, device=dev)
            try: table[name][b] = images_per_second(fn, x, min_time=a.min_time)
            except RuntimeError as e:
                if "out of memory" not in str(e).lower(): raise
                break
    base = table["eager fp32"]
    print(f"# {a.model}, input {tuple(shape)}, device {device}, {threads} CPU thread(s); images/s "
          f"(x ratio to eager fp32 at the same batch size)")
    print(f"# export check: TorchScript max|diff| {ts_diff:.1e}, ONNX max|diff| {onnx_diff:.1e} (target <= 1e-4)")
    print(f"{'variant':<15}" + "".join(f"{b:>16}" for b in sizes))
    for name, row in table.items():
        cells = [f"{row[b]:9.0f} x{row[b] / base[b]:4.2f}" if b in row and b in base else f"{'-':>14}" for b in sizes]
        print(f"{name:<15}" + "".join(f"{c:>16}" for c in cells))
    if a.quant:
        print("\n# int8 against fp32 in the same execution mode: x ratio of images/s")
        for q, ref in (("dynamic int8", "eager fp32"), ("static int8", "fp32 compiled")):
            ratios = [f"batch {b} x{table[q][b] / table[ref][b]:.2f}" for b in sizes
                      if b in table[q] and b in table[ref]]
            print(f"{q} / {ref}: " + ", ".join(ratios))
    best_b = max(base, key=base.get)
    chosen, _ = choose_batch_size(variants["eager fp32"][0], shape, sizes, device=device, min_time=a.min_time)
    ratio = base[chosen] / base[best_b]
    print(f"\nchoose_batch_size (its own measurement) picked {chosen}; in this sweep it gives {base[chosen]:.0f} images/s, "
          f"{100 * ratio:.1f}% of the best ({base[best_b]:.0f} images/s at batch {best_b}): "
          f"{'within' if ratio >= 0.9 else 'NOT within'} 10%")
    return 0 if ratio >= 0.9 else 1


def int8_variants(model, shape, eager) -> dict:
    "Dynamic int8 (eager), fp32 and static int8 compiled by `compile_cpu`: name -> (fn, device)."
    from course_lib.vision import compile_cpu, quantize_int8, static_int8
    cpu = copy.deepcopy(model).cpu().eval()
    calib = torch.randn(64, *shape)                 # latency only: any images calibrate the ranges
    out = {"dynamic int8": (eager(quantize_int8(cpu)), torch.device("cpu"))}
    for name, m in (("fp32 compiled", cpu), ("static int8", static_int8(cpu, calib))):
        fn, how = compile_cpu(m, calib[:2])
        if how != "compiled": print(f"# {name}: {how}")
        out[name] = (fn, torch.device("cpu"))
    return out


if __name__ == "__main__":
    sys.exit(main())
