"""course_lib.pile.format on inputs off the lesson's path (issue 17, kinds 1 and 2): valid files that must
be read (long-window zstd, a byte-order mark, list texts, .json.zst shards, big integers), damage
that must be reported (checksums), errors that must cross process boundaries, and names of subsets
that are not strings."""
import importlib, inspect, io, json, multiprocessing, os, pickle, pkgutil, warnings

import lm_dataformat
import pytest
import zstandard

import course_lib
import course_lib.pile.mini
from course_lib.pile import CorruptStreamError, PileFormatError, ReadStats, read_jsonl_zst, write_jsonl_zst
from course_lib.pile import count_subsets, filter_subsets, pile_set_name
from course_lib.pile import load_corpus
from course_lib.pile.mini import _stats_one
from course_lib.cli.pile import pile_main

LINES = [{"text": f"record {i} " + "abc " * 50, "meta": {"pile_set_name": "Github", "i": i}}
         for i in range(200)]


def jsonl(records) -> bytes:
    return b"".join(json.dumps(r).encode() + b"\n" for r in records)


def long_window_zst(path, payload: bytes, window_log: int):
    "What `zstd --long=<window_log>` writes: a frame that declares a 2**window_log byte window."
    params = zstandard.ZstdCompressionParameters(window_log=window_log, enable_ldm=True)
    buf = io.BytesIO()
    with zstandard.ZstdCompressor(compression_params=params).stream_writer(buf, closefd=False) as w:
        w.write(payload)
    path.write_bytes(buf.getvalue())
    assert zstandard.get_frame_parameters(buf.getvalue()).window_size == 1 << window_log
    return path


def run_cli(argv, capsys):
    rc = pile_main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


# ---- kind 1: valid files are read ---------------------------------------------------------------

@pytest.mark.parametrize("window_log", [28, 31])
def test_long_window_files_are_read(tmp_path, window_log, capsys):
    f = long_window_zst(tmp_path / "long.jsonl.zst", jsonl(LINES), window_log)
    for threaded in (True, False):
        assert list(read_jsonl_zst(f, threaded=threaded)) == LINES
    rc, out, err = run_cli(["stats", str(f), "--json"], capsys)
    assert rc == 0, err
    row = json.loads(out)["subsets"][0]
    assert (row["pile_set_name"], row["docs"]) == ("Github", 200)


def test_byte_order_mark_at_the_start(tmp_path):
    payload = b"\xef\xbb\xbf" + jsonl(LINES[:3])
    for f in (tmp_path / "bom.jsonl", tmp_path / "bom.jsonl.zst"):
        zst = f.suffix == ".zst"
        f.write_bytes(zstandard.ZstdCompressor().compress(payload) if zst else payload)
        theirs = [t for t, _ in lm_dataformat.Reader(str(f)).stream_data(get_meta=True)]
        assert [r["text"] for r in read_jsonl_zst(f)] == theirs == [r["text"] for r in LINES[:3]]
        st = ReadStats()
        assert len(list(read_jsonl_zst(f, errors="skip", stats=st))) == 3 and st.skipped == 0


def test_text_as_a_list_is_joined_as_lm_dataformat_joins_it(tmp_path):
    recs = [{"text": ["first part", "second", ""], "meta": {"pile_set_name": "ArXiv"}},
            {"text": [], "meta": {}}, {"text": "plain", "meta": {}}]
    f = tmp_path / "list.jsonl.zst"
    f.write_bytes(zstandard.ZstdCompressor().compress(jsonl(recs)))
    theirs = list(lm_dataformat.Reader(str(f)).stream_data(get_meta=True))
    ours = [(r["text"], r["meta"]) for r in read_jsonl_zst(f)]
    assert ours == theirs
    assert ours[0][0] == "first part\n\nsecond\n\n"


def test_text_list_with_a_non_string_is_still_an_error(tmp_path):
    f = tmp_path / "bad.jsonl"
    f.write_bytes(jsonl([{"text": ["a", 3], "meta": {}}]))
    with pytest.raises(PileFormatError, match=r"line 1: .*'text' is list, not str \(or a list of"):
        list(read_jsonl_zst(f))


