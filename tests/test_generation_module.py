"""DPGenerationModule: completion-only per-example loss, tied embeddings, per-example clipping on a causal LM."""

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import save_tiny_llama_lm

from dpl.errors import ConfigError
from dpl.tasks.modules import FinetuneOptions, LoraOptions
from dpl.tasks.modules.generation import DPGenerationModule, GenerationOptions, completion_token_loss
from dpl.core.per_example import PerExampleClipper


@pytest.fixture(scope="module")
def tiny_lm(tmp_path_factory):
    return save_tiny_llama_lm(tmp_path_factory.mktemp("tiny_lm"), tie=True)


def _batch():
    """Two right-padded examples: prompt tokens and padding are labelled -100."""
    ids = torch.tensor([[5, 6, 7, 8, 9, 2, 0], [5, 10, 11, 12, 13, 14, 2]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1, 1]])
    labels = torch.tensor([[-100, -100, -100, 8, 9, 2, -100], [-100, -100, 11, 12, 13, 14, 2]])
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def test_completion_token_loss_is_mean_over_completion_tokens():
    torch.manual_seed(0)
    logits = torch.randn(2, 7, 20)
    batch = _batch()
    losses = completion_token_loss(logits, batch["labels"])
    for i in range(2):
        # logits at t predict the token at t + 1; only positions with a label count
        terms = [F.cross_entropy(logits[i, t - 1], batch["labels"][i, t]) for t in range(1, 7)
                 if batch["labels"][i, t] != -100]
        assert losses[i] == pytest.approx(float(torch.stack(terms).mean()), rel=1e-5)
    # changing a prompt token's logit target does not change the loss
    other = batch["labels"].clone()
    other[0, 1] = -100
    torch.testing.assert_close(completion_token_loss(logits, other), losses)


def test_per_example_loss_ignores_padding_columns(tiny_lm):
    module = DPGenerationModule(model=tiny_lm, tied_embeddings="untie")
    module.ensure_model()
    module.model.eval()
    batch = _batch()
    padded = {k: torch.cat([v, torch.full((2, 3), 0 if k != "labels" else -100)], 1) for k, v in batch.items()}
    torch.testing.assert_close(module.per_example_loss(padded), module.per_example_loss(batch))
    one = {k: v[:1, :6] for k, v in batch.items()}  # the first example alone, without its padding
    with torch.no_grad():
        assert float(module.per_example_loss(one)[0]) == pytest.approx(float(module.per_example_loss(batch)[0]), rel=1e-5)


def test_tied_embeddings_are_frozen_or_untied(tiny_lm):
    frozen = DPGenerationModule(model=tiny_lm)
    model = frozen.ensure_model()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert not model.model.embed_tokens.weight.requires_grad
    assert "model.embed_tokens.weight" not in frozen.trainable

    untied = DPGenerationModule(model=tiny_lm, tied_embeddings="untie")
    model = untied.ensure_model()
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    torch.testing.assert_close(model.lm_head.weight, model.model.embed_tokens.weight)
    assert {"model.embed_tokens.weight", "lm_head.weight"} <= set(untied.trainable)
    PerExampleClipper(model)  # accepted: no shared trainable parameter


def _loop_clipped_sum(module, batch, max_norm):
    params = module.trainable
    total = {n: torch.zeros_like(p) for n, p in params.items()}
    for i in range(batch["input_ids"].shape[0]):
        one = {k: v[i:i + 1] for k, v in batch.items()}
        grads = torch.autograd.grad(module.per_example_loss(one).sum(), list(params.values()), allow_unused=True)
        grads = [torch.zeros_like(p) if g is None else g for g, p in zip(grads, params.values())]
        norm = float(torch.sqrt(sum(g.pow(2).sum() for g in grads)))
        factor = min(1.0, max_norm / (norm + 1e-6))
        for name, g in zip(params, grads):
            total[name] += factor * g
    return total


