"""Data for learning to generate a data set (DP synthetic data; Yue et al., "Synthetic text generation with
differential privacy: a simple and practical recipe", ACL 2023): a causal LM learns the records themselves, each
conditioned on its public attributes (the label and any other control column) through a plain-text control prefix.

* A table (CSV, TSV, JSON lines, Parquet; a text column, a label column and other control columns): the prompt is
  the control prefix and the name of the text column, ``"label: 1\\nsentence:"``; the completion is the text, every
  one of its tokens scored (and the EOS that ends it).
* Conversations (JSON lines with ``messages``): the control prefix (plain text; nothing without control columns),
  then the whole conversation in the tokenizer's chat template; every token of the conversation is scored (system,
  user and assistant turns and the template's own tokens), so the model learns to write both sides.

The control values seen in the training file (the label names) are kept as the run's public schema
(:meth:`SyntheticDataModule.schema`, saved with the checkpoint), as classification keeps its label names.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Literal

from dpl.core.privacy_unit import EXAMPLE, PrivacyUnit
from dpl.errors import DataError
from dpl.tasks.data.conversations import check_messages, encode, segments
from dpl.tasks.data.files import json_lines, read_text
from dpl.tasks.data.generation import GenerationDataModule
from dpl.tasks.data.padding import IGNORE_INDEX
from dpl.tasks.data.templates import Record, show_fields, uses_chat_template

__all__ = ["SyntheticDataModule", "control_prefix", "table_prompt"]

SCHEMA_KEY = "synthetic_schema"


def control_prefix(controls: dict[str, Any]) -> str:
    """The control prefix of one record: a ``column: value`` line per control column, in order."""
    return "".join(f"{column}: {value}\n" for column, value in controls.items())


def table_prompt(controls: dict[str, Any], text_column: str) -> str:
    """The prompt of a table record: its control prefix, then ``text_column:`` (the text follows after a space)."""
    return control_prefix(controls) + f"{text_column}:"


def _listed_values(given: dict[str, list[Any]] | None, controls: list[str]) -> dict[str, list[str]]:
    """``data.control_values`` checked (a control column each, distinct non-empty values) and written as strings."""
    listed: dict[str, list[str]] = {}
    for column, values in (given or {}).items():
        if column not in controls:
            raise DataError(f"data.control_values names {column!r}, which is not a control column (they are: "
                            f"{', '.join(controls) or 'none'})")
        if not isinstance(values, (list, tuple)) or not values:
            raise DataError(f"data.control_values[{column!r}] must be a non-empty list of values, got {values!r}")
        strings = [str(v) for v in values]
        if any(not v.strip() for v in strings):
            raise DataError(f"data.control_values[{column!r}] lists an empty value")
        repeated = [v for v in strings if strings.count(v) > 1]
        if repeated:
            raise DataError(f"data.control_values[{column!r}] lists {repeated[0]!r} more than once")
        listed[column] = strings
    return listed


def _template(control_columns: list[str], text_column: str) -> str:
    """:func:`table_prompt` as a ``str.format`` template over the record's fields."""
    escape = str.maketrans({"{": "{{", "}": "}}"})
    return "".join(f"{c.translate(escape)}: {{{c}}}\n" for c in control_columns) + f"{text_column.translate(escape)}:"


