"""Lesson 62a's cleaning experiment (issue 45 item 1; `course_lib.pile.experiment`, notebook 69f): the training sets
(decontaminated by GPT-3's rule, the cleaned one without lesson 62a's removals), one tokenizer fitted elsewhere, the
cached models a set and seed, and BPB over seeds with standard errors checked against closed forms."""
import math, statistics

import pytest
import torch

from course_lib.pile import (
    BPBReport, LN2, bpb_stderr, exact_dedup, gopher_reasons, mini_pile, paired_bpb_difference, read_jsonl_zst,
    train_bpe_tokenizer, train_tiny_gpt2, TinyGPTConfig, Decontaminator)
from course_lib.pile.experiment import (
    CleanExperimentConfig, clean_experiment_model, cleaning_removals, experiment_sets, mean_report, seeds_bpb,
    seeds_difference)

torch.set_num_threads(1)
TINY = dict(max_mb_per_subset=0.5, vocab_size=300, n_positions=32, n_embd=16, n_layer=1, n_head=1, steps=2,
            batch_size=2, seeds=(0, 1))


def _report(rows):
    "A BPBReport of `(subset, nll nats, bytes)` rows (one token a document)."
    return BPBReport.from_rows([(i, (y, 1)) for i, (_, y, _) in enumerate(rows)], [(s, x) for s, _, x in rows], 0, 0)


ROWS = [("a", 70.0, 100), ("a", 150.0, 200), ("a", 40.0, 90), ("b", 300.0, 400), ("b", 20.0, 50)]


def _seed(k):
    "The rows with every NLL scaled by k (a seed that is uniformly better or worse)."
    return _report([(s, y * k, x) for s, y, x in ROWS])


def test_one_seed_is_the_report_itself():
    r = _report(ROWS)
    v, se = seeds_bpb([r])
    assert v == pytest.approx(r.overall.bpb, rel=1e-12) and se == pytest.approx(bpb_stderr(r), rel=1e-12)


def test_seeds_bpb_is_the_mean_of_the_seeds_with_both_errors_in_quadrature():
    reps = [_seed(k) for k in (0.9, 1.0, 1.2)]
    per_seed = [r.overall.bpb for r in reps]
    v, se = seeds_bpb(reps)
    assert v == pytest.approx(statistics.mean(per_seed), rel=1e-12)
    # the mean report is the rows scaled by the mean factor: its document error is that of one report, scaled
    docs_se = bpb_stderr(_seed(statistics.mean([0.9, 1.0, 1.2])))
    seed_se = statistics.stdev(per_seed) / math.sqrt(3)
    assert se == pytest.approx(math.hypot(docs_se, seed_se), rel=1e-12)
    assert se > docs_se and se > seed_se


def test_seeds_bpb_per_subset_and_on_kept_documents():
    reps = [_seed(k) for k in (0.9, 1.1)]
    v, _ = seeds_bpb(reps, "b")
    assert v == pytest.approx(320.0 / 450 / LN2, rel=1e-12)     # the factors average to 1
    keep = [True, False, True, False, True]
    v_keep, se_keep = seeds_bpb(reps, keep=keep)
    only = [_report([(s, y * k, x) for (s, y, x), kp in zip(ROWS, keep) if kp]) for k in (0.9, 1.1)]
    assert (v_keep, se_keep) == pytest.approx(seeds_bpb(only), rel=1e-12)


def test_seeds_difference_of_a_constant_shift_is_exact():
    "b = a + c nats a byte on every document of every seed: the difference is c / ln 2 with no error at all."
    a = [_seed(k) for k in (0.9, 1.0, 1.2)]
    b = [_report([(s, y * k + 0.25 * x, x) for s, y, x in ROWS]) for k in (0.9, 1.0, 1.2)]
    d, se = seeds_difference(b, a)
    assert d == pytest.approx(0.25 / LN2, rel=1e-12) and se == pytest.approx(0.0, abs=1e-12)


def test_seeds_difference_adds_the_seed_spread_to_the_paired_error():
    a = [_seed(k) for k in (1.0, 1.0, 1.0)]
    b = [_seed(k) for k in (0.8, 1.0, 0.9)]
    d, se = seeds_difference(b, a)
    per_seed = [paired_bpb_difference(x, y)[0] for x, y in zip(b, a)]
    assert d == pytest.approx(statistics.mean(per_seed), rel=1e-12)
    docs_se = paired_bpb_difference(mean_report(b), mean_report(a))[1]
    assert se == pytest.approx(math.hypot(docs_se, statistics.stdev(per_seed) / math.sqrt(3)), rel=1e-12)


def test_mismatched_reports_are_refused():
    other = _report(ROWS[:4])
    with pytest.raises(ValueError, match="different documents"):
        mean_report([_report(ROWS), other])
    with pytest.raises(ValueError, match="pair them by seed"):
        seeds_difference([_report(ROWS)], [_report(ROWS), _report(ROWS)])
    with pytest.raises(ValueError, match="at least one"):
        mean_report([])
    with pytest.raises(ValueError, match="keep has 4 entries for 5 documents"):
        seeds_bpb([_report(ROWS)], keep=[True] * 4)          # a mask of another split: not silently cut


