"""Conversations as generation data: ``messages`` lists of ``{"role", "content"}`` turns (system, user, assistant),
rendered with the tokenizer's chat template and labelled on the assistant's tokens only.

* :func:`check_messages`: a row's ``messages`` value checked (one-line :class:`~dpl.errors.DataError` naming the file
  and line).
* :func:`segments`: the rendered conversation, through its last assistant turn, cut into ``(text, assistant?)``
  pieces; an assistant piece is what the model writes after the template's generation prompt: the reply and the
  template's end of turn (SmolLM2: ``Blue.<|im_end|>``).
* :func:`encode`: the token ids of the pieces (each tokenized without added special tokens: the template writes
  them) and the labels: the ids on assistant pieces, -100 elsewhere.
* :func:`prompt_ids`: turns (e.g. the conversation before its last assistant turn, :func:`history`) rendered with
  the generation prompt, as ``apply_chat_template(turns, add_generation_prompt=True)`` tokenizes them: what
  generation continues.
* :func:`conversation_split`: a split's conversation records (one evaluation source each).
* :func:`training_examples`, :func:`evaluation_sources`: a split's conversations as training examples and as
  evaluation sources, truncated to ``data.max_length`` (:mod:`~dpl.tasks.data.truncation`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dpl.errors import DataError
from dpl.tasks.data.padding import IGNORE_INDEX
from dpl.tasks.data.progress import in_chunks
from dpl.tasks.data.templates import Record, Split, _render_chat, files_of
from dpl.tasks.data.truncation import keep_end, truncate

__all__ = ["ROLES", "check_messages", "conversation_split", "encode", "evaluation_sources", "history", "prompt_ids",
           "last_reply", "segments", "training_examples"]

#: the roles a turn may have
ROLES: tuple[str, ...] = ("system", "user", "assistant")

Messages = list[dict[str, str]]


def check_messages(value: Any, path: Path | str, where: str, field: str = "messages",
                   need_reply: bool = True) -> Messages:
    """``value`` as a list of ``{"role", "content"}`` turns, or a one-line :class:`DataError` naming ``path`` and
    ``where``: a list of objects, each with a role of :data:`ROLES` and a string content; a user turn before the
    first assistant turn; with ``need_reply``, at least one assistant turn, and no assistant turn left empty."""
    at = f"{path} {where}"
    if not isinstance(value, list) or not value:
        raise DataError(f"{at}: field {field!r} must be a non-empty list of {{role, content}} turns, found "
                        f"{type(value).__name__ if value != [] else 'an empty list'}")
    turns: Messages = []
    for number, turn in enumerate(value, start=1):
        if not isinstance(turn, dict) or "role" not in turn or "content" not in turn:
            raise DataError(f"{at}: turn {number} of {field!r} must be an object with 'role' and 'content'")
        role, content = turn["role"], turn["content"]
        if role not in ROLES:
            raise DataError(f"{at}: turn {number} has role {role!r}; roles are {', '.join(ROLES)}")
        if not isinstance(content, str):
            raise DataError(f"{at}: turn {number} ({role}) content must be a string, found {type(content).__name__}")
        if role == "assistant" and not content.strip() and need_reply:
            raise DataError(f"{at}: turn {number} (assistant) is empty")
        if role == "assistant" and not any(t["role"] == "user" for t in turns):
            raise DataError(f"{at}: turn {number} (assistant) comes before any user turn")
        turns.append({"role": role, "content": content})
    if need_reply and not any(t["role"] == "assistant" for t in turns):
        raise DataError(f"{at}: the conversation has no assistant turn (nothing to learn)")
    return turns


def _last_assistant(messages: Messages) -> int:
    return max(i for i, m in enumerate(messages) if m["role"] == "assistant")


def history(messages: Messages) -> Messages:
    """The turns before the conversation's last assistant turn (all of them when it has none)."""
    if not any(m["role"] == "assistant" for m in messages):
        return list(messages)
    return list(messages[:_last_assistant(messages)])


def last_reply(messages: Messages) -> str:
    """The content of the last assistant turn, stripped (the reference of an evaluation)."""
    return messages[_last_assistant(messages)]["content"].strip()


def _render(tokenizer: Any, messages: Messages, generation_prompt: bool) -> str:
    return _render_chat(tokenizer, messages, generation_prompt)


