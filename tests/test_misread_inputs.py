"""Inputs the course's commands misread (issue 47, items 4-6): a `.jsonl.zst` compressed with a zstd
dictionary is not a corrupt stream, an adapter path with '=' is a path, and a local folder named like
a reference set (or a mini-Pile split) is not silently ignored."""
import contextlib, io, json

import numpy as np
import pytest
import zstandard
from PIL import Image

from course_lib.pile import PileFormatError, read_jsonl_zst
from course_lib.cli.pile import pile_main

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
    from course_lib.pile import load_corpus
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
    rc, out, err = run_pile(["stats", shard])   # a usage error (2), the file is not damaged
    assert rc == 2 and f"zstd dictionary {did}" in err and "--zstd-dict" in err
    rc, out, err = run_pile(["stats", shard, shard, "--processes", "2", "--json"])
    assert rc == 2 and f"zstd dictionary {did}" in err
    rc, out, err = run_pile(["stats", shard, shard, "--zstd-dict", dict_file, "--processes", "2",
                             "--json"])
    assert rc == 0, err
    rows = json.loads(out)["subsets"]
    assert [r["docs"] for r in rows if r["pile_set_name"] == "total"] == [2 * len(RECORDS)]
    rc, out, err = run_pile(["stats", shard, "--zstd-dict", tmp_path/"missing.dict"])
    assert rc == 2 and "missing.dict" in err


def test_course_bpb_takes_a_zstd_dictionary(zdict, tmp_path, capsys):
    from course_lib.cli.bpb import bpb_main
    from test_bpb_inputs import tiny as tiny_fixture   # a random GPT-2 with 32 positions
    model, tok, m = tiny_fixture.__wrapped__(tmp_path_factory=_Factory(tmp_path))
    d, dict_file, did, shard = zdict
    rc = bpb_main(["--model", str(m), str(shard), "--max-docs", "4"])
    err = capsys.readouterr().err
    assert rc == 2 and f"zstd dictionary {did}" in err and "--zstd-dict" in err
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
    assert rc == 2 and f"zstd dictionary {did}" in err and "--zstd-dict" in err
    rc, out, err = run_pile(["clean", src, tmp_path/"out", "--dedup", "none", "--filters", "none",
                             "--zstd-dict", dict_file])
    assert rc == 0, err
    assert f"kept {len(RECORDS)} of {len(RECORDS)} documents" in out


def test_an_adapter_path_with_an_equals_sign_is_a_path(tmp_path, monkeypatch):
    from course_lib.lora import parse_adapter_spec
    monkeypatch.chdir(tmp_path)
    (tmp_path/"lr=3e-3").mkdir()
    (tmp_path/"lr=3e-3"/"a.safetensors").write_bytes(b"")
    assert parse_adapter_spec("lr=3e-3/a.safetensors") == ("lr=3e-3/a.safetensors", 1.0)
    assert parse_adapter_spec("lr=3e-3/a.safetensors=0.5") == ("lr=3e-3/a.safetensors", 0.5)
    with pytest.raises(ValueError, match=r"no file 'lr=1e-4/a\.safetensors' exists.*PATH=WEIGHT"):
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
    from course_lib.cli import fid_main
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
    from course_lib.pile import write_jsonl_zst
    write_jsonl_zst(src/"a.jsonl.zst", RECORDS[:3])
    (tmp_path/"val").mkdir()
    rc, out, err = run_pile(["clean", src, tmp_path/"out", "--decontaminate", "val"])
    assert rc == 2 and "./val" in err and "mini:val" in err
    assert not (tmp_path/"out").exists()


# Issue 47, the new-user trial's remaining faults: the decontamination set with the dictionary, a
# file that is no dictionary, a frame that does not name its dictionary, exit 2 for a dictionary,
# and each name of --decontaminate val,test.

def test_clean_reads_the_decontamination_set_with_the_dictionary(zdict, tmp_path):
    pytest.importorskip("datatrove")
    from course_lib.pile import write_jsonl_zst
    d, dict_file, did, shard = zdict
    src, plain = tmp_path/"in", tmp_path/"plain"
    src.mkdir(), plain.mkdir()
    (src/"shard.jsonl.zst").write_bytes(shard.read_bytes())
    write_jsonl_zst(plain/"a.jsonl.zst", RECORDS[:20])
    decon = tmp_path/"decon.jsonl.zst"
    decon.write_bytes(shard.read_bytes())
    rc, out, err = run_pile(["clean", plain, tmp_path/"out0", "--dedup", "none", "--filters",
                             "none", "--decontaminate", decon])
    assert rc == 2 and "decon.jsonl.zst" in err and "--zstd-dict" in err, err
    assert not (tmp_path/"out0").exists()            # refused before anything is written
    rc, out, err = run_pile(["clean", src, tmp_path/"out", "--dedup", "none", "--filters", "none",
                             "--zstd-dict", dict_file, "--decontaminate", decon])
    assert rc == 0, err
    assert f"kept 0 of {len(RECORDS)} documents" in out   # the same text: all contaminated


