"""Table-to-text metrics (dpl.tasks.metrics.text) against values worked out independently.

Expected values come from hand computations written out in the comments, from published or
documented examples (Papineni et al. 2002's sentences as used in NLTK's BLEU doctests, Lin 2004's
ROUGE-L example), or from an independent implementation (nltk) where its definition
is the same. Everything except the METEOR-jar tests is pure Python and fast.
"""

import math
import os

import pytest

from dpl.tasks.metrics import METRICS, MeteorFallbackWarning, compute_metrics, meteor_java_available, tokenize
from dpl.tasks.metrics import meteor as meteor_module
from dpl.tasks.metrics.meteor10 import meteor_align, meteor_python

PY = {"meteor_backend": "python"}  # deterministic, no JVM: used everywhere except the jar tests


def score(metric, predictions, references, **kwargs):
    return compute_metrics(predictions, references, [metric], **{**PY, **kwargs})[metric]


# --------------------------------------------------------------------------- API and input checks


def test_metrics_constant_and_result_keys():
    assert METRICS == ("bleu", "rouge_l", "meteor", "nist", "cider")
    out = compute_metrics(["the pub is cheap"], [["the pub is cheap"]], **PY)
    assert list(out) == list(METRICS)
    assert all(isinstance(v, float) for v in out.values())
    # A subset, in the order asked for, duplicates dropped; a single name as a string is accepted.
    assert list(compute_metrics(["a b"], [["a b"]], ["nist", "bleu", "nist"], **PY)) == ["nist", "bleu"]
    assert list(compute_metrics(["a b"], [["a b"]], "cider")) == ["cider"]


def test_unknown_metric_raises_naming_valid_ones():
    with pytest.raises(ValueError) as err:
        compute_metrics(["a"], [["a"]], ["bleu", "ter"])
    message = str(err.value)
    assert "'ter'" in message
    assert all(name in message for name in METRICS)


def test_empty_reference_list_raises_with_index():
    with pytest.raises(ValueError, match=r"references\[2\]"):
        compute_metrics(["a", "b", "c"], [["a"], ["b"], []], **PY)


def test_other_bad_inputs_raise():
    with pytest.raises(ValueError, match="3 predictions but 2"):
        compute_metrics(["a", "b", "c"], [["a"], ["b"]], **PY)
    with pytest.raises(ValueError, match="at least one"):
        compute_metrics([], [], **PY)
    with pytest.raises(TypeError, match=r"references\[0\]"):
        compute_metrics(["a"], ["a"], **PY)  # a bare string instead of a list of references
    with pytest.raises(ValueError, match="meteor_backend"):
        compute_metrics(["a"], [["a"]], ["meteor"], meteor_backend="jar")


def test_empty_predictions_are_allowed():
    # All predictions empty: nothing matches, every metric is 0 (and nothing divides by zero).
    assert compute_metrics(["", ""], [["a b c d"], ["e f"]], **PY) == {name: 0.0 for name in METRICS}
    # One empty prediction among good ones only lowers the scores.
    good = compute_metrics(["the pub is cheap", "the cafe is near"], [["the pub is cheap"], ["the cafe is near"]], **PY)
    mixed = compute_metrics(["the pub is cheap", ""], [["the pub is cheap"], ["the cafe is near"]], **PY)
    assert all(0.0 <= mixed[name] < good[name] for name in METRICS)


def test_tokenisation_lowercases_and_splits_punctuation():
    assert tokenize("The Eagle is near Burger King. It costs £20-25.") == [
        "the", "eagle", "is", "near", "burger", "king", ".", "it", "costs", "£20", "-", "25", ".",
    ]  # fmt: skip
    # Case and spacing do not matter for any metric.
    a = compute_metrics(["The Pub, Zizzi, is CHEAP."], [["the pub , zizzi , is cheap ."]], **PY)
    assert a["bleu"] == pytest.approx(1.0) and a["rouge_l"] == pytest.approx(1.0)
    # ROUGE-L (like METEOR and CIDEr, following the MS-COCO code used for E2E) ignores punctuation
    # tokens; BLEU does not: "," adds unmatched n-grams.
    b = compute_metrics(["the eagle , a pub near the river"], [["the eagle a pub near the river"]], **PY)
    assert b["rouge_l"] == pytest.approx(1.0)
    assert b["bleu"] < 0.9


