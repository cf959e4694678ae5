"""Tests of dpl.core.accounting against prv-accountant, opacus and the closed form of the Gaussian mechanism."""

from __future__ import annotations

import itertools
import logging
import math
import time
import warnings

import numpy as np
import pytest
from scipy.stats import norm

from dpl.core import accounting
from dpl.core.accounting import events, prv, rdp
from dpl.core.accounting import (
    EpsilonSchedule,
    calibrate_gaussian_mechanism,
    calibrate_noise_multiplier,
    epsilon_for,
    gaussian_mechanism_epsilon,
    smallest_noise_multiplier,
)

DELTA = 1e-5


def prv_reference(sigma: float, q: float, steps: int, delta: float, eps_error: float) -> tuple[float, float, float]:
    """(lower, estimate, upper) epsilon straight from prv-accountant."""
    from prv_accountant import Accountant

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        acc = Accountant(noise_multiplier=sigma, sampling_probability=q, delta=delta, max_compositions=steps,
                         eps_error=eps_error)
        return acc.compute_epsilon(num_compositions=steps)


def gaussian_delta(eps: float, s: float) -> float:
    """Balle & Wang (2018): delta(eps) of the Gaussian mechanism with sensitivity 1 and std s."""
    return norm.cdf(1 / (2 * s) - eps * s) - math.exp(eps) * norm.cdf(-1 / (2 * s) - eps * s)


# ----------------------------------------------------------------------------------------------------------
# PRV epsilon


@pytest.mark.parametrize("sigma,q,steps,delta", [
    (1.0, 0.03, 400, 1e-5),
    (0.8, 0.01, 1000, 1e-6),
    (2.0, 1.0, 10, 1e-5),  # no subsampling
    (4.0, 0.2, 50, 1e-5),
])
def test_epsilon_for_matches_prv_accountant(sigma, q, steps, delta):
    eps = epsilon_for(sigma, q, steps, delta)
    lo, est, up = prv._prv_bounds(((sigma, q, steps),), delta, None)
    assert eps == up
    # prv-accountant with the eps_error dpl uses (0.5 % of an RDP bound) gives the same bounds
    eps_error = accounting.prv_error_for(epsilon_for(sigma, q, steps, delta, method="rdp"))
    assert eps_error == pytest.approx(up - est, rel=0.2)
    ref_lo, ref_est, ref_up = prv_reference(sigma, q, steps, delta, eps_error=eps_error)
    assert est == pytest.approx(ref_est, rel=2e-4)
    assert eps == pytest.approx(ref_up, rel=2e-3)
    assert lo == pytest.approx(ref_lo, rel=2e-3)
    # the reported value is the conservative end, accurate to ~1 %
    assert ref_est < eps <= 1.01 * ref_est


def test_epsilon_is_below_rdp_and_above_the_exact_single_gaussian():
    sigma, q, steps = 1.0, 0.03, 400
    assert epsilon_for(sigma, q, steps, DELTA) < epsilon_for(sigma, q, steps, DELTA, method="rdp")
    # one un-subsampled step is the Gaussian mechanism: PRV upper bound is within 1 % above the exact value
    exact = gaussian_mechanism_epsilon(1.5, DELTA)
    assert exact <= epsilon_for(1.5, 1.0, 1, DELTA) <= 1.01 * exact


def test_monotone_in_sigma_steps_and_rate():
    sigmas = [0.6, 0.8, 1.0, 1.3, 2.0, 4.0]
    eps = [epsilon_for(s, 0.03, 300, DELTA) for s in sigmas]
    assert all(a > b for a, b in itertools.pairwise(eps)), eps
    eps_rdp = [epsilon_for(s, 0.03, 300, DELTA, method="rdp") for s in sigmas]
    assert all(a > b for a, b in itertools.pairwise(eps_rdp)), eps_rdp
    assert epsilon_for(1.0, 0.03, 100, DELTA) < epsilon_for(1.0, 0.03, 300, DELTA)
    assert epsilon_for(1.0, 0.01, 300, DELTA) < epsilon_for(1.0, 0.03, 300, DELTA)


