"""Tests of the user-level accountant of example-level sampling (dpl.core.accounting.users), against dpl's own
subsampled-Gaussian accountant (k = 1) and Google's dp-accounting PLD accountant (an independent oracle)."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
from scipy import stats

from dpl.core.accounting import els_calibrate, els_epsilon, epsilon_for, group_privacy

DELTA = 1e-5
ORACLE_POINTS = [(1.0, 0.01, 1, 100), (1.2, 0.02, 4, 200), (2.0, 0.05, 8, 50), (0.8, 0.005, 16, 1000)]


def dp_accounting_epsilon(sigma: float, q: float, k: int, steps: int, delta: float) -> float:
    """dp-accounting's PLD epsilon of the mixture N(M, sigma^2), M ~ Binomial(k, q), against N(0, sigma^2), both
    add and remove directions (ADD_OR_REMOVE_ONE; PLD.from_mixture_gaussian_mechanism builds both), pessimistic."""
    dp_accounting = pytest.importorskip("dp_accounting")
    from dp_accounting.pld import pld_privacy_accountant

    acc = pld_privacy_accountant.PLDAccountant(dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE,
                                               value_discretization_interval=1e-3)
    event = dp_accounting.dp_event.MixtureOfGaussiansDpEvent(
        sigma, list(range(k + 1)), stats.binom.pmf(np.arange(k + 1), k, q).tolist())
    acc.compose(dp_accounting.SelfComposedDpEvent(event, steps))
    return acc.get_epsilon(delta)


@pytest.mark.parametrize("sigma,q,steps", [(1.0, 0.01, 100), (1.2, 0.02, 200), (0.8, 0.005, 1000), (2.0, 1.0, 10)])
def test_one_row_per_user_is_the_subsampled_gaussian(sigma, q, steps):
    assert els_epsilon(sigma, q, 1, steps, DELTA) == pytest.approx(epsilon_for(sigma, q, steps, DELTA), rel=1e-6)


@pytest.mark.parametrize("sigma,q,k,steps", ORACLE_POINTS)
def test_upper_bound_close_to_dp_accounting(sigma, q, k, steps):
    """Ours is an upper bound (eps_error ~0.5 % plus delta_error); dp-accounting's pessimistic PLD at a 1e-3 grid
    is within ~1e-4 relative of the true value here, so ours must be above it and within 2 % of it."""
    ours, theirs = els_epsilon(sigma, q, k, steps, DELTA), dp_accounting_epsilon(sigma, q, k, steps, DELTA)
    assert theirs * (1 - 1e-4) <= ours <= theirs * 1.02


def test_monotone_in_rows_and_tighter_than_group_privacy():
    """A user with k rows is a group of k rows: the row-level guarantee (eps_r, delta_r) of the subsampled Gaussian
    gives the user (k eps_r, k e^((k-1) eps_r) delta_r) by group privacy. At that user-level delta, the ELS
    accountant's epsilon must be no larger than k eps_r (both bound the same pair; ours is tight up to ~0.5 %)."""
    sigma, q, steps, delta_row = 1.0, 0.01, 500, 1e-7
    eps = [els_epsilon(sigma, q, k, steps, DELTA) for k in (1, 2, 4, 8)]
    assert all(a < b for a, b in zip(eps, eps[1:]))
    eps_row = epsilon_for(sigma, q, steps, delta_row)
    for k in (2, 4):
        eps_group, delta_group = group_privacy(eps_row, delta_row, k)
        assert eps_group == k * eps_row and delta_group == pytest.approx(k * math.exp((k - 1) * eps_row) * delta_row)
        assert delta_group < 1e-3
        assert els_epsilon(sigma, q, k, steps, delta_group) < eps_group


def test_calibration_is_tight_and_fast():
    target, q, k, steps = 8.0, 0.01, 8, 1000
    start = time.perf_counter()
    sigma = els_calibrate(target, DELTA, q, k, steps)
    elapsed = time.perf_counter() - start
    assert els_epsilon(sigma, q, k, steps, DELTA) <= target
    assert els_epsilon(sigma * (1 - 0.01), q, k, steps, DELTA) > target  # tol = 1 % in epsilon: sigma is ~minimal
    assert elapsed < 15.0  # measured ~3-4 s on 2 cores (5 PRV evaluations of two directions each)


def test_edge_cases():
    assert els_epsilon(0.0, 0.01, 4, 10, DELTA) == math.inf
    assert els_epsilon(1.0, 0.01, 4, 0, DELTA) == 0.0
    assert els_calibrate(1.0, DELTA, 0.01, 4, 0) == 0.0
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError):
            els_epsilon(1.0, 0.01, bad, 10, DELTA)
    a = els_epsilon(1.3, 0.02, 3, 100, DELTA)
    start = time.perf_counter()
    assert els_epsilon(1.3, 0.02, 3, 100, DELTA) == a
    assert time.perf_counter() - start < 0.01  # cached


def test_row_rate_accounting_would_be_caught():
    """Accounting a user with k = 4 rows as one row (the row-level accountant) understates epsilon by far more than
    the oracle test's tolerance, so that test would catch the mistake."""
    sigma, q, k, steps = ORACLE_POINTS[1]
    wrong, right = els_epsilon(sigma, q, 1, steps, DELTA), els_epsilon(sigma, q, k, steps, DELTA)
    assert right > 2 * wrong
    assert wrong < 0.9 * dp_accounting_epsilon(sigma, q, k, steps, DELTA)