@pytest.mark.parametrize("setup", ["full-untied", "full-frozen", "lora"])
def test_clipped_sum_matches_loop(tiny_lm, setup):
    finetuning = FinetuneOptions(method="lora", lora=LoraOptions(r=2, target_modules=["q_proj", "v_proj"])) \
        if setup == "lora" else None
    module = DPGenerationModule(model=tiny_lm, finetuning=finetuning,
                                tied_embeddings="untie" if setup == "full-untied" else "freeze")
    module.ensure_model()
    module.model.double()
    if setup == "lora":
        assert all("lora_" in n for n in module.trainable)
    batch = _batch()
    clipper = PerExampleClipper(module.model)
    with clipper.record(2):
        losses = module.per_example_loss(batch)
    sums, _ = clipper.clipped_sum(losses, 0.05)
    expected = _loop_clipped_sum(module, batch, 0.05)
    assert set(sums) == set(expected)
    for name in expected:
        torch.testing.assert_close(sums[name].double(), expected[name], rtol=1e-4, atol=1e-7, msg=name)


def test_generate_decodes_only_new_tokens(tiny_lm):
    module = DPGenerationModule(model=tiny_lm, generation=GenerationOptions(max_new_tokens=4))
    module.ensure_model().eval()
    tok = module.tokenizer
    prompt = tok(["name [ aromi ] , food [ french ]"], return_tensors="pt")
    texts = module.generate(prompt["input_ids"], prompt["attention_mask"])
    assert len(texts) == 1 and len(tok(texts[0], add_special_tokens=False)["input_ids"]) <= 4
    assert "aromi ] , food" not in texts[0]


@pytest.mark.parametrize("kwargs, message", [
    ({"tied_embeddings": "share"}, "tied_embeddings"),
    ({"generation": GenerationOptions(metrics=["bleu", "blue"])}, "unknown metric 'blue'"),
    ({"generation": GenerationOptions(max_new_tokens=0)}, "max_new_tokens"),
    ({"generation": GenerationOptions(num_beams=0)}, "num_beams"),
    ({"generation": GenerationOptions(meteor_backend="perl")}, "meteor_backend"),
])
def test_bad_options_fail_early(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        DPGenerationModule(model="unused", **kwargs)


def test_missing_model_is_one_line_error(tmp_path):
    module = DPGenerationModule(model=str(tmp_path / "nowhere"))
    with pytest.raises(ConfigError, match="(cannot (load|find))|not found"):
        module.ensure_model()


def test_untied_loss_finite(tiny_lm):
    module = DPGenerationModule(model=tiny_lm, tied_embeddings="untie")
    module.ensure_model()
    assert all(math.isfinite(float(x)) for x in module.per_example_loss(_batch()))


def test_plugins_work_for_generation(tiny_lm, tmp_path):
    """The same private step and plugins as classification: denoise runs on a causal LM's gradients."""
    import lightning as L

    from dpl.tasks.data import E2EDataModule
    from dpl.core.privacy import PrivacyConfig

    rows = ["mr,ref"] + [f"name[aromi] food[italian],aromi serves italian food {i % 3} ." for i in range(40)]
    (tmp_path / "train.csv").write_text("\n".join(rows) + "\n")
    logged = {}
    module = DPGenerationModule(model=tiny_lm, finetuning=FinetuneOptions(method="full"), tied_embeddings="untie",
                                privacy=PrivacyConfig(target_epsilon=8, batch_size=8, physical_batch_size=4, seed=3),
                                plugins={"denoise": {}})
    module._log_metric = lambda name, value: logged.setdefault(name, value)
    data = E2EDataModule(tokenizer=tiny_lm, train_file=str(tmp_path / "train.csv"), max_length=24)
    before = {n: p.detach().clone() for n, p in module.ensure_model().named_parameters()}
    trainer = L.Trainer(max_steps=2, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
    trainer.fit(module, datamodule=data)
    assert module.engine.steps_done == 2
    assert any(k.startswith("denoise") for k in logged), logged
    changed = [n for n, p in module.model.named_parameters() if not torch.equal(p, before[n])]
    assert "lm_head.weight" in changed and "model.embed_tokens.weight" in changed
