"""The privacy report of a run: ``privacy.json`` (machine-readable) and ``privacy.md`` (for people, with a paragraph
to paste into a model card), written into the run's log folder at the start of training, at every checkpoint, at the
end and when the run is interrupted or fails (:class:`PrivacyReport`), and beside exported weights
(:mod:`dpl.trained.export`). :class:`PrivacyReport` also records each run that took a private step in the data ledger
(:mod:`dpl.lightning.data_ledger`).

The privacy values come from :meth:`PrivateEngine.summary <dpl.core.engine.PrivateEngine.summary>` (epsilon, delta,
sigma, C, the sampling, steps, accountant, mechanism, plugins, and the privacy unit's own words); what was trained
from comes from the module and the data module (:mod:`dpl.lightning.provenance`: the base model and the training data
with their content hashes, what one example is); the run has a random public id and its dates. Public values only, never a secret.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.callbacks import Callback

from dpl.lightning import data_ledger
from dpl.lightning.checkpoint import REPORT_KEY, _write_atomic, public_mode
from dpl.lightning.provenance import new_run, run_sources, utc_now

REPORT_JSON = "privacy.json"
REPORT_MD = "privacy.md"
DELTA_FACTORS = (10.0, 1.0, 0.1, 0.01, 0.001)  # the epsilon-delta table: the run's delta times these

#: what the hashes of privacy.md are, and how their owner checks a file against them
HASH_NOTE = ("Hashes: BLAKE2b-256 of each file's bytes. The base model's are plain (`b2sum -l 256 FILE` prints the "
             "same). The training data's (`blake2b-256-keyed`) are keyed with a secret key of the machine that "
             "trained, so they confirm nothing to whoever holds a candidate copy of the data; b2sum prints another "
             "value. Their owner checks a file against this report on that machine (or with its key in "
             "DPL_DATA_KEY): `dpl verify-data FILE RUN_FOLDER`.")


def _plain(value: Any) -> Any:
    """JSON-safe: inf and NaN as strings (JSON has no such numbers)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def accountant_note(summary: dict[str, Any]) -> str:
    """How epsilon was computed, and how exact it is."""
    accountant = summary["accountant"]
    if accountant == "prv":
        return ("PRV accountant (Gopi, Lee & Wutschitz 2021), composed over the steps taken; epsilon is the upper end "
                "of its error interval (width 0.5% of epsilon, at least 0.001); RDP is used instead, with a warning, "
                "where PRV fails")
    if accountant == "rdp":
        return "RDP accountant (Mironov 2017): an upper bound, looser than PRV"
    return f"{accountant}: exact for the released stream"


def _words(report: dict[str, Any]) -> dict[str, Any]:
    """The privacy unit's own words (``unit_text``: :meth:`dpl.core.privacy_unit.PrivacyUnit.wording`); plain ones for
    a report written by an older dpl (an export of its checkpoint)."""
    if report.get("unit_text"):
        return report["unit_text"]
    noun = report.get("unit") or "example"
    return {"noun": noun, "adjacency": f"{report.get('adjacency')} adjacency of one {noun}",
            "poisson_sampling": f"Poisson sampling with rate q = {_fmt(report.get('sampling_rate'), '.4g')}",
            "protects": f"each {noun}", "clipped": f"each {noun}'s gradient", "not_protected": []}


def _has_labels(module: Any) -> bool:
    """Whether the task has a label set (classification does; generation does not)."""
    return getattr(module, "task", None) != "generation"


def _unit_text(report: dict[str, Any]) -> str | None:
    """What one privacy unit is, without repeating the unit's name (``one user: all the rows ...`` -> ``all the
    rows ...``)."""
    text = report.get("unit_description")
    lead = f"one {_words(report)['noun']}: "
    return text[len(lead):] if text and text.lower().startswith(lead) else text


