"""`dpl tune`: bad input in one line with nothing written, K drawn secretly from its law and kept across a resume,
every trial a full private fit, only the best run kept, and its report carrying the epsilon of the whole search."""

from __future__ import annotations

import json
import math
import random
import stat
from pathlib import Path

import pytest
import torch
import yaml
from helpers import save_tiny_bert, write_sentiment_tsv

from dpl.cli import main
from dpl.core.accounting import tuning as accounting
from dpl.lightning.report import REPORT_KEY
from dpl.tune import command, release, search, trials
from dpl.tune.state import STATE_FILE, TuningState


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tune")
    model = save_tiny_bert(tmp / "bert")
    write_sentiment_tsv(tmp / "data" / "train.tsv", rows=96)
    write_sentiment_tsv(tmp / "data" / "validation.tsv", rows=16, seed=1)
    config = {"trainer": {"accelerator": "cpu", "max_steps": 2, "enable_progress_bar": False,
                          "limit_val_batches": 2, "default_root_dir": str(tmp / "runs")},
              "model": {"class_path": "dpl.tasks.modules.DPClassificationModule",
                        "init_args": {"model": model, "privacy": {"target_epsilon": 6.0, "batch_size": 16},
                                      "optimizer": {"class_path": "torch.optim.SGD", "init_args": {"lr": 0.05}}}},
              "data": {"class_path": "dpl.tasks.data.ClassificationDataModule",
                       "init_args": {"tokenizer": model, "data_dir": str(tmp / "data"), "max_length": 16}}}
    (tmp / "tiny.yaml").write_text(yaml.safe_dump(config))
    return tmp


def _tune(world, *args: str) -> int:
    try:
        main(["tune", "--config", str(world / "tiny.yaml"), *args])
    except SystemExit as exc:
        return int(exc.code or 0)
    return 0


def _folders(root: Path) -> list[Path]:
    return sorted(root.glob("tune_*")) if root.exists() else []


def _force_k(monkeypatch, k: int) -> list:
    calls = []

    def sample(self, *args, **kwargs):
        calls.append((self, args, kwargs))
        return k

    monkeypatch.setattr(accounting.TrialDistribution, "sample", sample)
    return calls


# ------------------------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize("args,message", [
    ([], "needs a search space"),
    (["--search", "lr="], "empty value"),
    (["--search", "lr=0.1,0.1"], "listed twice"),
    (["--search", "model.privacy.target_epsilon=3,6"], "privacy accounting"),
    (["--search", "model.privacy.accountant=prv,rdp"], "privacy accounting"),
    (["--search", "lr=0.1", "--trials-mean", "2", "--total-epsilon", "-1"], "positive number"),
    (["--search", "lr=0.1", "--trials-mean", "2", "--total-epsilon", "4", "--model.privacy.noise_multiplier", "1"],
     "remove it"),
    (["--search", "batch_size=8,16", "--trials-mean", "30", "--total-epsilon", "0.02"], "cannot be met"),
    (["--search", "model.optimizer.init_args.lrr=0.1,0.2", "--trials-mean", "2"], "unknown option"),
    (["--search", "lr=0.1,abc", "--trials-mean", "2"], "--search model.optimizer.init_args.lr=abc"),
    (["--search", "lr=0.1", "--trials-mean", "0"], "must be positive"),
    (["--search", "lr=0.1", "--trials-mean", "-1"], "must be positive"),
    (["--search", "lr=0.1", "--trials-mean", "1", "--distribution", "geometric"], "above 1"),
    (["--search", "lr=0.1"], "--trials-mean"),
    (["--search", "lr=0.1", "--trials-mean", "3", "--method", "grid"], "unknown --method"),
    (["--search", "lr=0.1", "--trials-mean", "3", "--distribution", "uniform"], "unknown --distribution"),
    (["--search", "lr=0.1", "--trials-mean", "3", "--method", "liu-talwar", "--distribution", "geometric"],
     "never pure DP"),
    (["--search", "lr=0.1", "--trials-mean", "3", "--distribution", "negative-binomial"], "--eta"),
    (["--search", "lr=0.1", "--trials-mean", "3", "--distribution", "negative-binomial", "--eta", "-2"], "> -1"),
    (["--search", "lr=0.1", "--trials-mean", "3", "--export", "out"], "--export is not a trial option"),
    (["--search", "lr=0.1", "--trials-mean", "abc"], "invalid float value"),
    (["--search", "lr=0.1", "--trials-mean", "2.5", "--method", "composition"], "integer >= 1"),
    (["--search", "lr=0.1", "--trials-mean", "2", "--method", "composition", "--distribution", "poisson"],
     "no --distribution"),
])
def test_bad_input_is_one_line_and_writes_nothing(world, capsys, args, message):
    root = world / "runs"
    before = _folders(root)
    code = _tune(world, *args)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith("dpl: error:") and message in err[0], err
    assert _folders(root) == before


