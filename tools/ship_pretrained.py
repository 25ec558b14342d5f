"""Train the models the lessons load (their full-profile configurations) and ship them in the package.

    COURSE_LIB_HOME=/tmp/ship python tools/ship_pretrained.py            # train what is missing there, then copy
    COURSE_LIB_HOME=/tmp/ship python tools/ship_pretrained.py --only classifier ddpm
    python tools/ship_pretrained.py --rekey      # after a change of cache keys only: rename, no training
    python tools/ship_pretrained.py --restamp    # after a change of training code that trains the same

Each shipped model has a record `<file>.cache.json` beside it (`course_lib.core.cache`) with the fingerprint of the
code that trained it; `restore_pretrained` copies it into the cache, so a learner who edits a trainer is warned
(`StaleCacheWarning`) on the first load. `tests/test_pretrained.py` fails when the library's training code no
longer has the recorded fingerprint: retrain (the command above), or `--restamp` when the change trains the same.

Each model is trained by the library's own loader (so its cache key is the one the lessons ask for) in the
course cache named by COURSE_LIB_HOME, then copied to `course_lib/pretrained/<its path in the cache>`, where
`course_lib.core.basics.restore_pretrained` finds it. `course_lib/pretrained/provenance.json` records, for each file:
its config, this command, the code version (git commit), the training time, the figures it reached, its size
and SHA-256. `tests/test_pretrained.py` checks the files against it and retrains the judge from it."""
import argparse, hashlib, json, os, platform, shutil, subprocess, sys, time
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODELS = ("classifier", "ddpm", "base", "vision", "gpt2", "ddpm-quick", "base-quick", "ncsn", "flow-quick",
          "flux-quick", "ddpm-mnist", "guided", "flow", "flux", "clean-lm", "classifier-mnist",
          "unet-pair")
GPT2 = dict(max_mb_per_subset=4.0, vocab_size=4096, n_positions=256, n_embd=128, n_layer=4, steps=1800,
            batch_size=12, lr=5e-3, seed=0)               # nbs/62_tiny_gpt2.ipynb's full profile


