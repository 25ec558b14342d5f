"""Inputs the course's commands misread (issue 47, items 4-6): a `.jsonl.zst` compressed with a zstd
dictionary is not a corrupt stream, an adapter path with '=' is a path, and a local folder named like
a reference set (or a mini-Pile split) is not silently ignored."""
import contextlib, io, json

import numpy as np
import pytest
import zstandard
from PIL import Image

from course_lib.jsonl_zst import PileFormatError, read_jsonl_zst
from course_lib.pile_command import pile_main

RECORDS = [{"text": f"record {i}: the quick brown fox jumps over the lazy dog {i % 7}",
            "meta": {"pile_set_name": "A" if i % 2 else "B"}} for i in range(400)]


@pytest.fixture(scope="module")
def zdict(tmp_path_factory):
    "`(folder, dictionary file, dictionary id, .jsonl.zst file compressed with it)`."
    d = tmp_path_factory.mktemp("zdict")
    (d/"shards").mkdir()
    lines = [(json.dumps(r) + "\n").encode() for r in RECORDS]
    zd = zstandard.train_dictionary(2048, lines * 4)
    (d/"pile.dict").write_bytes(zd.as_bytes())
    cctx = zstandard.ZstdCompressor(dict_data=zd, write_checksum=True)
    (d/"shards"/"shard.jsonl.zst").write_bytes(cctx.compress(b"".join(lines)))
    arr = json.dumps([r["text"] for r in RECORDS[:5]]).encode()
    (d/"shards"/"array.json.zst").write_bytes(cctx.compress(arr))
    return d/"shards", d/"pile.dict", zd.dict_id(), d/"shards"/"shard.jsonl.zst"


def test_a_dictionary_frame_names_the_dictionary_it_needs(zdict):
    d, dict_file, did, shard = zdict
    with pytest.raises(PileFormatError) as e:
        list(read_jsonl_zst(shard))
    msg = str(e.value)
    assert f"zstd dictionary {did}" in msg and "--zstd-dict" in msg and "corrupt" not in msg
    assert e.value.dict_id == did and str(shard) in msg


def test_reading_with_the_dictionary_works(zdict):
    from course_lib.pile_corpus import load_corpus
    d, dict_file, did, shard = zdict
    for threaded in (True, False):
        got = list(read_jsonl_zst(shard, dict_data=dict_file.read_bytes(), threaded=threaded))
        assert got == RECORDS
    assert list(load_corpus(d/"array.json.zst", dict_data=dict_file.read_bytes()))[0]["text"] \
        == RECORDS[0]["text"]
    assert len(list(load_corpus(d, dict_data=zstandard.ZstdCompressionDict(
        dict_file.read_bytes())))) == len(RECORDS) + 5


def test_the_wrong_dictionary_names_both_ids(zdict, tmp_path):
    d, dict_file, did, shard = zdict
    other = zstandard.train_dictionary(2048, [f"other text {i} lorem ipsum dolor".encode() * 3
                                              for i in range(300)])
    with pytest.raises(PileFormatError, match=rf"dictionary {did}.* id {other.dict_id()}"):
        list(read_jsonl_zst(shard, dict_data=other))


