"""DP synthetic data end to end: the data module (control prefix, every token of the record scored), dpl fit ->
dpl synthesize -> dpl evaluate-synthetic on a sentiment table and on the shipped conversations (tiny Llama models),
the label counts (uniform, given, a DP histogram composed in the ledger), the synthetic report scanned for private
values, and the bad inputs, one line each."""

from __future__ import annotations

import contextlib
import io
import json
import math
import random
import re
from pathlib import Path

import pytest
import torch
from helpers import CHATML, save_tiny_bert, save_tiny_llama_lm

from dpl.cli import main
from dpl.synthetic import counts, leakage
from dpl.tasks.data import SyntheticDataModule
from dpl.tasks.data.padding import IGNORE_INDEX

ROOT = Path(__file__).resolve().parents[1]
POSITIVE, NEGATIVE = 37, 26  # the private label counts of the training table (unbalanced, on purpose)


def _run(args: list[str]) -> tuple[int, str, str]:
    out, err, code = io.StringIO(), io.StringIO(), 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            main(args)
    except SystemExit as exc:
        code = exc.code or 0
    return code, out.getvalue(), err.getvalue()


def _table(path: Path, positive: int, negative: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    rows = [(f"the {rng.choice(['pub', 'restaurant'])} in the {rng.choice(['city', 'riverside'])} serves "
             f"{rng.choice(['italian', 'french'])} food", label)
            for label, n in (("positive", positive), ("negative", negative)) for _ in range(n)]
    rng.shuffle(rows)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("sentence\tlabel\n" + "".join(f"{t}\t{label}\n" for t, label in rows))
    return [t for t, _ in rows]


def _fit(world: dict, config: str, *extra: str) -> Path:
    model = world["chat_model"] if "chat" in config else world["model"]
    code, out, err = _run(["fit", "--config", str(ROOT / config), "--model.init_args.model", model,
                           "--data.init_args.tokenizer", model, "--trainer.max_steps", "2",
                           "--trainer.default_root_dir", str(world["tmp"] / "runs" / Path(config).stem),
                           "--trainer.accelerator", "cpu", *extra])
    assert code == 0, err[-2000:]
    found = re.search(r"checkpoint (\S+)$", out.strip().splitlines()[-1])
    assert found, out[-1000:]
    return Path(found.group(1))


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("synthetic")
    world = {"tmp": tmp, "model": save_tiny_llama_lm(tmp / "llama"),
             "chat_model": save_tiny_llama_lm(tmp / "llama_chat", chat_template=CHATML),
             "bert": save_tiny_bert(tmp / "bert")}
    world["train_texts"] = _table(tmp / "data" / "train.tsv", POSITIVE, NEGATIVE, 0)
    _table(tmp / "data" / "validation.tsv", 10, 10, 1)
    world["sst2"] = _fit(world, "configs/synthetic/sst2.yaml", "--data.init_args.data_dir", str(tmp / "data"),
                         "--model.init_args.privacy.batch_size", "8", "--model.init_args.privacy.physical_batch_size",
                         "8")
    world["chat"] = _fit(world, "configs/synthetic/chat.yaml", "--data.init_args.train_file",
                         str(ROOT / "configs" / "chat" / "train.jsonl"))
    return world


# ------------------------------------------------------------------------------------------------ the data module


def test_table_records_follow_their_control_prefix_and_every_text_token_is_scored(world):
    data = SyntheticDataModule(data_dir=str(world["tmp"] / "data"), text_column="sentence", tokenizer=world["model"])
    data.setup("fit")
    first = data.train_set[0]
    text = world["train_texts"][0]
    split = data._splits["train"]
    assert split.prompts[0] in ("label: positive\nsentence:", "label: negative\nsentence:")
    assert split.completions[0] == " " + text
    prompt = data.tokenizer(split.prompts[0])["input_ids"]
    text_ids = data.tokenizer(" " + text, add_special_tokens=False)["input_ids"]
    assert first["input_ids"] == prompt + text_ids + [data.eos_token_id]
    assert first["labels"] == [IGNORE_INDEX] * len(prompt) + text_ids + [data.eos_token_id]
    assert data.schema()["values"] == {"label": ["negative", "positive"]}
    assert data.unit_description() == "one record of train.tsv (a text with its label)"


def test_control_values_replace_the_values_seen_in_training_and_check_them(world, tmp_path):
    """data.control_values: the schema (saved with the checkpoint, read by dpl synthesize) holds the listed values,
    not those seen in the training file; a training record outside them, or a bad list, is one line."""
    from dpl.errors import DataError

    data_dir = str(world["tmp"] / "data")
    listed = ["positive", "negative", "neutral"]  # neutral: in no training record, so only the listing reveals it
    data = SyntheticDataModule(data_dir=data_dir, text_column="sentence", tokenizer=world["model"],
                               control_values={"label": listed})
    data.setup("fit")
    assert data.schema()["values"] == {"label": listed}
    assert len(data.train_set) == POSITIVE + NEGATIVE
    narrow = SyntheticDataModule(data_dir=data_dir, text_column="sentence", tokenizer=world["model"],
                                 control_values={"label": ["positive"]})
    with pytest.raises(DataError, match=r"train.tsv line \d+: label 'negative' is not in data.control_values"):
        narrow.setup("fit")
    for values, message in [({"topic": ["a"]}, "'topic', which is not a control column (they are: label)"),
                            ({"label": []}, "must be a non-empty list"),
                            ({"label": ["a", " "]}, "lists an empty value"),
                            ({"label": ["a", "a"]}, "lists 'a' more than once")]:
        with pytest.raises(DataError, match=re.escape(message)):
            SyntheticDataModule(data_dir=data_dir, text_column="sentence", control_values=values)


def test_a_conversation_is_scored_on_every_token_after_its_control_prefix(world, tmp_path):
    from transformers import AutoTokenizer

    lines = (ROOT / "configs" / "chat" / "train.jsonl").read_text().splitlines()[:3]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({**json.loads(line), "topic": "desk"}) + "\n" for line in lines))
    data = SyntheticDataModule(train_file=str(path), label_column="topic", tokenizer=world["chat_model"])
    data.setup("fit")
    tokenizer = AutoTokenizer.from_pretrained(world["chat_model"])
    messages = json.loads(lines[0])["messages"]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False).rstrip()
    head = tokenizer("topic: desk\n", add_special_tokens=False)["input_ids"]
    example = data.train_set[0]
    assert example["input_ids"][:len(head)] == head
    assert tokenizer.decode(example["input_ids"][len(head):]) == tokenizer.decode(
        tokenizer(rendered, add_special_tokens=False)["input_ids"])
    assert example["labels"] == [IGNORE_INDEX] * len(head) + example["input_ids"][len(head):]


