"""``dpl plan``: a run's privacy plan and noise regime from its config alone, with alternatives at the same epsilon
and compute (:mod:`~dpl.planning.command`, :mod:`~dpl.planning.alternatives`; the model without its weights:
:mod:`~dpl.planning.skeleton`)."""
