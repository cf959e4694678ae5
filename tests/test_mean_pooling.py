"""DPClassificationModule with ``pooling: mean``: the head reads the mean of the real tokens' hidden states, and
dpl's per-example clipping gives the same clipped sums as a one-example-at-a-time loop."""

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import random_batch, reference_clipped_sum, save_tiny_bert, tiny_bert

from dpl.errors import ConfigError
from dpl.tasks.modules.classification import (DPClassificationModule, FinetuneOptions, LoraOptions, MeanPoolClassifier,
                                        apply_finetuning, mean_pool)
from dpl.core.per_example import PerExampleClipper


def _mean_pooled(lora: bool, seed: int = 0) -> MeanPoolClassifier:
    bert = tiny_bert(seed=seed).bert
    bert.pooler = None
    if lora:
        bert = apply_finetuning(bert, FinetuneOptions(method="lora", lora=LoraOptions(r=2, target_modules=None)),
                                "FEATURE_EXTRACTION")
    torch.manual_seed(seed + 1)
    return MeanPoolClassifier(bert, hidden_size=16, num_labels=2, dropout=0.0).train()


def test_mean_pool_ignores_padded_positions():
    hidden = torch.randn(3, 5, 4)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    pooled = mean_pool(hidden, mask)
    for i, n in enumerate(mask.sum(1).tolist()):
        torch.testing.assert_close(pooled[i], hidden[i, :n].mean(0))
    changed = hidden.clone()
    changed[mask == 0] = 1e6  # whatever sits at the padded positions
    torch.testing.assert_close(mean_pool(changed, mask), pooled)
    torch.testing.assert_close(mean_pool(hidden, None), hidden.mean(1))


def test_logits_do_not_depend_on_padding():
    model = _mean_pooled(lora=False).eval()
    batch = random_batch(batch_size=4, length=7)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    for i in range(4):
        n = int(batch["attention_mask"][i].sum())
        alone = model(input_ids=batch["input_ids"][i:i + 1, :n], attention_mask=batch["attention_mask"][i:i + 1, :n])
        torch.testing.assert_close(alone.logits[0], logits[i], rtol=1e-5, atol=1e-6)
    other = batch["input_ids"].clone()
    other[batch["attention_mask"] == 0] = 7  # other token ids under the padding
    torch.testing.assert_close(model(input_ids=other, attention_mask=batch["attention_mask"]).logits, logits)


def _losses(model, batch):
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    return F.cross_entropy(out.logits, batch["labels"], reduction="none")


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("max_norm", [0.05, math.inf])
def test_clipped_sums_match_a_per_example_loop(lora, max_norm):
    model = _mean_pooled(lora).double()
    batch = random_batch(batch_size=5)
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert any(n.startswith("classifier.") for n in params) and (not lora or any("lora_" in n for n in params))
    clipper = PerExampleClipper(model)
    with clipper.record(5):
        losses = _losses(model, batch)
    sums, norms = clipper.clipped_sum(losses, max_norm)
    clipper.remove()

    expected, expected_norms = reference_clipped_sum(lambda b: _losses(model, b), model, batch, max_norm)
    assert set(sums) == set(expected)
    torch.testing.assert_close(norms.double(), expected_norms, rtol=1e-5, atol=1e-7)
    for name in expected:
        torch.testing.assert_close(sums[name].double(), expected[name], rtol=1e-4, atol=1e-6, msg=name)


def test_module_builds_a_mean_pooled_model(tmp_path, caplog):
    folder = save_tiny_bert(tmp_path / "bert")
    module = DPClassificationModule(model=folder, num_labels=2, pooling="mean",
                                    finetuning=FinetuneOptions(method="lora", lora=LoraOptions(
                                        r=2, target_modules=["query", "value"])))
    with caplog.at_level("INFO"):
        model = module.ensure_model()
    assert isinstance(model, MeanPoolClassifier) and model.training
    assert "new classification head classifier.bias, classifier.weight" in caplog.text
    trainable = set(module.trainable)
    assert {"classifier.weight", "classifier.bias"} <= trainable
    assert all(n.startswith("classifier.") or "lora_" in n for n in trainable), trainable
    assert not any("pooler" in n for n, _ in model.named_parameters())  # unused: removed, so nothing unclipped
    batch = random_batch(batch_size=3, vocab=20)
    assert module(batch).shape == (3, 2)
    assert module.per_example_loss(batch).shape == (3,)

    frozen = DPClassificationModule(model=folder, num_labels=2, pooling="mean",
                                    finetuning=FinetuneOptions(freeze=["encoder.*"]))
    assert set(frozen.trainable) == {"classifier.weight", "classifier.bias"}  # freeze globs see the wrapper's names


def test_unknown_pooling_refused():
    with pytest.raises(ConfigError, match="pooling"):
        DPClassificationModule(pooling="max")


def test_trailing_padding_columns_are_dropped_without_changing_logits(tmp_path):
    from dpl.tasks.modules.classification import trim_trailing_padding

    batch = random_batch(batch_size=4, length=7, vocab=20)
    wide = {k: torch.cat([v, torch.zeros(4, 5, dtype=v.dtype)], dim=1) if v.dim() == 2 else v
            for k, v in batch.items()}  # the padding of a longer example elsewhere in the logical batch
    trimmed = trim_trailing_padding({k: wide[k] for k in ("input_ids", "attention_mask")})
    longest = int(batch["attention_mask"].sum(1).max())
    assert trimmed["input_ids"].shape == (4, longest) and trimmed["attention_mask"].shape == (4, longest)
    assert trim_trailing_padding({"input_ids": batch["input_ids"]})["input_ids"] is batch["input_ids"]
    for pooling in ("model", "mean"):
        module = DPClassificationModule(model=save_tiny_bert(tmp_path / pooling), num_labels=2, pooling=pooling)
        module.ensure_model().eval()
        torch.testing.assert_close(module(wide), module(batch), rtol=1e-5, atol=1e-6)


def test_step_orders_a_logical_batch_longest_first():
    """dpl's step cuts a logical batch into micro-batches longest first (every per-example value permuted alike,
    FSDP's filler flags included), so micro-batches of similar lengths carry little padding."""
    from dpl.core.step import PADDING_KEY
    from dpl.core.step import split_batch

    lengths = [3, 9, 5, 1, 5]
    mask = torch.tensor([[1] * n + [0] * (9 - n) for n in lengths])
    batch = {"input_ids": mask * 7, "attention_mask": mask, "labels": torch.tensor(lengths),
             "names": [f"e{n}" for n in lengths], PADDING_KEY: torch.tensor([False, True, False, False, True])}
    micro = list(split_batch(batch, 2))
    assert [m["attention_mask"].sum(1).tolist() for m in micro] == [[9, 5], [5, 3], [1]]
    assert [m["labels"].tolist() for m in micro] == [[9, 5], [5, 3], [1]]  # labels follow their examples
    assert [m["names"] for m in micro] == [["e9", "e5"], ["e5", "e3"], ["e1"]]
    assert [m[PADDING_KEY].tolist() for m in micro] == [[True, False], [True, False], [False]]  # stable: 5 then 5
    assert list(split_batch(batch, 8))[0]["labels"].tolist() == lengths  # one micro-batch: order left as it is