# ------------------------------------------------------------------------------------------------ label counts


def test_allocate_and_given_proportions():
    assert counts.allocate(10, {"a": 0.5, "b": 0.25, "c": 0.25}) == {"a": 5, "b": 3, "c": 2}
    assert sum(counts.allocate(7, {"a": 1 / 3, "b": 1 / 3, "c": 1 / 3}).values()) == 7
    assert counts.given("a=3,b=1", ["a", "b", "c"]).proportions == {"a": 0.75, "b": 0.25, "c": 0.0}
    for bad in ("d=1", "a=x", "a=-1", "a=0", "a"):
        with pytest.raises(Exception, match="--proportions"):
            counts.given(bad, ["a", "b", "c"])


def test_dp_histogram_adds_calibrated_noise_of_sensitivity_one_per_unit():
    from dpl.core.accounting.gaussian import calibrate_gaussian_mechanism, gaussian_mechanism_epsilon
    from dpl.core.noise import KeyedNormal

    values = ["a"] * 30 + ["b"] * 10
    key = bytes(range(32))
    out = counts.dp_histogram(values, None, ["a", "b"], 2.0, 1e-5, "add_remove", KeyedNormal(key))
    sigma = calibrate_gaussian_mechanism(2.0, 1e-5)
    z = KeyedNormal(key).standard_normal(2, dtype=torch.float64).tolist()
    assert out.histogram["noisy_counts"] == {"a": 30 + sigma * z[0], "b": 10 + sigma * z[1]}
    assert gaussian_mechanism_epsilon(out.histogram["noise_multiplier"], 1e-5) <= 2.0
    assert out.histogram["event"] == {"event": {"kind": "gaussian", "noise_multiplier": sigma}, "steps": 1}
    replace = counts.dp_histogram(values, None, ["a", "b"], 2.0, 1e-5, "replace_one", KeyedNormal(key))
    assert replace.histogram["noise_std"] == sigma * math.sqrt(2.0)
    # a user's rows add up to one unit vector of fractions: L2 norm <= 1 however many rows
    vectors = counts.unit_vectors(["a", "a", "b", "a"], ["u", "u", "u", "v"])
    assert vectors == [{"a": 2 / 3, "b": 1 / 3}, {"a": 1.0}]
    assert all(math.sqrt(sum(w * w for w in v.values())) <= 1.0 for v in vectors)


