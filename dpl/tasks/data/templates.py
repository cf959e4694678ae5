"""Prompt and completion templates of generation data: ``str.format`` templates over a :class:`Record`'s fields,
which turn a split's records into prompts and completions (:class:`Split`, :func:`render_split`)."""

from __future__ import annotations

import re
import string
from collections.abc import Hashable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from dpl.errors import DataError

_SHOW_FIELDS = 20


@dataclass
class Record:
    """One row of a data file: the ``fields`` the templates read, and where it comes from (for errors).

    ``group`` is the evaluation grouping key: records with the same key form one source (their completions are
    the references of one prompt). ``None`` groups by the rendered prompt. ``messages`` holds a conversation's
    checked turns (:func:`~dpl.tasks.data.conversations.check_messages`); such a record is one conversation,
    rendered by the chat template instead of the prompt and completion templates.
    """

    fields: dict[str, Any]
    path: Path
    where: str  # "line 12", "entry 3", ...
    group: Hashable | None = None
    messages: list[dict[str, str]] | None = None


@dataclass
class Split:
    """One split after reading and rendering the templates (no tokens yet)."""

    name: str
    files: list[Path]
    prompts: list[str]
    completions: list[str]
    groups: list[Hashable]
    users: list[str] | None = None  # the user of each record (training split with a user column)
    conversations: list[list[dict[str, str]]] | None = None  # the turns of each record (conversation data)

    def sources(self) -> list[tuple[str, list[str]]]:
        """``(prompt, references)`` per evaluation source, in order of first appearance; references in file
        order (stripped)."""
        order: dict[Hashable, tuple[str, list[str]]] = {}
        for prompt, completion, key in zip(self.prompts, self.completions, self.groups):
            if key not in order:
                order[key] = (prompt, [])
            order[key][1].append(completion.strip())
        return list(order.values())


def template_fields(template: str, arg: str) -> list[str]:
    """The field names a ``str.format`` template uses (the part before any ``.attr`` / ``[key]``).

    Raises :class:`DataError` for a malformed template or a positional field (``{}``, ``{0}``)."""
    if not isinstance(template, str):
        raise DataError(f"data.{arg} must be a string, got {type(template).__name__}")
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise DataError(f"data.{arg} {template!r} is not a valid str.format template ({exc}; write a literal "
                        f"brace as {{{{ or }}}})") from None
    names: list[str] = []
    for _, name, _, _ in parsed:
        if name is None:
            continue
        root = re.split(r"[.\[]", name, maxsplit=1)[0]
        if root == "" or root.isdigit():
            raise DataError(f"data.{arg} {template!r} has a positional field {{{name}}}: name the field, "
                            f"e.g. {{mr}}")
        if root not in names:
            names.append(root)
    return names


def show_fields(fields: Any) -> str:
    """The field names, for an error message (at most :data:`_SHOW_FIELDS`)."""
    names = list(fields)
    shown = ", ".join(str(n) for n in names[:_SHOW_FIELDS])
    return shown + (f", ... ({len(names)} fields)" if len(names) > _SHOW_FIELDS else "") if names else "none"


def render(template: str, arg: str, record: Record) -> str:
    """``template`` filled with ``record``'s fields; a missing field or a bad format is a :class:`DataError`
    naming the record."""
    try:
        return template.format_map(record.fields)
    except KeyError as exc:
        name = exc.args[0] if exc.args else "?"
        raise DataError(f"{record.path} {record.where}: data.{arg} {template!r} uses field {name!r}, which the "
                        f"data does not have (available fields: {show_fields(record.fields)})") from None
    except (ValueError, IndexError, AttributeError, TypeError) as exc:
        raise DataError(f"{record.path} {record.where}: cannot fill data.{arg} {template!r}: "
                        f"{type(exc).__name__}: {exc}") from None


# ------------------------------------------------------------------------------------------ chat templates

