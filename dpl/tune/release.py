"""The privacy of the tuned model and its report: the epsilon of the whole search (Papernot & Steinke, Theorem 2 or 6)
from one trial's RDP curve (the largest of the space's configurations', :mod:`dpl.tune.plans`), written into the kept
run's ``privacy.json`` / ``privacy.md`` and into the report its checkpoints carry (which ``dpl export`` writes beside
the exported weights).

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
from dpl.tune import plans as plans_module

#: what must be equal in every trial's report (sigma, the sampling rate and the steps are checked against the plans)
SHARED_KEYS = ("mechanism", "sampling", "accountant", "adjacency", "unit", "delta", "num_examples")
THEOREMS = {"poisson": "Theorem 6", "negative_binomial": "Theorem 2", "fixed": "composition"}
PAPER = 'Papernot & Steinke, "Hyperparameter tuning with Rényi differential privacy" (ICLR 2022)'


def distribution(fields: dict[str, Any]) -> accounting.TrialDistribution:
    return accounting.TrialDistribution(**fields)


def accounting_differences(first: dict[str, Any], other: dict[str, Any]) -> list[str]:
    """The fields of :data:`SHARED_KEYS` in which two trials' reports differ."""
    return [key for key in SHARED_KEYS if first.get(key) != other.get(key)]


def tuned_privacy(plans: list[dict[str, Any]], dist: accounting.TrialDistribution,
                  report: dict[str, Any]) -> dict[str, Any]:
    """The tuned release's epsilon at the trials' delta and at the deltas of the kept trial's table, and one trial's
    RDP epsilon, all from the largest RDP curve of the space's ``plans`` (:mod:`dpl.tune.plans`). A fixed number of
    trials is their composition (by the trials' own accountant when the plans share one accounting)."""
    delta = float(report["delta"])
    deltas = [float(row["delta"]) for row in report.get("epsilon_delta_table", [])]
    return {"epsilon": plans_module.tuned_epsilon(plans, dist, delta),
            "table": [{"delta": d, "epsilon": plans_module.tuned_epsilon(plans, dist, d)} for d in deltas],
            "epsilon_one_trial_rdp": _rdp_to_epsilon(accounting.ORDERS, plans_module.one_trial_rdp(plans), delta)}


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
    if "configurations_planned" in t:
        rows.append(("one trial's RDP", f"the largest curve of the {t['configurations_planned']} configurations of "
                                        f"the space whose accounting differs, planned before any trial"))
    if "total_epsilon" in t:
        rows.append(("--total-epsilon", f"{_fmt(t['total_epsilon'], 'g')}: each trial targeted epsilon "
                                        f"{_fmt(t['epsilon_per_trial_target'], '.4g')}"))
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
    for ckpt in sorted({path.resolve() for path in (run / "checkpoints").glob("*.ckpt")}):  # last.ckpt: a link
        checkpoint = load_checkpoint_file(ckpt)
        checkpoint[REPORT_KEY] = report
        buffer = io.BytesIO()
        torch.save(checkpoint, buffer)
        _write_atomic(buffer.getvalue(), ckpt, 0o644)
