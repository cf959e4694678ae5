"""``dpl tune``: private hyperparameter tuning that pays for its search (Papernot & Steinke, "Hyperparameter tuning
with Rényi differential privacy", ICLR 2022).

A secret number K of trials is drawn (Poisson or truncated negative binomial), each trial is a full private
``dpl fit`` with a configuration drawn uniformly from the search space, scored on the validation split; only the best
trial's run is kept, and its privacy report states the epsilon of the whole search.

Modules, one job each: :mod:`~dpl.tune.search` (the search space), :mod:`~dpl.tune.plans` (the plans of the
space's configurations, made before any trial, and the bound from their largest RDP curve), :mod:`~dpl.tune.state`
(the secret sidecar that makes a tuning resumable), :mod:`~dpl.tune.probe` (the callback a trial runs with),
:mod:`~dpl.tune.trials` (one trial: fit and score, through ``dpl fit``'s own code path), :mod:`~dpl.tune.release` (the privacy
of the tuned model and its report), :mod:`~dpl.tune.command` (the command). The accounting is
:mod:`dpl.core.accounting.tuning`.
"""
