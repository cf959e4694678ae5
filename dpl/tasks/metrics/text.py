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

import functools
import importlib.util
import itertools
import math
import shutil
import subprocess
import tempfile
import threading
import warnings
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Literal

from dpl.errors import ConfigError

__all__ = ["METRICS", "MeteorFallbackWarning", "compute_metrics", "meteor_java_available", "tokenize"]

METRICS: tuple[str, ...] = ("bleu", "rouge_l", "meteor", "nist", "cider")

MeteorBackend = Literal["auto", "java", "python"]
METEOR_BACKENDS = ("auto", "java", "python")

# Standalone tokens that the MS-COCO PTBTokenizer wrapper drops ("-LRB-" etc. are its brackets).
_COCO_PUNCTUATION = frozenset(
    ["''", "'", "``", "`", '"', "(", ")", "{", "}", ".", "?", "!", ",", ":", "-", "--", "...", ";"]
)

# METEOR 1.0 parameters (Banerjee & Lavie, 2005).
_METEOR_ALPHA = 0.9
_METEOR_BETA = 3.0
_METEOR_GAMMA = 0.5
# Exhaustive search over equally large alignments up to this many candidates, greedy beyond.
_ALIGN_SEARCH_LIMIT = 64

_NIST_ORDER = 5
_JAVA_HEAP = "-Xmx2G"


class MeteorFallbackWarning(RuntimeWarning):
    """METEOR was computed with the pure-Python METEOR 1.0 fallback instead of the METEOR 1.5 jar."""


def tokenize(text: str) -> list[str]:
    """Lowercase ``text`` and split it into mteval-v13a (sacrebleu ``13a``) tokens."""
    return _tokenizer_13a()(text.lower()).split()


@functools.cache
def _tokenizer_13a():
    from sacrebleu.tokenizers.tokenizer_13a import Tokenizer13a

    return Tokenizer13a()


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
    hyp_words = [_drop_punctuation(t) for t in hyp_tokens]
    ref_words = [[_drop_punctuation(t) for t in refs] for refs in ref_tokens]

    scores: dict[str, float] = {}
    for name in names:
        if name == "bleu":
            scores[name] = _bleu(hyp_tokens, ref_tokens)
        elif name == "nist":
            scores[name] = _nist(hyp_tokens, ref_tokens)
        elif name == "rouge_l":
            scores[name] = _rouge_l(hyp_words, ref_words)
        elif name == "cider":
            scores[name] = _cider(hyp_words, ref_words)
        else:  # meteor
            scores[name] = _meteor(hyp_words, ref_words, meteor_backend)
    return scores


# --------------------------------------------------------------------------- input checks


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


def _drop_punctuation(tokens: list[str]) -> list[str]:
    return [t for t in tokens if t not in _COCO_PUNCTUATION]


def _ngrams(tokens: Sequence[str], n: int) -> Iterable[tuple[str, ...]]:
    return (tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1))


# --------------------------------------------------------------------------- BLEU (sacrebleu)


def _bleu(hyps: list[list[str]], refs: list[list[list[str]]]) -> float:
    from sacrebleu.metrics import BLEU

    # sacrebleu takes reference *streams* (stream k = k-th reference of every input); None pads
    # inputs that have fewer references.
    n_streams = max(len(r) for r in refs)
    streams = [[" ".join(r[k]) if k < len(r) else None for r in refs] for k in range(n_streams)]
    # force: the texts are deliberately pre-tokenised (no "forgot to detokenize" warning).
    bleu = BLEU(tokenize="none", lowercase=False, smooth_method="none", max_ngram_order=4, force=True)
    score = bleu.corpus_score([" ".join(h) for h in hyps], streams).score / 100.0
    return min(score, 1.0)  # 100.00000000000004 / 100 for a perfect corpus


# --------------------------------------------------------------------------- NIST (mteval-v13a)


