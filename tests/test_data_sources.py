"""Hugging Face data sets as data (``data.dataset``, :mod:`dpl.tasks.data.sources`): a ``save_to_disk`` folder and
``Dataset`` / ``DatasetDict`` objects give the classification and the generation / chat data modules the same examples
as the same rows in files; the privacy report's data hash covers the rows read; one-line errors name what exists."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import datasets
import pytest
from helpers import save_tiny_bert, write_sentiment_tsv
from test_data_chat import make_chat_tokenizer
from test_data_generation import build, make_tokenizer, one_line

from dpl.errors import DataError
from dpl.tasks.data import ClassificationDataModule, E2EDataModule, JSONLDataModule

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def data_key(monkeypatch):
    monkeypatch.setenv("DPL_DATA_KEY", "ab" * 32)


@pytest.fixture(scope="module")
def sentiment(tmp_path_factory):
    """A tiny BERT, sentiment TSVs, and the same rows saved as a DatasetDict folder."""
    tmp = tmp_path_factory.mktemp("sentiment")
    model = save_tiny_bert(tmp / "model")
    train = write_sentiment_tsv(tmp / "files" / "train.tsv", rows=48)
    val = write_sentiment_tsv(tmp / "files" / "validation.tsv", rows=16, seed=1)
    dd = datasets.DatasetDict({name: datasets.Dataset.from_csv(path, sep="\t", keep_in_memory=True)
                               for name, path in (("train", train), ("validation", val))})
    dd.save_to_disk(str(tmp / "saved"))
    return tmp, model, dd


def encoded(dm, split: str = "train") -> list[dict]:
    dm.setup("fit")
    return list(getattr(dm, {"train": "train_set", "validation": "val_set"}[split]))


def test_classification_save_to_disk_and_objects_match_files(sentiment):
    tmp, model, dd = sentiment
    files = ClassificationDataModule(model, data_dir=str(tmp / "files"))
    expected = {split: encoded(files, split) for split in ("train", "validation")}
    for source in (str(tmp / "saved"), dd):
        dm = ClassificationDataModule(model, dataset=source)
        assert dm.count_train_examples() == 48
        assert dm.label_map == files.label_map == {"negative": 0, "positive": 1}
        assert {split: encoded(dm, split) for split in ("train", "validation")} == expected
    only_train = ClassificationDataModule(model, dataset=dd["train"])  # a Dataset: its one split trains
    assert encoded(only_train) == expected["train"] and only_train.val_set is None
    renamed = ClassificationDataModule(
        model, dataset=datasets.DatasetDict({"fit": dd["train"], "dev": dd["validation"]}), train_split="fit")
    assert encoded(renamed, "validation") == expected["validation"]  # dev found as validation


def test_dataset_replaces_the_file_options(sentiment):
    """A config's data_dir / files need no nulling out: data.dataset is read instead."""
    tmp, model, dd = sentiment
    dm = ClassificationDataModule(model, data_dir=str(tmp / "nowhere"), train_file="missing.tsv", dataset=dd)
    assert dm.count_train_examples() == 48


def test_provenance_hashes_the_rows_read(sentiment):
    tmp, model, dd = sentiment
    described = ClassificationDataModule(model, dataset=str(tmp / "saved")).training_data()
    assert [(f["split"], f["path"], f["rows"]) for f in described["files"]] == [
        ("train", "saved:train", 48), ("validation", "saved:validation", 16)]
    assert described["id"] == "blake2b-256-keyed:" + described["files"][0]["hash"]
    assert all(f["bytes"] > 0 for f in described["files"])
    # the same rows, from the folder or an object in two chunks: the same hash
    rechunked = datasets.concatenate_datasets([dd["train"].select(range(20)).flatten_indices(),
                                               dd["train"].select(range(20, 48)).flatten_indices()])
    assert rechunked.data.table.column(0).num_chunks == 2
    assert ClassificationDataModule(model, dataset=rechunked).training_data()["id"] == described["id"]
    # one row changed: another id; the key changes every hash
    rows = dd["train"].to_list()
    rows[7] = {**rows[7], "sentence": rows[7]["sentence"] + " very"}
    changed = datasets.Dataset.from_list(rows, features=dd["train"].features)
    assert ClassificationDataModule(model, dataset=changed).training_data()["id"] != described["id"]
    # a view (select) is hashed as the rows it holds, not the table under it
    view = dd["train"].select(range(10))
    copy = datasets.Dataset.from_list(dd["train"].to_list()[:10], features=dd["train"].features)
    assert (ClassificationDataModule(model, dataset=view).training_data()["id"]
            == ClassificationDataModule(model, dataset=copy).training_data()["id"])
    assert ClassificationDataModule(model, dataset=view).count_train_examples() == 10


def test_one_line_errors_name_what_exists(sentiment):
    tmp, model, dd = sentiment
    with pytest.raises(DataError) as err:
        ClassificationDataModule(model, dataset=dd, val_split="test").validate_data()
    assert one_line(err) == "data set 'DatasetDict' has no split 'test' (data.val_split; its splits: train, validation)"
    with pytest.raises(DataError) as err:
        ClassificationDataModule(model, dataset=str(tmp / "saved"), text_column="text").validate_data()
    assert one_line(err) == "saved:train: missing column(s) ['text'] (columns: sentence, label)"
    with pytest.raises(DataError) as err:
        ClassificationDataModule(model, data_dir=str(tmp / "files"), dataset_config="sst2")
    assert one_line(err) == "data.dataset_config chooses splits of data.dataset, which is not set"
    with pytest.raises(DataError) as err:
        ClassificationDataModule(model, dataset=dd, dataset_config="sst2")
    assert "DatasetDict object has none" in one_line(err)
    with pytest.raises(DataError) as err:
        E2EDataModule(dataset=dd)
    assert "data.dataset needs dpl.tasks.data.JSONLDataModule" in one_line(err)


