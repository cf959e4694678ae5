"""Per-example clipped sums from dpl.core.per_example equal a one-example-at-a-time loop."""

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import random_batch, reference_clipped_sum, tiny_bert, tiny_llama
from torch import nn

from dpl.errors import ConfigError
from dpl.tasks.modules.classification import FinetuneOptions, LoraOptions, apply_finetuning
from dpl.core.layer_gradients import LayerRecord, prepare
from dpl.core.per_example import PerExampleClipper


def _loss_fn(model):
    def losses(batch):
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        return F.cross_entropy(out.logits, batch["labels"], reduction="none")
    return losses


def _reference(model, batch, max_norm):
    """Clipped sum by looping over examples with ordinary autograd."""
    return reference_clipped_sum(_loss_fn(model), model, batch, max_norm)


def _lora(model):
    return apply_finetuning(model, FinetuneOptions(method="lora", lora=LoraOptions(r=2, target_modules=None)),
                            "SEQ_CLS")


@pytest.mark.parametrize("build", [tiny_bert, tiny_llama, lambda: _lora(tiny_bert()), lambda: _lora(tiny_llama())],
                         ids=["bert-full", "llama-full", "bert-lora", "llama-lora"])
@pytest.mark.parametrize("max_norm", [0.05, math.inf])
def test_matches_loop(build, max_norm):
    model = build().double()
    batch = random_batch(batch_size=5)
    clipper = PerExampleClipper(model)
    with clipper.record(5):
        losses = _loss_fn(model)(batch)
    sums, norms = clipper.clipped_sum(losses, max_norm)
    expected, expected_norms = _reference(model, batch, max_norm)
    assert set(sums) == set(expected)
    torch.testing.assert_close(norms.double(), expected_norms, rtol=1e-5, atol=1e-7)
    for name in expected:
        torch.testing.assert_close(sums[name].double(), expected[name], rtol=1e-4, atol=1e-6, msg=name)


def test_every_contribution_bounded():
    model = tiny_bert()
    batch = random_batch(batch_size=6)
    clipper = PerExampleClipper(model)
    max_norm = 0.1
    for i in range(6):
        one = {k: v[i:i + 1] for k, v in batch.items()}
        with clipper.record(1):
            losses = _loss_fn(model)(one)
        sums, norms = clipper.clipped_sum(losses, max_norm)
        total = torch.sqrt(sum(t.pow(2).sum() for t in sums.values()))
        assert norms[0] > max_norm  # the test is meaningful: clipping happened
        assert total <= max_norm * (1 + 1e-5)


@pytest.mark.parametrize("build", [tiny_bert, lambda: _lora(tiny_bert())], ids=["bert-full", "bert-lora"])
def test_every_contribution_bounded_under_bf16_autocast(build):
    """bf16-mixed runs the step under autocast: the norms and the sums must still be float32 products of the same
    recorded values, else an example's contribution exceeds max_norm by the bfloat16 rounding (~1e-3)."""
    torch.manual_seed(0)
    model = build()
    batch = random_batch(batch_size=8)
    clipper = PerExampleClipper(model)
    max_norm = 0.1
    excess = []
    for i in range(8):
        one = {k: v[i:i + 1] for k, v in batch.items()}
        with torch.autocast("cpu", dtype=torch.bfloat16):
            with clipper.record(1):
                losses = _loss_fn(model)(one).float()
            sums, norms = clipper.clipped_sum(losses, max_norm)
        assert all(t.dtype == torch.float32 for t in sums.values())
        assert norms[0] > max_norm
        total = torch.sqrt(sum(t.double().pow(2).sum() for t in sums.values()))
        excess.append(float(total / max_norm - 1))
    assert max(excess) <= 1e-5, excess


@pytest.mark.parametrize("steps,d_in,d_out", [(4, 8, 8), (1, 8, 8), (40, 3, 2), (40, 2, 3)])
def test_prepared_linear_holds_bf16_recordings_without_float32_copies(steps, d_in, d_out):
    """Every layer's activations and output gradients are held until the clipping factors are known: float32 copies
    of them under bf16-mixed would double or triple the step's memory. The results equal float32 recordings'."""
    torch.manual_seed(0)
    layer = nn.Linear(d_in, d_out)
    x, g = torch.randn(4, steps, d_in).bfloat16(), torch.randn(4, steps, d_out).bfloat16()
    names = {"weight": "weight", "bias": "bias"}
    state = prepare(LayerRecord(layer, "linear", names, [x]), [g], {}, None)
    held = [c.cell_contents for c in state.weighted_sum.__closure__ if isinstance(c.cell_contents, torch.Tensor)]
    assert not [t for t in held if t.dtype == torch.float32 and t.shape in (x.shape, g.shape)]
    upcast = prepare(LayerRecord(layer, "linear", names, [x.float()]), [g.float()], {}, None)
    factors = torch.tensor([1.0, 0.5, 0.25, 0.0])
    assert torch.equal(state.sq_norms, upcast.sq_norms)
    for name, tensor in state.weighted_sum(factors).items():
        assert tensor.dtype == torch.float32 and torch.equal(tensor, upcast.weighted_sum(factors)[name])


