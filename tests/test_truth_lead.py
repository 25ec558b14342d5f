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
    from course_lib.flow import FlowConfig, load_pretrained_flow
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


def test_damaged_cached_flux_pipeline_is_named_with_what_to_do(cache):
    from course_lib.core import cache_dir
    from course_lib.flux import FluxMiniConfig, load_flux_mini
    cfg = FluxMiniConfig.quick()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        load_flux_mini(cfg, progress=False)
    folder = cache_dir("models", "flux", cfg.key()) / "pipeline"
    truncate(next((folder / "transformer").glob("*.safetensors")))
    with pytest.raises(ValueError) as e:
        load_flux_mini(cfg, progress=False)
    msg = str(e.value)
    assert str(folder) in msg and "retrain=True" in msg and "delete" in msg, msg


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
    from course_lib.flow import FlowConfig, load_pretrained_flow
    return load_pretrained_flow(FlowConfig.from_ddpm(DDPMConfig.quick()), progress=False).history["loss"][-1]


def _vision_source():
    from course_lib.vision_transfer import pretrained_source_model
    return pretrained_source_model("course_resnet_32", steps=1000, label_augment="d4").name


def _tiny_gpt2():
    import json
    from course_lib.core import pretrained_dir
    from course_lib.lm import TinyGPTConfig, tiny_gpt2
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
    import course_lib.lora_io as lora_io
    from course_lib.lora_train import LoRATrainConfig, base_config, load_base
    base = load_base(base_config(100), progress=False)
    cfg = LoRATrainConfig(steps=2, batch_size=4, preview_every=0, adapter_name="bold", prior_images=0)
    path = lora_io.load_or_train_adapter("bold", base, cfg, n_images=8)
    def no_training(*a, **k): raise AssertionError("trained instead of loading the cached adapter")
    monkeypatch.setattr(lora_io, "train_adapter", no_training)
    read_only_locks["on"] = True
    assert lora_io.load_or_train_adapter("bold", base, cfg, n_images=8) == path
