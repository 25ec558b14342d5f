"""Unit 6 benchmark: reading Pile-format .jsonl.zst, and BPB evaluation throughput.

    python benchmarks/pile.py [--mb 120] [--repeat 2] [--shards 4] [--processes 1 2] [--no-bpb]

1. One file of >= 100 MB of uncompressed mini-Pile text (Python source code of the installed packages as `Github`,
   written at run time in a temporary folder): MB/s (uncompressed bytes a second) of
   - plain zstandard stream decompression into nothing (the single-core limit of the format),
   - JSON decoding alone of the same lines already decompressed and split in memory (msgspec, the reader's decoder,
     and orjson): the most one thread that parses can reach, whatever overlaps with it,
   - `course_lib.pile.jsonl_zst.read_jsonl_zst` (records fully parsed into dicts), threaded and not,
   - `lm_dataformat.Reader.stream_data` (the Pile's own reader), and a naive orjson line loop.
   - the reader's own line splitting and parsing over the same lines in memory (4 MB pieces, no decompression),
     and msgspec's `Decoder.decode_lines` over those pieces (splitting in C, but without the reader's line numbers);
   each also as main-thread CPU time (what the parsing thread itself spent, which a shared machine does not
   inflate), and the bounds that CPU times put on one thread, and on a decompressing thread beside the parsing one.
2. The same data in several shards of equal size, read by `course pile stats --processes N` (in this process, so
   `pile_main` with the pool it starts): scaling, against one process reading them one after another; and, for
   reference, the machine's own scaling on the same shards (N processes decompressing into nothing).
3. BPB evaluation tokens/s of `course_lib.pile.bits_per_byte.bpb` (windows batched) against one window at a time.
Ratios are against baselines measured in the same run. Nothing is downloaded."""
import argparse, contextlib, multiprocessing, io, json, os, sys, sysconfig, tempfile, time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import zstandard

from course_lib.pile import read_jsonl_zst, write_jsonl_zst, ReadStats
from course_lib.pile import mini_pile_records, format_table
from course_lib.cli.pile import pile_main
from course_lib.pile.mini import _stats_one
from course_lib.pile.jsonl_zst import _loads, _records
from course_lib.core import start_method

CTX = multiprocessing.get_context(start_method())   # the start method `course` uses (fork on Linux)


def code_records(max_bytes: int):
    "Deterministic records from the installed packages' .py files (sorted walk), then the mini-Pile, until max_bytes."
    total = 0
    roots = [Path(sysconfig.get_paths()["purelib"]), Path(sysconfig.get_paths()["stdlib"])]
    for root in roots:
        for dirpath, dirs, files in os.walk(root):
            dirs.sort()
            for f in sorted(files):
                if not f.endswith(".py"): continue
                p = Path(dirpath) / f
                try: text = p.read_text(encoding="utf-8")
                except (UnicodeDecodeError, OSError): continue
                if not text: continue
                yield {"text": text, "meta": {"pile_set_name": "Github", "source": str(p.relative_to(root))}}
                total += len(text.encode("utf-8"))
                if total >= max_bytes: return


def best(fn, repeat):
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter(); out = fn(); times.append(time.perf_counter() - t0)
    return min(times), out


def best_cpu(fn, repeat):
    """`(wall, main-thread CPU, process CPU, out)`, each the least of `repeat` runs. The main thread's CPU time is
    what the parsing thread spent working, whatever the other processes on a shared machine take from it."""
    walls, mains, procs = [], [], []
    for _ in range(repeat):
        w, m, c = time.perf_counter(), time.thread_time(), time.process_time()
        out = fn()
        walls.append(time.perf_counter() - w); mains.append(time.thread_time() - m)
        procs.append(time.process_time() - c)
    return min(walls), min(mains), min(procs), out


def plain(path):
    n = 0
    with open(path, "rb") as fh:
        r = zstandard.ZstdDecompressor().stream_reader(fh, read_across_frames=True)
        while (b := r.read(1 << 20)): n += len(b)
    return n


def ours(path, threaded=True):
    st = ReadStats()
    for _ in read_jsonl_zst(path, stats=st, threaded=threaded): pass
    return st.records


def lmd(path):
    import lm_dataformat
    return sum(1 for _ in lm_dataformat.Reader(str(path)).stream_data(get_meta=True))


def naive_orjson(path):
    import orjson
    n = 0
    with open(path, "rb") as fh:
        r = io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(fh, read_across_frames=True), 1 << 20)
        for line in r:
            if line.strip(): orjson.loads(line); n += 1
    return n


def in_memory_lines(path):
    "The file's lines, decompressed and split, in memory (for the parse-only rows; not timed)."
    with open(path, "rb") as fh:
        raw = zstandard.ZstdDecompressor().stream_reader(fh, read_across_frames=True).read()
    return [l for l in raw.split(b"\n") if l]


