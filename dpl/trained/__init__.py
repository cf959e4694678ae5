"""Working with a trained run, after ``dpl fit``: load a run or an exported folder (:mod:`~dpl.trained.runs`),
predict (:mod:`~dpl.trained.predict`), export a Hugging Face folder (:mod:`~dpl.trained.export`) and plot a run
(:mod:`~dpl.trained.plots`). What differs between tasks (how a task predicts, what it exports and how it loads an
export) lives in the task modules (:class:`~dpl.tasks.modules.base.DPTaskModule`); these commands are the same for
every task."""
