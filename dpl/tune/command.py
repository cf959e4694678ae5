"""dpl tune: private hyperparameter tuning. Draws a secret number K of trials (Poisson or truncated negative
binomial; Papernot & Steinke, ICLR 2022), runs K private dpl fit trials with configurations drawn uniformly from the
search space, scores each on the validation split, keeps only the best run and writes the epsilon of the whole search
into its privacy report. Every other option is a dpl fit option shared by all trials. The bound is planned before any
trial, from every configuration whose accounting differs (batch size, steps, epochs; dpl.tune.plans); with
--total-epsilon E, each trial's target epsilon is the largest that keeps the whole search within E.

Example: dpl tune --config configs/quickstart.yaml --search lr=0.005,0.01,0.02 --trials-mean 3
"""

from __future__ import annotations

import argparse
import json
import math
import secrets
import shutil
import sys
from pathlib import Path
from typing import Any, NoReturn

import yaml

from dpl.core.accounting import tuning as accounting
from dpl.errors import ConfigError, DPLError
from dpl.lightning import trackers
from dpl.tune import ledger_line, plans, probe, release, trials
from dpl.tune.probe import tunable
from dpl.tune.search import SearchSpace, config_args, parse_search, short
from dpl.tune.state import TuningState

METHODS = ("papernot-steinke", "liu-talwar", "composition")
DISTRIBUTIONS = ("poisson", "negative-binomial", "geometric", "logarithmic")
#: ``dpl fit`` options a trial cannot take
NOT_PER_TRIAL = {"--export": "export the kept run after tuning (dpl export RUN FOLDER)",
                 "--ckpt_path": "every trial is a fresh run (resume a tuning with dpl tune --resume FOLDER)",
                 "--print_config": "dpl fit --print_config shows a trial's configuration"}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        print(f"dpl: error: dpl tune: {message}", file=sys.stderr)
        raise SystemExit(2)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="dpl tune", allow_abbrev=False, description=__doc__.split("\n\n")[0],
                     epilog="Docs: docs/privacy.md#tuning-under-dp. Every other option goes to each trial's dpl fit.")
    parser.add_argument("--search", action="append", default=[], metavar="KEY=V1,V2",
                        help="a dpl fit option and its values (repeatable); aliases: lr, weight_decay, max_grad_norm, "
                             "batch_size, steps, epochs")
    parser.add_argument("--method", default="papernot-steinke", help=f"one of {', '.join(METHODS)}")
    parser.add_argument("--distribution", default=None,
                        help=f"of K: one of {', '.join(DISTRIBUTIONS)} (default poisson)")
    parser.add_argument("--trials-mean", type=float, default=None, metavar="MU",
                        help="E[K], the expected number of trials (composition: the number of trials)")
    parser.add_argument("--eta", type=float, default=None, help="shape of the negative binomial (> -1)")
    parser.add_argument("--total-epsilon", type=float, default=None, metavar="E",
                        help="the epsilon of the whole search: each trial targets the largest epsilon that keeps it "
                             "within E (instead of the config's privacy.target_epsilon)")
    parser.add_argument("--metric", default=None, help="validation metric (default val_acc, else val_bleu)")
    parser.add_argument("--mode", default=None, choices=("max", "min"), help="max (default; min for a loss)")
    parser.add_argument("--resume", default=None, metavar="FOLDER", help="continue the tuning in FOLDER")
    return parser


def tune_command(argv: list[str]) -> int:
    """``dpl tune ...``: see the module docstring."""
    args, fit_args = _parser().parse_known_args(argv)
    try:
        state = _resume(args, fit_args) if args.resume else _start(args, fit_args)
        if state is None:
            return 0
        return _run(state)
    except DPLError as exc:
        print(f"dpl: error: {exc}", file=sys.stderr)
        return 2


# ------------------------------------------------------------------------------------------------ starting


