"""course_lib.pile.steps and course_lib.pile.pipeline (datatrove) and `course pile clean`: reader formats
and error policy, accounting that adds up, dedup across tasks, resume after a kill, the executor swap to
Ray, the CLI."""
import gzip, json, os, random, re, signal, subprocess, sys, textwrap, time
from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip("datatrove")
from course_lib.pile import PileFormatError, read_jsonl_zst, write_jsonl_zst
from course_lib.pile import exact_dedup, exact_jaccard, gopher_reasons, text_hash
from course_lib.cli.pile import pile_main
from course_lib.pile import (
    DecontaminationFilter, PileReader, clean_pipeline, clean_report, read_removals, run_clean,
    run_pipeline)

WORDS = ("the of and to in that with for was on by be this from have are which its their river "
         "stone garden window letter morning village engine market winter music paper quiet bright "
         "slowly carried opened found under after across near").split()


def text(i: int, n: int = 80) -> str:
    "A text that passes Gopher's rules, different for every `i`."
    rng = random.Random(i)
    return " ".join(rng.choice(WORDS) for _ in range(n)) + "."


def rec(i, subset="Github", **meta):
    return {"text": text(i), "meta": {"pile_set_name": subset, "i": i, **meta}}


def out_records(folder) -> list[dict]:
    return [r for f in sorted(Path(folder).glob("*.jsonl.zst")) for r in read_jsonl_zst(f)]


def shard_bytes(folder) -> dict:
    return {p.name: p.read_bytes() for p in sorted(Path(folder).glob("*.jsonl.zst"))}


def test_reader_formats_case_meta_and_errors(tmp_path):
    "zst, GZ and plain shards in any case, meta kept, hidden folders skipped, bad lines by policy."
    d = tmp_path/"in"
    (d/"sub").mkdir(parents=True)
    (d/".clean").mkdir()
    write_jsonl_zst(d/"a.JSONL.ZST", [rec(0), rec(1, "Pile-CC", url="u")])
    (d/"sub"/"b.jsonl.GZ").write_bytes(gzip.compress(
        (json.dumps(rec(2)) + "\n{broken\n").encode()))
    (d/"c.Jsonl").write_text(json.dumps({"text": text(3), "meta": "not a dict", "id": 7}) + "\n"
                             + json.dumps({"text": text(4), "meta": None}) + "\n"
                             + json.dumps({"text": text(5), "meta": ["a", 1]}) + "\n"
                             + json.dumps({"text": text(6)}) + "\n")
    write_jsonl_zst(d/".clean"/"hidden.jsonl.zst", [rec(9)])
    (d/"notes.txt").write_text("not a shard")
    assert PileReader(str(d)).files() == ["a.JSONL.ZST", "c.Jsonl", "sub/b.jsonl.GZ"]
    with pytest.raises(PileFormatError, match="line 2"):
        run_clean(d, tmp_path/"strict", dedup=None, filters=())
    rep = run_clean(d, tmp_path/"out", dedup=None, filters=(), errors="skip")
    assert rep.skipped_lines == 1 and rep.documents_in == 7 and rep.balanced
    got = sorted(out_records(tmp_path/"out"), key=lambda r: r["text"])
    want = sorted([rec(0), rec(1, "Pile-CC", url="u"), rec(2),     # every meta exactly as read, or none
                   {"text": text(3), "meta": "not a dict", "id": 7}, {"text": text(4), "meta": None},
                   {"text": text(5), "meta": ["a", 1]}, {"text": text(6)}],
                  key=lambda r: r["text"])
    assert got == want
    rep = run_clean(d, tmp_path/"deduped", dedup="exact", filters=(), errors="skip")   # through the shards
    assert sorted(out_records(tmp_path/"deduped"), key=lambda r: r["text"]) == want


def corpus(tmp_path, shards=4, per=30, seed=0):
    "Shards with exact duplicates across shards, low-quality texts, several subsets."
    rng, k, docs = random.Random(seed), 0, []
    d = tmp_path/"in"
    d.mkdir()
    subsets = ["Github", "Pile-CC", "Enron Emails"]
    for s in range(shards):
        recs = []
        for _ in range(per):
            r = rng.random()
            if r < 0.15 and docs: recs.append(dict(rng.choice(docs)))       # exact duplicate
            elif r < 0.25: recs.append({"text": "$ # " * rng.randint(1, 9),
                                        "meta": {"pile_set_name": rng.choice(subsets)}})
            else:
                recs.append(rec(k, rng.choice(subsets)))
                k += 1
            docs.append(recs[-1])
        write_jsonl_zst(d/f"{s:02d}.jsonl.zst", recs)
    return d