def test_edge_cases():
    for method in ("prv", "rdp"):
        assert epsilon_for(1.0, 0.03, 0, DELTA, method=method) == 0.0
        assert epsilon_for(0.0, 0.03, 10, DELTA, method=method) == math.inf
        assert math.isfinite(epsilon_for(3.0, 1.0, 5, DELTA, method=method))
    assert gaussian_mechanism_epsilon(0.0, DELTA) == math.inf
    assert calibrate_noise_multiplier(1.0, DELTA, 0.03, 0) == 0.0
    assert events.epsilon(events.Composed(()), DELTA) == 0.0


# ----------------------------------------------------------------------------------------------------------
# calibration


@pytest.mark.parametrize("target,q,steps", [(3.0, 0.03, 400), (1.0, 0.01, 500), (8.0, 1.0, 5)])
def test_calibrated_sigma_checked_by_prv_accountant(target, q, steps):
    prv._prv_bounds.cache_clear()
    t = time.perf_counter()
    sigma = calibrate_noise_multiplier(target, DELTA, q, steps, tol=0.01)
    elapsed = time.perf_counter() - t
    assert prv._prv_bounds.cache_info().misses <= 5  # a handful of PRV evaluations
    assert elapsed < 10  # generous (shared CI machines); ~0.05-0.3 s here
    eps = epsilon_for(sigma, q, steps, DELTA)
    assert 0.99 * target <= eps <= target
    # independently: prv-accountant's upper bound (with a smaller eps_error than dpl's) never exceeds the target,
    # and its estimate is within tolerance
    _, ref_est, ref_up = prv_reference(sigma, q, steps, DELTA, eps_error=0.002 * target)
    assert ref_up <= target
    assert ref_est >= target * (1 - 0.01 - 2 * accounting.REL_EPS_ERROR * 1.5)
    # smallest: 2 % less noise breaks the target
    assert epsilon_for(0.98 * sigma, q, steps, DELTA) > target


def test_calibrate_without_subsampling_matches_exact_gaussian_and_tiny_targets():
    # q = 1, T = 1 is one Gaussian mechanism: PRV calibration is close to (and above) the exact answer
    exact = calibrate_gaussian_mechanism(0.5, DELTA)
    assert exact <= calibrate_noise_multiplier(0.5, DELTA, 1.0, 1) <= 1.02 * exact
    # a target too small for the RDP bracket (orders <= 256) still calibrates, by a secant on PRV alone
    sigma = calibrate_noise_multiplier(0.01, DELTA, 1.0, 1)
    assert 0.99 * 0.01 <= epsilon_for(sigma, 1.0, 1, DELTA) <= 0.01
    with pytest.raises(ValueError, match="cannot calibrate"):  # opacus' RDP bottoms out above 0.01
        calibrate_noise_multiplier(0.01, DELTA, 0.01, 100, method="rdp")


def test_calibrate_rdp_and_explicit_eps_error():
    sigma = calibrate_noise_multiplier(3.0, DELTA, 0.03, 400, method="rdp", tol=0.005)
    assert 0.995 * 3.0 <= epsilon_for(sigma, 0.03, 400, DELTA, method="rdp") <= 3.0
    assert sigma > calibrate_noise_multiplier(3.0, DELTA, 0.03, 400)  # RDP is looser: needs more noise
    sigma = calibrate_noise_multiplier(2.0, DELTA, 0.05, 200, eps_error=0.05)
    assert 0.99 * 2.0 <= epsilon_for(sigma, 0.05, 200, DELTA, eps_error=0.05) <= 2.0


def test_gaussian_mechanism_matches_closed_form():
    for s in (0.5, 1.0, 2.0, 5.0):
        for delta in (1e-5, 1e-3):
            eps = gaussian_mechanism_epsilon(s, delta)
            assert gaussian_delta(eps, s) == pytest.approx(delta, rel=1e-6)
            assert gaussian_delta(eps, s) <= delta * (1 + 1e-9)
            assert gaussian_delta(eps * (1 - 1e-4), s) > delta  # and it is the smallest such epsilon
    assert gaussian_mechanism_epsilon(50.0, 0.5) == 0.0  # delta(0) < 0.5 already


def test_calibrate_gaussian_mechanism():
    for target in (0.5, 2.0, 8.0):
        s = calibrate_gaussian_mechanism(target, DELTA)
        assert gaussian_mechanism_epsilon(s, DELTA) <= target
        assert gaussian_mechanism_epsilon(s * (1 - 1e-6), DELTA) > target * (1 - 1e-5)
        assert gaussian_delta(target, s) == pytest.approx(DELTA, rel=1e-6)