def test_json_zst_shards_in_a_folder_are_read_or_named(tmp_path, capsys):
    d = tmp_path / "shards"
    d.mkdir()
    arr = ["doc one", {"text": "doc two", "meta": {"pile_set_name": "Github"}}]   # lm_dataformat's
    (d / "a.json.zst").write_bytes(zstandard.ZstdCompressor().compress(json.dumps(arr).encode()))
    lines = zstandard.ZstdCompressor().compress(jsonl(LINES[:2]))
    (d / "b.json.zst").write_bytes(lines)   # JSON lines under the same name
    (d / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(jsonl(LINES[2:3])))
    (d / "notes.txt").write_text("not a shard")
    with pytest.warns(UserWarning, match=r"skipped 1 file\(s\) that are not shards .*: notes.txt"):
        texts = [r["text"] for r in load_corpus(d)]
    assert texts == ["doc one", "doc two"] + [r["text"] for r in LINES[:3]]
    rc, out, err = run_cli(["stats", str(d), "--json"], capsys)
    assert rc == 0, err
    assert json.loads(out)["subsets"][-1]["docs"] == 5
    assert "skipped 1 file(s)" in err and "notes.txt" in err


def test_gzip_and_upper_case_shards_in_a_folder_are_read(tmp_path, capsys):
    "Was: .jsonl.gz and .JSONL.ZST shards were left out of a folder (only the command named them)."
    import gzip
    d = tmp_path / "shards"
    d.mkdir()
    zst = lambda recs: zstandard.ZstdCompressor().compress(jsonl(recs))
    (d / "a.jsonl.zst").write_bytes(zst(LINES[:2]))
    (d / "b.jsonl.gz").write_bytes(gzip.compress(jsonl(LINES[2:4])))
    (d / "c.JSONL.ZST").write_bytes(zst(LINES[4:5]))
    (d / "d.JSONL.GZ").write_bytes(gzip.compress(jsonl(LINES[5:6])))
    (d / "e.Jsonl").write_bytes(jsonl(LINES[6:7]))
    (d / "readme.bin").write_bytes(b"\x00")
    with pytest.warns(UserWarning, match=r"skipped 1 file\(s\) that are not shards .*: readme.bin$"):
        texts = [r["text"] for r in load_corpus(d)]
    assert texts == [r["text"] for r in LINES[:7]]
    assert [r["text"] for r in load_corpus(d / "c.JSONL.ZST")] == [LINES[4]["text"]]
    st = ReadStats()
    assert [r["text"] for r in read_jsonl_zst(d / "b.jsonl.gz", stats=st)] == [r["text"] for r in LINES[2:4]]
    assert st.records == 2 and st.uncompressed_bytes == len(jsonl(LINES[2:4]))
    rc, out, err = run_cli(["stats", str(d), "--json"], capsys)
    assert rc == 0, err
    assert sum(s["docs"] for s in json.loads(out)["subsets"][:-1]) == 7, out
    assert "readme.bin" in err


