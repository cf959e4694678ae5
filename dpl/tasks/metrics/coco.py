"""ROUGE-L and CIDEr-D as the MS-COCO caption evaluation code (``pycocoevalcap``) computes them, on tokenised
texts with several references per input; see :mod:`dpl.tasks.metrics.text` for the definitions."""

from __future__ import annotations


def rouge_l(hyps: list[list[str]], refs: list[list[list[str]]]) -> float:
    """Mean over inputs of ROUGE-L F (beta 1.2) against the best reference."""
    from pycocoevalcap.rouge.rouge import Rouge

    rouge = Rouge()
    total = 0.0
    for hyp, input_refs in zip(hyps, refs):
        if hyp:  # an empty prediction scores 0 (COCO's code would split "" into one "" token)
            total += rouge.calc_score([" ".join(hyp)], [" ".join(r) for r in input_refs])
    return total / len(hyps)


def cider(hyps: list[list[str]], refs: list[list[list[str]]]) -> float:
    """Corpus CIDEr-D (IDF from this corpus's references)."""
    from pycocoevalcap.cider.cider import Cider

    if not any(ref for input_refs in refs for ref in input_refs):
        return 0.0  # no reference n-grams at all: every TF-IDF vector is empty
    gts = {i: [" ".join(r) for r in input_refs] for i, input_refs in enumerate(refs)}
    res = {i: [" ".join(hyp)] for i, hyp in enumerate(hyps)}
    score, _ = Cider().compute_score(gts, res)
    return float(score)
