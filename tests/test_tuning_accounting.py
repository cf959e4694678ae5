"""The privacy of private tuning (dpl.core.accounting.tuning) against the closed forms of Papernot & Steinke,
"Hyperparameter tuning with Rényi differential privacy" (ICLR 2022: Corollaries 3 and 4, Theorem 6 for pure DP and the
Gaussian mechanism), and against a brute-force evaluation of the Rényi divergence of the best-of-K output for a small
discrete mechanism, where every probability is computed exactly."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
from scipy.special import logsumexp
from scipy.stats import norm

from dpl.core.accounting import tuning
from dpl.core.accounting.rdp import _rdp_to_epsilon

# ------------------------------------------------------------------------------------------ distributions of K


@pytest.mark.parametrize("dist", [tuning.poisson(3.0), tuning.geometric(4.0), tuning.logarithmic(5.0),
                                  tuning.negative_binomial(6.0, 0.5), tuning.negative_binomial(4.0, -0.5),
                                  tuning.negative_binomial(3.0, 2.0)])
def test_pmf_sums_to_one_and_has_the_stated_mean(dist):
    p = dist.pmf_table(3000)
    assert p.sum() == pytest.approx(1.0, abs=1e-9)
    assert (p >= 0).all()
    assert float(np.dot(p, np.arange(3000))) == pytest.approx(dist.mean, rel=1e-7)
    assert [dist.pmf(k) for k in (0, 1, 7)] == [p[0], p[1], p[7]]


def test_the_special_cases_of_the_truncated_negative_binomial():
    geo = tuning.geometric(4.0)
    assert (geo.eta, geo.gamma, geo.mean) == (1.0, 0.25, pytest.approx(4.0))
    assert [geo.pmf(k) for k in (1, 2, 3)] == pytest.approx([0.25, 0.25 * 0.75, 0.25 * 0.75**2])
    log = tuning.logarithmic(5.0)
    gamma = log.gamma
    assert (1 / gamma - 1) / math.log(1 / gamma) == pytest.approx(5.0, rel=1e-9)
    assert log.pmf(3) == pytest.approx((1 - gamma) ** 3 / (3 * math.log(1 / gamma)))
    nb = tuning.negative_binomial(6.0, 0.5)  # Definition 1: (1-γ)^k / (γ^-η - 1) · Π_{l<k} (l+η)/(l+1)
    g = nb.gamma
    assert nb.pmf(3) == pytest.approx((1 - g) ** 3 / (g**-0.5 - 1) * (0.5 / 1) * (1.5 / 2) * (2.5 / 3))
    assert 0.5 * (1 - g) / (g * (1 - g**0.5)) == pytest.approx(6.0, rel=1e-9)
    assert tuning.poisson(2.0).pmf(0) == pytest.approx(math.exp(-2.0))


@pytest.mark.parametrize("dist", [tuning.poisson(3.0), tuning.geometric(4.0), tuning.logarithmic(5.0),
                                  tuning.negative_binomial(4.0, -0.5)])
def test_draws_of_k_follow_the_distribution(dist):
    """K is random with the stated law: the empirical mean of many draws is E[K] (a fixed K, or a K drawn from
    another law, fails), and the frequencies match the pmf."""
    rng = random.Random(1234)
    n = 20000
    draws = [dist.sample(rng.random) for _ in range(n)]
    var = float(np.dot(dist.pmf_table(3000), (np.arange(3000) - dist.mean) ** 2))
    assert abs(np.mean(draws) - dist.mean) < 4 * math.sqrt(var / n)
    assert len(set(draws)) > 3
    for k in range(0, 6):
        assert draws.count(k) / n == pytest.approx(dist.pmf(k), abs=0.015)


def test_the_default_draw_comes_from_os_entropy(monkeypatch):
    calls = []
    real = tuning.secrets.randbits
    monkeypatch.setattr(tuning.secrets, "randbits", lambda bits: calls.append(bits) or real(bits))
    tuning.geometric(3.0).sample()
    assert calls == [53]


@pytest.mark.parametrize("bad", [lambda: tuning.poisson(0.0), lambda: tuning.poisson(-1.0),
                                 lambda: tuning.geometric(1.0), lambda: tuning.logarithmic(0.5),
                                 lambda: tuning.negative_binomial(3.0, -1.0), lambda: tuning.poisson(float("nan")),
                                 lambda: tuning.poisson(1e6)])
def test_bad_parameters_are_refused(bad):
    with pytest.raises(ValueError):
        bad()


# ----------------------------------------------------------------------------------------- closed forms


@pytest.mark.parametrize("eta", [-0.5, 0.0, 0.5, 1.0, 2.0])
@pytest.mark.parametrize("eps", [0.1, 1.0])
def test_corollary_3_pure_dp(eta, eps):
    """An eps-DP trial (RDP eps at every order; a huge order stands for pure DP): (2 + eta) eps."""
    dist = tuning.negative_binomial(100.0, eta)
    out = tuning.negative_binomial_rdp(np.array([1e10]), np.array([eps]), dist.eta, dist.gamma)
    assert out[0] == pytest.approx((2 + eta) * eps, rel=1e-6)
    assert tuning.liu_talwar_epsilon(eps) == pytest.approx(3 * eps)  # eta = 1


@pytest.mark.parametrize("rho,mean,eta", [(0.01, 10.0, 0.0), (0.1, 5.0, 0.5), (1.0, 3.0, 1.0), (0.05, 50.0, -0.5),
                                          (0.3, 20.0, 2.0)])
def test_corollary_4_gaussian(rho, mean, eta):
    """A rho-zCDP trial (RDP rho lambda): eps'(lambda) = rho(lambda-1) + log E[K]/(lambda-1) + 2(1+eta)
    sqrt(rho log(1/gamma)) - eta rho beyond lambda = 1 + sqrt(log E[K]/rho), its minimum below (RDP is monotone)."""
    dist = tuning.negative_binomial(mean, eta)
    gamma = dist.gamma
    assert rho <= math.log(1 / gamma)
    knee = 1 + math.sqrt(math.log(dist.mean) / rho)
    orders = np.array(sorted({1.05, 1.5, 2.0, math.sqrt(math.log(1 / gamma) / rho), knee, knee + 0.5, 10.0, 40.0}))
    out = tuning.negative_binomial_rdp(orders, rho * orders, eta, gamma)
    const = 2 * (1 + eta) * math.sqrt(rho * math.log(1 / gamma)) - eta * rho
    for lam, value in zip(orders, out):
        x = max(lam, knee) - 1
        assert value == pytest.approx(rho * x + math.log(dist.mean) / x + const, rel=1e-9), lam


@pytest.mark.parametrize("eps,mu", [(1.0, 1.0), (0.1, 2.0), (1.0, 10.0), (2.0, 1000.0), (0.001, 100.0)])
def test_theorem_6_pure_dp(eps, mu):
    """eps-DP trial: at lambda = 1 + 1/(e^eps - 1), eps_hat = eps and delta_hat = 0, so eps' = RDP(lambda) +
    log(mu)(e^eps - 1); the trial is (lambda, min(eps, lambda eps^2/2))-RDP."""
    alpha = 1 + 1 / math.expm1(eps)
    orders = np.array([alpha, 1e10])
    rdp = np.minimum(eps, orders * eps**2 / 2)
    out = tuning.poisson_rdp(orders, rdp, mu, trial_delta=lambda e: 0.0 if e >= eps * (1 - 1e-12) else 1.0)
    assert out[0] == pytest.approx(min(eps, alpha * eps**2 / 2) + math.log(mu) * math.expm1(eps), rel=1e-9)


@pytest.mark.parametrize("sigma,mu", [(1.0, 1.0), (2.0, 10.0), (5.0, 100.0), (0.7, 3.0)])
def test_theorem_6_gaussian(sigma, mu):
    """The Gaussian mechanism, with its exact delta(eps) (Balle & Wang 2018): eps' = lambda/(2 sigma^2) + mu
    delta_hat + log(mu)/(lambda - 1) with eps_hat = log(1 + 1/(lambda - 1)), then the monotone envelope."""
    orders = tuning.ORDERS

    def delta(e: float) -> float:
        return norm.cdf(1 / (2 * sigma) - e * sigma) - math.exp(e) * norm.cdf(-1 / (2 * sigma) - e * sigma)

    out = tuning.poisson_rdp(orders, orders / (2 * sigma**2), mu, trial_delta=delta)
    direct = np.array([a / (2 * sigma**2) + mu * delta(math.log1p(1 / (a - 1))) + math.log(mu) / (a - 1)
                       for a in orders])
    assert np.allclose(out, np.minimum.accumulate(direct[::-1])[::-1], rtol=1e-12)
    # the default delta_hat, from the RDP curve itself, is an upper bound on the exact one: a looser, valid bound
    loose = tuning.poisson_rdp(orders, orders / (2 * sigma**2), mu)
    assert (loose >= out - 1e-12).all()


# -------------------------------------------------------------------------- brute force on a small mechanism

SCORES = np.arange(7)


def _discrete_gaussian(center: float, scale: float) -> np.ndarray:
    logits = -((SCORES - center) ** 2) / (2 * scale**2)
    return np.exp(logits - logsumexp(logits))


def _renyi(p: np.ndarray, q: np.ndarray, order: float) -> float:
    keep = p > 0
    return float(logsumexp(order * np.log(p[keep]) + (1 - order) * np.log(q[keep]))) / (order - 1)


def _symmetric_rdp(p: np.ndarray, q: np.ndarray, orders: np.ndarray) -> np.ndarray:
    return np.array([max(_renyi(p, q, a), _renyi(q, p, a)) for a in orders])


def _exact_delta(p: np.ndarray, q: np.ndarray, eps: float) -> float:
    return max(float(np.maximum(0, p - math.exp(eps) * q).sum()), float(np.maximum(0, q - math.exp(eps) * p).sum()))


def _best_of_k(p: np.ndarray, dist: tuning.TrialDistribution) -> np.ndarray:
    """The exact law of the best score of K runs (and, for Poisson, of 'nothing' when K = 0, as the last entry)."""
    return _best_of(p, dist.pmf_table(4000), with_nothing=dist.kind == "poisson")


def _best_of(p: np.ndarray, weights: np.ndarray, with_nothing: bool) -> np.ndarray:
    cdf = np.cumsum(p)
    ks = np.arange(len(weights)).astype(float)
    below = np.array([float(np.dot(weights, c**ks)) for c in cdf])  # P[best <= y or K = 0]
    law = np.diff(np.concatenate([[weights[0]], below]))
    return np.append(law, weights[0]) if with_nothing else law


BRUTE_ORDERS = np.array([a for a in tuning.ORDERS if a <= 30])
CASES = [(0.5, tuning.poisson(2.0)), (1.0, tuning.poisson(8.0)), (2.0, tuning.poisson(3.0)),
         (0.5, tuning.geometric(3.0)), (1.0, tuning.logarithmic(10.0)), (1.0, tuning.negative_binomial(5.0, -0.5)),
         (1.0, tuning.negative_binomial(4.0, 2.0))]


IDS = [f"{s}-{d.describe()['distribution']}-{d.mean:.0f}" for s, d in CASES]


@pytest.mark.parametrize("scale,dist", CASES, ids=IDS)
def test_the_bound_holds_on_a_small_mechanism_computed_exactly(scale, dist):
    """A trial outputs a score in 0..6 (a discretised Gaussian centred at 2.5, or at 3.5 on the neighbouring data);
    the best of K outputs has a law computed exactly from the pmf of K. Its Rényi divergence, both ways, stays below
    the theorem's bound at every order; it exceeds one trial's RDP at some order (reporting one trial's epsilon would
    be wrong), and the bound is not vacuous (within a factor of the truth somewhere)."""
    p, q = _discrete_gaussian(2.5, scale), _discrete_gaussian(3.5, scale)
    trial = _symmetric_rdp(p, q, BRUTE_ORDERS)
    if dist.kind == "poisson":
        bound = tuning.poisson_rdp(BRUTE_ORDERS, trial, dist.mu, trial_delta=lambda e: _exact_delta(p, q, e))
        default = tuning.poisson_rdp(BRUTE_ORDERS, trial, dist.mu)
        assert (default >= bound - 1e-12).all()
    else:
        bound = tuning.negative_binomial_rdp(BRUTE_ORDERS, trial, dist.eta, dist.gamma)
    tuned = _symmetric_rdp(_best_of_k(p, dist), _best_of_k(q, dist), BRUTE_ORDERS)
    assert (tuned <= bound + 1e-9).all(), np.max(tuned - bound)
    assert (tuned > trial + 1e-6).any()
    assert (bound < 10 * tuned).any()


def test_the_best_of_k_law_is_right():
    """The brute-force law itself: it sums to one, and for K = 1 always it is the trial's law."""
    p = _discrete_gaussian(2.5, 1.0)
    law = _best_of_k(p, tuning.poisson(2.0))
    assert law.sum() == pytest.approx(1.0) and law[-1] == pytest.approx(math.exp(-2.0))
    assert np.allclose(_best_of(p, np.array([0.0, 1.0]), with_nothing=False), p)  # K = 1
    two = _best_of(p, np.array([0.0, 0.0, 1.0]), with_nothing=False)  # K = 2: P[max = y] = F(y)^2 - F(y-1)^2
    assert two[3] == pytest.approx(p[:4].sum() ** 2 - p[:3].sum() ** 2)