def test_a_truncated_gzip_shard_is_reported(tmp_path):
    import gzip
    data = gzip.compress(jsonl(LINES[:50]))
    (tmp_path / "t.jsonl.gz").write_bytes(data[: len(data) // 2])
    with pytest.raises(CorruptStreamError, match=r"t.jsonl.gz: corrupt or truncated gzip stream .*gzip"):
        list(load_corpus(tmp_path / "t.jsonl.gz"))


@pytest.mark.parametrize("name", ["e.jsonl.zst", "e.JSONL.ZST", "e.json.zst", "e.jsonl.gz"])
def test_a_zero_byte_compressed_shard_is_an_error(tmp_path, name):
    "Was: a 0-byte .jsonl.zst read as a shard with no records, without a word."
    (tmp_path / name).write_bytes(b"")
    (tmp_path / "ok.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(jsonl(LINES[:1])))
    for where in (tmp_path / name, tmp_path):   # the file, and the folder that holds it
        with pytest.raises(PileFormatError, match=rf"{name}: the file is empty \(0 bytes\)"):
            list(load_corpus(where))
    empty_frame = tmp_path / "sub"
    empty_frame.mkdir()
    write_jsonl_zst(empty_frame / "none.jsonl.zst", [])   # a valid file of no records is still read
    assert (empty_frame / "none.jsonl.zst").stat().st_size > 0 and list(load_corpus(empty_frame)) == []


def test_a_zero_byte_plain_jsonl_is_an_empty_shard(tmp_path):
    (tmp_path / "e.jsonl").write_bytes(b"")
    assert list(load_corpus(tmp_path / "e.jsonl")) == []


def test_a_folder_of_nothing_readable_names_what_it_holds(tmp_path):
    (tmp_path / "x.parquet").write_bytes(b"PAR1")
    with pytest.raises(FileNotFoundError, match="holds no .jsonl.zst/.jsonl.gz/.jsonl/.json.zst .*x.parquet"):
        list(load_corpus(tmp_path))


def test_big_integers_round_trip(tmp_path):
    big = 123456789012345678901234567890
    src = tmp_path / "big.jsonl"
    src.write_bytes(jsonl([{"text": "a", "meta": {"id": big, "ids": [-big, 1]}},
                           {"text": "b", "meta": {}}]))
    recs = list(read_jsonl_zst(src))
    assert recs[0]["meta"]["id"] == big
    assert write_jsonl_zst(tmp_path / "out.jsonl.zst", recs) == 2
    assert list(read_jsonl_zst(tmp_path / "out.jsonl.zst")) == recs


def test_unwritable_record_is_named(tmp_path):
    recs = [{"text": "a", "meta": {}}, {"text": "b", "meta": {"when": {1, 2}}}]
    with pytest.raises(TypeError, match=r"record 1 cannot be written as JSON.*set"):
        write_jsonl_zst(tmp_path / "out.jsonl.zst", recs)


def test_written_files_carry_checksums_and_damage_is_reported(tmp_path):
    f = tmp_path / "w.jsonl.zst"
    write_jsonl_zst(f, LINES)
    data = f.read_bytes()
    assert zstandard.get_frame_parameters(data).has_checksum
    bad = bytearray(data)
    bad[-2] ^= 0x01   # the content checksum itself: every block decodes, only the checksum tells
    (tmp_path / "bad.jsonl.zst").write_bytes(bytes(bad))
    for threaded in (True, False):
        want = f"checksum mismatch in the frame that ends at compressed byte offset {len(data)}"
        with pytest.raises(CorruptStreamError, match=want) as e:
            list(read_jsonl_zst(tmp_path / "bad.jsonl.zst", errors="skip", threaded=threaded))
        assert e.value.offset == len(data)


def test_no_flipped_byte_changes_records_silently(tmp_path):
    f = tmp_path / "w.jsonl.zst"
    write_jsonl_zst(f, LINES)
    data = f.read_bytes()
    for i in range(6, len(data), max(1, len(data) // 40)):   # after the frame header, to the end
        bad = bytearray(data)
        bad[i] ^= 0x10
        (tmp_path / "bad.jsonl.zst").write_bytes(bytes(bad))
        try:
            recs = list(read_jsonl_zst(tmp_path / "bad.jsonl.zst", errors="skip"))
        except CorruptStreamError:
            continue
        assert recs == LINES, f"byte {i} flipped: records changed without an error"


# ---- kind 2: errors cross processes; output stays valid ----------------------------------------

def library_exception_classes():
    "Every exception (and warning) class defined in course_lib's modules, its subpackages' included."
    out = {}
    for m in pkgutil.walk_packages(course_lib.__path__, "course_lib."):
        mod = importlib.import_module(m.name)
        for name, obj in vars(mod).items():
            ours = inspect.isclass(obj) and obj.__module__ == mod.__name__
            if ours and issubclass(obj, BaseException):
                out[f"{mod.__name__}.{name}"] = obj
    return out


def example(cls):
    "An instance of `cls` built from its own constructor's parameters."
    params = [p for p in inspect.signature(cls.__init__).parameters.values()
              if p.name != "self" and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    kinds = [p.kind for p in inspect.signature(cls.__init__).parameters.values()]
    if not params or inspect.Parameter.VAR_POSITIONAL in kinds:
        return cls("what went wrong")
    values = {"path": "/data/x.jsonl.zst", "line": 7, "offset": 4096, "good_records": 12, "cell": 3,
              "notebook": "nbs/13_sampling.ipynb"}
    return cls(*[values.get(p.name, f"{p.name} value") for p in params])


@pytest.mark.parametrize("name", sorted(library_exception_classes()))
def test_every_library_exception_survives_pickling(name):
    cls = library_exception_classes()[name]
    e = example(cls)
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is cls
    assert str(back) == str(e) and back.args == e.args
    assert vars(back) == vars(e)


def test_the_library_has_the_exception_classes_this_test_expects():
    names = set(library_exception_classes())
    assert {"course_lib.pile.jsonl_zst.PileFormatError", "course_lib.pile.jsonl_zst.CorruptStreamError"} <= names


def test_bad_line_in_a_worker_process_reaches_the_parent(tmp_path, capsys):
    good, bad = tmp_path / "good.jsonl.zst", tmp_path / "bad.jsonl.zst"
    write_jsonl_zst(good, LINES[:3])
    bad.write_bytes(zstandard.ZstdCompressor().compress(jsonl(LINES[:2]) + b"{not json\n"))
    ctx = multiprocessing.get_context("forkserver")
    with ctx.Pool(2) as pool:
        res = pool.apply_async(_stats_one, (str(bad), "strict"))
        with pytest.raises(PileFormatError, match="bad.jsonl.zst, line 3: invalid JSON") as e:
            res.get(timeout=60)   # before: the pool's result thread died unpickling it; this hung
        assert e.value.line == 3
    rc, out, err = run_cli(["stats", str(good), str(bad), "--processes", "2"], capsys)
    assert rc == 1
    assert "bad.jsonl.zst, line 3: invalid JSON" in err and "BrokenProcessPool" not in err


def _die(*args):
    os._exit(3)   # a worker killed (out of memory, a signal): no error comes back


def test_a_dead_worker_is_reported(tmp_path, capsys, monkeypatch):
    for i in range(2):
        write_jsonl_zst(tmp_path / f"s{i}.jsonl.zst", LINES[:2])
    monkeypatch.setattr(course_lib.pile.mini, "_stats_one", _die)   # the forked workers run this
    rc, out, err = run_cli(["stats", str(tmp_path), "--processes", "2"], capsys)
    assert rc == 1 and "a worker process died" in err and "Traceback" not in err


@pytest.mark.parametrize("name", [["Github"], {"a": 1}, 7])
def test_pile_set_name_that_is_not_a_string(tmp_path, name, capsys):
    recs = [{"text": "a", "meta": {"pile_set_name": name}},
            {"text": "bb", "meta": {"pile_set_name": "Github"}},
            {"text": "c", "meta": {"pile_set_name": None}}]
    assert [pile_set_name(r) for r in recs] == [json.dumps(name), "Github", "unknown"]
    want = {json.dumps(name): 1, "Github": 1, "unknown": 1}
    assert {k: v.docs for k, v in count_subsets(recs).items()} == want
    assert list(filter_subsets(recs, ["Github"])) == [recs[1]]
    f = tmp_path / "names.jsonl.zst"
    write_jsonl_zst(f, recs)
    for errors in ("strict", "skip"):
        rc, out, err = run_cli(["stats", str(f), "--json", "--errors", errors], capsys)
        assert rc == 0, err
        assert {r["pile_set_name"]: r["docs"] for r in json.loads(out)["subsets"]} == \
            {json.dumps(name): 1, "Github": 1, "unknown": 1, "total": 3}


def test_unreadable_text_files_are_counted_when_skipped(tmp_path, capsys):
    (tmp_path / "good.txt").write_text("fine")
    (tmp_path / "bad.txt").write_bytes(b"\xff\xfe not UTF-8")
    with pytest.raises(PileFormatError, match="bad.txt: not UTF-8 text"):
        list(load_corpus(tmp_path))
    st = ReadStats()
    assert [r["text"] for r in load_corpus(tmp_path, errors="skip", stats=st)] == ["fine"]
    assert (st.skipped, st.bad_utf8) == (1, 1) and "bad.txt" in st.errors[0][1]
    rc, out, err = run_cli(["stats", str(tmp_path), "--json", "--errors", "skip"], capsys)
    assert rc == 0 and json.loads(out)["skipped_lines"] == 1


def test_text_files_lose_their_byte_order_mark(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"\xef\xbb\xbfhello")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert [r["text"] for r in load_corpus(tmp_path)] == ["hello"]


def test_nan_and_infinity_in_meta_are_refused_not_written_as_null(tmp_path):
    "orjson writes NaN as null: the value would come back as None, silently."
    from course_lib.pile import write_jsonl_zst
    for meta, where in [({"v": float("nan")}, r"meta\['v'\] = nan"),
                        ({"big": 2 ** 100, "w": [1.0, float("inf")]}, r"meta\['w'\]\[1\] = inf")]:
        with pytest.raises(TypeError, match=rf"record 1 cannot be written as JSON: .*{where}"):
            write_jsonl_zst(tmp_path / "x.jsonl.zst", [{"text": "a", "meta": {}}, {"text": "b", "meta": meta}])


def test_composition_of_no_documents_is_all_zero():
    "The 'total' row of an empty file said 1 byte / 1024 (the share's guard against dividing by zero leaked)."
    from course_lib.pile import composition_table
    total = composition_table({})[-1]
    assert total == {"pile_set_name": "total", "docs": 0, "bytes": 0, "share_pct": 0.0, "mean_doc_kib": 0.0}
