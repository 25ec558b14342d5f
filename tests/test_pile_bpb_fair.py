"""The fair comparison of unit 6 (issue 45): compressors one document at a time (`compressor_report`), the standard
error of a corpus BPB and of a paired difference (`bpb_stderr`, `paired_bpb_difference`), and Kaplan et al.'s
non-embedding parameter count (`non_embedding_params`), each against a closed form or a count by hand."""
import bz2, gzip, lzma, math, statistics

import pytest
import torch

from course_lib.pile import (
    BPBReport, LN2, bpb, bpb_stderr, code_bytes, compressor_bpb, compressor_report, non_embedding_params,
    paired_bpb_difference, train_bpe_tokenizer)

DOCS = [
    {"text": "Bits per byte divides the log-likelihood by UTF-8 bytes. " * 12, "meta": {"pile_set_name": "Pile-CC"}},
    {"text": "def f(x):\n    return x ** 2  # naïve ✓\n" * 20, "meta": {"pile_set_name": "Github"}},
    {"text": "短い文書。多字节字符 🙂 café, and some more words to compress.", "meta": {"pile_set_name": "Pile-CC"}},
    {"text": "The Pile is 825 GiB of text in 22 subsets.\n" * 30, "meta": {"pile_set_name": "ArXiv"}},
    {"text": "import math\nprint(math.log(2))\n" * 9, "meta": {"pile_set_name": "Github"}},
]
torch.set_num_threads(1)


def test_gzip_per_document_is_the_sum_of_each_documents_gzip():
    "Per document: C = len(gzip.compress(doc, 9)) less gzip's 18 bytes of framing, summed over documents (exact)."
    rep = compressor_report(DOCS, "gzip-9")
    by_hand = [len(gzip.compress(d["text"].encode("utf-8"), 9, mtime=0)) - 18 for d in DOCS]
    n = [len(d["text"].encode("utf-8")) for d in DOCS]
    assert [r[2] for r in rep.per_doc] == by_hand and [r[3] for r in rep.per_doc] == n
    assert rep.overall.bpb == pytest.approx(8 * sum(by_hand) / sum(n), rel=1e-12)
    assert rep.subsets["Github"].bpb == pytest.approx(8 * (by_hand[1] + by_hand[4]) / (n[1] + n[4]), rel=1e-12)
    assert sorted(rep.subsets) == ["ArXiv", "Github", "Pile-CC"] and rep.window == rep.stride == 0


@pytest.mark.parametrize("method,framing", [("bz2-9", lambda b: len(bz2.compress(b, 9)) - 24),
                                            ("lzma-9e", None), ("zstd-19", None)])
def test_every_compressor_per_document_equals_code_bytes(method, framing):
    rep = compressor_report([d["text"] for d in DOCS], method)
    want = [code_bytes(d["text"].encode("utf-8"), method) for d in DOCS]
    assert [r[2] for r in rep.per_doc] == want and set(rep.subsets) == {"all"}
    if framing: assert want == [framing(d["text"].encode("utf-8")) for d in DOCS]
    raw = [len(lzma.compress(d["text"].encode("utf-8"), preset=9 | lzma.PRESET_EXTREME)) for d in DOCS]
    assert method != "lzma-9e" or all(w < r for w, r in zip(want, raw))     # the .xz container left out


def test_per_document_is_never_better_than_one_stream_of_repeating_documents():
    docs = [{"text": "Permission is hereby granted, free of charge, to any person " * 3 + str(i)} for i in range(8)]
    alone = compressor_report([d["text"] for d in docs], "gzip-9").overall.bpb
    stream = compressor_bpb([d["text"] for d in docs], "gzip-9").bpb
    assert alone > 1.5 * stream      # the stream copies each licence from the one before


def test_unknown_compressor_names_the_valid_ones():
    with pytest.raises(KeyError, match="gzip-9"):
        compressor_report(DOCS, "gzip-10")


def _report(rows):
    "A BPBReport of `(subset, nll nats, bytes)` rows."
    return BPBReport.from_rows([(i, (y, 1)) for i, (_, y, _) in enumerate(rows)], [(s, x) for s, _, x in rows], 0, 0)


def test_stderr_with_equal_lengths_is_the_standard_error_of_the_mean():
    "Documents of equal length: the ratio estimator is the mean of the per-document BPB, its s.e. stdev / sqrt(n)."
    y = [700.0, 820.5, 640.25, 901.0, 755.0, 810.0]
    rep = _report([("a", v, 500) for v in y])
    per_doc = [v / (500 * LN2) for v in y]
    assert bpb_stderr(rep) == pytest.approx(statistics.stdev(per_doc) / math.sqrt(len(y)), rel=1e-12)
    assert bpb_stderr(rep, "a") == pytest.approx(bpb_stderr(rep), rel=1e-12)