def test_config_refuses_repeated_seeds_and_gives_each_seed_its_model_config():
    with pytest.raises(ValueError, match="distinct"):
        CleanExperimentConfig(seeds=(0, 0))
    cfg = CleanExperimentConfig()
    lm = cfg.lm(2)
    assert (lm.seed, lm.steps, lm.vocab_size, lm.n_positions) == (2, cfg.steps, cfg.vocab_size, cfg.n_positions)
    assert cfg.key() != CleanExperimentConfig(steps=cfg.steps + 1).key()


@pytest.fixture(scope="module")
def sets():
    return experiment_sets(CleanExperimentConfig(**TINY))


def test_no_training_text_shares_an_ngram_with_the_evaluation_splits(sets):
    decon = Decontaminator([r["text"] for r in sets.val + sets.test], n=13)
    before = sum(decon.hits(r["text"]) > 0 for r in sets.train)
    assert before > 0                                  # there was something to remove
    assert all(decon.hits(t) == 0 for t in sets.texts["raw"])


def test_the_cleaned_set_is_the_raw_set_less_the_removed_documents(sets):
    cfg = CleanExperimentConfig(**TINY)
    exact = {i for i, (_, why) in enumerate(exact_dedup(sets.train)) if why}
    gopher = {i for i, r in enumerate(sets.train)
              if r["meta"]["pile_set_name"] in cfg.gopher_subsets and gopher_reasons(r["text"])}
    assert sets.removed["exact duplicate"] == exact and sets.removed["Gopher rules"] == gopher
    assert not sets.removed["near duplicate"] & exact and sets.removed["near duplicate"]
    gone = set().union(*sets.removed.values())
    assert sets.texts["cleaned"] == [p for i, ps in enumerate(sets.pieces) if i not in gone for p in ps]
    assert sets.texts["raw"] == [p for ps in sets.pieces for p in ps]
    assert len(sets.texts["cleaned"]) < len(sets.texts["raw"])
    test_gone = set().union(*cleaning_removals(sets.test, cfg).values())
    assert sets.test_clean == [j not in test_gone for j in range(len(sets.test))] and not all(sets.test_clean)


def test_the_sets_are_the_same_every_call(sets):
    again = experiment_sets(CleanExperimentConfig(**TINY))
    assert again.digest("raw") == sets.digest("raw") and again.digest("cleaned") == sets.digest("cleaned")
    assert sets.digest("raw") != sets.digest("cleaned")


def test_train_tiny_gpt2_uses_a_tokenizer_fitted_elsewhere():
    tok = train_bpe_tokenizer(["a tokenizer fitted on other text, not on the training texts " * 20], 280)
    texts = ["def f(x):\n    return x + 1\n" * 40, "The model trains on these texts only. " * 40]
    model, got, _ = train_tiny_gpt2(texts, TinyGPTConfig(vocab_size=4096, n_positions=32, n_embd=16, n_layer=1,
                                                         n_head=1, steps=2, batch_size=2), tokenizer=tok)
    assert got is tok and model.config.vocab_size == len(tok) < 4096


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("COURSE_LIB_HOME", str(tmp_path))
    monkeypatch.setenv("COURSE_LIB_NO_PRETRAINED", "1")
    return tmp_path


@pytest.mark.filterwarnings("ignore::course_lib.core.StaleCacheWarning")   # the trainer is patched out below
def test_a_model_is_trained_once_stored_in_float16_and_checked_against_its_texts(cache, sets, monkeypatch):
    cfg = CleanExperimentConfig(**TINY)
    model, tok, d = clean_experiment_model("cleaned", 1, cfg, sets=sets)
    assert d.is_relative_to(cache) and len(tok) == cfg.vocab_size
    from safetensors import safe_open
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.float16}
    import course_lib.pile.experiment as ex
    monkeypatch.setattr(ex, "train_tiny_gpt2", lambda *a, **k: pytest.fail("trained again"))
    again, _, _ = clean_experiment_model("cleaned", 1, cfg, sets=sets)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), again.parameters()))
    saved = sets.texts["cleaned"]
    sets.texts["cleaned"] = saved[:-1]                # another machine's mini-Pile: other texts
    try:
        with pytest.warns(UserWarning, match="other texts"):
            clean_experiment_model("cleaned", 1, cfg, sets=sets)
    finally:
        sets.texts["cleaned"] = saved


def test_unknown_set_or_seed_is_refused(cache):
    cfg = CleanExperimentConfig(**TINY)
    with pytest.raises(ValueError, match="'raw' or 'cleaned'"):
        clean_experiment_model("decontaminated", 0, cfg)
    with pytest.raises(ValueError, match="not one of cfg.seeds"):
        clean_experiment_model("raw", 5, cfg)
