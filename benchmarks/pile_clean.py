"""Unit 6 benchmark: the cleaning pipeline (`course_lib.pile.pipeline.run_clean`) and MinHash signatures.

    python benchmarks/pile_clean.py [--mb-per-subset 8] [--shards 4] [--workers 2] [--repeat 1]

The mini-Pile (texts of the installed packages, `course_lib.pile.mini.mini_pile_records`, written at run time in
a temporary folder), in `--shards` Pile-format shards of about equal size. From one run, as ratios:
1. The cost of each step, one worker, every shard: `read_jsonl_zst` alone (the baseline), datatrove's executor with
   `PileReader` alone, + the Gopher rules filter, + the writer (`run_clean(dedup=None)`), + exact dedup
   (`run_clean(dedup="exact")`), and minhash dedup instead (`run_clean(dedup="minhash")`): documents a second, and
   each step's cost in ms a document (its row's time less the row above's).
1b. The ceiling of any pipeline that writes Pile shards: `read_jsonl_zst`'s time over itself plus writing the same
   documents (zstd level 1 of the encoded lines alone, `write_jsonl_zst` at level 1 and at level 3), one thread; and
   of `run_clean(dedup="exact")`, whose dedup stage reads and writes again what the filters kept: its own reads and
   writes at the measured rates, every step taken as free.
2. `run_clean(dedup="exact")` on `--workers` worker processes against one, on the same shards (documents a second),
   with the workers forked (`course_lib.core.basics.start_method` on Linux) and, for comparison, started by a fork server,
   beside the machine's own scaling on the same shards (the Gopher rules alone, in N processes).
3. MinHash signatures a second of `course_lib.pile.clean.MinHasher.signatures` against `datasketch.MinHash`
   (`update_batch` with the same normalised word 5-grams), 128 permutations, on the same documents.
Nothing is downloaded."""
import argparse, contextlib, multiprocessing, os, shutil, sys, tempfile, time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from course_lib.pile import read_jsonl_zst, write_jsonl_zst
from course_lib.pile import format_table, mini_pile_records
from course_lib.core import start_method

CTX = multiprocessing.get_context(start_method())   # the start method `course` uses (fork on Linux)


REPEAT = 1


def timed(fn):
    "`(seconds, out)`: the least time of `REPEAT` runs (the machine may be shared: the least is the least disturbed)."
    best = None
    for _ in range(REPEAT):
        t0 = time.perf_counter(); out = fn(); t = time.perf_counter() - t0
        best = t if best is None else min(best, t)
    return best, out


def write_shards(folder: Path, records: list, n: int) -> list[Path]:
    "`records` in `n` shards of about equal UTF-8 size (each record to the lightest shard so far), order kept."
    parts, sizes = [[] for _ in range(n)], [0] * n
    for r in records:
        i = sizes.index(min(sizes))
        parts[i].append(r); sizes[i] += len(r["text"].encode("utf-8"))
    folder.mkdir(parents=True)
    paths = [folder / f"shard{i:02d}.jsonl.zst" for i in range(n)]
    for p, part in zip(paths, parts): write_jsonl_zst(p, part)
    return paths


def read_all(shards) -> int:
    return sum(1 for s in shards for _ in read_jsonl_zst(s))


def executor_only(shards_dir: Path, work: Path, tasks: int, gopher: bool) -> None:
    "datatrove's local executor with `PileReader` (and the Gopher rules filter), nothing written."
    from course_lib.pile import GopherRulesFilter, PileReader, RemovalWriter, Stage, run_pipeline
    shutil.rmtree(work, ignore_errors=True)   # datatrove would skip the tasks a previous repeat completed
    steps = [PileReader(shards_dir)]
    if gopher: steps.append(GopherRulesFilter(RemovalWriter(work / "removed" / "gopher", "gopher")))
    run_pipeline([Stage("bench", steps)], work / "logs", tasks=tasks, workers=1)


@contextlib.contextmanager
def quiet_fd2():
    "File descriptor 2 to /dev/null: the executor's worker processes log to stderr whatever the parent redirects."
    sys.stderr.flush()
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    try: yield
    finally:
        os.dup2(saved, 2); os.close(saved); os.close(null)


def clean(shards_dir: Path, out: Path, dedup, tasks: int, workers: int):
    from course_lib.pile import run_clean
    shutil.rmtree(out, ignore_errors=True)
    with quiet_fd2():
        return run_clean(shards_dir, out, dedup=dedup, filters=("gopher",), tasks=tasks, workers=workers)


def gopher_shard(path) -> int:
    "The Gopher rules over one shard's documents, nothing else (the machine's own scaling, for reference)."
    from course_lib.pile import gopher_reasons
    return sum(1 for r in read_jsonl_zst(path) if not gopher_reasons(r["text"]))


