"""Tiny models built from configs, for fast unit tests (no downloaded weights)."""

from __future__ import annotations

import torch
from transformers import BertConfig, BertForSequenceClassification, LlamaConfig, LlamaForSequenceClassification


def tiny_bert(num_labels: int = 2, seed: int = 0, positions: int = 32,
              dropout: float = 0.0) -> BertForSequenceClassification:
    torch.manual_seed(seed)
    config = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=positions, num_labels=num_labels,
                        hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
    return BertForSequenceClassification(config).train()


def reference_clipped_sum(per_example_loss, model, batch: dict, max_norm: float, units: torch.Tensor | None = None):
    """The clipped sum and per-example norms by looping over the examples with ordinary autograd (the reference
    dpl's engine is compared with); with ``units`` (a unit per example), per unit: the gradient of the mean of its
    examples' losses, clipped as one."""
    import math

    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    total = {n: torch.zeros_like(p) for n, p in params.items()}
    norms = []
    if units is None:
        groups = [torch.tensor([i]) for i in range(batch["labels"].shape[0])]
    else:
        groups = [(units == u).nonzero().flatten() for u in units.unique_consecutive().tolist()]
    for rows in groups:
        one = {k: v[rows] for k, v in batch.items()}
        grads = torch.autograd.grad(per_example_loss(one).mean(), list(params.values()), allow_unused=True)
        grads = [torch.zeros_like(p) if g is None else g for g, p in zip(grads, params.values())]
        norm = torch.sqrt(sum(g.pow(2).sum() for g in grads))
        norms.append(norm)
        factor = 1.0 if math.isinf(max_norm) else min(1.0, max_norm / (float(norm) + 1e-6))
        for name, g in zip(params, grads):
            total[name] += factor * g
    return total, torch.stack(norms)


def tiny_llama(num_labels: int = 2, seed: int = 0) -> LlamaForSequenceClassification:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, intermediate_size=32, max_position_embeddings=32,
                         num_labels=num_labels, pad_token_id=0, tie_word_embeddings=False)
    return LlamaForSequenceClassification(config).train()


def random_batch(batch_size: int = 4, length: int = 7, vocab: int = 50, num_labels: int = 2, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (batch_size, length), generator=gen)
    mask = torch.ones_like(ids)
    for i in range(batch_size):  # ragged lengths with right padding
        cut = int(torch.randint(3, length + 1, (1,), generator=gen))
        ids[i, cut:] = 0
        mask[i, cut:] = 0
    labels = torch.randint(0, num_labels, (batch_size,), generator=gen)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


WORDS = ["good", "great", "fine", "bad", "awful", "poor", "movie", "film", "plot", "the", "a", "was", "is", "very",
         "not", "really", "acting", "story"]


def save_tiny_bert(folder, num_labels: int = 2, positions: int = 128) -> str:
    """A tiny BERT classifier and its word-level tokenizer saved to ``folder`` (loads with from_pretrained); its
    ``positions`` cover the data modules' ``max_length`` (128 by default, 64 in the shipped configs)."""
    from pathlib import Path

    from transformers import BertTokenizerFast

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS
    (folder / "vocab.txt").write_text("\n".join(vocab) + "\n")
    tokenizer = BertTokenizerFast(vocab_file=str(folder / "vocab.txt"))
    tokenizer.save_pretrained(folder)
    model = tiny_bert(num_labels=num_labels, positions=positions)
    model.config.vocab_size = len(vocab)
    model.resize_token_embeddings(len(vocab))
    model.save_pretrained(folder)
    return str(folder)


def tiny_classification_workspace(tmp, rows: int = 96, val_rows: int = 32):
    """``tmp`` with a tiny BERT classifier under ``model/`` and sentiment TSVs under ``data/``; returns
    ``(tmp, model folder)``."""
    model = save_tiny_bert(tmp / "model")
    write_sentiment_tsv(tmp / "data" / "train.tsv", rows=rows)
    write_sentiment_tsv(tmp / "data" / "validation.tsv", rows=val_rows, seed=1)
    return tmp, model


def write_sentiment_tsv(path, rows: int = 64, seed: int = 0) -> str:
    """A small separable sentiment TSV (``sentence<TAB>label``) over the tiny vocabulary."""
    import random
    from pathlib import Path

    rng = random.Random(seed)
    lines = ["sentence\tlabel"]
    for i in range(rows):
        positive = i % 2 == 0
        word = rng.choice(["good", "great", "fine"] if positive else ["bad", "awful", "poor"])
        noun = rng.choice(["movie", "film", "plot", "acting", "story"])
        lines.append(f"the {noun} was {rng.choice(['', 'very ', 'really '])}{word}\t{'positive' if positive else 'negative'}")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text("\n".join(lines) + "\n")
    return str(path)