#: values of ``data.chat_template``: ``auto`` (the tokenizer's chat template when it has one), ``none`` (the plain
#: prompt text), ``always`` (the chat template; a tokenizer without one is an error)
ChatTemplateMode = Literal["auto", "none", "always"]
CHAT_TEMPLATE_MODES: tuple[str, ...] = ("auto", "none", "always")
# stand-ins for the user's prompt and the assistant's reply, to find where the template writes them
_PROMPT_MARK = "DPLPROMPTMARK"
_REPLY_MARK = "DPLREPLYMARK"


def render_split(name: str, records: list[Record], prompt_template: str, completion_template: str) -> Split:
    """A split's prompt/completion records rendered by the two templates (an empty prompt or completion is one
    :class:`DataError` line); a record's evaluation source is its ``group``, else its prompt."""
    prompts, completions, groups = [], [], []
    for record in records:
        prompt = render(prompt_template, "prompt_template", record)
        completion = render(completion_template, "completion_template", record)
        if not prompt.strip():
            raise DataError(f"{record.path} {record.where}: the prompt is empty (data.prompt_template "
                            f"{prompt_template!r})")
        if not completion.strip():
            raise DataError(f"{record.path} {record.where}: the completion (reference) is empty "
                            f"(data.completion_template {completion_template!r})")
        prompts.append(prompt)
        completions.append(completion)
        groups.append(prompt if record.group is None else ("group", record.group))
    return Split(name=name, files=files_of(records), prompts=prompts, completions=completions, groups=groups)


def files_of(records: list[Record]) -> list[Path]:
    """The files ``records`` come from, in order of first appearance."""
    return list(dict.fromkeys(r.path for r in records))


def check_chat_mode(mode: Any) -> str:
    """``mode`` if it is one of :data:`CHAT_TEMPLATE_MODES`, else a one-line :class:`DataError`."""
    if not isinstance(mode, str) or mode not in CHAT_TEMPLATE_MODES:
        raise DataError(f"data.chat_template must be one of {', '.join(CHAT_TEMPLATE_MODES)}, got {mode!r}")
    return mode


def uses_chat_template(tokenizer: Any, mode: str, name: str | None = None) -> bool:
    """Whether prompts are rendered with ``tokenizer``'s chat template under ``mode``; ``always`` with a tokenizer
    that has none is a one-line :class:`DataError` (naming the tokenizer ``name``, by default its own)."""
    if check_chat_mode(mode) == "none":
        return False
    has = bool(getattr(tokenizer, "chat_template", None))
    if mode == "always" and not has:
        name = name or getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise DataError(f"data.chat_template is 'always' but the tokenizer {name!r} has no chat template "
                        f"(use 'auto' or 'none' for the plain prompt)")
    return has


def _render_chat(tokenizer: Any, messages: list[dict[str, str]], generation_prompt: bool) -> str:
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    except Exception as exc:  # the template's own errors (jinja2, raise_exception) and bad templates
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise DataError(f"the tokenizer's chat template fails: {type(exc).__name__}: {first} (set "
                        f"data.chat_template: none for the plain prompt)") from None
    if not isinstance(text, str):
        raise DataError(f"the tokenizer's chat template gave a {type(text).__name__}, not text")
    return text


def render_prompt(tokenizer: Any, prompt: str) -> str:
    """``prompt`` as one user turn in ``tokenizer``'s chat template, ending with the generation prompt (SmolLM2:
    ``<|im_start|>assistant\\n``)."""
    return _render_chat(tokenizer, _user(prompt), True)


def _user(prompt: str) -> list[dict[str, str]]:
    """The conversation of one prompt: a single user turn. No system message: a template's default system
    prompt (SmolLM2: "You are a helpful AI assistant named SmolLM, ...") applies, as in ``apply_chat_template``."""
    return [{"role": "user", "content": prompt}]