# ------------------------------------------------------------------------------- a DP-SGD trial's release


def test_a_dp_sgd_trial_curve_is_opacus_composed():
    from opacus.accountants.analysis import rdp as opacus_rdp

    curve = tuning.subsampled_gaussian_rdp([(1.1, 0.01, 500)])
    frac = [i for i, a in enumerate(tuning.ORDERS) if a in tuning.FRACTIONAL_ORDERS]
    want = opacus_rdp.compute_rdp(q=0.01, noise_multiplier=1.1, steps=500, orders=list(tuning.ORDERS[frac]))
    assert np.all(curve[frac] <= np.asarray(want) * (1 + 1e-9))
    assert np.allclose(curve[frac], want, rtol=1e-6)
    assert (np.diff(curve) >= -1e-12).all()  # RDP grows with the order


@pytest.mark.parametrize("dist", [tuning.poisson(5.0), tuning.geometric(5.0), tuning.logarithmic(5.0),
                                  tuning.negative_binomial(5.0, -0.5)])
def test_the_tuned_release_costs_more_than_one_trial_and_is_not_a_fixed_composition(dist):
    curve = tuning.subsampled_gaussian_rdp([(0.9, 0.01, 400)])
    delta = 1e-5
    one = _rdp_to_epsilon(tuning.ORDERS, curve, delta)
    tuned = tuning.tuned_epsilon(dist, tuning.ORDERS, curve, delta)
    assert tuned > one * 1.05
    fixed = [tuning.fixed_trials_epsilon(tuning.ORDERS, curve, k, delta) for k in (4, 5, 6)]
    assert all(abs(tuned - f) > 0.01 for f in fixed)
    # many trials: the random-K bound grows like log E[K], the composition faster
    many = tuning.tuned_epsilon(type(dist)(**{**dist.__dict__, **_mean(dist, 100.0)}), tuning.ORDERS, curve, delta)
    assert many < 0.7 * tuning.fixed_trials_epsilon(tuning.ORDERS, curve, 100, delta)


