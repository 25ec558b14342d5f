"""The tiny GPT-2's held-out checkpoints (nbs/62_tiny_gpt2.ipynb): where a run is evaluated, what is recorded, and
that measuring on the way does not change what is trained (the shipped model's record depends on it)."""
import math

import pytest
import torch

from course_lib.pile import bpb
from course_lib.pile import TinyGPTConfig, eval_documents, eval_steps, train_tiny_gpt2

TEXTS = ["The Pile is a dataset of diverse text for language modelling. " * 20,
         "def f(x):\n    return x * 2  # code is text too\n" * 30] * 4
CFG = TinyGPTConfig(vocab_size=300, n_positions=16, n_embd=16, n_layer=1, n_head=2, steps=8, batch_size=2,
                    warmup=1)


def test_eval_steps_double_up_to_the_last_step():
    assert eval_steps(1800, 8) == [14, 28, 56, 112, 225, 450, 900, 1800]
    assert eval_steps(30, 8) == [1, 2, 4, 8, 15, 30]       # short runs: fewer, distinct steps
    assert eval_steps(5, 0) == []


def test_eval_documents_takes_the_first_of_each_subset_in_order():
    recs = [{"text": f"{s}{i}", "meta": {"pile_set_name": s}} for i in range(3) for s in ("Github", "Licenses")]
    got = [r["text"] for r in eval_documents(recs, 2)]
    assert sorted(got) == ["Github0", "Github1", "Licenses0", "Licenses1"]
    assert got.index("Github1") == got.index("Github0") + 1  # a subset's documents stay together


def test_checkpoints_are_recorded_and_do_not_change_training():
    docs = [{"text": t[:300], "meta": {"pile_set_name": "Pile-CC"}} for t in TEXTS[:2]]
    m1, tok, h1 = train_tiny_gpt2(TEXTS, CFG, eval_docs=docs, eval_points=3)
    m0, _, h0 = train_tiny_gpt2(TEXTS, CFG)
    assert [e["step"] for e in h1["eval"]] == [2, 4, 8]
    assert [e["tokens"] for e in h1["eval"]] == [s * CFG.batch_size * CFG.n_positions for s in (2, 4, 8)]
    assert h0["eval"] == [] and h1["cpu_seconds"] > 0
    assert h1["loss"] == h0["loss"]                          # same batches, same steps
    for a, b in zip(m1.parameters(), m0.parameters()): assert torch.equal(a, b)
    last = bpb(m1, tok, docs, window=CFG.n_positions).overall.bpb
    assert h1["eval"][-1]["bpb"] == pytest.approx(last, rel=1e-6) and math.isfinite(last)
