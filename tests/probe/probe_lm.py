"""Unit 6's small GPT-2 on the accelerator (under the device probe): the trainer's Accelerator follows
`get_device()` (on 767c4b0 it asked `torch.cuda.is_available()` only, so an MPS learner trained on the CPU) and the
BPB evaluation runs where the model is."""
import torch
from accelerate.state import AcceleratorState, PartialState

from course_lib.core import kind
from course_lib.pile import TinyGPTConfig, train_tiny_gpt2

DEV = kind()


def test_tiny_gpt2_trains_on_the_device():
    AcceleratorState._reset_state(True); PartialState._reset_state()
    texts = [f"document {i}: the quick brown fox jumps over the lazy dog {i * 7}." for i in range(40)]
    cfg = TinyGPTConfig(vocab_size=300, n_positions=16, n_embd=16, n_layer=1, n_head=2, steps=3,
                        batch_size=4, warmup=1)
    docs = [{"text": t, "meta": {"pile_set_name": "Pile-CC"}} for t in texts[:3]]
    model, tok, hist = train_tiny_gpt2(texts, cfg, eval_docs=docs, eval_points=1)
    assert next(model.parameters()).device.type == DEV
    assert len(hist["loss"]) == 3 and all(torch.isfinite(torch.tensor(hist["loss"])))
    assert hist["eval"] and hist["eval"][-1]["bpb"] > 0
