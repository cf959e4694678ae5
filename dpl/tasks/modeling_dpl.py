"""dpl's classifiers that no transformers class holds, as transformers remote code: a classifier on the mean of an
encoder's last hidden states (``pooling: model`` is an ordinary transformers class; ``pooling: mean`` is
:class:`MeanPoolForSequenceClassification`) and the prompt-based classifier (:class:`PromptForSequenceClassification`).
``dpl export`` copies this file beside the weights, and
``AutoModelForSequenceClassification.from_pretrained(folder, trust_remote_code=True)`` loads them. Self-contained:
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
        hidden = self.encoder(**_inputs(input_ids, attention_mask, token_type_ids)).last_hidden_state
        if attention_mask is None:
            pooled = hidden.mean(dim=1)
        else:
            mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp_min(1.0)
        logits = self.classifier(self.dropout(pooled))
        loss = nn.functional.cross_entropy(logits, labels) if labels is not None else None
        return SequenceClassifierOutput(loss=loss, logits=logits)


class PromptForSequenceClassification(PreTrainedModel):
    """dpl's prompt-based classifier: a masked LM reads the prompt rendered in its cloze template, and class k's logit
    is the score of label word k at the mask position (``config.dpl_prompt``: ``mask_token_id``, ``word_ids`` and
    ``decoder``: ``embeddings`` - a linear layer of the label words' rows - or ``mlm_head`` - the masked LM's own
    head restricted to the label words). The inputs must hold the mask token once (``dpl predict`` renders the
    template; ``dpl.json`` holds it)."""

    config_class = PretrainedConfig
    base_model_prefix = "encoder"
    _supports_sdpa = True

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__(config)
        from transformers import AutoModelForMaskedLM

        prompt = config.dpl_prompt
        if prompt["decoder"] == "mlm_head":
            self.mlm = AutoModelForMaskedLM.from_config(config)
        else:
            self.encoder = AutoModel.from_config(config)
            if getattr(self.encoder, "pooler", None) is not None:
                self.encoder.pooler = None
            self.label_decoder = nn.Linear(config.hidden_size, len(prompt["word_ids"]), bias=False)
        self.post_init()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                **kwargs: Any) -> SequenceClassifierOutput:
        inputs = _inputs(input_ids, attention_mask, token_type_ids)
        is_mask = input_ids == self.config.dpl_prompt["mask_token_id"]
        if not bool((is_mask.sum(1) == 1).all()):
            raise ValueError("every input must contain the mask token exactly once (render it in the template)")
        rows = torch.arange(input_ids.shape[0], device=input_ids.device)
        position = is_mask.float().argmax(1)
        if hasattr(self, "mlm"):
            words = torch.tensor(self.config.dpl_prompt["word_ids"], device=input_ids.device)
            logits = self.mlm(**inputs).logits[rows, position][:, words]
        else:
            hidden = self.encoder(**inputs).last_hidden_state
            logits = self.label_decoder(hidden[rows, position])
        loss = nn.functional.cross_entropy(logits, labels) if labels is not None else None
        return SequenceClassifierOutput(loss=loss, logits=logits)


def _inputs(input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
            token_type_ids: torch.Tensor | None) -> dict[str, Any]:
    """The encoder's keyword arguments (``token_type_ids`` only where given: not every encoder takes them)."""
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
    if token_type_ids is not None:
        inputs["token_type_ids"] = token_type_ids
    return inputs
