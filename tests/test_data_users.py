"""The user of each training row (``data.user_column``): keys aligned with ``train_set``, one-line errors, E2E by mr,
DART by entry."""

from __future__ import annotations

import csv
import json
import warnings
from pathlib import Path

import pytest

from dpl.errors import DataError
from dpl.lightning.data import DPDataModule
from dpl.tasks.data import (ClassificationDataModule, DARTDataModule, E2EDataModule, JSONLDataModule,
                            PromptClassificationDataModule, QuickstartDataModule)
from helpers import WORDS
from test_data_generation import DART, DEVSET, E2E_ROWS, build, ids, make_tokenizer, write_csv, write_jsonl


def one_line(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message, message
    assert isinstance(excinfo.value, DataError)
    return message


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


@pytest.fixture(scope="module")
def bert(tmp_path_factory) -> str:
    """A word-level BERT tokenizer over the tiny vocabulary (built from ``vocab=``: every word a token)."""
    from transformers import BertTokenizerFast

    folder = tmp_path_factory.mktemp("bert")
    (folder / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]) + "\n")
    BertTokenizerFast(vocab=str(folder / "vocab.txt")).save_pretrained(folder)
    return str(folder)


def write_table(path: Path, rows: list[list[str]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        csv.writer(f, delimiter="\t" if path.suffix == ".tsv" else ",", lineterminator="\n").writerows(rows)
    return path


CLS_TRAIN = [["sentence", "label", "user"],
             ["the movie was good", "positive", "ann"],
             ["the plot was bad", "negative", "bob"],
             ["", "", ""],  # a blank line in between
             ["a great story", "positive", "ann"],
             ["awful acting", "negative", "7"]]
CLS_VAL = [["sentence", "label"], ["the film is great", "positive"], ["not good", "negative"]]


def test_base_data_module_has_no_users():
    assert DPDataModule().train_user_keys() is None


@pytest.mark.parametrize("suffix", [".tsv", ".csv"])
def test_classification_keys_follow_the_train_rows(bert, tmp_path, suffix):
    train = [r if any(r) else [] for r in CLS_TRAIN]
    write_table(tmp_path / f"train{suffix}", train)
    write_table(tmp_path / f"validation{suffix}", CLS_VAL)  # no user column: not needed there
    dm = ClassificationDataModule(tokenizer=bert, data_dir=str(tmp_path), user_column="user")
    dm.setup("fit")
    keys = dm.train_user_keys()
    assert keys == ["ann", "bob", "ann", "7"] and len(keys) == len(dm.train_set)
    words = ["good", "bad", "great", "awful"]
    for i, word in enumerate(words):  # each key sits beside its own row
        tokens = dm.tokenizer.convert_ids_to_tokens(dm.train_set[i]["input_ids"])
        assert word in tokens
    assert "user" not in dm.train_set.column_names  # the column stays out of the examples and batches
    assert set(dm.collate([dm.train_set[0]])) == {"input_ids", "attention_mask", "token_type_ids", "labels"}
    limited = ClassificationDataModule(tokenizer=bert, data_dir=str(tmp_path), user_column="user",
                                       max_train_examples=3)
    limited.setup("fit")
    assert limited.train_user_keys() == ["ann", "bob", "ann"]


def test_classification_without_user_column_has_no_keys(bert, tmp_path):
    write_table(tmp_path / "train.tsv", [r for r in CLS_TRAIN if any(r)])
    dm = ClassificationDataModule(tokenizer=bert, data_dir=str(tmp_path))
    dm.setup("fit")
    assert dm.train_user_keys() is None


@pytest.mark.parametrize("suffix", [".tsv", ".csv"])
def test_classification_user_errors_are_one_line(bert, tmp_path, suffix):
    path = write_table(tmp_path / f"train{suffix}", [r for r in CLS_TRAIN if any(r)])
    with pytest.raises(DataError) as excinfo:
        ClassificationDataModule(tokenizer=bert, train_file=str(path), user_column="owner").prepare_data()
    message = one_line(excinfo)
    assert str(path) in message and "'owner'" in message and "missing column" in message
    rows = [r for r in CLS_TRAIN if any(r)]
    rows[3] = ["a great story", "positive", ""]
    write_table(path, rows)
    with pytest.raises(DataError) as excinfo:
        ClassificationDataModule(tokenizer=bert, train_file=str(path), user_column="user").prepare_data()
    message = one_line(excinfo)
    assert message.startswith(f"{path} line 4:") and "user" in message


def test_classification_subclasses_pass_the_user_column_on(bert, tmp_path):
    write_table(tmp_path / "train.tsv", [r for r in CLS_TRAIN if any(r)])
    prompt = PromptClassificationDataModule(tokenizer=bert, data_dir=str(tmp_path), user_column="user",
                                            labels=["negative", "positive"])
    prompt.setup("fit")
    assert prompt.train_user_keys() == ["ann", "bob", "ann", "7"]
    quick = QuickstartDataModule(tokenizer=bert, data_dir=str(tmp_path), user_column="user")
    quick.setup("fit")
    assert quick.train_user_keys() == ["ann", "bob", "ann", "7"]
    with pytest.raises(DataError) as excinfo:  # generated rows have no users
        QuickstartDataModule(tokenizer=bert, train_size=10, validation_size=4, user_column="user").prepare_data()
    assert "'user'" in one_line(excinfo)


# ------------------------------------------------------------------------------------------------ generation


JSONL = [{"prompt": "Q what", "completion": "A yes", "who": "u1"},
         {"prompt": "Q what", "completion": "A no", "who": 2},
         {"prompt": "Q x", "completion": "A y", "who": "u1"}]


def test_jsonl_keys_follow_the_train_lines(tok, tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", JSONL)
    write_jsonl(tmp_path / "dev.jsonl", [{"prompt": "Q z", "completion": "A one"}])  # no user field there
    dm = build(JSONLDataModule, tok, data_dir=str(tmp_path), user_column="who")
    dm.setup("fit")
    assert dm.train_user_keys() == ["u1", "2", "u1"]
    for example, item in zip(dm.train_set, JSONL):
        assert example["input_ids"][-len(ids(tok, item["completion"])) - 1:-1] == ids(tok, item["completion"])
    assert set(dm.collate(dm.train_set[:2])) == {"input_ids", "attention_mask", "labels"}
    limited = build(JSONLDataModule, tok, train_file=str(path), user_column="who", max_train_examples=2)
    limited.setup("fit")
    assert limited.train_user_keys() == ["u1", "2"]
    plain = build(JSONLDataModule, tok, train_file=str(path))
    plain.setup("fit")
    assert plain.train_user_keys() is None


def test_jsonl_user_errors_name_the_line(tok, tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", JSONL)
    with pytest.raises(DataError) as excinfo:
        build(JSONLDataModule, tok, train_file=str(path), user_column="owner").prepare_data()
    message = one_line(excinfo)
    assert message.startswith(f"{path} line 1:") and "'owner'" in message
    for empty in ("", "  ", None):
        write_jsonl(path, [JSONL[0], {**JSONL[1], "who": empty}])
        with pytest.raises(DataError) as excinfo:
            build(JSONLDataModule, tok, train_file=str(path), user_column="who").prepare_data()
        message = one_line(excinfo)
        assert message.startswith(f"{path} line 2:") and "empty user" in message


def test_e2e_by_mr_one_key_per_meaning_representation(tok, tmp_path):
    path = write_csv(tmp_path / "trainset.csv", E2E_ROWS)
    dm = build(E2EDataModule, tok, train_file=str(path), user_column="mr")
    dm.setup("fit")
    keys = dm.train_user_keys()
    assert keys == [mr for mr, _ in E2E_ROWS[1:]]
    assert len(set(keys)) == len({mr for mr, _ in E2E_ROWS[1:]}) == 3
    for example, (mr, ref), key in zip(dm.train_set, E2E_ROWS[1:], keys):
        assert key == mr
        assert example["input_ids"][1:1 + len(ids(tok, f"Table: {mr}"))] == ids(tok, f"Table: {mr}")
    by_key: dict[str, list[int]] = {}
    for i, key in enumerate(keys):
        by_key.setdefault(key, []).append(i)
    assert sorted(len(v) for v in by_key.values()) == [1, 2, 3]


def test_e2e_other_column_holdout_and_errors(tok, tmp_path):
    rows = [[*E2E_ROWS[0], "owner"]] + [[mr, ref, f"o{i % 2}"] for i, (mr, ref) in enumerate(E2E_ROWS[1:])]
    path = write_csv(tmp_path / "trainset.csv", rows)
    dm = build(E2EDataModule, tok, train_file=str(path), user_column="owner", holdout_mrs=1, holdout_seed=0)
    dm.setup("fit")
    held = {s["prompt"] for s in dm.val_set}
    kept = [r for r in rows[1:] if f"Table: {r[0]}\nSentence:" not in held]
    assert dm.train_user_keys() == [owner for _, _, owner in kept] and len(kept) == len(dm.train_set)
    with pytest.raises(DataError) as excinfo:
        build(E2EDataModule, tok, train_file=str(path), user_column="user").prepare_data()
    message = one_line(excinfo)
    assert str(path) in message and "'user'" in message
    rows[4][2] = ""
    write_csv(path, rows)
    with pytest.raises(DataError) as excinfo:
        build(E2EDataModule, tok, train_file=str(path), user_column="owner").prepare_data()
    message = one_line(excinfo)
    assert message.startswith(f"{path} line 5:") and "'owner'" in message
    assert build(E2EDataModule, tok, train_file=str(path)).validate_data()  # no user_column: not read


def test_dart_by_entry_and_by_field(tok, tmp_path):
    path = tmp_path / "dart-train.json"
    path.write_text(json.dumps(DART))
    dm = build(DARTDataModule, tok, train_file=str(path), user_column="entry")
    dm.setup("fit")
    assert dm.train_user_keys() == ["0", "0", "1", "2"]  # one per annotation, keyed by its entry
    texts = [note["text"] for entry in DART for note in entry["annotations"]]
    for example, text in zip(dm.train_set, texts):
        assert example["input_ids"][-len(ids(tok, " " + text)) - 1:-1] == ids(tok, " " + text)
    by_triples = build(DARTDataModule, tok, train_file=str(path), user_column="triples")
    by_triples.setup("fit")
    assert by_triples.train_user_keys() == ["cafe : food : red | cafe : area : city"] * 2 + \
        ["pub : near : river"] * 2  # two entries with the same triples: one user
    with pytest.raises(DataError) as excinfo:
        build(DARTDataModule, tok, train_file=str(path), user_column="owner").prepare_data()
    message = one_line(excinfo)
    assert message.startswith(f"{path} entry 0 annotation 0:") and "'owner'" in message
    plain = build(DARTDataModule, tok, train_file=str(path))
    plain.setup("fit")
    assert plain.train_user_keys() is None


@pytest.mark.skipif(not DEVSET.is_file(), reason="shared E2E devset not available")
def test_real_e2e_devset_by_mr(tok):
    with open(DEVSET, newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    mrs = {r["mr"] for r in rows}
    dm = build(E2EDataModule, tok, train_file=str(DEVSET), user_column="mr", max_length=256)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dm.setup("fit")
    keys = dm.train_user_keys()
    assert len(keys) == len(dm.train_set) == len(rows)
    assert keys == [r["mr"] for r in rows]
    assert len(set(keys)) == len(mrs) == 547