def test_accounting_adds_up_and_matches_the_methods(tmp_path):
    "Every document is kept or logged once, by the step the methods of pile_clean say."
    d = corpus(tmp_path)
    ev = tmp_path/"eval.jsonl.zst"
    inputs = [r for f in sorted(d.glob("*.jsonl.zst")) for r in read_jsonl_zst(f)]
    leaked = next(r for r in inputs if r["meta"]["pile_set_name"] == "Github"
                  and not gopher_reasons(r["text"]))
    write_jsonl_zst(ev, [{"text": " ".join(leaked["text"].split()[10:30]), "meta": {}}])
    rep = run_clean(d, tmp_path/"out", dedup="exact", drop_subsets=["Enron Emails"],
                    decontaminate=ev, tasks=3)
    assert rep.balanced and rep.documents_in == len(inputs)
    assert rep.bytes_in == sum(len(r["text"].encode()) for r in inputs)
    # the same steps by hand, in input order
    left = [r for r in inputs if r["meta"]["pile_set_name"] != "Enron Emails"]
    n_subset = len(inputs) - len(left)
    left2 = [r for r in left if not gopher_reasons(r["text"])]
    left3 = [r for r in left2 if r["text"] != leaked["text"]]
    kept = [r for r, why in exact_dedup(left3) if why is None]
    steps = {k: v["documents"] for k, v in rep.removed.items()}
    assert steps == {"subset": n_subset, "gopher": len(left) - len(left2),
                     "decontaminate": len(left2) - len(left3), "exact-dedup": len(left3) - len(kept)}
    assert Counter(r["text"] for r in out_records(tmp_path/"out")) == Counter(r["text"] for r in kept)
    log = read_removals(tmp_path/"out"/".clean")
    assert len(log) == rep.documents_in - rep.documents_kept
    assert len({r["doc_id"] for r in log}) == len(log)      # no document removed twice
    by_id = {f"{f.name}/{i}": r for f in sorted(d.glob("*.jsonl.zst"))
             for i, r in enumerate(read_jsonl_zst(f))}
    for r in log:   # each row names a real document, its subset and size
        src = by_id[r["doc_id"]]
        assert (r["pile_set_name"], r["bytes"]) == (src["meta"]["pile_set_name"],
                                                    len(src["text"].encode()))
        if r["step"] == "exact-dedup":
            assert text_hash(by_id[r["duplicate_of"]]["text"]) == text_hash(src["text"])


def test_exact_dedup_is_global_and_does_not_depend_on_tasks(tmp_path):
    d = corpus(tmp_path, shards=5, per=20, seed=3)
    one = run_clean(d, tmp_path/"one", filters=(), tasks=1)
    five = run_clean(d, tmp_path/"five", filters=(), tasks=5, workers=2)
    assert one.removed == five.removed and one.removed["exact-dedup"]["documents"] > 0
    texts = [r["text"] for r in out_records(tmp_path/"five")]
    assert len(texts) == len(set(texts))
    assert Counter(texts) == Counter(r["text"] for r in out_records(tmp_path/"one"))


def test_minhash_dedup_removes_near_duplicates_across_shards(tmp_path):
    d = tmp_path/"in"
    d.mkdir()
    base = [text(i, 200) for i in range(8)]
    near = []
    for i, t in enumerate(base[:4]):   # one word in 200 changed: Jaccard of 5-grams about 0.95
        w = t.split()
        w[100] = "changed"
        near.append(" ".join(w))
        assert exact_jaccard(t, near[-1]) > 0.9
    assert max(exact_jaccard(a, b) for a in base for b in base if a != b) < 0.2
    write_jsonl_zst(d/"0.jsonl.zst", [{"text": t, "meta": {"pile_set_name": "Github"}} for t in base])
    write_jsonl_zst(d/"1.jsonl.zst", [{"text": t, "meta": {"pile_set_name": "Github"}} for t in near])
    rep = run_clean(d, tmp_path/"out", dedup="minhash", filters=(), tasks=2)
    assert rep.balanced and rep.removed["minhash-dedup"]["documents"] == 4
    assert sorted(r["text"] for r in out_records(tmp_path/"out")) == sorted(base)