def _nist(hyps: list[list[str]], refs: list[list[list[str]]], max_n: int = _NIST_ORDER) -> float:
    # Information weights from the n-gram counts of all references of the corpus.
    ref_counts: Counter[tuple[str, ...]] = Counter()
    ref_words = 0
    for input_refs in refs:
        for ref in input_refs:
            ref_words += len(ref)
            for n in range(1, max_n + 1):
                ref_counts.update(_ngrams(ref, n))
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
            counts = Counter(_ngrams(hyp, n))
            hyp_ngrams[n - 1] += sum(counts.values())
            max_ref: Counter[tuple[str, ...]] = Counter()
            for ref in input_refs:
                max_ref |= Counter(_ngrams(ref, n))
            for ngram, count in counts.items():
                if ngram in max_ref:
                    info_sum[n - 1] += info(ngram) * min(count, max_ref[ngram])
    score = sum(s / max(c, 1) for s, c in zip(info_sum, hyp_ngrams))
    return score * _nist_length_penalty(sys_len / ref_len if ref_len > 0 else 0.0)


def _nist_length_penalty(ratio: float) -> float:
    """exp(beta log(ratio)^2) for ratio < 1, with beta such that ratio 2/3 gives 0.5 (mteval)."""
    if ratio >= 1.0:
        return 1.0
    if ratio <= 0.0:
        return 0.0
    beta = math.log(0.5) / math.log(1.5) ** 2
    return math.exp(beta * math.log(ratio) ** 2)


# --------------------------------------------------------------------------- ROUGE-L and CIDEr-D (pycocoevalcap)


def _rouge_l(hyps: list[list[str]], refs: list[list[list[str]]]) -> float:
    from pycocoevalcap.rouge.rouge import Rouge

    rouge = Rouge()
    total = 0.0
    for hyp, input_refs in zip(hyps, refs):
        if hyp:  # an empty prediction scores 0 (COCO's code would split "" into one "" token)
            total += rouge.calc_score([" ".join(hyp)], [" ".join(r) for r in input_refs])
    return total / len(hyps)


def _cider(hyps: list[list[str]], refs: list[list[list[str]]]) -> float:
    from pycocoevalcap.cider.cider import Cider

    if not any(ref for input_refs in refs for ref in input_refs):
        return 0.0  # no reference n-grams at all: every TF-IDF vector is empty
    gts = {i: [" ".join(r) for r in input_refs] for i, input_refs in enumerate(refs)}
    res = {i: [" ".join(hyp)] for i, hyp in enumerate(hyps)}
    score, _ = Cider().compute_score(gts, res)
    return float(score)


# --------------------------------------------------------------------------- METEOR


def _meteor(hyps: list[list[str]], refs: list[list[list[str]]], backend: MeteorBackend) -> float:
    if backend == "python":
        return _meteor_python(hyps, refs)
    if backend == "java":
        return _meteor_java(hyps, refs)
    if meteor_java_available():
        try:
            return _meteor_java(hyps, refs)
        except RuntimeError as err:
            reason = f"the METEOR 1.5 jar failed ({err})"
    else:
        reason = "java or pycocoevalcap's METEOR 1.5 jar is not available"
    warnings.warn(
        f"{reason}; computing METEOR 1.0 in Python instead (exact + stem matching, no synonyms "
        "or paraphrases): scores are lower than, and not comparable with, the official METEOR 1.5",
        MeteorFallbackWarning,
        stacklevel=3,
    )
    return _meteor_python(hyps, refs)


def _meteor_jar() -> Path | None:
    spec = importlib.util.find_spec("pycocoevalcap")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        jar = Path(location) / "meteor" / "meteor-1.5.jar"
        if jar.is_file():
            return jar
    return None


def meteor_java_available() -> bool:
    """Whether ``meteor_backend="auto"`` will use the official METEOR 1.5 jar (java + pycocoevalcap)."""
    return shutil.which("java") is not None and _meteor_jar() is not None