# --------------------------------------------------------------------------- BLEU


def test_bleu_by_hand_one_sentence():
    # prediction (7 tokens): the pub is cheap near the river
    # reference  (8 tokens): the pub is cheap and near the river
    # 1-grams: the x2 (ref has 2), pub, is, cheap, near, river              -> 7/7
    # 2-grams: the pub, pub is, is cheap, near the, the river match;
    #          "cheap near" does not                                          -> 5/6
    # 3-grams: the pub is, pub is cheap, near the river match;
    #          "is cheap near", "cheap near the" do not                       -> 3/5
    # 4-grams: "the pub is cheap" matches; the other 3 do not                 -> 1/4
    # brevity penalty: c = 7 < r = 8 -> exp(1 - 8/7)
    # BLEU = exp(-1/7) * (1 * 5/6 * 3/5 * 1/4) ** (1/4) = exp(-1/7) * 2 ** (-3/4)
    expected = math.exp(-1 / 7) * 2 ** (-3 / 4)
    assert score("bleu", ["the pub is cheap near the river"], [["the pub is cheap and near the river"]]) == (
        pytest.approx(expected, rel=1e-12)
    )


# Papineni et al. (2002), section 2.1, Example 1 (candidate 1 and its three references), plus the
# second sentence pair of NLTK's corpus_bleu doctest, whose documented values are
# sentence_bleu([ref1a, ref1b, ref1c], hyp1) = 0.5045... and corpus_bleu(...) = 0.5920...
HYP1 = "It is a guide to action which ensures that the military always obeys the commands of the party"
REF1A = "It is a guide to action that ensures that the military will forever heed Party commands"
REF1B = "It is the guiding principle which guarantees the military forces always being under the command of the Party"
REF1C = "It is the practical guide for the army always to heed the directions of the party"
HYP2 = "he read the book because he was interested in world history"
REF2A = "he was interested in world history because he read the book"


def test_bleu_papineni_example_as_documented_by_nltk():
    # Lowercasing does not change any clipped count here ("Party"/"party" has max count 1 either way).
    assert score("bleu", [HYP1], [[REF1A, REF1B, REF1C]]) == pytest.approx(0.5045666840058485, rel=1e-9)
    assert score("bleu", [HYP1, HYP2], [[REF1A, REF1B, REF1C], [REF2A]]) == pytest.approx(0.5920778868801042, rel=1e-9)


def test_bleu_agrees_with_nltk_on_a_multi_reference_corpus():
    from nltk.translate.bleu_score import corpus_bleu

    preds = ["the cat sat on the red mat", HYP2.lower(), "a cheap pub near the river"]
    refs = [
        ["the cat sat on the mat", "a cat sat on the red mat"],
        [REF2A.lower()],
        # Two references equally close in length to the prediction (7 and 5 words for 6): as in
        # mteval-v13a and nltk, the shorter one is the brevity-penalty length. (torchmetrics'
        # BLEUScore takes the first one and gives 0.759 here instead of 0.791.)
        ["the pub near the river is cheap", "cheap pub by the river", "a pub"],
    ]
    expected = corpus_bleu([[r.split() for r in rs] for rs in refs], [p.split() for p in preds])
    assert score("bleu", preds, refs) == pytest.approx(expected, rel=1e-12)


def test_bleu_uses_all_references():
    # Every n-gram of the prediction occurs in one of the two references, but neither reference
    # alone contains all of them: "the cat sat on" comes from the first, "on the red mat" from the
    # second. With both, all clipped precisions are 1 and the closest reference length is 7 = c.
    pred = ["the cat sat on the red mat"]
    ref_a, ref_b = "the cat sat on the mat", "a cat sat on the red mat"
    assert score("bleu", pred, [[ref_a, ref_b]]) == pytest.approx(1.0)
    assert score("bleu", pred, [[ref_a]]) < 0.7
    assert score("bleu", pred, [[ref_b]]) < 0.85


