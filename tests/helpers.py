"""Tiny models built from configs, for fast unit tests (no downloaded weights)."""

from __future__ import annotations

import torch
from transformers import BertConfig, BertForSequenceClassification, LlamaConfig, LlamaForSequenceClassification


def tiny_bert(num_labels: int = 2, seed: int = 0) -> BertForSequenceClassification:
    torch.manual_seed(seed)
    config = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=32, num_labels=num_labels,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return BertForSequenceClassification(config).train()


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