@dataclass(frozen=True)
class ChatFormat:
    """A tokenizer's chat template applied to prompt -> completion pairs.

    The prompt is one user turn followed by the generation prompt (the assistant turn's header); the completion
    is what the template writes between the generation prompt and the reply (usually nothing), the reply (the
    completion text without surrounding whitespace) and the end of the assistant turn (e.g. ``<|im_end|>``; the
    template's text after the reply, without trailing whitespace).
    """

    tokenizer: Any
    reply_prefix: str
    end_of_turn: str
    #: the rendered prompt's text before and after the user's prompt ("" when the template does not show it once)
    head: str
    tail: str

    @classmethod
    def of(cls, tokenizer: Any) -> ChatFormat:
        """The format of ``tokenizer``'s chat template (rendered once with stand-in texts)."""
        framed = render_prompt(tokenizer, _PROMPT_MARK)
        head, tail = framed.split(_PROMPT_MARK) if framed.count(_PROMPT_MARK) == 1 else ("", "")
        full = _render_chat(tokenizer, [*_user(_PROMPT_MARK), {"role": "assistant", "content": _REPLY_MARK}], False)
        if full.count(_REPLY_MARK) != 1:
            raise DataError("the tokenizer's chat template does not write the assistant's reply once (set "
                            "data.chat_template: none for the plain prompt)")
        at = full.index(_REPLY_MARK)
        # the completion continues the generation prompt the model sees at inference
        prefix = full[len(framed):at] if full.startswith(framed) else ""
        return cls(tokenizer=tokenizer, reply_prefix=prefix, end_of_turn=full[at + len(_REPLY_MARK):].rstrip(),
                   head=head, tail=tail)

    def prompt(self, prompt: str) -> str:
        """The rendered prompt (:func:`render_prompt`)."""
        return render_prompt(self.tokenizer, prompt)

    def completion(self, completion: str) -> str:
        """The text the model learns to write after :meth:`prompt`: the reply and the end of the turn."""
        return self.reply_prefix + completion.strip() + self.end_of_turn


def chat_format(tokenizer: Any, mode: str, name: str | None = None) -> ChatFormat | None:
    """The :class:`ChatFormat` of ``tokenizer`` under ``data.chat_template`` = ``mode``; ``None`` for the plain
    prompt text."""
    return ChatFormat.of(tokenizer) if uses_chat_template(tokenizer, mode, name) else None


def prompt_text(tokenizer: Any, prompt: str, chat: bool) -> tuple[str, bool]:
    """``(text to tokenize, add special tokens?)`` of one prompt: the plain prompt with the tokenizer's special
    tokens, or the chat-rendered prompt (:func:`render_prompt`) without: the template writes its own (e.g. a
    BOS), as ``apply_chat_template(tokenize=True)`` assumes."""
    return (render_prompt(tokenizer, prompt), False) if chat else (prompt, True)


def encode_prompts(tokenizer: Any, prompts: list[str], chat: bool) -> list[list[int]]:
    """The token ids of each prompt, rendered by :func:`prompt_text`."""
    if not prompts:
        return []
    rendered = [prompt_text(tokenizer, p, chat) for p in prompts]
    texts, special = [text for text, _ in rendered], rendered[0][1]
    return [list(ids) for ids in tokenizer(texts, add_special_tokens=special)["input_ids"]]


def chat_prompt(tokenizer: Any, prompt: str, mode: str) -> tuple[str, bool]:
    """The text to tokenize for a generation ``prompt`` exactly as the data module renders it under
    ``data.chat_template`` = ``mode``, and whether the tokenizer must add its special tokens to it.

    ``none`` (or ``auto`` with a tokenizer without a chat template): ``(prompt, True)``; with the chat template:
    ``(rendered prompt ending with the generation prompt, False)``. Tokenize with
    ``tokenizer(text, add_special_tokens=special)``. ``always`` without a chat template, or an unknown mode, is a
    one-line :class:`DataError`. Runs trained before the option existed used the plain prompt (``none``).
    """
    return prompt_text(tokenizer, prompt, uses_chat_template(tokenizer, mode))