LM_WORDS = ["name", "area", "food", "eat", "type", "pub", "restaurant", "city", "centre", "riverside", "italian",
            "french", "is", "a", "in", "the", "serves", "food", "there", "near", "table", "sentence", ":", "[", "]",
            ",", ".", "aromi", "alimentum", "cotto", "wildwood"]


def tiny_llama_lm(vocab_size: int = 50, seed: int = 0, tie: bool = False):
    """A tiny Llama causal LM (optionally with tied input/output embeddings)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, intermediate_size=32, max_position_embeddings=128,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=tie)
    return LlamaForCausalLM(config).train()


#: a ChatML chat template (the format of SmolLM2's), for tiny tokenizers that render conversations
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def save_tiny_llama_lm(folder, tie: bool = True, chat_template: str | None = None, digits: bool = False) -> str:
    """A tiny Llama causal LM and a word-level tokenizer (pad 0, bos 1, eos 2; with ``chat_template``, if given;
    ``digits``: a token per digit, numbers split into them) saved to ``folder``."""
    from pathlib import Path

    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    words = sorted(set(LM_WORDS) | (set("0123456789") if digits else set()))
    vocab = {w: i for i, w in enumerate(["<pad>", "<s>", "</s>", "<unk>"] + words)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.normalizer = normalizers.Lowercase()
    backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()]
                                                    + ([pre_tokenizers.Digits(individual_digits=True)] if digits
                                                       else []))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>",
                                        eos_token="</s>", unk_token="<unk>")
    tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(folder)
    tiny_llama_lm(vocab_size=len(vocab), tie=tie).save_pretrained(folder)
    return str(folder)


# ---------------------------------------------------------------------------------------------------------
# a tiny float-feature task for fast end-to-end runs of the private loop (no tokenizer, no transformer)

from pathlib import Path  # noqa: E402

import lightning as L  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import Dataset  # noqa: E402

from dpl.lightning.data import DPDataModule  # noqa: E402
from dpl.lightning.module import DPModule  # noqa: E402


class VectorData(Dataset):
    def __init__(self, n: int = 64, dim: int = 6, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, dim, generator=gen)
        self.y = (self.x[:, 0] > 0).long()

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict:
        return {"x": self.x[i], "labels": self.y[i]}


class VectorDataModule(DPDataModule):
    def __init__(self, n: int = 64) -> None:
        super().__init__(eval_batch_size=32)
        self.n = n

    def setup(self, stage: str | None = None) -> None:
        self.train_set, self.val_set = VectorData(self.n), VectorData(16, seed=1)

    def collate(self, examples):
        if not examples:
            return {"x": torch.zeros(0, 6), "labels": torch.zeros(0, dtype=torch.long)}
        return {"x": torch.stack([e["x"] for e in examples]), "labels": torch.stack([e["labels"] for e in examples])}


class VectorModule(DPModule):
    def __init__(self, batch_norm: bool = False, **kwargs) -> None:
        super().__init__(**kwargs)
        self.batch_norm = batch_norm

    def build_model(self) -> nn.Module:
        torch.manual_seed(0)
        layers = [nn.Linear(6, 8)] + ([nn.BatchNorm1d(8)] if self.batch_norm else []) + [nn.Tanh(), nn.Linear(8, 2)]
        return nn.Sequential(*layers)

    def per_example_loss(self, batch):
        return F.cross_entropy(self.model(batch["x"]), batch["labels"], reduction="none")

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.per_example_loss(batch).mean())


class SaveAndStopAt(L.Callback):
    """Writes a checkpoint after ``step`` private steps and stops (an interrupted run)."""

    def __init__(self, step: int, path: Path) -> None:
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if pl_module.engine.steps_done == self.step:
            trainer.save_checkpoint(self.path)
            trainer.should_stop = True


class InterruptAt(L.Callback):
    """Raises ``KeyboardInterrupt`` (as Ctrl+C does) once ``step`` private steps are done."""

    def __init__(self, step: int = 1) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if pl_module.engine.steps_done >= self.step:
            raise KeyboardInterrupt


def fake_entry_points(monkeypatch, plugins: dict) -> None:
    """Make ``plugins`` ({name: class or factory}) look installed, beside the real entry points."""
    from dpl.core import plugin_manager

    real = plugin_manager.installed_plugins()

    class EP:
        def __init__(self, name, obj):
            self.name, self.obj, self.value, self.dist = name, obj, f"test:{name}", None

        def load(self):
            return self.obj

    fake = dict(real)
    fake.update({name: EP(name, obj) for name, obj in plugins.items()})
    monkeypatch.setattr(plugin_manager, "installed_plugins", lambda: fake)


def real_model_precision() -> list[str]:
    """``--trainer.precision 32-true`` on a CPU without native bfloat16 (where bf16-mixed is emulated, many times
    slower than float32: the quickstart's real-MiniLM tests would take minutes), else nothing (the config's own)."""
    from dpl.lightning.precision import cpu_has_native_bf16

    return [] if cpu_has_native_bf16() else ["--trainer.precision", "32-true"]