def _meteor_java(hyps: list[list[str]], refs: list[list[list[str]]], modules: Sequence[str] | None = None) -> float:
    """Corpus METEOR from the METEOR 1.5 jar in -stdio mode, the way pycocoevalcap / E2E call it.

    ``modules`` (tests only) replaces the default matchers, e.g. ``("exact", "stem", "synonym")``
    skips loading the paraphrase table (~15 s).
    """
    java, jar = shutil.which("java"), _meteor_jar()
    if java is None or jar is None:
        raise RuntimeError("METEOR 1.5 needs a `java` executable and pycocoevalcap's meteor-1.5.jar")

    def clean(words: list[str]) -> str:  # "|||" separates fields in the jar's protocol
        return " ".join(words).replace("|||", " ")

    score_lines = [
        "SCORE ||| " + " ||| ".join(clean(r) for r in input_refs) + " ||| " + clean(hyp)
        for hyp, input_refs in zip(hyps, refs)
    ]
    cmd = [java, _JAVA_HEAP, "-Dfile.encoding=UTF-8", "-jar", str(jar), "-", "-", "-stdio", "-l", "en", "-norm"]
    if modules is not None:
        cmd += ["-m", " ".join(modules)]
    with tempfile.TemporaryFile() as stderr:
        try:
            proc = subprocess.Popen(
                cmd,
                cwd=jar.parent,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr,
                text=True,
                encoding="utf-8",
            )
        except OSError as err:
            raise RuntimeError(f"cannot start java: {err}") from err
        try:
            stats = _exchange(proc, score_lines)  # one statistics line per SCORE line
            outputs = _exchange(proc, ["EVAL ||| " + " ||| ".join(stats)], n_out=len(stats) + 1)
            proc.stdin.close()
            proc.wait(timeout=60)
            return float(outputs[-1])  # segment scores, then the corpus score
        except (RuntimeError, ValueError, OSError, subprocess.TimeoutExpired) as err:
            proc.kill()
            proc.wait()
            stderr.seek(0)
            tail = stderr.read().decode("utf-8", "replace").strip().splitlines()[-3:]
            raise RuntimeError(f"METEOR jar: {err}; stderr: {' / '.join(tail)}") from err


def _exchange(proc: subprocess.Popen, lines: list[str], n_out: int | None = None) -> list[str]:
    """Write ``lines`` from a thread (no pipe deadlock) while reading ``n_out`` answer lines."""

    def write() -> None:
        try:
            for line in lines:
                proc.stdin.write(line + "\n")
            proc.stdin.flush()
        except OSError:  # the process died; the reader reports it
            pass

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    answers = []
    for _ in range(len(lines) if n_out is None else n_out):
        answer = proc.stdout.readline()
        if not answer:
            raise RuntimeError(f"the process ended early (exit code {proc.poll()})")
        answers.append(answer.strip())
    writer.join()
    return answers


@functools.cache
def _porter_stemmer():
    from nltk.stem.porter import PorterStemmer

    return PorterStemmer(mode=PorterStemmer.ORIGINAL_ALGORITHM)


@functools.lru_cache(maxsize=100_000)
def _stem(word: str) -> str:
    return _porter_stemmer().stem(word)


def _meteor_python(hyps: list[list[str]], refs: list[list[list[str]]]) -> float:
    matches = hyp_len = ref_len = chunks = 0
    for hyp, input_refs in zip(hyps, refs):
        best = max((_meteor_stats(hyp, ref) for ref in input_refs), key=lambda s: s[0])
        _, m, h, r, ch = best
        matches, hyp_len, ref_len, chunks = matches + m, hyp_len + h, ref_len + r, chunks + ch
    return _meteor_score(matches, hyp_len, ref_len, chunks)


def _meteor_score(matches: int, hyp_len: int, ref_len: int, chunks: int) -> float:
    if matches == 0:
        return 0.0
    precision, recall = matches / hyp_len, matches / ref_len
    fmean = precision * recall / (_METEOR_ALPHA * precision + (1 - _METEOR_ALPHA) * recall)
    penalty = _METEOR_GAMMA * (chunks / matches) ** _METEOR_BETA
    return fmean * (1 - penalty)


