"""course_lib.pile.format: the Pile's jsonl.zst format (against lm_dataformat, the Pile's own reader/writer), bad input,
Table 1 of the Pile paper, the mini-Pile builder and the `course pile` command."""
import io, json, random, sys

import pytest
import zstandard

from course_lib.pile import CorruptStreamError, PileFormatError, ReadStats, read_jsonl_zst, write_jsonl_zst
from course_lib.pile import (
    PILE_TABLE1, PILE_RAW_GIB, PILE_EFFECTIVE_GIB, count_subsets, composition_table, filter_subsets,
    split_of, SPLITS, MINI_PILE_SUBSETS)
from course_lib.pile import load_corpus
from course_lib.pile import build_mini_pile
from course_lib.cli.pile import pile_main

RECORDS = [
    {"text": "héllo wörld ✓ 你好 🙂", "meta": {"pile_set_name": "Pile-CC"}},
    {"text": 'quotes " and back\\slash, a/b </script>\nnew line\ttab \u2028 sep', "meta": {"pile_set_name": "Github", "n": 3}},
    {"text": "", "meta": {"pile_set_name": "Enron Emails"}},
    {"text": "x" * 5000, "meta": {"pile_set_name": "ArXiv", "nested": {"a": [1, 2.5, None]}}},
]


def lines_zst(path, payload: bytes):
    path.write_bytes(zstandard.ZstdCompressor(level=3).compress(payload))
    return path


# ---- Table 1 -------------------------------------------------------------------------------------------------

def test_table1_is_consistent():
    assert len(PILE_TABLE1) == 22 and len({s.name for s in PILE_TABLE1}) == 22
    assert abs(sum(s.raw_gib for s in PILE_TABLE1) - PILE_RAW_GIB) < 0.05
    assert abs(sum(s.effective_gib for s in PILE_TABLE1) - PILE_EFFECTIVE_GIB) < 0.05
    assert abs(sum(s.weight_pct for s in PILE_TABLE1) - 100) < 0.05
    for s in PILE_TABLE1:
        assert abs(s.raw_gib * s.epochs - s.effective_gib) < 0.02, s
        assert abs(100 * s.effective_gib / PILE_EFFECTIVE_GIB - s.weight_pct) < 0.01, s
    by = {s.name: s for s in PILE_TABLE1}
    assert by["Pile-CC"].raw_gib == 227.12 and by["Books3"].epochs == 1.5 and by["Wikipedia (en)"].epochs == 3.0


# ---- round trips and lm_dataformat ---------------------------------------------------------------------------

@pytest.mark.parametrize("threaded", [True, False])
def test_roundtrip(tmp_path, threaded):
    assert write_jsonl_zst(tmp_path / "a.jsonl.zst", RECORDS) == len(RECORDS)
    st = ReadStats()
    assert list(read_jsonl_zst(tmp_path / "a.jsonl.zst", stats=st, threaded=threaded, read_size=7)) == RECORDS
    assert st.records == 4 and st.lines == 4 and st.skipped == 0


def test_plain_strings_and_bad_records_on_write(tmp_path):
    write_jsonl_zst(tmp_path / "s.jsonl.zst", ["a", "b"])
    assert list(read_jsonl_zst(tmp_path / "s.jsonl.zst")) == [{"text": "a", "meta": {}}, {"text": "b", "meta": {}}]
    with pytest.raises(TypeError, match="record 1"):
        write_jsonl_zst(tmp_path / "bad.jsonl.zst", [{"text": "ok"}, {"text": 3}])
    assert not (tmp_path / "bad.jsonl.zst").exists()   # atomic: nothing left behind


def test_multiple_frames(tmp_path):
    c = zstandard.ZstdCompressor()
    data = b"".join(c.compress(json.dumps(r).encode() + b"\n") for r in RECORDS)
    (tmp_path / "m.jsonl.zst").write_bytes(data)
    assert list(read_jsonl_zst(tmp_path / "m.jsonl.zst", read_size=5)) == RECORDS


def test_lm_dataformat_writes_we_read(tmp_path):
    import lm_dataformat as lmd   # a dev requirement: import it plainly
    ar = lmd.Archive(str(tmp_path / "out"))
    for r in RECORDS[:2]: ar.add_data(r["text"], meta=r["meta"])
    ar.commit("one")
    for r in RECORDS[2:]: ar.add_data(r["text"], meta=r["meta"])
    ar.commit("two")
    files = sorted((tmp_path / "out").glob("*.jsonl.zst"))
    ours = [(r["text"], r["meta"]) for f in files for r in read_jsonl_zst(f)]
    theirs = list(lmd.Reader(str(tmp_path / "out")).stream_data(get_meta=True))
    assert ours == theirs == [(r["text"], r["meta"]) for r in RECORDS]
    assert [(r["text"], r["meta"]) for r in load_corpus(tmp_path / "out")] == theirs