def test_resume_takes_no_other_option_and_needs_a_tuning_folder(world, capsys, tmp_path):
    assert _tune_resume(tmp_path) == 2
    assert "not a tuning folder" in capsys.readouterr().err
    assert _tune(world, "--resume", str(tmp_path)) == 2
    assert "takes no other option" in capsys.readouterr().err


@pytest.mark.parametrize("extra,reason", [
    (["--model.privacy.seed", "3"], "independent trials"),
    (["--model.init_args.plugins", "{ftrl: {noise: banded, bands: 2}}"], "no RDP curve"),
])
def test_trials_the_bound_does_not_cover_are_refused_before_training(world, capsys, monkeypatch, extra, reason):
    _force_k(monkeypatch, 2)
    root = world / "runs"
    before = _folders(root)
    code = _tune(world, "--search", "lr=0.01,0.02", "--trials-mean", "2", *extra)
    captured = capsys.readouterr()
    assert code == 2
    errors = [line for line in captured.err.splitlines() if line.startswith("dpl:")]
    assert len(errors) == 1 and reason in errors[0] and "dpl: trained" not in captured.out
    assert _folders(root) == before  # a setup error is bad input: no tuning folder left to resume


# --------------------------------------------------------------------------------------------- the search


def test_the_search_space_is_uniform_and_its_keys_are_neutral():
    space = search.parse_search(["lr=0.1,0.2,0.3", "model.init_args.finetuning.method=full,lora"])
    assert space.size == 6
    rng = random.Random(0)
    draws = [tuple(space.draw(rng.randrange).values()) for _ in range(6000)]
    counts = {d: draws.count(d) for d in set(draws)}
    assert len(counts) == 6 and all(abs(c - 1000) < 150 for c in counts.values())
    assert search.canonical("--model.init_args.optimizer.init_args.lr") == "model.optimizer.lr"
    assert search.is_neutral("model.init_args.privacy.max_grad_norm")
    assert not search.is_neutral("model.privacy.target_epsilon") and not search.is_neutral("data.train_size")


def test_trials_with_different_accounting_are_refused():
    state = TuningState(folder=".", fit_args=[], search={}, method="papernot-steinke", distribution={}, metric=None,
                        mode="max", trials=2, configurations=[{}, {}])
    report = {"mechanism": "gaussian", "sampling": "poisson", "accountant": "prv", "noise_multiplier": 1.0,
              "sampling_rate": 0.1, "steps_planned": 10, "steps_taken": 10, "delta": 1e-5, "unit": "example",
              "adjacency": "add_remove"}
    plan = {"noise_multiplier": 1.0, "sampling_rate": 0.1, "steps": 10, "delta": 1e-5}
    state.finished.append({"index": 0, "report": report})
    command._check_accounting(state, dict(report), plan)
    with pytest.raises(Exception, match="noise_multiplier"):
        command._check_accounting(state, {**report, "noise_multiplier": 0.9}, plan)
    with pytest.raises(Exception, match="unit"):
        command._check_accounting(state, {**report, "unit": "user"}, plan)
    with pytest.raises(Exception, match="11 steps"):
        command._check_accounting(state, {**report, "steps_taken": 11}, plan)


