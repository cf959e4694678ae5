"""``dpl report RUN``: PNG plots of a run's ``metrics.csv`` - epsilon spent over the steps, and every validation
metric (loss, accuracy, F1, BLEU ...) over the steps - written into ``RUN/plots/`` (or ``--output``).

The training loss is not logged (it is computed on the private examples), so the curves are the validation ones.
Needs matplotlib (``pip install matplotlib``, or the ``bench`` extra).
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path
from typing import Any

from dpl.errors import ConfigError


def read_metrics(path: Path) -> dict[str, list[tuple[int, float]]]:
    """``metric -> [(step, value), ...]`` from a CSVLogger ``metrics.csv`` (empty cells skipped)."""
    series: dict[str, list[tuple[int, float]]] = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            step = row.get("step")
            if not step:
                continue
            for name, value in row.items():
                if name not in ("step", "epoch") and value not in (None, ""):
                    series.setdefault(name, []).append((int(float(step)), float(value)))  # private steps taken
    return series


def _metrics_file(run: Path) -> Path:
    if run.is_file():
        return run
    for candidate in (run / "metrics.csv", *sorted(run.glob("**/metrics.csv"), key=lambda p: p.stat().st_mtime)[-1:]):
        if candidate.is_file():
            return candidate
    raise ConfigError(f"{run}: no metrics.csv (give a run folder, lightning_logs/version_N)")


def steps_axis(ax: Any, last: int) -> None:
    """An x axis of private steps: whole steps only, from 0 to ``last`` (a lone point is not centred on its own
    fractional ticks)."""
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlim(0, last + max(1, last // 20))


def write_plots(run: str | Path, output: str | Path | None = None) -> list[Path]:
    """Write ``epsilon.png`` and ``validation.png`` for ``run``; return the files written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("dpl report draws with matplotlib, which is not installed: pip install matplotlib "
                          "(or pip install -e \".[bench]\")") from None
    metrics = _metrics_file(Path(run))
    series = read_metrics(metrics)
    folder = Path(output) if output is not None else metrics.parent / "plots"
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    last = max((step for points in series.values() for step, _ in points), default=1)
    if "epsilon" in series:
        fig, ax = plt.subplots(figsize=(5, 3.5))
        steps, values = zip(*series["epsilon"])
        ax.plot(steps, values, marker=".")
        ax.set(xlabel="private steps", ylabel="epsilon spent", title="Privacy spent")
        steps_axis(ax, last)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(folder / "epsilon.png", dpi=120)
        plt.close(fig)
        written.append(folder / "epsilon.png")
    names = sorted(n for n in series if n.startswith(("val_", "test_")) and "/" not in n)
    if names:
        fig, axes = plt.subplots(len(names), 1, figsize=(5, 2.2 * len(names)), squeeze=False, sharex=True)
        for ax, name in zip(axes[:, 0], names):
            steps, values = zip(*series[name])
            ax.plot(steps, values, marker="o")
            ax.set_ylabel(name)
            ax.grid(alpha=0.3)
            steps_axis(ax, last)
        axes[-1, 0].set_xlabel("private steps")
        fig.suptitle("Validation (the training loss is private and not logged)", fontsize=9)
        fig.tight_layout()
        fig.savefig(folder / "validation.png", dpi=120)
        plt.close(fig)
        written.append(folder / "validation.png")
    if not written:
        raise ConfigError(f"{metrics}: nothing to plot (no epsilon or validation metric logged)")
    return written


def report_command(argv: list[str]) -> int:
    """``dpl report RUN [--output FOLDER]``."""
    parser = argparse.ArgumentParser(prog="dpl report", description=__doc__.split("\n\n")[0])
    parser.add_argument("run", help="a run folder (lightning_logs/version_N) or its metrics.csv")
    parser.add_argument("--output", default=None, help="folder for the PNGs (default: RUN/plots)")
    args = parser.parse_args(argv)
    try:
        files = write_plots(args.run, args.output)
    except ConfigError as exc:
        print(f"dpl: error: {exc}", file=sys.stderr)
        return 2
    print("dpl: wrote " + ", ".join(str(f) for f in files))
    return 0
