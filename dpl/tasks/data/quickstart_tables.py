"""A table-to-text set that dpl generates in memory, for the generation quickstart (``configs/e2e/quickstart.yaml``):
E2E-style meaning representations of made-up restaurants (``name[...], eatType[...], food[...], ...``) with two to
three reference sentences each, from a fixed vocabulary and templates, deterministic given the seed. No download:
a fresh clone runs it offline. :class:`QuickstartE2EDataModule` reads it as :class:`E2EDataModule` reads the E2E
files (one row per reference, evaluation grouped by ``mr``)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from dpl.errors import ConfigError
from dpl.tasks.data.e2e import E2EDataModule
from dpl.tasks.data.templates import Record

NAMES = ["The Olive Tree", "Blue Spice", "The Golden Palace", "Green Man", "The Mill", "Loch Fyne", "The Punter",
         "Cotto", "Aromi", "Zizzi", "The Eagle", "Wildwood", "Fitzbillies", "The Vaults", "Clowns", "Giraffe",
         "Strada", "The Phoenix", "Alimentum", "Bibimbap House", "The Cricketers", "Midsummer House", "Browns",
         "The Dumpling Tree", "Taste of Cambridge", "The Rice Boat", "Travellers Rest", "The Wrestlers"]
EAT_TYPES = {"restaurant": "restaurant", "coffee shop": "coffee shop", "pub": "pub"}
FOODS = ["Italian", "French", "Chinese", "Indian", "Japanese", "English", "fast food"]
PRICES = {"cheap": "cheap", "moderate": "moderately priced", "high": "expensive"}
AREAS = {"riverside": "by the riverside", "city centre": "in the city centre"}
NEAR = ["the Bakers", "Cafe Sicilia", "Burger King", "Raja Indian Cuisine", "the Portland Arms", "Rainbow Vegetarian Cafe"]

#: the generator's seed and sizes when the config does not set them
SEED, TRAIN_SIZE, VALIDATION_SIZE = 0, 2000, 40


def _article(word: str) -> str:
    return "an" if word[0].lower() in "aeiou" else "a"


def _table(rng: random.Random) -> dict[str, str]:
    table = {"name": rng.choice(NAMES), "eatType": rng.choice(list(EAT_TYPES)), "food": rng.choice(FOODS),
             "priceRange": rng.choice(list(PRICES)), "area": rng.choice(list(AREAS))}
    if rng.random() < 0.5:
        table["familyFriendly"] = rng.choice(["yes", "no"])
    if rng.random() < 0.4:
        table["near"] = rng.choice(NEAR)
    return table


def _mr(table: dict[str, str]) -> str:
    return ", ".join(f"{key}[{value}]" for key, value in table.items())


def _sentences(table: dict[str, str]) -> list[str]:
    """Three wordings of the same table (every field named in each)."""
    name, kind, food = table["name"], EAT_TYPES[table["eatType"]], table["food"]
    price, area = PRICES[table["priceRange"]], AREAS[table["area"]]
    family = {"yes": " It is family friendly.", "no": " It is not family friendly."}.get(table.get("familyFriendly"), "")
    near = f" near {table['near']}" if "near" in table else ""
    return [f"{name} is {_article(price)} {price} {food} {kind} {area}{near}.{family}",
            f"{_article(food).capitalize()} {food} {kind} {area}{near}, {name} is {price}.{family}",
            f"For {price} {food if food == 'fast food' else food + ' food'}, try {name}, {_article(kind)} {kind} {area}{near}.{family}"]


def generate(seed: int = SEED, train_size: int = TRAIN_SIZE, validation_size: int = VALIDATION_SIZE,
             ) -> dict[str, list[tuple[str, str]]]:
    """``{"train": [(mr, ref), ...], "validation": [...]}``: ``train_size`` training rows and references for
    ``validation_size`` meaning representations that no training row has (two to three references each)."""
    rng = random.Random(seed)
    rows: dict[str, list[tuple[str, str]]] = {"train": [], "validation": []}
    seen: set[str] = set()
    held = 0
    while held < validation_size:
        table = _table(rng)
        mr = _mr(table)
        if mr in seen:
            continue
        seen.add(mr)
        refs = _sentences(table)
        rows["validation"] += [(mr, ref) for ref in refs[:rng.choice([2, 3])]]
        held += 1
    while len(rows["train"]) < train_size:
        table = _table(rng)
        mr = _mr(table)
        if mr in seen:
            continue  # a held-out table, or one already written: draw another
        seen.add(mr)
        for ref in _sentences(table)[:rng.choice([1, 2, 3])]:
            if len(rows["train"]) < train_size:
                rows["train"].append((mr, ref))
    return rows


class QuickstartE2EDataModule(E2EDataModule):
    """The generation quickstart's data: E2E-style tables and sentences generated in memory
    (:func:`dpl.tasks.data.quickstart_tables.generate`), read as :class:`E2EDataModule` reads ``mr``/``ref`` rows.

    Args:
        train_size: training rows (one reference sentence each).
        validation_size: meaning representations held out for validation (none of them is trained on).
        seed: the generator's seed (same seed: same rows).
        **kwargs: the options of :class:`E2EDataModule` (``tokenizer``, ``max_length``, ``chat_template``, ...);
            no data files are read.
    """

    def __init__(self, train_size: int = TRAIN_SIZE, validation_size: int = VALIDATION_SIZE, seed: int = SEED,
                 **kwargs: Any) -> None:
        if train_size < 2 or validation_size < 1:
            raise ConfigError(f"data.train_size must be at least 2 and data.validation_size at least 1, got "
                              f"{train_size} and {validation_size}")
        for key in ("data_dir", "train_file", "val_file", "test_file", "holdout_mrs"):
            if kwargs.get(key) is not None:
                raise ConfigError(f"data.{key}: {type(self).__name__} generates its rows and reads no file (use "
                                  f"dpl.tasks.data.E2EDataModule for files)")
        super().__init__(**kwargs)
        self.train_size, self.validation_size, self.seed = train_size, validation_size, seed

    def _path(self, split: str) -> Path:
        return Path(f"<generated {split} tables, seed {self.seed}>")

    def read_splits(self) -> dict[str, list[Record]]:
        rows = generate(self.seed, self.train_size, self.validation_size)
        return {split: [Record(fields={"mr": mr, "ref": ref}, path=self._path(split), where=f"row {i + 1}")
                        for i, (mr, ref) in enumerate(pairs)] for split, pairs in rows.items()}

    def train_name(self) -> str:
        return "the generated tables"

    def training_data(self) -> dict[str, Any] | None:
        """The generator, its settings and a hash of the generated training rows."""
        from dpl.lightning.provenance import describe_generated

        lines = (f"{mr}\t{ref}" for mr, ref in generate(self.seed, self.train_size, self.validation_size)["train"])
        settings = {"seed": self.seed, "train_size": self.train_size, "validation_size": self.validation_size}
        return describe_generated("dpl.tasks.data.quickstart_tables.generate", settings, lines, "mr<TAB>ref")
