"""course_lib.pile.clean (nbs/69_pile_clean.ipynb: dedup, MinHash) and course_lib.pile.quality
(nbs/69b_pile_quality.ipynb: Gopher rules, decontamination) against exact answers and the professional libraries.

Documents: the mini-Pile (`mini_pile(0.5)`, built in about 2 s into the test cache), its train, val and test
splits, plus near-duplicates made from them by replacing a fraction of their words. Each test states the
tolerance it holds our methods to and why.
"""
import itertools
import random
import re

import numpy as np
import pytest

from course_lib.pile import read_jsonl_zst
from course_lib.pile import (
    EMPTY_HASH, GOPHER_RULES, MERSENNE_PRIME, Decontaminator, MinHasher, RemovalLog, exact_dedup,
    exact_jaccard, gopher_reasons, lsh_params, minhash_jaccard, near_duplicates, ngram_set,
    normalize_text, shingle_hashes, text_hash, word_ngrams)
from course_lib.pile.clean import _affine_mod_p, _buckets
from course_lib.pile import mini_pile


@pytest.fixture(scope="module")
def splits():
    return {k: list(read_jsonl_zst(p)) for k, p in mini_pile(0.5).items()}


def _mutate(text: str, q: float, rng: random.Random) -> str:
    "`text` with a fraction q of its words replaced by fresh tokens (a constructed near-duplicate)."
    words = text.split()
    for i in rng.sample(range(len(words)), int(q * len(words))):
        words[i] = f"zq{rng.randrange(10**9)}"
    return " ".join(words)


@pytest.fixture(scope="module")
def corpus(splits):
    """The train split's texts followed by 48 constructed near-duplicates of its longer documents
    (words replaced at rates 0.5-10%: exact Jaccard of 5-gram shingles from about 0.3 to 0.97)."""
    rng = random.Random(0)
    texts = [r["text"] for r in splits["train"]]
    long_docs = [t for t in texts if 300 <= len(t.split()) <= 5000][:48]
    rates = (0.005, 0.01, 0.02, 0.03, 0.04, 0.06, 0.08, 0.1)
    return texts + [_mutate(t, rates[i % len(rates)], rng) for i, t in enumerate(long_docs)]


