"""BLEU (computed by sacrebleu) and NIST (mteval-v13a, implemented here) of tokenised texts with several
references per input; see :mod:`dpl.tasks.metrics.text` for the definitions."""

from __future__ import annotations

import math
from collections import Counter

from dpl.tasks.metrics.tokens import ngrams

NIST_ORDER = 5


def bleu(hyps: list[list[str]], refs: list[list[list[str]]]) -> float:
    """Corpus BLEU-4 in ``[0, 1]`` (sacrebleu, no smoothing)."""
    from sacrebleu.metrics import BLEU

    # sacrebleu takes reference *streams* (stream k = k-th reference of every input); None pads
    # inputs that have fewer references.
    n_streams = max(len(r) for r in refs)
    streams = [[" ".join(r[k]) if k < len(r) else None for r in refs] for k in range(n_streams)]
    # force: the texts are deliberately pre-tokenised (no "forgot to detokenize" warning).
    scorer = BLEU(tokenize="none", lowercase=False, smooth_method="none", max_ngram_order=4, force=True)
    score = scorer.corpus_score([" ".join(h) for h in hyps], streams).score / 100.0
    return min(score, 1.0)  # 100.00000000000004 / 100 for a perfect corpus


def nist(hyps: list[list[str]], refs: list[list[list[str]]], max_n: int = NIST_ORDER) -> float:
    """Corpus NIST-``max_n`` as mteval-v13a computes it."""
    # Information weights from the n-gram counts of all references of the corpus.
    ref_counts: Counter[tuple[str, ...]] = Counter()
    ref_words = 0
    for input_refs in refs:
        for ref in input_refs:
            ref_words += len(ref)
            for n in range(1, max_n + 1):
                ref_counts.update(ngrams(ref, n))
    if ref_words == 0:
        return 0.0

    def info(ngram: tuple[str, ...]) -> float:
        context = ref_counts[ngram[:-1]] if len(ngram) > 1 else ref_words
        return math.log2(context / ref_counts[ngram])

    info_sum = [0.0] * max_n  # information of the matched (clipped) n-grams, per order
    hyp_ngrams = [0] * max_n  # number of n-grams in the predictions, per order
    sys_len = 0
    ref_len = 0.0  # sum over inputs of the average reference length
    for hyp, input_refs in zip(hyps, refs):
        sys_len += len(hyp)
        ref_len += sum(len(r) for r in input_refs) / len(input_refs)
        for n in range(1, max_n + 1):
            counts = Counter(ngrams(hyp, n))
            hyp_ngrams[n - 1] += sum(counts.values())
            max_ref: Counter[tuple[str, ...]] = Counter()
            for ref in input_refs:
                max_ref |= Counter(ngrams(ref, n))
            for ngram, count in counts.items():
                if ngram in max_ref:
                    info_sum[n - 1] += info(ngram) * min(count, max_ref[ngram])
    score = sum(s / max(c, 1) for s, c in zip(info_sum, hyp_ngrams))
    return score * nist_length_penalty(sys_len / ref_len if ref_len > 0 else 0.0)


def nist_length_penalty(ratio: float) -> float:
    """exp(beta log(ratio)^2) for ratio < 1, with beta such that ratio 2/3 gives 0.5 (mteval)."""
    if ratio >= 1.0:
        return 1.0
    if ratio <= 0.0:
        return 0.0
    beta = math.log(0.5) / math.log(1.5) ** 2
    return math.exp(beta * math.log(ratio) ** 2)