def parse_only(lines, loads):
    for l in lines: loads(l)
    return len(lines)


def in_memory_pieces(lines, size=4 << 20):
    "The same lines joined into pieces of about `size` bytes, as the reader's decompressor hands them over."
    pieces, cur, n = [], [], 0
    for l in lines:
        cur.append(l + b"\n"); n += len(l) + 1
        if n >= size: pieces.append(bytearray(b"".join(cur))); cur, n = [], 0
    if cur: pieces.append(bytearray(b"".join(cur)))
    return [(p, len(p)) for p in pieces]


def decode_lines(pieces):
    "msgspec's own JSON-lines decoder over the same pieces: splitting and parsing in C, no line numbers, no checks."
    import msgspec
    dec, n = msgspec.json.Decoder(), 0
    for buf, size in pieces:
        with memoryview(buf) as v: n += len(dec.decode_lines(v[:size]))
    return n


def split_and_parse(pieces):
    "The reader's own line splitting and parsing (`_records`) over in-memory pieces: no decompression."
    st = ReadStats()
    for _ in _records(iter(pieces), st, True): pass
    return st.records


def stats_cli(shards, processes):
    "`course pile stats SHARD... --json --processes N`; returns the documents counted."
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert pile_main(["stats", *map(str, shards), "--json", "--processes", str(processes)]) == 0
    return json.loads(out.getvalue())["subsets"][-1]["docs"]


def _noop(x): return x