def test_missing_data_set_offline_names_the_cached_ones(tmp_path):
    """As a user offline: the name is looked up in the local cache only, and the error lists what it holds."""
    cache = tmp_path / "cache"
    (cache / "someone___tiny").mkdir(parents=True)
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_CACHE": str(cache),
           "HF_HUB_CACHE": str(tmp_path / "hub"), "OMP_NUM_THREADS": "1"}
    code = ("from dpl.tasks.data.sources import DatasetSource\n"
            "try:\n    DatasetSource('glue', 'sst2').load()\nexcept Exception as exc:\n    print(repr(str(exc)))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.stdout.strip() == repr("data set 'glue' (sst2) not found in the local cache (offline); cached data "
                                      "sets: someone/tiny"), out.stderr[-2000:]


# ----------------------------------------------------------------------------------- generation and chat


def chat_rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (ROOT / "configs" / "chat" / f"{name}.jsonl").read_text().splitlines()
            if line.strip()]


def test_chat_save_to_disk_matches_the_shipped_files(tmp_path):
    tok = make_chat_tokenizer()
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(chat_rows("train")),
                               "validation": datasets.Dataset.from_list(chat_rows("validation"))})
    dd.save_to_disk(str(tmp_path / "chat"))
    files = build(JSONLDataModule, tok, data_dir=str(ROOT / "configs" / "chat"), max_length=256)
    files.setup("fit")
    saved = build(JSONLDataModule, tok, dataset=str(tmp_path / "chat"), max_length=256)
    saved.setup("fit")
    assert saved.conversational and saved.count_train_examples() == len(chat_rows("train"))
    assert saved.train_set == files.train_set
    assert [{k: v for k, v in e.items()} for e in saved.val_set] == list(files.val_set)
    assert saved.unit_description() == "one line of chat:train (a conversation)"
    described = saved.training_data()
    assert [(f["split"], f["rows"]) for f in described["files"]] == [("train", 32), ("validation", 8)]
    assert described["id"] != files.training_data()["id"]  # rows hashed, not the file's bytes: a different id


def test_prompt_completion_dataset_and_row_errors():
    tok = make_tokenizer()
    rows = [{"question": "name cafe", "answer": "red"}, {"question": "name pub", "answer": "blue"}]
    dm = build(JSONLDataModule, tok, dataset=datasets.Dataset.from_list(rows), prompt_field="question",
               completion_field="answer")
    files = build(JSONLDataModule, tok, train_file=str(ROOT / "tests" / "nothing.jsonl"), prompt_field="question",
                  completion_field="answer")
    files.read_splits = lambda: {"train": files.read_rows("train", Path("x"), rows)}
    dm.setup("fit")
    files.setup("fit")
    assert dm.train_set == files.train_set and len(dm.train_set) == 2
    bad = datasets.Dataset.from_list([*rows, {"question": "name bar", "answer": " "}])
    with pytest.raises(DataError) as err:
        build(JSONLDataModule, tok, dataset=bad, prompt_field="question", completion_field="answer").validate_data()
    assert one_line(err) == "Dataset:train row 3: empty completion in field 'answer'"


# ----------------------------------------------------------------------------------- the library loop


def test_private_training_takes_a_dataset_split_and_refuses_a_dataset_dict():
    """A ``datasets.Dataset`` (torch format) trains as the same rows in a list: the same parameters, exactly (the
    same sampled rows through the same float32 arithmetic); a DatasetDict is refused in one line."""
    import torch
    from test_training_loop import Classifier, loop, toy_data

    from dpl.errors import ConfigError

    rows = toy_data()
    features = datasets.Features({"x": datasets.Sequence(datasets.Value("float32")), "y": datasets.Value("int64")})
    table = datasets.Dataset.from_list([{"x": r["x"].tolist(), "y": int(r["y"])} for r in rows], features=features)
    table.set_format("torch")
    trained = {}
    for name, data in (("list", rows), ("dataset", table)):
        model = Classifier()
        loop(model, data, steps=3).run()
        trained[name] = [p.detach().clone() for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(trained["list"], trained["dataset"]))
    with pytest.raises(ConfigError) as err:
        loop(Classifier(), datasets.DatasetDict({"train": table, "test": table}), steps=3)
    assert str(err.value) == "data is a DatasetDict (splits: train, test): give the training split, e.g. data['train']"


# ----------------------------------------------------------------------------------- dpl export --push-to-hub


@pytest.mark.parametrize("offline", [True, False])
def test_push_to_hub_is_refused_offline_or_without_a_token(offline, tmp_path, monkeypatch, capsys):
    """Refused in one line before anything is read or written: offline, or online without a configured token."""
    import huggingface_hub.constants as constants

    from dpl.trained.export import export_command

    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    monkeypatch.setattr(constants, "HF_STORED_TOKENS_PATH", str(tmp_path / "no-tokens"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1" if offline else "0")
    code = export_command([str(tmp_path / "no-run"), str(tmp_path / "out"), "--push-to-hub", "someone/model"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and not (tmp_path / "out").exists()
    if offline:
        assert err == ("dpl: error: --push-to-hub someone/model: the Hugging Face Hub is offline here (HF_HUB_OFFLINE "
                       "is set); export without it and upload the folder later")
    else:
        assert err == ("dpl: error: --push-to-hub someone/model: no Hugging Face token is configured (set HF_TOKEN or "
                       "run `hf auth login`)")
