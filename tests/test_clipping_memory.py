"""privacy.clipping_memory: the clipped sums of fast, low and auto equal a one-example-at-a-time loop (full fine-tuning
and LoRA, with and without activation checkpointing, per example and per user); low holds no layer input that
checkpointing drops; auto holds no more per-example gradients than its budget; plugins train alike in every mode."""

from __future__ import annotations

import logging
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from helpers import random_batch, reference_clipped_sum, tiny_bert, tiny_llama

from dpl import PrivateTraining
from dpl.core.per_example import PerExampleClipper
from dpl.core.privacy import PrivacyConfig
from dpl.errors import ConfigError, PrivacyWarning
from dpl.tasks.modules.classification import FinetuneOptions, LoraOptions, apply_finetuning

#: (mode, auto's budget in MiB): auto with room for every layer, and with room for a few only
MODES = [("fast", None), ("low", None), ("auto", None), ("auto", 0.004)]
MODE_IDS = ["fast", "low", "auto", "auto-small-budget"]


def _loss_fn(model):
    def losses(batch):
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        return F.cross_entropy(out.logits, batch["labels"], reduction="none")
    return losses


def _build(name: str, checkpointing: bool):
    model = (tiny_bert if name.startswith("bert") else tiny_llama)()
    options = FinetuneOptions(method="lora" if name.endswith("lora") else "full", gradient_checkpointing=checkpointing,
                              lora=LoraOptions(r=2, target_modules=None))
    return apply_finetuning(model, options, "SEQ_CLS").double()


def _clipped(model, batch, mode, budget, max_norm, units=None, reforward=None):
    clipper = PerExampleClipper(model, memory=mode, budget_mib=budget)
    size = batch["labels"].shape[0]
    with clipper.record(size):
        losses = _loss_fn(model)(batch)
    if units is not None:
        losses = losses / torch.bincount(units)[units].to(losses.dtype)
    sums, norms = clipper.clipped_sum(losses, max_norm, units=units, reforward=reforward)
    return sums, norms, clipper