def train(kind: str) -> list[dict]:
    "Load (training on a cache miss) one kind of model; returns its artefacts: path, config, figures."
    from course_lib.core import cache_dir, load_checkpoint
    if kind in ("classifier", "classifier-mnist"):             # the 8x8 digits' judge, MNIST's
        from course_lib.ddpm import ClassifierConfig, load_digits_classifier
        cfg, call = {"classifier": (ClassifierConfig(), "ClassifierConfig()"),
                     "classifier-mnist": (ClassifierConfig.mnist(), "ClassifierConfig.mnist()")}[kind]
        m = load_digits_classifier(config=cfg)
        path = cache_dir("models", "digits_classifier") / f"{cfg.key()}.safetensors"
        return [dict(path=path, config=cfg.__dict__, figures={"valid_acc": m.valid_acc},
                     call=f"load_digits_classifier(config={call})")]
    if kind == "ddpm-mnist":
        from course_lib.data.mnist import MNIST
        from course_lib.ddpm import DDPMConfig, load_pretrained_ddpm
        cfg, data = DDPMConfig.mnist(), MNIST("train", size=28)
        m = load_pretrained_ddpm(cfg, dataset=data, progress=False)
        path = cache_dir("models", "ddpm", cfg.key(data)) / "ema.safetensors"
        return [dict(path=path, config=cfg.to_dict(), call="load_pretrained_ddpm(DDPMConfig.mnist(), "
                     "dataset=MNIST('train', size=28))", data="MNIST('train', size=28)",
                     figures={"final_loss": sum(m.history["loss"][-50:]) / 50, "train_seconds": m.history["seconds"]})]
    if kind == "unet-pair":              # nbs/10a_unet.ipynb's full profile: TinyUNet and UNet2DModel on MNIST
        from course_lib.ddpm import UNetPairConfig, load_unet_pair
        cfg = UNetPairConfig()
        _, h = load_unet_pair(cfg, progress=True)
        figures = {**{f"loss_last50_{k}": sum(v[-50:]) / 50 for k, v in h["losses"].items()},
                   **{f"train_seconds_{k}": s for k, s in h["seconds"].items()}}
        return [dict(path=cfg.path(), config=asdict(cfg), call="load_unet_pair(UNetPairConfig())",
                     data="MNIST('train', size=28)", figures=figures)]
    if kind in ("ddpm", "base", "ddpm-quick", "base-quick"):      # the lessons' models and the quick profile's
        from course_lib.ddpm import DDPMConfig, load_pretrained_ddpm
        from course_lib.lora import base_config
        cfg, call = {"ddpm": (DDPMConfig(), "load_pretrained_ddpm(DDPMConfig())"),
                     "base": (base_config(), "load_base(base_config())"),
                     "ddpm-quick": (DDPMConfig.quick(), "load_pretrained_ddpm(DDPMConfig.quick())"),
                     "base-quick": (base_config(100), "load_base(base_config(100))")}[kind]
        m = load_pretrained_ddpm(cfg, progress=False)
        path = cache_dir("models", "ddpm", cfg.key()) / "ema.safetensors"
        return [dict(path=path, config=cfg.to_dict(), call=call,
                     figures={"final_loss": m.history["loss"][-1], "train_seconds": m.history["seconds"]})]
    if kind == "vision":
        from course_lib.vision import pretrained_source_model
        out = []
        for name, aug in (("course_resnet_32", "d4"), ("course_vit_32", "d4"), ("course_resnet_32", "none")):
            path = pretrained_source_model(name, steps=1000, label_augment=aug)
            _, meta = load_checkpoint(path)
            out.append(dict(path=path, config=json.loads(meta.get("config", "{}")),
                            call=f"pretrained_source_model({name!r}, steps=1000, label_augment={aug!r})",
                            figures={"val_acc": float(meta["val_acc"])}))
        return out
    if kind == "ncsn":                   # nbs/21_langevin.ipynb's digits NCSN (its full profile)
        from course_lib.score import NCSNConfig, load_ncsn
        cfg = NCSNConfig()
        load_ncsn(cfg)
        path = cache_dir("score", "ncsn") / f"ncsn-{cfg.key()}.safetensors"
        losses = load_checkpoint(path)[0]["losses"]
        return [dict(path=path, config=asdict(cfg), call="load_ncsn(NCSNConfig())",
                     figures={"final_loss": float(losses[-50:].mean())})]
    if kind == "guided":                 # nbs/70_guidance.ipynb's full profile: unit 1's DDPM with 11 classes
        from course_lib.ddpm import DDPMConfig
        from course_lib.ddpm.training import default_dataset
        from course_lib.flux import load_guided_ddpm
        from course_lib.flux.guidance import label_dropout_dataset
        m = load_guided_ddpm(DDPMConfig(), 0.2, progress=False)
        cfg = m.ddpm_config
        data = label_dropout_dataset(default_dataset(cfg), 0.2)
        path = cache_dir("models", "ddpm", cfg.key(data)) / "ema.safetensors"
        return [dict(path=path, config=cfg.to_dict(), call="load_guided_ddpm(DDPMConfig(), 0.2)",
                     data="label_dropout_dataset(default_dataset(cfg), 0.2)",
                     figures={"final_loss": sum(m.history["loss"][-50:]) / 50, "train_seconds": m.history["seconds"]})]
    if kind in ("flow", "flow-quick"):   # nbs/71_flow_matching.ipynb: unit 1's budget (quick: its quick budget)
        from course_lib.ddpm import DDPMConfig
        from course_lib.flux import FlowConfig, load_pretrained_flow
        base = "DDPMConfig()" if kind == "flow" else "DDPMConfig.quick()"
        cfg = FlowConfig.from_ddpm(DDPMConfig() if kind == "flow" else DDPMConfig.quick())
        m = load_pretrained_flow(cfg, progress=False)
        path = cache_dir("models", "flow", cfg.key()) / "ema.safetensors"
        return [dict(path=path, config=asdict(cfg), call=f"load_pretrained_flow(FlowConfig.from_ddpm({base}))",
                     figures={"final_loss": float(sum(m.history["loss"][-50:]) / 50),
                              "train_seconds": m.history["seconds"]})]
    if kind in ("flux", "flux-quick"):   # nbs/72 and 73: FLUX-mini, FluxMiniConfig() (quick: .quick())
        from course_lib.flux import FluxMiniConfig
        from course_lib.flux import load_flux_mini
        cfg = FluxMiniConfig() if kind == "flux" else FluxMiniConfig.quick()
        pipe = load_flux_mini(cfg, progress=False)
        path = cache_dir("models", "flux", cfg.key()) / "pipeline"
        loss = pipe.history["flow_loss"][-50:]
        call = "load_flux_mini(FluxMiniConfig())" if kind == "flux" else "load_flux_mini(FluxMiniConfig.quick())"
        return [dict(path=path, config=asdict(cfg), call=call,
                     figures={"final_flow_loss": float(sum(loss) / len(loss)),
                              "train_seconds": pipe.history["flow_seconds"]})]
    if kind == "gpt2":
        from course_lib.pile import TinyGPTConfig, tiny_gpt2
        cfg = TinyGPTConfig(**GPT2)
        _, _, d = tiny_gpt2(cfg)
        loss = json.loads((d / "course_lib.json").read_text())["loss"]
        return [dict(path=d, config=GPT2, call=f"tiny_gpt2(TinyGPTConfig(**{GPT2}))",
                     figures={"final_loss_nats": sum(loss[-20:]) / len(loss[-20:])})]
    if kind == "clean-lm":               # nbs/62a_pile_cleaning.ipynb's full profile: 2 training sets x 3 seeds
        from course_lib.pile.experiment import CleanExperimentConfig, clean_experiment_model, experiment_sets
        cfg = CleanExperimentConfig()
        sets, out = experiment_sets(cfg), []
        for seed in cfg.seeds:           # seed by seed: a stopped run still leaves pairs
            for name in ("raw", "cleaned"):
                t0 = time.time()
                _, _, d = clean_experiment_model(name, seed, cfg, sets=sets)
                info = json.loads((d / "course_lib.json").read_text())
                print(f"clean-lm: {name} seed {seed} in {time.time() - t0:.0f} s", flush=True)
                out.append(dict(path=d, config={**asdict(cfg), "set": name, "seed": seed},
                                call=f"clean_experiment_model({name!r}, {seed}, CleanExperimentConfig())",
                                data=f"experiment_sets(CleanExperimentConfig()).texts[{name!r}], sha256 "
                                     + info["texts_sha256"],
                                figures={"final_loss_nats": sum(info["loss"][-20:]) / 20,
                                         "cpu_seconds": info["cpu_seconds"]}))
        return out
    raise ValueError(f"unknown model kind {kind!r}; choose from {MODELS}")