def build_report(module: Any, run: dict[str, Any] | None = None,
                 sources: dict[str, Any] | None = None) -> dict[str, Any]:
    """The report of ``module`` (a :class:`~dpl.lightning.module.DPModule` whose privacy is prepared), for ``run``
    (:func:`new_run`; default: a new one) trained from ``sources`` (:func:`run_sources`; default: computed now)."""
    engine = module.engine
    delta = engine.summary()["delta"]
    deltas = tuple(delta * f for f in DELTA_FACTORS if delta * f < 1) if delta else ()
    summary = engine.summary(deltas)
    words = summary["unit_text"]
    run = dict(run if run is not None else new_run())
    run["updated"] = utc_now()
    report = {
        "guarantee": f"(epsilon, delta)-DP with respect to {words['adjacency']} ({words['noun']}-level), for the "
                     "model's weights and everything computed from them",
        "run": run,
        **(sources if sources is not None else run_sources(module)),
        **{k: v for k, v in summary.items() if k != "epsilon_at_delta"},
        "epsilon_delta_table": [{"delta": d, "epsilon": e} for d, e in summary["epsilon_at_delta"].items()],
        "accountant_note": accountant_note(summary),
        "not_protected": ["the pretrained model and tokenizer", "the validation and test sets",
                          *(["the label set"] if _has_labels(module) else []), "the number of training examples",
                          *words["not_protected"], "hyperparameters tuned on the private data",
                          "the training data's file names and sizes (its content hashes are keyed with a secret key "
                          "of the machine that trained: they confirm nothing to whoever holds a candidate copy)"],
    }
    if summary["sampling"] != "poisson" and summary["steps_per_epoch"]:
        report["epochs_planned"] = summary["steps_planned"] / summary["steps_per_epoch"]
    report["model_card"] = model_card_paragraph(report)
    return _plain(report)


def _fmt(value: Any, spec: str = ".3f") -> str:
    return format(value, spec) if isinstance(value, (int, float)) and not isinstance(value, bool) else str(value)


def _sampling_text(report: dict[str, Any]) -> str:
    if report["sampling"] == "poisson":
        return _words(report)["poisson_sampling"]
    if report["sampling"] == "cyclic_poisson":
        return (f"Poisson sampling with rate q = {_fmt(report['sampling_rate'], '.4g')} within one secret partition "
                f"of the data per step (expected batch size {report['batch_size']})")
    epochs = report.get("epochs_planned")
    return (f"fixed-size batches of {report['batch_size']} from one secret shuffled order"
            + (f", {_fmt(epochs, '.3g')} epochs" if epochs is not None else ""))


def model_card_paragraph(report: dict[str, Any]) -> str:
    """A paragraph to paste into a model card."""
    plugins = ", ".join(report["plugins"]) or "none"
    words = _words(report)
    noun = words["noun"]
    base = (report.get("base_model") or {}).get("location")
    example = _unit_text(report)
    labels = ", the label set" if "the label set" in report.get("not_protected", ["the label set"]) else ""
    return (f"This model was fine-tuned{f' from {base}' if base else ''} with differential privacy using dpl "
            f"{report['dpl_version']}. It satisfies "
            f"({_fmt(report['epsilon'], '.2f')}, {_fmt(report['delta'], '.2g')})-differential privacy with respect "
            f"to {words['adjacency']}: it protects {words['protects']}, for its weights and everything computed "
            f"from them. {f'One {noun} is {example}. ' if example else ''}Training ran "
            f"{report['steps_taken']} private step{'' if report['steps_taken'] == 1 else 's'} "
            f"(mechanism {report['mechanism']}; plugins: {plugins}) with {_sampling_text(report)}, {words['clipped']} "
            f"clipped to norm {_fmt(report['max_grad_norm'], 'g')} and Gaussian noise of multiplier "
            f"{_fmt(report['noise_multiplier'], '.4g')}; epsilon was computed with the {report['accountant']} "
            f"accountant. The guarantee does not cover the pretrained model, the validation data{labels}, the "
            f"number of training examples, or hyperparameters tuned on the private data.")