def _mean(dist: tuning.TrialDistribution, mean: float) -> dict:
    if dist.kind == "poisson":
        return {"mu": mean}
    return {"gamma": tuning.negative_binomial(mean, dist.eta).gamma}


def test_a_fixed_number_of_trials_is_their_composition():
    dist = tuning.fixed(3)
    assert dist.sample() == 3 and dist.mean == 3 and dist.pmf(3) == 1.0 and dist.pmf(2) == 0.0
    curve = tuning.subsampled_gaussian_rdp([(0.9, 0.01, 400)])
    assert tuning.tuned_epsilon(dist, tuning.ORDERS, curve, 1e-5) == pytest.approx(
        _rdp_to_epsilon(tuning.ORDERS, 3 * curve, 1e-5))
    with pytest.raises(ValueError):
        tuning.fixed(2.5)


def test_liu_talwar_refuses_approximate_dp_trials():
    with pytest.raises(ValueError, match="pure DP"):
        tuning.liu_talwar_epsilon(1.0, 1e-5)


# ------------------------------------------------------------------- a search over the batch size and the steps
# Two configurations calibrated to the same per-trial epsilon whose RDP curves cross: few steps at a large sampling
# rate (larger at high orders) and many steps at a small one (larger at low orders). The tuned bound must take, order
# by order, the larger of the two: either curve alone (the kept trial's, or the drawn configurations' when only one of
# them was drawn) gives a smaller epsilon.
DELTA = 1e-5
SPACE = [(0.5, 4), (0.01, 3000)]  # (sampling rate, steps)


