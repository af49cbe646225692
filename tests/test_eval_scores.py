"""The unbiased pass@k estimator and the evaluation summary (pure functions) on hand-computed
cases."""

from math import comb

import pytest

from areal_mega.eval.scores import flat_metrics, pass_at_k, pass_ks, summarize


def test_pass_at_k_hand_computed():
    # n=4, c=1: pass@1 = 1/4; pass@2 = 1 - C(3,2)/C(4,2) = 1 - 3/6 = 1/2; pass@4 = 1
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)
    assert pass_at_k(4, 1, 4) == 1.0
    # n=5, c=2, k=2: 1 - C(3,2)/C(5,2) = 1 - 3/10
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)
    # none correct: 0 for every k; all correct: 1
    assert [pass_at_k(8, 0, k) for k in (1, 2, 8)] == [0.0, 0.0, 0.0]
    assert pass_at_k(8, 8, 1) == 1.0
    # n - c < k: every k-subset holds a correct sample
    assert pass_at_k(10, 9, 2) == 1.0


def test_pass_at_k_equals_the_binomial_formula_and_is_stable_for_large_n():
    for n in (1, 3, 7, 16):
        for c in range(n + 1):
            for k in range(1, n + 1):
                want = 1 - comb(n - c, k) / comb(n, k)
                assert pass_at_k(n, c, k) == pytest.approx(want, abs=1e-12), (n, c, k)
    # C(1000, 500) overflows a float; the product form does not
    p = pass_at_k(1000, 3, 500)
    assert p == pytest.approx(1 - comb(997, 500) / comb(1000, 500), rel=1e-9)
    assert 0.87 < p < 0.88


def test_pass_at_k_rejects_bad_arguments():
    for n, c, k in ((4, 5, 1), (4, -1, 1), (4, 1, 0), (4, 1, 5), (0, 0, 1)):
        with pytest.raises(ValueError):
            pass_at_k(n, c, k)


def test_pass_ks():
    assert pass_ks(1) == [1]
    assert pass_ks(8) == [1, 2, 4, 8]
    assert pass_ks(6) == [1, 2, 4, 6]
    with pytest.raises(ValueError):
        pass_ks(0)


def _rec(source, rewards, lens=None, fins=None):
    n = len(rewards)
    return {
        "source": source,
        "rewards": rewards,
        "response_lens": lens or [2] * n,
        "finish_reasons": fins or ["stop"] * n,
    }


def test_summarize_overall_and_per_source():
    recs = [
        _rec("a", [1, 0, 0, 0], lens=[1, 2, 3, 4], fins=["stop", "length", "stop", "stop"]),
        _rec("a", [1, 1, 1, 1]),
        _rec("b", [0, 0, 0.5, 0]),
    ]  # partial credit is not a pass at threshold 1
    s = summarize(recs)
    o = s["overall"]
    assert o["n_prompts"] == 3 and o["n_samples"] == 4
    assert o["pass@1"] == pytest.approx((0.25 + 1 + 0) / 3)
    assert o["pass@2"] == pytest.approx((0.5 + 1 + 0) / 3)
    assert o["pass@4"] == pytest.approx((1 + 1 + 0) / 3)
    assert o["reward"] == pytest.approx(5.5 / 12)
    assert o["response_len"] == pytest.approx((10 + 8 + 8) / 12)
    assert o["truncation_rate"] == pytest.approx(1 / 12)
    assert s["per_source"]["a"]["pass@1"] == pytest.approx(0.625)
    assert s["per_source"]["b"]["pass@4"] == 0.0
    assert summarize(recs, pass_threshold=0.5)["per_source"]["b"]["pass@1"] == 0.25
    flat = flat_metrics(s)
    assert flat["eval/pass@1"] == o["pass@1"] and flat["eval/b/pass@4"] == 0.0
    # one source: no per-source copies of the overall numbers
    assert not any(k.startswith("eval/a/") for k in flat_metrics(summarize(recs[:2])))


def test_summarize_rejects_empty_and_ragged_input():
    with pytest.raises(ValueError, match="no evaluation records"):
        summarize([])
    with pytest.raises(ValueError, match="samples"):
        summarize([_rec("a", [1, 0]), _rec("a", [1])])