RESUME_SCRIPT = textwrap.dedent("""
    import sys
    from course_lib.pile import run_clean
    run_clean(sys.argv[1], sys.argv[2], dedup="exact", drop_subsets=["Enron Emails"], tasks=6)
""")


def test_killed_run_resumes_to_the_same_bytes(tmp_path):
    d = corpus(tmp_path, shards=6, per=120, seed=5)
    ref = run_clean(d, tmp_path/"ref", dedup="exact", drop_subsets=["Enron Emails"], tasks=6)
    out = tmp_path/"out"
    marker = out/".clean"/"logs"/"filter"/"completions"/"00000"
    p = subprocess.Popen([sys.executable, "-c", RESUME_SCRIPT, str(d), str(out)],
                         start_new_session=True, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 60
        while not marker.exists() and p.poll() is None and time.time() < deadline:
            time.sleep(0.005)
        assert marker.exists(), "the first task never finished"
        os.killpg(p.pid, signal.SIGKILL)   # the run and its datatrove manager process
    finally:
        p.wait()
    done = lambda: sorted(p.name for p in (out/".clean"/"logs").glob("*/completions/*"))
    killed_at = done()
    assert "exact-dedup" not in str(killed_at), "the run finished before it was killed"
    assert not shard_bytes(out)
    rep = run_clean(d, out, dedup="exact", drop_subsets=["Enron Emails"], tasks=6)
    assert shard_bytes(out) == shard_bytes(tmp_path/"ref") and len(shard_bytes(out)) > 1
    assert (rep.removed, rep.subsets) == (ref.removed, ref.subsets)
    logs = lambda o: sorted(map(json.dumps, read_removals(o/".clean")))
    assert logs(out) == logs(tmp_path/"ref")
    assert not [p for p in out.rglob("*.tmp")]   # no temporary file left behind


def test_same_pipeline_on_ray(tmp_path):
    "The stage objects that ran on datatrove's local executor run unchanged on Ray's local cluster."
    try:
        import ray
    except ImportError as e:
        pytest.skip(f"ray does not import: {e}")
    d = corpus(tmp_path, shards=2, per=20, seed=7)
    out = tmp_path/"out"
    stages = clean_pipeline(d, out, dedup="exact")
    run_pipeline(stages, tmp_path/"logs-local", tasks=2, workers=2)
    local = shard_bytes(out)
    local_rep = clean_report(out)
    for p in out.glob("*.jsonl.zst"): p.unlink()
    try:
        ray.init(address="local", include_dashboard=False, num_cpus=2,
                 _node_ip_address="127.0.0.1", log_to_driver=False)
    except Exception as e:
        pytest.skip(f"ray does not start here: {e}")
    try:
        run_pipeline(stages, tmp_path/"logs-ray", tasks=2, workers=2, executor="ray")
    finally:
        ray.shutdown()
    assert shard_bytes(out) == local and local
    assert clean_report(out).removed == local_rep.removed
    assert (tmp_path/"logs-ray"/"exact-dedup"/"completions"/"00001").is_file()


def test_decontamination_filter_from_texts():
    from datatrove.data import Document
    f = DecontaminationFilter(texts=[text(1)], n=13)
    assert f.filter(Document(text=text(2), id="a")) is True
    keep, why = f.filter(Document(text="intro " + text(1) + " outro", id="b"))
    assert keep is False and "13-grams" in why


def test_cli_clean(tmp_path, capsys):
    d = corpus(tmp_path, shards=2, per=15, seed=9)
    out = tmp_path/"out"
    bad = [([str(tmp_path/"nope"), str(out)], "nope"),
           ([str(d), str(out), "--tasks", "0"], "tasks must be an int >= 1, got 0"),
           ([str(d), str(out), "--drop-subsets", "Pile-CC", "Wikipedia"], "'Wikipedia'"),
           ([str(d), str(out), "--decontaminate", str(tmp_path/"ev")], "ev")]
    for args, named in bad:
        assert pile_main(["clean", *args]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and named in err, err
        assert not out.exists()
    (tmp_path/"full").mkdir()
    (tmp_path/"full"/"x.txt").write_text("x")
    assert pile_main(["clean", str(d), str(tmp_path/"full")]) == 2
    assert "not empty" in capsys.readouterr().err
    assert pile_main(["clean", str(d), str(out), "--tasks", "2", "--drop-subsets", "Pile-CC"]) == 0
    assert "kept" in capsys.readouterr().out
    first = shard_bytes(out)
    assert pile_main(["clean", str(d), str(out), "--tasks", "2", "--drop-subsets", "Pile-CC"]) == 0
    assert shard_bytes(out) == first                  # the same settings: a finished run, resumed
    assert pile_main(["clean", str(d), str(out), "--tasks", "3"]) == 2   # other settings: refused
    assert "not a previous run" in capsys.readouterr().err


def test_cli_clean_says_when_tasks_outnumber_shards(tmp_path, capsys):
    "A task reads whole shards: more tasks than shards leaves some idle, and the command says so (and runs)."
    d = corpus(tmp_path, shards=2, per=6, seed=4)
    assert pile_main(["clean", str(d), str(tmp_path/"a"), "--tasks", "2"]) == 0
    assert "note" not in capsys.readouterr().err
    assert pile_main(["clean", str(d/"00.jsonl.zst"), str(tmp_path/"b"), "--tasks", "3"]) == 0
    out, err = capsys.readouterr()
    assert "3 tasks for 1 shard(s)" in err and "2 task(s) will have nothing to read" in err, err
    assert "kept" in out


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="workers are forked on Linux only")
def test_local_workers_are_forked_copies(tmp_path, monkeypatch):
    """On Linux the local executor's workers start as copies of this process (fork): they see what
    this process holds, and import nothing again (with datatrove's default fork server, every worker
    of every stage imported datatrove and this module again)."""
    import course_lib.pile.pipeline as pp
    from datatrove.pipeline.base import PipelineStep

    class Mark(PipelineStep):
        name = "mark"
        def __init__(self, folder):
            super().__init__()
            self.folder = str(folder)
        def run(self, data=None, rank=0, world_size=1):
            import course_lib.pile.pipeline as m
            Path(self.folder, f"{rank}.json").write_text(json.dumps(
                {"pid": os.getpid(), "mark": getattr(m, "_TEST_MARK", None)}))
            yield from data or ()

    monkeypatch.setattr(pp, "_TEST_MARK", "set in the parent", raising=False)
    (tmp_path/"marks").mkdir()
    run_pipeline([pp.Stage("mark", [Mark(tmp_path/"marks")])], tmp_path/"logs", tasks=2, workers=2)
    seen = [json.loads((tmp_path/"marks"/f"{r}.json").read_text()) for r in range(2)]
    assert all(s["pid"] != os.getpid() for s in seen), seen   # ran in worker processes
    assert [s["mark"] for s in seen] == ["set in the parent"] * 2, seen


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_quiet_workers_print_nothing_whatever_the_start_method(tmp_path, capfd, monkeypatch, method):
    """`quiet` (run_clean's default) keeps datatrove's log off stderr in workers that are not forked
    copies of this process too: forkserver (macOS) and spawn (Windows) workers do not inherit this
    process's redirected stderr. The output is the forked run's."""
    import course_lib.pile.pipeline as pp
    d = corpus(tmp_path, shards=2, per=6, seed=3)
    run_clean(d, tmp_path/"fork", dedup="exact", tasks=2, workers=2)
    capfd.readouterr()
    monkeypatch.setattr(pp, "_start_method", lambda: method)
    run_clean(d, tmp_path/"other", dedup="exact", tasks=2, workers=2)
    err = capfd.readouterr().err
    assert err == "", err[:2000]
    shards = lambda o: {f.name: f.read_bytes() for f in sorted(o.glob("*.jsonl.zst"))}
    assert shards(tmp_path/"other") == shards(tmp_path/"fork") != {}


def test_tasks_and_workers_must_be_ints(tmp_path):
    "A count that is not an int is named as such, with its value as written (not '3' shown as 3)."
    d = corpus(tmp_path, shards=1, per=3, seed=1)
    for kw, shown in (({"tasks": "3"}, "tasks must be an int >= 1, got '3'"),
                      ({"workers": 2.5}, "workers must be an int >= 1, got 2.5"),
                      ({"workers": True}, "workers must be an int >= 1, got True")):
        with pytest.raises(ValueError, match=re.escape(shown)):
            run_clean(d, tmp_path/"out", **kw)
    assert not (tmp_path/"out").exists()   # nothing written


def test_output_inside_input_or_input_inside_output_is_refused(tmp_path):
    "OUT inside IN would be read as input by a later task (a shard out twice, another lost): refused first."
    d = corpus(tmp_path, shards=2, per=5, seed=3)
    for out, says in ((d/"cleaned", "is inside the input"), (d, "is inside the input"),
                      (tmp_path, "is inside the output folder"), (d/"sub"/"deeper", "is inside the input")):
        with pytest.raises(ValueError, match=says):
            run_clean(d, out, dedup=None, tasks=2)
    assert not (d/"cleaned").exists() and not (d/"sub").exists()
    with pytest.raises(ValueError, match="is inside the input"):      # a single shard as input, OUT its file
        run_clean(d/"00.jsonl.zst", d/"00.jsonl.zst", dedup=None)
    assert pile_main(["clean", str(d), str(d/"out"), "--tasks", "2"]) != 0 and not (d/"out").exists()


def test_a_resumed_run_whose_input_changed_is_refused_naming_the_shards(tmp_path):
    d = corpus(tmp_path, shards=3, per=5, seed=4)
    out = tmp_path/"out"
    run_clean(d, out, dedup="exact", tasks=3)
    before = shard_bytes(out)
    run_clean(d, out, dedup="exact", tasks=3)                        # unchanged input: resumes (a no-op)
    assert shard_bytes(out) == before
    write_jsonl_zst(d/"01.jsonl.zst", [rec(500), rec(501)])           # a shard edited
    (d/"02.jsonl.zst").unlink()                                       # one deleted
    write_jsonl_zst(d/"03.jsonl.zst", [rec(600)])                     # one added
    with pytest.raises(ValueError, match=r"input has changed since \(01.jsonl.zst changed, "
                                         r"02.jsonl.zst removed, 03.jsonl.zst added\)"):
        run_clean(d, out, dedup="exact", tasks=3)
    assert shard_bytes(out) == before                                 # nothing written


def test_an_empty_decontamination_set_is_refused(tmp_path):
    "Decontaminating against nothing would report 'kept 3 of 3' as if it had checked: refused."
    d = corpus(tmp_path, shards=1, per=3, seed=2)
    (tmp_path/"empty").mkdir()
    (tmp_path/"empty.jsonl").write_text("")
    write_jsonl_zst(tmp_path/"none.jsonl.zst", [])
    for ev in (tmp_path/"empty", tmp_path/"empty.jsonl", tmp_path/"none.jsonl.zst"):
        with pytest.raises(ValueError, match="nothing to decontaminate against: .* holds no document"):
            run_clean(d, tmp_path/"out", dedup=None, decontaminate=ev)
    assert not (tmp_path/"out").exists()


def test_minhash_path_removes_exact_duplicates_shorter_than_its_shingle(tmp_path):
    "MinHash signs word 5-grams: a 3-word document has none, so only an exact stage before it catches its copies."
    d = tmp_path/"in"
    d.mkdir()
    short = ["see the river", "quiet bright morning"]
    long_ = [text(i, 200) for i in range(4)]
    write_jsonl_zst(d/"0.jsonl.zst", [{"text": t, "meta": {"pile_set_name": "Github"}} for t in short + long_])
    write_jsonl_zst(d/"1.jsonl.zst", [{"text": t, "meta": {"pile_set_name": "Github"}} for t in short + long_[:2]])
    rep = run_clean(d, tmp_path/"out", dedup="minhash", filters=(), tasks=2)
    texts = sorted(r["text"] for r in out_records(tmp_path/"out"))
    assert texts == sorted(short + long_) and rep.balanced
    assert rep.removed["exact-dedup"]["documents"] == 4 and "minhash-dedup" not in rep.removed
