"""``GrowthWatch``: a series grown by orders of magnitude while finite is told once."""

from __future__ import annotations

import math

from psserver.utils.divergence import GrowthWatch


def test_a_loss_falling_without_bound_is_told_once_at_ten_thousand_times_its_first():
    watch = GrowthWatch()
    # nll_loss of raw outputs, as the RPC tutorial's loop against a logits model measured it
    told = [watch.observe(v) for v in (0.08, -0.5, -40.0, -9_000.0, -12_000.0, -8.07e8)]
    assert told[:4] == [None] * 4
    assert told[4].startswith("-1.2e+04, from 0.08 at first: training is diverging (a loss that takes "
                              "log-probabilities (nll_loss) fed a model's raw outputs")
    assert told[5] is None


def test_what_converging_training_does_is_never_told():
    watch = GrowthWatch()
    losses = [2.3 * math.exp(-t / 50) for t in range(500)]  # to 1e-4
    log_probs = [-2.3 - t / 5 for t in range(500)]  # a confident classifier's log-probabilities
    assert all(watch.observe(v) is None for v in losses)
    assert all(GrowthWatch().observe(v) is None for v in log_probs)
    big = GrowthWatch()
    assert big.observe(5e9) is None and big.observe(1e12) is None  # an MSE of prices that starts large


def test_non_finite_values_are_left_to_the_guards_that_refuse_them():
    watch = GrowthWatch()
    assert watch.observe(math.nan) is None and watch.first is None
    assert watch.observe(1.0) is None and watch.observe(math.inf) is None and watch.observe(-math.inf) is None
    assert watch.observe(2e4) is not None