# ------------------------------------------------------------------------------------------------ leakage


def test_leakage_finds_duplicates_near_duplicates_and_canaries():
    train = ["the pub in the city serves italian food at a fair price", "a quiet french restaurant"]
    index = leakage.TrainingIndex(train)
    assert index.longest_match("we said the pub in the city serves italian food today") == 8
    assert index.longest_match("nothing in common here at all") == 0
    found = leakage.duplicates(["A quiet  French restaurant", "the pub in the city serves italian food ok",
                                "new text entirely unlike the others"], index, near_words=8)
    assert (found["exact"], found["near"], found["longest_match_max"]) == (1, 1, 8)
    canary = leakage.canary_texts(2, seed=3)
    assert canary == leakage.canary_texts(2, seed=3) and canary[0] != canary[1]
    secret = canary[0].split()[6]
    result = leakage.canaries([f"well {canary[0]} indeed", f"the code is {secret}"], canary)
    assert result["reproduced"] == 1 and result["each"][0]["secret_reproduced"] == 2
    assert result["each"][1]["reproduced"] == 0 and result["each"][0]["longest_match"] == 8


# ------------------------------------------------------------------------------------------------ end to end


def test_sst2_fit_synthesize_evaluate(world):
    out = world["tmp"] / "synthetic" / "sst2"
    code, stdout, err = _run(["synthesize", str(world["sst2"]), "--rows", "12", "--out", str(out), "--seed", "3",
                              "--max_new_tokens", "6", "--batch_size", "5"])
    assert code == 0, err
    assert stdout.startswith("dpl: 12 synthetic records written to ") and "epsilon = " in stdout
    rows = (out / "train.tsv").read_text().splitlines()
    assert rows[0] == "sentence\tlabel" and len(rows) == 13
    assert sorted(r.split("\t")[1] for r in rows[1:]) == ["negative"] * 6 + ["positive"] * 6  # uniform
    report = json.loads((out / "privacy.json").read_text())
    training = json.loads((world["sst2"].parent.parent / "privacy.json").read_text())
    assert report["guarantee"]["epsilon"] == training["epsilon"] and report["source"]["run_id"] == training["run"]["id"]
    assert report["label_counts"]["method"] == "uniform" and "uniform" in (out / "privacy.md").read_text()
    steps = report["training"]["steps_taken"]
    assert f" {steps} step{'' if steps == 1 else 's'} (" in (out / "privacy.md").read_text()  # 1 step, 2 steps
    again = world["tmp"] / "synthetic" / "sst2-again"
    assert _run(["synthesize", str(world["sst2"]), "--rows", "12", "--out", str(again), "--seed", "3",
                 "--max_new_tokens", "6", "--batch_size", "5"])[0] == 0
    assert (again / "train.tsv").read_text() == (out / "train.tsv").read_text()  # the seed fixes the sample
    code, stdout, err = _run(["evaluate-synthetic", str(out), str(world["tmp"] / "data" / "validation.tsv"),
                              "--train", str(world["tmp"] / "data" / "train.tsv"), "--encoder", world["bert"]])
    assert code == 0, err
    assert "TSTR accuracy" in stdout
    page = json.loads((out / "evaluation" / "evaluation.json").read_text())
    assert 0 <= page["downstream"]["tstr_accuracy"] <= 1 and page["downstream"]["real_rows"] == 12
    assert page["leakage"]["synthetic"]["texts"] == 12 and (out / "evaluation" / "evaluation.png").is_file()
    assert "not differentially private" in (out / "evaluation" / "evaluation.md").read_text()