def test_the_accounting_keys_are_planned_over_the_whole_space():
    space = search.parse_search(["batch_size=8,16", "lr=0.1,0.2", "steps=2,3"])
    assert space.size == 8
    assert space.accounting_configurations() == [
        {"model.privacy.batch_size": b, "trainer.max_steps": s} for b in ("8", "16") for s in ("2", "3")]
    assert search.accounting_part({"model.privacy.batch_size": "8", "model.optimizer.init_args.lr": "0.1"}) == {
        "model.privacy.batch_size": "8"}
    assert search.parse_search(["lr=0.1"]).accounting_configurations() == [{}]
    assert search.is_planned("model.init_args.privacy.batch_size") and search.is_planned("trainer.max_epochs")


# ------------------------------------------------------------------------------------------------ a tuning


def test_a_tuning_runs_k_trials_and_keeps_only_the_best(world, capsys, monkeypatch, tmp_path):
    root = tmp_path / "runs"
    calls = _force_k(monkeypatch, 3)
    code = _tune(world, "--search", "lr=0.01,0.1", "--search", "max_grad_norm=0.5,1", "--trials-mean", "2",
                 "--trainer.default_root_dir", str(root))
    out = capsys.readouterr().out
    assert code == 0, out
    assert len(calls) == 1 and calls[0][1:] == ((), {})  # K drawn once, with the default (OS entropy) uniform
    scores = [float(line.split("val_acc ")[1].split()[0]) for line in out.splitlines()
              if line.startswith("dpl: trial") and "val_acc" in line]
    assert len(scores) == 3 and out.count("dpl: trained 2 private steps") == 3
    (folder,) = _folders(root)
    assert len(list(folder.glob("trial_*"))) == 1  # the others are deleted
    state = json.loads((folder / STATE_FILE).read_text())
    assert stat.S_IMODE((folder / STATE_FILE).stat().st_mode) == 0o600
    assert state["trials"] == 3 and len(state["configurations"]) == 3 and state["released"]
    (run,) = [p.parent for p in folder.glob("trial_*/**/privacy.json")]
    report = json.loads((run / "privacy.json").read_text())
    tuning = report["tuning"]
    assert tuning["score"] == pytest.approx(max(scores), abs=1e-4)
    assert set(tuning) == {"method", "theorem", "distribution", "search_space", "metric", "mode", "score", "epsilon",
                           "delta", "epsilon_one_trial", "epsilon_one_trial_rdp"}  # K is not among them
    assert tuning["distribution"] == {"distribution": "poisson", "mu": 2.0, "expected_trials": 2.0}
    assert "Theorem 6" in tuning["theorem"]
    # the epsilon of the release, recomputed: Theorem 6 on one trial's curve, not one trial, not 3 fixed trials
    curve = accounting.subsampled_gaussian_rdp([(report["noise_multiplier"], report["sampling_rate"],
                                                 report["steps_planned"])])
    expected = accounting.tuned_epsilon(accounting.poisson(2.0), accounting.ORDERS, curve, report["delta"])
    assert report["epsilon"] == pytest.approx(expected) == pytest.approx(tuning["epsilon"])
    assert report["epsilon"] > tuning["epsilon_one_trial_rdp"] > tuning["epsilon_one_trial"] * 0.99
    assert abs(report["epsilon"] - accounting.fixed_trials_epsilon(accounting.ORDERS, curve, 3, report["delta"])) > 0.01
    assert "## Tuning" in (run / "privacy.md").read_text()
    assert "chosen by private tuning" in report["model_card"] and "Theorem 6" in report["model_card"]
    assert "hyperparameters tuned on the private data" not in json.dumps(report)
    # the checkpoint carries the tuned report, so an export does too; last.ckpt stays a link to it (one file)
    assert (run / "checkpoints" / "last.ckpt").is_symlink()
    assert len([p for p in (run / "checkpoints").glob("*.ckpt") if not p.is_symlink()]) == 1
    ckpt = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert ckpt[REPORT_KEY]["tuning"]["epsilon"] == pytest.approx(expected)
    main(["export", str(run), str(tmp_path / "export")])
    exported = json.loads((tmp_path / "export" / "privacy.json").read_text())
    assert exported["epsilon"] == pytest.approx(expected) and "tuning" in exported
    assert str(folder) not in json.dumps(exported) and set(exported["tuning"]) == set(tuning)
    # finished: a resume only says so
    assert _tune_resume(folder) == 0
    assert "is finished" in capsys.readouterr().out