def _meteor_stats(hyp: list[str], ref: list[str]) -> tuple[float, int, int, int, int]:
    """(segment score, matches, prediction length, reference length, chunks) of one pair."""
    alignment = _meteor_align(hyp, ref)
    chunks = _count_chunks(alignment)
    return _meteor_score(len(alignment), len(hyp), len(ref), chunks), len(alignment), len(hyp), len(ref), chunks


def _meteor_align(hyp: list[str], ref: list[str]) -> list[tuple[int, int]]:
    """METEOR 1.0 word alignment: an exact stage, then a Porter-stem stage on the unaligned words.

    In each stage only words with the same key (the word, then its stem) can be linked; the stage
    links as many words as possible and, among such alignments, picks one with the fewest crossing
    links (together with the links of earlier stages), then the fewest chunks.
    """
    aligned: list[tuple[int, int]] = []
    free_hyp, free_ref = set(range(len(hyp))), set(range(len(ref)))
    stem_hyp, stem_ref = [_stem(w) for w in hyp], [_stem(w) for w in ref]
    for hyp_keys, ref_keys in ((hyp, ref), (stem_hyp, stem_ref)):
        hyp_pos: dict[str, list[int]] = defaultdict(list)
        ref_pos: dict[str, list[int]] = defaultdict(list)
        for i in sorted(free_hyp):
            hyp_pos[hyp_keys[i]].append(i)
        for j in sorted(free_ref):
            ref_pos[ref_keys[j]].append(j)
        # Per key, the candidate link sets of maximal size. Linking a fixed subset of positions in
        # order never adds crossings, so only the choice of subset on the longer side matters.
        options: list[list[list[tuple[int, int]]]] = []
        for key, hs in hyp_pos.items():
            rs = ref_pos.get(key)
            if not rs:
                continue
            options.append(_subset_links(hs, rs))
        if not options:
            continue
        if math.prod(len(o) for o in options) <= _ALIGN_SEARCH_LIMIT:
            best = min(itertools.product(*options), key=lambda combo: _alignment_cost(aligned, _flat(combo)))
            chosen = _flat(best)
        else:  # too many combinations: choose key by key, in order of first occurrence
            chosen = []
            for key_options in options:
                chosen += min(key_options, key=lambda links: _alignment_cost(aligned + chosen, links))
        aligned += chosen
        free_hyp -= {i for i, _ in chosen}
        free_ref -= {j for _, j in chosen}
    return sorted(aligned)


def _subset_links(hs: list[int], rs: list[int]) -> list[list[tuple[int, int]]]:
    if len(hs) == len(rs):
        return [list(zip(hs, rs))]
    if math.comb(max(len(hs), len(rs)), min(len(hs), len(rs))) > _ALIGN_SEARCH_LIMIT:
        # Pathological repetition: keep the order-preserving alignment of the first occurrences.
        return [list(zip(hs, rs))]
    if len(hs) > len(rs):
        return [list(zip(sub, rs)) for sub in itertools.combinations(hs, len(rs))]
    return [list(zip(hs, sub)) for sub in itertools.combinations(rs, len(hs))]


def _flat(combo: Iterable[list[tuple[int, int]]]) -> list[tuple[int, int]]:
    return [link for links in combo for link in links]


def _alignment_cost(fixed: list[tuple[int, int]], new: list[tuple[int, int]]) -> tuple[int, int]:
    crossings = sum(1 for a, b in itertools.combinations(new, 2) if (a[0] - b[0]) * (a[1] - b[1]) < 0)
    crossings += sum(1 for a in new for b in fixed if (a[0] - b[0]) * (a[1] - b[1]) < 0)
    return crossings, _count_chunks(sorted(fixed + new))


def _count_chunks(alignment: list[tuple[int, int]]) -> int:
    """Fewest runs of links adjacent in both the prediction and the reference (sorted input)."""
    chunks = 0
    previous = None
    for i, j in alignment:
        if previous is None or (i, j) != (previous[0] + 1, previous[1] + 1):
            chunks += 1
        previous = (i, j)
    return chunks