def writer_ceiling(shards, t_read: float, folder: Path, n_docs: int, rep) -> list[dict]:
    """What writing alone costs against `t_read` (read_jsonl_zst of `shards`): zstd level 1 compression of the output
    bytes already encoded (zstd's fastest level, C code only), write_jsonl_zst at level 1, and at level 3 (PileWriter's);
    then the reads and writes of `rep`'s run_clean(dedup="exact") at those rates (level 3), its steps taken as free."""
    import zstandard
    from course_lib.pile.jsonl_zst import _dumps
    records = [r for s in shards for r in read_jsonl_zst(s)]
    data = b"".join(map(_dumps, records))
    folder.mkdir()
    runs = [("zstd level 1 of the encoded lines alone", lambda: zstandard.ZstdCompressor(level=1).compress(data)),
            ("write_jsonl_zst(level=1)", lambda: write_jsonl_zst(folder / "l1.jsonl.zst", records, level=1)),
            ("write_jsonl_zst(level=3), as PileWriter", lambda: write_jsonl_zst(folder / "l3.jsonl.zst", records, level=3))]
    rows = [{"writing (1 thread)": "read_jsonl_zst alone (nothing written)", "ms/doc": t_read / n_docs * 1e3,
             "ceiling x read_jsonl_zst": 1.0}]
    times = {}
    for name, fn in runs:
        times[name] = t = timed(fn)[0]
        rows.append({"writing (1 thread)": f"+ {name}", "ms/doc": t / n_docs * 1e3,
                     "ceiling x read_jsonl_zst": t_read / (t_read + t)})
    # run_clean(dedup="exact") reads the input, writes what the filters keep, reads that again for the dedup
    # stage and writes what it keeps: its own I/O at these rates (a text byte costs the same everywhere)
    b_in, b_mid = rep.bytes_in, rep.bytes_kept + rep.removed.get("exact-dedup", {}).get("bytes", 0)
    t3 = times["write_jsonl_zst(level=3), as PileWriter"]
    t_io = t_read * (1 + b_mid / b_in) + t3 * (b_mid + rep.bytes_kept) / b_in
    rows.append({"writing (1 thread)": "run_clean(dedup='exact')'s own reads and writes (steps free)",
                 "ms/doc": (t_io - t_read) / n_docs * 1e3, "ceiling x read_jsonl_zst": t_read / t_io})
    return rows


def forkserver_rows(run, n_docs: int, t1: float, workers: int) -> list[dict]:
    """`run` again with the workers started by a fork server (datatrove's default, and the default on Linux from
    Python 3.14) where `start_method()` forks them: each worker of each stage imports datatrove and course_lib."""
    import multiprocess
    import course_lib.pile.pipeline as pp
    if start_method() == "forkserver" or "forkserver" not in multiprocess.get_all_start_methods(): return []
    saved, pp._start_method = pp._start_method, lambda: "forkserver"
    try: t, _ = timed(run)
    finally: pp._start_method = saved
    return [{"run": f"run_clean(dedup='exact'), {workers} workers, forkserver instead of fork", "docs/s": n_docs / t,
             "speed-up": t1 / t}]


def positive(s: str) -> int:
    v = int(s)
    if v < 1: raise argparse.ArgumentTypeError(f"must be an int >= 1, got {s}")
    return v