# ----------------------------------------------------------------------------------------------------------
# histories of events


def _steps(*segments, method="prv"):
    """Epsilon of Poisson-subsampled Gaussian segments ``(sigma, q, n)`` composed, through the events."""
    history = events.Composed(tuple(events.SelfComposed(events.PoissonGaussian(s, q), n) for s, q, n in segments))
    return events.epsilon(history, DELTA, method)


def test_rdp_method_matches_opacus_rdp_accountant():
    from opacus.accountants import RDPAccountant

    ref = RDPAccountant()
    segments = [(1.0, 0.03, 50), (1.5, 0.02, 30), (1.0, 0.03, 20)]
    for sigma, q, n in segments:
        for _ in range(n):
            ref.step(noise_multiplier=sigma, sample_rate=q)
    assert _steps(*segments, method="rdp") == pytest.approx(ref.get_epsilon(DELTA), rel=1e-9)
    assert epsilon_for(1.1, 0.03, 300, DELTA, method="rdp") == pytest.approx(
        _opacus_epsilon(1.1, 0.03, 300, DELTA), rel=1e-9)


def _opacus_epsilon(sigma, q, steps, delta):
    from opacus.accountants import RDPAccountant

    acc = RDPAccountant()
    acc.history = [(sigma, q, steps)]
    return acc.get_epsilon(delta)


def test_history_of_segments_equals_one_shot():
    assert _steps(*[(1.0, 0.03, 1)] * 100, (1.0, 0.03, 150), (1.0, 0.03, 0), (1.0, 0.03, 150)) == \
        epsilon_for(1.0, 0.03, 400, DELTA)


def test_accountant_heterogeneous_history_matches_prv_accountant():
    from prv_accountant import PoissonSubsampledGaussianMechanism, PRVAccountant

    # composition is commutative: the third segment merges with the first
    eps = _steps((0.9, 0.02, 100), (1.3, 0.05, 200), (0.9, 0.02, 100))
    assert eps == _steps((0.9, 0.02, 200), (1.3, 0.05, 200))
    _, est, _ = prv._prv_bounds(((0.9, 0.02, 200), (1.3, 0.05, 200)), DELTA, None)
    prvs = [PoissonSubsampledGaussianMechanism(sampling_probability=0.02, noise_multiplier=0.9),
            PoissonSubsampledGaussianMechanism(sampling_probability=0.05, noise_multiplier=1.3)]
    ref = PRVAccountant(prvs=prvs, max_self_compositions=[200, 200], eps_error=0.01 * est, delta_error=DELTA / 1000)
    _, ref_est, _ = ref.compute_epsilon(delta=DELTA, num_self_compositions=[200, 200])
    assert est == pytest.approx(ref_est, rel=2e-4)
    assert ref_est < eps <= 1.01 * ref_est
    # between the two homogeneous runs of the same length
    assert epsilon_for(1.3, 0.05, 400, DELTA) < eps < epsilon_for(0.9, 0.02, 400, DELTA) or \
        epsilon_for(0.9, 0.02, 400, DELTA) < eps < epsilon_for(1.3, 0.05, 400, DELTA)


def test_fallback_to_rdp_warns_once(monkeypatch, caplog):
    def broken(*args):
        raise RuntimeError("boom")

    monkeypatch.setattr(prv, "_prv_bounds", broken)
    monkeypatch.setattr(accounting.common, "_warned", set())  # once per process: forget earlier tests' warnings
    with caplog.at_level(logging.WARNING, logger="dpl.core.accounting"):
        eps = _steps((1.0, 0.03, 100))
        eps2 = _steps((1.0, 0.03, 200))
    assert eps == pytest.approx(_opacus_epsilon(1.0, 0.03, 100, DELTA), rel=1e-9)
    assert eps2 == pytest.approx(_opacus_epsilon(1.0, 0.03, 200, DELTA), rel=1e-9)
    assert sum("falling back to RDP" in r.getMessage() for r in caplog.records) == 1

    monkeypatch.setattr(prv, "_prv_bounds", lambda *args: (0.0, float("nan"), float("nan")))
    assert epsilon_for(1.0, 0.03, 100, DELTA) == pytest.approx(_opacus_epsilon(1.0, 0.03, 100, DELTA), rel=1e-9)
    # calibration falls back to RDP too: a valid (larger) sigma
    sigma = calibrate_noise_multiplier(3.0, DELTA, 0.03, 100)
    assert epsilon_for(sigma, 0.03, 100, DELTA, method="rdp") <= 3.0


