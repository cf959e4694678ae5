"""JSON-lines generation data: one object per line with a prompt and a completion field, or a conversation
(a ``messages`` list of role/content turns); the same columns of a Hugging Face data set (``data.dataset``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from dpl.core.privacy_unit import EXAMPLE, PrivacyUnit
from dpl.errors import DataError
from dpl.tasks.data.conversations import check_messages
from dpl.tasks.data.files import json_lines, read_text
from dpl.tasks.data.generation import GenerationDataModule
from dpl.tasks.data.templates import Record, show_fields


class JSONLDataModule(GenerationDataModule):
    """JSON lines, one object per line with a prompt and a completion field; lines with identical prompts form
    one evaluation source (their completions are its references, in file order). Or one conversation per line
    (``{"messages": [{"role": "user", "content": ...}, {"role": "assistant", "content": ...}, ...]}``, the OpenAI
    and TRL fine-tuning format): one training example per conversation, labelled on its assistant turns; one
    evaluation source per conversation, whose last assistant turn is generated from the turns before it.

    Fields: every key of the line's object, plus ``prompt`` and ``completion`` (the values of ``prompt_field``
    and ``completion_field``, so the default templates work whatever the field names).

    Args:
        data_dir: folder with ``train*.jsonl``, ``dev*.jsonl`` / ``val*.jsonl`` and ``test*.jsonl`` (``.json``
            files holding JSON lines are found too).
        prompt_field: key of the prompt text in each object.
        completion_field: key of the completion text in each object.
        format: ``messages`` (conversations in ``messages_field``), ``prompt_completion``, or ``auto``: each file
            by its first line (``messages`` when it has ``messages_field``).
        messages_field: key of a conversation's list of turns (roles system, user, assistant).
        user_column: column (generation readers: record field) naming the user who owns each row, for
            privacy.unit: user; rows of one user form one privacy unit. Any key of the objects.
        **kwargs: the other options of :class:`~dpl.tasks.data.generation.GenerationDataModule` (``train_file``,
            ``val_file``, ``test_file``, ``tokenizer``, templates, ``max_length``, ...).
    """

    FILE_PATTERNS = {"train": ("train*.jsonl", "train*.json"),
                     "validation": ("dev*.jsonl", "dev*.json", "val*.jsonl", "val*.json"),
                     "test": ("test*.jsonl", "test*.json")}

    def __init__(self, data_dir: str | None = None, prompt_field: str = "prompt",
                 completion_field: str = "completion",
                 format: Literal["auto", "prompt_completion", "messages"] = "auto",
                 messages_field: str = "messages", **kwargs: Any) -> None:
        super().__init__(data_dir=data_dir, **kwargs)
        if format not in ("auto", "prompt_completion", "messages"):
            raise DataError(f"data.format must be one of auto, prompt_completion, messages, got {format!r}")
        self.prompt_field = prompt_field
        self.completion_field = completion_field
        self.format = format
        self.messages_field = messages_field

    def unit_description(self, unit: PrivacyUnit = EXAMPLE) -> str:
        if unit.per_user:
            return super().unit_description(unit)
        if self.conversational:
            return f"one line of {self.train_name()} (a conversation)"
        return f"one line of {self.train_name()} (a prompt with its completion)"

    def read_file(self, split: str, path: Path) -> list[Record]:
        return self._records(path, json_lines(path, read_text(path)), "line")

    def read_rows(self, split: str, path: Path, rows: list[dict[str, Any]]) -> list[Record]:
        """A data set split's rows, each with the columns of a JSON line."""
        return self._records(path, list(enumerate(rows, start=1)), "row")

    def _records(self, path: Path, items: list[tuple[int, dict[str, Any]]], unit: str) -> list[Record]:
        """The records of ``items`` (numbered objects of ``path``; ``unit``: what a number counts, line or row)."""
        if self.format == "messages" or (self.format == "auto" and items and self.messages_field in items[0][1]):
            return self._conversations(path, items, unit)
        records: list[Record] = []
        for number, item in items:
            for key, what in ((self.prompt_field, "prompt"), (self.completion_field, "completion")):
                if key not in item:
                    raise DataError(f"{path} {unit} {number}: missing {what} field {key!r} (fields: "
                                    f"{show_fields(item)})")
                if not isinstance(item[key], str):
                    raise DataError(f"{path} {unit} {number}: {what} field {key!r} must be a string, found "
                                    f"{type(item[key]).__name__}")
            if not item[self.completion_field].strip():
                raise DataError(f"{path} {unit} {number}: empty completion in field {self.completion_field!r}")
            fields = {**item, "prompt": item[self.prompt_field], "completion": item[self.completion_field]}
            records.append(Record(fields=fields, path=path, where=f"{unit} {number}"))
        if not records:
            raise DataError(f"{path}: the file has no JSON lines")
        return records

    def _conversations(self, path: Path, items: list[tuple[int, dict[str, Any]]], unit: str) -> list[Record]:
        records = []
        for number, item in items:
            if self.messages_field not in item:
                raise DataError(f"{path} {unit} {number}: missing conversation field {self.messages_field!r} "
                                f"(fields: {show_fields(item)})")
            messages = check_messages(item[self.messages_field], path, f"{unit} {number}", self.messages_field)
            records.append(Record(fields=dict(item), path=path, where=f"{unit} {number}", group=(str(path), number),
                                  messages=messages))
        if not records:
            raise DataError(f"{path}: the file has no JSON lines")
        return records
