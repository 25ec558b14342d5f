"""One key for every cached artefact (`course_lib.core.cache.cache_key`): config, data and code version.

The case that motivated it: `load_pretrained_ddpm(config, dataset=zeros)` followed by
`load_pretrained_ddpm(config)` returned the zeros-trained model (the dataset was not in the key).
"""
import dataclasses
import warnings

import pytest
import torch

from course_lib.core import cache as core
from course_lib.core import (
    StaleCacheWarning, cache_key, check_cached, code_fingerprint, data_fingerprint, record_cached)


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("COURSE_LIB_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("COURSE_LIB_NO_PRETRAINED", "1")
    return tmp_path / "cache"


def tiny_ddpm():
    from course_lib.ddpm import DDPMConfig
    return DDPMConfig(image_size=8, block_out_channels=(8, 16), norm_num_groups=8, steps=3, batch_size=8,
                      warmup_steps=1, checkpoint_every=1000, mixed_precision="no")


def weights(model):
    return torch.cat([p.detach().flatten() for p in model.state_dict().values() if p.is_floating_point()])


def test_dataset_is_in_the_ddpm_key(home):
    from course_lib.ddpm import load_pretrained_ddpm
    cfg = tiny_ddpm()
    zeros = torch.zeros(16, 1, 8, 8)
    assert cfg.key(zeros) != cfg.key()
    on_zeros = load_pretrained_ddpm(cfg, dataset=zeros, progress=False)
    on_digits = load_pretrained_ddpm(cfg, progress=False)          # was: the zeros model, from the cache
    assert not torch.equal(weights(on_zeros), weights(on_digits))
    again = load_pretrained_ddpm(cfg, dataset=zeros, progress=False)  # a real cache hit: the same weights
    assert torch.equal(weights(on_zeros), weights(again))


def test_data_fingerprint_follows_the_data(tmp_path):
    x = torch.zeros(4, 1, 8, 8)
    assert data_fingerprint(None) is None
    assert data_fingerprint(x) == data_fingerprint(x.clone())
    y = x.clone()
    y[3, 0, 7, 7] = 1e-6
    assert data_fingerprint(y) != data_fingerprint(x)
    assert data_fingerprint(x.double()) != data_fingerprint(x)           # dtype counts
    ds = torch.utils.data.TensorDataset(x, torch.arange(4))
    ds2 = torch.utils.data.TensorDataset(x, torch.tensor([0, 1, 2, 4]))
    assert data_fingerprint(ds) != data_fingerprint(ds2)                # labels count
    items = [(x[i], i) for i in range(4)]
    assert data_fingerprint(items) == data_fingerprint(list(items))
    (tmp_path / "a.png").write_bytes(b"12345")
    before = data_fingerprint(tmp_path)
    (tmp_path / "a.png").write_bytes(b"123456")
    assert data_fingerprint(tmp_path) != before                         # a changed file changes the key
    assert data_fingerprint("digits-train") == "digits-train"
    with pytest.raises(TypeError, match="cannot fingerprint"):
        data_fingerprint(object())


def test_cache_key_parts():
    @dataclasses.dataclass
    class C:
        lr: float = 1e-3
        sizes: tuple = (1, 2)
    base = cache_key("ddpm", C())
    assert len(base) == 12 and int(base, 16) >= 0
    assert cache_key("ddpm", C()) == base
    assert cache_key("ddpm", {"lr": 1e-3, "sizes": [1, 2]}) == base     # a dataclass keys as its dict
    assert cache_key("ddpm", C(lr=2e-3)) != base
    assert cache_key("classifier", C()) != base
    assert cache_key("ddpm", C(), code_version=2) != base
    assert cache_key("ddpm", C(), data=torch.zeros(2)) != base
    with pytest.raises(TypeError, match="cannot key a config value of type object"):
        cache_key("ddpm", {"x": object()})
    with pytest.raises(ValueError, match="kind must be a non-empty string"):
        cache_key("", C())
    with pytest.raises(TypeError, match="code_version must be an int"):
        cache_key("ddpm", C(), code_version="1")


@pytest.mark.parametrize("make", ["ddpm", "classifier", "toy_score", "ncsn", "tiny_gpt2"])
def test_every_config_key_is_the_core_key(make, monkeypatch):
    "Each loader's `config.key()` is `cache.cache_key`: no hand-written hash is left."
    from course_lib.ddpm import ClassifierConfig
    from course_lib.ddpm import DDPMConfig
    from course_lib.pile import TinyGPTConfig
    from course_lib.score import NCSNConfig
    from course_lib.score import ToyScoreConfig
    cfg = {"ddpm": DDPMConfig.quick, "classifier": ClassifierConfig, "toy_score": ToyScoreConfig,
           "ncsn": NCSNConfig, "tiny_gpt2": TinyGPTConfig}[make]()
    calls = []
    monkeypatch.setattr(core, "cache_key", lambda kind, *a, **k: calls.append(kind) or f"key-of-{kind}")
    assert cfg.key() == f"key-of-{calls[0]}"
    assert calls[0] == ("digits_classifier" if make == "classifier" else make)


def test_code_fingerprint_follows_called_functions(monkeypatch):
    "Editing a function that the trainer calls changes the trainer's fingerprint; nothing else does."
    import inspect
    from course_lib.ddpm import train_ddpm
    g = inspect.unwrap(train_ddpm).__globals__                    # train_ddpm is wrapped by grad_enabled
    before = code_fingerprint(train_ddpm)
    assert code_fingerprint(train_ddpm) == before
    ns = {"__name__": "__main__"}
    exec("def ema_update(ema, model, decay):\n    return None\n", ns)
    monkeypatch.setitem(g, "ema_update", ns["ema_update"])
    assert code_fingerprint(train_ddpm) != before
    monkeypatch.undo()
    assert code_fingerprint(train_ddpm) == before


def test_source_layout_does_not_change_the_fingerprint(tmp_path, monkeypatch):
    import importlib
    import sys
    (tmp_path / "course_lib_fp_a.py").write_text("def f(x):\n    'doc'\n    return x + 1\n")
    (tmp_path / "course_lib_fp_b.py").write_text("def f(x):\n    # note\n    return (x +\n            1)\n")
    (tmp_path / "course_lib_fp_c.py").write_text("def f(x):\n    return x + 2\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    fa, fb, fc = (importlib.import_module(f"course_lib_fp_{n}").f for n in "abc")
    for m in ("course_lib_fp_a", "course_lib_fp_b", "course_lib_fp_c"):
        monkeypatch.delitem(sys.modules, m)
    assert code_fingerprint(fa) == code_fingerprint(fb)      # docstring, comment, line breaks
    assert code_fingerprint(fa) != code_fingerprint(fc)


def test_edited_training_code_warns_on_a_cache_hit(home, monkeypatch):
    "A learner who edits the trainer and re-runs is told the cached model is older, and how to retrain."
    from course_lib.ddpm import load_pretrained_ddpm
    cfg = tiny_ddpm()
    first = load_pretrained_ddpm(cfg, progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", StaleCacheWarning)
        load_pretrained_ddpm(cfg, progress=False)                   # same code: no warning
    g = load_pretrained_ddpm.__globals__
    ns = {"__name__": "__main__", "_orig": g["train_ddpm"]}       # the learner's edited cell
    exec("def train_ddpm(*args, **kw):\n    print('my edit')\n    return _orig(*args, **kw)\n", ns)
    monkeypatch.setitem(g, "train_ddpm", ns["train_ddpm"])
    with pytest.warns(StaleCacheWarning, match=r"training code has changed.*retrain=True"):
        cached = load_pretrained_ddpm(cfg, progress=False)
    assert torch.equal(weights(cached), weights(first))             # the cached model, as the warning says
    retrained = load_pretrained_ddpm(cfg, progress=False, retrain=True)
    assert retrained is not None
    with warnings.catch_warnings():
        warnings.simplefilter("error", StaleCacheWarning)
        load_pretrained_ddpm(cfg, progress=False)                   # recorded with the edited code now


def test_check_cached_records(tmp_path):
    art = tmp_path / "m.safetensors"
    art.write_bytes(b"x")
    assert check_cached(art, "k", "code1", "retrain=True")         # no record yet: written, no warning
    assert core.cache_record_path(art).is_file()
    assert check_cached(art, "k", "code1", "retrain=True")
    with pytest.warns(StaleCacheWarning, match="m.safetensors.*now code2.*load_x\\(retrain=True\\)"):
        assert not check_cached(art, "k", "code2", "load_x(retrain=True)")
    record_cached(art, "k", "code2")
    assert check_cached(art, "k", "code2", "retrain=True")


def test_fingerprint_of_exec_code_with_comprehensions_is_stable():
    "Code without source (exec, python -c) is hashed by its bytecode, nested code objects included, not by repr."
    def make(src):
        ns = {"__name__": "__main__"}
        exec(compile(src, "<cell>", "exec"), ns)
        return ns["f"]
    src = "def f(x):\n    return sum(v for v in x) + len([v for v in x])\n"
    assert code_fingerprint(make(src)) == code_fingerprint(make(src))
    assert code_fingerprint(make(src)) != code_fingerprint(make(src.replace("+ len", "- len")))


def test_edited_trainer_warns_on_the_first_load_of_a_shipped_model(tmp_path, monkeypatch):
    "An empty cache (a new Colab session): the shipped model's record names the course's code, not the edit."
    from course_lib.ddpm import DDPMConfig, load_pretrained_ddpm
    monkeypatch.setenv("COURSE_LIB_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("COURSE_LIB_NO_PRETRAINED", raising=False)
    g = load_pretrained_ddpm.__globals__
    ns = {"__name__": "__main__", "_orig": g["train_ddpm"]}
    exec("def train_ddpm(*args, **kw):\n    print('my edit')\n    return _orig(*args, **kw)\n", ns)
    monkeypatch.setitem(g, "train_ddpm", ns["train_ddpm"])
    with pytest.warns(StaleCacheWarning, match=r"761a98acc20a/ema.safetensors: the training code has changed"):
        load_pretrained_ddpm(DDPMConfig.quick(), progress=False)


def test_the_warning_points_at_the_callers_line(home):
    "The warning names the learner's line, not contextlib's."
    from course_lib.ddpm import load_pretrained_ddpm
    cfg = tiny_ddpm()
    load_pretrained_ddpm(cfg, progress=False)
    core.record_cached(core.cache_record_path.__globals__["Path"](
        load_pretrained_ddpm.__globals__["cache_dir"]("models", "ddpm", cfg.key()) / "ema.safetensors"),
        cfg.key(), "other-code")
    with pytest.warns(StaleCacheWarning) as w:
        load_pretrained_ddpm(cfg, progress=False)
    assert w[0].filename == __file__


@pytest.mark.parametrize("bad", ["folder", "pil"])
def test_paths_and_pil_images_are_refused_with_the_way_out(home, tmp_path, bad):
    "The key accepts any data; the trainer names what to do with data it cannot take (was a raw TypeError)."
    from PIL import Image
    from course_lib.ddpm import load_pretrained_ddpm
    data = tmp_path if bad == "folder" else [Image.new("L", (8, 8)) for _ in range(4)]
    with pytest.raises(ValueError, match="ImageFolder"):
        load_pretrained_ddpm(tiny_ddpm(), dataset=data, progress=False)