class SyntheticDataModule(GenerationDataModule):
    """Records of a classification or text data set, for a causal LM that learns to generate them, each conditioned
    on its control columns (label and other public attributes) through a control prefix.

    Args:
        data_dir: folder with the training file (``train.tsv``, ``train.csv``, ``train.jsonl``, ``train.json`` or
            ``train.parquet``).
        text_column: the column holding the text to generate (tables).
        label_column: the label column: a control column whose value proportions ``dpl synthesize`` chooses
            (uniform, given, or a DP histogram); ``null`` for none.
        control_columns: other public attributes to condition on (their values seen in training are the run's
            public schema, as label names are: name only columns whose values are public).
        control_values: the values of control columns, by column (``{label: ["0", "1"]}``): the schema then holds
            these instead of the values seen in the training file, which stay private (a value only some records
            have is not revealed); a training record with a value not listed is an error. Set it where the set of
            values is itself sensitive, as classification's ``labels``.
        format: ``table`` (CSV/TSV/JSON/Parquet rows), ``messages`` (conversations in ``messages_field``), or
            ``auto`` (``messages`` when a JSON-lines file's first line has ``messages_field``).
        messages_field: key of a conversation's list of turns.
        chat_template: tables: ``none`` (default: the plain control prefix) or ``auto``/``always`` (the prefix as a
            user turn of the chat template); conversations are always rendered with the chat template.
        max_length: most tokens of one training example; a longer one keeps its start (the control prefix and the
            beginning of the record) and loses its end.
        **kwargs: the other options of :class:`~dpl.tasks.data.generation.GenerationDataModule` (``train_file``,
            ``tokenizer``, ``max_train_examples``, ``user_column``, ...).
    """

    FILE_PATTERNS = {"train": ("train*.tsv", "train*.csv", "train*.jsonl", "train*.json", "train*.parquet")}

    def __init__(self, data_dir: str | None = None, text_column: str = "text", label_column: str | None = "label",
                 control_columns: list[str] | None = None, control_values: dict[str, list[Any]] | None = None,
                 format: Literal["auto", "table", "messages"] = "auto", messages_field: str = "messages",
                 chat_template: Literal["auto", "none", "always"] = "none", max_length: int = 128,
                 **kwargs: Any) -> None:
        if format not in ("auto", "table", "messages"):
            raise DataError(f"data.format must be one of auto, table, messages, got {format!r}")
        controls = ([label_column] if label_column else []) + [c for c in control_columns or []
                                                               if c != label_column]
        if text_column in controls:
            raise DataError(f"data.text_column {text_column!r} cannot also be a control column")
        self.control_values = _listed_values(control_values, controls)
        for name in ("prompt_template", "completion_template"):
            if name in kwargs:
                raise DataError(f"data.{name} is set by the control columns here; do not set it")
        super().__init__(data_dir=data_dir, prompt_template=_template(controls, text_column),
                         completion_template=f" {{{text_column}}}", chat_template=chat_template,
                         max_length=max_length, **kwargs)
        self.text_column = text_column
        self.label_column = label_column
        self.control_columns = controls
        self.format = format
        self.messages_field = messages_field
        self._controls: dict[str, list[list[Any]]] = {}  # split -> the control values of each record

    # ------------------------------------------------------------------------------------ reading

    def read_file(self, split: str, path: Path) -> list[Record]:
        if path.suffix.lower() == ".jsonl" and self.format != "table":
            items = json_lines(path, read_text(path))
            if self.format == "messages" or (items and self.messages_field in items[0][1]):
                return self._conversations(path, items)
        elif self.format == "messages":
            raise DataError(f"{path}: data.format is messages, which needs a JSON-lines (.jsonl) file")
        return self._table(split, path)

    def _table(self, split: str, path: Path) -> list[Record]:
        from dpl.tasks.data.tables import column_values, load_split

        columns = [self.text_column, *self.control_columns]
        if split == "train" and self.user_column and self.user_column not in columns:
            columns.append(self.user_column)
        data = load_split(split, path, columns)
        values = {c: column_values(data.dataset, c) for c in columns}
        records = []
        for i in range(len(data.dataset)):
            fields = {c: ("" if values[c][i] is None else values[c][i]) for c in columns}
            if not isinstance(fields[self.text_column], str) or not fields[self.text_column].strip():
                raise DataError(f"{path} {data.where(i)}: empty text in column {self.text_column!r}")
            for column in self.control_columns:
                if str(fields[column]).strip() == "":
                    raise DataError(f"{path} {data.where(i)}: empty value in control column {column!r}")
            records.append(Record(fields=fields, path=path, where=data.where(i)))
        return records

    def _conversations(self, path: Path, items: list[tuple[int, dict[str, Any]]]) -> list[Record]:
        records = []
        for number, item in items:
            if self.messages_field not in item:
                raise DataError(f"{path} line {number}: missing conversation field {self.messages_field!r} "
                                f"(fields: {show_fields(item)})")
            for column in self.control_columns:
                if column not in item or str(item[column]).strip() == "":
                    raise DataError(f"{path} line {number}: missing or empty control field {column!r} (fields: "
                                    f"{show_fields(item)})")
            messages = check_messages(item[self.messages_field], path, f"line {number}", self.messages_field)
            records.append(Record(fields=dict(item), path=path, where=f"line {number}", group=(str(path), number),
                                  messages=messages))
        if not records:
            raise DataError(f"{path}: the file has no JSON lines")
        return records

    def read_splits(self) -> dict[str, list[Record]]:
        splits = super().read_splits()
        self._controls = {name: [[r.fields[c] for c in self.control_columns] for r in records]
                          for name, records in splits.items()}
        for column, listed in self.control_values.items():
            allowed = set(listed)
            for record in splits["train"]:
                if str(record.fields[column]) not in allowed:
                    raise DataError(f"{record.path} {record.where}: {column} {str(record.fields[column])!r} is not "
                                    f"in data.control_values[{column!r}]")
        return splits

    # ------------------------------------------------------------------------------------ schema

    def schema(self) -> dict[str, Any]:
        """The run's public schema: the text column (or the conversation field), the control columns with the
        values seen in the training file (sorted), the format and the file type."""
        self.validate_data()
        assert self._splits is not None
        path = self._splits["train"].files[0]
        values = {c: self.control_values.get(c) or sorted({str(row[i]) for row in self._controls["train"]})
                  for i, c in enumerate(self.control_columns)}
        return {"text_column": self.text_column, "label_column": self.label_column,
                "control_columns": list(self.control_columns), "values": values,
                "format": "messages" if self.conversational else "table", "messages_field": self.messages_field,
                "file_type": path.suffix.lower().lstrip(".")}

    def state_dict(self) -> dict[str, Any]:
        return {SCHEMA_KEY: self.schema()} if self._splits is not None else {}

    def train_controls(self) -> list[list[Any]]:
        """The control values of each training record (private: ``dpl synthesize``'s DP histogram counts them)."""
        self.validate_data()
        rows = self._controls["train"]
        return rows[:self.max_train_examples] if self.max_train_examples is not None else rows

    def unit_description(self, unit: PrivacyUnit = EXAMPLE) -> str:
        if unit.per_user:
            return super().unit_description(unit)
        what = "a conversation" if self.conversational else "a text"
        controls = f" with its {', '.join(self.control_columns)}" if self.control_columns else ""
        return f"one record of {self.train_name()} ({what}{controls})"

    # ------------------------------------------------------------------------------------ tokens

    def _tokenize_train(self, split: Any) -> list[dict[str, Any]]:
        if split.conversations is None:
            return super()._tokenize_train(split)
        tokenizer = self.tokenizer
        if not uses_chat_template(tokenizer, "always", self.tokenizer_location):
            raise DataError(f"conversations are rendered with the tokenizer's chat template; "
                            f"{self.tokenizer_location!r} has none")
        controls = self._controls[split.name]
        examples, truncated = [], 0
        for messages, values in list(zip(split.conversations, controls))[:self.max_train_examples]:
            prefix = control_prefix(dict(zip(self.control_columns, values)))
            head = list(tokenizer(prefix, add_special_tokens=False)["input_ids"]) if prefix else []
            ids, _ = encode(tokenizer, segments(tokenizer, messages))
            ids = head + ids
            labels = [IGNORE_INDEX] * len(head) + ids[len(head):]
            if len(ids) > self.max_length:
                truncated += 1
                ids, labels = ids[:self.max_length], labels[:self.max_length]
            examples.append({"input_ids": ids, "labels": labels})
        if truncated:
            warnings.warn(f"{split.name}: {truncated} of {len(examples)} conversations are longer than "
                          f"max_length={self.max_length} tokens and were truncated (their end cut)", stacklevel=3)
        return examples