def cache_path(kind: str, config: dict) -> str:
    "Where the current library's loader looks for the model `kind` with the provenance `config` (cache-relative)."
    from course_lib.core import cache_key
    if kind in ("classifier", "classifier-mnist"):
        from course_lib.ddpm import ClassifierConfig
        return f"models/digits_classifier/{ClassifierConfig(**config).key()}.safetensors"
    if kind in ("ddpm", "base", "ddpm-quick", "base-quick"):
        from course_lib.ddpm import DDPMConfig
        return f"models/ddpm/{DDPMConfig.from_dict(config).key()}/ema.safetensors"
    if kind == "guided":
        from course_lib.ddpm import DDPMConfig
        from course_lib.ddpm.training import default_dataset
        from course_lib.flux.guidance import label_dropout_dataset
        cfg = DDPMConfig.from_dict(config)
        return f"models/ddpm/{cfg.key(label_dropout_dataset(default_dataset(cfg), 0.2))}/ema.safetensors"
    if kind == "ddpm-mnist":
        from course_lib.data.mnist import MNIST
        from course_lib.ddpm import DDPMConfig
        return f"models/ddpm/{DDPMConfig.from_dict(config).key(MNIST('train', size=28))}/ema.safetensors"
    if kind == "unet-pair":
        from course_lib.ddpm import UNetPairConfig
        cfg = UNetPairConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in config.items()})
        return f"models/unet_pair/{cfg.path().name}"
    if kind == "vision":
        key = cache_key("vision_source", {k: v for k, v in config.items() if k != "v"}, code_version=config["v"])
        return f"vision/{config['model']}-source-{key}.safetensors"
    if kind == "ncsn":
        from course_lib.score import NCSNConfig
        return f"score/ncsn/ncsn-{NCSNConfig(**config).key()}.safetensors"
    if kind in ("flow", "flow-quick"):
        from course_lib.flux import FlowConfig
        return f"models/flow/{FlowConfig(**config).key()}/ema.safetensors"
    if kind in ("flux", "flux-quick"):
        from course_lib.flux import FluxMiniConfig
        cfg = FluxMiniConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in config.items()})
        return f"models/flux/{cfg.key()}/pipeline"
    if kind == "gpt2":
        from course_lib.pile import TinyGPTConfig
        return f"pile/tiny-gpt2-{TinyGPTConfig(**config).key()}"
    if kind == "clean-lm":
        from course_lib.pile.experiment import CleanExperimentConfig
        cfg = CleanExperimentConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in config.items()
                                       if k not in ("set", "seed")})
        return f"pile/clean-lm/{config['set']}-seed{config['seed']}-{cfg.key()}"
    raise ValueError(f"unknown model kind {kind!r}; choose from {MODELS}")