def _plans(target: float = 3.0, space=SPACE) -> list[dict]:
    from dpl.core.mechanism import PoissonGaussian, calibrate

    return [{"config": {"model.privacy.batch_size": str(i)}, "sampling_rate": q, "steps": steps, "delta": DELTA,
             "accountant": "prv", "mechanism": "gaussian", "sampling": "poisson", "unit": "example",
             "adjacency": "add_remove", "num_examples": 1000, "epsilon": target,
             "noise_multiplier": calibrate(PoissonGaussian(q, "prv"), target, DELTA, steps)} for i, (q, steps) in
            enumerate(space)]


@pytest.mark.parametrize("dist", [tuning.poisson(3.0), tuning.geometric(3.0), tuning.fixed(3)])
def test_the_bound_of_a_space_is_the_largest_curve_of_all_its_configurations(dist):
    from dpl.tune import plans

    space = _plans()
    curves = [tuning.subsampled_gaussian_rdp([(p["noise_multiplier"], p["sampling_rate"], p["steps"])])
              for p in space]
    assert (curves[0] > curves[1]).any() and (curves[1] > curves[0]).any()  # they cross
    largest = np.maximum(curves[0], curves[1])
    want = (tuning.fixed_trials_epsilon(tuning.ORDERS, largest, 3, DELTA) if dist.kind == "fixed" else
            tuning.tuned_epsilon(dist, tuning.ORDERS, largest, DELTA))
    got = plans.tuned_epsilon(space, dist, DELTA)
    assert got == pytest.approx(want, rel=1e-12)
    alone = [plans.tuned_epsilon([p], dist, DELTA) for p in space]  # the kept trial's curve, or only the drawn ones
    assert all(got >= a for a in alone)
    assert got > max(alone) * 1.005  # where the curves cross, either alone would understate the search's epsilon