def test_bleu_is_zero_without_four_gram_matches():
    # Standard BLEU-4 without smoothing: no matching 4-gram anywhere in the corpus gives 0.
    assert score("bleu", ["the pub is cheap"], [["the pub was cheap"]]) == 0.0


# --------------------------------------------------------------------------- NIST


def test_nist_by_hand():
    # Corpus: prediction "a b c" with reference "a b c d"; prediction "a c" with reference "a c".
    # Information weights from all reference n-grams (6 reference words):
    #   info(a) = log2(6/2), info(b) = log2(6/1), info(c) = log2(6/2), info(d) = log2(6/1)
    #   info(a b) = log2(count(a)/count(a b)) = log2(2/1) = 1, info(b c) = log2(1/1) = 0,
    #   info(a c) = log2(2/1) = 1, info(c d) = 1, all 3/4-grams: log2(1/1) = 0
    # n=1: matched a, b, c + a, c -> (4 log2 3 + log2 6) / 5 prediction unigrams
    # n=2: matched a b, b c + a c  -> (1 + 0 + 1) / 3 prediction bigrams
    # n=3: matched a b c           -> 0 / 1;  n=4, 5: no prediction n-grams -> 0
    # length penalty: 5 prediction words vs 4 + 2 = 6 reference words (average per input):
    #   exp(beta log(5/6)^2), beta = log(0.5) / log(1.5)^2
    info = (4 * math.log2(3) + math.log2(6)) / 5 + 2 / 3
    beta = math.log(0.5) / math.log(1.5) ** 2
    expected = info * math.exp(beta * math.log(5 / 6) ** 2)
    assert score("nist", ["a b c", "a c"], [["a b c d"], ["a c"]]) == pytest.approx(expected, rel=1e-12)


def test_nist_clips_against_all_references_like_mteval():
    # Prediction "a b", references "a x" and "y b": 4 reference words, so every unigram has
    # information log2(4/1) = 2 (the bigrams a x, y b: log2(1/1) = 0). mteval clips each n-gram by
    # its maximum count over the references, so both a and b match: (2 + 2) / 2 = 2; "a b" does
    # not match; lengths 2 vs average 2 -> no penalty. NIST = 2.
    # (nltk's corpus_nist scores against a single best reference per n-gram order and gives 1.)
    assert score("nist", ["a b"], [["a x", "y b"]]) == pytest.approx(2.0)


def test_nist_clips_by_the_maximum_count_and_uses_the_average_reference_length():
    # Prediction "a a b"; references "a x" and "a b y z w v" (8 reference words, "a" twice).
    #   info(a) = log2(8/2) = 2, info(b) = log2(8/1) = 3, info(a b) = log2(count(a)/count(a b)) = 1
    # n=1: "a" occurs twice but at most once in any one reference -> clipped to 1: (2 + 3) / 3
    # n=2: "a a" no, "a b" yes -> 1 / 2;  n=3: "a a b" no -> 0 / 1
    # length penalty: 3 prediction words vs the average reference length (2 + 6) / 2 = 4
    beta = math.log(0.5) / math.log(1.5) ** 2
    expected = (5 / 3 + 1 / 2) * math.exp(beta * math.log(3 / 4) ** 2)
    assert score("nist", ["a a b"], [["a x", "a b y z w v"]]) == pytest.approx(expected, rel=1e-12)


def test_nist_agrees_with_nltk_for_single_references():
    # With one reference per input, nltk.translate.nist_score implements the same definition.
    from nltk.translate.nist_score import corpus_nist

    preds = [HYP1, HYP2, "the eagle is a cheap coffee shop near burger king"]
    refs = [REF1A, REF2A, "near burger king there is a cheap coffee shop called the eagle"]
    expected = corpus_nist([[tokenize(r)] for r in refs], [tokenize(p) for p in preds], n=5)
    assert score("nist", preds, [[r] for r in refs]) == pytest.approx(expected, rel=1e-12)


# --------------------------------------------------------------------------- ROUGE-L