def test_a_file_that_is_no_zstd_dictionary_is_refused(zdict, tmp_path):
    from course_lib.pile import as_zstd_dict
    d, dict_file, did, shard = zdict
    (tmp_path/"empty.dict").write_bytes(b"")
    (tmp_path/"page.dict").write_text("<!DOCTYPE html><html><body>Not found</body></html>")
    (tmp_path/"cut.dict").write_bytes(dict_file.read_bytes()[:20])
    (tmp_path/"folder.dict").mkdir()
    for name, words in (("empty", "empty"), ("page", "HTML"), ("cut", "damaged")):
        with pytest.raises(ValueError, match=rf"{name}\.dict.*{words}"):
            as_zstd_dict(tmp_path/f"{name}.dict")
    with pytest.raises(ValueError, match="empty"): as_zstd_dict(b"")
    with pytest.raises(OSError, match=r"folder\.dict is a folder"):
        as_zstd_dict(tmp_path/"folder.dict")
    for name, words in (("empty", "empty"), ("page", "HTML"), ("folder", "is a folder")):
        rc, out, err = run_pile(["stats", shard, "--zstd-dict", tmp_path/f"{name}.dict"])
        assert rc == 2 and f"{name}.dict" in err and words in err, err
    (tmp_path/"raw.dict").write_text("some sample text " * 20)
    with pytest.warns(UserWarning, match="raw-content"): as_zstd_dict(tmp_path/"raw.dict")
    rc, out, err = run_pile(["stats", shard, "--zstd-dict", tmp_path/"raw.dict"])
    assert rc == 2 and "raw-content" in err and "id 0" not in err, err


def test_a_frame_that_does_not_name_its_dictionary_says_so(zdict, tmp_path):
    d, dict_file, did, shard = zdict
    zd = zstandard.ZstdCompressionDict(dict_file.read_bytes())
    lines = b"".join((json.dumps(r) + "\n").encode() for r in RECORDS)
    f = tmp_path/"nodictid.jsonl.zst"
    f.write_bytes(zstandard.ZstdCompressor(dict_data=zd, write_dict_id=False).compress(lines))
    with pytest.raises(PileFormatError) as e: list(read_jsonl_zst(f))
    msg = str(e.value)
    assert "does not name" in msg and "--zstd-dict" in msg and "dict_data" in msg, msg
    assert msg.index("--zstd-dict") < msg.index("re-download"), msg
    assert len(list(read_jsonl_zst(f, dict_data=dict_file))) == len(RECORDS)


def test_a_needed_dictionary_is_a_usage_error(zdict, tmp_path, capsys):
    d, dict_file, did, shard = zdict
    other = tmp_path/"other.dict"
    other.write_bytes(zstandard.train_dictionary(2048, [f"other text {i} lorem ipsum".encode() * 3
                                                        for i in range(400)]).as_bytes())
    for extra in ([], ["--zstd-dict", other]):
        rc, out, err = run_pile(["stats", shard, *extra])
        assert rc == 2 and f"zstd dictionary {did}" in err, err
    rc, out, err = run_pile(["stats", "--help"])
    assert rc == 0 and "exit status" in out and "zstd dictionary" in out
    if pytest.importorskip("datatrove"):
        rc, out, err = run_pile(["clean", d, tmp_path/"out", "--zstd-dict", other])
        assert rc == 2 and f"zstd dictionary {did}" in err, err
        assert not (tmp_path/"out").exists()


def test_decontaminate_refuses_each_split_name_that_is_a_folder(tmp_path, monkeypatch, capsys):
    import course_lib.cli.pile as pc
    def no_mini_pile(*a, **k): raise AssertionError("the mini-Pile was used")
    monkeypatch.setattr(pc, "mini_pile", no_mini_pile)
    monkeypatch.chdir(tmp_path)
    (tmp_path/"val").mkdir(), (tmp_path/"test").mkdir()
    for v in ("val,test", "test,val"):
        with pytest.raises(ValueError, match=r"mini:"): pc._decontaminate_paths(v)
    rc, out, err = run_pile(["clean", "--help"])
    assert rc == 0 and "mini:" in out and "exit status" in out


# Issue 47, the new-user trial (helper B): `ref:NAME` beside a folder NAME is carried through to
# the cache path, and an adapter spec with '=' that names no file says so first.

def test_course_fid_ref_name_beside_a_folder_of_that_name(tmp_path, monkeypatch):
    from course_lib.cli import fid_main
    monkeypatch.chdir(tmp_path)
    write_pngs(tmp_path/"digits-valid")
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = fid_main(["./digits-valid", "ref:digits-valid"])
    assert rc == 0, err.getvalue()
    assert "names both" not in err.getvalue() and out.getvalue().startswith("FID")


def test_an_adapter_spec_with_equals_that_names_no_file(tmp_path, monkeypatch):
    from course_lib.lora import parse_adapter_spec
    monkeypatch.chdir(tmp_path)
    (tmp_path/"lr=3e-3").mkdir()
    with pytest.raises(ValueError) as e:
        parse_adapter_spec("lr=3e-3/missing.safetensors")
    msg = str(e.value)
    assert msg.index("no file 'lr=3e-3/missing.safetensors'") < msg.index("PATH=WEIGHT")
    assert "folder 'lr=3e-3' exists" in msg and "PATH=0.8" in msg
    assert "got the weight" not in msg and "lr=0.8" not in msg
    with pytest.raises(ValueError, match=r"'lr=3e-3' is a folder, not an adapter file"):
        parse_adapter_spec("lr=3e-3")


def test_flow_grid_with_an_extreme_mu(monkeypatch):
    "FLUX's dynamic shift for any finite mu: no OverflowError, times in [0, 1], still diffusers'."
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler
    from course_lib.flux import flow_grid
    for mu in (800.0, -800.0, 1e300):
        g = flow_grid(4, mu=mu)
        assert torch.isfinite(g).all() and (g >= 0).all() and (g <= 1).all(), (mu, g)
    assert torch.equal(flow_grid(4, mu=800.0), torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0]))
    s = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True)
    for mu in (0.5, 1.15, 3.0):
        s.set_timesteps(8, mu=mu)
        assert (flow_grid(8, mu=mu) - s.sigmas).abs().max() < 1e-6