def _assert_matches(sums, norms, expected, expected_norms):
    assert set(sums) == set(expected)
    torch.testing.assert_close(norms.double(), expected_norms, rtol=1e-5, atol=1e-6)
    for name in expected:
        torch.testing.assert_close(sums[name].double(), expected[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("mode,budget", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
@pytest.mark.parametrize("name", ["bert-full", "llama-full", "bert-lora", "llama-lora"])
@pytest.mark.parametrize("length", [6, 24], ids=["gram", "per-example"])  # 16x16 layers: Gram below T = 8
def test_matches_loop(name, checkpointing, mode, budget, length):
    model = _build(name, checkpointing)
    batch = random_batch(batch_size=5, length=length)
    sums, norms, _ = _clipped(model, batch, mode, budget, 0.05)
    _assert_matches(sums, norms, *reference_clipped_sum(_loss_fn(model), model, batch, 0.05))


@pytest.mark.parametrize("mode,budget", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
def test_user_units_match_loop(mode, budget, checkpointing):
    model = _build("llama-full", checkpointing)
    batch = random_batch(batch_size=6, length=12)
    units = torch.tensor([0, 0, 0, 1, 2, 2])
    sums, norms, _ = _clipped(model, batch, mode, budget, 0.05, units=units)
    expected = reference_clipped_sum(_loss_fn(model), model, batch, 0.05, units=units)
    _assert_matches(sums, norms, *expected)


def test_the_paths_that_run():
    """Both the Gram and the per-example-gradient norms run in low mode at the lengths above (they are chosen by
    cost), and auto's small budget keeps some layers' gradients and sends the others to the second pass."""
    from dpl.core import layer_gradients

    seen = []
    original = layer_gradients._input_gram

    def spy(*args):
        seen.append("gram")
        return original(*args)

    layer_gradients._input_gram = spy
    try:
        model = _build("llama-full", False)
        _clipped(model, random_batch(batch_size=5, length=6), "low", None, 0.05)
        assert seen
        _, _, clipper = _clipped(model, random_batch(batch_size=5, length=6), "auto", 0.004, 0.05)
        assert 0 < clipper.peak_held_bytes <= 0.004 * 2 ** 20
    finally:
        layer_gradients._input_gram = original


@pytest.mark.parametrize("budget", [0.0, 0.001, 0.004, 0.02])
def test_auto_holds_no_more_than_its_budget(budget):
    model = _build("llama-full", True)
    batch = random_batch(batch_size=5, length=12)
    sums, norms, clipper = _clipped(model, batch, "auto", budget, 0.05)
    assert clipper.peak_held_bytes <= budget * 2 ** 20
    if budget == 0.0:
        assert clipper.peak_held_bytes == 0
    _assert_matches(sums, norms, *reference_clipped_sum(_loss_fn(model), model, batch, 0.05))


def test_auto_with_room_keeps_every_layer_and_needs_no_second_pass(monkeypatch):
    model = _build("llama-lora", False)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    calls = []
    original = torch.autograd.grad
    monkeypatch.setattr(torch.autograd, "grad", lambda *a, **k: calls.append(1) or original(*a, **k))
    _, _, clipper = _clipped(model, random_batch(batch_size=5, length=12), "auto", 64.0, 0.05)
    assert len(calls) == 1  # the norms' pass only
    embedding = 0  # LoRA: the embedding is frozen, every trainable layer is kept
    assert clipper.peak_held_bytes == 4 * 5 * (trainable - embedding)


def test_auto_says_once_when_layers_take_the_second_pass(caplog):
    """A budget that keeps no layer sends them all to the second backward pass: one line says how many and names
    per-layer clipping (one pass); a second step says nothing more, and a budget with room says nothing."""
    model, batch = _build("llama-full", False), random_batch(batch_size=5, length=12)
    clipper = PerExampleClipper(model, memory="auto", budget_mib=0.0)
    with caplog.at_level(logging.INFO, logger="dpl"):
        for _ in range(2):
            with clipper.record(5):
                losses = _loss_fn(model)(batch)
            clipper.clipped_sum(losses, 0.05)
    told = [r.getMessage() for r in caplog.records if "take a second backward pass" in r.getMessage()]
    layers = len({rec.module for rec in clipper.records})
    assert told == [f"dpl: clipping_memory auto: {layers} of {layers} layers do not fit its budget and take a second "
                    "backward pass every step; privacy.clipping: per_layer clips every layer in the one pass at the "
                    "non-private step's memory (docs/methods.md: which clipping when)"]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="dpl"):
        _clipped(model, batch, "auto", 64.0, 0.05)
    assert not any("second backward pass" in r.getMessage() for r in caplog.records)


def test_low_keeps_no_checkpointed_input_after_the_forward_pass():
    """Under checkpointing, low holds no layer input between the forward and the backward pass (fast holds all)."""
    model = _build("llama-full", True)
    batch = random_batch(batch_size=5, length=12)
    for mode in ("fast", "low"):
        clipper = PerExampleClipper(model, memory=mode)
        with clipper.record(5):
            losses = _loss_fn(model)(batch)
        if mode == "fast":
            held = sum(len(rec.inputs) for rec in clipper.records)
            assert held == len(clipper.records)
        else:
            calls = [c for _, layer in clipper.stream.layers.values() for c in layer.calls]
            decoder = [c for c in calls if c.deferred]
            assert len(decoder) == 2 * 9  # 2 layers x (q, k, v, o, gate, up, down, 2 norms)
            assert all(c.a is None for c in decoder)
        clipper.clipped_sum(losses, 0.05)
        clipper.remove()


@pytest.mark.parametrize("mode", ["low", "auto"])
def test_non_finite_example_contributes_zero(mode):
    model = _build("llama-full", False)
    batch = random_batch(batch_size=5, length=12)
    batch["input_ids"][0, 0] = 49
    batch["input_ids"][1:][batch["input_ids"][1:] == 49] = 48
    with torch.no_grad():
        model.get_input_embeddings().weight[49] = float("nan")

    def reforward(rows):  # the whole batch, each row not kept replaced by a kept one (no dropout here to replay)
        index = torch.where(rows, torch.arange(5), int(rows.nonzero()[0, 0]))
        return _loss_fn(model)({k: v[index] for k, v in batch.items()})

    sums, norms, _ = _clipped(model, batch, mode, 0.0 if mode == "auto" else None, 0.05, reforward=reforward)
    assert not math.isfinite(float(norms[0]))
    rest = {k: v[1:] for k, v in batch.items()}
    expected, _ = reference_clipped_sum(_loss_fn(model), model, rest, 0.05)
    for name in expected:
        assert torch.isfinite(sums[name]).all(), name
        torch.testing.assert_close(sums[name].double(), expected[name], rtol=1e-5, atol=1e-6, msg=name)


def _dropout_step(mode, budget, checkpointing, lora, seed, batch, max_norm):
    """The clip plugin's clipped sum of ``batch`` on a tiny BERT with dropout 0.5, the global generator seeded first."""
    from dpl.core.step import StepContext
    from plugins.clip import ClipPlugin

    options = FinetuneOptions(method="lora" if lora else "full", gradient_checkpointing=checkpointing,
                              lora=LoraOptions(r=2, target_modules=None))
    model = apply_finetuning(tiny_bert(dropout=0.5), options, "SEQ_CLS").double()
    with torch.no_grad():
        model.get_input_embeddings().weight[49] = float("nan")  # the first example's gradient is not finite
    plugin = ClipPlugin()
    plugin.memory, plugin.budget_mib = mode, budget
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    ctx = StepContext(model=model, trainable=trainable, per_example_loss=_loss_fn(model), max_grad_norm=max_norm,
                      noise_multiplier=0.0, expected_batch_size=2, step=0, noise_source=torch.Generator(),
                      log=lambda *_: None)
    torch.manual_seed(seed)
    return plugin.estimate_gradient(ctx, batch).values


#: float32's unit roundoff. The clipper forms norms and sums in float32 (from the float64 model's activations and
#: output gradients): each entry is a float32 sum of at most n = B * T products (the batch's tokens), so it is off by
#: at most ~n * U32 of its size; norms and sums of the same gradient then agree to ~n * U32 in norm
U32 = 2.0 ** -24


def _norm(sums):
    return math.sqrt(sum(float(t.double().pow(2).sum()) for t in sums.values()))


def _assert_same_sum(sums, expected, n):
    """``sums`` equal ``expected`` to float32 sums of ``n`` terms: ||sums - expected|| <= 2 n U32 ||expected|| (the
    difference taken as a whole: entries that cancel to ~0 have no relative precision of their own)."""
    difference = _norm({k: sums[k].double() - expected[k].double() for k in expected})
    assert difference <= 2 * n * U32 * _norm(expected), difference / _norm(expected)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("mode,budget", [("low", None), ("auto", 0.0)], ids=["low", "auto-nothing-kept"])
def test_non_finite_example_under_dropout_adds_at_most_c(mode, budget, lora):
    """With dropout 0.5 and a non-finite example, low/auto form the clipped sum by a second forward pass; it must
    draw the first pass's dropout masks, on which the clip factors were measured. A batch of that example and one
    whose gradient is far above C: the clipped sum is that one example's, of norm C * ||g|| / (||g|| + 1e-6) <= C up
    to float32 rounding (2 n U32, n = B * T the longest float32 sum), and equal to fast's (one pass) under the same
    seed. With fresh masks in the second pass (the replay removed from plugins.clip: ``with _replaying(rng):`` made a
    no-op) the norms reach ~1.1 C and fast's sum differs by O(1)."""
    batch = random_batch(batch_size=2, length=12)
    batch["input_ids"][0, 0] = 49
    batch["input_ids"][1][batch["input_ids"][1] == 49] = 48
    max_norm, n = 1e-4, 2 * 12
    for seed in range(6):
        sums = _dropout_step(mode, budget, False, lora, seed, batch, max_norm)
        assert 0.5 * max_norm < _norm(sums) <= max_norm * (1 + 2 * n * U32), (seed, _norm(sums) / max_norm)
        _assert_same_sum(sums, _dropout_step("fast", None, False, lora, seed, batch, max_norm), n)


@pytest.mark.parametrize("mode,budget", [("low", None), ("auto", 0.0)], ids=["low", "auto-nothing-kept"])
def test_second_backward_pass_under_checkpointing_and_dropout_matches_fast(mode, budget):
    """The second backward pass of low (and the first, under activation checkpointing) recomputes the checkpointed
    segments: with dropout 0.5 they must replay the forward pass's masks (torch's preserve_rng_state), so the
    clipped sum equals fast's (one forward and one backward pass) under the same seed, with and without a non-finite
    example (then a second forward pass too)."""
    clean = random_batch(batch_size=4, length=12)
    clean["input_ids"][clean["input_ids"] == 49] = 48
    broken = {k: v.clone() for k, v in clean.items()}
    broken["input_ids"][0, 0] = 49
    for batch in (clean, broken):
        for seed in range(3):
            sums = _dropout_step(mode, budget, True, False, seed, batch, 0.05)
            _assert_same_sum(sums, _dropout_step("fast", None, True, False, seed, batch, 0.05), 4 * 12)


def test_bad_value_refused_in_one_line():
    with pytest.raises(ConfigError) as info:
        PrivacyConfig(clipping_memory="medium").validate()
    assert "\n" not in str(info.value) and "fast, low or auto" in str(info.value)
    with pytest.raises(ConfigError, match="clipping_memory_budget"):
        PrivacyConfig(clipping_memory_budget=-1).validate()
    with pytest.raises(ConfigError, match="clipping_memory"):
        PerExampleClipper(tiny_llama(), memory="medium")


def _rows(count: int = 48, length: int = 10) -> list[dict[str, torch.Tensor]]:
    batch = random_batch(batch_size=count, length=length, seed=3)
    return [{k: v[i] for k, v in batch.items()} for i in range(count)]


#: test_plugins_train_alike_in_every_mode: 3 steps of lr 0.1, C 0.1, sigma 0.5, B 8 (physical 3) over 48 rows of 10
#: tokens. Between the modes only the float32 rounding of each step's clipped sum differs: each entry a float32 sum of at
#: most n = 3 * 10 tokens + 16 micro-batches = 46 terms, so ||delta sum|| <= 2 n U32 ||sum|| <= 2 n U32 * 48 * C (every
#: row at most). The difference that makes to the parameters moves them by ~1e-9 (SGD) to ~1e-7 (adambc) per step,
#: whose own effect on the next steps' gradients is of second order.
LR, STEPS, SIGMA, C, B = 0.1, 3, 0.5, 0.1, 8
SUM_ROUNDING = 2 * (3 * 10 + 16) * U32 * 48 * C
BOUNDS = {
    # the update is linear in the clipped sum: ||delta theta|| <= lr * steps * ||delta sum|| / B
    "default": LR * STEPS * SUM_ROUNDING / B, "ftrl": LR * STEPS * SUM_ROUNDING / B,
    # denoise shrinks the singular values above its threshold (here up to 1.28 times the bulk edge): a spectral map
    # whose slope there is a few (the shrinker's, and the singular vectors' 1 / gap with the gap >= 0.28 edge); an
    # allowance of 10 times the linear bound, not a proof (a singular value within rounding of the threshold would
    # flip, a jump no tolerance covers; measured here: 1.3e-9, as the linear updates)
    "denoise": 10 * LR * STEPS * SUM_ROUNDING / B,
    # adambc: u = m^ / sqrt(D), D = max(v^ - Phi, Phi) >= Phi = (sigma C / B)^2 (gamma_relative 1). Per coordinate
    # |delta u| <= |delta m^| / sqrt(D) + |m^| |delta v^| / (2 D^1.5) <= (1 + 2 * 1.06) max_s |delta g~_s| / sqrt(Phi)
    # (m^2 <= 1.06 v^ for 3 steps of beta1 0.9, beta2 0.999; v^ <= 2 D): the division by sqrt(Phi) = sigma C / B
    # amplifies each rounding B / (sigma C) = 160 times; over the steps' coordinates ||.|| <= sqrt(steps) max_s
    "adambc": LR * STEPS * 3.2 * STEPS ** 0.5 * (SUM_ROUNDING / B) / (SIGMA * C / B),
}


@pytest.mark.parametrize("name,plugins", [("default", {}), ("denoise", {"denoise": {}}), ("adambc", {"adambc": {}}),
                                          ("ftrl", {"ftrl": {"noise": "independent"}})],
                         ids=["default", "denoise", "adambc", "ftrl"])
def test_plugins_train_alike_in_every_mode(name, plugins):
    """Same seed, same noise: the parameters after a few steps agree across fast, low and auto (checkpointing on), to
    the float32 rounding of the clipped sums carried through each plugin's update (:data:`BOUNDS`: ~1e-6 for the
    SGD-like updates, ~1e-3 for adambc's division by the noise std; measured on an AMD EPYC: 9e-10 and 2.5e-7); a mode that lost or mis-weighted a layer's
    gradient moves them by ~lr (adambc: ~lr per coordinate)."""
    results = {}
    for mode in ("fast", "low", "auto"):
        model = _build("llama-full", True)
        privacy = PrivacyConfig(target_epsilon=None, noise_multiplier=SIGMA, batch_size=B, physical_batch_size=3,
                                max_grad_norm=C, seed=0, clipping_memory=mode, clipping_memory_budget=0.002)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", PrivacyWarning)
            training = PrivateTraining(model, _loss_fn(model), privacy, data=_rows(), steps=STEPS, plugins=plugins,
                                       optimizer=lambda params: torch.optim.SGD(params, lr=LR))
        plugin = dict(training.engine.plugin_manager.list_name_plugin())["clip"]
        assert plugin.memory == mode
        training.run()
        results[mode] = {n: p.detach().clone() for n, p in model.named_parameters()}
    for mode in ("low", "auto"):
        difference = _norm({n: results[mode][n].double() - value.double() for n, value in results["fast"].items()})
        assert difference <= BOUNDS[name], (mode, difference, BOUNDS[name])


def test_gradient_checkpointing_option_turns_it_on():
    model = _build("llama-lora", True)
    assert model.base_model.model.is_gradient_checkpointing
    assert not _build("llama-full", False).is_gradient_checkpointing


@pytest.mark.parametrize("length", [6, 24], ids=["gram", "per-example"])
def test_norms_chunked_over_examples_match_loop(monkeypatch, length):
    """low computes each layer's norms a few examples at a time (no Gram or per-example gradient of the whole batch)."""
    from dpl.core import clipping_policy

    monkeypatch.setattr(clipping_policy, "NORM_CHUNK", 200)
    for units in (None, torch.tensor([0, 0, 1, 2, 2])):
        model = _build("llama-full", True)
        batch = random_batch(batch_size=5, length=length)
        sums, norms, _ = _clipped(model, batch, "low", None, 0.05, units=units)
        _assert_matches(sums, norms, *reference_clipped_sum(_loss_fn(model), model, batch, 0.05, units=units))


@pytest.mark.parametrize("length,chunk", [(6, 720), (24, 3328)], ids=["gram", "per-example"])
def test_a_partial_last_chunk_of_norms_counts(monkeypatch, length, chunk):
    """NORM_CHUNK set to twice the largest layer's elements per example (at length 6: 2 T^2 + T (16 + 32) = 360; at
    24: 16 * 32 + T (16 + 32) = 1,664): chunks of 2 to 4 of the 5 examples (or 3 users), so every layer's last chunk
    is partial (checked), and the norms and sums still equal the loop (and per user). Planted bug this catches: in
    ``layer_gradients.sq_norms`` append ``torch.zeros(rows - start)`` instead of the norms of a chunk shorter than
    ``chunk`` (the partial last one)."""
    from dpl.core import clipping_policy, layer_gradients

    monkeypatch.setattr(clipping_policy, "NORM_CHUNK", chunk)
    seen: list[tuple[int, int]] = []
    for kind, prepare_fn in list(layer_gradients._PREPARE.items()):
        def spy(rec, grads, grams, *rest, _prepare=prepare_fn):
            seen.append((id(rec.module), rec.inputs[0].shape[0]))
            return _prepare(rec, grads, grams, *rest)
        monkeypatch.setitem(layer_gradients._PREPARE, kind, spy)
    for units in (None, torch.tensor([0, 0, 1, 2, 2])):
        seen.clear()
        model = _build("llama-full", True)
        batch = random_batch(batch_size=5, length=length)
        sums, norms, _ = _clipped(model, batch, "low", None, 0.05, units=units)
        _assert_matches(sums, norms, *reference_clipped_sum(_loss_fn(model), model, batch, 0.05, units=units))
        sizes: dict[int, list[int]] = {}
        for module, rows in seen:
            sizes.setdefault(module, []).append(rows)
        linear = [v for v in sizes.values() if len(v) > 1]
        if units is None:  # (a user's tokens are its rows' tokens: chunks of one user there)
            assert sum(v[-1] < v[0] for v in linear) >= 10, sizes  # layers in several chunks, the last one partial


@pytest.mark.parametrize("budget", [0.0, None], ids=["nothing-kept", "default-budget"])
def test_auto_bounds_every_contribution_under_bf16_autocast(budget):
    """Under bf16 autocast a second backward pass would round each clipped gradient apart from its norm: auto keeps
    the book of the layers it does not keep (float32 products, one backward pass), so no example adds more than C."""
    model = _build("bert-full", False).float()
    batch = random_batch(batch_size=6)
    clipper = PerExampleClipper(model, memory="auto", budget_mib=budget)
    for i in range(6):
        one = {k: v[i:i + 1] for k, v in batch.items()}
        with torch.autocast("cpu", dtype=torch.bfloat16):
            with clipper.record(1):
                losses = _loss_fn(model)(one).float()
            sums, norms = clipper.clipped_sum(losses, 0.1)
        assert norms[0] > 0.1
        total = torch.sqrt(sum(t.double().pow(2).sum() for t in sums.values()))
        assert total <= 0.1 * (1 + 1e-5)


def test_low_refused_under_bf16():
    model = _build("llama-full", False).float()
    clipper = PerExampleClipper(model, memory="low")
    with pytest.raises(ConfigError, match="clipping_memory low"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            with clipper.record(2):
                pass
    with pytest.raises(ConfigError, match="clipping_memory low"):
        with PerExampleClipper(model.to(torch.bfloat16), memory="low").record(2):
            pass


@pytest.mark.parametrize("mode,budget", [("fast", None), ("auto", None), ("auto", 0.0)],
                         ids=["fast", "auto", "auto-nothing-kept"])
@pytest.mark.parametrize("name", ["bert-full", "llama-lora"])
def test_the_bf16_book_matches_float32_within_bf16_rounding(name, mode, budget):
    """Under bf16 autocast the book holds the layers' bf16 output gradients (and inputs as they come) with float32
    norms and sums: the clipped sum and norms of the float32 step, to bf16's rounding of the forward and backward
    passes (8 bits of mantissa; measured here: within 1%)."""
    model = _build(name, False).float()
    batch = random_batch(batch_size=6, length=12)
    exact_sums, exact_norms, _ = _clipped(model, batch, "fast", None, 1e3)  # float32, no clipping: the raw gradients
    clipper = PerExampleClipper(model, memory=mode, budget_mib=budget)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with clipper.record(6):
            losses = _loss_fn(model)(batch).float()
        sums, norms = clipper.clipped_sum(losses, 1e3)
    assert all(t.dtype == torch.float32 for t in sums.values()) and norms.dtype == torch.float32
    torch.testing.assert_close(norms, exact_norms.float(), rtol=3e-2, atol=0)
    error = torch.sqrt(sum((sums[k].double() - exact).pow(2).sum() for k, exact in exact_sums.items()))
    size = torch.sqrt(sum(exact.pow(2).sum() for exact in exact_sums.values()))
    assert error <= 3e-2 * size


def test_auto_with_room_for_every_book_runs_one_backward_pass(monkeypatch):
    """auto keeps the book of a layer whose per-example gradients do not fit but whose book does; with every layer
    kept or booked there is no second backward pass, and the clipped sum is still the per-example loop's."""
    from dpl.core import per_example

    calls = []
    real_grad = torch.autograd.grad
    monkeypatch.setattr(per_example.torch.autograd, "grad", lambda *a, **k: calls.append(1) or real_grad(*a, **k))
    for budget, passes in ((1.0, 1), (0.004, 2)):
        calls.clear()
        model = _build("bert-full", False)
        batch = random_batch(batch_size=5, length=24)
        sums, norms, clipper = _clipped(model, batch, "auto", budget, 0.05)
        assert len(calls) == passes and clipper.peak_held_bytes <= budget * 2 ** 20
        monkeypatch.setattr(per_example.torch.autograd, "grad", real_grad)
        _assert_matches(sums, norms, *reference_clipped_sum(_loss_fn(model), model, batch, 0.05))
        monkeypatch.setattr(per_example.torch.autograd, "grad", lambda *a, **k: calls.append(1) or real_grad(*a, **k))


def test_auto_in_one_pass_forms_each_shared_input_gram_once_as_fast_does(monkeypatch):
    """The layers that read one input (Q, K and V) share its Gram matrix in auto's one pass as in fast: auto forms
    no more input Gram products than fast (each a batched product of the input with itself)."""
    from dpl.core import layer_gradients

    formed = []
    real = layer_gradients._input_gram

    def counting(a, source, grams):
        key_before = len(grams)
        out = real(a, source, grams)
        formed.append(len(grams) > key_before)
        return out

    monkeypatch.setattr(layer_gradients, "_input_gram", counting)
    counts = {}
    for mode in ("fast", "auto"):
        formed.clear()
        model = _build("bert-full", False)
        batch = random_batch(batch_size=3, length=4)  # T (d_in + d_out) < d_in d_out: the Gram path
        sums, norms, clipper = _clipped(model, batch, mode, 1.0 if mode == "auto" else None, 0.05)
        assert mode == "fast" or clipper.one_pass
        counts[mode] = (sum(formed), len(formed))
    assert counts["fast"][1] == counts["auto"][1] > counts["fast"][0]  # some layers share their input's Gram
    assert counts["auto"][0] == counts["fast"][0]
