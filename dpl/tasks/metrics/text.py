"""Corpus-level metrics for table-to-text generation with several references per input.

These are the automatic metrics reported for E2E NLG and DART: BLEU, ROUGE-L, METEOR, NIST and
CIDEr. :func:`compute_metrics` scores a whole corpus at once: ``predictions[i]`` is the system
output for input ``i`` and ``references[i]`` is the list of *all* human references of that input
(E2E has about eight per input, DART a variable number). Every metric uses every reference.

Scale
    BLEU, ROUGE-L and METEOR are fractions in ``[0, 1]`` (not percent: multiply by 100 to compare
    with papers that print BLEU 65.4). NIST (unbounded, about 8-9 on E2E) and CIDEr (``[0, 10]``,
    about 2-3 on E2E) are on their usual scales.

Tokenisation (the official E2E script lowercases and tokenises before scoring)
    Every text is lowercased (``str.lower``) and tokenised with the ``13a`` tokeniser of mteval-v13a
    (as implemented by sacrebleu), which splits off punctuation. BLEU and NIST score these tokens.
    ROUGE-L, METEOR and CIDEr are computed, as in the MS-COCO caption code that the E2E script
    calls, on the same tokens with standalone punctuation tokens removed (the COCO ``PTBTokenizer``
    list: ``. , ? ! : ; - -- ... ' '' ` `` "`` and brackets). The COCO code tokenises with Stanford's
    Java PTB tokeniser instead; the two differ in details (e.g. ``don't`` stays one token here), so
    ROUGE-L/METEOR/CIDEr can differ from the official script's in the last digits.

The metrics
    ``bleu``
        Corpus BLEU-4 (Papineni et al., 2002) computed by sacrebleu: modified n-gram precisions
        n = 1..4 clipped by the maximum count over all references of an input, uniform geometric
        mean, brevity penalty with the reference length closest to each prediction (mteval-v13a
        convention, ties to the shorter). No smoothing: if some n-gram order has no match in the
        whole corpus (or every prediction has fewer than 4 tokens) BLEU is 0.
    ``nist``
        NIST-5 (Doddington, 2002) exactly as mteval-v13a defines it: information weights
        ``log2(count(w1..wn-1) / count(w1..wn))`` estimated from all references of the corpus,
        matches clipped by the maximum count over an input's references, arithmetic sum over
        n = 1..5 of information-weighted precisions, and NIST's length penalty against the average
        reference length. Implemented here: ``nltk.translate.nist_score.corpus_nist`` agrees with it
        for one reference per input but, with several, scores each n-gram order against a single
        "best" reference (and uses that reference's length), which is not what mteval does.
    ``rouge_l``
        ROUGE-L as in the MS-COCO caption evaluation code (``pycocoevalcap``), which the E2E script
        uses: for each input, P = max over references of LCS/len(prediction), R = max over
        references of LCS/len(reference), F = (1 + b^2) P R / (R + b^2 P) with b = 1.2; the corpus
        score is the mean over inputs (an empty prediction scores 0).
    ``cider``
        CIDEr-D (Vedantam et al., 2015) from ``pycocoevalcap`` (its ``Cider`` class is the CIDEr-D
        variant: TF-IDF n-gram vectors n = 1..4, clipped counts, Gaussian length penalty sigma = 6,
        times 10, averaged over references and inputs). The IDF is estimated from the references of
        the corpus being scored, so CIDEr is only meaningful for a corpus: with a single input
        every weight is 0 and so is the score.
    ``meteor``
        Two backends (``meteor_backend``):

        * ``"java"``: the official METEOR 1.5 jar shipped in ``pycocoevalcap``, run as the E2E
          script runs it (``-l en -norm``, English default parameters, exact + stem + WordNet
          synonym + paraphrase matching, best reference per input, corpus score from aggregated
          statistics). Needs a ``java`` executable; starting it takes ~15 s (it loads the
          paraphrase table). Same program and settings as the official E2E script (which differs
          only in the tokenisation, see above).
        * ``"python"``: METEOR 1.0 (Banerjee & Lavie, 2005) implemented here: unigram alignment in
          two stages, exact match then Porter-stem match (nltk's ``PorterStemmer``, original
          algorithm); in each stage the largest alignment, ties broken by fewest crossing links,
          then fewest chunks;
          P = m/len(prediction), R = m/len(reference), Fmean = P R / (alpha P + (1 - alpha) R),
          penalty = gamma (chunks/m)^beta with alpha = 0.9, beta = 3, gamma = 0.5; score =
          Fmean (1 - penalty). Per input the best-scoring reference is used, and the corpus score
          is computed from the summed statistics (m, lengths, chunks) of those pairs, as METEOR
          does. **No synonym (WordNet) or paraphrase matching** (nltk's METEOR needs WordNet, which
          nltk downloads at run time and no maintained PyPI package ships), and METEOR 1.0 rather than 1.5
          parameters (METEOR 1.5 also down-weights function words and penalises fragmentation far
          more steeply: gamma = 0.6, beta = 0.2). These scores are therefore *not* comparable with
          published (METEOR 1.5) numbers: on typical outputs they are markedly higher (0.86 where
          METEOR 1.5 gives 0.49 on a two-sentence E2E-style example). Use them only to compare
          systems scored the same way.
        * ``"auto"`` (default): ``"java"`` when ``java`` and the jar are available, otherwise
          ``"python"`` with a :class:`MeteorFallbackWarning`. The result then depends on the
          machine: pass ``"java"`` or ``"python"`` explicitly when scores must be comparable.
"""

