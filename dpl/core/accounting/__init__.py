"""Privacy accounting for the Poisson-subsampled Gaussian mechanism and for one Gaussian mechanism.

Adjacency is **add/remove one example** throughout (what opacus and prv-accountant assume). A step releases
the sum of clipped per-example contributions (sensitivity C) plus N(0, sigma^2 C^2) noise, each example being
in the batch independently with probability ``sample_rate`` (Poisson sampling); ``sample_rate == 1`` is the
plain Gaussian mechanism composed ``steps`` times.

Methods
-------
``"prv"`` (default)
    Numerical composition of privacy random variables (PRVs; Gopi, Lee & Wutschitz, NeurIPS 2021), the
    algorithm of ``prv_accountant.PRVAccountant`` with its ``Domain`` and ``Heterogeneous`` (FFT) composer.
    The value returned is the **upper** bound: epsilon at ``delta - delta_error`` plus ``eps_error``, so it
    is conservative. Errors: ``delta_error = delta / 1000`` (prv-accountant's choice) and ``eps_error`` =
    :func:`prv_error_for` of a cheap RDP bound, i.e. 0.5 % of an upper bound on epsilon (at least 1e-3);
    the grid mesh is the one Theorem 5.5 of the paper requires for that ``eps_error``. So the bound is ~0.5 %
    above the PRV estimate, which matches prv-accountant's estimate to ~1e-5 (the tests check it).
    Where prv-accountant is slow (~0.5-1 s an evaluation for q=0.03, T=400, mostly Python loops), dpl
    computes the same quantities faster (~30 ms for q=0.03, T=400; ~90 ms for q=0.01, T=3000, on 2 busy
    cores). The accountant's ``epsilon`` costs one such evaluation when the history changed:

    * safe domain size (the paper's remark 5.6, ``compute_safe_domain_size``) from a vectorised RDP bound on
      integer orders (_INT_ORDERS) instead of a Python loop over fractional orders; any valid RDP bound
      gives a valid (at most slightly larger) domain;
    * the PRV's cdf (that of ``PoissonSubsampledGaussianMechanism``) in float64, once per cell edge, with
      the survival function for cells right of 0 (no cancellation) instead of long double cdf differences;
    * the mean of the truncated PRV, which makes the cell-centred discretisation mean-preserving, by
      Gauss-Legendre quadrature in the Gaussian output space instead of ``scipy.quad`` on the cdf;
    * the grid widened to an FFT-friendly (5-smooth) length, with the same [-k h, (k+1) h] layout;
    * epsilon read off the composed PRV in float64 (``compute_epsilon``'s formula, which uses long double).

    Results are cached (``functools.lru_cache``) by (merged history, delta, eps_error). Where the grid would
    exceed ``MAX_GRID_POINTS`` points, the mesh is coarsened and ``eps_error`` grows to what that mesh
    guarantees: looser, still an upper bound.
``"rdp"``
    Renyi DP with opacus' ``compute_rdp`` / ``get_privacy_spent`` on ``RDPAccountant``'s default orders:
    an upper bound, looser than PRV (10-30 % in epsilon, more for small epsilon). PRV falls back to it, with a
    logged warning, where PRV raises or returns inf/nan.

Modules, one job each
---------------------
:mod:`~dpl.core.accounting.prv` (PRV, :func:`epsilon_for`), :mod:`~dpl.core.accounting.rdp` (RDP bounds),
:mod:`~dpl.core.accounting.gaussian` (one Gaussian mechanism, exactly: Balle & Wang 2018),
:mod:`~dpl.core.accounting.calibration` (:func:`smallest_noise_multiplier`, the one sigma search every calibration
uses), :mod:`~dpl.core.accounting.events` (the events mechanisms declare, their composition - every epsilon dpl
reports is one - and :func:`~dpl.core.accounting.events.calibrate`; :func:`calibrate_noise_multiplier`),
:mod:`~dpl.core.accounting.schedule`
(:class:`EpsilonSchedule`, epsilon for the current step computed ahead, off the training loop),
:mod:`~dpl.core.accounting.users` (user-level DP of example-level sampling, :func:`els_epsilon`,
:func:`els_calibrate`; :func:`group_privacy`), :mod:`~dpl.core.accounting.tuning` (the best of a random number of
private runs: Papernot & Steinke's Theorems 2 and 6, for ``dpl tune``),
:mod:`~dpl.core.accounting.common` (error settings and argument checks).
"""

from dpl.core.accounting.calibration import smallest_noise_multiplier
from dpl.core.accounting.events import calibrate_noise_multiplier
from dpl.core.accounting.common import METHODS, REL_EPS_ERROR, Segment
from dpl.core.accounting.gaussian import calibrate_gaussian_mechanism, gaussian_mechanism_epsilon
from dpl.core.accounting.prv import epsilon_for, prv_error_for
from dpl.core.accounting.schedule import EpsilonSchedule
from dpl.core.accounting.users import els_calibrate, els_epsilon, group_privacy

__all__ = [
    "METHODS",
    "REL_EPS_ERROR",
    "EpsilonSchedule",
    "Segment",
    "calibrate_gaussian_mechanism",
    "calibrate_noise_multiplier",
    "els_calibrate",
    "els_epsilon",
    "epsilon_for",
    "gaussian_mechanism_epsilon",
    "group_privacy",
    "prv_error_for",
    "smallest_noise_multiplier",
]