def _distribution(args: argparse.Namespace) -> accounting.TrialDistribution:
    if args.method not in METHODS:
        raise ConfigError(f"dpl tune: unknown --method {args.method!r} (one of {', '.join(METHODS)})")
    if args.distribution is not None and args.distribution not in DISTRIBUTIONS:
        raise ConfigError(f"dpl tune: unknown --distribution {args.distribution!r} (one of {', '.join(DISTRIBUTIONS)})")
    if args.method == "liu-talwar":
        raise ConfigError("dpl tune: --method liu-talwar needs trials that are epsilon-DP with delta = 0 (pure DP) and "
                          "a geometric number of trials; dpl's trials add Gaussian noise, which is never pure DP: use "
                          "--method papernot-steinke (with --distribution geometric, its Theorem 2 is the Rényi-DP "
                          "counterpart)")
    if args.trials_mean is None:
        raise ConfigError("dpl tune: give the expected number of trials, --trials-mean MU")
    if args.method == "composition":
        if args.distribution is not None or args.eta is not None:
            raise ConfigError("dpl tune: --method composition runs exactly --trials-mean trials: no --distribution "
                              "or --eta")
        try:
            return accounting.fixed(args.trials_mean)
        except ValueError as exc:
            raise ConfigError(f"dpl tune: --trials-mean: {exc}") from None
    args.distribution = args.distribution or "poisson"
    if args.eta is not None and args.distribution != "negative-binomial":
        raise ConfigError("dpl tune: --eta is the shape of --distribution negative-binomial (geometric is eta 1, "
                          "logarithmic eta 0)")
    try:
        if args.distribution == "poisson":
            return accounting.poisson(args.trials_mean)
        if args.distribution == "geometric":
            return accounting.geometric(args.trials_mean)
        if args.distribution == "logarithmic":
            return accounting.logarithmic(args.trials_mean)
        if args.eta is None:
            raise ConfigError("dpl tune: --distribution negative-binomial needs its shape, --eta (> -1)")
        return accounting.negative_binomial(args.trials_mean, args.eta)
    except ValueError as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"dpl tune: --trials-mean / --eta: {exc}") from None


def _check_fit_args(fit_args: list[str]) -> None:
    if fit_args[:1] and not fit_args[0].startswith("-"):
        raise ConfigError(f"dpl tune: unexpected argument {fit_args[0]!r} (dpl tune takes dpl fit's options, "
                          f"e.g. --config FILE)")
    for arg in fit_args:
        name = arg.split("=", 1)[0]
        if name in NOT_PER_TRIAL:
            raise ConfigError(f"dpl tune: {name} is not a trial option: {NOT_PER_TRIAL[name]}")


def _preflight(fit_args: list[str], space: SearchSpace, total: bool) -> tuple[Path, list[str]]:
    """Parse every value of the search space with the shared options (nothing runs): a bad key or value is one line
    now, not after hours of trials. Returns the folder to tune in and the arguments every trial adds. ``total``:
    ``--total-epsilon`` is given (it calibrates sigma: a config that sets sigma cannot take it)."""
    first = {key: values[0] for key, values in space.options.items()}
    resolved = _yaml(trials.check_args(["fit", *fit_args, *config_args(first)]))
    for key, values in space.options.items():
        for value in values[1:]:
            try:
                trials.check_args(["fit", *fit_args, *config_args({**first, key: value})])
            except ConfigError as exc:
                raise ConfigError(f"dpl tune: --search {key}={value}: {exc}") from None
    privacy = ((resolved.get("model") or {}).get("init_args") or {}).get("privacy") or {}
    if total and privacy.get("noise_multiplier") is not None:
        raise ConfigError("dpl tune: --total-epsilon calibrates each trial's sigma to a target epsilon; the config "
                          "sets privacy.noise_multiplier: remove it")
    trainer = resolved.get("trainer") or {}
    _check_trial_requirements(trainer)
    extra = _one_device(trainer)
    return Path(trainer.get("default_root_dir") or "."), extra


def _check_trial_requirements(trainer: dict[str, Any]) -> None:
    """What every trial needs, checked before any trial trains: a last checkpoint (the kept run is released from it)
    and a validation run (the score)."""
    if trainer.get("enable_checkpointing") is False:
        raise ConfigError("dpl tune: a trial needs checkpoints (its last checkpoint is what is kept and scored); the "
                          "config sets trainer.enable_checkpointing: false (configs/smoke.yaml does): drop it")
    if trainer.get("limit_val_batches") in (0, 0.0):
        raise ConfigError("dpl tune: trials are scored on the validation split; the config sets "
                          "trainer.limit_val_batches: 0")