def run_pile(argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = pile_main([str(a) for a in argv])
    return rc, out.getvalue(), err.getvalue()


def test_course_pile_stats_takes_a_zstd_dictionary(zdict, tmp_path):
    d, dict_file, did, shard = zdict
    rc, out, err = run_pile(["stats", shard])
    assert rc == 1 and f"zstd dictionary {did}" in err and "--zstd-dict" in err
    rc, out, err = run_pile(["stats", shard, shard, "--processes", "2", "--json"])
    assert rc == 1 and f"zstd dictionary {did}" in err
    rc, out, err = run_pile(["stats", shard, shard, "--zstd-dict", dict_file, "--processes", "2",
                             "--json"])
    assert rc == 0, err
    rows = json.loads(out)["subsets"]
    assert [r["docs"] for r in rows if r["pile_set_name"] == "total"] == [2 * len(RECORDS)]
    rc, out, err = run_pile(["stats", shard, "--zstd-dict", tmp_path/"missing.dict"])
    assert rc == 2 and "missing.dict" in err


def test_course_bpb_takes_a_zstd_dictionary(zdict, tmp_path, capsys):
    from course_lib.bpb_command import bpb_main
    from test_bpb_inputs import tiny as tiny_fixture   # a random GPT-2 with 32 positions
    model, tok, m = tiny_fixture.__wrapped__(tmp_path_factory=_Factory(tmp_path))
    d, dict_file, did, shard = zdict
    rc = bpb_main(["--model", str(m), str(shard), "--max-docs", "4"])
    err = capsys.readouterr().err
    assert rc == 1 and f"zstd dictionary {did}" in err and "--zstd-dict" in err
    rc = bpb_main(["--model", str(m), str(shard), "--max-docs", "4", "--zstd-dict",
                   str(dict_file), "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert {r["pile_set_name"] for r in json.loads(out)["subsets"]} >= {"A", "B"}


class _Factory:
    def __init__(self, root): self.root = root
    def mktemp(self, name): return self.root/name


def test_course_pile_clean_takes_a_zstd_dictionary(zdict, tmp_path):
    pytest.importorskip("datatrove")
    d, dict_file, did, shard = zdict
    src = tmp_path/"in"
    src.mkdir()
    (src/"shard.jsonl.zst").write_bytes(shard.read_bytes())
    rc, out, err = run_pile(["clean", src, tmp_path/"out0", "--dedup", "none", "--filters", "none"])
    assert rc in (1, 2) and f"zstd dictionary {did}" in err and "--zstd-dict" in err
    rc, out, err = run_pile(["clean", src, tmp_path/"out", "--dedup", "none", "--filters", "none",
                             "--zstd-dict", dict_file])
    assert rc == 0, err
    assert f"kept {len(RECORDS)} of {len(RECORDS)} documents" in out


def test_an_adapter_path_with_an_equals_sign_is_a_path(tmp_path, monkeypatch):
    from course_lib.lora_command import parse_adapter_spec
    monkeypatch.chdir(tmp_path)
    (tmp_path/"lr=3e-3").mkdir()
    (tmp_path/"lr=3e-3"/"a.safetensors").write_bytes(b"")
    assert parse_adapter_spec("lr=3e-3/a.safetensors") == ("lr=3e-3/a.safetensors", 1.0)
    assert parse_adapter_spec("lr=3e-3/a.safetensors=0.5") == ("lr=3e-3/a.safetensors", 0.5)
    with pytest.raises(ValueError, match=r"PATH=WEIGHT.*no file 'lr=1e-4/a\.safetensors'"):
        parse_adapter_spec("lr=1e-4/a.safetensors")


def write_pngs(folder, n=4):
    folder.mkdir(parents=True)
    for i in range(n):
        Image.fromarray(np.full((8, 8), 40 * i, np.uint8), "L").save(folder/f"{i}.png")


def test_a_folder_named_like_a_reference_set_is_refused(tmp_path, monkeypatch):
    from course_lib.metrics import as_uint8_images
    monkeypatch.chdir(tmp_path)
    write_pngs(tmp_path/"digits-valid")
    with pytest.raises(ValueError, match=r"digits-valid.*\./digits-valid.*ref:digits-valid"):
        as_uint8_images("digits-valid")
    assert as_uint8_images("./digits-valid").shape == (4, 3, 8, 8)
    assert as_uint8_images("ref:digits-valid", size=8).shape[1:] == (3, 8, 8)


def test_course_fid_refuses_a_folder_named_like_a_reference_set(tmp_path, monkeypatch):
    from course_lib.fid_command import fid_main
    monkeypatch.chdir(tmp_path)
    write_pngs(tmp_path/"digits-valid")
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = fid_main(["missing.npz", "digits-valid"])
    assert rc == 2
    msg = err.getvalue()
    assert str(tmp_path/"digits-valid") in msg and "./digits-valid" in msg
    assert "ref:digits-valid" in msg


def test_decontaminate_refuses_a_folder_named_like_a_split(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    src = tmp_path/"in"
    src.mkdir()
    from course_lib.jsonl_zst import write_jsonl_zst
    write_jsonl_zst(src/"a.jsonl.zst", RECORDS[:3])
    (tmp_path/"val").mkdir()
    rc, out, err = run_pile(["clean", src, tmp_path/"out", "--decontaminate", "val"])
    assert rc == 2 and "./val" in err and "mini:val" in err
    assert not (tmp_path/"out").exists()
