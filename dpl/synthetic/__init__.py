"""DP synthetic data: ``dpl synthesize`` (:mod:`~dpl.synthetic.command`: label counts in :mod:`~dpl.synthetic.counts`,
sampling in :mod:`~dpl.synthetic.sampling`, the report in :mod:`~dpl.synthetic.report`) and ``dpl evaluate-synthetic``
(:mod:`~dpl.synthetic.evaluation`)."""