def _yaml(text: str) -> dict[str, Any]:
    try:
        loaded = yaml.safe_load(text)
    except yaml.YAMLError:
        return {}
    return loaded if isinstance(loaded, dict) else {}


def _one_device(trainer: dict[str, Any]) -> list[str]:
    """Trials run one after another in this process, on one device: refuse more; pin ``devices: auto`` to one."""
    devices, nodes, strategy = trainer.get("devices", "auto"), trainer.get("num_nodes", 1), trainer.get("strategy")
    name = strategy if isinstance(strategy, str) else (strategy or {}).get("class_path", "") if strategy else ""
    many = (isinstance(devices, int) and devices > 1) or (isinstance(devices, (list, tuple)) and len(devices) > 1) or \
        (isinstance(devices, str) and devices.isdigit() and int(devices) > 1) or str(devices) == "-1"
    if many or (isinstance(nodes, int) and nodes > 1) or any(s in str(name).lower() for s in ("ddp", "fsdp")):
        raise ConfigError("dpl tune runs each trial in this process on one device: set trainer.devices 1 and the "
                          "default strategy (multi-device trials are not supported)")
    return ["--trainer.devices", "1"] if str(devices) == "auto" else []


def _start(args: argparse.Namespace, fit_args: list[str]) -> TuningState | None:
    space = parse_search(args.search)
    _check_fit_args(fit_args)
    dist = _distribution(args)
    if args.total_epsilon is not None and not (math.isfinite(args.total_epsilon) and args.total_epsilon > 0):
        raise ConfigError(f"dpl tune: --total-epsilon must be a positive number, got {args.total_epsilon!r}")
    root, extra = _preflight(fit_args, space, args.total_epsilon is not None)
    fit_args, planned, target = _plan(args, [*fit_args, *extra], space, dist)
    folder = root / f"tune_{secrets.token_hex(4)}"
    k = dist.sample()  # secret: OS entropy, never printed into anything shared
    state = TuningState(folder=str(folder), fit_args=fit_args, search=space.describe(), method=args.method,
                        distribution=dict(dist.__dict__), metric=args.metric,
                        mode=args.mode or ("min" if args.metric and "loss" in args.metric else "max"), trials=k,
                        configurations=[space.draw() for _ in range(k)], plans=planned,
                        total_epsilon=args.total_epsilon, target_epsilon=target, ledger_root=str(root))
    folder.mkdir(parents=True, exist_ok=False)
    state.save()
    law = release.law_text({"distribution": dist.describe()})
    drawn = "" if dist.kind == "fixed" else f" drawn from {law}"
    print(f"dpl: tuning in {folder} (secret: keep it to yourself): {k} trial{'s' * (k != 1)}{drawn}, over "
          f"{space.size} configurations ({release.space_text(space.describe())})", flush=True)
    if k == 0:
        print(f"dpl: no trial drawn (K = 0 has probability e^-{dist.mu:g} = {math.exp(-dist.mu):.3g}, whatever the "
              f"data): nothing is released; a new dpl tune is a new search, whose epsilon adds to this one's",
              flush=True)
        state.released = True
        state.save()
        return None
    return state


def _plan(args: argparse.Namespace, fit_args: list[str], space: SearchSpace,
          dist: accounting.TrialDistribution) -> tuple[list[str], list[dict[str, Any]], float | None]:
    """Before anything is drawn: the plans of every accounting-distinct configuration and, with ``--total-epsilon``,
    the per-trial target that keeps the search within it. Returns the trials' arguments, the plans and that target."""
    if args.total_epsilon is None:
        planned = plans.plan_space(fit_args, space)
        target = None
    else:
        target, planned, total = plans.solve_total(fit_args, space, dist, args.total_epsilon)
        fit_args = [*fit_args, plans.TARGET_OPTION, repr(target)]
        print(f"dpl: --total-epsilon {args.total_epsilon:g}: each trial targets epsilon={target:.4f}; the tuned "
              f"model's epsilon is {total:.4f} at delta={planned[0]['delta']:.3g}", flush=True)
    if len(planned) > 1:
        sigmas = ", ".join(f"{plan['noise_multiplier']:.4g}" for plan in planned)
        print(f"dpl: the bound covers the {len(planned)} configurations whose accounting differs (planned sigma "
              f"{sigmas}): one trial's RDP is the largest of their curves", flush=True)
    return fit_args, planned, target