def test_a_batch_size_search_is_bounded_by_every_configuration_and_meets_the_total(world, capsys, monkeypatch,
                                                                                     tmp_path):
    """Both trials draw batch size 8 (forced): the bound must still cover batch size 32, whose RDP curve crosses
    batch size 8's, so the kept (and only drawn) configuration's curve alone would give a smaller epsilon."""
    import numpy as np

    from dpl.planning.command import plan_config

    _force_k(monkeypatch, 2)
    monkeypatch.setattr(search.SearchSpace, "draw", lambda self, *a: {"model.privacy.batch_size": "8"})
    total = 8.0
    code = _tune(world, "--search", "batch_size=8,32", "--trials-mean", "2", "--total-epsilon", str(total),
                 "--trainer.default_root_dir", str(tmp_path / "runs"))
    out = capsys.readouterr().out
    assert code == 0, out
    assert "each trial targets epsilon=" in out and "the bound covers the 2 configurations" in out
    (folder,) = _folders(tmp_path / "runs")
    state = TuningState.load(folder)
    target = state.target_epsilon
    assert state.total_epsilon == total and [p["config"] for p in state.plans] == [
        {"model.privacy.batch_size": "8"}, {"model.privacy.batch_size": "32"}]
    (run,) = [p.parent for p in folder.glob("trial_*/**/privacy.json")]
    report = json.loads((run / "privacy.json").read_text())
    tuning = report["tuning"]
    assert tuning["total_epsilon"] == total and tuning["epsilon_per_trial_target"] == target
    assert tuning["configurations_planned"] == 2 and "--total-epsilon" in (run / "privacy.md").read_text()
    assert report["epsilon"] == tuning["epsilon"] and total * 0.99 <= report["epsilon"] <= total
    # recomputed without dpl.tune: the planner's sigma, q and steps of both batch sizes at the per-trial target
    curves = {}
    for batch in ("8", "32"):
        plan = plan_config(["--config", str(world / "tiny.yaml"), "--model.privacy.batch_size", batch,
                            "--model.privacy.target_epsilon", repr(target)])
        curves[batch] = accounting.subsampled_gaussian_rdp([(plan.current.noise_multiplier, plan.sampling_rate,
                                                             plan.current.steps)])
        if batch == "8":  # the trials ran as planned
            assert report["noise_multiplier"] == plan.current.noise_multiplier
            assert (report["sampling_rate"], report["steps_planned"]) == (plan.sampling_rate, plan.current.steps)
    assert (curves["8"] > curves["32"]).any() and (curves["32"] > curves["8"]).any()
    dist, delta = accounting.poisson(2.0), report["delta"]
    expected = accounting.tuned_epsilon(dist, accounting.ORDERS, np.maximum(curves["8"], curves["32"]), delta)
    assert report["epsilon"] == pytest.approx(expected, rel=1e-9)
    # the root ledger's line: its event (one trial is any of the two configurations) is worth the same. Planted bug
    # this catches: dpl.tune.plans.tuning_event taking trials[0] instead of events.AnyOf(tuple(trials))
    from dpl.core.accounting import events
    from dpl.lightning.data_ledger import LEDGER_NAME, read_entries

    lines, _ = read_entries(tmp_path / "runs" / LEDGER_NAME)
    [(event, _)] = events.history_from_json(lines[-1]["events"])
    assert events.epsilon(event, delta) == pytest.approx(expected, rel=1e-9)
    # the planted mistakes: the kept trial's curve, or only the drawn configurations' (batch size 8 alone)
    kept_only = accounting.tuned_epsilon(dist, accounting.ORDERS, release_curve(report), delta)
    assert report["epsilon"] > kept_only * 1.005
    assert report["epsilon_delta_table"] and all(
        row["epsilon"] == pytest.approx(accounting.tuned_epsilon(
            dist, accounting.ORDERS, np.maximum(curves["8"], curves["32"]), row["delta"]), rel=1e-9)
        for row in report["epsilon_delta_table"])


