"""A sequence classifier on the mean of an encoder's last hidden states (dpl's ``pooling: mean``), as transformers
remote code: ``dpl export`` copies this file beside the weights, and
``AutoModelForSequenceClassification.from_pretrained(folder, trust_remote_code=True)`` loads it. Self-contained:
it imports only torch and transformers."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import AutoModel, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import SequenceClassifierOutput


class MeanPoolForSequenceClassification(PreTrainedModel):
    """encoder -> masked mean over the real tokens -> dropout -> linear head (``config.num_labels`` classes)."""

    config_class = PretrainedConfig
    base_model_prefix = "encoder"
    _supports_sdpa = True  # the encoder's own attention does the work: it says what it supports

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__(config)
        self.encoder = AutoModel.from_config(config)
        if getattr(self.encoder, "pooler", None) is not None:
            self.encoder.pooler = None  # not used by mean pooling (and not trained)
        dropout = getattr(config, "hidden_dropout_prob", None)
        self.dropout = nn.Dropout(0.1 if dropout is None else float(dropout))
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                **kwargs: Any) -> SequenceClassifierOutput:
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
        if token_type_ids is not None:
            inputs["token_type_ids"] = token_type_ids
        hidden = self.encoder(**inputs).last_hidden_state
        if attention_mask is None:
            pooled = hidden.mean(dim=1)
        else:
            mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp_min(1.0)
        logits = self.classifier(self.dropout(pooled))
        loss = nn.functional.cross_entropy(logits, labels) if labels is not None else None
        return SequenceClassifierOutput(loss=loss, logits=logits)