def test_rouge_l_lin_2004_example():
    # Lin (2004), section 3.1: reference "police killed the gunman";
    # "police kill the gunman" has LCS "police the gunman" = 3 -> P = R = 3/4 -> ROUGE-L 0.75;
    # "the gunman kill police" has LCS "the gunman" = 2     -> P = R = 2/4 -> ROUGE-L 0.5.
    # The corpus score is the mean over inputs: 0.625.
    ref = ["police killed the gunman"]
    assert score("rouge_l", ["police kill the gunman"], [ref]) == pytest.approx(0.75)
    assert score("rouge_l", ["the gunman kill police"], [ref]) == pytest.approx(0.5)
    assert score("rouge_l", ["police kill the gunman", "the gunman kill police"], [ref, ref]) == pytest.approx(0.625)


def test_rouge_l_multi_reference_by_hand():
    # Prediction "a b c d" (4 words). Reference "a b x": LCS "a b" = 2 -> P = 2/4, R = 2/3.
    # Reference "a c d e f g": LCS "a c d" = 3 -> P = 3/4, R = 3/6.
    # COCO ROUGE-L takes P_max = 3/4 and R_max = 2/3 over the references, then
    # F = (1 + 1.2^2) P R / (R + 1.2^2 P).
    p, r = 3 / 4, 2 / 3
    expected = (1 + 1.44) * p * r / (r + 1.44 * p)
    assert score("rouge_l", ["a b c d"], [["a b x", "a c d e f g"]]) == pytest.approx(expected, rel=1e-12)
    assert score("rouge_l", ["a b c d"], [["a b x"]]) < expected
    assert score("rouge_l", ["a b c d"], [["a c d e f g"]]) < expected


# --------------------------------------------------------------------------- METEOR (pure-Python METEOR 1.0)


def test_meteor_components_by_hand():
    # prediction: the(0) dog(1) walked(2) to(3) my(4) school(5)
    # reference:  my(0) old(1) dog(2) walks(3) to(4) school(5)
    # exact stage: dog 1->2, to 3->4, my 4->0, school 5->5; stem stage: walked/walks -> "walk": 2->3
    pred, ref = ["the", "dog", "walked", "to", "my", "school"], ["my", "old", "dog", "walks", "to", "school"]
    assert meteor_align(pred, ref) == [(1, 2), (2, 3), (3, 4), (4, 0), (5, 5)]
    # m = 5; chunks: (1,2)(2,3)(3,4) | (4,0) | (5,5) = 3; P = R = 5/6 so Fmean = 5/6;
    # penalty = 0.5 * (3/5)^3 = 0.108; METEOR = 5/6 * (1 - 0.108)
    expected = 5 / 6 * (1 - 0.5 * (3 / 5) ** 3)
    assert score("meteor", ["the dog walked to my school"], [["my old dog walks to school"]]) == pytest.approx(
        expected, rel=1e-12
    )


def test_meteor_agrees_with_nltk_without_wordnet():
    # nltk's METEOR with the same stemmer, the same parameters and no synonyms (a stub in place of
    # WordNet) gives the same sentence scores on these single-sentence corpora.
    from nltk.stem.porter import PorterStemmer
    from nltk.translate.meteor_score import meteor_score

    class NoSynonyms:
        def synsets(self, word):
            return []

    stemmer = PorterStemmer(mode=PorterStemmer.ORIGINAL_ALGORITHM)
    pairs = [
        ("the dog walked to my school", ["my old dog walks to school"]),
        ("the cheap pubs are near the river", ["a cheap pub near the rivers", "the pub is expensive"]),
        ("zizzi serves italian food", ["italian food is served at zizzi"]),
    ]
    for pred, refs in pairs:
        expected = meteor_score([r.split() for r in refs], pred.split(), stemmer=stemmer, wordnet=NoSynonyms())
        assert score("meteor", [pred], [refs]) == pytest.approx(expected, rel=1e-12)


def test_meteor_alignment_prefers_fewer_chunks_among_equal_alignments():
    # Prediction "a b", reference "a x a b": "a" can link to reference word 0 or 2. Both have no
    # crossings; linking to 2 makes "a b" one chunk. m = 2, P = 1, R = 2/4,
    # Fmean = P R / (0.9 P + 0.1 R) = 0.5 / 0.95, penalty = 0.5 * (1/2)^3.
    assert meteor_align(["a", "b"], ["a", "x", "a", "b"]) == [(0, 2), (1, 3)]
    expected = 0.5 / 0.95 * (1 - 0.5 * 0.5**3)
    assert score("meteor", ["a b"], [["a x a b"]]) == pytest.approx(expected, rel=1e-12)


