"""The privacy report of a synthetic data set (``privacy.json`` / ``privacy.md`` beside the data): the guarantee it
inherits from the training (post-processing), composed with the DP label histogram's where one was released, the
privacy unit, the run it was sampled from, and what was generated and how.

Only public and DP values go into it: the training report's (ε, δ, σ, q, the events, the unit, the data file's name
and keyed hash), the label counts used (uniform or given proportions, or noisy counts), the sampling settings. The
exact label counts of the private data never appear.
"""

from __future__ import annotations

import json
import math
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from dpl.synthetic.counts import LabelCounts

REPORT_JSON, REPORT_MD = "privacy.json", "privacy.md"

_METHOD_TEXT = {
    "uniform": "uniform over the run's labels (no private information used)",
    "given": "proportions given by the user (--proportions; no private information used)",
    "dp_histogram": "a DP histogram of the training labels (Gaussian noise on the counts), composed with the training",
    None: "no label column",
}


def composed_guarantee(training: dict[str, Any], counts: LabelCounts | None) -> dict[str, Any]:
    """ε and δ of the synthetic data: the training's (post-processing), or the training's events composed with the
    DP histogram's Gaussian mechanism at the sum of their δ's."""
    eps, delta = float(training["epsilon"]), float(training["delta"])
    if counts is None or counts.histogram is None:
        return {"epsilon": eps, "delta": delta, "how": "the training's guarantee (post-processing)"}
    from dpl.core.accounting import events

    histogram = counts.histogram
    total_delta = delta + float(histogram["delta"])
    history = [*events.history_from_json(training.get("events") or []),
               *events.history_from_json([histogram["event"]])]
    summed = eps + float(histogram["epsilon"])
    composed = summed
    if training.get("events") and math.isfinite(eps):
        composed = min(summed, events.epsilon(events.history_event(history), total_delta))
    return {"epsilon": composed, "delta": total_delta, "epsilon_sum": summed,
            "how": "the training's events composed with the label histogram's Gaussian mechanism"}


def build(training: dict[str, Any], source: str, data_file: str, rows: int, columns: list[str], kind: str,
          counts: LabelCounts | None, label_column: str | None, sampling: dict[str, Any],
          empty: int) -> dict[str, Any]:
    """The report (plain JSON values) of a synthetic data set sampled from the run whose privacy report is
    ``training``."""
    run = training.get("run") or {}
    label = None
    if counts is not None:
        label = {"column": label_column, "method": counts.method, "proportions": counts.proportions,
                 "rows": counts.counts, "histogram": counts.histogram}
    return {
        "synthetic_data": {"file": data_file, "rows": rows, "columns": columns, "kind": kind,
                           "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                           "empty_records": empty},
        "source": {"run_id": run.get("id"), "checkpoint": source, "base_model": (training.get("base_model") or {})
                   .get("location"), "training_data": training.get("training_data"),
                   "unit": training.get("unit") or "example", "unit_description": training.get("unit_description"),
                   "adjacency": training.get("adjacency")},
        "training": {k: training.get(k) for k in ("epsilon", "delta", "noise_multiplier", "max_grad_norm",
                                                  "sampling", "sampling_rate", "steps_taken", "mechanism",
                                                  "accountant", "events")},
        "label_counts": label,
        "guarantee": composed_guarantee(training, counts),
        "sampling": sampling,
        "not_protected": ("the schema: the column names and the label (control) values, as the run's report and "
                          "export show them; the number of rows generated, chosen by whoever ran dpl synthesize"),
    }


def _fmt(value: Any) -> str:
    number = float(value)
    return f"{number:.3f}" if math.isfinite(number) else "inf (no guarantee)"


def markdown(report: dict[str, Any]) -> str:
    """``privacy.md``: the report for people."""
    data, source, guarantee = report["synthetic_data"], report["source"], report["guarantee"]
    label, sampling, training = report["label_counts"], report["sampling"], report["training"]
    files = ", ".join(f["path"] for f in (source.get("training_data") or {}).get("files") or []
                      if f.get("split") == "train") or "the training data"
    lines = [f"# Synthetic data: {data['file']}", "",
             f"{data['rows']} {data['kind']} sampled on {data['created']} by `dpl synthesize` from run "
             f"{source['run_id']} ({source['checkpoint']}), a model fine-tuned from `{source['base_model']}` "
             f"with differential privacy on {files}.", "",
             "## Guarantee", "",
             f"epsilon = {_fmt(guarantee['epsilon'])}, delta = {float(guarantee['delta']):.3g}: "
             f"{guarantee['how']}. The privacy unit is {source.get('unit_description') or source['unit']} "
             f"({source['adjacency']} adjacency). Sampling from the trained model is post-processing: it spends no "
             f"privacy, however many records are drawn.", "",
             f"Training: epsilon = {_fmt(training['epsilon'])}, delta = {float(training['delta']):.3g}, "
             f"sigma = {training['noise_multiplier']}, C = {training['max_grad_norm']}, "
             f"{training['steps_taken']} step{'' if training['steps_taken'] == 1 else 's'} "
             f"({training['mechanism']}, {training['accountant']} accountant).", ""]
    if label is not None:
        lines += ["## Label counts", "", f"Column `{label['column']}`: {_METHOD_TEXT[label['method']]}.", "",
                  "| label | proportion | rows |", "|---|---|---|"]
        lines += [f"| {name} | {p:.4f} | {label['rows'].get(name, 0)} |" for name, p in label["proportions"].items()]
        if label["histogram"] is not None:
            h = label["histogram"]
            lines += ["", f"The histogram: every {h['unit']} adds at most 1 (L2) to the counts (sensitivity "
                          f"{h['sensitivity']:.4g}); Gaussian noise of std {h['noise_std']:.4g} on each count "
                          f"(epsilon = {_fmt(h['epsilon'])}, delta = {float(h['delta']):.3g} alone); negative noisy "
                          f"counts count as 0. Noisy counts: "
                          + ", ".join(f"{k} {v:.1f}" for k, v in h["noisy_counts"].items()) + "."]
        lines.append("")
    lines += ["## How it was generated", "",
              f"Columns: {', '.join(data['columns'])}. Each record was sampled after its control prefix (the label "
              f"and other control values) with temperature {sampling['temperature']}, top-p {sampling['top_p']}, "
              f"at most {sampling['max_new_tokens']} new tokens"
              + (f", {sampling['turns']} user/assistant exchange(s) per conversation" if data['kind'] ==
                 "conversations" else "")
              + f", seed {sampling['seed']} (public: sampling protects nothing and needs no secret). "
              f"{data['empty_records']} record(s) stayed empty after {sampling['retries']} resampling(s).", "",
              f"Not protected: {report['not_protected']}.", ""]
    return "\n".join(lines)


def write(report: dict[str, Any], folder: Path) -> None:
    (folder / REPORT_JSON).write_text(json.dumps(report, indent=2, default=str) + "\n")
    (folder / REPORT_MD).write_text(markdown(report))