def release_curve(report: dict) -> object:
    return accounting.subsampled_gaussian_rdp([(report["noise_multiplier"], report["sampling_rate"],
                                                report["steps_planned"])])


def test_a_trial_unlike_its_plan_is_refused_before_training(world, capsys, monkeypatch, tmp_path):
    from dpl.tune import plans

    _force_k(monkeypatch, 1)
    real = plans.plan_configuration
    monkeypatch.setattr(plans, "plan_configuration", lambda *a: {**real(*a), "steps": 3})
    code = _tune(world, "--search", "lr=0.01,0.1", "--trials-mean", "2", "--trainer.default_root_dir",
                 str(tmp_path / "runs"))
    captured = capsys.readouterr()
    errors = [line for line in captured.err.splitlines() if line.startswith("dpl:")]
    assert code == 2 and "dpl: trained" not in captured.out
    assert len(errors) == 1 and "not the one planned for it (2 steps where the plan has 3)" in errors[0], errors


def _tune_resume(folder: Path) -> int:
    try:
        main(["tune", "--resume", str(folder)])
    except SystemExit as exc:
        return int(exc.code or 0)
    return 0


def test_a_crashed_tuning_resumes_without_drawing_k_again(world, capsys, monkeypatch, tmp_path):
    root = tmp_path / "runs"
    _force_k(monkeypatch, 3)
    real_fit = trials.fit
    fits = []

    def crashing_fit(fit_args, config, folder, extra):
        fits.append(folder)
        if len(fits) == 2:  # killed mid-trial: a half-written trial folder, and the exit code of SIGTERM
            (folder / "lightning_logs" / "version_0").mkdir(parents=True)
            raise trials.TrialFailed(143)
        return real_fit(fit_args, config, folder, extra)

    monkeypatch.setattr(trials, "fit", crashing_fit)
    assert _tune(world, "--search", "lr=0.01,0.1", "--trials-mean", "3", "--trainer.default_root_dir",
                 str(root)) == 143
    assert "dpl tune --resume" in capsys.readouterr().err
    (folder,) = _folders(root)
    state = TuningState.load(folder)
    assert len(state.finished) == 1 and state.running["index"] == 1 and not state.released
    configurations = list(state.configurations)

    def no_draw(self, *args, **kwargs):
        raise AssertionError("K drawn again")

    monkeypatch.setattr(accounting.TrialDistribution, "sample", no_draw)
    monkeypatch.setattr(trials, "fit", lambda *a: fits.append(a[2]) or real_fit(*a))
    assert _tune_resume(folder) == 0
    out = capsys.readouterr().out
    assert "1 of 3 trials finished" in out and "dpl: trial 1/3" not in out  # the finished trial is not run again
    assert out.count("dpl: trained 2 private steps") == 2
    state = TuningState.load(folder)
    assert state.released and state.configurations == configurations and len(state.finished) == 3
    assert len(list(folder.glob("trial_*"))) == 1


def test_a_fixed_number_of_trials_costs_their_composition(world, capsys, tmp_path):
    from dpl.core.accounting import epsilon_for

    code = _tune(world, "--search", "lr=0.01,0.1", "--trials-mean", "2", "--method", "composition",
                 "--trainer.default_root_dir", str(tmp_path / "runs"))
    out = capsys.readouterr().out
    assert code == 0 and out.count("dpl: trained 2 private steps") == 2
    (run,) = [p.parent for p in tmp_path.glob("runs/tune_*/trial_*/**/privacy.json")]
    report = json.loads((run / "privacy.json").read_text())
    assert report["tuning"]["distribution"] == {"distribution": "fixed", "trials": 2, "expected_trials": 2.0}
    expected = epsilon_for(report["noise_multiplier"], report["sampling_rate"], 2 * report["steps_planned"],
                           report["delta"])
    assert report["epsilon"] == pytest.approx(expected) and report["epsilon"] > report["tuning"]["epsilon_one_trial"]