def test_stderr_is_stratified_by_subset_and_the_ratio_estimator_by_hand():
    "Cochran's combined ratio estimate: residuals about the overall rate, centred within each subset (by hand)."
    rows = [("a", 100.0, 80), ("a", 300.0, 200), ("a", 90.0, 100), ("b", 50.0, 40), ("b", 10.0, 20), ("c", 7.0, 9)]
    rep = _report(rows)
    def var(k, R):
        e = [y - R * x for s, y, x in rows if s == k]
        return len(e) / (len(e) - 1) * sum((v - statistics.mean(e)) ** 2 for v in e) if len(e) > 1 else 0.0
    total = sum(x for _, _, x in rows)
    R = sum(y for _, y, _ in rows) / total
    assert bpb_stderr(rep) == pytest.approx(math.sqrt(var("a", R) + var("b", R)) / (total * LN2), rel=1e-12)
    Rb = 60.0 / 60
    byhand_b = math.sqrt(2 * ((50 - Rb * 40) ** 2 + (10 - Rb * 20) ** 2)) / (60 * LN2)   # own rate: mean residual 0
    assert bpb_stderr(rep, "b") == pytest.approx(byhand_b, rel=1e-12)
    assert bpb_stderr(rep, "c") == 0.0                               # one document: no spread to measure
    with pytest.raises(KeyError, match="'a', 'b', 'c'"):
        bpb_stderr(rep, "z")


def test_paired_difference_by_hand_and_shared_difficulty_cancels():
    "Equal lengths: the paired s.e. is stdev of the per-document differences / sqrt(n); a common offset cancels."
    ya = [700.0, 820.5, 640.25, 901.0, 755.0, 810.0]
    hard = [0.0, 400.0, -300.0, 900.0, 50.0, -200.0]                 # each document's difficulty, shared
    a = _report([("s", v + h, 500) for v, h in zip(ya, hard)])
    b = _report([("s", v + h - 20.0 - 3 * i, 500) for i, (v, h) in enumerate(zip(ya, hard))])
    diff, se = paired_bpb_difference(a, b)
    per = [(20.0 + 3 * i) / (500 * LN2) for i in range(6)]
    assert diff == pytest.approx(a.overall.bpb - b.overall.bpb, rel=1e-12)
    assert se == pytest.approx(statistics.stdev(per) / math.sqrt(6), rel=1e-12)
    assert se < 0.1 * math.hypot(bpb_stderr(a), bpb_stderr(b))      # the shared difficulty drops out
    assert paired_bpb_difference(a, b, "s") == pytest.approx((diff, se), rel=1e-12)


def test_paired_difference_refuses_different_documents():
    a = _report([("s", 1.0, 10), ("s", 2.0, 20)])
    with pytest.raises(ValueError, match="different documents"):
        paired_bpb_difference(a, _report([("s", 1.0, 10), ("s", 2.0, 21)]))
    with pytest.raises(ValueError, match="different documents"):
        paired_bpb_difference(a, _report([("s", 1.0, 10)]))


def test_model_and_compressor_pair_document_by_document():
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    tok = train_bpe_tokenizer([d["text"] for d in DOCS] * 3, vocab_size=300)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_positions=32, n_embd=32, n_layer=1, n_head=2,
                                       bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)).eval()
    lm, gz = bpb(model, tok, DOCS, window=32), compressor_report(DOCS, "gzip-9")
    diff, se = paired_bpb_difference(lm, gz)
    by_hand = sum(m[1] - g[1] for m, g in zip(lm.per_doc, gz.per_doc)) / (lm.overall.bytes * LN2)
    assert diff == pytest.approx(by_hand, rel=1e-9) and diff == pytest.approx(lm.overall.bpb - gz.overall.bpb)
    assert se > 0


@pytest.mark.parametrize("d,L,V,P,tied", [(32, 2, 300, 64, True), (48, 3, 1000, 128, True), (32, 1, 257, 16, False)])
def test_non_embedding_params_by_hand_and_closed_form(d, L, V, P, tied):
    "N = every parameter less wte, wpe (and an untied lm_head): 12 L d^2 + 13 L d + 2 d for GPT-2 (exact)."
    from transformers import GPT2Config, GPT2LMHeadModel
    model = GPT2LMHeadModel(GPT2Config(vocab_size=V, n_positions=P, n_embd=d, n_layer=L, n_head=2,
                                       tie_word_embeddings=tied))
    assert (model.lm_head.weight is model.transformer.wte.weight) == tied
    by_name = {k: p.numel() for k, p in model.named_parameters()}
    embeddings = ("transformer.wte.weight", "transformer.wpe.weight", "lm_head.weight")
    by_hand = sum(n for k, n in by_name.items() if k not in embeddings)
    assert non_embedding_params(model) == by_hand == L * (12 * d * d + 13 * d) + 2 * d
    assert sum(by_name.values()) - by_hand == V * d * (1 if tied else 2) + P * d


def test_non_embedding_params_refuses_a_model_without_positions():
    with pytest.raises(ValueError, match="transformer.wpe"):
        non_embedding_params(torch.nn.Linear(3, 3))


def test_stderr_agrees_with_a_stratified_bootstrap():
    "The delta-method standard error against 4000 stratified bootstrap draws of the documents (10% tolerance)."
    g = torch.Generator().manual_seed(0)
    rows = []
    for s, rate, n in (("a", 1.3, 40), ("b", 2.9, 25), ("c", 0.8, 30)):
        x = (torch.rand(n, generator=g) * 3000 + 200).round()
        y = x * rate * (1 + 0.3 * torch.randn(n, generator=g))
        rows += [(s, float(yi), int(xi)) for yi, xi in zip(y, x)]
    rep = _report(rows)
    draws = []
    for _ in range(4000):
        Y = X = 0.0
        for s in "abc":
            d = [(y, x) for k, y, x in rows if k == s]
            for j in torch.randint(0, len(d), (len(d),), generator=g).tolist():
                Y, X = Y + d[j][0], X + d[j][1]
        draws.append(Y / (X * LN2))
    assert bpb_stderr(rep) == pytest.approx(statistics.stdev(draws), rel=0.1)
