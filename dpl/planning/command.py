"""``dpl plan --config ...``: what a ``dpl fit`` config will do to privacy and noise, from the config alone.

The config is parsed by ``dpl fit``'s own parser (the same files, overrides and one-line errors), the model and data
classes are instantiated, N is counted without tokenizing, the model is built without its weights
(:mod:`~dpl.planning.skeleton`), and the privacy engine is set up by the very call ``dpl fit`` makes before training
(:meth:`~dpl.lightning.module.DPModule.prepare_privacy`: plugins, mechanism, calibration, budget). So sigma is the one
``dpl fit`` would train with. Printed: N, B, q, steps, epochs, (epsilon, delta), the mechanism, d, sigma, the
noise-batch ratio sigma / B and the noise on the mean update against the clipped signal
(:mod:`dpl.core.regime`), the memory per-example clipping holds in each ``privacy.clipping_memory`` mode
(:mod:`~dpl.planning.memory`), then the alternatives at the same epsilon and compute
(:mod:`~dpl.planning.alternatives`).
A config that needs no model code (the quickstart's kind) is planned by :mod:`~dpl.planning.quick` first, without
importing torch or Lightning; the report is the same.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sys
import warnings
from collections.abc import Iterator
from functools import partial
from typing import Any

from dpl.core.regime import HOPELESS, QUIET, hopeless_evidence
from dpl.planning.alternatives import PlanReport, finish_report, row_of
from dpl.planning.memory import MemoryPlan, memory_lines, plan_memory, shape_of

USAGE = "usage: dpl plan --config CONFIG [--config CONFIG ...] [--KEY VALUE ...]"
HELP = (f"{USAGE}\n\n"
        "The privacy plan of a dpl fit config, without training: N, B, q, steps, (epsilon, delta), sigma as\n"
        "dpl fit calibrates it, the noise-batch ratio sigma/B and the noise on the mean update sigma C sqrt(d)/B\n"
        "against the clipped signal (<= C), the memory per-example clipping holds in each clipping_memory mode,\n"
        "and the batch sizes at the same epsilon and compute (B x steps).\n"
        "Takes the configs and options of dpl fit (dpl fit --help); loads no weights, and dpl's data modules\n"
        "tokenize no data for it.\n"
        "See docs/planning.md.")


def plan_command(argv: list[str]) -> int:
    """``dpl plan``: print the plan of the config given as ``dpl fit`` takes it."""
    if argv[:1] in (["-h"], ["--help"]):
        print(HELP)
        return 0
    if not argv:
        print(f"dpl: error: dpl plan needs a config ({USAGE[7:]}), e.g. dpl plan --config configs/quickstart.yaml",
              file=sys.stderr)
        return 2
    from dpl.errors import dpl_error_in
    from dpl.messages import quiet
    from dpl.planning.quick import quick_plan

    try:
        report = quick_plan(argv)
        if report is None:  # the config needs dpl fit's parser and classes
            quiet()  # the warnings dpl fit silences
            report = plan_config(argv)
    except Exception as exc:
        error = dpl_error_in(exc)
        if error is None or os.environ.get("DPL_DEBUG"):
            raise
        print(f"dpl: error: {error}", file=sys.stderr)
        return 2
    print(format_report(report))
    return 0


def plan_config(argv: list[str]) -> PlanReport:
    """The :class:`PlanReport` of the config and options ``argv`` (as ``dpl fit`` takes them)."""
    from dpl.cli_lightning import DPLightningCLI
    from dpl.lightning.data import DPDataModule
    from dpl.lightning.module import DPModule

    class PlanCLI(DPLightningCLI):
        """``dpl fit``'s parser and classes; instead of fitting, the plan (a bare trainer: no logger, callbacks or
        run folder)."""

        report: PlanReport

        def _set_seed(self) -> None:  # nothing random is drawn
            pass

        def instantiate_trainer(self, **kwargs: Any) -> Any:
            from lightning.pytorch import Trainer

            bare = {"logger": False, "callbacks": [], "enable_checkpointing": False, "enable_progress_bar": False,
                    "enable_model_summary": False}
            return Trainer(**self.trainer_config(**{**kwargs, **bare}))

        def _run_subcommand(self, subcommand: str) -> None:
            self.report = make_report(self.model, self.datamodule, self.trainer, self._check_val_check_interval)

    with _lightning_quiet(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"LightningCLI's args parameter")  # dpl plan passes fit's args
        cli = PlanCLI(DPModule, DPDataModule, subclass_mode_model=True, subclass_mode_data=True,
                      save_config_callback=None, args=["fit", *argv], auto_configure_optimizers=False)
    report = cli.report
    report.configs = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a in ("--config", "-c")]
    return report


@contextlib.contextmanager
def _lightning_quiet() -> Iterator[None]:
    """Lightning's start lines (accelerators available, ...) say nothing about a plan."""
    loggers = [logging.getLogger(name) for name in ("lightning.pytorch", "lightning.fabric")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def make_report(module: Any, datamodule: Any, trainer: Any, check: Any = None) -> PlanReport:
    """Count N, build the model without weights, set the engine up as ``dpl fit`` does (``check``: the CLI's own
    checks of the trainer against the plan), then plan the alternatives."""
    from dpl.planning.skeleton import build_without_weights

    num_rows = datamodule.count_train_examples()
    build_without_weights(module, datamodule)
    module.prepare_privacy(num_rows, trainer)
    if check is not None:
        check()
    engine = module.engine
    plan, mechanism, cfg = engine.plan, engine.mechanism, module.privacy
    current = row_of(engine, current=True)
    target = cfg.target_epsilon if cfg.noise_multiplier is None else current.epsilon
    trainable = module.trainable
    report = PlanReport(
        configs=[], rows_in_data=num_rows, population=plan.population, num_units=plan.num_units, unit=plan.unit,
        data_text=engine.unit.data_text(), sampled_noun=engine.unit.sampled_noun,
        user_sampling=engine.unit.setup_fields()["user_sampling"], max_rows_per_user=engine.unit.max_rows,
        sampling_rate=float(mechanism.sample_rate),
        sampling=str(mechanism.sampling), steps_per_epoch=plan.steps_per_epoch, target_epsilon=float(target),
        delta=plan.delta, mechanism=mechanism.name, accounting=str(mechanism.accounting),
        adjacency=mechanism.adjacency, max_grad_norm=float(cfg.max_grad_norm), current=current,
        trainable=sum(p.numel() for p in trainable.values()), estimator=_estimator(engine), lora=_lora(module),
        task_kind=engine.task_kind)
    if report.estimator is None:
        report.memory = _memory(module, datamodule, trainer)
    report.clipping = _clipping(engine, cfg)
    return finish_report(report, engine, partial(_replan, module, trainer, float(target)))


def _clipping(engine: Any, cfg: Any) -> str | None:
    """``privacy.clipping: per_layer``: the groups and thresholds the default estimator set up, and under adaptive
    thresholds the split of the step's privacy (the mechanism's scope)."""
    if cfg.clipping == "flat":
        return None
    clip = dict(engine.plugin_manager.list_name_plugin()).get("clip")
    groups = len(clip.groups) if clip is not None and clip.groups is not None else 0
    thresholds = clip.thresholds if clip is not None else []
    shown = (f"C_g from {min(thresholds):.3g} to {max(thresholds):.3g}, sum of squares C^2" if thresholds else "")
    adaptive = engine.mechanism.scope.get("clipping")
    kind = adaptive if adaptive else f"per_layer fixed over {groups} groups (sigma and epsilon: flat clipping's)"
    return f"{kind}; {shown}; one backward pass, no book" if shown else kind


def _replan(module: Any, trainer: Any, epsilon: float, batch_size: int, steps: int) -> Any:
    """A new engine for ``batch_size`` and ``steps``, calibrated to ``epsilon``, set up as ``dpl fit`` sets one up."""
    from dpl.core.engine import PrivateEngine
    from dpl.lightning.strategy import dp_strategy

    base = module.engine
    privacy = dataclasses.replace(module.privacy, batch_size=batch_size, target_epsilon=epsilon, noise_multiplier=None)
    engine = PrivateEngine(privacy, base.plugin_options)
    with warnings.catch_warnings():  # the run's own warnings (delta, seed) were shown once already
        warnings.simplefilter("ignore")
        engine.setup(module.model, trainable=module.trainable, num_rows=base.plan.num_rows, steps=steps,
                     optimizer_factory=module.optimizer_factory, world_size=trainer.world_size,
                     sharded=dp_strategy(trainer).shards_parameters, users=base.unit.users)
    return engine


def _memory(module: Any, datamodule: Any, trainer: Any) -> MemoryPlan:
    """The memory block of the model without weights: its clipper's layers, last first (the backward pass's order,
    up to the order within a block)."""
    from dpl.core.per_example import PerExampleClipper

    cfg = module.privacy
    clipper = PerExampleClipper(module.model, memory=cfg.clipping_memory, budget_mib=cfg.clipping_memory_budget)
    try:
        layers = [shape_of(rec) for rec in reversed(clipper.records)]
    finally:
        clipper.remove()
    tokens = getattr(datamodule, "max_length", None)
    return plan_memory(layers, physical_batch_size=cfg.physical_batch_size, tokens=tokens, mode=cfg.clipping_memory,
                       budget_mib=cfg.clipping_memory_budget, precision=str(trainer.precision),
                       batch_memory_mib=cfg.physical_batch_memory, batch_size=cfg.batch_size,
                       checkpointing=bool(getattr(getattr(module, "finetuning", None), "gradient_checkpointing", False)))


def _estimator(engine: Any) -> str | None:
    """The plugin whose ``estimate_gradient`` replaces the default, if any."""
    from dpl.core.plugin_manager import active_plugin_names, implemented_hooks

    if engine.release_dimension is not None:
        return None
    pm = engine.plugin_manager
    return next((name for name in active_plugin_names(pm) if "estimate_gradient" in implemented_hooks(
        pm.get_plugin(name))), "a plugin")


def _lora(module: Any) -> tuple[int, int, int] | None:
    """``(rank, LoRA's trainable parameters, the other trainable parameters)`` when the module trains LoRA."""
    finetuning = getattr(module, "finetuning", None)
    if getattr(finetuning, "method", None) != "lora":
        return None
    trainable = module.trainable
    in_lora = sum(p.numel() for n, p in trainable.items() if "lora_" in n)
    if not in_lora:
        return None
    return int(finetuning.lora.r), in_lora, sum(p.numel() for p in trainable.values()) - in_lora


# ------------------------------------------------------------------------------------------------- printing


def format_report(report: PlanReport) -> str:
    """The plan as text: the run, its noise regime, the alternatives and the recommendation."""
    r, cur = report, report.current
    source = f" ({', '.join(r.configs)})" if r.configs else ""
    lines = [f"dpl plan{source}"]
    lines.append(f"  data     {r.data_text}; B = {cur.batch_size:,} expected per step (q = {r.sampling_rate:.4g}, {r.sampling} "
                 f"sampling); {cur.steps:,} steps = {cur.epochs:.3g} epoch{'' if cur.epochs == 1 else 's'}")
    lines.append(f"  privacy  epsilon = {cur.epsilon:.3f} (target {r.target_epsilon:g}), delta = {r.delta:.3g}, "
                 f"{r.adjacency} adjacency of one {r.unit}; mechanism {r.mechanism}, {r.accounting}")
    lora = f" ({r.lora[1]:,} in LoRA r {r.lora[0]})" if r.lora else ""
    lines.append(f"  model    d = {r.trainable:,} trainable parameters{lora}")
    lines.append("  noise    " + _noise_line(r))
    lines.append("  regime   " + _regime_line(r))
    if r.clipping is not None:
        lines.append(f"  clipping {r.clipping}")
    if r.memory is None:
        lines.append(f"  memory   not predicted: the gradient estimate is {r.estimator}'s own, not per-example "
                     "clipping")
    else:
        block = memory_lines(r.memory)
        lines += ["  memory   " + block[0], *("           " + line for line in block[1:])]
    if len(r.rows) > 1 or r.recommended is not None:
        lines += ["", f"alternatives at epsilon = {r.target_epsilon:g} and the same compute (B x steps = "
                      f"{cur.batch_size * cur.steps:,} {r.sampled_noun}):", _table(r)]
    lines += [f"  not planned: {line}" for line in r.refused]
    mark = "recommended (*)" if r.recommended is not None else "recommended"
    lines.append(f"  {mark}: {r.why}")
    return "\n".join(lines)


def _noise_line(r: PlanReport) -> str:
    cur = r.current
    if cur.noise_multiplier == 0:
        return "sigma = 0: no noise (not private)"
    text = f"sigma = {cur.noise_multiplier:.4f}, C = {r.max_grad_norm:g}"
    if cur.noise_scale != 1.0:
        text += (f"; per step sigma x {cur.noise_scale:.3g} ({r.mechanism}'s sensitivity) = "
                 f"{cur.step_noise_multiplier:.4f} (the first step; later steps' at least as large)")
    text += f"\n           noise-batch ratio sigma/B = {cur.step_noise_multiplier / cur.batch_size:.3g}"
    if cur.regime is None:
        return text + f"; the gradient estimate is {r.estimator}'s own: its noise is not on d coordinates"
    return text + (f"; noise on the mean update sigma C sqrt(d)/B = {cur.regime.noise_norm:.3g} against a clipped "
                   f"signal of norm <= C = {r.max_grad_norm:g}")


def _regime_line(r: PlanReport) -> str:
    regime = r.current.regime
    if regime is None:
        return "not assessed (docs/planning.md)"
    x = regime.relative_noise
    if regime.quiet:
        return f"{x:.3g} x the largest clipped signal: at most {QUIET:g}, where the project's runs learned (docs/planning.md)"
    if not regime.hopeless:
        return (f"{x:.3g} x the largest clipped signal: between {QUIET:g} and {HOPELESS:g}, where the project's "
                "classification runs learned, less the noisier (docs/planning.md)")
    return f"{x:.3g} x the largest clipped signal: {hopeless_evidence(r.task_kind)} (dpl fit warns; docs/planning.md)"


def _table(r: PlanReport) -> str:
    header = ("B", "steps", "epochs", "sigma", "epsilon", "sigma/B", "noise norm")
    rows = [header]
    for row in r.rows:
        sigma = row.step_noise_multiplier
        norm = f"{row.regime.noise_norm:.3g}" if row.regime is not None else "-"
        rows.append((f"{row.batch_size:,}", f"{row.steps:,}", f"{row.epochs:.3g}", f"{sigma:.4f}",
                     f"{row.epsilon:.3f}", f"{sigma / row.batch_size:.2e}", norm))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    out = []
    for i, row in enumerate(rows):
        item = r.rows[i - 1] if i else None
        mark = "*" if item is not None and item is r.recommended else " "
        note = "  (current)" if item is not None and item.current else ""
        out.append(f"  {mark} " + "  ".join(cell.rjust(w) for cell, w in zip(row, widths)) + note)
    return "\n".join(out)