def test_zero_trials_release_nothing(world, capsys, monkeypatch, tmp_path):
    _force_k(monkeypatch, 0)
    code = _tune(world, "--search", "lr=0.01,0.1", "--trials-mean", "0.5", "--trainer.default_root_dir",
                 str(tmp_path / "runs"))
    out = capsys.readouterr().out
    assert code == 0 and "nothing is released" in out and "dpl: trained" not in out
    (folder,) = _folders(tmp_path / "runs")
    assert not list(folder.glob("trial_*")) and TuningState.load(folder).released


def test_the_kept_run_has_the_best_score_whatever_the_order(monkeypatch, tmp_path):
    """min mode, NaN scores lose, ties keep the first."""
    assert command._better(0.5, math.nan, "max") and not command._better(math.nan, 0.1, "max")
    assert command._better(0.1, 0.2, "min") and not command._better(0.2, 0.2, "max")


def test_the_theorem_follows_the_distribution():
    assert release.THEOREMS[accounting.geometric(3.0).kind] == "Theorem 2"
    assert release.THEOREMS[accounting.poisson(3.0).kind] == "Theorem 6"


def test_help_names_the_options(capsys):
    with pytest.raises(SystemExit) as info:
        main(["tune", "--help"])
    out = capsys.readouterr().out
    assert info.value.code == 0 and "--search" in out and "--trials-mean" in out and "--resume" in out
    assert "--total-epsilon" in out and "batch_size" in out


# ------------------------------------------------------------------------------------------------ the data ledger


def _ledger_json(target: Path) -> dict:
    from dpl.trained.spending import ledger_command

    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert ledger_command([str(target), "--json"]) == 0
    return json.loads(out.getvalue())


def test_a_tuning_is_one_line_in_the_ledger_of_its_root_with_the_tuned_epsilon(world, capsys, monkeypatch, tmp_path):
    """Two trials drawn, the loser's folder deleted: `dpl ledger ROOT` shows one run, the tuning, at the tuned
    epsilon (its event composed), not the kept trial's epsilon; no trial line anywhere below the root."""
    from dpl.core.accounting import events
    from dpl.lightning.data_ledger import LEDGER_NAME, read_entries

    root = tmp_path / "runs"
    _force_k(monkeypatch, 2)
    assert _tune(world, "--search", "lr=0.01,0.1", "--trials-mean", "2", "--distribution", "geometric",
                 "--trainer.default_root_dir", str(root)) == 0
    (folder,) = _folders(root)
    (run,) = [p.parent for p in folder.glob("trial_*/**/privacy.json")]
    tuned = json.loads((run / "privacy.json").read_text())
    assert sorted(p.relative_to(root) for p in root.glob("**/" + LEDGER_NAME)) == [Path(LEDGER_NAME)]
    lines, _ = read_entries(root / LEDGER_NAME)
    assert {line["run_id"] for line in lines} == {folder.name} and len(lines) == 2  # started, released: never per trial
    assert all(line["steps"] == 0 and line["ended"] is None and "trials_finished" not in line
               for line in lines)  # nothing that counts the secret K
    shown = _ledger_json(root)
    [group] = shown["data_sets"]
    [tuning] = group["runs"]
    assert tuning["status"] == "finished" and tuning["mechanism"] == "tuning"
    assert tuning["epsilon"] == pytest.approx(tuned["epsilon"], rel=1e-12)
    assert tuning["epsilon"] > tuned["tuning"]["epsilon_one_trial"]
    [(event, _)] = events.history_from_json(tuning["events"])
    assert isinstance(event, events.RepeatAndSelect) and event.shape == 1.0
    assert events.epsilon(event, tuning["delta"]) == pytest.approx(tuned["epsilon"], rel=1e-9)
    from dpl.trained.spending import ledger_command

    capsys.readouterr()
    assert ledger_command([str(root)]) == 0  # shown as a tuning: no step count, no "None" folder
    [line] = [line for line in capsys.readouterr().out.splitlines() if folder.name in line]
    assert "None" not in line and "the best of K trials" in line and "     - " in line


