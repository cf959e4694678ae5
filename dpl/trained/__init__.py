"""Working with a trained run, after ``dpl fit``: load a run or an exported folder (:mod:`~dpl.trained.runs`),
predict (:mod:`~dpl.trained.predict`), export a Hugging Face folder (:mod:`~dpl.trained.export`, with
:mod:`~dpl.trained.modeling_dpl` as the remote code of mean-pooled classifiers) and plot a run
(:mod:`~dpl.trained.plots`). These put the adapter and the tasks together, like the ``dpl`` command."""
