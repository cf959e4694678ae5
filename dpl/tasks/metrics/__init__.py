"""Evaluation metrics.

:mod:`dpl.tasks.metrics.text`: corpus-level table-to-text generation metrics with several references per
input (BLEU, ROUGE-L, METEOR, NIST, CIDEr), as reported for E2E NLG and DART.
"""

from dpl.tasks.metrics.text import METRICS, MeteorFallbackWarning, compute_metrics, meteor_java_available, tokenize

__all__ = ["METRICS", "MeteorFallbackWarning", "compute_metrics", "meteor_java_available", "tokenize"]
