"""`course bpb` and `course_lib.pile.bits_per_byte` on inputs off the lesson's path (issue 17, kind 2): nothing to
score, a subset with no bytes, a truncated file after the documents asked for, a window longer than
the model's context, bad lines with `--errors skip`, subset names that are not strings, and a folder
with nothing to read."""
import json

import pytest
import torch
import zstandard

from course_lib.pile import bpb
from course_lib.cli.bpb import bpb_main
from course_lib.pile import train_bpe_tokenizer
from course_lib.pile import write_jsonl_zst

DOCS = [{"text": "Bits per byte divides the log-likelihood by UTF-8 bytes. " * 4,
         "meta": {"pile_set_name": "A"}},
        {"text": "def f(x):\n    return x ** 2\n" * 5, "meta": {"pile_set_name": "B"}}]
POSITIONS = 32
torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    "A random GPT-2 with 32 positions and its BPE tokenizer, saved to a directory."
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    tok = train_bpe_tokenizer([d["text"] for d in DOCS] * 3, vocab_size=300)
    cfg = GPT2Config(vocab_size=len(tok), n_positions=POSITIONS, n_embd=16, n_layer=1, n_head=2,
                     bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    model = GPT2LMHeadModel(cfg).eval()
    d = tmp_path_factory.mktemp("tiny-lm")
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return model, tok, d


def strict_json(text):
    "Parse as JSON proper: NaN and Infinity are not JSON."
    def no_constant(name): raise ValueError(f"{name} is not JSON")
    return json.loads(text, parse_constant=no_constant)


def run(argv, capsys):
    rc = bpb_main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def test_nothing_to_score_is_an_error(tiny, tmp_path, capsys):
    *_, d = tiny
    write_jsonl_zst(tmp_path / "empty-text.jsonl.zst", [{"text": "", "meta": {}}])
    rc, out, err = run(["--model", str(d), str(tmp_path / "empty-text.jsonl.zst"), "--json"], capsys)
    assert rc == 2, out
    assert "no text to score" in err and "empty-text.jsonl.zst" in err and out == ""
    (tmp_path / "zero.jsonl.zst").write_bytes(b"")   # 0 bytes: a damaged file, not an empty one (exit 1)
    rc, out, err = run(["--model", str(d), str(tmp_path / "zero.jsonl.zst"), "--json"], capsys)
    assert rc == 1 and out == "", out
    assert "zero.jsonl.zst: the file is empty (0 bytes)" in err, err


def test_json_stays_json_when_a_subset_has_no_bytes(tiny, tmp_path, capsys):
    model, tok, d = tiny
    docs = DOCS + [{"text": "", "meta": {"pile_set_name": "Empty"}}]
    write_jsonl_zst(tmp_path / "v.jsonl.zst", docs)
    argv = ["--model", str(d), str(tmp_path / "v.jsonl.zst"), "--json", "--compressors"]
    rc, out, err = run(argv, capsys)
    assert rc == 0, err
    res = strict_json(out)
    rows = {r["pile_set_name"]: r for r in res["subsets"]}
    assert rows["Empty"]["bpb"] is None and rows["Empty"]["docs"] == 1
    assert rows["all"]["bpb"] == pytest.approx(bpb(model, tok, DOCS).overall.bpb, rel=1e-9)
    assert res["compressors"]["gzip-9"]["Empty"] is None


def test_max_docs_reads_no_further_than_it_needs(tiny, tmp_path, capsys):
    *_, d = tiny
    filler = [{"text": f"filler {i} " + "x" * 3000, "meta": {}} for i in range(300)]
    write_jsonl_zst(tmp_path / "full.jsonl.zst", DOCS[:1] + filler)
    data = (tmp_path / "full.jsonl.zst").read_bytes()
    cut = tmp_path / "cut.jsonl.zst"
    cut.write_bytes(data[: len(data) * 3 // 4])   # truncated far after the first record
    rc, out, err = run(["--model", str(d), str(cut), "--max-docs", "1", "--json"], capsys)
    assert rc == 0, err
    assert strict_json(out)["subsets"][-1]["docs"] == 1
    rc, out, err = run(["--model", str(d), str(cut), "--max-docs", "400"], capsys)
    assert rc == 1 and "corrupt zstd stream" in err   # reading to the cut still reports it


def test_window_longer_than_the_models_context(tiny, tmp_path, capsys):
    model, tok, d = tiny
    write_jsonl_zst(tmp_path / "v.jsonl.zst", DOCS)
    rc, out, err = run(["--model", str(d), str(tmp_path / "v.jsonl.zst"), "--window", "64"], capsys)
    assert rc == 2
    assert "64" in err and f"({POSITIONS} tokens)" in err and "Traceback" not in err
    want = rf"window 64 is longer than the model's context \({POSITIONS} positions"
    with pytest.raises(ValueError, match=want):
        bpb(model, tok, DOCS, window=64)


def test_bad_lines_can_be_skipped(tiny, tmp_path, capsys):
    model, tok, d = tiny
    payload = b"".join(json.dumps(r).encode() + b"\n" for r in DOCS) + b"{not json\n"
    (tmp_path / "bad.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(payload))
    rc, out, err = run(["--model", str(d), str(tmp_path / "bad.jsonl.zst")], capsys)
    assert rc == 1 and "line 3: invalid JSON" in err and "--errors skip" in err
    argv = ["--model", str(d), str(tmp_path / "bad.jsonl.zst"), "--errors", "skip", "--json"]
    rc, out, err = run(argv, capsys)
    assert rc == 0, err
    want = bpb(model, tok, DOCS).overall.bpb
    assert strict_json(out)["subsets"][-1]["bpb"] == pytest.approx(want, rel=1e-9)


def test_subset_names_that_are_not_strings(tiny):
    model, tok, _ = tiny
    docs = [{**DOCS[0], "meta": {"pile_set_name": ["Github"]}}, DOCS[1]]
    rep = bpb(model, tok, docs)
    assert set(rep.subsets) == {'["Github"]', "B"}
    assert rep.overall.bytes == sum(len(x["text"].encode()) for x in docs)


def test_a_folder_with_nothing_to_read(tiny, tmp_path, capsys):
    *_, d = tiny
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "x.parquet").write_bytes(b"PAR1")
    rc, out, err = run(["--model", str(d), str(tmp_path / "data")], capsys)
    assert rc == 2 and "x.parquet" in err and "Traceback" not in err