def test_we_write_lm_dataformat_reads(tmp_path):
    import lm_dataformat as lmd   # a dev requirement: import it plainly
    write_jsonl_zst(tmp_path / "ours.jsonl.zst", RECORDS, level=19)
    theirs = list(lmd.Reader(str(tmp_path / "ours.jsonl.zst")).stream_data(get_meta=True))
    assert theirs == [(r["text"], r["meta"]) for r in RECORDS]


# ---- bad input -----------------------------------------------------------------------------------------------

def test_truncated_stream(tmp_path):
    good = [{"text": f"document {i} " * 40, "meta": {"pile_set_name": "Pile-CC"}} for i in range(3000)]
    write_jsonl_zst(tmp_path / "g.jsonl.zst", good)
    raw = (tmp_path / "g.jsonl.zst").read_bytes()
    (tmp_path / "cut.jsonl.zst").write_bytes(raw[: len(raw) // 2])
    for errors in ("strict", "skip"):
        got = []
        with pytest.raises(CorruptStreamError) as ei:
            for r in read_jsonl_zst(tmp_path / "cut.jsonl.zst", errors=errors): got.append(r)
        e = ei.value
        assert "cut.jsonl.zst" in str(e) and "truncated" in str(e) and f"after {len(got)} good records" in str(e)
        assert 0 < e.offset <= len(raw) // 2 and e.good_records == len(got) > 0 and got == good[: len(got)]


def test_corrupt_stream(tmp_path):
    good = [{"text": f"document {i} " * 40} for i in range(3000)]
    write_jsonl_zst(tmp_path / "g.jsonl.zst", good)
    raw = bytearray((tmp_path / "g.jsonl.zst").read_bytes())
    mid = len(raw) // 2
    raw[mid: mid + 64] = bytes(64)
    (tmp_path / "bad.jsonl.zst").write_bytes(bytes(raw))
    got = []
    with pytest.raises(CorruptStreamError) as ei:
        for r in read_jsonl_zst(tmp_path / "bad.jsonl.zst", read_size=4096): got.append(r)
    assert "bad.jsonl.zst" in str(ei.value) and ei.value.good_records == len(got)
    assert mid - 8192 <= ei.value.offset <= mid + 8192 and [r["text"] for r in got] == [g["text"] for g in good[: len(got)]]


def test_not_zstd_at_all(tmp_path):
    (tmp_path / "x.jsonl.zst").write_bytes(b'{"text": "plain json, not compressed"}\n')
    with pytest.raises(CorruptStreamError, match="x.jsonl.zst"):
        list(read_jsonl_zst(tmp_path / "x.jsonl.zst"))


BAD_LINES = [
    (b'{"text": "broken', "bad_json"),
    (b'{"meta": {"pile_set_name": "Github"}}', "bad_text"),
    (b'{"text": 42}', "bad_text"),
    (b'{"text": null}', "bad_text"),
    (b'["text"]', "bad_text"),
    (b'{"text": "caf\xe9"}', "bad_utf8"),
    (b'\xff\xfe garbage', "bad_utf8"),
]


@pytest.mark.parametrize("line,kind", BAD_LINES, ids=[k + str(i) for i, (_, k) in enumerate(BAD_LINES)])
def test_bad_line_strict_and_skip(tmp_path, line, kind):
    p = lines_zst(tmp_path / "b.jsonl.zst", b'{"text": "one"}\n{"text": "two"}\n' + line + b'\n{"text": "four"}\n')
    with pytest.raises(PileFormatError, match=r"b\.jsonl\.zst, line 3") as ei:
        list(read_jsonl_zst(p))
    assert ei.value.line == 3
    st = ReadStats()
    assert [r["text"] for r in read_jsonl_zst(p, errors="skip", stats=st)] == ["one", "two", "four"]
    assert getattr(st, kind) == 1 and st.skipped == 1 and st.errors[0][0] == 3


def test_lenient_never_loses_a_good_record(tmp_path):
    rng = random.Random(0)
    good, lines = [], []
    for i in range(2000):
        if rng.random() < 0.2: lines.append(rng.choice(BAD_LINES)[0])
        else:
            r = {"text": f"doc {i} ✓ " + "y" * rng.randint(0, 3000), "meta": {"i": i}}
            good.append(r); lines.append(json.dumps(r, ensure_ascii=rng.random() < 0.5).encode())
        if rng.random() < 0.05: lines.append(b"")           # blank lines are skipped silently
    p = lines_zst(tmp_path / "mixed.jsonl.zst", b"\n".join(lines))
    st = ReadStats()
    assert list(read_jsonl_zst(p, errors="skip", stats=st, read_size=1000)) == good
    assert st.records == len(good) and st.skipped == sum(l not in (b"",) for l in lines) - len(good)


def test_empty_file_and_empty_frame(tmp_path):
    (tmp_path / "e.jsonl.zst").write_bytes(b"")
    with pytest.raises(PileFormatError, match=r"empty \(0 bytes\)"):     # a 0-byte shard is refused, not read as empty
        list(read_jsonl_zst(tmp_path / "e.jsonl.zst"))
    write_jsonl_zst(tmp_path / "f.jsonl.zst", [])
    assert list(read_jsonl_zst(tmp_path / "f.jsonl.zst")) == []
    with pytest.raises(FileNotFoundError, match="nope"):
        list(read_jsonl_zst(tmp_path / "nope.jsonl.zst"))


def test_last_line_without_newline(tmp_path):
    p = lines_zst(tmp_path / "n.jsonl.zst", b'{"text": "a"}\n{"text": "last"}')
    st = ReadStats()
    assert [r["text"] for r in read_jsonl_zst(p, stats=st)] == ["a", "last"] and st.lines == 2


def test_multi_megabyte_document(tmp_path):
    big = "".join(chr(0x4E00 + i % 2000) if i % 7 else "\n" for i in range(2_000_000))   # ~5.7 MB of UTF-8
    recs = [{"text": "small"}, {"text": big, "meta": {"pile_set_name": "Books3"}}, {"text": "after"}]
    write_jsonl_zst(tmp_path / "big.jsonl.zst", recs)
    st = ReadStats()
    got = list(read_jsonl_zst(tmp_path / "big.jsonl.zst", stats=st, read_size=1 << 12))
    assert [r["text"] for r in got] == ["small", big, "after"] and st.uncompressed_bytes > 5_000_000
    assert count_subsets(got)["Books3"].bytes == len(big.encode("utf-8"))


def test_early_stop_does_not_hang(tmp_path):
    write_jsonl_zst(tmp_path / "g.jsonl.zst", ({"text": "z" * 1000} for _ in range(20000)))
    it = read_jsonl_zst(tmp_path / "g.jsonl.zst", read_size=1 << 12)
    assert next(it)["text"] == "z" * 1000
    it.close()


def test_errors_argument():
    with pytest.raises(ValueError, match="'ignore'"):
        next(read_jsonl_zst("x.jsonl.zst", errors="ignore"))


def _frames_of_every_kind():
    "zstd frames with every header and block variant (RFC 8878): what the fast path's frame walker must follow."
    recs = [json.dumps({"text": f"doc {i} " + "ab" * (i % 50), "meta": {"i": i}}).encode() + b"\n" for i in range(90)]
    rnd = random.Random(0)
    noise = json.dumps({"text": "".join(rnd.choice("abcdefghijklmnopqrstuvwxyz0123456789 ") for _ in range(2000))}).encode() + b"\n"
    cobj = zstandard.ZstdCompressor(level=3, write_content_size=False).compressobj()
    return [zstandard.ZstdCompressor(level=3).compress(b"".join(recs[:30])),                        # content size, single segment
            zstandard.ZstdCompressor(level=1, write_checksum=True).compress(b"".join(recs[30:60])),  # content checksum
            cobj.compress(b"".join(recs[60:])) + cobj.flush(),                                       # streaming: no content size
            zstandard.ZstdCompressor().compress(b""),                                                # an empty frame
            zstandard.ZstdCompressor(level=3).compress(b'{"text": "' + b"z" * 300_000 + b'"}\n'),   # RLE blocks
            zstandard.ZstdCompressor(level=-5).compress(noise),                                      # a raw block
            b"\x50\x2a\x4d\x18" + (7).to_bytes(4, "little") + b"skipped"]                            # a skippable frame


def test_complete_files_take_the_fast_path(tmp_path, monkeypatch):
    import course_lib.pile.jsonl_zst as P   # the reader's module: where it looks the careful path up
    frames = _frames_of_every_kind()
    full = zstandard.ZstdDecompressor().stream_reader(b"".join(frames), read_across_frames=True).read()
    want = [json.loads(l) for l in full.split(b"\n") if l.strip()]
    (tmp_path / "all.jsonl.zst").write_bytes(b"".join(frames))
    def careful(*a, **k): raise AssertionError("the careful path ran on a complete file")
    monkeypatch.setattr(P, "_zstd_chunks", careful)
    for threaded in (True, False):
        for read_size in (1, 13, 1 << 24):
            assert list(read_jsonl_zst(tmp_path / "all.jsonl.zst", threaded=threaded, read_size=read_size)) == want
    rnd = random.Random(1)                                       # many reads and pieces, lines cut across them
    recs = [{"text": rnd.randbytes(300).hex()} for i in range(1000)]
    write_jsonl_zst(tmp_path / "w.jsonl.zst", recs, level=1)
    assert (tmp_path / "w.jsonl.zst").stat().st_size > 200_000
    for threaded in (True, False):
        assert [r["text"] for r in read_jsonl_zst(tmp_path / "w.jsonl.zst", threaded=threaded, read_size=5000)] == [r["text"] for r in recs]


def test_a_cut_anywhere_is_found(tmp_path):
    "A file cut inside a frame raises, with every record before the cut; a file cut at a frame boundary is a shorter valid file."
    frames = _frames_of_every_kind()
    data, bounds = b"".join(frames), {0}
    for f in frames: bounds.add(len(b"".join(frames[:frames.index(f) + 1])))
    full = zstandard.ZstdDecompressor().stream_reader(data, read_across_frames=True).read()
    # a cut at byte 0 leaves an empty file, refused as such (test_empty_file_and_empty_frame)
    cuts = sorted((set(range(0, len(data), 23)) | {b + d for b in bounds for d in (-2, -1, 0, 1, 2)})
                  - {-1, -2, 0, len(data) + 1, len(data) + 2})
    for i, cut in enumerate(cuts):
        (tmp_path / "c.jsonl.zst").write_bytes(data[:cut])
        got = []
        try:
            for r in read_jsonl_zst(tmp_path / "c.jsonl.zst", threaded=i % 4 == 0, read_size=(1 << 24) if i % 2 else 1 + i % 50):
                got.append(r)
        except CorruptStreamError as e:
            assert cut not in bounds and e.good_records == len(got) and 0 < e.offset <= cut, cut
        else: assert cut in bounds, cut
        assert [r["text"] for r in got] == [json.loads(l)["text"] for l in full.split(b"\n") if l.strip()][:len(got)]


def test_big_integers_are_exact(tmp_path):
    line = b'{"text": "a", "meta": {"id": 123456789012345678901234567890, "x": 1.5}}\n'
    p = lines_zst(tmp_path / "i.jsonl.zst", line)
    assert list(read_jsonl_zst(p)) == [json.loads(line)]   # as json (and lm_dataformat) read it


# ---- subsets, splits, the mini-Pile, folders -------------------------------------------------------------------

def test_counts_and_filter():
    c = count_subsets(RECORDS)
    assert c["Pile-CC"].bytes == len(RECORDS[0]["text"].encode("utf-8")) == 29 and c["Pile-CC"].docs == 1
    rows = composition_table(c)
    assert rows[-1]["pile_set_name"] == "total" and abs(sum(r["share_pct"] for r in rows[:-1]) - 100) < 1e-9
    assert [r["meta"]["pile_set_name"] for r in filter_subsets(RECORDS, {"Github", "ArXiv"})] == ["Github", "ArXiv"]


def test_split_of_is_deterministic_and_proportional():
    texts = [f"document number {i}" for i in range(5000)]
    splits = [split_of(t) for t in texts]
    assert splits == [split_of(t) for t in texts]
    assert 0.07 < splits.count("val") / 5000 < 0.13 and 0.07 < splits.count("test") / 5000 < 0.13


def test_build_mini_pile(tmp_path):
    paths = build_mini_pile(tmp_path / "a", max_mb_per_subset=0.05, max_doc_kb=32)
    again = build_mini_pile(tmp_path / "b", max_mb_per_subset=0.05, max_doc_kb=32)
    assert set(paths) == set(SPLITS) and all(paths[s].read_bytes() == again[s].read_bytes() for s in SPLITS)
    recs = {s: list(read_jsonl_zst(paths[s])) for s in SPLITS}
    assert all(split_of(r["text"]) == s for s in SPLITS for r in recs[s])
    assert {r["meta"]["pile_set_name"] for s in SPLITS for r in recs[s]} <= set(MINI_PILE_SUBSETS)
    assert "Github" in {r["meta"]["pile_set_name"] for r in recs["train"]}
    assert all(r["meta"]["source"] for s in SPLITS for r in recs[s])
    texts = [r["text"] for s in SPLITS for r in recs[s]]
    assert len(texts) == len(set(texts))   # deduplicated, each text in one split
    manifest = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert sum(v["docs"] for s in SPLITS for v in manifest[s].values()) == len(texts)


def test_folder_of_text_files(tmp_path):
    (tmp_path / "c" / "poems").mkdir(parents=True); (tmp_path / "c" / "code").mkdir()
    (tmp_path / "c" / "poems" / "a.txt").write_text("roses ✓", encoding="utf-8")
    (tmp_path / "c" / "code" / "b.py").write_text("print(1)\n")
    (tmp_path / "c" / "code" / "skip.bin").write_bytes(b"\x00\x01")
    recs = list(load_corpus(tmp_path / "c"))
    assert [(r["meta"]["pile_set_name"], r["text"]) for r in recs] == [("code", "print(1)\n"), ("poems", "roses ✓")]
    (tmp_path / "e").mkdir()
    with pytest.raises(FileNotFoundError, match="no .jsonl.zst"):
        list(load_corpus(tmp_path / "e"))


# ---- the command line -------------------------------------------------------------------------------------------

def test_cli_stats(tmp_path, capsys):
    write_jsonl_zst(tmp_path / "a.jsonl.zst", RECORDS)
    write_jsonl_zst(tmp_path / "b.jsonl.zst", RECORDS[:1])
    assert pile_main(["stats", str(tmp_path / "a.jsonl.zst"), str(tmp_path / "b.jsonl.zst"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    by = {r["pile_set_name"]: r for r in out["subsets"]}
    assert by["Pile-CC"]["docs"] == 2 and by["total"]["docs"] == 5
    assert pile_main(["stats", str(tmp_path / "a.jsonl.zst")]) == 0
    assert "Github" in capsys.readouterr().out
    assert pile_main(["stats", str(tmp_path / "missing.jsonl.zst")]) == 2
    assert "missing.jsonl.zst" in capsys.readouterr().err
    assert pile_main([]) == 2 and pile_main(["stats"]) == 2
    lines_zst(tmp_path / "d.jsonl.zst", b'{"text": "a"}\nnot json\n')
    assert pile_main(["stats", str(tmp_path / "d.jsonl.zst")]) == 1 and "line 2" in capsys.readouterr().err
    assert pile_main(["stats", "--errors", "skip", str(tmp_path / "d.jsonl.zst")]) == 0
    assert "(1 bad line skipped)" in capsys.readouterr().out


def test_cli_stats_processes(tmp_path, capsys):
    for i in range(5): write_jsonl_zst(tmp_path / "pile" / f"{i:02d}.jsonl.zst", RECORDS * (i + 1))
    assert pile_main(["stats", str(tmp_path / "pile"), "--json"]) == 0
    one = json.loads(capsys.readouterr().out)
    assert pile_main(["stats", str(tmp_path / "pile"), "--json", "--processes", "2"]) == 0
    assert json.loads(capsys.readouterr().out) == one and one["subsets"][-1]["docs"] == 4 * 15


def _stats_in_child(path, errors, *args):
    "Stands in for `_stats_one` in a worker: what the worker's `course_lib.pile.mini` holds, and its pid."
    import os, sys
    return getattr(sys.modules["course_lib.pile.mini"], "_TEST_MARK", None), os.getpid()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork is the start method on Linux only")
def test_stats_processes_are_forked_whatever_the_default(tmp_path, monkeypatch):
    """`course pile stats --processes 2` forks its workers on Linux (copies of this process, nothing imported again)
    even where the default start method is forkserver, as it is from Python 3.14 on."""
    import multiprocessing, os
    import course_lib.pile.mini as pc
    monkeypatch.setattr(pc, "_TEST_MARK", "set in the parent", raising=False)
    monkeypatch.setattr(pc, "_stats_one", _stats_in_child)
    tasks = [str(write_and_path(tmp_path / f"{i}.jsonl.zst")) for i in range(2)]
    default = multiprocessing.get_start_method()
    multiprocessing.set_start_method("forkserver", force=True)
    try: seen = pc._stats_parts(tasks, "strict", processes=2)
    finally: multiprocessing.set_start_method(default, force=True)
    assert all(pid != os.getpid() for _, pid in seen), seen        # ran in worker processes
    assert [m for m, _ in seen] == ["set in the parent"] * 2, seen


def write_and_path(path):
    write_jsonl_zst(path, RECORDS)
    return path


def test_cli_build_mini(tmp_path, capsys):
    assert pile_main(["build-mini", str(tmp_path / "mp"), "--max-mb", "0.02", "--max-doc-kb", "16"]) == 0
    assert all((tmp_path / "mp" / f"{s}.jsonl.zst").is_file() for s in SPLITS)