def _hash_text(described: dict[str, Any] | None) -> str:
    """A described model or data set in one cell: its files with size and hash, or its generator."""
    if not described:
        return "not stated"
    if described.get("generator"):
        return (f"generated by {described['generator']} with {json.dumps(described['settings'])}; id "
                f"`{described['id']}` (the hash of {described['hashed']})")
    kind = "keyed hash" if str(described.get("id") or "").startswith("blake2b-256-keyed:") else "hash"
    files = "; ".join(f"{f.get('split') + ': ' if f.get('split') else ''}`{f['path']}` ({f['bytes']:,} bytes, "
                      f"{kind} `{f['hash']}`)" for f in described.get("files") or [])
    return files or f"not hashed ({described.get('hashed')})"


def _provenance_rows(report: dict[str, Any]) -> list[tuple[str, str]]:
    """Who trained what from what: the run, its dates, the base model, the training data, one unit."""
    run = report.get("run")
    if not run:
        return []
    continues = run.get("continues")
    base = report.get("base_model") or {}
    return [("run id", f"`{run['id']}` ({run['status']})"
             + (f", continuing run `{continues['run_id']}` from step {continues['steps']}" if continues else "")),
            ("started / ended (UTC)", f"{run['started']} / {run.get('ended') or 'not yet'} (report of "
                                      f"{run.get('updated')})"),
            ("base model", f"`{base.get('location')}`: {_hash_text(base)}" if base else "not stated"),
            ("training data", _hash_text(report.get("training_data"))),
            (f"one {_words(report)['noun']} is", _unit_text(report) or "not stated")]


