"""The one-run privacy audit (dpl/audit.py, ``dpl audit``): the bound of Steinke, Nasr & Jagielski 2023 on known
cases, the honest mechanism below its claim, planted bugs caught, and the command."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from dpl.audit import (AuditConfig, epsilon_lower_bound, guesses_for, p_value, perfect_guess_ceiling, run_audit,
                       score_guesses)
from dpl.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]


# --- the bound ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("m", "r", "v", "delta", "printed"), [
    # Values printed in the paper (arXiv:2305.08846; Appendix D and the Figure 11 text of Section 7), as
    # transcribed in a public note that reproduced them: the port must give the same numbers.
    (100, 100, 75, 0.0, 0.702),
    (100, 100, 75, 1e-4, 0.699),
    (1000, 100, 75, 1e-4, 0.673),  # abstentions (r < m) and the 2 m delta term
    (100000, 1510, 1439, 1e-5, 2.675),
])
def test_bound_reproduces_the_papers_numbers(m, r, v, delta, printed):
    assert epsilon_lower_bound(m, r, v, delta, confidence=0.95) == pytest.approx(printed, abs=1e-3)


def test_p_value_reproduces_the_paper():
    # Appendix D: p-value of 75 / 100 correct guesses against eps = ln 3, delta = 0 is 0.553.
    assert p_value(100, 100, 75, math.log(3), 0.0) == pytest.approx(0.553, abs=1e-3)


@pytest.mark.parametrize("r", [1, 16, 100, 1000])
def test_all_correct_without_delta_is_the_closed_form(r):
    # delta = 0, v = r: p = q^r, q = e^eps / (1 + e^eps), so eps = -ln(beta^(-1/r) - 1).
    expected = max(0.0, -math.log(0.05 ** (-1 / r) - 1))
    assert epsilon_lower_bound(r, r, r, 0.0, 0.95) == pytest.approx(expected, abs=1e-9)


def test_all_correct_bound_grows_with_the_number_of_guesses():
    bounds = [epsilon_lower_bound(10000, r, r, 1e-6, 0.95) for r in (10, 30, 100, 300, 1000, 3000)]
    assert all(b2 > b1 + 0.5 for b1, b2 in zip(bounds, bounds[1:])), bounds


def test_delta_and_m_only_lower_the_bound():
    base = epsilon_lower_bound(1000, 200, 180, 0.0, 0.95)
    with_delta = epsilon_lower_bound(1000, 200, 180, 1e-5, 0.95)
    more_canaries = epsilon_lower_bound(100000, 200, 180, 1e-5, 0.95)
    assert base > with_delta > more_canaries > 0


def test_random_guesses_bound_is_about_zero_and_valid():
    # Scores independent of membership: every (k+, k-) candidate guesses at chance. The bound must be > 0 in at
    # most ~5 % of the trials (that is what 95 % confidence means) and tiny on average.
    rng = np.random.default_rng(0)
    m = 2000
    candidates = guesses_for(m)
    bounds = []
    for _ in range(40):
        included = rng.random(m) < 0.5
        _, best = score_guesses(rng.normal(size=m), included, candidates, 1e-5, 0.95)
        bounds.append(best.bound)
    assert sum(b > 0 for b in bounds) <= 4, bounds
    assert np.mean(bounds) < 0.05


def test_bound_is_a_valid_test_at_epsilon_zero():
    # Under a 0-DP mechanism v ~ Binomial(r, 1/2): P[bound > 0] <= 5 %.
    rng = np.random.default_rng(1)
    draws = rng.binomial(200, 0.5, size=2000)
    values, counts = np.unique(draws, return_counts=True)
    rejected = sum(int(n) for v, n in zip(values, counts) if epsilon_lower_bound(1000, 200, int(v), 1e-5, 0.95) > 0)
    assert 0 < rejected / len(draws) <= 0.05  # valid, and not vacuous


def test_ceiling_is_the_perfect_guess_bound():
    candidates = guesses_for(1000)
    ceiling = perfect_guess_ceiling(1000, candidates, 1e-5, 0.95)
    scores = np.arange(1000.0)
    included = scores >= 500  # the top half are members: every candidate is right
    _, best = score_guesses(scores, included, candidates, 1e-5, 0.95)
    assert best.bound == pytest.approx(ceiling)
    assert best.correct == best.guesses


# --- the canary game through dpl's private step -------------------------------------------------------------

FAST = dict(target_epsilon=2.0, target_delta=1e-5, steps=60, canaries=1000, examples=500, batch_size=50, seed=3)


def test_honest_gaussian_stays_below_its_claim():
    result = run_audit(AuditConfig(**FAST))
    assert result.mechanism == "gaussian"
    assert result.claimed_epsilon <= 2.0
    assert not result.violation
    assert result.lower_bound < result.claimed_epsilon
    assert result.ceiling > result.claimed_epsilon  # the audit could have caught a violation here
    assert result.best.correct > result.best.guesses / 2  # and it does see the canaries (better than chance)


@pytest.mark.parametrize("bug", ["weak_noise", "no_clip", "noise_leak"])
def test_planted_bugs_are_reported_as_violations(bug):
    result = run_audit(AuditConfig(**FAST, inject=bug))
    assert result.violation, result.report()
    assert "VIOLATION" in result.report()


def test_random_direction_canaries_catch_clipping_off():
    cfg = AuditConfig(**{**FAST, "canaries": 500}, canary_type="random", rows=48, inject="no_clip")
    assert run_audit(cfg).violation


def test_honest_with_a_postprocessing_plugin_stays_below_its_claim():
    result = run_audit(AuditConfig(**FAST, plugins={"adambc": {}}, score="sum"))
    assert result.plugins == ["adambc"]
    assert not result.violation


def test_noise_leak_needs_the_release_to_be_the_update():
    with pytest.raises(ConfigError, match="noise_leak"):
        run_audit(AuditConfig(**FAST, plugins={"adambc": {}}, inject="noise_leak"))


PER_LAYER = dict(FAST, clipping="per_layer", layers=16, canary_type="random", rows=48)


@pytest.mark.parametrize("thresholds", ["fixed", "adaptive"])
def test_per_layer_audit_is_sound_and_catches_its_bugs(thresholds):
    """privacy.clipping per_layer over 16 layers, random canaries spanning all of them: the honest mechanism stays below
    its claim and sees the canaries; each layer clipped to C instead of C_g (a canary adds 4 C), clipping off, and the
    noise known to the auditor (the counts' noise of adaptive thresholds replayed first) are violations."""
    honest = run_audit(AuditConfig(**PER_LAYER, clipping_thresholds=thresholds))
    assert "per_layer clipping" in honest.report()
    assert not honest.violation and honest.best.correct > honest.best.guesses / 2, honest.report()
    for bug in ("unsplit_thresholds", "no_clip", "noise_leak"):
        broken = run_audit(AuditConfig(**PER_LAYER, clipping_thresholds=thresholds, inject=bug))
        assert broken.violation, broken.report()


def test_the_canary_model_split_into_layers_has_the_same_gradient():
    from dpl.audit.canaries import LinearCanaryModel

    x, y = torch.randn(3, 5, dtype=torch.float64), torch.randn(3, 7, dtype=torch.float64)
    model = LinearCanaryModel(7, 5, layers=3).double()
    assert [part.weight.shape[0] for part in model.parts] == [3, 2, 2]
    weights = [part.weight for part in model.parts]
    grads = torch.autograd.grad(model.per_example_loss({"x": x, "y": y})[1], weights)
    assert torch.equal(torch.cat(grads), torch.outer(y[1], x[1]))  # one product per entry: exact
    assert model.weight().shape == (7, 5)


@pytest.mark.parametrize(("change", "message"), [
    ({"inject": "unsplit_thresholds"}, "unsplit_thresholds needs clipping: per_layer and layers >= 2"),
    ({"clipping_thresholds": "adaptive"}, "adaptive needs clipping: per_layer"),
    ({"clipping": "per_layer", "layers": 10**6}, "layers must be in"),
    ({"canaries": 1}, "canaries"),
    ({"rows": 10, "cols": 10}, "rows \\* cols"),
    ({"batch_size": 10**6}, "batch_size"),
    ({"guesses": [[2000, 0]]}, "guess counts"),
])
def test_bad_settings_are_refused(change, message):
    with pytest.raises(ConfigError, match=message):
        run_audit(AuditConfig(**{**FAST, **change}))


# --- the command --------------------------------------------------------------------------------------------


def run_cli(args, capsys):
    from dpl.cli import main

    code = 0
    try:
        main(["audit", "--config", str(ROOT / "configs/audit/gaussian.yaml"), *args])
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


TINY = ["--canaries", "400", "--examples", "200", "--batch_size", "30", "--steps", "30"]


def test_cli_audit_prints_the_report_and_writes_json(tmp_path, capsys):
    path = tmp_path / "audit.json"
    code, out, _ = run_cli([*TINY, "--target_epsilon", "2", "--output", str(path)], capsys)
    assert code == 0
    assert "lower bound" in out and "verdict" in out and "no violation found" in out
    report = json.loads(path.read_text())
    assert report["violation"] is False
    assert report["lower_bound"] < report["claimed_epsilon"] <= 2.0
    assert report["canaries"] == 400 and report["config"]["steps"] == 30
    assert {"k_plus", "k_minus", "correct", "bound", "guesses"} <= set(report["best"])


def test_cli_audit_reports_a_planted_bug(capsys):
    code, out, _ = run_cli([*TINY, "--target_epsilon", "1", "--inject", "no_clip"], capsys)
    assert code == 1  # a CI job running dpl audit fails
    assert "VIOLATION" in out


def test_cli_audit_bad_setting_is_one_line(capsys):
    code, out, err = run_cli([*TINY, "--canaries", "1"], capsys)
    assert code == 2
    assert err.strip().startswith("dpl: error:") and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(("old", "new"), [("epsilon", "target_epsilon"), ("delta", "target_delta"),
                                          ("rows_per_user", "max_rows_per_user")])
def test_cli_audit_refuses_an_old_key_in_one_line(old, new, tmp_path, capsys):
    """The settings a training run also has carry the privacy config's names; another name, on the command line or
    in a config file, is one line naming the right one (nothing runs)."""
    code, out, err = run_cli([*TINY, f"--{old}", "2"], capsys)
    assert code == 2 and out == ""
    assert err.strip() == f"dpl: error: dpl audit: {old!r} is now {new!r} (the privacy config's name)"
    config = tmp_path / "old.yaml"
    config.write_text(f"{old}: 2\n")
    code, _, err = run_cli([*TINY, "--config", str(config)], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and f"{old!r} is now {new!r}" in err


AUDIT_CONFIGS = sorted((ROOT / "configs" / "audit").glob("*.yaml"))


@pytest.mark.parametrize("config", AUDIT_CONFIGS, ids=lambda p: p.name)
def test_audit_configs_parse(config):
    from dpl.audit import build_parser

    parser = build_parser()
    base = ROOT / "configs" / "audit" / "gaussian.yaml"
    args = parser.parse_args(["--config", str(base), "--config", str(config)])
    cfg = AuditConfig(**{k: args[k] for k in AuditConfig.__dataclass_fields__})
    cfg.validate()


@pytest.mark.skipif("ftrl" not in __import__("dpl.core.plugin_manager").core.plugin_manager.installed_plugins(),
                    reason="ftrl plugin not installed")
@pytest.mark.parametrize("bug", ["none", "weak_noise"])
def test_a_plugin_with_its_own_mechanism_is_audited_the_same_way(bug):
    # ftrl brings its own sampler (shuffled fixed-size batches), noise and accounting: all through the hooks.
    result = run_audit(AuditConfig(**FAST, plugins={"ftrl": {}}, score="sum", inject=bug))
    assert result.mechanism == "ftrl"
    assert result.violation == (bug != "none"), result.report()


def test_user_level_audit_is_sound_and_catches_per_row_clipping():
    """unit: user, k = 4: canaries are users of 4 copies of themselves. The honest mechanism (each user's mean clipped
    as one) stays below its claimed user-level epsilon; clipping each row on its own (a canary user adds 4 C) is a
    violation."""
    honest = run_audit(AuditConfig(**FAST, unit="user", max_rows_per_user=4))
    assert not honest.violation and honest.lower_bound < honest.claimed_epsilon
    assert honest.best.correct > honest.best.guesses / 2  # the canary users are seen
    broken = run_audit(AuditConfig(**FAST, unit="user", max_rows_per_user=4, inject="per_row_clip"))
    assert broken.violation, broken.report()
    with pytest.raises(ConfigError, match="per_row_clip needs unit: user"):
        run_audit(AuditConfig(**FAST, inject="per_row_clip"))
