"""Noise-correlation strategies of ``ftrl``: the coefficients, their sensitivity and their expected error.

Every strategy here is a lower-triangular **Toeplitz** matrix C (T x T) given by its first column
c = (c_0, c_1, ..., c_{T-1}), c_0 = 1. The release at step t is

    g~_t = (sum_i clip(g_i) + sigma * C_clip * sens * (C^-1 Z)_t) / B,     Z i.i.d. N(0, I)

i.e. the post-processing C^-1 (C X + sigma * sens * Z) of one Gaussian mechanism on C X with sensitivity
``sens`` (per unit clipping norm). C^-1 is Toeplitz too, with first column beta (the *noising* coefficients:
the beta of Choquette-Choo et al. (ICLR 2024) are these, their "strategy" is the inverse c -- mind the naming).

Participation: fixed-size batches from one secret shuffled order, the same every epoch, so every example takes
part in steps i, i + b, i + 2b, ... (b = steps per epoch), at most k = ceil(T / b) times. For such a pattern the
contribution of one example to C X is the sum of the columns of C at its steps; for Toeplitz C the column at
step s is c shifted down by s, so the pattern starting at i is the pattern starting at 0 shifted down by i and
truncated: offset 0 is the worst case, whatever the signs of c. With c >= 0 (every strategy here) all columns
have non-negative inner products, so the worst gradients are identical unit vectors, and

    sens^2 = || sum_{j<k} shift(c, j b) ||^2        (exact; the design note's formula).

Amplified banded (cyclic Poisson sampling, ``mechanism.py``) accounts each participation as its own subsampled
Gaussian step, so its sensitivity is the largest column norm ||c|| of the b-banded C: that is this formula with one
participation (``every = steps``), and the same fit with ``every = steps`` minimises its objective.

The first t rows of C only see the participations before t, so the sensitivity of the first t releases is the
norm of the first t entries of that vector (``sens_prefix``): epsilon after t steps is that of a Gaussian
mechanism with noise multiplier sigma * sens_T / sens_t.

Expected error (logged, and the objective the ``banded`` and ``blt`` fits minimise): the noise the run adds to
the *parameters* of SGD is (learning rate x) the prefix sums of the gradient noise, A C^-1 Z with A the
lower-triangular ones; its per-coordinate variance at step t, in units of (sigma C_clip)^2, is
sens^2 * sum_{s<=t} gamma_s^2 with gamma = cumsum(beta). ``expected_error`` is the root of its mean over the T
steps (the "mean prefix-sum error" of the matrix-factorization literature). DP-SGD without amplification
(C = I) has sens^2 = k and gives sqrt(k (T + 1) / 2).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.polynomial import polynomial as P
from scipy import optimize, signal

FAMILIES = ("nu_ftrl", "banded", "blt", "independent")


# ----------------------------------------------------------------------------------------------------------
# nu-DP-FTRL closed form


def nu_strategy_coefficients(n: int, nu: float) -> np.ndarray:
    """First column of the strategy C of nu-DP-FTRL: c_0 = 1, c_t = c_{t-1} (1 - 1/(2t)) (1 - nu).

    Generating function (1 - (1 - nu) x)^(-1/2); positive and non-increasing."""
    t = np.arange(1, n, dtype=np.float64)
    return np.concatenate([[1.0], np.cumprod((1.0 - 0.5 / t) * (1.0 - nu))])


def nu_noising_coefficients(n: int, nu: float) -> np.ndarray:
    """First column of C^-1 (the paper's beta): beta_0 = 1, beta_t = beta_{t-1} (t - 3/2) / t (1 - nu).

    Generating function (1 - (1 - nu) x)^(1/2); sum over all t is sqrt(nu)."""
    t = np.arange(1, n, dtype=np.float64)
    return np.concatenate([[1.0], np.cumprod((t - 1.5) / t * (1.0 - nu))])


def default_nu(steps: int) -> float:
    """The default nu of ``nu_ftrl``: 1 / T for a run of T steps (see plugins/ftrl/README.md)."""
    return 1.0 / max(int(steps), 1)


# ----------------------------------------------------------------------------------------------------------
# sensitivity and error of any Toeplitz strategy


def participation_vector(c: np.ndarray, every: int) -> np.ndarray:
    """sum_{j} shift(c, j * every) over the participations 0, every, 2 every, ... < len(c)."""
    n = len(c)
    u = np.zeros(n, dtype=np.float64)
    for start in range(0, n, max(int(every), 1)):
        u[start:] += c[:n - start]
    return u


def sensitivity_prefix(c: np.ndarray, every: int) -> np.ndarray:
    """sens_t for t = 1..T (entry t-1): sensitivity of the first t releases under the b-periodic pattern."""
    if np.any(c < 0):
        raise ValueError("sensitivity formula needs non-negative strategy coefficients")
    u = participation_vector(np.asarray(c, dtype=np.float64), every)
    return np.sqrt(np.cumsum(u * u))


def toeplitz_inverse(c: np.ndarray) -> np.ndarray:
    """First column of C^-1 for a lower-triangular Toeplitz C with first column c (c_0 != 0): the power series
    1 / c(x) to len(c) terms (an IIR filter with denominator c, applied to an impulse)."""
    c = np.asarray(c, dtype=np.float64)
    last = int(np.flatnonzero(c)[-1]) + 1 if np.any(c) else 1
    impulse = np.zeros(len(c))
    impulse[0] = 1.0
    return signal.lfilter([1.0], c[:last], impulse)


def expected_error(beta: np.ndarray, sens: float) -> float:
    """sqrt(sens^2 * mean_t sum_{s<=t} gamma_s^2), gamma = cumsum(beta): RMS over the steps of the per-coordinate
    std of the noise in the prefix sums, in units of sigma * C_clip (see the module docstring)."""
    n = len(beta)
    gamma = np.cumsum(beta)
    weights = np.arange(n, 0, -1, dtype=np.float64)
    return float(math.sqrt(sens * sens * float(np.dot(weights, gamma * gamma)) / n))


# ----------------------------------------------------------------------------------------------------------
# buffered linear Toeplitz (BLT)


def blt_polynomials(omega: np.ndarray, theta: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """c(x) = 1 + x sum_j omega_j / (1 - theta_j x) = N(x) / D(x); returns (N, D), increasing powers."""
    omega, theta = np.asarray(omega, dtype=np.float64), np.asarray(theta, dtype=np.float64)
    den = np.array([1.0])
    for th in theta:
        den = P.polymul(den, [1.0, -th])
    num = den.copy()  # N has degree nbuf, like D
    for j, (om, th) in enumerate(zip(omega, theta)):
        others = np.array([1.0])
        for i, th_i in enumerate(theta):
            if i != j:
                others = P.polymul(others, [1.0, -th_i])
        term = om * np.concatenate([[0.0], others])  # x * omega_j * prod_{i != j} (1 - theta_i x)
        num[:len(term)] += term
    return num, den


def blt_coefficients(omega: np.ndarray, theta: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(c, beta): first columns of the BLT strategy C and of C^-1, n terms each."""
    num, den = blt_polynomials(omega, theta)
    impulse = np.zeros(n)
    impulse[0] = 1.0
    return signal.lfilter(num, den, impulse), signal.lfilter(den, num, impulse)


def blt_inverse_parameters(omega: np.ndarray, theta: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(omega_hat, theta_hat) with C^-1 = I + sum_j omega_hat_j * Toeplitz(0, 1, theta_hat_j, theta_hat_j^2, ...):
    the inverse of a BLT is a BLT with as many buffers (partial fractions of D(x) / N(x)). May be complex for
    arbitrary parameters; real for the fitted ones (omega > 0, 0 <= theta < 1)."""
    num, den = blt_polynomials(omega, theta)
    # N(x) = prod_j (1 - theta_hat_j x): theta_hat_j are the roots of the reversed polynomial x^m N(1/x).
    theta_hat = np.roots(num)  # np.roots takes decreasing powers: num reversed is the reversed polynomial's
    numer = P.polysub(den, num)  # D - N = -x * sum_j omega_j prod_{i != j}(1 - theta_i x)
    numer = numer[1:]  # divide by x
    omega_hat = []
    for j, th in enumerate(theta_hat):
        x = 1.0 / th
        others = np.prod([1.0 - t / th for i, t in enumerate(theta_hat) if i != j]) if len(theta_hat) > 1 else 1.0
        omega_hat.append(P.polyval(x, numer) / others)
    omega_hat, theta_hat = np.asarray(omega_hat), np.asarray(theta_hat)
    if np.all(np.abs(omega_hat.imag) < 1e-12) and np.all(np.abs(theta_hat.imag) < 1e-12):
        omega_hat, theta_hat = omega_hat.real, theta_hat.real
    return omega_hat, theta_hat


def blt_toeplitz_coefficients(omega: np.ndarray, theta: np.ndarray, n: int) -> np.ndarray:
    """First column of I + sum_j omega_j Toeplitz(0, 1, theta_j, theta_j^2, ...), n terms, directly."""
    t = np.arange(n - 1, dtype=np.float64)
    col = np.zeros(n, dtype=np.result_type(np.asarray(omega), np.asarray(theta), np.float64))
    col[0] = 1.0
    for om, th in zip(omega, theta):
        col[1:] += om * np.power(th, t)
    return col


# ----------------------------------------------------------------------------------------------------------
# the strategy object


@dataclass
class Strategy:
    """Everything public about a fitted strategy for a run of ``steps`` steps with participations every
    ``every`` steps: its coefficients, sensitivity and expected error."""

    family: str
    steps: int
    every: int
    c: np.ndarray
    beta: np.ndarray
    params: dict[str, Any] = field(default_factory=dict)
    fit_seconds: float = 0.0

    def __post_init__(self) -> None:
        self.c = np.asarray(self.c, dtype=np.float64)
        self.beta = np.asarray(self.beta, dtype=np.float64)
        self.sens_prefix = sensitivity_prefix(self.c, self.every)
        self.noise_var_prefix = np.cumsum(self.beta * self.beta)  # Var of (C^-1 Z)_t, t = 0..T-1

    @property
    def participations(self) -> int:
        return -(-self.steps // self.every)

    @property
    def sensitivity(self) -> float:
        return float(self.sens_prefix[-1])

    @property
    def expected_error(self) -> float:
        return expected_error(self.beta, self.sensitivity)

    def marginal_std(self, step: int) -> float:
        """Std of one coordinate of (C^-1 Z)_step (0-based)."""
        return float(math.sqrt(self.noise_var_prefix[step]))

    def describe(self) -> str:
        shown = ", ".join(f"{k}={_fmt(v)}" for k, v in self.params.items())
        return (f"{self.family} ({shown}) for T={self.steps}, participations every b={self.every} steps "
                f"(k={self.participations}): sensitivity {self.sensitivity:.4f}, expected prefix-sum error "
                f"{self.expected_error:.4g} sigma*C (independent noise: {independent_error(self.steps, self.every):.4g})")


def _fmt(v: Any) -> str:
    if isinstance(v, (list, tuple, np.ndarray)):
        return "[" + ", ".join(_fmt(x) for x in v) + "]"
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)


def independent_error(steps: int, every: int) -> float:
    k = -(-steps // every)
    return math.sqrt(k * (steps + 1) / 2)


# ----------------------------------------------------------------------------------------------------------
# fits


def _loss(c: np.ndarray, beta: np.ndarray, every: int) -> float:
    if not (np.all(np.isfinite(beta)) and np.all(np.isfinite(c))) or np.any(c < 0):
        return 1e300
    u = participation_vector(c, every)
    sens2 = float(np.dot(u, u))
    n = len(beta)
    gamma = np.cumsum(beta)
    with np.errstate(over="ignore", invalid="ignore"):  # an exploding candidate scores inf: rejected below
        value = sens2 * float(np.dot(np.arange(n, 0, -1, dtype=np.float64), gamma * gamma)) / n
    return value if math.isfinite(value) else 1e300


def fit_banded(steps: int, every: int, bands: int, init_nu: float) -> tuple[np.ndarray, float]:
    """Banded Toeplitz c_0 = 1, c_1..c_{bands-1} >= 0 minimising the expected error for this run length and
    participation pattern (L-BFGS-B from the truncated nu-DP-FTRL coefficients). Returns (bands coefficients,
    loss)."""
    start = nu_strategy_coefficients(bands, init_nu)[1:]
    if bands == 1:
        return np.array([1.0]), 0.0
    impulse = np.zeros(steps)
    impulse[0] = 1.0

    def loss(x: np.ndarray) -> float:
        c_band = np.concatenate([[1.0], x])
        c = np.zeros(steps)
        c[:min(bands, steps)] = c_band[:steps]
        beta = signal.lfilter([1.0], c_band, impulse)
        return math.log(_loss(c, beta, every))

    res = optimize.minimize(loss, start, method="L-BFGS-B", bounds=[(0.0, 4.0)] * (bands - 1),
                            options={"maxiter": 500})
    best = res.x if res.fun <= loss(start) else start
    return np.concatenate([[1.0], best]), float(math.exp(min(res.fun, loss(start))))


BLT_TOLERANCE = 0.01  # a BLT with fewer buffers is kept if its expected error is within 1% of the best fit's


def _blt_strategy(steps: int, every: int, nbuf: int, nu: float) -> Strategy:
    omega, theta, _ = fit_blt(steps, every, nbuf, nu)
    c, beta = blt_coefficients(omega, theta, steps)
    return Strategy("blt", steps, every, c, beta, {"nbuf": nbuf, "omega": omega.tolist(), "theta": theta.tolist()})


def _fewest_buffers(fits: list[Strategy]) -> Strategy:
    """The BLT with the fewest buffers whose expected error is within ``BLT_TOLERANCE`` of the best of ``fits``
    (one fit per buffer count 1..nbuf: each buffer is a model-size vector read and written every step, and a fit
    with more buffers can end in a worse local optimum than one with fewer)."""
    best = min(f.expected_error for f in fits)
    return next(f for f in fits if f.expected_error <= best * (1 + BLT_TOLERANCE))


def fit_blt(steps: int, every: int, nbuf: int, init_nu: float) -> tuple[np.ndarray, np.ndarray, float]:
    """BLT parameters (omega > 0, 0 < theta < 1) minimising the expected error for this run length and
    participation pattern. Start: theta on log-spaced time scales 2..T, omega the non-negative least-squares fit
    of the nu-DP-FTRL coefficients; then L-BFGS-B on (logit theta, log omega). Returns (omega, theta, loss)."""
    taus = np.geomspace(2.0, max(float(steps), 3.0), nbuf)
    theta0 = 1.0 - 1.0 / taus
    target = nu_strategy_coefficients(steps, init_nu)[1:]
    basis = np.stack([np.power(th, np.arange(steps - 1, dtype=np.float64)) for th in theta0], axis=1)
    omega0, _ = optimize.nnls(basis, target) if steps > 1 else (np.full(nbuf, 0.1), None)
    omega0 = np.maximum(omega0, 1e-4)

    def unpack(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return np.exp(x[nbuf:]), 1.0 / (1.0 + np.exp(-x[:nbuf]))

    def loss(x: np.ndarray) -> float:
        omega, theta = unpack(x)
        c, beta = blt_coefficients(omega, theta, steps)
        return math.log(_loss(c, beta, every))

    x0 = np.concatenate([np.log(theta0 / (1 - theta0)), np.log(omega0)])
    bounds = [(-12.0, 14.0)] * nbuf + [(-14.0, 3.0)] * nbuf
    res = optimize.minimize(loss, x0, method="L-BFGS-B", bounds=bounds, options={"maxiter": 400})
    x = res.x if res.fun <= loss(x0) else x0
    omega, theta = unpack(x)
    order = np.argsort(theta)
    return omega[order], theta[order], float(math.exp(loss(x)))


def make_strategy(family: str, steps: int, every: int, nu: float | None = None, bands: int = 4,
                  banded_coefficients: str = "optimized", nbuf: int = 4) -> Strategy:
    """Build the strategy of ``family`` for a run of ``steps`` steps with participations every ``every`` steps."""
    import time

    start = time.perf_counter()
    nu_value = default_nu(steps) if nu is None else float(nu)
    if family == "independent":
        c = np.zeros(steps)
        c[0] = 1.0
        strat = Strategy(family, steps, every, c, c.copy(), {})
    elif family == "nu_ftrl":
        strat = Strategy(family, steps, every, nu_strategy_coefficients(steps, nu_value),
                         nu_noising_coefficients(steps, nu_value), {"nu": nu_value})
    elif family == "banded":
        if banded_coefficients == "truncated":
            band = nu_strategy_coefficients(bands, nu_value)
            band = band / band[0]
        else:
            band, _ = fit_banded(steps, every, bands, nu_value)
        c = np.zeros(steps)
        c[:min(bands, steps)] = band[:steps]
        strat = Strategy(family, steps, every, c, toeplitz_inverse(c),
                         {"bands": bands, "coefficients": banded_coefficients, "c": band.tolist()})
    elif family == "blt":
        strat = _fewest_buffers([_blt_strategy(steps, every, n, nu_value) for n in range(1, nbuf + 1)])
    else:
        raise ValueError(f"unknown noise family {family!r}")
    strat.fit_seconds = time.perf_counter() - start
    return strat


def strategy_from_params(family: str, steps: int, every: int, params: dict[str, Any]) -> Strategy:
    """Rebuild a strategy from its public parameters (a checkpoint's)."""
    if family == "independent":
        return make_strategy(family, steps, every)
    if family == "nu_ftrl":
        return make_strategy(family, steps, every, nu=params["nu"])
    if family == "banded":
        band = np.asarray(params["c"], dtype=np.float64)
        c = np.zeros(steps)
        c[:min(len(band), steps)] = band[:steps]
        return Strategy(family, steps, every, c, toeplitz_inverse(c), dict(params))
    if family == "blt":
        omega, theta = np.asarray(params["omega"]), np.asarray(params["theta"])
        c, beta = blt_coefficients(omega, theta, steps)
        return Strategy(family, steps, every, c, beta, dict(params))
    raise ValueError(f"unknown noise family {family!r}")