def _resume(args: argparse.Namespace, fit_args: list[str]) -> TuningState | None:
    given = [a for a in ("search", "metric", "mode", "trials_mean", "eta", "total_epsilon")
             if getattr(args, a) not in (None, [])]
    if fit_args or given or args.method != "papernot-steinke" or args.distribution is not None:
        raise ConfigError("dpl tune: --resume FOLDER takes no other option (the tuning's options are in its folder)")
    state = TuningState.load(args.resume)
    if state.released:
        print(f"dpl: the tuning in {state.folder} is finished" + ("" if state.best is not None else
                                                                  " (no trial was drawn: nothing was released)"))
        if state.best is not None:
            _say_released(state)
        return None
    print(f"dpl: resuming the tuning in {state.folder}: {len(state.finished)} of {state.trials} trials finished",
          flush=True)
    if not state.plans:  # a tuning started without plans searched only neutral options: one plan covers it
        state.plans = plans.plan_space(state.fit_args, parse_search([f"{k}={','.join(v)}"
                                                                     for k, v in state.search.items()]))
        state.save()
    return state


# ------------------------------------------------------------------------------------------------- running


def _run(state: TuningState) -> int:
    root = Path(state.folder)
    _remove_stale_trials(state)
    for index, config in enumerate(state.configurations):
        if state.result(index) is not None:
            continue
        try:
            code = _trial(state, index, config)
        except DPLError:
            _forget_if_nothing_trained(state, 2)
            raise
        if code:
            _ledger_update(state, status="failed")
            if not _forget_if_nothing_trained(state, code):
                print(f"dpl: dpl tune stopped at trial {index + 1}/{state.trials}; fix the cause and continue with: "
                      f"dpl tune --resume {root}", file=sys.stderr)
            return code
    _release(state)
    return 0


def _forget_if_nothing_trained(state: TuningState, code: int) -> bool:
    """A setup error (exit 2) before any trial started training is bad input, not a tuning to resume: remove the
    tuning folder (K was drawn from OS entropy alone, nothing was released) and say so; return whether it was removed.
    Once a trial has trained, the tuning's line is in the data ledger and its folder is kept (resume it)."""
    if code != 2 or state.finished or state.ledger_line is not None:
        return False
    shutil.rmtree(state.folder, ignore_errors=True)
    return True


def _trial(state: TuningState, index: int, config: dict[str, str]) -> int:
    root = Path(state.folder)
    name = f"trial_{secrets.token_hex(4)}"  # random: the kept run's path says nothing about its index or K
    state.running = {"index": index, "folder": name}
    state.save()
    tag = f"dpl: trial {index + 1}/{state.trials}"
    print(f"{tag}: {short(config)}", flush=True)
    plan = plans.plan_for(state.plans, config)
    probe.EXPECTED = plan  # the trial is refused before training if its accounting is not the planned one
    probe.TUNING = state  # the first trial to train writes the tuning's line in the data ledger
    try:
        run = trials.fit(state.fit_args, config, root / name, [])
        metric, value = trials.score(run, state.metric)
    except trials.TrialFailed as exc:
        return exc.code
    except KeyboardInterrupt:
        _ledger_update(state, status="interrupted")
        raise
    finally:
        probe.EXPECTED = None
        probe.TUNING = None
    report = json.loads((run / "privacy.json").read_text())
    _check_accounting(state, report, plan)
    state.metric = metric
    best = state.result(state.best) if state.best is not None else None
    better = best is None or _better(value, best["score"], state.mode)
    state.finished.append({"index": index, "folder": name, "run": str(run.relative_to(root / name)), "score": value,
                           "report": report})
    loser = None if best is None else (best["folder"] if better else name)
    if better:
        state.best = index
    state.running = None
    state.save()
    if loser is not None:
        shutil.rmtree(root / loser, ignore_errors=True)
    print(f"{tag}: {metric} {value:.4g}" + (" (best so far)" if better else ""), flush=True)
    return 0


def _better(value: float, best: float, mode: str) -> bool:
    if math.isnan(value):
        return False
    if math.isnan(best):
        return True
    return value > best if mode == "max" else value < best