def test_the_dp_histogram_is_composed_in_the_ledger_and_no_private_value_reaches_the_report(world):
    out = world["tmp"] / "synthetic" / "sst2-dp"
    code, stdout, err = _run(["synthesize", str(world["sst2"]), "--rows", "10", "--out", str(out),
                              "--max_new_tokens", "4", "--label_epsilon", "1"])
    assert code == 0, err
    assert "the label histogram recorded in" in stdout
    report = json.loads((out / "privacy.json").read_text())
    histogram = report["label_counts"]["histogram"]
    training = json.loads((world["sst2"].parent.parent / "privacy.json").read_text())
    assert report["guarantee"]["delta"] == training["delta"] + histogram["delta"]
    assert report["guarantee"]["epsilon"] <= training["epsilon"] + histogram["epsilon"]
    code, stdout, _ = _run(["ledger", str(world["sst2"].parents[3]), "--json"])
    group = json.loads(stdout)["data_sets"][0]
    assert {r["run_id"] for r in group["runs"]} == {training["run"]["id"], report["run"]["id"]}
    assert group["composed"]["epsilon"] == pytest.approx(report["guarantee"]["epsilon"], rel=1e-9)
    # the private values: the exact label counts and proportions, and the training texts
    for name in ("privacy.json", "privacy.md"):
        text = re.sub(r"\d{4}-\d\d-\d\dT[\d:]+(\+00:00|Z)?", "", (out / name).read_text())
        for value in (POSITIVE, NEGATIVE):
            assert not re.search(rf"(?<![\w.]){value}(?![\w.])", text), f"{name} holds the count {value}"
        for value in (POSITIVE / (POSITIVE + NEGATIVE), NEGATIVE / (POSITIVE + NEGATIVE)):
            assert f"{value:.4f}" not in text and repr(value) not in text
        assert not any(t in text for t in world["train_texts"])
    numbers = [float(n) for n in re.findall(r"\d+\.\d+", json.dumps(histogram["noisy_counts"]))]
    assert len(numbers) == 2 and set(numbers).isdisjoint({float(POSITIVE), float(NEGATIVE)})


def test_user_level_units_and_their_histogram(world, tmp_path):
    """privacy.unit user: one user's records are one unit in training, and one vector of L2 norm <= 1 in the DP
    histogram, whose report and ledger line say user-level."""
    lines = (world["tmp"] / "data" / "train.tsv").read_text().splitlines()
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.tsv").write_text("\n".join([lines[0] + "\tuser", *(f"{line}\tu{i % 9}" for i, line in
                                                                     enumerate(lines[1:]))]) + "\n")
    checkpoint = _fit(world, "configs/synthetic/sst2.yaml", "--data.init_args.data_dir", str(data),
                      "--data.init_args.user_column", "user", "--model.init_args.privacy.unit", "user",
                      "--model.init_args.privacy.max_rows_per_user", "8", "--model.init_args.privacy.batch_size", "3",
                      "--model.init_args.privacy.physical_batch_size", "8",
                      "--trainer.default_root_dir", str(tmp_path / "runs"))
    training = json.loads((checkpoint.parent.parent / "privacy.json").read_text())
    assert training["unit"] == "user"
    out = tmp_path / "synthetic"
    code, _, err = _run(["synthesize", str(checkpoint), "--rows", "4", "--out", str(out), "--max_new_tokens", "3",
                         "--label_epsilon", "2"])
    assert code == 0, err
    report = json.loads((out / "privacy.json").read_text())
    assert report["source"]["unit"] == "user" and report["label_counts"]["histogram"]["unit"] == "user"
    assert "every user adds at most 1" in (out / "privacy.md").read_text()
    code, stdout, _ = _run(["ledger", str(tmp_path / "runs"), "--json"])
    (group,) = json.loads(stdout)["data_sets"]
    assert group["unit"] == "user" and len(group["runs"]) == 2


