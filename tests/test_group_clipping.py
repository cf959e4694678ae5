"""privacy.clipping: per_layer: group-wise clipping in the one backward pass against a one-example-at-a-time loop
that clips each group on its own (tiny BERT and Llama from configs, full and LoRA, activation checkpointing on and
off, per example and per user); each group's contribution is within its threshold; the groups and thresholds."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import random_batch, tiny_bert, tiny_llama

from dpl.core import clipping_policy as policy
from dpl.core.per_example import PerExampleClipper
from dpl.errors import ConfigError
from dpl.tasks.modules.classification import FinetuneOptions, LoraOptions, apply_finetuning


def _loss_fn(model):
    def losses(batch):
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        return F.cross_entropy(out.logits, batch["labels"], reduction="none")
    return losses


def _build(name: str, checkpointing: bool, dtype=torch.float64):
    model = (tiny_bert if name.startswith("bert") else tiny_llama)()
    options = FinetuneOptions(method="lora" if name.endswith("lora") else "full", gradient_checkpointing=checkpointing,
                              lora=LoraOptions(r=2, target_modules=None))
    return apply_finetuning(model, options, "SEQ_CLS").to(dtype)


def reference(model, batch, groups, thresholds, units=None):
    """The oracle: per example (or unit: the gradient of its rows' mean loss), each group's gradient clipped to its
    threshold with ordinary autograd; returns the sums and each unit's per-group clipped norms."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    total = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in params.items()}
    size = batch["labels"].shape[0]
    rows_of = [torch.tensor([i]) for i in range(size)] if units is None else [
        (units == u).nonzero().flatten() for u in units.unique_consecutive().tolist()]
    clipped_norms, within = [], torch.zeros(len(groups))
    for rows in rows_of:
        one = {k: v[rows] for k, v in batch.items()}
        grads = torch.autograd.grad(_loss_fn(model)(one).mean(), list(params.values()), allow_unused=True)
        grads = {n: (torch.zeros_like(p) if g is None else g).double() for (n, p), g in zip(params.items(), grads)}
        norms = []
        for g_index, (names, threshold) in enumerate(zip(groups, thresholds)):
            norm = math.sqrt(sum(float(grads[n].pow(2).sum()) for n in names))
            factor = min(1.0, threshold / (norm + 1e-6))
            for n in names:
                total[n] += factor * grads[n]
            norms.append(factor * norm)
            within[g_index] += float(norm <= threshold) - 0.5
        clipped_norms.append(norms)
    return total, torch.tensor(clipped_norms), within


def _grouped(model, batch, groups, thresholds, units=None):
    clipper = PerExampleClipper(model)
    clipper.set_groups(groups)
    with clipper.record(batch["labels"].shape[0]):
        losses = _loss_fn(model)(batch)
    if units is not None:
        losses = losses / torch.bincount(units)[units].to(losses.dtype)
    return clipper.group_clipped_sum(losses, torch.tensor(thresholds), units=units)


def _check(model, batch, patterns=None, units=None, max_norm=0.05):
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    groups = policy.clipping_groups(names, patterns)
    thresholds = policy.group_thresholds(max_norm, [sum(dict(model.named_parameters())[n].numel() for n in g)
                                                    for g in groups])
    sums, _, counts = _grouped(model, batch, groups, thresholds, units)
    expected, clipped_norms, within = reference(model, batch, groups, thresholds, units)
    assert list(sums) == names
    for name in names:  # the clipper's norms and sums are float32: a few float32 ulps (2^-24) of the terms summed
        torch.testing.assert_close(sums[name].double(), expected[name], rtol=1e-5, atol=1e-6, msg=name)
    # each group's contribution of each unit within its threshold (the +1e-6 of the factor's denominator below it)
    assert bool((clipped_norms <= torch.tensor(thresholds, dtype=torch.float64) * (1 + 1e-9)).all())
    assert torch.equal(counts.double(), within.double())  # no norm within float32 rounding of its threshold here
    assert math.isclose(sum(c * c for c in thresholds), max_norm ** 2, rel_tol=1e-12)
    return groups


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
@pytest.mark.parametrize("name", ["bert-full", "llama-full", "bert-lora", "llama-lora"])
@pytest.mark.parametrize("length", [6, 24], ids=["gram", "per-example"])
def test_per_layer_matches_the_loop(name, checkpointing, length):
    model = _build(name, checkpointing)
    groups = _check(model, random_batch(batch_size=5, length=length))
    assert len(groups) == len({n.rpartition(".")[0] for g in groups for n in g}) > 4


def _spy_paths(monkeypatch) -> dict[str, list[str]]:
    """Record which layers form their clipped sum with their norms, chunk by chunk (``fused``), and which from their
    inputs and output gradients after their norms (``direct``)."""
    from dpl.core import group_clipping, layer_gradients

    paths: dict[str, list[str]] = {"fused": [], "direct": []}
    fused, direct = layer_gradients.clipped_in_chunks, layer_gradients._direct_sums

    def spy_fused(rec, *rest):
        out = fused(rec, *rest)
        if out is not None:
            paths["fused"].append(rec.kind)
        return out
    monkeypatch.setattr(group_clipping, "clipped_in_chunks", spy_fused)
    monkeypatch.setattr(layer_gradients, "_direct_sums",
                        lambda rec, *rest: paths["direct"].append(rec.kind) or direct(rec, *rest))
    return paths


@pytest.mark.parametrize("name", ["llama-full", "bert-full"])  # BERT's linear layers have biases
@pytest.mark.parametrize("patterns", [None, ["*.0.*", "*"]], ids=["layers", "groups"])
@pytest.mark.parametrize("length", [6, 24], ids=["gram", "per-example"])
def test_norms_in_chunks_match_the_loop(monkeypatch, length, patterns, name):
    """A norm chunk of a few examples (at length 6 a Gram layer's 2 T^2 + T (d_in + d_out) is at most 360 elements
    per example: chunks of 2; at 24 a per-example weight gradient 16 * 32 + 24 * 48 = 1,664: chunks of one, the
    batch's 5 * 512 above the chunk, so not formed once for the whole batch). A linear layer clipped on its own on
    the per-example path forms each chunk's per-example gradients once, for its norms and its sum together; on the
    Gram path, or in a group of several layers, its norms come in chunks and its sum from its inputs and output
    gradients. Both equal the loop, per example and per user."""
    monkeypatch.setattr(policy, "NORM_CHUNK", 720 if length == 6 else 2000)
    paths = _spy_paths(monkeypatch)
    model = _build(name, False)
    _check(model, random_batch(batch_size=5, length=length), patterns)
    if length == 24 and patterns is None:
        assert "linear" in paths["fused"] and "linear" not in paths["direct"]
    else:
        assert not paths["fused"] and "linear" in paths["direct"]
    if length == 6:
        assert "embedding" in paths["direct"]  # an embedding's norms: always Gram
    # users (a unit's tokens are its rows', so 6 positions x 2 rows can take the per-example path)
    _check(model, random_batch(batch_size=6, length=length), patterns, units=torch.tensor([0, 0, 1, 2, 2, 3]))


@pytest.mark.parametrize("how", ["exclude", "not-finite"])
@pytest.mark.parametrize("length", [6, 24], ids=["gram", "per-example"])
def test_excluded_examples_add_nothing_on_every_path(monkeypatch, length, how):
    """Rows flagged in ``exclude`` (FSDP's fillers), or whose gradient is not finite (a loss times inf), add exactly
    nothing and are not counted, whether a layer forms its sum with its norms chunk by chunk or after them: the sums
    and counts of the other rows alone."""
    monkeypatch.setattr(policy, "NORM_CHUNK", 720 if length == 6 else 2000)
    paths = _spy_paths(monkeypatch)
    model = _build("llama-full", False)
    batch = random_batch(batch_size=5, length=length)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    groups = policy.clipping_groups(names)
    thresholds = policy.group_thresholds(0.05, [sum(dict(model.named_parameters())[n].numel() for n in g)
                                                for g in groups])
    clipper = PerExampleClipper(model)
    clipper.set_groups(groups)
    flagged = torch.tensor([False, True, False, False, True])
    with clipper.record(5):
        losses = _loss_fn(model)(batch)
    if how == "not-finite":
        losses = losses * torch.where(flagged, math.inf, 1.0).to(losses.dtype)
    sums, _, counts = clipper.group_clipped_sum(losses, torch.tensor(thresholds),
                                                exclude=flagged if how == "exclude" else None)
    kept = torch.tensor([0, 2, 3])
    expected, _, within = reference(model, {k: v[kept] for k, v in batch.items()}, groups, thresholds)
    for name in names:
        torch.testing.assert_close(sums[name].double(), expected[name], rtol=1e-5, atol=1e-6, msg=name)
    assert torch.equal(counts.double(), within.double())
    assert bool(paths["fused"]) == (length == 24)


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
def test_users_match_the_loop(checkpointing):
    model = _build("llama-full", checkpointing)
    _check(model, random_batch(batch_size=6, length=12), units=torch.tensor([0, 0, 0, 1, 2, 2]))


def test_groups_by_pattern_match_the_loop():
    model = _build("llama-full", checkpointing=True)
    groups = _check(model, random_batch(batch_size=4, length=10),
                    patterns=["*.layers.0.*", "*.layers.1.*", "*embed*", "*"])
    assert len(groups) == 4 and all(".layers.0." in n for n in groups[0])


def test_bf16_norms_and_sums_in_float32():
    """Under bf16 autocast (``bf16-mixed``) the clipped sum is float32 and matches the float64 loop within bf16's
    rounding of the activations and output gradients (2^-8 relative, through two blocks: 3% of the largest entry)."""
    model = _build("llama-full", checkpointing=True, dtype=torch.float32)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    groups = policy.clipping_groups(names)
    thresholds = policy.group_thresholds(0.05, [1] * len(groups))
    batch = random_batch(batch_size=4, length=8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        sums, _, _ = _grouped(model, batch, groups, thresholds)
    assert all(t.dtype == torch.float32 for t in sums.values())
    expected, _, _ = reference(model.double(), batch, groups, thresholds)
    for name in names:
        scale = float(expected[name].abs().max())
        assert float((sums[name].double() - expected[name]).abs().max()) <= 0.03 * scale + 1e-7, name


def test_bad_groups_and_thresholds_in_one_line():
    names = ["a.weight", "a.bias", "b.weight"]
    assert policy.clipping_groups(names) == [["a.weight", "a.bias"], ["b.weight"]]
    for patterns, message in [(["a.*"], "'b.weight' matches no pattern"),
                              (["a.*", "c.*", "*"], "pattern 'c.*' matches no trainable parameter"),
                              (["*.bias", "*"], "the parameters of layer 'a' fall in patterns")]:
        with pytest.raises(ConfigError) as info:
            policy.clipping_groups(names, patterns)
        assert message in str(info.value) and "\n" not in str(info.value)
    assert policy.group_thresholds(1.0, [1, 3]) == pytest.approx([0.5, math.sqrt(0.75)])
    assert policy.group_thresholds(5.0, [1, 1], [3.0, 4.0]) == [3.0, 4.0]
    with pytest.raises(ConfigError, match="add up to 2, not C\\^2 = 25"):
        policy.group_thresholds(5.0, [1, 1], [1.0, 1.0])
    with pytest.raises(ConfigError, match="2 thresholds for 3 groups"):
        policy.group_thresholds(1.0, [1, 1, 1], [0.5, 0.5])