DDPM_TRAINER, FLOW_TRAINER = ("course_lib.ddpm.training", "train_ddpm"), ("course_lib.flux.flow_training", "train_flow")
FLUX_TRAINER = ("course_lib.flux.train", "train_flux_mini")
JUDGE_TRAINER = ("course_lib.ddpm.classifier", "train_digits_classifier")
TRAINERS = {**dict.fromkeys(("classifier", "classifier-mnist"), JUDGE_TRAINER),
            **dict.fromkeys(("ddpm", "base", "ddpm-quick", "base-quick", "ddpm-mnist", "guided"), DDPM_TRAINER),
            "flow": FLOW_TRAINER, "flow-quick": FLOW_TRAINER, "flux": FLUX_TRAINER, "flux-quick": FLUX_TRAINER,
            "gpt2": ("course_lib.pile.lm", "train_tiny_gpt2"),
            "clean-lm": ("course_lib.pile.experiment", "clean_experiment_model"), "ncsn": ("course_lib.score.ncsn", "train_ncsn"),
            "unet-pair": ("course_lib.ddpm.unet", ("train_eps", "TinyUNet"))}


def trainer_fingerprint(kind: str) -> str | None:
    "The code fingerprint the loader of `kind` records (None: its loader keeps no record)."
    import importlib
    from course_lib.core import code_fingerprint
    if kind not in TRAINERS: return None
    mod, names = TRAINERS[kind]            # a name, or the names whose code the loader records together
    names = (names,) if isinstance(names, str) else names
    return code_fingerprint(*(getattr(importlib.import_module(mod), n) for n in names))


def restamp(dest: Path, prov: dict) -> None:
    "Write each shipped model's record with the current training code's fingerprint."
    from course_lib.core import record_cached
    for rel, m in prov["models"].items():
        code = trainer_fingerprint(m["kind"])
        if code is None: continue
        path = dest / rel
        key = path.parent.name if path.name in ("ema.safetensors", "pipeline") else path.stem.rsplit("-", 1)[-1]
        record_cached(path, key, code, source="shipped")
        print(f"{m['kind']}: {rel} recorded with code {code}")


