"""JSON-lines generation data: one object per line with a prompt and a completion field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dpl.errors import DataError
from dpl.tasks.data.files import json_lines, read_text
from dpl.tasks.data.generation import GenerationDataModule
from dpl.tasks.data.templates import Record, show_fields


class JSONLDataModule(GenerationDataModule):
    """JSON lines, one object per line with a prompt and a completion field; lines with identical prompts form
    one evaluation source (their completions are its references, in file order).

    Fields: every key of the line's object, plus ``prompt`` and ``completion`` (the values of ``prompt_field``
    and ``completion_field``, so the default templates work whatever the field names).

    Args:
        data_dir: folder with ``train*.jsonl``, ``dev*.jsonl`` / ``val*.jsonl`` and ``test*.jsonl`` (``.json``
            files holding JSON lines are found too).
        prompt_field: key of the prompt text in each object.
        completion_field: key of the completion text in each object.
        user_column: column (generation readers: record field) naming the user who owns each row, for
            privacy.unit: user; rows of one user form one privacy unit. Any key of the objects.
        **kwargs: the other options of :class:`~dpl.tasks.data.generation.GenerationDataModule` (``train_file``,
            ``val_file``, ``test_file``, ``tokenizer``, templates, ``max_length``, ...).
    """

    FILE_PATTERNS = {"train": ("train*.jsonl", "train*.json"),
                     "validation": ("dev*.jsonl", "dev*.json", "val*.jsonl", "val*.json"),
                     "test": ("test*.jsonl", "test*.json")}

    def __init__(self, data_dir: str | None = None, prompt_field: str = "prompt",
                 completion_field: str = "completion", **kwargs: Any) -> None:
        super().__init__(data_dir=data_dir, **kwargs)
        self.prompt_field = prompt_field
        self.completion_field = completion_field

    def unit_description(self, unit: str = "example") -> str:
        if unit == "user":
            return super().unit_description(unit)
        return f"one line of {self.train_name()} (a prompt with its completion)"

    def read_file(self, split: str, path: Path) -> list[Record]:
        text = read_text(path)
        records: list[Record] = []
        for number, item in json_lines(path, text):
            for key, what in ((self.prompt_field, "prompt"), (self.completion_field, "completion")):
                if key not in item:
                    raise DataError(f"{path} line {number}: missing {what} field {key!r} (fields: "
                                    f"{show_fields(item)})")
                if not isinstance(item[key], str):
                    raise DataError(f"{path} line {number}: {what} field {key!r} must be a string, found "
                                    f"{type(item[key]).__name__}")
            if not item[self.completion_field].strip():
                raise DataError(f"{path} line {number}: empty completion in field {self.completion_field!r}")
            fields = {**item, "prompt": item[self.prompt_field], "completion": item[self.completion_field]}
            records.append(Record(fields=fields, path=path, where=f"line {number}"))
        if not records:
            raise DataError(f"{path}: the file has no JSON lines")
        return records
