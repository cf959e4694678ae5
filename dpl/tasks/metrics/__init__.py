"""Evaluation metrics.

:mod:`dpl.tasks.metrics.text`: corpus-level table-to-text generation metrics with several references per
input (BLEU, ROUGE-L, METEOR, NIST, CIDEr), as reported for E2E NLG and DART. Its :func:`compute_metrics`
tokenises (:mod:`~dpl.tasks.metrics.tokens`) and calls each metric family: BLEU and NIST
(:mod:`~dpl.tasks.metrics.ngram`), ROUGE-L and CIDEr-D (:mod:`~dpl.tasks.metrics.coco`), METEOR
(:mod:`~dpl.tasks.metrics.meteor`, with the pure-Python METEOR 1.0 in :mod:`~dpl.tasks.metrics.meteor10`).
"""

from dpl.tasks.metrics.text import METRICS, MeteorFallbackWarning, compute_metrics, meteor_java_available, tokenize

__all__ = ["METRICS", "MeteorFallbackWarning", "compute_metrics", "meteor_java_available", "tokenize"]