def pool_startup(processes):
    "Starting and stopping a pool of `processes` workers that do nothing."
    with ProcessPoolExecutor(processes, mp_context=CTX) as ex: list(ex.map(_noop, range(processes)))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=float, default=120, help="uncompressed MB of the test file (>= 100 for the target)")
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--shards", type=int, default=4)
    p.add_argument("--processes", type=int, nargs="+", default=[1, 2])
    p.add_argument("--no-bpb", action="store_true")
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="pile-bench-") as d:
        d = Path(d)
        t0 = time.perf_counter()
        n_rec = write_jsonl_zst(d / "big.jsonl.zst", code_records(int(a.mb * 1e6)), level=3)
        size = plain(d / "big.jsonl.zst")
        print(f"test file: {n_rec} records, {size/1e6:.1f} MB uncompressed, {(d/'big.jsonl.zst').stat().st_size/1e6:.1f} MB "
              f"compressed (zstd 3), written in {time.perf_counter()-t0:.1f} s; cpu cores: {os.cpu_count()}")
        rows, base = [], None
        lines = in_memory_lines(d / "big.jsonl.zst")
        pieces = in_memory_pieces(lines)
        import orjson
        cases = [("plain zstd decompression (no parsing)", lambda: plain(d / "big.jsonl.zst")),
                 ("parse only: msgspec on in-memory lines", lambda: parse_only(lines, _loads)),
                 ("reader's splitting + parsing of in-memory 4 MB pieces", lambda: split_and_parse(pieces)),
                 ("msgspec decode_lines of the same pieces (no per-line checks)", lambda: decode_lines(pieces)),
                 ("parse only: orjson on in-memory lines", lambda: parse_only(lines, orjson.loads)),
                 ("read_jsonl_zst (threaded, msgspec)", lambda: ours(d / "big.jsonl.zst", True)),
                 ("read_jsonl_zst (one thread)", lambda: ours(d / "big.jsonl.zst", False)),
                 ("naive orjson line loop", lambda: naive_orjson(d / "big.jsonl.zst"))]
        try:
            import lm_dataformat  # noqa: F401
            cases.append(("lm_dataformat.Reader", lambda: lmd(d / "big.jsonl.zst")))
        except ImportError: print("lm_dataformat not installed: pip install lm_dataformat")
        res, cpu, proc = {}, {}, {}
        load0 = os.getloadavg()[0]
        for name, fn in cases:
            t, tm, tp, out = best_cpu(fn, a.repeat)
            res[name], cpu[name], proc[name] = size / 1e6 / t, size / 1e6 / tm, size / 1e6 / tp
            if not name.startswith("plain"): assert out == n_rec, (name, out)
        del lines, pieces
        base, bound = res[cases[0][0]], res[cases[1][0]]
        cbound = cpu[cases[1][0]]
        ref = res.get("lm_dataformat.Reader")
        for name, mbs in res.items():
            rows.append({"reader": name, "MB/s": mbs, "x plain": mbs / base, "x parse-only": mbs / bound,
                         "x lm_dataformat": mbs / ref if ref else float("nan"),
                         "main-thread CPU MB/s": cpu[name], "x parse-only CPU": cpu[name] / cbound,
                         "process CPU MB/s": proc[name]})
        print(f"\n1. one file, records fully parsed (load average {load0:.1f} before, {os.getloadavg()[0]:.1f} after, "
              f"on {os.cpu_count()} cores)"); print(format_table(rows))
        # what one thread, and a decompressing thread beside a parsing one, can reach at most (CPU seconds a MB:
        # load-independent): one thread does both jobs one after the other; two overlap them at best
        dc, pc = 1 / proc[cases[0][0]], 1 / cbound
        print(f"   bounds from CPU time: one thread decompressing then parsing <= {1 / (dc + pc):.0f} MB/s = "
              f"{pc / (dc + pc):.2f}x parse-only; a decompressing thread beside the parsing one <= "
              f"{min(1 / dc, 1 / pc):.0f} MB/s = {min(1 / dc, 1 / pc) / cbound:.2f}x parse-only (with a free core for it)")

        # 2. shards x processes: shards of equal uncompressed size (equal record counts gave shards 23-41 MB, and the
        # slowest process decided), read by the command line's code
        shards = [d / f"shard{i:02d}.jsonl.zst" for i in range(a.shards)]
        text_bytes = sum(len(r["text"].encode("utf-8")) for r in read_jsonl_zst(d / "big.jsonl.zst"))
        def shard_records(i):
            lo, hi, acc = text_bytes * i / a.shards, text_bytes * (i + 1) / a.shards, 0
            for r in read_jsonl_zst(d / "big.jsonl.zst"):
                if lo <= acc < hi or (i == a.shards - 1 and acc >= hi): yield r
                acc += len(r["text"].encode("utf-8"))
        for i, s in enumerate(shards): write_jsonl_zst(s, shard_records(i))
        t1, _ = best(lambda: [_stats_one(str(s), "strict", False) for s in shards], a.repeat)
        rows = [{"processes": "1, one thread, shard after shard", "MB/s": size / 1e6 / t1, "speed-up": 1.0, "efficiency": 1.0}]
        for np_ in a.processes:
            t, docs = best(lambda: stats_cli(shards, np_), a.repeat)
            assert docs == n_rec, (docs, n_rec)
            rows.append({"processes": f"{np_}, course pile stats --processes {np_}" + (" (threaded reader)" if np_ == 1 else ""),
                         "MB/s": size / 1e6 / t, "speed-up": t1 / t, "efficiency": t1 / t / np_})
        # the machine's own scaling, for reference: the same shards decompressed into nothing by N processes
        tp1, _ = best(lambda: [plain(s) for s in shards], a.repeat)
        rows.append({"processes": "1, plain decompression only (reference)", "MB/s": size / 1e6 / tp1, "speed-up": 1.0, "efficiency": 1.0})
        for np_ in [n for n in a.processes if n > 1]:
            def run_plain():
                with ProcessPoolExecutor(np_, mp_context=CTX) as ex: return list(ex.map(plain, shards))
            t, _ = best(run_plain, a.repeat)
            rows.append({"processes": f"{np_}, plain decompression only (reference)", "MB/s": size / 1e6 / t,
                         "speed-up": tp1 / t, "efficiency": tp1 / t / np_})
        print(f"\n2. {a.shards} shards of {size / a.shards / 1e6:.0f} MB, course pile stats (speed-ups against the first row "
              f"of each kind)"); print(format_table(rows))
        for np_ in [n for n in a.processes if n > 1]:
            t, _ = best(lambda: pool_startup(np_), a.repeat)
            print(f"   starting and stopping a pool of {np_} worker processes alone: {t * 1000:.0f} ms")

    if not a.no_bpb:
        import torch
        from transformers import GPT2Config, GPT2LMHeadModel
        from course_lib.pile import bpb
        from course_lib.pile import train_bpe_tokenizer
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
        docs = list(mini_pile_records(max_mb_per_subset=0.05, max_doc_kb=16))
        tok = train_bpe_tokenizer([r["text"] for r in docs], vocab_size=1024)
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_positions=128, n_embd=128, n_layer=4, n_head=4,
                                           bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)).eval()
        rows, base = [], None
        for name, bs in [("one window at a time", 1), ("batched windows (8)", 8), ("batched windows (32)", 32)]:
            t, rep = best(lambda: bpb(model, tok, docs, window=128, batch_size=bs), 1)
            tps = rep.overall.tokens / t
            base = base or tps
            rows.append({"bpb evaluation": name, "tokens": rep.overall.tokens, "tokens/s": tps, "speed-up": tps / base, "bpb": rep.overall.bpb})
        print("\n3. BPB evaluation (GPT-2, 4 layers, d=128, window 128)"); print(format_table(rows, floats=".3f"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
