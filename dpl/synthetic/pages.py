"""The one-page evaluation of a synthetic data set (:mod:`dpl.synthetic.evaluation`): ``evaluation.json`` (every
figure), ``evaluation.md`` (for a data owner) and ``evaluation.png`` (lengths, labels, accuracy, longest matches;
needs matplotlib, else the page says so)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


def _f(value: Any, spec: str = ".3f") -> str:
    if value is None:
        return "not measured"
    return format(value, spec) if isinstance(value, float) and math.isfinite(value) else str(value)


def _plot(result: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    dist = result["distribution"]
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    ax = axes[0][0]
    top = max(max(dist["synthetic"]["lengths"] or [1]), max(dist["validation"]["lengths"] or [1]))
    bins = range(0, top + 2, max(1, (top + 1) // 30))
    ax.hist(dist["validation"]["lengths"], bins=bins, alpha=0.5, density=True, label="real validation")
    ax.hist(dist["synthetic"]["lengths"], bins=bins, alpha=0.5, density=True, label="synthetic")
    ax.set(title="length (words)", xlabel="words", ylabel="density")
    ax.legend()
    ax = axes[0][1]
    labels = sorted(set(dist["synthetic"].get("label_proportions") or {}) |
                    set(dist["validation"].get("label_proportions") or {}))
    if labels:
        xs = range(len(labels))
        ax.bar([x - 0.2 for x in xs], [dist["validation"]["label_proportions"].get(k, 0) for k in labels], 0.4,
               label="real validation")
        ax.bar([x + 0.2 for x in xs], [dist["synthetic"]["label_proportions"].get(k, 0) for k in labels], 0.4,
               label="synthetic")
        ax.set_xticks(list(xs), labels if len(labels) <= 12 else [""] * len(labels), rotation=45, ha="right")
        ax.legend()
    ax.set(title="label proportions")
    ax = axes[1][0]
    down = result.get("downstream") or {}
    bars = [(name, down.get(key)) for name, key in (("synthetic (TSTR)", "tstr_accuracy"),
                                                     ("real rows", "real_accuracy"),
                                                     ("majority class", "majority_accuracy"))
            if down.get(key) is not None]
    if bars:
        ax.bar([b[0] for b in bars], [b[1] for b in bars], color=["C1", "C0", "C7"][:len(bars)])
        ax.set_ylim(0, 1)
    ax.set(title="accuracy on the real validation split")
    ax = axes[1][1]
    leak = result.get("leakage")
    if leak:
        top = max(max(leak["synthetic"]["longest_matches"] or [1]), max(leak["validation"]["longest_matches"] or [1]))
        bins = range(0, top + 2)
        ax.hist(leak["validation"]["longest_matches"], bins=bins, alpha=0.5, density=True, label="real validation")
        ax.hist(leak["synthetic"]["longest_matches"], bins=bins, alpha=0.5, density=True, label="synthetic")
        ax.legend()
    ax.set(title="longest match with a training record (words; < 4: 0)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def _markdown(result: dict[str, Any], plotted: bool) -> str:
    dist, down = result["distribution"], result.get("downstream")
    guarantee = result.get("guarantee")
    lines = ["# Evaluation of synthetic data", "",
             f"`{Path(result['synthetic']).name}`: {result['rows']} rows, text column `{result['text_column']}`"
             + (f", label column `{result['label_column']}`" if result["label_column"] else "")
             + (f"; its guarantee: epsilon = {_f(float(guarantee['epsilon']))}, delta = {float(guarantee['delta']):.3g}"
                f" (label counts: {result['label_counts']})" if guarantee else "") + ".", "",
             f"> {result['not_dp']}", ""]
    if plotted:
        lines += ["![lengths, labels, accuracy and longest matches](evaluation.png)", ""]
    if down:
        lines += ["## Downstream: train on synthetic, test on real", "",
                  f"The same classifier ({down['recipe']}, features of `{result['encoder']}`) trained on each set, "
                  f"tested on the real validation split ({down['classes']} classes).", "",
                  "| trained on | accuracy |", "|---|---|",
                  f"| the {result['rows']} synthetic rows | {_f(down['tstr_accuracy'])} |",
                  f"| {down['real_rows']} real training rows | {_f(down['real_accuracy'])} |",
                  f"| (the majority class) | {_f(down['majority_accuracy'])} |", ""]
    mauve, real = result["mauve"], result.get("mauve_real") or {}
    lines += ["## Fidelity", "",
              f"MAUVE (features: mean-pooled last hidden states of `{result['encoder']}`) against the real validation "
              f"texts: synthetic {_f(mauve.get('mauve'))}" + (f" ({mauve['why_not']})" if mauve.get("why_not") else "")
              + (f"; as many real training texts: {_f(real.get('mauve'))}" if real else "") + " (1 = the same "
              "distribution).", "",
              "| | texts | mean length (words) | median | distinct-1 | distinct-2 |", "|---|---|---|---|---|---|"]
    for name, d in (("synthetic", dist["synthetic"]), ("real validation", dist["validation"])):
        lines.append(f"| {name} | {d['texts']} | {_f(d['length_mean'], '.1f')} | {_f(float(d['length_median']), '.1f')}"
                     f" | {_f(d['distinct_1'])} | {_f(d['distinct_2'])} |")
    props = dist["synthetic"].get("label_proportions")
    if props:
        real_props = dist["validation"].get("label_proportions") or {}
        shown = sorted(set(props) | set(real_props))
        gap = sum(abs(props.get(k, 0) - real_props.get(k, 0)) for k in shown) / 2
        lines += ["", f"Label proportions: total variation distance {gap:.3f} between synthetic and real validation "
                      f"({len(shown)} labels)."]
    leak = result.get("leakage")
    lines += ["", "## Leakage", ""]
    if leak:
        s, v = leak["synthetic"], leak["validation"]
        lines += [f"Against the real training texts (near duplicate: at least {s['near_words']} consecutive words "
                  f"shared with one training record, or the whole text when shorter):", "",
                  "| | exact duplicates | near duplicates | longest match, median (words) | longest match, max |",
                  "|---|---|---|---|---|",
                  f"| synthetic | {s['exact']} ({s['exact_fraction']:.1%}) | {s['near']} ({s['near_fraction']:.1%}) | "
                  f"{s['longest_match_median']} | {s['longest_match_max']} |",
                  f"| real validation (for scale) | {v['exact']} ({v['exact_fraction']:.1%}) | {v['near']} "
                  f"({v['near_fraction']:.1%}) | {v['longest_match_median']} | {v['longest_match_max']} |", ""]
    else:
        lines += ["Not measured: give the real training file with --train.", ""]
    canaries = result.get("canaries")
    if canaries:
        lines += [f"Canaries: {canaries['reproduced']} of {canaries['canaries']} reproduced whole by a synthetic "
                  f"record, {canaries['secrets_reproduced']} secret numbers reproduced; the most consecutive words "
                  f"of a canary in one record: {max(c['longest_match'] for c in canaries['each'])}.", ""]
        exposure = canaries.get("exposure")
        if exposure:
            lines += [f"Exposure under the trained model (each canary's secret ranked by the model's loss among "
                      f"{exposure['candidates']} random ones; Carlini et al., \"The Secret Sharer\"): mean "
                      f"{exposure['mean']:.2f} bits, most {exposure['max']:.2f} of at most {exposure['most']:.2f} "
                      f"(a model that learnt nothing of them: {exposure['by_chance']:.2f} expected); ranks "
                      f"{', '.join(str(e['rank']) for e in exposure['each'])}.", ""]
    return "\n".join(lines)


def write_page(result: dict[str, Any], folder: Path) -> None:
    """``evaluation.json``, ``evaluation.png`` and ``evaluation.md`` into the new ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "evaluation.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    plotted = _plot(result, folder / "evaluation.png")
    (folder / "evaluation.md").write_text(_markdown(result, plotted))