def test_one_accounting_composes_by_its_own_accountant():
    from dpl.core.accounting import epsilon_for
    from dpl.tune import plans

    (plan,) = _plans(space=SPACE[:1])
    assert plans.composed_epsilon([plan, {**plan, "config": {}}], 3, DELTA) == pytest.approx(
        epsilon_for(plan["noise_multiplier"], plan["sampling_rate"], 3 * plan["steps"], DELTA))


def test_a_trial_unlike_its_plan_is_named():
    from dpl.tune import plans

    plan = _plans()[0]
    report = {"noise_multiplier": plan["noise_multiplier"], "sampling_rate": plan["sampling_rate"],
              "steps_planned": plan["steps"], "steps_taken": plan["steps"], "delta": DELTA}
    assert plans.mismatch(plan, report) is None
    assert "noise_multiplier" in plans.mismatch(plan, {**report, "noise_multiplier": plan["noise_multiplier"] * 0.99})
    assert "sampling_rate" in plans.mismatch(plan, {**report, "sampling_rate": 0.25})
    assert "steps" in plans.mismatch(plan, {**report, "steps_taken": plan["steps"] + 1})


@pytest.fixture
def planner(monkeypatch):
    """The planner's answer for :data:`SPACE` without a model: sigma calibrated by the mechanism, as dpl fit does."""
    from dpl.tune import plans

    calls = []

    def plan_configuration(fit_args, config, target=None):
        calls.append(target)
        i = int(config["model.privacy.batch_size"])
        return _plans(3.0 if target is None else target)[i]

    monkeypatch.setattr(plans, "plan_configuration", plan_configuration)
    return calls


@pytest.mark.parametrize("dist,total", [(tuning.poisson(3.0), 2.0), (tuning.geometric(4.0), 8.0),
                                        (tuning.fixed(3), 4.0)])
def test_the_total_epsilon_solve_meets_the_total_within_one_percent(planner, dist, total):
    from dpl.tune import plans, search

    space = search.parse_search(["batch_size=0,1", "lr=0.1,0.2"])
    target, planned, tuned = plans.solve_total([], space, dist, total)
    assert [p["config"] for p in planned] == [{"model.privacy.batch_size": "0"}, {"model.privacy.batch_size": "1"}]
    assert planner[-2:] == [target, target]  # the answer is planned again, for every configuration
    recomputed = plans.tuned_epsilon(_plans(target), dist, DELTA)
    assert tuned == pytest.approx(recomputed, rel=1e-12)
    assert total * 0.99 <= tuned <= total
    assert target < total if dist.kind != "poisson" else target > 0


def test_a_total_epsilon_nothing_can_meet_is_one_line(planner):
    from dpl.errors import ConfigError
    from dpl.tune import plans, search

    with pytest.raises(ConfigError, match="cannot be met") as info:
        plans.solve_total([], search.parse_search(["batch_size=0,1"]), tuning.poisson(50.0), 0.01)
    assert "\n" not in str(info.value)
