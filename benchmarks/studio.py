"""The LoRA studio's overhead: steps per second of a run started from the studio (`Studio.start`: a background
thread, the live status, the file lock) against the headless trainers it calls (`train_lora_run` for unit 4,
`train_flux_lora` for unit 7), on the same base, images and settings, in the same process, runs alternated.

    python benchmarks/studio.py                  # the small untrained bases of tests/test_studio.py, ~1 minute
    python benchmarks/studio.py --steps 200 --repeat 3

Target: the studio at most 5% below the headless trainer (the ratio printed is studio / headless)."""
import argparse, copy, json, tempfile
from pathlib import Path

from course_lib.flux_lora_train import FluxLoRAConfig, train_flux_lora, write_corner_folder
from course_lib.lora_command import LoRATrainConfig, train_lora_run
from course_lib.studio import Studio, tiny_bases


def steps_per_s(history: list[dict], skip: int = 5) -> float:
    "Steps per second over the history after the first `skip` steps (warm-up)."
    h = history[skip:]
    return (len(h) - 1) / (h[-1]["seconds"] - h[0]["seconds"])


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--repeat", type=int, default=2)
    a = p.parse_args(argv)
    work = Path(tempfile.mkdtemp())
    st = Studio(work/"studio", tiny_bases())
    st.add_images(sorted(write_corner_folder(work/"digits", n=8, pixels=16).glob("*.png")))
    st.set_captions({n: "a photo of sks digit" for n in st.captions()})
    cfgs = {"unet": LoRATrainConfig(rank=4, steps=a.steps, batch_size=4, prior_images=0, preview_every=0),
            "flux": FluxLoRAConfig(rank=4, alpha=4.0, steps=a.steps, batch_size=4, checkpoint_every=a.steps)}
    out = {}
    for trainer, cfg in cfgs.items():
        base, rates = st.base(trainer), {"headless": [], "studio": []}
        for r in range(a.repeat):
            if trainer == "unet":
                run = train_lora_run(base, st.images_dir, cfg, work/f"h-{trainer}-{r}")
            else:
                run = train_flux_lora(copy.deepcopy(base), st.images_dir, cfg, work/f"h-{trainer}-{r}",
                                      progress=False)
            rates["headless"].append(steps_per_s(run.history))
            st.start(trainer, f"s-{trainer}-{r}", cfg)
            st.wait()
            rates["studio"].append(steps_per_s(st.run_info(f"s-{trainer}-{r}")["history"]))
        best = {k: max(v) for k, v in rates.items()}
        out[trainer] = {**{f"{k}_steps_per_s": round(v, 2) for k, v in best.items()},
                        "ratio": round(best["studio"] / best["headless"], 3)}
        print(f"{trainer}: headless {best['headless']:.1f} steps/s, studio {best['studio']:.1f} steps/s, "
              f"ratio {out[trainer]['ratio']:.3f} (target >= 0.95)")
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
