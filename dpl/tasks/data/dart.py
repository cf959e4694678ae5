"""DART data in its official JSON format: triple sets, each with one or more reference sentences."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dpl.core.privacy_unit import EXAMPLE, PrivacyUnit
from dpl.errors import DataError
from dpl.tasks.data.files import read_text
from dpl.tasks.data.generation import GenerationDataModule
from dpl.tasks.data.templates import Record

#: the ``user_column`` value that makes each entry (a triple set with all its annotations) one user
ENTRY = "entry"


def linearize_triples(tripleset: list[list[str]]) -> str:
    """``"s : p : o | s : p : o"`` of a DART triple set."""
    return " | ".join(" : ".join(str(x).strip() for x in triple) for triple in tripleset)


class DARTDataModule(GenerationDataModule):
    """DART data in its official JSON format: a JSON list of entries ``{"tripleset": [[subject, predicate,
    object], ...], "subtree_was_extended": bool, "annotations": [{"source": str, "text": str}, ...]}``.

    Fields: ``triples`` (the triple set linearized as ``"s : p : o | s : p : o"``), ``text`` and ``source`` (of
    one annotation). Training: one example per annotation. Evaluation: one source per entry, its annotation
    texts as references.

    Args:
        data_dir: folder with ``*.json`` files whose names contain ``train``, ``dev`` (or ``val``) and ``test``
            (e.g. ``dart-v1.1.1-full-train.json``, ``-dev.json``, ``-test.json``).
        prompt_template, completion_template: see :class:`~dpl.tasks.data.generation.GenerationDataModule`.
        user_column: column (generation readers: record field) naming the user who owns each row, for
            privacy.unit: user; rows of one user form one privacy unit. ``entry``: one unit per DART entry (its
            triple set with all its annotations); a field works too (``triples`` joins the entries sharing it).
        **kwargs: the other options of :class:`~dpl.tasks.data.generation.GenerationDataModule` (``train_file``,
            ``val_file``, ``test_file``, ``tokenizer``, ``max_length``, ...).
    """

    FILE_PATTERNS = {"train": ("*train*.json",), "validation": ("*dev*.json", "*val*.json"),
                     "test": ("*test*.json",)}
    DATA_SOURCE = ("get DART (dart-v1.1.1-full-{train,dev,test}.json) from https://github.com/Yale-LILY/dart "
                   "(data/v1.1.1) and set data.data_dir to their folder; offline: dpl fit --config "
                   "configs/e2e/quickstart.yaml (generated tables)")

    def __init__(self, data_dir: str | None = None, prompt_template: str = "Triples: {triples}\nSentence:",
                 completion_template: str = " {text}", **kwargs: Any) -> None:
        super().__init__(data_dir=data_dir, prompt_template=prompt_template, completion_template=completion_template,
                         **kwargs)

    def user_key(self, record: Record) -> Any:
        """``user_column: entry``: the entry's index in the file; otherwise the record field."""
        if self.user_column == ENTRY:
            return str(record.group[1])
        return super().user_key(record)

    def unit_description(self, unit: PrivacyUnit = EXAMPLE) -> str:
        name = self.train_name()
        if unit.per_user and self.user_column == ENTRY:
            return f"one entry of {name}: a triple set with all its annotations"
        if unit.per_user:
            return super().unit_description(unit)
        return (f"one annotation of an entry of {name} (one reference text of a triple set); several annotations "
                f"share one triple set: use privacy.unit: user with data.user_column: entry to protect a whole entry")

    def read_file(self, split: str, path: Path) -> list[Record]:
        text = read_text(path)
        if not text.strip():
            raise DataError(f"{path}: the file is empty")
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise DataError(f"{path} line {exc.lineno}: invalid JSON ({exc.msg})") from None
        if not isinstance(data, list):
            raise DataError(f"{path}: expected a JSON list of DART entries, found a {type(data).__name__}")
        if not data:
            raise DataError(f"{path}: the JSON list has no entries")
        records: list[Record] = []
        for i, entry in enumerate(data):
            where = f"entry {i}"
            if not isinstance(entry, dict):
                raise DataError(f"{path} {where}: expected a JSON object, found {type(entry).__name__}")
            tripleset = entry.get("tripleset")
            if not isinstance(tripleset, list) or not tripleset:
                raise DataError(f"{path} {where}: no tripleset (expected a non-empty list of "
                                f"[subject, predicate, object])")
            for triple in tripleset:
                if not isinstance(triple, list) or len(triple) != 3 or not all(isinstance(x, str) for x in triple):
                    raise DataError(f"{path} {where}: bad triple {json.dumps(triple)[:80]} (expected [subject, "
                                    f"predicate, object] strings)")
            annotations = entry.get("annotations")
            if not isinstance(annotations, list) or not annotations:
                raise DataError(f"{path} {where}: no annotations (expected a non-empty list of "
                                f"{{\"source\": ..., \"text\": ...}})")
            triples = linearize_triples(tripleset)
            for k, note in enumerate(annotations):
                if not isinstance(note, dict) or not isinstance(note.get("text"), str):
                    raise DataError(f"{path} {where} annotation {k}: expected an object with a \"text\" string")
                if not note["text"].strip():
                    raise DataError(f"{path} {where} annotation {k}: empty reference text")
                fields = {"triples": triples, "text": note["text"], "source": str(note.get("source", ""))}
                records.append(Record(fields=fields, path=path, where=f"{where} annotation {k}", group=(str(path), i)))
        return records