def test_chat_fit_synthesize_evaluate(world):
    out = world["tmp"] / "synthetic" / "chat"
    code, stdout, err = _run(["synthesize", str(world["chat"]), "--rows", "3", "--turns", "2", "--out", str(out),
                              "--max_new_tokens", "4"])
    assert code == 0, err
    rows = [json.loads(line) for line in (out / "train.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and all([t["role"] for t in r["messages"]] == ["user", "assistant"] * 2 for r in rows)
    assert json.loads((out / "privacy.json").read_text())["label_counts"] is None
    code, stdout, err = _run(["evaluate-synthetic", str(out), str(ROOT / "configs" / "chat" / "validation.jsonl"),
                              "--train", str(ROOT / "configs" / "chat" / "train.jsonl"), "--encoder", world["bert"],
                              "--text_column", "messages"])
    assert code == 0, err
    page = json.loads((out / "evaluation" / "evaluation.json").read_text())
    assert "downstream" not in page and page["leakage"]["synthetic"]["texts"] == 3


def test_an_export_synthesizes_too(world):
    folder = world["tmp"] / "exported" / "sst2"
    assert _run(["export", str(world["sst2"]), str(folder)])[0] == 0
    out = world["tmp"] / "synthetic" / "from-export"
    code, _, err = _run(["synthesize", str(folder), "--rows", "4", "--out", str(out), "--max_new_tokens", "3",
                         "--proportions", "positive=1"])
    assert code == 0, err
    assert [r.split("\t")[1] for r in (out / "train.tsv").read_text().splitlines()[1:]] == ["positive"] * 4


def test_exposure_ranks_a_memorized_canary_first_and_the_page_says_so(world, tmp_path):
    """A canary repeated 10 times in the training data of a non-private full fine-tuning that memorizes it (rank 1
    also with 5 copies or 25 steps on this tiny model): its secret ranks first among 99 random ones (the most
    exposure); a canary the fit never saw ranks like any number; evaluate-synthetic --run reports the exposure and
    refuses, in one line, a canary that is not a training record, or --run without --canaries and --train."""
    from dpl.synthetic.exposure import alternatives, canary_exposure, rank_and_exposure

    assert rank_and_exposure(1.0, [2.0, 3.0, 4.0]) == (1, 2.0) and rank_and_exposure(2.0, [2.0, 1.0, 3.0])[0] == 3
    others = alternatives("004213", 99, seed=1)
    assert len(set(others)) == 99 and "004213" not in others and all(len(o) == 6 and o.isdigit() for o in others)
    model = save_tiny_llama_lm(tmp_path / "llama", digits=True)
    seen, unseen = leakage.canary_texts(2, seed=5)
    _table(tmp_path / "data" / "train.tsv", 15, 15, 0)
    with open(tmp_path / "data" / "train.tsv", "a") as f:
        f.write(f"{seen}\tpositive\n" * 10)
    (tmp_path / "canaries.txt").write_text(seen + "\n")
    world = {**world, "model": model, "tmp": tmp_path}
    run = _fit(world, "configs/synthetic/sst2.yaml", "--data.init_args.data_dir", str(tmp_path / "data"),
               "--model.init_args.privacy.noise_multiplier", "0", "--model.init_args.privacy.batch_size", "16",
               "--model.init_args.privacy.physical_batch_size", "16", "--trainer.max_steps", "40",
               "--model.init_args.finetuning.method", "full", "--model.init_args.optimizer.init_args.lr", "0.01")
    found = canary_exposure(str(run), [{"sentence": seen, "label": "positive"},
                                       {"sentence": unseen, "label": "positive"}], "sentence", 99, seed=0)
    assert [e["rank"] for e in found["each"]][0] == 1 and found["max"] == found["most"] == math.log2(100)
    assert abs(found["by_chance"] - 1.3962) < 1e-4  # log2(100) - log2(100!) / 100
    assert found["each"][1]["rank"] > 1  # the never-seen canary: a uniform rank in 1..100 (this seed: not the first)
    out = tmp_path / "synthetic"
    assert _run(["synthesize", str(run), "--rows", "4", "--out", str(out), "--max_new_tokens", "3",
                 "--non_private_ok"])[0] == 0
    code, _, err = _run(["evaluate-synthetic", str(out), str(world["tmp"] / "data" / "train.tsv"), "--train",
                         str(tmp_path / "data" / "train.tsv"), "--canaries", str(tmp_path / "canaries.txt"),
                         "--run", str(run), "--encoder", world["bert"]])
    assert code == 0, err[-2000:]
    page = json.loads((out / "evaluation" / "evaluation.json").read_text())
    assert page["canaries"]["exposure"]["each"][0]["rank"] == 1
    assert "Exposure under the trained model" in (out / "evaluation" / "evaluation.md").read_text()
    (tmp_path / "canaries.txt").write_text(unseen + "\n")
    code, _, err = _run(["evaluate-synthetic", str(out), str(tmp_path / "data" / "train.tsv"), "--out",
                         str(tmp_path / "again"), "--train", str(tmp_path / "data" / "train.tsv"), "--canaries",
                         str(tmp_path / "canaries.txt"), "--run", str(run), "--encoder", world["bert"]])
    errors = [line for line in err.splitlines() if line.startswith("dpl: error:")]
    assert code == 2 and len(errors) == 1 and "is not a record of" in errors[0], err[-1500:]
    assert not (tmp_path / "again").exists()
    code, _, err = _run(["evaluate-synthetic", str(out), str(tmp_path / "data" / "train.tsv"), "--out",
                         str(tmp_path / "again"), "--run", str(run)])
    assert code == 2 and "give --canaries and --train" in err


# ------------------------------------------------------------------------------------------------ bad inputs


def test_bad_inputs_are_one_line_and_write_nothing(world, tmp_path):
    run = str(world["sst2"])
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "keep.txt").write_text("mine")
    nonprivate = _fit(world, "configs/synthetic/sst2.yaml", "--data.init_args.data_dir", str(world["tmp"] / "data"),
                      "--model.init_args.privacy.noise_multiplier", "0", "--model.init_args.privacy.batch_size", "8",
                      "--trainer.default_root_dir", str(tmp_path / "nonprivate"))
    cases = [
        (["synthesize", run, "--rows", "0", "--out", str(tmp_path / "a")], "--rows must be positive"),
        (["synthesize", run, "--rows", "2", "--out", str(existing)], "exists: choose a new folder"),
        (["synthesize", run, "--rows", "2", "--out", str(tmp_path / "b"), "--proportions", "neutral=1"],
         "unknown label 'neutral'"),
        (["synthesize", str(nonprivate), "--rows", "2", "--out", str(tmp_path / "c")], "was not trained private"),
        (["synthesize", str(world["tmp"] / "exported" / "sst2"), "--rows", "2", "--out", str(tmp_path / "d"),
          "--label_epsilon", "1"], "needs the run folder"),
        (["evaluate-synthetic", str(tmp_path / "none"), "v.tsv"], "not found"),
    ]
    for args, message in cases:
        code, _, err = _run(args)
        lines = [line for line in err.splitlines() if line.startswith("dpl: error:")]
        assert code == 2 and len(lines) == 1 and message in lines[0], (args, err[-1500:])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["existing", "nonprivate"]
    assert (existing / "keep.txt").read_text() == "mine"
    code, _, err = _run(["synthesize", str(nonprivate), "--rows", "2", "--out", str(tmp_path / "c"),
                         "--max_new_tokens", "2", "--non_private_ok"])
    assert code == 0, err
    assert "no guarantee" in (tmp_path / "c" / "privacy.md").read_text()
