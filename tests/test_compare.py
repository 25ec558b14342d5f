"""`course_lib.core.compare`: the sentence two estimates support, checked against SciPy's Welch t-test."""
import math

import numpy as np
import pytest
from scipy import stats

from course_lib.core.compare import Comparison, verdict


@pytest.mark.parametrize("seed", range(20))
def test_z_is_welchs_statistic(seed):
    "With se = s / sqrt(n), z equals `scipy.stats.ttest_ind_from_stats(..., equal_var=False)` to 1e-12."
    rng = np.random.default_rng(seed)
    m1, m2 = rng.normal(scale=3, size=2)
    s1, s2 = rng.uniform(0.1, 5, size=2)
    n1, n2 = rng.integers(2, 5000, size=2)
    ours = Comparison("a", float(m1), float(s1 / math.sqrt(n1)), "b", float(m2), float(s2 / math.sqrt(n2))).z
    ref = stats.ttest_ind_from_stats(m1, s1, n1, m2, s2, n2, equal_var=False).statistic
    assert ours == pytest.approx(ref, rel=1e-12, abs=1e-12)


def test_the_sentence_follows_the_evidence():
    # 10a's full run (issue 42): 0.498 against 0.574 on 512 samples each
    se = lambda p: math.sqrt(p * (1 - p) / 512)
    s = verdict("TinyUNet", 0.498, se(0.498), "UNet2DModel", 0.574, se(0.574))
    assert s.startswith("UNet2DModel ahead of TinyUNet by 2.") and "standard errors" in s, s
    # the same rates on 64 samples each cannot be ranked
    se64 = lambda p: math.sqrt(p * (1 - p) / 64)
    s = verdict("TinyUNet", 0.498, se64(0.498), "UNet2DModel", 0.574, se64(0.574))
    assert s.startswith("cannot rank TinyUNet and UNet2DModel: 0.9 standard errors apart, 2 needed"), s
    # lower is better for a FID: the smaller one leads
    assert verdict("x", 1.0, 0.1, "y", 2.0, 0.1, higher_is_better=False).startswith("x ahead of y by 7.1")
    assert verdict("x", 1.0, 0.1, "y", 2.0, 0.1).startswith("y ahead of x by 7.1")
    # no standard error at all: an exact gap, or an exact tie
    assert Comparison("x", 1.0, 0.0, "y", 2.0, 0.0).leader == "y"
    assert Comparison("x", 1.0, 0.0, "y", 1.0, 0.0).leader is None



def test_a_measure_without_a_better_side_says_which_is_higher():
    "33's memorisation check: samples farther from the training digits than held-out digits are is no merit."
    d = "distance to the nearest training digit"
    s = verdict("samples", 1.43, 0.02, "held-out digits", 1.04, 0.03, measure=d)
    assert s.startswith(f"samples above held-out digits in {d} by 10.8 standard errors"), s
    s = verdict("samples", 0.9, 0.02, "held-out digits", 1.04, 0.03, measure=d)
    assert s.startswith(f"held-out digits above samples in {d} by 3.9"), s
    s = verdict("samples", 1.05, 0.02, "held-out digits", 1.04, 0.03, measure=d)
    assert s.startswith(f"cannot tell samples and held-out digits apart in {d}: 0.3 standard errors"), s
    assert "ahead" not in s and Comparison("a", 1.0, 0.1, "b", 0.5, 0.1, measure=d).leader == "a"

def test_the_threshold_is_strict_and_settable():
    c = Comparison("a", 2.0, 0.5, "b", 0.0, 0.0)          # exactly 4 standard errors
    assert c.z == 4 and c.separated and c.leader == "a"
    assert not Comparison("a", 2.0, 0.5, "b", 0.0, 0.0, z_needed=4).separated
    assert not Comparison("a", 1.0, 0.5, "b", 0.0, 0.0).separated        # exactly 2: not above 2


@pytest.mark.parametrize("bad, msg", [
    (dict(se_a=-0.1), "a: the standard error must be a finite number >= 0, got -0.1"),
    (dict(se_b=float("inf")), "b: the standard error must be a finite number >= 0, got inf"),
    (dict(est_a=float("nan")), "a: the estimate must be a finite number, got nan"),
    (dict(est_b="0.4"), "b: the estimate must be a finite number, got '0.4'"),
    (dict(est_a=True), "a: the estimate must be a finite number, got True"),
    (dict(b="a"), "two estimates of the same name 'a'"),
    (dict(z_needed=0), "z_needed must be > 0, got 0"),
])
def test_bad_input_is_named(bad, msg):
    args = dict(a="a", est_a=0.5, se_a=0.1, b="b", est_b=0.4, se_b=0.1) | bad
    with pytest.raises(ValueError, match=msg.replace("(", r"\(").replace(")", r"\)")):
        Comparison(**args)


def test_paired_standard_error_matches_scipys_paired_t_test():
    from scipy import stats
    rng = np.random.default_rng(1)
    for _ in range(20):
        shared = rng.normal(size=64)                              # the noise both measurements share
        a, b = shared + rng.normal(0.3, 0.2, 64), shared + rng.normal(0.0, 0.2, 64)
        d = a - b
        c = Comparison("a", a.mean(), stats.sem(a), "b", b.mean(), stats.sem(b), se_diff=stats.sem(d))
        assert abs(c.z - stats.ttest_rel(a, b).statistic) < 1e-10
        # pairing removes the shared noise: the independent z understates the gap
        assert abs(c.z) > abs(Comparison("a", a.mean(), stats.sem(a), "b", b.mean(), stats.sem(b)).z)
    assert "difference -1 ± 0.1 paired" in verdict("x", 1.0, 0.5, "y", 2.0, 0.5, se_diff=0.1)
    with pytest.raises(ValueError, match="x - y: the standard error must be a finite number >= 0, got -1"):
        Comparison("x", 1.0, 0.5, "y", 2.0, 0.5, se_diff=-1)
