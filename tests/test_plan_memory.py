"""``dpl plan``'s memory block: the formulas on hand-computed layers, auto's budget, the quickstart's block, and the
prediction against what the clipper really holds on a tiny Llama."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import save_tiny_bert, save_tiny_llama_lm, tiny_llama_lm

from dpl.cli import main
from dpl.core import clipping_policy
from dpl.core.per_example import PerExampleClipper
from dpl.planning import memory
from dpl.planning.memory import (
    NORM_CHUNK,
    KindMemory,
    LayerShape,
    auto_choices,
    auto_keeps,
    keeps_in_any_order,
    memory_lines,
    plan_memory,
    shape_of,
)
from dpl.planning.quick import quick_plan
from dpl.tasks.modules.classification import FinetuneOptions, LoraOptions, apply_finetuning

ROOT = Path(__file__).resolve().parents[1]
MIB = 2 ** 20


def test_constants_are_the_clippers():
    assert NORM_CHUNK is clipping_policy.NORM_CHUNK


def test_the_default_budget_is_a_quarter_of_the_available_ram(monkeypatch):
    monkeypatch.setattr(clipping_policy, "available_ram_bytes", lambda: 8 * 1024 * MIB)
    memory._default_budget.cache_clear()
    try:
        m = plan_memory([LayerShape("linear", 8, 4, 36)], physical_batch_size=2, tokens=5, mode="auto",
                        budget_mib=None, precision="32-true")
        assert m.budget_bytes == 2048 * MIB == clipping_policy.default_budget_bytes()
        assert "auto's budget 2,048 MiB (default: a quarter of the available RAM here; on CUDA of the free memory " \
               "at the first step)" in "\n".join(memory_lines(m))
        assert clipping_policy.default_budget_bytes(4 * MIB) == MIB  # CUDA: a quarter of the free memory
    finally:
        memory._default_budget.cache_clear()


# ------------------------------------------------------------------------------------------- the formulas


def _one(layer: LayerShape, batch: int, tokens: int, mode: str = "auto", budget: float | None = None,
         precision: str = "32-true"):
    return plan_memory([layer], physical_batch_size=batch, tokens=tokens, mode=mode, budget_mib=budget,
                       precision=precision)


def test_one_linear_layer_on_the_per_example_path():
    # b = 3, T = 5, d_in = 8, d_out = 4 with a bias: T^2 (d_in + d_out) = 300 >= d_in d_out T = 160
    layer = LayerShape("linear", 8, 4, 8 * 4 + 4)
    m = _one(layer, 3, 5)
    g, per_example_state = 4 * 3 * 5 * 4, 4 * 3 * 36
    assert m.fast == g + per_example_state == 672 and m.fast_transient == 0
    assert m.auto == per_example_state == 432 and m.kinds == [KindMemory("linear", 1, 36, 672, 1, 432, 432)]
    # low: one chunk of the 3 examples: d_in d_out + T (d_in + d_out) = 92 elements each
    assert m.low_transient == 4 * 3 * (32 + 5 * 12)
    bf16 = _one(layer, 3, 5, precision="bf16-mixed")  # g in bfloat16, per-example gradients in float32
    assert bf16.fast == 2 * 3 * 5 * 4 + per_example_state


def test_one_linear_layer_on_the_gram_path():
    # T = 2: T^2 (d_in + d_out) = 48 < d_in d_out T = 64: two (b, T, T) Gram matrices, transient
    layer = LayerShape("linear", 8, 4, 8 * 4 + 4)
    m = _one(layer, 3, 2, mode="fast")
    assert m.fast == 4 * 3 * 2 * 4 + 4 * 3 * 4  # g and the per-example bias gradient
    assert m.fast_transient == 2 * 4 * 3 * 2 * 2
    # auto holds the smaller of the per-example gradients (4 b 36 = 432 bytes) and the book (g: 4 b T 4; its input a
    # is autograd's saved activation), which is fast's state less the per-example bias gradient
    assert m.auto == 4 * 3 * 2 * 4 < m.fast and m.kinds[0].booked_layers == 1
    # under activation checkpointing both books hold the input too (4 b T 8), which the recomputation would drop
    checkpointed = plan_memory([layer], physical_batch_size=3, tokens=2, mode="fast", budget_mib=None,
                               precision="32-true", checkpointing=True)
    assert checkpointed.auto == 4 * 3 * 2 * (8 + 4) and checkpointed.fast == m.fast + 4 * 3 * 2 * 8


def test_norm_and_embedding_layers():
    norm, embedding = LayerShape("rms_norm", 16, 16, 16), LayerShape("embedding", 50, 16, 800)
    m = plan_memory([norm, embedding], physical_batch_size=2, tokens=3, mode="auto", budget_mib=None,
                    precision="32-true")
    assert m.fast == (4 * 2 * 3 * 16 + 4 * 2 * 16) + 4 * 2 * 3 * 16 and m.fast_transient == 2 * 4 * 2 * 3 * 3
    # the norm's per-example gradients kept; the embedding's never, but its book (g) fits the budget
    assert m.auto == 4 * 2 * 16 + 4 * 2 * 3 * 16
    assert [(k.kind, k.kept_layers, k.booked_layers) for k in m.kinds] == [("embedding", 0, 1), ("rms_norm", 1, 0)]
    none = plan_memory([norm, embedding], physical_batch_size=2, tokens=3, mode="auto", budget_mib=4 * 2 * 16 / MIB,
                       precision="32-true")
    assert none.auto == 4 * 2 * 16 and "1 layer kept; 1 as low" in "\n".join(memory_lines(none))


def test_auto_under_bf16_keeps_fasts_state_for_the_layers_not_kept():
    linear, embedding = LayerShape("linear", 8, 4, 36), LayerShape("embedding", 50, 8, 400)
    # room for one linear layer's per-example gradients (4 x 4 x 36 = 576 bytes), not two
    m = plan_memory([linear, embedding, linear], physical_batch_size=4, tokens=10, mode="auto",
                    budget_mib=600 / MIB, precision="bf16-mixed")
    kept, linear_fast, embedding_fast = 576, 2 * 4 * 10 * 4 + 576, 4 * 4 * 10 * 8
    assert m.auto == kept + linear_fast + embedding_fast
    assert [(k.kind, k.kept_layers, k.kept, k.auto) for k in m.kinds] == [
        ("linear", 1, kept, kept + linear_fast), ("embedding", 0, 0, embedding_fast)]
    text = "\n".join(memory_lines(m))
    assert "(auto): 2.69 KiB (1 layer kept, 2 with fast's state)" in text and "low refused under bf16" in text


def test_auto_keeps_layers_only_while_they_fit():
    layers = [LayerShape("linear", 16, 16, 272), LayerShape("embedding", 50, 16, 800),
              LayerShape("layer_norm", 16, 16, 32), LayerShape("linear", 16, 32, 544)]
    assert auto_keeps(layers, 4, 0) == [False] * 4
    assert auto_keeps(layers, 4, 10 ** 9) == [True, False, True, True]
    # room for the first and the norm only: greedy in the order given (the backward pass's)
    assert auto_keeps(layers, 4, 4 * 4 * (272 + 32)) == [True, False, True, False]
    assert keeps_in_any_order(layers, 4, 0) and keeps_in_any_order(layers, 4, 10 ** 9)
    assert not keeps_in_any_order(layers, 4, 4 * 4 * (272 + 32))
    tiny = plan_memory(layers, physical_batch_size=4, tokens=8, mode="auto", budget_mib=0.0, precision="32-true")
    assert tiny.auto == 0 and all(k.kept_layers == 0 for k in tiny.kinds)
    huge = plan_memory(layers, physical_batch_size=4, tokens=8, mode="auto", budget_mib=1e6, precision="32-true")
    # one pass: each layer the smaller of its per-example gradients and its book. 16 x 16 at T = 8 is on the
    # per-example path (T (d_in + d_out) >= d_in d_out): book 4 b T 16 + 4 b 256 = 6,144 > 4,352 kept; 16 x 32 on the
    # Gram path: book 4 b T 32 = 4,096 < 8,704; the norm kept; the embedding's book (g)
    assert huge.auto == 4 * 4 * 272 + 4 * 4 * 8 * 32 + 4 * 4 * 32 + 4 * 4 * 8 * 16
    assert auto_choices(layers, 4, 10 ** 9, tokens=8) == ["kept", "booked", "kept", "booked"]
    booked = plan_memory(layers, physical_batch_size=4, tokens=8, mode="auto", budget_mib=4 * 4 * 272 / MIB,
                         precision="32-true")  # room for one layer's per-example gradients; no book fits the rest
    assert booked.auto == 4 * 4 * 272
    # a book fits where per-example gradients do not: a wide layer at few tokens (book 4 b T d_out; with
    # checkpointing 4 b T (d_in + d_out))
    wide = LayerShape("linear", 64, 64, 64 * 64)
    assert auto_choices([wide], 2, 4 * 2 * 3 * 64, tokens=3) == ["booked"]
    assert auto_choices([wide], 2, 4 * 2 * 3 * 64 - 1, tokens=3) == ["low"]
    assert auto_choices([wide], 2, 4 * 2 * 3 * 128 - 1, tokens=3, checkpointing=True) == ["low"]
    assert auto_choices([wide], 2, 0, tokens=3, bf16=True) == ["booked"]


def test_physical_batch_size_auto_is_predicted_per_example():
    layer = LayerShape("linear", 8, 4, 36)
    m = plan_memory([layer], physical_batch_size="auto", tokens=5, mode="auto", budget_mib=None,
                    precision="32-true")
    assert m.micro_batch is None and m.auto == 4 * 36 and m.fast == _one(layer, 1, 5).fast


def test_unknown_length_keeps_what_does_not_need_it():
    m = plan_memory([LayerShape("linear", 8, 4, 36)], physical_batch_size=2, tokens=None, mode="auto",
                    budget_mib=None, precision="32-true")
    assert m.fast is None and m.auto == 4 * 2 * 36
    text = "\n".join(memory_lines(m))
    assert "T unknown: the data module sets no max_length" in text and "fast needs T" in text


# ------------------------------------------------------------------------------------------- the plan


def test_the_quickstart_plan_prints_the_block(capsys):
    argv = ["--config", str(ROOT / "configs/quickstart.yaml")]
    report = quick_plan(argv)
    # MiniLM LoRA r 1 on query/value: 6 layers x 2 matrices x (A, B), and the head (384 x 2 + 2); b = 128
    assert report.memory.kinds == [KindMemory("linear", 25, 9_986, report.memory.fast, 25, 4 * 128 * 9_986,
                                              4 * 128 * 9_986)]
    assert report.memory.tokens == 64 and report.memory.micro_batch == 128 and report.memory.precision == "bf16-mixed"
    main(["plan", *argv])
    out = capsys.readouterr().out
    assert "  memory   micro-batch b = 128 (privacy.physical_batch_size), T = 64 tokens (data.max_length)" in out
    assert "linear      25       9,986" in out and "25 (4.88 MiB)" in out
    assert "above the non-private step (auto): 4.88 MiB (every layer kept: one backward pass, fast's time)" in out
    assert "low refused under bf16" in out


def test_a_plugins_own_gradient_estimate_is_not_predicted(tmp_path, capsys):
    bert = save_tiny_bert(tmp_path / "bert")
    main(["plan", "--config", str(ROOT / "configs/quickstart.yaml"), "--model.init_args.model", bert,
          "--data.init_args.tokenizer", bert, "--data.init_args.train_size", "400", "--data.init_args.validation_size",
          "20", "--trainer.precision", "32-true", "--model.init_args.plugins", "{dpzero: {}}",
          "--model.init_args.privacy.batch_size", "16", "--model.init_args.optimizer", "torch.optim.SGD"])
    out = capsys.readouterr().out
    assert "  memory   not predicted: the gradient estimate is dpzero's own, not per-example clipping" in out


def test_the_skeleton_has_the_real_models_layers(tmp_path):
    from dpl.planning.skeleton import build_without_weights
    from dpl.tasks.modules import DPGenerationModule

    folder = save_tiny_llama_lm(tmp_path / "llama", tie=False)

    def layers(model):
        clipper = PerExampleClipper(model)
        clipper.remove()
        return [shape_of(rec) for rec in clipper.records]

    planned = build_without_weights(DPGenerationModule(model=folder))
    real = DPGenerationModule(model=folder).ensure_model(None)
    assert layers(planned) == layers(real)
    assert {s.kind for s in layers(real)} == {"linear", "embedding", "rms_norm"}


# ------------------------------------------------------------------------------- against what dpl holds


def _held(model, budget_mib: float, batch: int = 3, tokens: int = 7) -> int:
    """``auto``'s peak bytes of kept per-example gradients in one real step."""
    clipper = PerExampleClipper(model, memory="auto", budget_mib=budget_mib)
    ids = torch.randint(3, 50, (batch, tokens), generator=torch.Generator().manual_seed(0))
    with clipper.record(batch):
        logits = model(input_ids=ids).logits
        losses = F.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none").mean(1)
    clipper.clipped_sum(losses, 1.0)
    return clipper.peak_held_bytes


