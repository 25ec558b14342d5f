"""Unit 4's lessons count on the model the unit trains: notebook 40's parameter counts are made on the base model
of notebooks 42 and 43 (`base_config()`), with the targets notebook 42 adapts."""
from pathlib import Path

import matplotlib
import nbformat

from course_lib.ddpm import make_unet
from course_lib.lora import LORA_TARGETS, add_lora
from course_lib.lora import base_config
from course_lib.lora import count_parameters

ROOT = Path(__file__).resolve().parent.parent


def run_until(nb_path: Path, name: str) -> dict:
    """Execute the code cells of `nb_path` in order (plain Python: magics and the Colab cell skipped) until one
    assigns `name`; return the namespace."""
    matplotlib.use("Agg")
    ns: dict = {"__name__": "lesson"}
    for c in nbformat.read(nb_path, as_version=4).cells:
        if c.cell_type != "code" or "%pip" in c.source or c.source.startswith("#| default_exp"):
            continue
        exec(compile(c.source, f"{nb_path.name}:{c.get('id')}", "exec"), ns)
        if name in ns:
            return ns
    raise AssertionError(f"no code cell of {nb_path.name} assigns {name!r}")


def test_notebook_40_counts_on_the_unit_base_model():
    ns = run_until(ROOT / "nbs" / "40_lora_from_scratch.ipynb", "rows")
    base = make_unet(base_config())
    lesson = ns["unet"]
    got = {k: lesson.config[k] for k in base.config}
    assert got == dict(base.config), {k: (got[k], v) for k, v in base.config.items() if got[k] != v}
    n_base = sum(p.numel() for p in base.parameters())
    assert ns["total"] == n_base == 1_114_081, (ns["total"], n_base)
    assert tuple(ns["targets"]) == LORA_TARGETS, ns["targets"]
    # the lesson's rank-8 share is the one notebook 42 trains (add_lora, rank 8 on the same targets)
    trained = count_parameters(add_lora(base, rank=8))
    assert ns["lora_param_count"](ns["unet"], ns["targets"], 8) == trained["trainable"] == 32_512