@pytest.mark.parametrize("dot_chunk", [1 << 21, 5])
def test_both_ghost_and_materialized_linear_paths(monkeypatch, dot_chunk):
    # Short sequences pick the ghost norm, long-and-thin layers materialise (in either orientation: the narrower
    # side first, as LoRA's A (wide in, narrow out) and B (narrow in, wide out)): all must agree with the loop.
    # A small dot_chunk: the ghost norms' Gram products are dotted one example at a time.
    monkeypatch.setattr("dpl.core.layer_gradients._DOT_CHUNK", dot_chunk)
    torch.manual_seed(0)
    for steps, d_in, d_out in [(2, 8, 8), (40, 3, 2), (40, 2, 3), (30, 16, 2), (30, 2, 16)]:
        layer = nn.Linear(d_in, d_out).double()
        x = torch.randn(4, steps, d_in, dtype=torch.float64)
        clipper = PerExampleClipper(layer)
        with clipper.record(4):
            losses = layer(x).pow(2).sum((1, 2))
        sums, _ = clipper.clipped_sum(losses, 1.0)
        ref = {n: torch.zeros_like(p) for n, p in layer.named_parameters()}
        for i in range(4):
            grads = torch.autograd.grad(layer(x[i:i + 1]).pow(2).sum(), list(layer.parameters()))
            norm = torch.sqrt(sum(g.pow(2).sum() for g in grads))
            for (n, _), g in zip(layer.named_parameters(), grads):
                ref[n] += min(1.0, 1.0 / (float(norm) + 1e-6)) * g
        for n in ref:
            torch.testing.assert_close(sums[n].double(), ref[n])


def test_embedding_padding_idx_gets_no_gradient():
    emb = nn.Embedding(10, 4, padding_idx=0)
    ids = torch.tensor([[0, 1, 1], [2, 0, 3]])
    clipper = PerExampleClipper(emb)
    with clipper.record(2):
        losses = emb(ids).sum((1, 2))
    sums, norms = clipper.clipped_sum(losses, math.inf)
    assert torch.all(sums["weight"][0] == 0)
    torch.testing.assert_close(norms, torch.tensor([2 * 2.0, math.sqrt(8.0)]))  # ||2*ones(4)||, two rows


def test_tied_parameters_refused():
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight
    with pytest.raises(ConfigError, match="shared"):
        PerExampleClipper(model)


def test_frozen_parameters_ignored():
    model = tiny_bert()
    for name, p in model.named_parameters():
        if "embeddings" in name:
            p.requires_grad_(False)
    clipper = PerExampleClipper(model)
    assert not any("embeddings" in n for n in clipper.parameter_names)
    assert "classifier.weight" in clipper.parameter_names


def test_rms_norm_closed_form_only_where_it_holds():
    """Llama's RMSNorm gets the closed form (checked numerically at setup); a look-alike with another formula falls
    back to the exact path, and both give the loop's clipped sum (test_matches_loop covers llama-full)."""
    model = tiny_llama()
    kinds = {type(rec.module).__name__: rec.kind for rec in PerExampleClipper(model).records}
    assert kinds["LlamaRMSNorm"] == "rms_norm"

    class OddRMSNorm(nn.Module):  # named like an RMSNorm, but no normalization: the closed form would be wrong
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(4))
            self.eps = 1e-6

        def forward(self, x):
            return x * self.weight

    odd = nn.Sequential(nn.Linear(3, 4), OddRMSNorm(), nn.Linear(4, 2))
    clipper = PerExampleClipper(odd)
    assert [rec.kind for rec in clipper.records] == ["linear", "generic", "linear"]
    assert PerExampleClipper(nn.Sequential(nn.Linear(3, 4), nn.RMSNorm(4))).records[1].kind == "rms_norm"