from __future__ import annotations

from collections.abc import Sequence

from dpl.errors import ConfigError
from dpl.tasks.metrics.coco import cider, rouge_l
from dpl.tasks.metrics.meteor import (METEOR_BACKENDS, MeteorBackend, MeteorFallbackWarning, meteor,
                                      meteor_java_available)
from dpl.tasks.metrics.ngram import bleu, nist
from dpl.tasks.metrics.tokens import drop_punctuation, tokenize

__all__ = ["METRICS", "METEOR_BACKENDS", "MeteorFallbackWarning", "check_metric_names", "compute_metrics",
           "meteor_java_available", "tokenize"]

METRICS: tuple[str, ...] = ("bleu", "rouge_l", "meteor", "nist", "cider")


def compute_metrics(
    predictions: list[str],
    references: list[list[str]],
    metrics: Sequence[str] = METRICS,
    *,
    meteor_backend: MeteorBackend = "auto",
) -> dict[str, float]:
    """Corpus-level BLEU, ROUGE-L, METEOR, NIST and CIDEr of ``predictions`` against ``references``.

    Args:
        predictions: one generated text per input (empty strings are allowed).
        references: ``references[i]`` lists all reference texts of input ``i`` (at least one).
        metrics: which of :data:`METRICS` to compute, in the order the result should have.
        meteor_backend: ``"auto"``, ``"java"`` or ``"python"`` (see the module documentation):
            the official METEOR 1.5 jar, or METEOR 1.0 without synonyms in pure Python.

    Returns:
        ``{metric name: corpus score}``. BLEU, ROUGE-L and METEOR are in ``[0, 1]`` (not percent);
        NIST-5 and CIDEr-D are on their usual scales. All texts are lowercased and tokenised
        (mteval-v13a tokens; punctuation tokens dropped for ROUGE-L, METEOR and CIDEr).

    Raises:
        ValueError: an unknown metric name (the message lists the valid ones), an unknown METEOR
            backend, no predictions, a different number of predictions and reference lists, or an
            input with an empty reference list (the message gives its index).
        TypeError: ``predictions`` or a ``references[i]`` is a single string, or holds a non-string.
        RuntimeError: ``meteor_backend="java"`` and the METEOR jar cannot be run.
    """
    names = check_metric_names(metrics)
    if meteor_backend not in METEOR_BACKENDS:
        raise ConfigError(f"unknown meteor_backend {meteor_backend!r}; valid backends: {', '.join(METEOR_BACKENDS)}")
    _check_corpus(predictions, references)

    hyp_tokens = [tokenize(p) for p in predictions]
    ref_tokens = [[tokenize(r) for r in refs] for refs in references]
    # ROUGE-L, METEOR and CIDEr: the same tokens without punctuation (MS-COCO convention).
    hyp_words = [drop_punctuation(t) for t in hyp_tokens]
    ref_words = [[drop_punctuation(t) for t in refs] for refs in ref_tokens]

    scores: dict[str, float] = {}
    for name in names:
        if name == "bleu":
            scores[name] = bleu(hyp_tokens, ref_tokens)
        elif name == "nist":
            scores[name] = nist(hyp_tokens, ref_tokens)
        elif name == "rouge_l":
            scores[name] = rouge_l(hyp_words, ref_words)
        elif name == "cider":
            scores[name] = cider(hyp_words, ref_words)
        else:  # meteor
            scores[name] = meteor(hyp_words, ref_words, meteor_backend)
    return scores


def check_metric_names(metrics: Sequence[str] | str) -> list[str]:
    """The distinct metric names in order; ``ConfigError`` naming the valid ones for an unknown name."""
    if isinstance(metrics, str):
        metrics = [metrics]
    names: list[str] = []
    for name in metrics:
        if name not in METRICS:
            raise ConfigError(f"unknown metric {name!r}; valid metrics: {', '.join(METRICS)}")
        if name not in names:
            names.append(name)
    return names


def _check_corpus(predictions: Sequence[str], references: Sequence[Sequence[str]]) -> None:
    if isinstance(predictions, str):
        raise TypeError("predictions must be a list of strings, not a single string")
    if len(predictions) == 0:
        raise ValueError("no predictions: corpus-level metrics need at least one input")
    if len(predictions) != len(references):
        raise ValueError(
            f"got {len(predictions)} predictions but {len(references)} reference lists; "
            "references[i] must list the references of predictions[i]"
        )
    for i, prediction in enumerate(predictions):
        if not isinstance(prediction, str):
            raise TypeError(f"predictions[{i}] is a {type(prediction).__name__}, not a string")
    for i, refs in enumerate(references):
        if isinstance(refs, str):
            raise TypeError(f"references[{i}] is a string; it must be a list of reference strings")
        if len(refs) == 0:
            raise ValueError(f"references[{i}] is empty: every input needs at least one reference")
        for k, ref in enumerate(refs):
            if not isinstance(ref, str):
                raise TypeError(f"references[{i}][{k}] is a {type(ref).__name__}, not a string")