@pytest.fixture(scope="module")
def pairs(splits, corpus):
    """(a, b, exact Jaccard) pairs: every pair of real train documents of one pile_set_name with some
    shared shingle, 40 pairs with none, and each constructed near-duplicate with its source."""
    train = splits["train"]
    shingles = {i: set(word_ngrams(r["text"], 5)) for i, r in enumerate(train)}
    real, disjoint = [], []
    for i, j in itertools.combinations(range(len(train)), 2):
        if train[i]["meta"]["pile_set_name"] != train[j]["meta"]["pile_set_name"]:
            continue
        u = len(shingles[i] | shingles[j])
        J = len(shingles[i] & shingles[j]) / u if u else 1.0
        (real if J > 0 else disjoint).append((train[i]["text"], train[j]["text"], J))
    made = [(t, m, exact_jaccard(t, m)) for t, m in zip(
        [t for t in corpus[:len(train)] if 300 <= len(t.split()) <= 5000][:48], corpus[len(train):])]
    real.sort(key=lambda p: -p[2])                         # all with J >= 0.2, then a spread down to 0
    low = [p for p in real if p[2] < 0.2]
    real = [p for p in real if p[2] >= 0.2] + low[::max(len(low) // 40, 1)]
    return real + disjoint[:20] + made


def _sigs(texts, num_perm):
    "{text: signature} over the distinct texts (each signed once)."
    distinct = list(dict.fromkeys(texts))
    return dict(zip(distinct, MinHasher(num_perm=num_perm).signatures(distinct)))


def test_affine_mod_p_is_exact():
    "The vectorised (a x + b) mod 2^61 - 1 equals Python's exact integers, extreme values included."
    rng = np.random.RandomState(1)
    x = np.concatenate([[0, 1, 2**32 - 1], rng.randint(0, 2**32, 500, dtype=np.uint64)]).astype(np.uint64)
    a = np.concatenate([[1, MERSENNE_PRIME - 1], rng.randint(1, MERSENNE_PRIME, 30, dtype=np.uint64)])
    b = np.concatenate([[0, MERSENNE_PRIME - 1], rng.randint(0, MERSENNE_PRIME, 30, dtype=np.uint64)])
    got = _affine_mod_p(x, a.astype(np.uint64), b.astype(np.uint64))
    want = [[(int(ai) * int(xi) + int(bi)) % MERSENNE_PRIME for ai, bi in zip(a, b)] for xi in x]
    assert got.dtype == np.uint64 and got.shape == (len(x), len(a))
    assert got.tolist() == want


def test_exact_dedup_against_grouping_by_normalised_text(splits):
    "Flags exactly the records whose normalised text was seen before, pointing at the first one."
    texts = [r["text"] for r in splits["train"][:40]]
    variants = [t.upper().replace(".", " . ") for t in texts[:10]] + texts[5:15]
    records = [{"text": t} for t in texts + variants]
    first = {}
    want = [None if first.setdefault(normalize_text(r["text"]), i) == i
            else f"exact-duplicate of #{first[normalize_text(r['text'])]}" for i, r in enumerate(records)]
    got = [reason for _, reason in exact_dedup(records)]
    assert got == want and sum(g is not None for g in got) >= 20
    assert text_hash("Hello, World!") == text_hash("hello world") != text_hash("hello worlds")


def test_shingles_match_word_ngrams(splits):
    "One 64-bit hash per distinct word n-gram (no collision among the mini-Pile's shingles)."
    for r in splits["val"]:
        for n in (1, 5, 13):
            assert len(shingle_hashes(r["text"], n)) == len(set(word_ngrams(r["text"], n)))
    assert word_ngrams("One two three", 5) == ["one two three"] and word_ngrams(" ,; ", 5) == []


def test_minhash_estimates_within_4_standard_errors_of_exact(pairs):
    """Each estimate within 4 standard errors sqrt(J (1 - J) / num_perm) (+ 1/num_perm for the J = 0 and
    J = 1 ends) of the exact Jaccard, and the mean error within 4 standard errors of that mean (unbiased)."""
    P = 256
    sig = _sigs([t for a, b, _ in pairs for t in (a, b)], P)
    assert len(pairs) >= 100 and sum(0.2 < J < 0.98 for _, _, J in pairs) >= 40
    errors, ses = [], []
    for a, b, J in pairs:
        est = minhash_jaccard(sig[a], sig[b])
        se = np.sqrt(J * (1 - J) / P)
        assert abs(est - J) <= 4 * se + 1 / P, (J, est)
        errors.append(est - J), ses.append(se)
    assert abs(np.mean(errors)) <= 4 * np.sqrt(np.sum(np.square(ses))) / len(ses) + 1e-3


def test_minhash_against_datasketch(pairs):
    """Our estimates and datasketch.MinHash's (same shingles, same num_perm) are both unbiased: each one's
    mean absolute error against the exact Jaccard within 25% (+ 0.003) of the other's (measured on these
    164 pairs: 0.019 ours, 0.017 datasketch's)."""
    datasketch = pytest.importorskip("datasketch")
    P, ours, theirs = 128, [], []
    sig = _sigs([t for a, b, _ in pairs for t in (a, b)], P)
    ds = {}
    for t in sig:
        ds[t] = datasketch.MinHash(num_perm=P, seed=1)
        ds[t].update_batch([s.encode() for s in set(word_ngrams(t, 5))])
    for a, b, J in pairs:
        ours.append(abs(minhash_jaccard(sig[a], sig[b]) - J))
        theirs.append(abs(ds[a].jaccard(ds[b]) - J))
    mae_ours, mae_theirs = np.mean(ours), np.mean(theirs)
    assert mae_ours <= 1.25 * mae_theirs + 0.003 and mae_theirs <= 1.25 * mae_ours + 0.003, \
        (mae_ours, mae_theirs)


def test_signatures_batched_equal_one_by_one(corpus):
    mh = MinHasher(num_perm=64, n_gram=3)
    texts = corpus[:30] + ["", "one", corpus[0] * 3]
    batch = mh.signatures(texts)
    assert batch.shape == (len(texts), 64) and batch.dtype == np.uint64
    assert all((batch[i] == mh.signature(t)).all() for i, t in enumerate(texts))
    assert (batch[30] == EMPTY_HASH).all() and (batch[31] < MERSENNE_PRIME).all()


def test_lsh_params_equal_datasketch():
    lsh = pytest.importorskip("datasketch.lsh")
    for threshold, num_perm in ((0.5, 64), (0.7, 128), (0.8, 112), (0.9, 256), (0.3, 20)):
        assert lsh_params(threshold, num_perm) == lsh._optimal_param(threshold, num_perm, 0.5, 0.5)


def _clusters_removed(candidates: dict[int, set[int]], n: int) -> set[int]:
    "Union-find over candidate pairs: every document of a cluster but its first (smallest index)."
    parent = list(range(n))

    def find(i):
        while parent[i] != i:
            i = parent[i]
        return i
    for i, js in candidates.items():
        for j in js:
            ri, rj = find(i), find(j)
            parent[max(ri, rj)] = min(ri, rj)
    return {i for i in range(n) if find(i) != i}


def _overlap(a: set, b: set) -> float:
    return len(a & b) / len(a | b) if a | b else 1.0


def test_near_duplicates_against_datasketch_lsh(corpus):
    """The candidate pairs of our LSH (threshold 0.7, 128 permutations, bands and rows of lsh_params) and
    of datasketch.MinHashLSH on the same documents. Pairs whose exact Jaccard is far from the threshold
    (>= 0.85 or <= 0.55) are found by both or neither: overlap measured 0.96, held to >= 0.9. Near it each
    hash family draws its own coin (P(candidate) ~ 0.5 at J = 0.7), so the whole pair sets (0.76) and the
    removed sets (same clustering, first kept: 0.72) overlap less: held to >= 0.6."""
    datasketch = pytest.importorskip("datasketch")
    bands, rows = lsh_params(0.7, 128)
    sig = MinHasher(128).signatures(corpus)
    ours = {(int(i), int(j)) for g in _buckets(sig, bands, rows) for i, j in itertools.combinations(g, 2)}
    index, sketches, sets = datasketch.MinHashLSH(threshold=0.7, num_perm=128), [], []
    for i, t in enumerate(corpus):
        sets.append(set(word_ngrams(t, 5)))
        sketches.append(datasketch.MinHash(num_perm=128, seed=1))
        sketches[-1].update_batch([s.encode() for s in sets[-1]])
        index.insert(i, sketches[-1])
    candidates = {i: set(index.query(m)) - {i} for i, m in enumerate(sketches)}
    theirs = {(min(i, j), max(i, j)) for i, js in candidates.items() for j in js}
    J = {p: len(sets[p[0]] & sets[p[1]]) / len(sets[p[0]] | sets[p[1]]) for p in ours | theirs}
    far = {p for p in J if not 0.55 < J[p] < 0.85}
    assert len(ours & far) >= 20 and _overlap(ours & far, theirs & far) >= 0.9, sorted(
        (J[p], p in ours) for p in (ours ^ theirs) & far)
    removed = {i for i, r in enumerate(near_duplicates(sig, bands, rows)) if r is not None}
    assert _overlap(ours, theirs) >= 0.6 and _overlap(removed, _clusters_removed(candidates, len(corpus))) >= 0.6


def test_near_duplicates_verified_by_exact_jaccard(corpus):
    "With texts, every removed document has exact Jaccard >= threshold with another document."
    sig = MinHasher(128).signatures(corpus)
    kept = near_duplicates(sig, *lsh_params(0.7, 128), threshold=0.7, texts=corpus)
    removed = [i for i, r in enumerate(kept) if r is not None]
    assert len(removed) >= 20 and all(kept[r] is None and r < i for i, r in enumerate(kept) if r is not None)
    sets = [set(word_ngrams(t, 5)) for t in corpus]
    for i in removed:
        assert max(len(sets[i] & sets[k]) / len(sets[i] | sets[k]) for k in range(len(corpus)) if k != i) >= 0.7


def _whitespace_tokenizer():
    "A datatrove WordTokenizer that splits on whitespace (datatrove's English default needs spaCy)."
    from datatrove.utils.word_tokenizers import WordTokenizer

    class Whitespace(WordTokenizer):
        def word_tokenize(self, text):
            return text.split()

        def sent_tokenize(self, text):
            return [s for s in re.split(r"(?<=[.!?])\s+", text) if s]

        def span_tokenize(self, text):
            return [m.span() for m in re.finditer(r"\S+", text)]
    return Whitespace("en")


def test_near_duplicates_against_datatrove_minhash_dedup(corpus, tmp_path):
    """datatrove's own MinHash dedup (Signature, Buckets, Cluster, Filter stages, local executor; 14 bands
    of 8 rows, 5-gram shingles) and ours with the same bands and rows on the same documents. Constructed
    near-duplicates far from the threshold (exact Jaccard to their source >= 0.85 or <= 0.45) are in a
    cluster for both or neither (>= 90%), and the real documents each removes overlap >= 0.75. Near the
    threshold each hash family draws its own coin: the whole removed sets overlap 0.78 (measured), held
    to >= 0.7 (datatrove also maps digits to 0, strips accents and keeps the root of a union by size)."""
    pytest.importorskip("datatrove")
    from datatrove.data import Document
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.dedup.minhash import (MinhashConfig, MinhashDedupBuckets, MinhashDedupCluster,
                                                  MinhashDedupFilter, MinhashDedupSignature)
    from datatrove.utils.hashing import HashConfig
    cfg = MinhashConfig(n_grams=5, num_buckets=14, hashes_per_bucket=8,
                        hash_config=HashConfig(precision=64, hash_fc="sha1"))
    docs = [Document(text=t, id=str(i)) for i, t in enumerate(corpus)]
    tok, kept = _whitespace_tokenizer(), []

    def collect(data, rank=0, world_size=1):
        for d in data:
            kept.append(int(d.id))
            yield d
    sigs, buckets, remove = (str(tmp_path / d) for d in ("sigs", "buckets", "remove"))
    stages = [[docs, MinhashDedupSignature(sigs, config=cfg, language=tok)],
              [MinhashDedupBuckets(sigs, buckets, config=cfg)],
              [MinhashDedupCluster(buckets, remove, config=cfg)],
              [docs, MinhashDedupFilter(remove), collect]]
    for i, (pipeline, tasks) in enumerate(zip(stages, (1, cfg.num_buckets, 1, 1))):   # stage 2: a task a band
        LocalPipelineExecutor(pipeline, tasks=tasks, workers=1,
                              logging_dir=str(tmp_path / f"logs{i}")).run()
    theirs = set(range(len(corpus))) - set(kept)
    reps = near_duplicates(MinHasher(num_perm=112).signatures(corpus), 14, 8)
    ours = {i for i, r in enumerate(reps) if r is not None}
    in_ours = ours | {r for r in reps if r is not None}
    removed = np.fromfile(tmp_path / "remove" / "000000.remove", dtype="<u4")
    assert set(removed.tolist()) == theirs                       # the Filter dropped what Cluster listed
    pairs = np.concatenate([np.fromfile(f, dtype="<u4").reshape(-1, 4)
                            for f in sorted((tmp_path / "buckets").glob("*.dups"))])
    in_theirs = set(pairs[:, 1].tolist()) | set(pairs[:, 3].tolist())    # (file, doc, file, doc) rows
    n_real = len(corpus) - 48                               # the constructed near-duplicates come last
    far = [k for k in range(n_real, len(corpus)) if not 0.45 < exact_jaccard(corpus[k], _source(corpus, k)) < 0.85]
    agree = np.mean([(k in in_ours) == (k in in_theirs) for k in far])
    # which member of a cluster is removed is each library's choice (ours: the first; datatrove: the root
    # of a union by size): 0.90 on this machine's mini-Pile, 0.82 on a fresh environment's (one cluster of
    # two kept the other member), so held to >= 0.75
    real_ours, real_theirs = {i for i in ours if i < n_real}, {i for i in theirs if i < n_real}
    # enough cases far from the threshold to judge: the mini-Pile is built from the environment's own files, so
    # their count varies (14 in a fresh virtual environment on 2026-12-06, 15 or more in others)
    assert len(far) >= 12 and agree >= 0.9, (agree, [k for k in far if (k in in_ours) != (k in in_theirs)])
    assert len(real_ours) >= 5 and _overlap(real_ours, real_theirs) >= 0.75, real_ours ^ real_theirs
    assert _overlap(ours, theirs) >= 0.7, (len(ours), len(theirs), ours ^ theirs)


def _source(corpus, k):
    "The real document that constructed near-duplicate k was made from (see the `corpus` fixture)."
    n_real = len(corpus) - 48
    return [t for t in corpus[:n_real] if 300 <= len(t.split()) <= 5000][k - n_real]


def test_gopher_rules_against_datatrove(splits):
    """Keep/remove decisions of `gopher_reasons` and of datatrove's GopherQualityFilter followed by
    GopherRepetitionFilter (same thresholds, whitespace words) on the mini-Pile's 253 documents and 6
    constructed ones. Measured agreement 0.91, held to >= 0.9. Where they differ (measured on the
    mini-Pile: 17 documents we remove for repeated 5-10-grams and datatrove keeps, 5 it removes for a mean
    word length over 10 and we keep): our duplicate n-gram fraction counts every occurrence of a repeated
    n-gram, first included, over word characters (as Dolma and RedPajama v2), datatrove's only the later
    ones, skipping ahead, over all characters; datatrove's mean word length leaves out pure-punctuation
    tokens. It also counts blank lines as lines and does not lower-case stop words."""
    pytest.importorskip("datatrove")
    from datatrove.data import Document
    from datatrove.pipeline.filters import GopherQualityFilter, GopherRepetitionFilter
    tok = _whitespace_tokenizer()
    quality, repetition = GopherQualityFilter(language=tok), GopherRepetitionFilter(language=tok)
    prose = ("The river that runs through the old town has been there for centuries, and the people who "
             "live with it have learned to read its moods and to respect its floods. ")
    texts = [r["text"] for s in splits.values() for r in s] + [
        prose * 3, "- item one\n" * 80, "short text", prose + "# tag " * 40, "\n\n".join([prose] * 6),
        " ".join(f"w{i}" for i in range(200))]
    ours = [not gopher_reasons(t) for t in texts]
    theirs = [quality.filter(Document(t, str(i))) is True and
              repetition.filter(Document(t, str(i))) is True for i, t in enumerate(texts)]
    agree = np.mean(np.equal(ours, theirs))
    assert sum(ours) >= 20 and len(ours) - sum(ours) >= 20       # both decisions are exercised
    differ = [(i, gopher_reasons(texts[i])) for i in range(len(texts)) if ours[i] != theirs[i]]
    assert agree >= 0.9, (agree, differ)
    assert not ours[-6] and not ours[-5] and not ours[-4] and not ours[-3] and not ours[-2]


def test_gopher_thresholds_are_the_papers():
    "Table A1 and Appendix A.1.1 of Rae et al. 2021."
    assert GOPHER_RULES["word_count"] | {} == {"description": "number of words", "min": 50, "max": 100_000}
    assert (GOPHER_RULES["mean_word_length"]["min"], GOPHER_RULES["mean_word_length"]["max"]) == (3, 10)
    want = {"hash_ratio": 0.1, "ellipsis_ratio": 0.1, "bullet_lines": 0.9, "ellipsis_lines": 0.3,
            "dup_line_frac": 0.3, "dup_para_frac": 0.3, "dup_line_char_frac": 0.2, "dup_para_char_frac": 0.2,
            "top_2_gram": 0.2, "top_3_gram": 0.18, "top_4_gram": 0.16, "dup_5_gram": 0.15, "dup_6_gram": 0.14,
            "dup_7_gram": 0.13, "dup_8_gram": 0.12, "dup_9_gram": 0.11, "dup_10_gram": 0.10}
    assert {k: GOPHER_RULES[k]["max"] for k in want} == want
    assert GOPHER_RULES["alpha_words"]["min"] == 0.8 and GOPHER_RULES["stop_words"]["min"] == 2


def test_decontamination_against_brute_force(splits):
    """`Decontaminator.hits` equals a brute-force count of shared normalised word 13-grams (Python tuples,
    no hashing) for every train document and for constructed leaks (a test document's 13 words pasted in:
    1 hit; 12 words: none)."""
    evals = [r["text"] for s in ("val", "test") for r in splits[s]]
    words = normalize_text(evals[0]).split()
    train = [r["text"] for r in splits["train"]] + [
        "intro text " + " ".join(words[100:113]) + " outro", "intro " + " ".join(words[100:112]) + " outro"]

    def grams(t):
        w = normalize_text(t).split()
        return {tuple(w[i:i + 13]) for i in range(len(w) - 12)} if len(w) >= 13 else {tuple(w)} - {()}
    eval_grams = set().union(*map(grams, evals))
    dec = Decontaminator(evals)
    want = [len(grams(t) & eval_grams) for t in train]
    assert [dec.hits(t) for t in train] == want and want[-2:] == [1, 0]
    assert len(ngram_set(evals)) == len(eval_grams) == len(dec.grams)
    assert dec.is_contaminated(train[-2]) and not dec.is_contaminated(train[-1])


def test_removal_log_round_trip_and_counts(tmp_path):
    log = RemovalLog()
    for i, (step, subset) in enumerate([("exact", "Github"), ("gopher", "Github"), ("gopher", "Licenses")]):
        log.add(i, step, f"reason {i}", subset, 100 * (i + 1))
    path = log.write(tmp_path / "removed.jsonl")
    back = RemovalLog.read(path, path)
    assert len(back) == 6 and back.records[:3] == log.records
    assert back.counts() == {"exact": 2, "gopher": 4} and back.bytes("pile_set_name") == {"Github": 600,
                                                                                        "Licenses": 600}
    assert back.counts(("step", "pile_set_name"))[("gopher", "Licenses")] == 2
    with pytest.raises(ValueError, match="'bogus'"):
        log.counts("bogus")


@pytest.mark.parametrize("call, error, match", [
    (lambda: MinHasher(num_perm=0), ValueError, "num_perm must be an int >= 1, got 0"),
    (lambda: MinHasher(n_gram=2.5), ValueError, "n_gram must be an int >= 1, got 2.5"),
    (lambda: word_ngrams("a b c", 0), ValueError, "n must be an int >= 1, got 0"),
    (lambda: shingle_hashes("a b", -1), ValueError, "got -1"),
    (lambda: lsh_params(1.0, 128), ValueError, r"threshold must be a number in \(0, 1\), got 1.0"),
    (lambda: lsh_params(0, 128), ValueError, "got 0"),
    (lambda: lsh_params(0.5, 0), ValueError, "num_perm must be an int >= 1, got 0"),
    (lambda: near_duplicates(np.zeros((3, 8), np.uint64), 4, 4), ValueError, "bands \\* rows = 16"),
    (lambda: near_duplicates(np.zeros((3, 8), np.uint64), 2, 4, threshold=1.5), ValueError, "got 1.5"),
    (lambda: near_duplicates(np.zeros((3, 8), np.uint64), 2, 4, texts=["a"] * 3), ValueError,
     "threshold=None"),
    (lambda: normalize_text(b"bytes"), TypeError, "text must be a str, got bytes"),
    (lambda: gopher_reasons(None), TypeError, "got NoneType"),
    (lambda: MinHasher().signatures("one text"), TypeError, "not one str"),
    (lambda: MinHasher().signatures(["ok", 3]), TypeError, r"texts\[1\] must be a str, got int"),
    (lambda: Decontaminator("a benchmark"), TypeError, "not one str"),
    (lambda: list(exact_dedup([{"text": "a"}, {"txt": "b"}])), TypeError, "record #1"),
    (lambda: minhash_jaccard(np.zeros(4), np.zeros(5)), ValueError, r"\(4,\) and \(5,\)"),
])
def test_bad_inputs_raise(call, error, match):
    with pytest.raises(error, match=match):
        call()
