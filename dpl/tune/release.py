"""The privacy of the tuned model and its report: the epsilon of the whole search (Papernot & Steinke, Theorem 2 or 6)
from one trial's RDP curve, written into the kept run's ``privacy.json`` / ``privacy.md`` and into the report its
checkpoints carry (which ``dpl export`` writes beside the exported weights).

The report keeps its shape: ``epsilon`` and the epsilon-delta table become the tuned release's; a ``tuning`` section
says how (method, distribution, expected number of trials, search space, metric, one trial's epsilon). The number of
trials drawn, the other trials and their scores are secret and appear nowhere in it.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import torch

from dpl.core.accounting import tuning as accounting
from dpl.core.accounting.rdp import _rdp_to_epsilon
from dpl.lightning.checkpoint import _write_atomic, load_checkpoint_file
from dpl.lightning.report import REPORT_KEY, REPORT_MD, _fmt, report_markdown, write_report

#: what must be equal in every trial's report for one RDP curve to cover them all
ACCOUNTING_KEYS = ("mechanism", "sampling", "accountant", "adjacency", "unit", "noise_multiplier", "sampling_rate",
                   "steps_planned", "delta", "num_examples")
THEOREMS = {"poisson": "Theorem 6", "negative_binomial": "Theorem 2", "fixed": "composition"}
PAPER = 'Papernot & Steinke, "Hyperparameter tuning with Rényi differential privacy" (ICLR 2022)'


def distribution(fields: dict[str, Any]) -> accounting.TrialDistribution:
    return accounting.TrialDistribution(**fields)


def accounting_differences(first: dict[str, Any], other: dict[str, Any]) -> list[str]:
    """The accounting fields in which two trials' reports differ."""
    return [key for key in ACCOUNTING_KEYS if first.get(key) != other.get(key)]


def trial_curve(report: dict[str, Any]) -> Any:
    """One trial's RDP curve at :data:`~dpl.core.accounting.tuning.ORDERS`: its planned steps (or more, if it took
    more) of the Poisson-subsampled Gaussian with its sigma and rate."""
    steps = max(int(report["steps_planned"]), int(report["steps_taken"]))
    return accounting.subsampled_gaussian_rdp([(float(report["noise_multiplier"]), float(report["sampling_rate"]),
                                                steps)])


def tuned_privacy(report: dict[str, Any], dist: accounting.TrialDistribution) -> dict[str, Any]:
    """The tuned release's epsilon at the trial's delta and at the deltas of its table, and one trial's RDP epsilon.
    A fixed number of trials is their composition by the trial's own accountant (PRV: tighter than RDP)."""
    curve = trial_curve(report)
    delta = float(report["delta"])
    deltas = [float(row["delta"]) for row in report.get("epsilon_delta_table", [])]

    def epsilon(d: float) -> float:
        if dist.kind == "fixed":
            return composed_epsilon(report, dist.trials, d)
        return accounting.tuned_epsilon(dist, accounting.ORDERS, curve, d)

    return {"epsilon": epsilon(delta), "table": [{"delta": d, "epsilon": epsilon(d)} for d in deltas],
            "epsilon_one_trial_rdp": _rdp_to_epsilon(accounting.ORDERS, curve, delta)}


def composed_epsilon(report: dict[str, Any], trials: int, delta: float) -> float:
    """Epsilon of ``trials`` runs like the trial of ``report``, composed (the steps of all of them, one accountant)."""
    from dpl.core.accounting import epsilon_for

    steps = max(int(report["steps_planned"]), int(report["steps_taken"]))
    return epsilon_for(float(report["noise_multiplier"]), float(report["sampling_rate"]), trials * steps, delta,
                       method=report["accountant"])


def tuned_report(trial_report: dict[str, Any], tuning: dict[str, Any], privacy: dict[str, Any]) -> dict[str, Any]:
    """The kept trial's report, made the tuned model's: its epsilon (and table) are the whole search's, the guarantee
    and the model card say so, and ``tuning`` describes the search."""
    from dpl.lightning.report import model_card_paragraph

    report = json.loads(json.dumps(trial_report))
    report["epsilon"] = report["epsilon_planned"] = privacy["epsilon"]
    report["epsilon_delta_table"] = privacy["table"]
    report["guarantee"] = report["guarantee"] + (", including the choice of its hyperparameters among a secret, random "
                                                 "number of private trainings (dpl tune)")
    report["not_protected"] = [item for item in report.get("not_protected", [])
                               if item != "hyperparameters tuned on the private data"]
    report["tuning"] = {**tuning, "epsilon": privacy["epsilon"], "delta": report["delta"],
                        "epsilon_one_trial": trial_report["epsilon"],
                        "epsilon_one_trial_rdp": privacy["epsilon_one_trial_rdp"]}
    report["model_card"] = f"{_without_tuning_caveat(model_card_paragraph(report))} {tuning_sentence(report)}"
    return report