def _check_accounting(state: TuningState, report: dict[str, Any], plan: dict[str, Any]) -> None:
    """Refuse a finished trial the bound does not cover: not tunable, unlike the others beyond sigma, sampling rate
    and steps, or unlike its plan in those."""
    reason = tunable(report, bool(report.get("seeded")))
    if reason is None and report.get("resumed_parts"):
        reason = "a trial must be one fresh run"
    if reason:
        raise ConfigError(f"dpl tune: {reason}")
    if state.finished:
        differ = release.accounting_differences(state.finished[0]["report"], report)
        if differ:
            raise ConfigError(f"dpl tune: trials differ in their privacy accounting ({', '.join(differ)}); the bound "
                              f"covers configurations that differ only in sigma, sampling rate and steps")
    differ = plans.mismatch(plan, report)
    if differ:
        raise ConfigError(f"dpl tune: the trial's accounting is not the one planned for it ({differ}): the bound "
                          f"does not cover it")


def _remove_stale_trials(state: TuningState) -> None:
    """Delete trial folders that are not the best one: an interrupted trial (it runs again from the start), or one
    beaten just before an interruption."""
    keep = {state.result(state.best)["folder"]} if state.best is not None else set()
    for folder in Path(state.folder).glob("trial_*"):
        if folder.is_dir() and folder.name not in keep:
            shutil.rmtree(folder, ignore_errors=True)
    if state.running is not None:
        state.running = None
        state.save()


def _release(state: TuningState) -> None:
    best = state.result(state.best)
    dist = release.distribution(state.distribution)
    privacy = release.tuned_privacy(state.plans, dist, best["report"])
    tuning = {"method": state.method, "theorem": release.THEOREMS[dist.kind], "distribution": dist.describe(),
              "search_space": state.search, "metric": state.metric, "mode": state.mode, "score": best["score"]}
    if len(state.plans) > 1:
        tuning["configurations_planned"] = len(state.plans)
    if state.total_epsilon is not None:
        tuning.update(total_epsilon=state.total_epsilon, epsilon_per_trial_target=state.target_epsilon)
    report = release.tuned_report(best["report"], tuning, privacy)
    release.write_release(_kept(state), report)
    state.released = True
    _ledger_update(state, status="finished")
    state.save()
    _say_released(state)
    loggers = trials.trackers(state.fit_args)  # the trials logged to none: the tuned model is their one run
    trackers.log_release(loggers, report, _kept(state))
    for logger in loggers:
        print(f"dpl: the tuned model logged to {type(logger).__name__} as one run (epsilon={report['epsilon']:.3f})",
              flush=True)


def _ledger_update(state: TuningState, status: str) -> None:
    """Write the tuning's line again with its final ``status``, if a trial has started training. Never per trial, and
    with no count of trials, steps or end time: each would reveal the secret number of trials K."""
    if state.ledger_line is None or state.ledger_root is None:
        return
    state.ledger_line = ledger_line.write(state.ledger_root, state.ledger_line, status=status)
    state.save()


def _kept(state: TuningState) -> Path:
    best = state.result(state.best)
    return Path(state.folder) / best["folder"] / best["run"]


def _say_released(state: TuningState) -> None:
    best = state.result(state.best)
    run = _kept(state)
    report = json.loads((run / "privacy.json").read_text())
    t = report["tuning"]
    print(f"dpl: kept {run} ({t['metric']} {best['score']:.4g}; {short(state.configurations[state.best])})")
    how = (f"the best of {state.trials} trials, composed" if t["theorem"] == "composition" else
           f"{t['method']}, {t['theorem']}: the best of K trials, K ~ {release.law_text(t)}")
    print(f"dpl: tuned model: epsilon={t['epsilon']:.3f} at delta={t['delta']:.3g} ({how}); one trial alone: "
          f"epsilon={t['epsilon_one_trial']:.3f}")
    if t["theorem"] != "composition" and state.plans:
        n = max(1, math.ceil(t["distribution"]["expected_trials"] - 1e-9))
        composed = plans.composed_epsilon(state.plans, n, float(t["delta"]))
        print(f"dpl: for comparison, exactly {n} trial{'s' * (n != 1)} composed would spend epsilon={composed:.3f} "
              f"(--method composition --trials-mean {n})")
    print("dpl: share only the kept run or its export (dpl export); keep the rest of the tuning folder secret",
          flush=True)