def report_markdown(report: dict[str, Any]) -> str:
    rows = [*_provenance_rows(report),
            ("epsilon spent", f"{_fmt(report['epsilon'])} at delta = {_fmt(report['delta'], '.3g')}"),
            ("epsilon planned", _fmt(report["epsilon_planned"])),
            ("steps taken / planned", f"{report['steps_taken']} / {report['steps_planned']}"),
            ("noise multiplier sigma", _fmt(report["noise_multiplier"], ".4g")),
            ("clipping norm C", _fmt(report["max_grad_norm"], "g")),
            ("sampling", _sampling_text(report)),
            ("protects", _words(report)["protects"]),
            ("training examples N", str(report["num_examples"])),
            ("mechanism", str(report["mechanism"])),
            ("plugins", json.dumps(report["plugins"]) if report["plugins"] else "none (defaults: clip, gaussian)"),
            ("accountant", report["accountant_note"]),
            ("adjacency", f"{report['adjacency']}: {_words(report)['adjacency']}"),
            ("dpl version", str(report["dpl_version"]))]
    lines = ["# Privacy report", "", report["guarantee"] + ".", "", "| | |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in rows]
    if report.get("run"):
        lines += ["", HASH_NOTE]
    users = report.get("users")
    if users:
        lines += ["", "## Users", "", "| | |", "|---|---|",
                  f"| users | {users['users']} ({report['num_examples']} rows) |",
                  f"| rows of a user used at most, k | {users['max_rows_per_user']} |",
                  f"| sampling | {users['sampling']} |"]
        if report.get("epsilon_per_row") is not None:
            lines += [f"| epsilon per row, for reference | {_fmt(report['epsilon_per_row'])} |"]
        if report.get("epsilon_group_privacy") is not None:
            lines += [f"| per-row guarantee converted by group privacy | epsilon {_fmt(report['epsilon_group_privacy'])}"
                      f" at delta {_fmt(report['delta_group_privacy'], '.3g')} (loose) |"]
    lines += ["", "## Epsilon at other deltas", "", "| delta | epsilon |", "|---|---|"]
    lines += [f"| {_fmt(r['delta'], '.3g')} | {_fmt(r['epsilon'])} |" for r in report["epsilon_delta_table"]]
    lines += ["", "## For the model card", "", report["model_card"], "",
              "Not protected: " + ", ".join(report["not_protected"]) + ".", ""]
    return "\n".join(lines)


def write_report(report: dict[str, Any], folder: str | Path) -> Path:
    """Write ``privacy.json`` and ``privacy.md`` into ``folder`` (atomically); return the JSON file's path."""
    folder = Path(folder)
    path = folder / REPORT_JSON
    _write_atomic((json.dumps(report, indent=2) + "\n").encode(), path, public_mode())
    _write_atomic(report_markdown(report).encode(), folder / REPORT_MD, public_mode())
    return path


class PrivacyReport(Callback):
    """Keeps ``privacy.json`` / ``privacy.md`` in the run's log folder current: written when training starts, at
    every checkpoint (whose report also goes into the checkpoint, under :data:`REPORT_KEY`, for ``dpl export``), when
    it ends and when it is interrupted or fails. Epsilon after the first and after the last step is also logged
    (``metrics.csv``) when Lightning's ``log_every_n_steps`` skips those rows.

    A run that took at least one private step is recorded in the data ledger of ``trainer.default_root_dir``
    (:mod:`dpl.lightning.data_ledger`) when it ends, and when it is interrupted (Ctrl+C, SIGTERM) or fails - then
    before the command removes a run folder without checkpoint, with one line on stderr saying the epsilon spent.

    Args:
        ledger: record the run in the data ledger.
    """

    def __init__(self, ledger: bool = True) -> None:
        self.ledger = ledger
        self.run: dict[str, Any] | None = None
        self._sources: dict[str, Any] | None = None
        self._start_steps: int | None = None  # steps done when training started (a resume: the checkpoint's)
        self._recorded = False
        self._report: dict[str, Any] | None = None  # the last report written
        self._folder: str | None = None  # the run's log folder ("": none), read once: ``trainer.log_dir`` is collective

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit":
            self.run, self._sources, self._start_steps, self._recorded = new_run(), None, None, False
            self._checkpoint_steps: int | None = None
            self._folder = None

    def on_load_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        earlier = checkpoint.get(REPORT_KEY) or {}
        if self.run is not None and (earlier.get("run") or {}).get("id"):
            self.run["continues"] = {"run_id": earlier["run"]["id"], "steps": int(earlier.get("steps_taken") or 0)}

    def _write(self, trainer: Any, module: Any) -> dict[str, Any] | None:
        if not module.engine.configured:
            return None
        if self.run is None:
            self.run = new_run()
        if self._sources is None:
            self._sources = run_sources(module)
        report = build_report(module, self.run, self._sources)
        folder = self._folder if self._folder is not None else trainer.log_dir
        if trainer.is_global_zero and folder:
            write_report(report, folder)
        return report

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._flushed_at: int | None = None
        self._start_steps = pl_module.engine.steps_done
        self._folder = trainer.log_dir or ""  # every rank (a broadcast); later hooks may run on one rank only (errors)
        self._write(trainer, pl_module)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        """Epsilon after the first step goes into ``metrics.csv`` whatever ``trainer.log_every_n_steps``."""
        steps = pl_module.engine.steps_done
        every = trainer.log_every_n_steps
        if every > 0 and (trainer.global_step % every == 0 or trainer.should_stop):  # Lightning writes this row
            self._flushed_at = steps
        elif steps == 1 and pl_module.engine.configured:
            self._log_epsilon(trainer, pl_module)

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        self._checkpoint_steps = getattr(getattr(pl_module, "engine", None), "steps_done", 0)  # the steps the newest checkpoint holds
        report = self._write(trainer, pl_module)
        if report is not None:
            checkpoint[REPORT_KEY] = report

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if not pl_module.engine.configured:
            return
        if getattr(self, "_flushed_at", None) != pl_module.engine.steps_done:  # the last step's epsilon, unless written
            self._log_epsilon(trainer, pl_module)
        self._end(trainer, pl_module, "finished")

    @staticmethod
    def _log_epsilon(trainer: Any, pl_module: Any) -> None:
        """Epsilon spent so far into the loggers, at the step taken (1-based, as the rows Lightning writes)."""
        # float32, as the values the module logs every step (Lightning logs tensors), so that the column stays monotone
        steps = pl_module.engine.steps_done
        epsilon = float(torch.tensor(pl_module.engine.epsilon(steps), dtype=torch.float32))
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics({"epsilon": epsilon}, step=steps)
                logger.save()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        """Ctrl+C, SIGTERM or an error: the report says so, and the steps taken are recorded in the ledger."""
        from lightning.pytorch.utilities.exceptions import SIGTERMException

        if not pl_module.engine.configured or self._start_steps is None or self._recorded:
            return
        status = "interrupted" if isinstance(exception, (KeyboardInterrupt, SIGTERMException)) else "failed"
        try:
            path = self._end(trainer, pl_module, status)
        except Exception as exc:  # noqa: BLE001 - the run's own exception is the one to raise
            print(f"dpl: warning: the {status} run could not be recorded in the privacy ledger ({exc})",
                  file=sys.stderr, flush=True)
            return
        if path is not None and self._report is not None:
            print(data_ledger.stop_line(self._report, status, path) + self._checkpoint_note(trainer), file=sys.stderr,
                  flush=True)

    def _checkpoint_note(self, trainer: Any) -> str:
        """Where a stopped run can resume from: its newest checkpoint and the steps it holds ("" without one)."""
        callback = getattr(trainer, "checkpoint_callback", None)
        last = getattr(callback, "last_model_path", "") or getattr(callback, "best_model_path", "")
        steps = getattr(self, "_checkpoint_steps", None)
        if not last or steps is None or not Path(last).is_file():
            return ""
        return f"; its last checkpoint, {last}, holds step {steps} (--ckpt_path resumes from it)"

    def _end(self, trainer: Any, pl_module: Any, status: str) -> Path | None:
        """Write the final report with ``status``; record the run in the ledger; return the ledger's path (``None``:
        not recorded: no private step taken, ledger off, or another rank)."""
        if self.run is None:
            self.run = new_run()
        self.run.update(status=status, ended=utc_now())
        self._report = self._write(trainer, pl_module)
        steps = pl_module.engine.steps_done - (self._start_steps or 0)
        if self._report is None or not self.ledger or steps < 1 or self._recorded or not trainer.is_global_zero:
            return None
        self._recorded = True
        return data_ledger.record(self._report, trainer.default_root_dir, run_folder=self._folder or None,
                                  steps_this_run=steps)


def fit_summary_line(engine: Any, metrics: dict[str, float], steps_before: int = 0) -> str:
    """The one line that ends a fit: the private steps this fit took (``steps_before``: the steps a resume started
    from), the privacy spent in all, sigma, C and the validation ``metrics``."""
    done, cfg, mechanism = engine.steps_done, engine.privacy, engine.mechanism
    taken = done - steps_before
    if steps_before and taken == 0:
        head = f"dpl: took no private step (resumed at step {done}: the trainer's max_steps / max_epochs were reached)"
    else:
        head = f"dpl: trained {done} private step{'' if done == 1 else 's'}"
        head += f" ({taken} after resuming at step {steps_before})" if steps_before else ""
    shown = ", ".join(f"{k}={v:.4f}" for k, v in sorted(metrics.items()))
    return (f"{head}; privacy spent (epsilon={engine.epsilon():.3f}, delta={engine.plan.delta:.3g}, "
            f"{mechanism.adjacency} adjacency{' of one user' if engine.unit.per_user else ''}); "
            f"sigma={engine.noise_multiplier:.4f}, C={cfg.max_grad_norm:g}" + (f"; {shown}" if shown else ""))