def rekey(dest: Path, prov: dict) -> None:
    """Move each shipped model to the path the current cache keys give it, without training: for a change of
    the key's form only (the config, the data and the code version the model was trained with are unchanged)."""
    moved = {}
    for rel, m in prov["models"].items():
        new = cache_path(m["kind"], m["config"])
        if new != rel:
            (dest / new).parent.mkdir(parents=True, exist_ok=True)
            os.replace(dest / rel, dest / new)
            old_name, new_name = Path(rel).name, Path(new).name      # files are listed from the parent
            m["files"] = {(new_name + f[len(old_name):] if f.split("/")[0] == old_name else f): v
                          for f, v in m["files"].items()}
            m.setdefault("rekeyed_from", []).append(rel)
            print(f"{m['kind']}: {rel} -> {new}")
        moved[new] = m
    prov["models"] = moved
    for d in sorted((p for p in dest.rglob("*") if p.is_dir()), reverse=True):
        if not any(d.iterdir()): d.rmdir()


def files_of(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]


def sha256(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def main(argv=None) -> int:
    a = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a.add_argument("--only", nargs="+", choices=MODELS, default=list(MODELS))
    a.add_argument("--rekey", action="store_true", help="move shipped models to their current cache keys")
    a.add_argument("--restamp", action="store_true", help="record the current training code's fingerprint")
    args = a.parse_args(argv)
    dest = ROOT / "course_lib" / "pretrained"
    if args.restamp:
        restamp(dest, json.loads((dest / "provenance.json").read_text()))
        return 0
    if args.rekey:
        prov_path = dest / "provenance.json"
        prov = json.loads(prov_path.read_text())
        rekey(dest, prov)
        prov_path.write_text(json.dumps(prov, indent=1, sort_keys=True, default=str) + "\n")
        return 0
    if not os.environ.get("COURSE_LIB_HOME"):
        sys.exit("set COURSE_LIB_HOME to a scratch cache: the models are trained (or found) there")
    from course_lib.core import cache_dir
    prov_path = dest / "provenance.json"
    prov = json.loads(prov_path.read_text()) if prov_path.is_file() else {"models": {}}
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    for kind in args.only:
        t0 = time.time()
        for art in train(kind):
            rel = Path(art["path"]).resolve().relative_to(cache_dir().resolve())
            target = dest / rel
            if target.exists(): shutil.rmtree(target) if target.is_dir() else target.unlink()
            target.parent.mkdir(parents=True, exist_ok=True)
            (shutil.copytree if Path(art["path"]).is_dir() else shutil.copyfile)(art["path"], target)
            prov["models"][rel.as_posix()] = {
                "kind": kind, "call": art["call"], "config": art["config"], "figures": art["figures"],
                **({"data": art["data"]} if "data" in art else {}),
                "command": f"COURSE_LIB_HOME=<scratch> python tools/ship_pretrained.py --only {kind}",
                "code_version": commit, "python": platform.python_version(), "machine": platform.machine(),
                "files": {p.relative_to(target.parent).as_posix(): {"bytes": p.stat().st_size, "sha256": sha256(p)}
                          for p in files_of(target)}}
            print(f"{kind}: {rel} ({sum(p.stat().st_size for p in files_of(target)) / 1e6:.2f} MB) "
                  f"{art['figures']}")
        print(f"{kind}: {time.time() - t0:.0f} s")
    restamp(dest, prov)
    prov["total_bytes"] = sum(f["bytes"] for m in prov["models"].values() for f in m["files"].values())
    prov_path.write_text(json.dumps(prov, indent=1, sort_keys=True, default=str) + "\n")
    print(f"{len(prov['models'])} models, {prov['total_bytes'] / 1e6:.1f} MB in {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