def segments(tokenizer: Any, messages: Messages) -> list[tuple[str, bool]]:
    """The chat-rendered conversation through its last assistant turn as ``(text, is_assistant)`` pieces in order;
    joined they are ``apply_chat_template(messages[:last + 1])`` without the text after the last reply (the
    template's trailing whitespace).

    Assistant turn ``i`` spans from the end of ``apply_chat_template(messages[:i], add_generation_prompt=True)`` to
    the end of ``apply_chat_template(messages[:i + 1])`` less its trailing whitespace. A template that does not
    render a conversation as the continuation of its beginnings (each of these a prefix of the whole) is a
    one-line :class:`DataError`."""
    last = _last_assistant(messages)
    full = _render(tokenizer, messages[:last + 1], False)
    pieces: list[tuple[str, bool]] = []
    done = 0
    for i in range(last + 1):
        if messages[i]["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:i], True)
        through = _render(tokenizer, messages[:i + 1], False)
        if not (full.startswith(before) and full.startswith(through) and len(through) > len(before) >= done):
            raise DataError("the tokenizer's chat template does not render a conversation as the continuation of "
                            "its first turns, so its assistant tokens cannot be told apart")
        end = len(through[len(before):].rstrip()) + len(before)
        pieces += [(full[done:len(before)], False), (full[len(before):end], True)]
        done = end
    return [(text, assistant) for text, assistant in pieces if text]


def encode(tokenizer: Any, pieces: list[tuple[str, bool]]) -> tuple[list[int], list[int]]:
    """``(input_ids, labels)`` of :func:`segments`' pieces: each piece tokenized without added special tokens,
    concatenated; labels are the ids on assistant pieces and -100 on the others."""
    encoded = tokenizer([text for text, _ in pieces], add_special_tokens=False)["input_ids"]
    ids: list[int] = []
    labels: list[int] = []
    for (_, assistant), piece in zip(pieces, encoded):
        ids += piece
        labels += list(piece) if assistant else [IGNORE_INDEX] * len(piece)
    return ids, labels


def prompt_ids(tokenizer: Any, turns: Messages) -> list[int]:
    """The tokens generation continues after ``turns`` (e.g. :func:`history`): the turns rendered with the generation
    prompt, tokenized without added special tokens (the ids of ``apply_chat_template(turns,
    add_generation_prompt=True)``)."""
    text = _render(tokenizer, turns, True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def conversation_split(name: str, records: list[Record]) -> Split:
    """A split of conversation records: one evaluation source each, its last reply the reference."""
    conversations = [r.messages for r in records if r.messages is not None]
    return Split(name=name, files=files_of(records), prompts=[r.where for r in records],
                 completions=[last_reply(m) for m in conversations], groups=[("group", r.group) for r in records],
                 conversations=conversations)


def training_examples(tokenizer: Any, conversations: list[Messages], max_length: int, split: str
                      ) -> list[dict[str, Any]]:
    """One training example per conversation: its chat-rendered turns through the last assistant turn, labelled on
    the assistant pieces; a longer one keeps its end (and a leading BOS)."""
    bos = getattr(tokenizer, "bos_token_id", None)
    encoded = in_chunks(lambda chunk: [encode(tokenizer, segments(tokenizer, messages)) for messages in chunk],
                        conversations, f"tokenizing {split} conversations")
    encoded = truncate(encoded, max_length,
                       lambda pair: len(pair[0]), lambda pair: keep_end(pair[0], max_length, bos, pair[1]), split,
                       f"conversations are longer than max_length={max_length} tokens and were truncated (their "
                       f"start cut, the end kept)")
    return [{"input_ids": ids, "labels": labels or []} for ids, labels in encoded]


def evaluation_sources(tokenizer: Any, conversations: list[Messages], max_length: int, split: str
                       ) -> list[dict[str, Any]]:
    """One evaluation source per conversation: the turns before its last assistant turn with the generation prompt,
    the last ``max_length - 1`` tokens kept (and a leading BOS); the reference is that turn's content."""
    bos = getattr(tokenizer, "bos_token_id", None)
    budget = max_length - 1
    prompts = in_chunks(lambda chunk: [prompt_ids(tokenizer, history(messages)) for messages in chunk],
                        conversations, f"tokenizing {split} conversations")
    prompts = truncate(prompts, budget, len,
                       lambda ids: keep_end(ids, budget, bos)[0], split,
                       f"conversations are longer than max_length - 1 = {budget} tokens before their last reply and "
                       f"were truncated (start cut)")
    return [{"input_ids": ids, "references": [last_reply(messages)], "prompt": history(messages)}
            for ids, messages in zip(prompts, conversations)]