def _layers(model) -> list:
    clipper = PerExampleClipper(model)
    clipper.remove()
    return [shape_of(rec) for rec in reversed(clipper.records)]


def _predicted(model, budget_mib: float, batch: int = 3, tokens: int = 7) -> int:
    clipper = PerExampleClipper(model)
    clipper.remove()
    layers = [shape_of(rec) for rec in reversed(clipper.records)]
    return plan_memory(layers, physical_batch_size=batch, tokens=tokens, mode="auto", budget_mib=budget_mib,
                       precision="32-true").auto


@pytest.mark.parametrize("budget", [0.0, 64.0], ids=["none-kept", "all-kept"])
def test_auto_prediction_is_what_a_full_fine_tuning_step_holds(budget):
    model = tiny_llama_lm()
    predicted = _predicted(model, budget)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    embedding = model.get_input_embeddings().weight.numel()
    layers = _layers(model)
    one_pass = sum(min(c for c in pair if c is not None) for pair in memory._costs(layers, 3, 7))
    assert predicted == (0 if budget == 0 else one_pass)  # one pass: each layer the smaller of its two states
    assert _held(model, budget) == predicted


@pytest.mark.parametrize("kept", [0, 3, 5, 8])
def test_auto_prediction_is_what_a_lora_step_holds_within_its_budget(kept):
    # LoRA r 2 on q_proj and o_proj (16 x 16): every A and B has 32 parameters, so the budget keeps `kept` of the 8
    # layers whatever their order
    model = apply_finetuning(tiny_llama_lm(), FinetuneOptions(method="lora", lora=LoraOptions(
        r=2, target_modules=["q_proj", "o_proj"])), "CAUSAL_LM")
    budget = (kept * 4 * 3 * 32 + 100) / MIB
    predicted = _predicted(model, budget)
    assert predicted == kept * 4 * 3 * 32
    assert _held(model, budget) == predicted


def test_auto_holds_no_more_than_fast_in_float32_and_the_plan_says_when_it_does():
    """A book holds what fast holds of its layer (g, per-example gradients on that path, inputs only under
    checkpointing), so float32 auto never holds more than fast; under bf16 a kept layer's float32 per-example
    gradients can exceed the bfloat16 g fast holds, and the plan says so."""
    layer = LayerShape("linear", 64, 64, 64 * 64 + 64)  # T = 2: the Gram path
    for checkpointing in (False, True):
        m = plan_memory([layer], physical_batch_size=3, tokens=2, mode="auto", budget_mib=1.0, precision="32-true",
                        checkpointing=checkpointing)
        assert m.auto <= m.fast and "auto holds more than fast" not in "\n".join(memory_lines(m))
        assert "one backward pass, fast's time" in "\n".join(memory_lines(m))
    bf16 = _one(layer, 3, 2, budget=1.0, precision="bf16-mixed")
    assert bf16.auto == 4 * 3 * (64 * 64 + 64) > bf16.fast == 2 * 3 * 2 * 64 + 4 * 3 * 64
    assert "auto holds more than fast here" in "\n".join(memory_lines(bf16))
