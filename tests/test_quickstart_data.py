"""The quickstart data generated in memory (``data.train_size``): deterministic, balanced, the same generator as
the shipped files, no validation sentence among the training sentences."""

import pytest

from dpl.tasks.data.quickstart import QuickstartDataModule
from dpl.tasks.data.quickstart_gen import generate
from dpl.errors import ConfigError


def test_generated_splits_are_deterministic_balanced_and_disjoint():
    dm = QuickstartDataModule(train_size=3000, validation_size=500, seed=7)
    summary = dm.validate_data()
    assert summary["rows"] == {"train": 3000, "validation": 500}
    assert dm.label_map == {"negative": 0, "positive": 1}
    texts = {}
    for name in ("train", "validation"):
        keys = dm._splits[name].keys
        assert keys.count("positive") == keys.count("negative")
        texts[name] = dm._splits[name].dataset["sentence"]
        assert len({t.lower() for t in texts[name]}) == len(texts[name])
    assert not {t.lower() for t in texts["train"]} & {t.lower() for t in texts["validation"]}
    assert dm.generation_stats["validation_in_train"] >= 0

    again = QuickstartDataModule(train_size=3000, validation_size=500, seed=7)
    again.validate_data()
    assert again._splits["train"].dataset["sentence"] == texts["train"]
    other = QuickstartDataModule(train_size=3000, validation_size=500, seed=8)
    other.validate_data()
    assert other._splits["train"].dataset["sentence"] != texts["train"]
    rows = generate(seed=7, train_size=3000, validation_size=500)  # the generator the script writes files with
    assert [s for s, _ in rows["validation"]] == texts["validation"]


def test_train_size_and_data_dir_are_exclusive(tmp_path):
    with pytest.raises(ConfigError, match="train_size"):
        QuickstartDataModule(train_size=100, data_dir=str(tmp_path))
    with pytest.raises(ConfigError, match="at least 2"):
        QuickstartDataModule(train_size=1)


def test_without_train_size_the_shipped_files_are_read():
    dm = QuickstartDataModule()
    assert dm.validate_data()["rows"] == {"train": 2000, "validation": 400}


def test_by_template_names_every_sentence_and_skips_excluded():
    from dpl.tasks.data.quickstart_gen import NEG, POS, Generator, by_template

    rows = by_template(seed=3, size=400)
    assert rows == by_template(seed=3, size=400)
    assert [label for _, label, _ in rows].count("positive") == 200
    templates = {name for _, _, name in rows}
    assert {"simple", "negated", "contrast"} <= templates
    assert templates <= {name for name in dir(Generator) if callable(getattr(Generator, name))}
    gen = Generator(3)  # the template really produced the sentence: same draws, same text
    assert [gen.sentence(POS if i % 2 == 0 else NEG) for i in range(5)] == [text for text, _, _ in rows[:5]]
    excluded = {rows[0][0], rows[1][0]}
    again = by_template(seed=3, size=400, exclude=excluded)
    assert not {text for text, _, _ in again} & excluded
