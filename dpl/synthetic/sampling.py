"""Sampling synthetic records from a model trained on them (:class:`~dpl.tasks.modules.DPSyntheticModule`): each
record is generated after its control prefix, as training rendered it (:mod:`dpl.tasks.data.synthetic`).

* Tables: the prompt ``"label: 1\\nsentence:"`` is continued until the EOS; the text is the continuation, stripped.
* Conversations: turn by turn in the chat template, ``turns`` user/assistant exchanges: the header of a user turn
  (the template's rendering of the turns so far and a user turn, cut where its content starts) is continued until
  the end of the turn, then the assistant's turn after the generation prompt, and so on. The template's default
  system prompt (SmolLM2 writes one) applies as in training; no system turn is generated.

Sampling is post-processing of the trained model: its seed (``--seed``) is public and protects nothing.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from dpl.tasks.data.synthetic import control_prefix, table_prompt

_MARK = "DPLCONTENTMARK"


@dataclass
class SamplingOptions:
    """How records are sampled (nucleus sampling at ``temperature``)."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 64
    batch_size: int = 32
    seed: int = 0
    turns: int = 1
    retries: int = 3


class Progress:
    """A tqdm bar on a terminal (stderr), else a plain line every 10% of the records."""

    def __init__(self, total: int, what: str) -> None:
        self.total, self.done, self.what, self.shown = total, 0, what, 0
        self.bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=what, unit="rec", file=sys.stderr)

    def update(self, n: int) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
        elif self.done * 10 // max(self.total, 1) > self.shown or self.done == self.total:
            self.shown = self.done * 10 // max(self.total, 1)
            print(f"dpl: {self.what}: {self.done}/{self.total} records", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _stop_ids(tokenizer: Any) -> list[int]:
    """The EOS and, with a chat template, the last token of its end of turn (generation stops at either)."""
    ids = [int(tokenizer.eos_token_id)]
    if getattr(tokenizer, "chat_template", None):
        from dpl.tasks.data.templates import ChatFormat

        try:
            end = ChatFormat.of(tokenizer).end_of_turn
        except Exception:  # noqa: BLE001 - a template that cannot render a reply: the EOS alone
            end = ""
        tail = tokenizer(end, add_special_tokens=False)["input_ids"] if end else []
        if tail and int(tail[-1]) not in ids:
            ids.append(int(tail[-1]))
    return ids


class Sampler:
    """Samples continuations of token-id prompts from ``model`` in left-padded batches."""

    def __init__(self, model: Any, tokenizer: Any, options: SamplingOptions, device: torch.device) -> None:
        self.model, self.tokenizer, self.options, self.device = model, tokenizer, options, device
        self.stop = _stop_ids(tokenizer)
        self.end_texts = [t for t in (tokenizer.decode([i]) for i in self.stop) if t.strip()]

    @torch.inference_mode()
    def continue_ids(self, prompts: list[list[int]]) -> list[str]:
        """The decoded continuation of each prompt (special tokens and the end of turn dropped, stripped)."""
        pad = self.tokenizer.pad_token_id
        length = max(len(p) for p in prompts)
        ids = torch.tensor([[pad] * (length - len(p)) + p for p in prompts], device=self.device)
        mask = torch.tensor([[0] * (length - len(p)) + [1] * len(p) for p in prompts], device=self.device)
        o = self.options
        out = self.model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=o.temperature,
                                  top_p=o.top_p, max_new_tokens=o.max_new_tokens, pad_token_id=pad,
                                  eos_token_id=self.stop, num_beams=1)
        texts = []
        for row in out[:, length:].tolist():
            cut = next((i for i, t in enumerate(row) if t in self.stop), len(row))
            text = self.tokenizer.decode(row[:cut], skip_special_tokens=True)
            for end in self.end_texts:
                text = text.split(end)[0]
            texts.append(text.strip())
        return texts


def _encode(tokenizer: Any, text: str, special: bool) -> list[int]:
    return list(tokenizer(text, add_special_tokens=special)["input_ids"])


def sample_tables(sampler: Sampler, controls: list[dict[str, str]], text_column: str, chat: bool,
                  progress: Callable[[int], None]) -> list[str]:
    """One text per control dict, in order; an empty text is sampled again (at most ``retries`` times)."""
    from dpl.tasks.data.templates import encode_prompts

    tokenizer, size = sampler.tokenizer, sampler.options.batch_size
    prompts = encode_prompts(tokenizer, [table_prompt(c, text_column) for c in controls], chat)
    texts: list[str] = [""] * len(controls)
    todo = list(range(len(controls)))
    for attempt in range(sampler.options.retries + 1):
        for start in range(0, len(todo), size):
            chunk = todo[start:start + size]
            for i, text in zip(chunk, sampler.continue_ids([prompts[i] for i in chunk])):
                texts[i] = text
            if attempt == 0:
                progress(len(chunk))
        todo = [i for i in todo if not texts[i]]
        if not todo:
            break
    return texts


def _render(tokenizer: Any, messages: list[dict[str, str]], generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def _user_header(tokenizer: Any, history: list[dict[str, str]]) -> str:
    """The rendered turns so far followed by the header of a user turn (the text before its content)."""
    text = _render(tokenizer, [*history, {"role": "user", "content": _MARK}], False)
    return text.split(_MARK)[0]


def sample_conversations(sampler: Sampler, controls: list[dict[str, str]],
                         progress: Callable[[int], None]) -> list[list[dict[str, str]]]:
    """One conversation of ``turns`` user/assistant exchanges per control dict, in order."""
    tokenizer, size = sampler.tokenizer, sampler.options.batch_size
    conversations: list[list[dict[str, str]]] = [[] for _ in controls]
    heads = [_encode(tokenizer, control_prefix(c), False) if c else [] for c in controls]
    for start in range(0, len(controls), size):
        chunk = list(range(start, min(start + size, len(controls))))
        for _ in range(sampler.options.turns):
            for role in ("user", "assistant"):
                texts = [_user_header(tokenizer, conversations[i]) if role == "user"
                         else _render(tokenizer, conversations[i], True) for i in chunk]
                prompts = [heads[i] + _encode(tokenizer, text, False) for i, text in zip(chunk, texts)]
                for i, reply in zip(chunk, sampler.continue_ids(prompts)):
                    conversations[i].append({"role": role, "content": reply})
        progress(len(chunk))
    return conversations
