"""Issue 28's kinds in units 4 and 7 (lessons 43, 71, 72, 73): a damaged cached model gets an error that names the file
and says what to do (never a parser's traceback from inside safetensors or diffusers)."""
import warnings
from pathlib import Path

import pytest


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("COURSE_LIB_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("COURSE_LIB_NO_PRETRAINED", raising=False)
    return tmp_path / "home"


def truncate(p: Path):
    b = p.read_bytes()
    p.write_bytes(b[: len(b) // 3])


def test_damaged_cached_flow_model_is_named_with_what_to_do(cache):
    from course_lib.core import cache_dir
    from course_lib.ddpm import DDPMConfig
    from course_lib.flux import FlowConfig, load_pretrained_flow
    cfg = FlowConfig.from_ddpm(DDPMConfig.quick())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        load_pretrained_flow(cfg, progress=False)                 # the shipped copy, restored into the cache
    path = cache_dir("models", "flow", cfg.key()) / "ema.safetensors"
    truncate(path)
    with pytest.raises(ValueError) as e:
        load_pretrained_flow(cfg, progress=False)
    msg = str(e.value)
    assert str(path) in msg and "damaged" in msg and "retrain=True" in msg, msg


@pytest.mark.parametrize("part", ["transformer", "text_encoder_2", "vae"])
def test_damaged_cached_flux_pipeline_is_named_with_what_to_do(cache, part):
    "Each part fails its own way (diffusers' OSError, transformers' SafetensorError): each is named."
    from course_lib.core import cache_dir
    from course_lib.flux import FluxMiniConfig
    from course_lib.flux import load_flux_mini
    cfg = FluxMiniConfig.quick()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        load_flux_mini(cfg, progress=False)
    folder = cache_dir("models", "flux", cfg.key()) / "pipeline"
    truncate(next((folder / part).glob("*.safetensors")))
    with pytest.raises(ValueError) as e:
        load_flux_mini(cfg, progress=False)
    msg = str(e.value)
    assert str(folder) in msg and "retrain=True" in msg and "delete" in msg, msg


def test_a_damaged_checkpoint_says_what_to_do(tmp_path):
    import torch
    from course_lib.core import load_checkpoint, save_checkpoint
    path = save_checkpoint(tmp_path / "m.safetensors", {"w": torch.ones(64, 64)}) or tmp_path / "m.safetensors"
    truncate(path)
    with pytest.raises(ValueError) as e:
        load_checkpoint(path)
    msg = str(e.value)
    assert str(path) in msg and "delete it and load again" in msg, msg


# --- a read-only course cache: every loader that keeps an artefact there (siblings of the classifier's fix) -------
@pytest.fixture
def read_only_locks(monkeypatch):
    "Every file lock fails as in a read-only folder (EROFS) once switched on (root may write anywhere: no chmod)."
    import errno
    import filelock
    state = {"on": False}
    real = filelock.BaseFileLock.acquire
    def acquire(self, *a, **k):
        if state["on"]:
            raise OSError(errno.EROFS, "Read-only file system", self.lock_file)
        return real(self, *a, **k)
    monkeypatch.setattr(filelock.BaseFileLock, "acquire", acquire)
    return state


def _mini_pile():
    from course_lib.pile import mini_pile
    return mini_pile(0.05)


def _reference_statistics():
    from course_lib.metrics import reference_statistics
    return reference_statistics("digits-train", extractor="digits", size=8)["mu"].shape


def _flow():
    from course_lib.ddpm import DDPMConfig
    from course_lib.flux import FlowConfig, load_pretrained_flow
    return load_pretrained_flow(FlowConfig.from_ddpm(DDPMConfig.quick()), progress=False).history["loss"][-1]


def _vision_source():
    from course_lib.vision import pretrained_source_model
    return pretrained_source_model("course_resnet_32", steps=1000, label_augment="d4").name


def _tiny_gpt2():
    import json
    from course_lib.core import pretrained_dir
    from course_lib.pile import TinyGPTConfig, tiny_gpt2
    prov = json.loads((pretrained_dir() / "provenance.json").read_text())
    cfg = next(m["config"] for m in prov["models"].values() if m["kind"] == "gpt2")
    return tiny_gpt2(TinyGPTConfig(**cfg))[2].name


@pytest.mark.parametrize("load", [_mini_pile, _reference_statistics, _flow, _vision_source, _tiny_gpt2],
                         ids=lambda f: f.__name__.strip("_"))
def test_loaders_read_a_read_only_cache_that_holds_the_artefact(cache, read_only_locks, load):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first = load()                                   # made (or restored from the package) in a writable cache
        read_only_locks["on"] = True
        assert load() == first                           # a hit needs no lock: before, FileLock raised EROFS


def test_lora_adapter_cache_is_read_from_a_read_only_cache(cache, read_only_locks, monkeypatch):
    import course_lib.lora.run as lora_io
    from course_lib.lora import base_config, load_base
    from course_lib.lora import LoRATrainConfig
    base = load_base(base_config(100), progress=False)
    cfg = LoRATrainConfig(steps=2, batch_size=4, preview_every=0, adapter_name="bold", prior_images=0)
    path = lora_io.load_or_train_adapter("bold", base, cfg, n_images=8)
    def no_training(*a, **k): raise AssertionError("trained instead of loading the cached adapter")
    monkeypatch.setattr(lora_io, "train_adapter", no_training)
    read_only_locks["on"] = True
    assert lora_io.load_or_train_adapter("bold", base, cfg, n_images=8) == path


# --- state dicts of wrapped models (torch.compile, DataParallel / DDP) save and load as the plain model's ----------
@pytest.mark.parametrize("wrap", ["compile", "dataparallel"])
def test_lora_adapter_of_a_wrapped_unet_saves_and_loads_as_the_plain_models(tmp_path, wrap):
    import copy
    import torch
    from safetensors import safe_open
    from course_lib.lora import add_lora, set_adapters
    from course_lib.lora import base_config, load_base
    from course_lib.lora import base_fingerprint
    from course_lib.lora import load_adapter, save_adapter
    base = load_base(base_config(100), progress=False)
    unet = copy.deepcopy(base)
    add_lora(unet, 2, 2.0, ["to_q", "to_v"], adapter_name="concept")
    with torch.no_grad():
        for n, p in unet.named_parameters():
            if "lora_B" in n: p.normal_()
    wrapped = torch.compile(unet) if wrap == "compile" else torch.nn.DataParallel(unet)
    assert base_fingerprint(wrapped) == base_fingerprint(base)          # the same base, wrapped or not
    path = save_adapter(wrapped, tmp_path / "a.safetensors", "concept")
    with safe_open(str(path), "pt") as f:
        keys = list(f.keys())
    assert keys and not any(k.startswith(("_orig_mod.", "module.")) for k in keys), keys[:3]
    plain = copy.deepcopy(base)
    other = torch.compile(plain) if wrap == "compile" else torch.nn.DataParallel(plain)
    load_adapter(other, path, adapter_name="concept")                   # into a wrapped model too
    set_adapters(plain, "concept")
    sd = {k: v for k, v in plain.state_dict().items() if "lora_" in k}
    want = {k: v for k, v in unet.state_dict().items() if "lora_" in k}
    assert sd.keys() == want.keys() and all(torch.equal(sd[k], want[k]) for k in sd)


def test_flux_lora_state_of_a_wrapped_transformer_has_the_plain_names():
    from types import SimpleNamespace
    import torch
    from course_lib.flux import FluxMiniConfig, make_flux_pipeline
    from course_lib.flux import add_flux_lora
    from course_lib.flux import FluxLoRAConfig
    from course_lib.flux import lora_state
    pipe = make_flux_pipeline(FluxMiniConfig(num_layers=1, num_single_layers=1, text_layers=1))
    add_flux_lora(pipe, FluxLoRAConfig(rank=2, alpha=2.0))
    want = lora_state(pipe)["transformer"]
    got = lora_state(SimpleNamespace(transformer=torch.nn.DataParallel(pipe.transformer),
                                     text_encoder=pipe.text_encoder))["transformer"]
    assert got.keys() == want.keys()


def test_count_flops_names_a_size_the_model_refuses_and_defaults_to_its_own():
    import timm
    import course_lib.vision.registry  # noqa: F401  (registers the course's models)
    from course_lib.vision import count_flops
    vit = timm.create_model("course_vit_32", num_classes=5)
    assert count_flops(vit) == count_flops(vit, (1, 32, 32)) > 0      # the model's own (1, 32, 32)
    with pytest.raises(ValueError, match=r"input_size=\(3, 64, 64\).*own input size is \(1, 32, 32\)"):
        count_flops(vit, (3, 64, 64))                                   # before: timm's bare AssertionError
    assert vit.training                                                 # the mode is given back after a failure


@pytest.mark.parametrize("rank", ["0", "-3"])
def test_adapter_metadata_with_a_rank_below_one_is_named(rank):
    from course_lib.lora import parse_adapter_metadata
    meta = {"rank": rank, "alpha": "4.0", "target_modules": '["to_q"]'}
    with pytest.raises(ValueError, match=rf"a.safetensors: adapter metadata 'rank' is {rank}, not an integer >= 1"):
        parse_adapter_metadata("a.safetensors", meta)       # before: `course lora info` printed it, exit 0


def test_lora_train_names_a_file_given_as_the_image_folder(tmp_path, capsys):
    from course_lib.cli.lora import lora_main
    (tmp_path / "a.safetensors").write_bytes(b"x")
    assert lora_main(["train", str(tmp_path / "a.safetensors"), str(tmp_path / "o.safetensors")]) == 2
    err = capsys.readouterr().err
    assert "is a file, not a folder" in err and "does not exist" not in err, err