def test_meteor_corpus_score_from_summed_statistics():
    # Corpus = the two examples above: m = 5 + 2, prediction words 6 + 2, reference words 6 + 4,
    # chunks 3 + 1 -> P = 7/8, R = 7/10, penalty = 0.5 (4/7)^3 (not the mean of sentence scores).
    p, r = 7 / 8, 7 / 10
    expected = p * r / (0.9 * p + 0.1 * r) * (1 - 0.5 * (4 / 7) ** 3)
    got = score("meteor", ["the dog walked to my school", "a b"], [["my old dog walks to school"], ["a x a b"]])
    assert got == pytest.approx(expected, rel=1e-12)


def test_meteor_uses_best_reference():
    pred = ["the cheap pub is near the river"]
    best = score("meteor", pred, [["the cheap pub is near the river bank"]])
    assert score(
        "meteor", pred, [["an expensive restaurant", "the cheap pub is near the river bank", "a pub"]]
    ) == pytest.approx(best)
    assert score("meteor", pred, [["an expensive restaurant"]]) < best
    # Best by score, not by number of matches: both references match all 3 words of "the cheap pub",
    # the first one in two chunks and with a far lower recall.
    only_second = score("meteor", ["the cheap pub"], [["the cheap pub"]])
    assert score("meteor", ["the cheap pub"], [["the pub is not a cheap pub at all", "the cheap pub"]]) == only_second


# --------------------------------------------------------------------------- CIDEr-D


def test_cider_by_hand():
    # Two inputs, one reference each: "a b c" and "d e"; predictions "a b" and "d e".
    # Every reference n-gram occurs in the references of one input of N = 2, so every weight is
    # tf * (log 2 - log 1) = tf * log 2 (the common factor cancels in the cosines).
    # Input 1: n=1: hyp {a, b}, ref {a, b, c}: cos = 2 / (sqrt 2 sqrt 3); n=2: hyp {a b},
    #   ref {a b, b c}: cos = 1 / sqrt 2; n=3, 4: the prediction has none -> 0.
    #   Gaussian length penalty exp(-(2 - 3)^2 / (2 * 6^2)); score = 10 * mean over n = 1..4.
    # Input 2: identical 2-word sentences: cosines 1, 1, 0, 0 -> 10 * 2/4 = 5.
    input1 = 10 * (2 / math.sqrt(6) + 1 / math.sqrt(2)) / 4 * math.exp(-1 / 72)
    expected = (input1 + 5.0) / 2
    assert score("cider", ["a b", "d e"], [["a b c"], ["d e"]]) == pytest.approx(expected, rel=1e-12)


def test_cider_averages_over_references_and_needs_a_corpus():
    preds = ["the pub is cheap", "the cafe is near the river"]
    one_ref = score("cider", preds, [["the pub is cheap"], ["the cafe is near the river"]])
    # CIDEr-D averages the similarity over the references of an input (not the max), so adding an
    # unrelated reference lowers the score, and repeating a reference does not change it.
    two_refs = score("cider", preds, [["the pub is cheap", "an expensive restaurant"], ["the cafe is near the river"]])
    same_twice = score("cider", preds, [["the pub is cheap", "the pub is cheap"], ["the cafe is near the river"]])
    assert two_refs < one_ref
    assert same_twice == pytest.approx(one_ref)
    # The IDF comes from the scored corpus: with one input every n-gram has weight log 1 - log 1 = 0.
    assert score("cider", ["the pub is cheap"], [["the pub is cheap"]]) == 0.0


# --------------------------------------------------------------------------- all metrics


CORPUS_REFS = [
    ["The Eagle is a cheap coffee shop near Burger King.", "Near Burger King is The Eagle, a cheap coffee shop."],
    ["Zizzi is a family-friendly pub in the city centre.", "Zizzi, a pub in the city centre, is kid friendly."],
    ["The Phoenix serves French food by the river.", "By the river, The Phoenix serves French food at low prices."],
]