def _without_tuning_caveat(card: str) -> str:
    """The model card without "..., or hyperparameters tuned on the private data." (the tuning is covered now)."""
    caveat = ", or hyperparameters tuned on the private data."
    if caveat not in card:
        return card
    head = card[:card.index(caveat)]
    cut = head.rfind(", ")
    return (head[:cut] + ", or " + head[cut + 2:] if cut >= 0 else head) + "."


def tuning_sentence(report: dict[str, Any]) -> str:
    """The model card's sentence on the tuning."""
    t = report["tuning"]
    how = "a fixed number" if t["distribution"]["distribution"] == "fixed" else "a random number"
    return (f"Its hyperparameters were chosen by private tuning: the best, by {t['metric']} on the validation set "
            f"(treated as public), of {how} of independent private trainings ({law_text(t)}) with "
            f"configurations drawn uniformly from {space_text(t['search_space'])}; the epsilon above covers the whole "
            f"search ({PAPER}, {t['theorem']}), where one training alone spent epsilon "
            f"{_fmt(t['epsilon_one_trial'], '.2f')}.")


def tuning_markdown(report: dict[str, Any]) -> str:
    """The ``## Tuning`` section of privacy.md."""
    t = report["tuning"]
    rows = [("method", f"{t['method']} ({PAPER}, {t['theorem']})"),
            ("number of trials K", law_text(t) + ("" if t["distribution"]["distribution"] == "fixed" else
                                              "; K itself is secret")),
            ("search space", space_text(t["search_space"])),
            ("score", f"{t['metric']} ({t['mode']}) on the validation set, treated as public: "
                      f"{_fmt(t['score'], '.4g')} for this model"),
            ("epsilon of the tuned model", f"{_fmt(t['epsilon'])} at delta = {_fmt(t['delta'], '.3g')} "
                                           f"({'composition' if t['theorem'] == 'composition' else 'RDP'})"),
            ("epsilon of one trial", f"{_fmt(t['epsilon_one_trial'])} ({report['accountant']}); "
                                     f"{_fmt(t['epsilon_one_trial_rdp'])} by RDP")]
    secret = "" if t["distribution"]["distribution"] == "fixed" else "the number of trials, "
    lines = ["## Tuning", "", "| | |", "|---|---|", *[f"| {k} | {v} |" for k, v in rows], "",
             f"Not released: {secret}the other trials and their scores (they stay in the tuning folder's secret "
             f"sidecar, or were deleted).", ""]
    return "\n".join(lines)


def law_text(t: dict[str, Any]) -> str:
    """The law of K in words."""
    d = t["distribution"]
    if d["distribution"] == "fixed":
        return f"exactly {d['trials']}, composed"
    if d["distribution"] == "poisson":
        return f"Poisson with mean {_fmt(d['mu'], 'g')}"
    params = f"eta {_fmt(d['eta'], 'g')}, gamma {_fmt(d['gamma'], '.4g')}"
    return f"{d['distribution']} ({params}), mean {_fmt(d['expected_trials'], '.3g')}"


def space_text(space: dict[str, list[str]]) -> str:
    """The search space in words."""
    return "; ".join(f"{key} in {{{', '.join(values)}}}" for key, values in space.items())


def write_release(run: Path, report: dict[str, Any]) -> None:
    """Write ``report`` into ``run``'s privacy.json / privacy.md (with the tuning section) and into every checkpoint
    of the run (the report ``dpl export`` writes). Each file is replaced atomically."""
    write_report(report, run)
    _write_atomic((report_markdown(report) + "\n" + tuning_markdown(report)).encode(), run / REPORT_MD, 0o644)
    for ckpt in sorted((run / "checkpoints").glob("*.ckpt")):
        checkpoint = load_checkpoint_file(ckpt)
        checkpoint[REPORT_KEY] = report
        buffer = io.BytesIO()
        torch.save(checkpoint, buffer)
        _write_atomic(buffer.getvalue(), ckpt, 0o644)
