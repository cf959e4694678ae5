"""Prompt-based classification for masked LMs (MeZO style): template rendering, label-word logits, DP-SGD and
DPZero on it, and `dpl fit` with the prompt data module."""

import pytest
import torch
from helpers import save_tiny_bert, write_sentiment_tsv
from transformers import AutoTokenizer

from dpl.errors import ConfigError, DataError
from dpl.tasks.data.prompt import PromptClassificationDataModule, render_ids
from dpl.tasks.modules.prompt import DPPromptClassificationModule
from dpl.core.plugin_manager import create_plugin_manager
from dpl.core.step import StepContext, private_step
from dpl.core.update import apply_direction


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("prompt")
    model = save_tiny_bert(tmp / "model")
    write_sentiment_tsv(tmp / "data" / "train.tsv", rows=64)
    write_sentiment_tsv(tmp / "data" / "validation.tsv", rows=16, seed=1)
    return tmp, model


def test_template_keeps_the_mask_when_truncating(tiny):
    _, model = tiny
    tok = AutoTokenizer.from_pretrained(model)
    ids = render_ids(tok, "{sentence} It was [MASK].", "the movie was very good", max_length=64)
    assert tok.convert_ids_to_tokens(ids)[0] == "[CLS]" and tok.convert_ids_to_tokens(ids)[-1] == "[SEP]"
    assert ids.count(tok.mask_token_id) == 1
    short = render_ids(tok, "{sentence} It was [MASK].", "the movie was very good " * 10, max_length=12)
    assert len(short) == 12 and short.count(tok.mask_token_id) == 1  # the sentence was cut, not the template
    with pytest.raises(DataError):
        render_ids(tok, "{sentence} It was [MASK].", "good", max_length=4)
    with pytest.raises(DataError):
        PromptClassificationDataModule(tokenizer=model, data_dir="x", template="{sentence} no mask")


def _module_and_data(tiny, **kwargs):
    tmp, model = tiny
    data = PromptClassificationDataModule(tokenizer=model, data_dir=str(tmp / "data"), max_length=16,
                                          labels=["negative", "positive"])
    module = DPPromptClassificationModule(model=model, label_words=["bad", "good"], **kwargs)
    module.ensure_model(data)
    data.setup("fit")
    return module, data


def test_label_word_logits_from_the_embeddings(tiny):
    module, data = _module_and_data(tiny)
    assert module.decoder_used == "embeddings"  # the tiny BERT has no MLM head, like MiniLM's package
    model = module.model
    words = [data.tokenizer.convert_tokens_to_ids(w) for w in ("bad", "good")]
    embeddings = model.encoder.get_input_embeddings().weight
    torch.testing.assert_close(model.label_decoder.weight, embeddings[words].detach())
    assert model.label_decoder.weight.data_ptr() != embeddings.data_ptr()  # a copy: no shared parameter
    batch = data.collate([data.train_set[i] for i in range(4)])
    model.eval()
    logits = module(batch)
    assert logits.shape == (4, 2)
    # by hand: the last hidden state at the mask position times the label-word embeddings
    hidden = model.encoder(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
    position = (batch["input_ids"] == data.tokenizer.mask_token_id).float().argmax(1)
    expected = hidden[torch.arange(4), position] @ embeddings[words].T
    torch.testing.assert_close(logits, expected)
    assert module.per_example_loss(batch).shape == (4,)
    with pytest.raises(ConfigError, match="MLM head"):
        DPPromptClassificationModule(model=tiny[1], label_words=["bad", "good"], decoder="mlm_head").ensure_model(data)
    with pytest.raises(ConfigError):
        DPPromptClassificationModule(model=tiny[1], label_words=["bad", "bad"])


@pytest.mark.parametrize("plugins", [{}, {"dpzero": {"mu": 1e-3}}], ids=["dpsgd", "dpzero"])
def test_private_step_on_the_prompt_model(tiny, plugins):
    module, data = _module_and_data(tiny)
    model = module.model
    trainable = module.trainable
    pm = create_plugin_manager(plugins)
    optimizer = torch.optim.SGD(trainable.values(), lr=0.1)
    batch = data.collate([data.train_set[i] for i in range(6)])
    ctx = StepContext(model=model, trainable=trainable, per_example_loss=module.per_example_loss, max_grad_norm=1.0,
                      noise_multiplier=0.5, expected_batch_size=6, step=0,
                      noise_source=torch.Generator().manual_seed(0), log=lambda k, v: None, public_seed=3,
                      optimizer=optimizer)
    before = {n: p.detach().clone() for n, p in trainable.items()}
    apply_direction(optimizer, trainable, private_step(pm.hook, ctx, batch, physical_batch_size=4))
    assert any(not torch.equal(before[n], p.detach()) for n, p in trainable.items())


def test_dpl_fit_prompt_mode_with_dpzero(tiny, capsys):
    from pathlib import Path

    from dpl.cli import main

    tmp, model = tiny
    root = tmp / "runs"
    config = Path(__file__).resolve().parents[1] / "plugins" / "dpzero" / "dpzero.yaml"
    main(["fit", "--config", str(config), "--model", "dpl.tasks.modules.DPPromptClassificationModule",
          "--model.model", model, "--model.label_words", "[bad, good]",
          "--model.privacy.batch_size", "16", "--model.privacy.target_epsilon", "4",
          "--data", "dpl.tasks.data.prompt.PromptClassificationDataModule", "--data.tokenizer", model,
          "--data.data_dir", str(tmp / "data"), "--data.max_length", "16", "--data.labels", "[negative, positive]",
          "--trainer.max_steps", "3", "--trainer.accelerator", "cpu", "--trainer.default_root_dir", str(root),
          "--trainer.enable_progress_bar", "false", "--trainer.logger", "false"])
    assert "dpl: trained 3 private steps" in capsys.readouterr().out
