"""course_lib.pile.bits_per_byte: bits per byte against lm-evaluation-harness run on the same local model directory and documents,
rolling/strided windows, compressors, the data-parallel evaluation (2 CPU processes) and `course bpb`."""
import bz2, gzip, json, lzma, math, os, re, subprocess, sys, textwrap

import pytest
import torch
import zstandard

from course_lib.pile import BPBResult, bpb, n_bytes, prefix_token_id, rolling_windows
from course_lib.cli.bpb import bpb_main
from course_lib.pile import COMPRESSORS, compressor_bpb
from course_lib.pile import train_bpe_tokenizer
from course_lib.pile import write_jsonl_zst

DOCS = [
    {"text": "Bits per byte divides the log-likelihood by UTF-8 bytes. " * 12, "meta": {"pile_set_name": "Pile-CC"}},
    {"text": "def f(x):\n    return x ** 2  # naïve ✓\n" * 20, "meta": {"pile_set_name": "Github"}},
    {"text": "短い文書。多字节字符 🙂 café", "meta": {"pile_set_name": "Pile-CC"}},
    {"text": "a", "meta": {"pile_set_name": "Enron Emails"}},
    {"text": "The Pile is 825 GiB of text in 22 subsets.\n" * 30, "meta": {"pile_set_name": "ArXiv"}},
]
WINDOW = 32
torch.set_num_threads(1)   # tiny models: a second thread only waits (and the suite runs two workers)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    "A small random GPT-2 (weights large enough that predictions depend on the context) and a BPE tokenizer, saved to a dir."
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    tok = train_bpe_tokenizer([d["text"] for d in DOCS] * 3, vocab_size=300)
    cfg = GPT2Config(vocab_size=len(tok), n_positions=WINDOW, n_embd=32, n_layer=2, n_head=2, initializer_range=0.2,
                     bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    model = GPT2LMHeadModel(cfg).eval()
    d = tmp_path_factory.mktemp("tiny-lm")
    model.save_pretrained(d); tok.save_pretrained(d)
    return model, tok, d


def test_windows_match_the_harness():
    import lm_eval.utils as utils   # a dev requirement: import it plainly
    for w in (1, 4, 16):
        for n in range(0, 70):
            toks = list(range(100, 100 + n)); s = [-1] + toks
            ref = [utils.make_disjoint_window(p) for p in utils.get_rolling_token_windows(toks, -1, w, 1)]
            ours = rolling_windows(n, w)
            assert [((c + x)[-(w + 1):][:-1], x) for c, x in ref] == [(s[a:e], toks[e - k:e]) for a, e, k in ours]


@pytest.mark.parametrize("stride", [1, 3, 8, 16])
def test_sliding_windows_score_each_token_once(stride):
    for n in range(0, 60):
        wins = rolling_windows(n, 16, stride)
        scored = [t for a, e, k in wins for t in range(e - k, e)]
        assert scored == list(range(n))
        assert all(e - a <= 16 and k <= e - a for a, e, k in wins)
        assert all(e - a >= min(16 - stride, e - k) for a, e, k in wins)   # at least window - stride context
    with pytest.raises(ValueError, match="stride"): rolling_windows(5, 4, 5)
    with pytest.raises(ValueError, match="window"): rolling_windows(5, 0)


def test_bpb_equals_lm_evaluation_harness(tiny, monkeypatch):
    "lm-evaluation-harness itself (HFLM on the saved directory, loglikelihood_rolling) gives the same BPB within 1e-6."
    monkeypatch.setenv("HF_HUB_OFFLINE", "1"); monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    from lm_eval.models.huggingface import HFLM
    from lm_eval.api.instance import Instance
    from lm_eval.api.metrics import bits_per_byte
    model, tok, d = tiny
    # logits_cache=False: the harness's logits cache (reusing one forward pass for requests that share a prefix)
    # changes the result of rolling windows over repeated text when batch_size > 1 (batch_size=1 agrees either way)
    lm = HFLM(pretrained=str(d), tokenizer=str(d), device="cpu", batch_size=4, max_length=WINDOW, logits_cache=False)
    reqs = [Instance("loglikelihood_rolling", doc={}, arguments=(x["text"],), idx=i) for i, x in enumerate(DOCS)]
    ll = lm.loglikelihood_rolling(reqs, disable_tqdm=True)
    # the harness's own aggregation: items are (loglikelihood, utf-8 bytes) pairs
    harness = bits_per_byte([(l, len(x["text"].encode("utf-8"))) for l, x in zip(ll, DOCS)])
    rep = bpb(model, tok, DOCS, window=WINDOW)
    assert abs(rep.overall.bpb - harness) / harness < 1e-6, (rep.overall.bpb, harness)
    for (subset, nll, ntok, nb), l in zip(rep.per_doc, ll):   # per document too
        assert abs(nll + l) <= 1e-6 * abs(l)
    assert rep.overall.bytes == sum(len(x["text"].encode("utf-8")) for x in DOCS) == sum(map(n_bytes, [x["text"] for x in DOCS]))
    assert rep.overall.bytes > sum(len(x["text"]) for x in DOCS)   # multi-byte characters count as bytes


def test_bpb_against_the_models_own_loss(tiny):
    model, tok, _ = tiny
    text = "café 🙂 naïve ✓ bits"
    ids = [prefix_token_id(tok)] + tok.encode(text)
    assert len(ids) <= WINDOW
    with torch.no_grad(): loss = model(torch.tensor([ids]), labels=torch.tensor([ids])).loss.item()
    r = bpb(model, tok, [text], window=WINDOW).overall
    assert r.tokens == len(ids) - 1 and abs(r.nll - loss * r.tokens) / r.nll < 1e-5
    assert abs(r.bpb - r.nll / (n_bytes(text) * math.log(2))) < 1e-12
    assert abs(r.bpb - (r.tokens / r.bytes) * r.bits_per_token) < 1e-12 and abs(r.perplexity - math.exp(loss)) / r.perplexity < 1e-5


@pytest.mark.parametrize("stride", [None, 8])
def test_batched_equals_one_window_at_a_time(tiny, stride):
    model, tok, _ = tiny
    a = bpb(model, tok, DOCS, window=WINDOW, stride=stride, batch_size=16)
    b = bpb(model, tok, DOCS, window=WINDOW, stride=stride, batch_size=1)
    assert a.overall.tokens == b.overall.tokens and abs(a.overall.nll - b.overall.nll) / b.overall.nll < 1e-5
    assert set(a.subsets) == {"Pile-CC", "Github", "Enron Emails", "ArXiv"} and a.subsets["Pile-CC"].docs == 2


def test_strided_window_by_hand(tiny):
    "A sliding window scores each token with the context of a direct forward pass over s[start:end]."
    model, tok, _ = tiny
    text = DOCS[1]["text"]
    s = [prefix_token_id(tok)] + tok.encode(text)
    want = 0.0
    with torch.no_grad():
        for a, e, k in rolling_windows(len(s) - 1, WINDOW, 8):
            logp = torch.log_softmax(model(torch.tensor([s[a:e]])).logits[0].double(), -1)
            want -= sum(logp[j, s[a + j + 1]].item() for j in range(e - a - k, e - a))
    got = bpb(model, tok, [text], window=WINDOW, stride=8).overall.nll
    assert abs(got - want) / want < 1e-5


def test_compressor_bpb():
    texts = [d["text"] for d in DOCS]
    data = "\n".join(texts).encode("utf-8")
    L_B = sum(len(t.encode("utf-8")) for t in texts)
    gz = compressor_bpb(texts, "gzip-9")
    assert gz.bytes == L_B == len(data) - (len(texts) - 1)          # no '\n' separators in L_B
    assert gz.tokens == len(gzip.compress(data, 9, mtime=0)) - 18    # no gzip header and trailer
    assert gz.bpb == pytest.approx(8 * gz.tokens / L_B, rel=1e-12)
    assert compressor_bpb(texts, "bz2-9").tokens == len(bz2.compress(data, 9)) - 24
    xz = compressor_bpb(texts, "lzma-9e").tokens
    assert xz == len(lzma.compress(data, format=lzma.FORMAT_RAW,
                                   filters=[{"id": lzma.FILTER_LZMA2, "preset": 9 | lzma.PRESET_EXTREME}]))
    assert len(lzma.compress(data, preset=9 | lzma.PRESET_EXTREME)) - xz > 40   # the .xz container is left out
    for m in COMPRESSORS: assert 0 < compressor_bpb(texts, m).bpb < 8
    with pytest.raises(KeyError, match="zstd-19"): compressor_bpb(texts, "rar")


def test_compressor_bytes_are_the_documents_utf8_bytes():
    "Was: L_B = len('\\n'.join(texts)), one byte too many a document; now the model's denominator."
    from course_lib.pile import BPBReport
    texts = [d["text"] for d in DOCS]
    for m in ("gzip-9", "zstd-19"):
        assert compressor_bpb(texts, m).bytes == sum(n_bytes(t) for t in texts)
    assert compressor_bpb(["a"] * 100, "zstd-19").bytes == 100


def test_zstd_code_bytes_leaves_out_every_frame_header():
    "A frame is magic (4) + frame header + 3 bytes a block (+ 4 with a checksum); measured with zstandard."
    from course_lib.pile import zstd_code_bytes
    for kw in ({}, {"write_checksum": True}, {"write_content_size": False, "write_checksum": False}):
        cctx = zstandard.ZstdCompressor(level=19, **kw)
        for b in (b"", b"x", b"hello world " * 3, bytes(range(256)) * 900):   # raw, compressed, RLE, 2 blocks
            f = cctx.compress(b)
            blocks = max(1, -(-len(b) // (128 << 10)))
            frame = zstandard.frame_header_size(f) + 3 * blocks + 4 * bool(kw.get("write_checksum"))
            assert zstd_code_bytes(f) == len(f) - frame, (kw, len(b))
    two = zstandard.ZstdCompressor().compress(b"ab") + zstandard.ZstdCompressor().compress(b"cd")
    assert zstd_code_bytes(two) == 4   # two raw blocks of 2 bytes
    with pytest.raises(ValueError, match="not a zstd frame"): zstd_code_bytes(b"not zstd at all")


def test_per_document_zstd_bpb_counts_no_frame_header_per_document():
    "Was: each document's frame (about 9 bytes = 72 bits) was counted, a floor of 72 / L_B bits a byte."
    from course_lib.pile import zstd_dict_bpb
    train = [f"tiny doc number {i} about bits per byte" for i in range(300)]
    docs = ["tiny doc"] * 50
    r = zstd_dict_bpb(docs, train, dict_size=4096)
    d = zstandard.train_dictionary(4096, [t.encode() for t in train])
    cctx = zstandard.ZstdCompressor(level=19, dict_data=d, write_content_size=False, write_checksum=False,
                                    write_dict_id=False)
    frames = [cctx.compress(t.encode()) for t in docs]
    empty = len(cctx.compress(b""))                  # a measured empty frame: 9 bytes
    assert r.bytes == 8 * 50 and r.docs == 50
    assert r.tokens == sum(len(f) - zstandard.frame_header_size(f) - 3 for f in frames)
    assert sum(map(len, frames)) - r.tokens >= 50 * (empty - 3)   # at least the 6-byte header a document
    assert r.bpb < 8 * sum(map(len, frames)) / r.bytes - 8 * 6 / 8


def test_bpb_result_arithmetic():
    r = BPBResult().add(100.0, 50, 200).add(50.0, 25, 100, docs=2)
    assert r.docs == 3 and r.bpb == 150 / (300 * math.log(2)) and r.loss == 2.0 and r.perplexity == math.exp(2)


def test_two_processes_same_totals(tiny, tmp_path):
    "torch.distributed with 2 CPU processes (gloo) through Accelerate gives the totals of one process."
    model, tok, d = tiny
    write_jsonl_zst(tmp_path / "docs.jsonl.zst", DOCS)
    script = tmp_path / "dp.py"
    script.write_text(textwrap.dedent(f"""
        import json, torch
        torch.set_num_threads(1)
        from accelerate import Accelerator
        from course_lib.pile import bpb
        from course_lib.pile import load_local_lm
        from course_lib.pile import read_jsonl_zst
        acc = Accelerator(cpu=True)
        model, tok = load_local_lm({str(d)!r})
        rep = bpb(model, tok, read_jsonl_zst({str(tmp_path / 'docs.jsonl.zst')!r}), window={WINDOW}, accelerator=acc)
        if acc.is_main_process:
            json.dump({{"world": acc.num_processes, "nll": rep.overall.nll, "tokens": rep.overall.tokens,
                        "bytes": rep.overall.bytes, "docs": rep.overall.docs,
                        "subsets": {{k: [v.nll, v.tokens, v.bytes] for k, v in rep.subsets.items()}}}},
                      open({str(tmp_path / 'out.json')!r}, "w"))
        acc.wait_for_everyone()                    # no rank leaves while the other still talks to it
        torch.distributed.destroy_process_group()  # and gloo is shut down before the interpreter is
    """))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    # --standalone: torchrun's own rendezvous on a port it picks (no port chosen here and raced for). Up to two
    # retries when the failure is the transport's, never when the script raises: a port taken, a rendezvous timeout,
    # or a rank killed by SIGABRT inside gloo (seen in 2 of some 30 runs in the floors' venv, CI's and a fresh
    # clone's, never reproduced here; the aborting rank's own lines are kept and shown if every attempt fails)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script)]
    errors = []
    for attempt in range(3):
        (tmp_path / "out.json").unlink(missing_ok=True)
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        # torchrun's summary of a failed rank fills the end of its output; the ranks' own errors come first
        errors += [f"attempt {attempt + 1}: {l}" for l in (r.stdout + r.stderr).splitlines()
                   if re.search(r"Error|Exception|terminate called|what\(\)|Traceback|Signal \d+", l)]
        transient = re.search(r"EADDRINUSE|[Aa]ddress already in use|[Rr]endezvous.*(timed out|timeout)|Connection reset"
                              r"|Signal 6 \(SIGABRT\)", r.stdout + r.stderr)
        script_failed = re.search(r"exitcode\s*:\s*1\b", r.stdout + r.stderr)   # a rank raised: no retry
        if r.returncode == 0 or not transient or script_failed:
            break
    assert r.returncode == 0, "\n".join(errors[:60]) + "\n...\n" + r.stderr[-2000:]
    out = json.loads((tmp_path / "out.json").read_text())
    one = bpb(model, tok, DOCS, window=WINDOW)
    assert out["world"] == 2 and out["docs"] == one.overall.docs == len(DOCS)
    assert out["tokens"] == one.overall.tokens and out["bytes"] == one.overall.bytes
    assert abs(out["nll"] - one.overall.nll) <= 1e-6 * one.overall.nll
    for k, (nll, ntok, nb) in out["subsets"].items():
        assert ntok == one.subsets[k].tokens and nb == one.subsets[k].bytes and abs(nll - one.subsets[k].nll) <= 1e-6 * nll


def test_cli(tiny, tmp_path, capsys):
    model, tok, d = tiny
    write_jsonl_zst(tmp_path / "v.jsonl.zst", DOCS)
    assert bpb_main(["--model", str(d), str(tmp_path / "v.jsonl.zst"), "--json", "--compressors"]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = {r["pile_set_name"]: r for r in out["subsets"]}
    ref = bpb(model, tok, DOCS)
    assert abs(rows["all"]["bpb"] - ref.overall.bpb) < 1e-9 and rows["all"]["bytes"] == ref.overall.bytes
    assert "gzip-9" in out["compressors"]
    assert bpb_main(["--model", str(d), str(tmp_path / "v.jsonl.zst"), "--stride", "8"]) == 0
    assert "Github" in capsys.readouterr().out
    assert bpb_main(["--model", str(tmp_path / "nomodel"), str(tmp_path / "v.jsonl.zst")]) == 2
    assert "config.json" in capsys.readouterr().err
    assert bpb_main(["--model", str(d), str(tmp_path / "none.jsonl.zst")]) == 2
    assert bpb_main(["--model", str(d), str(tmp_path / "v.jsonl.zst"), "--window", "0"]) == 2
    assert bpb_main([str(tmp_path / "v.jsonl.zst")]) == 2