def test_identical_prediction_and_reference_gives_the_maximum():
    preds = [refs[0] for refs in CORPUS_REFS]
    best = compute_metrics(preds, [[r[0]] for r in CORPUS_REFS], **PY)
    assert best["bleu"] == pytest.approx(1.0)
    assert best["rouge_l"] == pytest.approx(1.0)
    # METEOR 1.0 keeps a small fragmentation penalty even for a perfect match: one chunk per input,
    # 3 chunks for the 10 + 9 + 8 = 27 matched words (punctuation dropped; "family-friendly" is one
    # 13a token): 1 - 0.5 (3/27)^3.
    assert best["meteor"] == pytest.approx(1 - 0.5 * (3 / 27) ** 3, rel=1e-12)
    # Any change to the predictions lowers every metric.
    worse = [
        ["The Eagle is a coffee shop near Burger King.", preds[1], preds[2]],
        [preds[0], "Zizzi is a pub in the city centre.", "The Phoenix serves food by the river."],
        ["Burger King is near a cheap coffee shop.", "Zizzi is a family-friendly pub.", "The Phoenix is by the river."],
    ]
    for other in worse:
        scores = compute_metrics(other, [[r[0]] for r in CORPUS_REFS], **PY)
        assert all(scores[name] < best[name] for name in METRICS), (other, scores, best)


def test_multiple_references_are_all_used():
    # Predictions equal to the *second* references: adding those references (to the first ones)
    # raises every metric; BLEU and ROUGE-L reach their maximum.
    preds = [refs[1] for refs in CORPUS_REFS]
    first_only = compute_metrics(preds, [[r[0]] for r in CORPUS_REFS], **PY)
    both = compute_metrics(preds, CORPUS_REFS, **PY)
    assert all(both[name] > first_only[name] for name in METRICS), (first_only, both)
    assert both["bleu"] == pytest.approx(1.0) and both["rouge_l"] == pytest.approx(1.0)


# --------------------------------------------------------------------------- METEOR backends


def test_auto_backend_falls_back_to_python_with_a_warning(monkeypatch):
    monkeypatch.setattr(meteor_module.shutil, "which", lambda name: None)  # no java on PATH
    assert not meteor_java_available()
    preds, refs = ["the dog walked to my school"], [["my old dog walks to school"]]
    with pytest.warns(MeteorFallbackWarning, match="METEOR 1.0"):
        got = compute_metrics(preds, refs, ["meteor"])["meteor"]
    assert got == score("meteor", preds, refs)
    with pytest.raises(RuntimeError, match="java"):
        compute_metrics(preds, refs, ["meteor"], meteor_backend="java")


needs_java = pytest.mark.skipif(not meteor_java_available(), reason="needs java and pycocoevalcap's METEOR 1.5 jar")


@needs_java
def test_meteor_jar_protocol_and_synonyms():
    # The paraphrase table is left out here (it takes ~15 s to load); see the slow test below.
    modules = ("exact", "stem", "synonym")
    identical = [tokenize("the pub is cheap"), tokenize("zizzi is near the river")]
    assert meteor_module.meteor_java(identical, [[t] for t in identical], modules) == pytest.approx(1.0)
    # WordNet synonyms: "film" ~ "movie" matches in METEOR 1.5, not in the Python METEOR 1.0.
    hyp, refs = [tokenize("the film was good"), []], [[tokenize("the movie was good")], [tokenize("a b")]]
    with_synonyms = meteor_module.meteor_java(hyp, refs, modules)
    assert with_synonyms > meteor_python(hyp, refs) > 0.0


@needs_java
@pytest.mark.skipif(
    not os.environ.get("DPL_SLOW_TESTS"), reason="starts the full METEOR 1.5 (~15-30 s); set DPL_SLOW_TESTS=1"
)
def test_meteor_jar_default_configuration():
    preds = [refs[1] for refs in CORPUS_REFS]
    assert compute_metrics(preds, [[r[1]] for r in CORPUS_REFS], ["meteor"], meteor_backend="java")[
        "meteor"
    ] == pytest.approx(1.0)
    auto = compute_metrics(preds, [[r[0]] for r in CORPUS_REFS], ["meteor"])["meteor"]
    assert 0.0 < auto < 1.0