def test_a_tuning_logs_one_run_to_the_tracker_with_the_tuned_epsilon(world, capsys, monkeypatch, tmp_path):
    """Three trials with the shipped MLflow fragment (a file store under tmp_path): the store holds exactly one run,
    the tuned model's, with the whole search's epsilon and the released score, the tuning's public description and
    the tuned privacy.json; no trial's run, steps or validation metrics (each trial writing its own runs would reveal
    the secret K and the losing trials' scores)."""
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps its file store behind this switch
    from mlflow.tracking import MlflowClient

    root, store = tmp_path / "runs", f"file:{tmp_path / 'mlruns'}"
    _force_k(monkeypatch, 3)
    assert _tune(world, "--config", str(Path(__file__).resolve().parents[1] / "configs" / "trackers" / "mlflow.yaml"),
                 "--trainer.logger.init_args.tracking_uri", store, "--search", "lr=0.01,0.1", "--trials-mean", "3",
                 "--trainer.default_root_dir", str(root)) == 0
    assert "the tuned model logged to MLFlowLogger as one run" in capsys.readouterr().out
    (folder,) = _folders(root)
    (run,) = [p.parent for p in folder.glob("trial_*/**/privacy.json")]
    tuned = json.loads((run / "privacy.json").read_text())
    client = MlflowClient(tracking_uri=store)
    experiments = client.search_experiments()
    runs = [r for e in experiments for r in client.search_runs([e.experiment_id])]
    assert len(runs) == 1
    (found,) = runs
    assert found.info.status == "FINISHED"
    assert found.data.metrics == {"epsilon": pytest.approx(tuned["epsilon"], rel=1e-6),
                                  "val_acc": pytest.approx(tuned["tuning"]["score"], rel=1e-6)}
    assert tuned["epsilon"] > tuned["tuning"]["epsilon_one_trial"]
    assert [m.step for m in client.get_metric_history(found.info.run_id, "val_acc")] == [tuned["steps_taken"]]
    params = found.data.params
    assert params["tuning/method"] == "papernot-steinke" and params["privacy/unit"] == "example"
    assert float(params["privacy/sigma"]) == pytest.approx(tuned["noise_multiplier"])
    assert not any("trial" in k and k != "tuning/epsilon_one_trial" for k in params)
    copy = Path(client.download_artifacts(found.info.run_id, "privacy/privacy.json", str(tmp_path / "copy")))
    assert json.loads(copy.read_text()) == tuned


def test_a_failed_tuning_keeps_its_line_and_its_folder(world, capsys, monkeypatch, tmp_path):
    """The first trial trains, then its scoring fails: the tuning's line (written before its first private step)
    stays in the root's ledger and the tuning folder is kept for a resume."""
    from dpl.lightning.data_ledger import LEDGER_NAME, read_entries

    root = tmp_path / "runs"
    _force_k(monkeypatch, 2)

    def failing_score(run, metric):
        raise trials.TrialFailed(2)

    monkeypatch.setattr(trials, "score", failing_score)
    assert _tune(world, "--search", "lr=0.01,0.1", "--trials-mean", "2", "--trainer.default_root_dir", str(root)) == 2
    (folder,) = _folders(root)
    lines, _ = read_entries(root / LEDGER_NAME)
    assert lines[-1]["run_id"] == folder.name and lines[-1]["status"] == "failed" and lines[-1]["epsilon"] > 0


def test_trial_requirements_are_checked_before_any_trial_trains(world, capsys, tmp_path):
    root = tmp_path / "runs"
    code = _tune(world, "--search", "lr=0.01,0.1", "--trials-mean", "2", "--trainer.default_root_dir", str(root),
                 "--trainer.enable_checkpointing", "false")
    err = capsys.readouterr().err
    assert code == 2 and "needs checkpoints" in err and len(err.strip().splitlines()) == 1
    assert not root.exists() or not list(root.iterdir())