# ----------------------------------------------------------------------------------------------------------
# bad input


@pytest.mark.parametrize("call,match", [
    (lambda: epsilon_for(-1.0, 0.03, 10, DELTA), "noise_multiplier"),
    (lambda: epsilon_for(float("nan"), 0.03, 10, DELTA), "noise_multiplier"),
    (lambda: epsilon_for(1.0, 0.0, 10, DELTA), "sample_rate"),
    (lambda: epsilon_for(1.0, 1.5, 10, DELTA), "sample_rate"),
    (lambda: epsilon_for(1.0, 0.03, -1, DELTA), "steps"),
    (lambda: epsilon_for(1.0, 0.03, 2.5, DELTA), "steps"),
    (lambda: epsilon_for(1.0, 0.03, 10, 0.0), "delta"),
    (lambda: epsilon_for(1.0, 0.03, 10, 1.0), "delta"),
    (lambda: epsilon_for(1.0, 0.03, 10, DELTA, method="gdp"), "method"),
    (lambda: epsilon_for(1.0, 0.03, 10, DELTA, eps_error=0.0), "eps_error"),
    (lambda: calibrate_noise_multiplier(0.0, DELTA, 0.03, 10), "target_epsilon"),
    (lambda: calibrate_noise_multiplier(-1.0, DELTA, 0.03, 10), "target_epsilon"),
    (lambda: calibrate_noise_multiplier(1.0, 2.0, 0.03, 10), "delta"),
    (lambda: calibrate_noise_multiplier(1.0, DELTA, 0.03, 10, tol=0.0), "tol"),
    (lambda: calibrate_noise_multiplier(1.0, DELTA, -0.1, 10), "sample_rate"),
    (lambda: gaussian_mechanism_epsilon(-0.5, DELTA), "noise_multiplier"),
    (lambda: gaussian_mechanism_epsilon(1.0, -DELTA), "delta"),
    (lambda: calibrate_gaussian_mechanism(0.0, DELTA), "target_epsilon"),
    (lambda: events.epsilon(events.PoissonGaussian(1.0, 0.03), DELTA, method="x"), "method"),
    (lambda: events.epsilon(events.PoissonGaussian(1.0, 0.03), 1.5), "delta"),
])
def test_bad_input_raises(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_discretisation_matches_prv_accountant():
    # dpl's float64 cell masses and truncated mean equal prv-accountant's CellCentred discretisation
    from prv_accountant import PoissonSubsampledGaussianMechanism, discretisers
    from prv_accountant.privacy_random_variables import PrivacyRandomVariableTruncated

    domain = prv._fft_friendly_domain(6.0, 2e-3)
    for sigma, q in [(1.0, 0.03), (0.7, 0.3), (2.0, 1.0)]:
        ours = prv._discretise(sigma, q, domain)
        tprv = PrivacyRandomVariableTruncated(PoissonSubsampledGaussianMechanism(q, sigma), domain.t_min(),
                                              domain.t_max())
        with np.errstate(all="ignore"):
            ref = discretisers.CellCentred().discretise(tprv, domain)
        np.testing.assert_allclose(ours.pmf, np.asarray(ref.pmf, dtype=np.float64), rtol=1e-6, atol=1e-14)
        assert ours.domain.shifts() == pytest.approx(float(ref.domain.shifts()), abs=1e-7)


def test_internal_rdp_bound_is_an_upper_bound_close_to_opacus():
    # the cheap integer-order RDP bound (used for the PRV domain and the calibration bracket) is a valid RDP
    # bound: it agrees with opacus' RDP at the same integer orders
    from opacus.accountants.analysis import rdp as opacus_rdp

    orders = rdp._INT_ORDERS[:40]
    for sigma, q in [(0.7, 0.01), (1.0, 0.03), (3.0, 0.5), (2.0, 1.0)]:
        ref = opacus_rdp.compute_rdp(q=q, noise_multiplier=sigma, steps=1, orders=list(orders))
        np.testing.assert_allclose(rdp._int_rdp_per_step(sigma, q)[:40], ref, rtol=1e-9)


# ----------------------------------------------------------------------------------------------------------
# the one sigma search, and epsilon for the current step


@pytest.mark.parametrize("power", [0.5, 1.0, 2.0, 6.0])
@pytest.mark.parametrize("target", [0.05, 1.0, 30.0])
def test_smallest_noise_multiplier_on_closed_forms(power, target):
    calls = []

    def epsilon_of(sigma: float) -> float:
        calls.append(sigma)
        return 3.0 / sigma ** power

    sigma = smallest_noise_multiplier(epsilon_of, target, tol=1e-3)
    assert target * (1 - 1e-3) <= epsilon_of(sigma) <= target
    assert len(calls) <= 16  # at most a factor 2 per step until bracketed: 12 steps to sigma = 3600
    # a proxy of the same shape off by a constant factor: the second evaluation lands in the window
    calls.clear()
    sigma = smallest_noise_multiplier(epsilon_of, target, tol=1e-3, proxy=lambda s: 5.0 / s ** power)
    assert target * (1 - 1e-3) <= 3.0 / sigma ** power <= target and len(calls) <= 3


def test_smallest_noise_multiplier_refuses_an_unreachable_target():
    with pytest.raises(ValueError, match="no sigma found"):
        smallest_noise_multiplier(lambda s: 2.0 + 1 / s, 1.0)
    with pytest.raises(ValueError, match="epsilon failed"):
        smallest_noise_multiplier(lambda s: math.log(-1.0), 1.0)


def test_epsilon_schedule_bounds_and_costs():
    calls = []

    def epsilon_of(n: int) -> float:
        calls.append(n)
        return math.sqrt(n) / 10

    schedule = EpsilonSchedule(epsilon_of, spacing=0.02)
    assert schedule(5000) == epsilon_of(5000)  # the first ask: exact, and no thread for a one-off question
    assert schedule._thread is None and len(calls) == 2
    values = [schedule(t) for t in range(1, 5001)]
    assert len(set(calls)) <= 300  # grid points (every count to 50, then 2% apart) and a few exact counts
    for t, value in zip(range(1, 5001), values):
        assert epsilon_of(t) <= value <= 1.011 * epsilon_of(t)
    assert values == sorted(values)


def _ledger(sigma: float, rate: float, steps: int):
    from dpl.core.ledger import PrivacyLedger, make_plan
    from dpl.core.mechanism import PoissonGaussian
    from dpl.core.privacy import PrivacyConfig

    population = round(64 / rate)
    privacy = PrivacyConfig(noise_multiplier=sigma, batch_size=64, target_delta=DELTA)
    return PrivacyLedger(privacy, make_plan(privacy, population=population, steps=steps), PoissonGaussian(rate))


def test_ledger_epsilon_is_exact_when_first_asked_and_an_upper_bound_per_step():
    ledger = _ledger(1.1, 0.03, 300)
    assert ledger.epsilon(300) == epsilon_for(1.1, 0.03, 300, DELTA)
    for t in (1, 2, 120, 121, 250, 300):
        exact = epsilon_for(1.1, 0.03, t, DELTA)
        assert exact <= ledger.epsilon(t) <= 1.026 * exact  # grid 5% apart
    import copy

    assert copy.deepcopy(ledger).epsilon(300) == epsilon_for(1.1, 0.03, 300, DELTA)


def test_ledger_epsilon_of_parts_exact_when_first_asked_and_bounded_per_step():
    from dpl.core.accounting import events

    ledger = _ledger(1.3, 0.05, 300)
    ledger.history = [(events.SelfComposed(events.PoissonGaussian(1.0, 0.03), 100), 100)]

    def exact(n: int) -> float:
        return prv._epsilon(accounting.common._canonical([(1.0, 0.03, 100), (1.3, 0.05, n)]), DELTA, "prv")

    assert ledger.epsilon(300) == exact(200)
    for n in (1, 2, 60, 61, 150, 200):
        assert exact(n) <= ledger.epsilon(100 + n) <= 1.026 * exact(n)
    assert ledger.epsilon(100) == epsilon_for(1.0, 0.03, 100, DELTA)
    ledger.noise_multiplier = 0.0
    assert ledger.epsilon(103) == math.inf