def datasketch_signatures(texts, num_perm=128, n=5):
    import datasketch
    from course_lib.pile import word_ngrams
    out = []
    for t in texts:
        m = datasketch.MinHash(num_perm=num_perm, seed=1)
        m.update_batch([g.encode("utf-8") for g in set(word_ngrams(t, n))])
        out.append(m.hashvalues)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb-per-subset", type=float, default=8, help="MB of text of each mini-Pile subset at most")
    p.add_argument("--shards", type=positive, default=4, help="Pile shards the documents are split into, one task each")
    p.add_argument("--workers", type=positive, default=2, help="worker processes of the parallel run")
    p.add_argument("--repeat", type=positive, default=1, help="best of this many runs of each row")
    a = p.parse_args(argv)
    global REPEAT
    REPEAT = max(1, a.repeat)
    import course_lib.pile.pipeline  # noqa: F401  (datatrove's import, about a second, is not a step's cost)
    records = list(mini_pile_records(max_mb_per_subset=a.mb_per_subset))
    texts = [r["text"] for r in records]
    n_docs, mb = len(texts), sum(len(t.encode("utf-8")) for t in texts) / 1e6
    load0 = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="pile-clean-bench-") as d:
        d = Path(d)
        shards = write_shards(d / "in", records, a.shards)
        print(f"mini-Pile: {n_docs} documents, {mb:.1f} MB of text, in {a.shards} shards; cpu cores: {os.cpu_count()}, "
              f"load average {load0:.1f}")

        # 1. the cost of each step, one worker
        t_read, n = timed(lambda: read_all(shards))
        assert n == n_docs, (n, n_docs)
        runs = [("read_jsonl_zst alone", t_read, n_docs),
                ("datatrove executor + PileReader", *timed(lambda: executor_only(d / "in", d / "w1", a.shards, False)),),
                ("+ Gopher rules filter", *timed(lambda: executor_only(d / "in", d / "w2", a.shards, True)))]
        runs = [(r[0], r[1], n_docs) for r in runs]
        reports = {}
        for name, dedup in [("+ writer (run_clean, dedup=None)", None), ("+ exact dedup (run_clean, dedup='exact')", "exact"),
                            ("minhash dedup instead (dedup='minhash')", "minhash")]:
            t, rep = timed(lambda: clean(d / "in", d / "out", dedup, a.shards, 1))
            assert rep.documents_in == n_docs and rep.balanced, (name, rep.documents_in)
            reports[dedup] = rep
            runs.append((name, t, n_docs))
        rows, prev = [], None
        for name, t, n in runs:
            step = (t - prev) / n * 1e3 if prev is not None else t / n * 1e3
            if name.startswith("minhash"): step = (t - runs[3][1]) / n * 1e3   # against the writer row
            rows.append({"pipeline (1 worker)": name, "seconds": t, "docs/s": n / t, "MB/s": mb / t,
                         "x read_jsonl_zst": t_read / t, "step ms/doc": step})
            if not name.startswith("minhash"): prev = t
        print("\n1. the cost of each step, 1 worker, every shard (step ms/doc: this row's time less the row above's; "
              "minhash against the writer row)"); print(format_table(rows, floats=".3f"))
        for k, rep in reports.items():
            print(f"   dedup={k}: kept {rep.documents_kept} of {rep.documents_in} documents; removed "
                  + ", ".join(f"{s} {v['documents']}" for s, v in rep.removed.items()))

        # 1b. the ceiling of any pipeline that writes what it reads
        rows = writer_ceiling(shards, t_read, d / "ceiling", n_docs, reports["exact"])
        print("\n1b. the ceiling of a pipeline that reads these shards and writes Pile shards, with nothing in between "
              "(1 thread): read_jsonl_zst's time / (its time + the writing's)"); print(format_table(rows, floats=".3f"))

        # 2. workers
        t1 = runs[4][1]
        tn, rep = timed(lambda: clean(d / "in", d / "out", "exact", a.shards, a.workers))
        assert rep.documents_in == n_docs and rep.documents_kept == reports["exact"].documents_kept
        g1, _ = timed(lambda: [gopher_shard(s) for s in shards])
        def gopher_pool():
            with ProcessPoolExecutor(a.workers, mp_context=CTX) as ex: return list(ex.map(gopher_shard, shards))
        gn, _ = timed(gopher_pool)
        rows = [{"run": "run_clean(dedup='exact'), 1 worker", "docs/s": n_docs / t1, "speed-up": 1.0},
                {"run": f"run_clean(dedup='exact'), {a.workers} workers", "docs/s": n_docs / tn, "speed-up": t1 / tn},
                *forkserver_rows(lambda: clean(d / "in", d / "out", "exact", a.shards, a.workers), n_docs, t1, a.workers),
                {"run": "Gopher rules alone, 1 process (reference)", "docs/s": n_docs / g1, "speed-up": 1.0},
                {"run": f"Gopher rules alone, {a.workers} processes (reference)", "docs/s": n_docs / gn,
                 "speed-up": g1 / gn}]
        print(f"\n2. {a.workers} workers against 1, {a.shards} tasks (one a shard)"); print(format_table(rows))

    # 3. MinHash signatures
    from course_lib.pile import MinHasher
    mh = MinHasher(num_perm=128, n_gram=5)
    t_ours, sigs = timed(lambda: mh.signatures(texts))
    t_ds, _ = timed(lambda: datasketch_signatures(texts))
    rows = [{"MinHash, 128 permutations, word 5-grams": "datasketch.MinHash (update_batch)", "signatures/s": n_docs / t_ds,
             "MB/s": mb / t_ds, "x datasketch": 1.0},
            {"MinHash, 128 permutations, word 5-grams": "course_lib MinHasher.signatures", "signatures/s": n_docs / t_ours,
             "MB/s": mb / t_ours, "x datasketch": t_ds / t_ours}]
    print(f"\n3. MinHash signatures of the same {n_docs} documents"); print(format_table(rows))
    print(f"\nload average {load0:.1f} before, {os.getloadavg()[0]:.1f} after")
    return 0


if __name__ == "__main__":
    sys.exit(main())
