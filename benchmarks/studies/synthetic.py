"""DP synthetic data study: what a synthetic copy of SST-2 or Banking77 is worth at epsilon 1, 4, 8 and inf.

Every cell is the three documented commands (docs/synthetic.md), in this process:

1. ``dpl fit --config configs/synthetic/<data>.yaml`` (SmolLM2-135M-Instruct + LoRA r 8 on q/k/v/o, the label as
   control prefix, AdamW lr 0.002 as the config sets it, not tuned) on the real training file with 10 canary records
   inserted (``dpl.synthetic.leakage.canary_texts``, labelled with the first label), at the target epsilon (inf:
   ``privacy.noise_multiplier 0``, no guarantee), ``seed_everything`` per seed;
2. ``dpl synthesize`` of ``rows`` records, uniform labels (``--non_private_ok`` for inf);
3. ``dpl evaluate-synthetic`` against the real validation split with ``--train`` (the training file with its
   canaries) and ``--canaries``: TSTR accuracy beside the same classifier on as many real training rows, MAUVE of the
   synthetic and of as many real training texts against the validation texts, exact and near duplicates, canaries.

One study per data set (``--data``), each sized to at most 8 hours on one thread of this 2-core CPU: 4 epsilons x 3
seeds = 12 cells. Measured on this CPU with one thread (the other core busy): the fit runs at 2-3 examples/s
(Poisson B = 64, micro-batches of 16, max 64 tokens), ``dpl synthesize`` at about 1.2 records/s (48 new tokens),
the evaluation in about 30 s per 200 records. So each fit takes 50 steps of B = 64 (3,200 examples: about 20
minutes), and a cell about 30 (SST-2: 500 records) to 40 minutes (Banking77: 770 records, 10 per label).

What that size can show, and what it cannot: 50 steps see 3,200 of SST-2's 67,349 training rows (q = 0.001) and
3,200 of Banking77's 9,003 (q = 0.007): a third of an epoch at most, so sigma stays small at every epsilon and the
comparison across epsilon is of the same short fine-tuning under more or less noise, beside the non-private one (inf)
and a classifier trained on as many real rows. It cannot show what Yue et al.'s long runs (many epochs, batches of
thousands) reach, nor resolve TSTR differences below the seeds' spread (a few points on 872 SST-2 and 1,000
Banking77 validation rows).

The canary arm's positive control (``--control``): the same fit at epsilon inf and 8 on 500 training rows plus the
10 canaries, where q = 64/510 puts each canary in about 6 of the 50 batches, both epsilons of a seed before the next
seed. It shows whether this fit and sampler reproduce a canary the fit has seen (so that the full study's "0 of 10"
means something), and what epsilon 8 changes at that sampling rate; it also measures each canary's exposure under
the trained model (``dpl evaluate-synthetic --run``: its secret ranked among 99 random ones, at most 6.6 bits; about
1.40 expected of a model that learnt nothing of it), which detects memorization long before a sampled record
repeats a secret. Its TSTR figures are of a 500-row training set, not comparable with the full study's.

The baseline of no training (``--untrained``): the same prompts sampled from the pretrained model itself (a fit of
one step at lr 0, so the weights stay the pretrained ones: the records depend on no training row, epsilon 0),
evaluated the same way. It shows what the control prefix alone (a label's name) is worth to the classifier, which
no epsilon can go below; 3 cells of sampling and evaluation (about 15 minutes each).

Results (per cell and seed, and the mean and spread over seeds) go to ``<out>/synthetic_<data>.json`` (other seeds:
``_seeds<first>``) after every cell; the cells run in the order epsilon 8, inf, 4, 1 (every seed of one before the
next, so a partial run already compares epsilon 8 with the non-private copy); ``--resume`` keeps the cells of a file
with the same settings; ``--epsilons`` runs only some epsilons' cells (the headline cells of both data sets first:
``--epsilons 8 inf``), and processes of one study with ``--resume`` share its file: each claims a cell before it
runs it (``<file>.claims.lock``, cleared of processes that died), skips the cells others hold or have saved, and
adds its cells under a lock (``<file>.lock``); ``--table`` prints the docs' table of a results file without
training.

    python benchmarks/studies/synthetic.py --data sst2 --resume         # SST-2: 12 cells, about 6 CPU-hours
    python benchmarks/studies/synthetic.py --data banking77 --resume    # Banking77: 12 cells, about 8 CPU-hours
    python benchmarks/studies/synthetic.py --data sst2 --control --resume   # the canary control: 6 cells
    python benchmarks/studies/synthetic.py --data banking77 --untrained --resume   # no training: 3 cells
    python benchmarks/studies/synthetic.py --quick     # SST-2 at 8 and Banking77 at inf: 2 steps on 200 rows (the test)
    python benchmarks/studies/synthetic.py --table benchmarks/results/studies/synthetic_sst2.json
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import math
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import DATA, PUBLISHED_TUNE_SEED, RESULTS, machine, read_tsv, result_name, save, study_parser

ROOT = Path(__file__).resolve().parents[2]
DATASETS = {"sst2": {"config": "configs/synthetic/sst2.yaml", "text": "sentence", "validation": "validation.tsv"},
            "banking77": {"config": "configs/synthetic/banking77.yaml", "text": "text", "validation": "dev.tsv"}}
EPSILONS = [1.0, 4.0, 8.0, math.inf]
FIRST = [8.0, math.inf, 4.0, 1.0]   # the run order: the comparison a partial run can already make (epsilon 8 vs inf)
SIZE = {"train_rows": None, "validation_rows": None, "steps": 50, "batch_size": 64, "max_new_tokens": 48,
        "canaries": 10}
SETTINGS = {"sst2": {**SIZE, "cells": [("sst2", e) for e in EPSILONS], "rows": {"sst2": 500}},
            "banking77": {**SIZE, "cells": [("banking77", e) for e in EPSILONS], "rows": {"banking77": 770}}}
CONTROL_ROWS = 500  # --control: so few training rows that each (canary) record is drawn about 6 times in 50 steps
EXPOSURE_CANDIDATES = 99  # --control: each canary's secret ranked among 99 random ones (at most 6.6 bits)
QUICK = {"cells": [("sst2", 8.0), ("banking77", math.inf)], "train_rows": 200, "validation_rows": 60,
         "steps": 2, "batch_size": 16, "rows": {"sst2": 20, "banking77": 20}, "max_new_tokens": 12, "canaries": 2,
         "exposure_candidates": 9}


class _Tee(io.StringIO):
    """Kept (the checkpoint's path, the error message) and shown on stderr (the long fits' progress) at once."""

    def write(self, text: str) -> int:
        sys.__stderr__.write(text)
        return super().write(text)


def dpl(*args: str) -> str:
    """``dpl ARGS`` in this process; its stdout (a failure raises with the end of its stderr)."""
    from dpl.cli import main

    out, err = _Tee(), _Tee()
    code = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            main(list(args))
    except SystemExit as exc:
        code = exc.code or 0
    if code:
        raise RuntimeError(f"dpl {' '.join(args[:3])} ... exited {code}: {err.getvalue()[-2000:]}")
    return out.getvalue()


def write_tsv(path: Path, columns: list[str], rows: list[tuple[str, str]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f, delimiter="\t", lineterminator="\n")
        writer.writerow(columns)
        writer.writerows(rows)


def prepare(name: str, s: dict[str, Any], seed: int, folder: Path) -> dict[str, Path]:
    """The cell's files: the training rows with the canaries inserted, the validation rows, the canaries."""
    from dpl.synthetic.leakage import canary_texts

    spec = DATASETS[name]
    texts, labels = read_tsv(DATA / name / "train.tsv", spec["text"], "label")
    rows = list(zip(texts, labels))
    if s["train_rows"] is not None:
        rows = random.Random(seed).sample(rows, s["train_rows"])
    canaries = canary_texts(s["canaries"], seed=1000 + seed)
    first = sorted(set(labels))[0]
    rows = rows + [(c, first) for c in canaries]
    random.Random(seed).shuffle(rows)
    texts, labels = read_tsv(DATA / name / spec["validation"], spec["text"], "label")
    validation = list(zip(texts, labels))[:s["validation_rows"]]
    paths = {"train": folder / "data" / "train.tsv", "validation": folder / "validation.tsv",
             "canaries": folder / "canaries.txt"}
    write_tsv(paths["train"], [spec["text"], "label"], rows)
    write_tsv(paths["validation"], [spec["text"], "label"], validation)
    paths["canaries"].write_text("\n".join(canaries) + "\n")
    return paths


def cell(name: str, epsilon: float, seed: int, s: dict[str, Any], folder: Path) -> dict[str, Any]:
    """One fit -> synthesize -> evaluate; its figures."""
    start = time.perf_counter()
    paths = prepare(name, s, seed, folder)
    untrained = epsilon == 0  # lr 0: the weights stay the pretrained ones, the records depend on no training row
    privacy = (["--model.init_args.privacy.noise_multiplier", "0"] if math.isinf(epsilon) or untrained
               else ["--model.init_args.privacy.target_epsilon", str(epsilon)])
    steps = ["--trainer.max_steps", "1", "--model.init_args.optimizer.init_args.lr", "0"] if untrained else \
        ["--trainer.max_steps", str(s["steps"])]
    out = dpl("fit", "--config", str(ROOT / DATASETS[name]["config"]), "--data.init_args.data_dir",
              str(paths["train"].parent), "--trainer.default_root_dir", str(folder / "runs"), *steps,
              "--model.init_args.privacy.batch_size", str(s["batch_size"]), "--seed_everything", str(seed), *privacy)
    checkpoint = out.strip().splitlines()[-1].rsplit("checkpoint ", 1)[-1]
    synthetic = folder / "synthetic"
    dpl("synthesize", checkpoint, "--rows", str(s["rows"][name]), "--out", str(synthetic), "--seed", str(seed),
        "--max_new_tokens", str(s["max_new_tokens"]),
        *(["--non_private_ok"] if math.isinf(epsilon) or untrained else []))
    exposure = (["--run", checkpoint, "--exposure_candidates", str(s["exposure_candidates"])]
                if s.get("exposure_candidates") else [])
    dpl("evaluate-synthetic", str(synthetic), str(paths["validation"]), "--train", str(paths["train"]),
        "--canaries", str(paths["canaries"]), "--seed", str(seed), *exposure)
    page = json.loads((synthetic / "evaluation" / "evaluation.json").read_text())
    report = json.loads((synthetic / "privacy.json").read_text())
    down, leak = page["downstream"], page["leakage"]["synthetic"]
    # untrained: the run's report says inf (sigma 0), but with lr 0 no training row reaches the weights: epsilon 0
    spent = 0.0 if untrained else float(report["training"]["epsilon"])
    return {"data": name, "epsilon": epsilon, "seed": seed, "epsilon_spent": spent,
            "sigma": report["training"]["noise_multiplier"], "tstr_accuracy": down["tstr_accuracy"],
            "real_accuracy": down["real_accuracy"], "majority_accuracy": down["majority_accuracy"],
            "mauve": page["mauve"].get("mauve"), "mauve_real": (page.get("mauve_real") or {}).get("mauve"),
            "exact_duplicates": leak["exact_fraction"], "near_duplicates": leak["near_fraction"],
            "longest_match_max": leak["longest_match_max"],
            "validation_exact_duplicates": page["leakage"]["validation"]["exact_fraction"],
            "canaries_reproduced": page["canaries"]["reproduced"],
            "canary_secrets_reproduced": page["canaries"]["secrets_reproduced"],
            "canary_longest_match": max((f["longest_match"] for f in page["canaries"]["each"]), default=0),
            **exposure_figures(page["canaries"].get("exposure")),
            "seconds": time.perf_counter() - start, "machine": machine()}


def exposure_figures(exposure: dict[str, Any] | None) -> dict[str, Any]:
    """A cell's canary exposure figures (mean and most over its canaries, each rank), when measured."""
    if not exposure:
        return {}
    return {"canary_exposure": exposure["mean"], "canary_exposure_max": exposure["max"],
            "canary_ranks": [e["rank"] for e in exposure["each"]]}


def summary(cells: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Mean and spread (population std) over seeds per data set and epsilon."""
    groups: dict[tuple[str, float], list[dict[str, Any]]] = {}
    for c in cells:
        groups.setdefault((c["data"], c["epsilon"]), []).append(c)
    keys = ("tstr_accuracy", "real_accuracy", "mauve", "mauve_real", "exact_duplicates", "near_duplicates",
            "canaries_reproduced", "canary_secrets_reproduced", "canary_longest_match", "canary_exposure")
    out = []
    for (name, epsilon), group in sorted(groups.items(), key=lambda item: item[0][1]):  # by epsilon, inf last
        row: dict[str, Any] = {"data": name, "epsilon": epsilon, "seeds": len(group)}
        for key in keys:
            values = [g[key] for g in group if g.get(key) is not None]
            row[key] = statistics.fmean(values) if values else None
            row[f"{key}_spread"] = statistics.pstdev(values) if len(values) > 1 else 0.0 if values else None
        longest = [g["canary_longest_match"] for g in group if g.get("canary_longest_match") is not None]
        row["canary_longest_match_max"] = max(longest) if longest else None
        most = [g["canary_exposure_max"] for g in group if g.get("canary_exposure_max") is not None]
        row["canary_exposure_max"] = max(most) if most else None
        out.append(row)
    return out


def canary_cell(row: dict[str, Any], inserted: int, candidates: int | None = None) -> str:
    """How many canaries came back whole (mean over the seeds); with the cells that recorded them, how many secrets
    (the 6-digit number) and the longest run of a canary's words in one synthetic record over the seeds (of its 8;
    below the leakage index's 4-grams: "< 4"); with ``candidates``, the canaries' exposure under the trained model
    (mean over canaries and seeds, and the most, of at most log2(candidates + 1) bits)."""
    from dpl.synthetic.leakage import SHINGLE

    text = f"{row['canaries_reproduced']:g} of {inserted}"
    longest = row.get("canary_longest_match_max")
    if longest is not None:
        run = f"< {SHINGLE}" if longest < SHINGLE else f"{longest:g}"
        text += f" (secrets {row['canary_secrets_reproduced']:g}, longest run {run} words)"
    if candidates and row.get("canary_exposure") is not None:
        text += (f"; exposure {row['canary_exposure']:.2f} bits, most {row['canary_exposure_max']:.2f} of "
                 f"{math.log2(candidates + 1):.2f}")
    return text


def table(results: dict[str, Any]) -> str:
    """The docs' table: per epsilon, mean +- spread over the seeds."""
    def pm(row: dict[str, Any], key: str, scale: float = 100.0, digits: int = 1) -> str:
        if row[key] is None:
            return "—"
        return f"{scale * row[key]:.{digits}f} ± {scale * row[key + '_spread']:.{digits}f}"

    settings = results["settings"]
    lines = ["| data | ε | seeds | TSTR accuracy | real rows' accuracy | MAUVE (synthetic) | MAUVE (real rows) "
             "| exact / near duplicates, % | canaries reproduced |", "|---|---|---|---|---|---|---|---|---|"]
    for row in results["summary"]:
        eps = ("∞ (no noise)" if math.isinf(row["epsilon"]) else "0 (untrained)" if row["epsilon"] == 0
               else f"{row['epsilon']:g}")
        lines.append(f"| {row['data']} | {eps} | {row['seeds']} | {pm(row, 'tstr_accuracy')} | "
                     f"{pm(row, 'real_accuracy')} | {pm(row, 'mauve', 1.0, 3)} | {pm(row, 'mauve_real', 1.0, 3)} | "
                     f"{100 * row['exact_duplicates']:.1f} / {100 * row['near_duplicates']:.1f} | "
                     f"{canary_cell(row, settings['canaries'], settings.get('exposure_candidates'))} |")
    return "\n".join(lines)


def settings_for(data: str, quick: bool = False, control: bool = False, untrained: bool = False) -> dict[str, Any]:
    """The study's size: the data set's 12 cells; ``quick``: the test's 2 tiny cells; ``control``: the canary arm's
    positive control, epsilon 8 and inf on :data:`CONTROL_ROWS` training rows, where q = B / (rows + canaries) is
    about 0.13 and each canary is expected in 6 of the 50 batches (in the full study: 0.05 of a batch for SST-2)."""
    if quick:
        return QUICK
    s = SETTINGS[data]
    if control:
        return {**s, "train_rows": CONTROL_ROWS, "cells": [(data, math.inf), (data, 8.0)],
                "exposure_candidates": EXPOSURE_CANDIDATES, "order": "seed"}
    if untrained:
        return {**s, "cells": [(data, 0.0)], "order": "seed"}
    return s


def cells_to_run(cells: list[tuple[str, float]], seeds: list[int], done: list[dict[str, Any]],
                 epsilons: list[float] | None = None, by_seed: bool = False) -> list[tuple[str, float, int]]:
    """The (data, epsilon, seed) cells not in ``done``, in the run order (:data:`FIRST`, every seed of one epsilon
    before the next; ``by_seed``: every cell of one seed, in the given order, before the next seed); only those of
    ``epsilons`` when given."""
    order = ([(d, e, seed) for seed in seeds for d, e in cells] if by_seed else
             [(d, e, seed) for d, e in sorted(cells, key=lambda c: FIRST.index(c[1])) for seed in seeds])
    return [(d, e, seed) for d, e, seed in order if (epsilons is None or e in epsilons)
            and not any(c["data"] == d and c["epsilon"] == e and c["seed"] == seed for c in done)]


def merge_cells(mine: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``mine`` and the cells of ``theirs`` that ``mine`` lacks (a cell is its data, epsilon and seed)."""
    key = lambda c: (c["data"], c["epsilon"], c["seed"])  # noqa: E731
    have = {key(c) for c in mine}
    return mine + [c for c in theirs if key(c) not in have]


def cells_on_disk(path: Path, settings: dict[str, Any]) -> list[dict[str, Any]]:
    """The cells of the results file ``path`` when it was written with ``settings`` (else none)."""
    if not path.is_file():
        return []
    old = json.loads(path.read_text())
    return old["cells"] if old.get("settings") == settings else []


@contextlib.contextmanager
def locked(path: Path) -> Any:
    """Hold an exclusive lock on ``<path>.lock`` (POSIX) while reading and rewriting ``path``."""
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _claims(path: Path) -> tuple[Path, dict[str, int]]:
    """The file of the cells being run (``<file>.claims.lock``: cell -> process id) and its live claims."""
    import os

    claims_path = path.with_suffix(".claims.lock")
    claims = json.loads(claims_path.read_text() or "{}") if claims_path.is_file() else {}

    def alive(pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    return claims_path, {k: pid for k, pid in claims.items() if alive(pid)}


def claim(path: Path, key: str, still_to_run: Any) -> bool:
    """Claim the cell ``key`` of results file ``path`` for this process, when no live process holds it and
    ``still_to_run()`` (under the lock: it reads the file). Processes of one study so run different cells."""
    import os

    with locked(path):
        claims_path, claims = _claims(path)
        if key in claims or not still_to_run():
            return False
        claims_path.write_text(json.dumps({**claims, key: os.getpid()}))
        return True


def release(path: Path, key: str) -> None:
    """Give the cell ``key`` back (its results saved, or its run failed)."""
    with locked(path):
        claims_path, claims = _claims(path)
        claims.pop(key, None)
        claims_path.write_text(json.dumps(claims))


def main() -> None:
    parser = study_parser(__doc__)
    parser.add_argument("--data", choices=tuple(DATASETS), default="sst2", help="the data set of the study")
    parser.add_argument("--resume", action="store_true", help="keep the cells of a results file with the same "
                                                               "settings")
    parser.add_argument("--epsilons", type=float, nargs="+", choices=EPSILONS, metavar="EPS",
                        help="run only the cells of these epsilons (of 1 4 8 inf; the results file keeps the others)")
    parser.add_argument("--control", action="store_true",
                        help="the canary arm's positive control: epsilon 8 and inf on 500 training rows, where each "
                             "canary is drawn into about 6 batches (results: synthetic_<data>_control)")
    parser.add_argument("--untrained", action="store_true",
                        help="the baseline of no training: the pretrained model (lr 0) sampled after the same control "
                             "prefixes, epsilon 0 (results: synthetic_<data>_untrained)")
    parser.add_argument("--table", type=Path, metavar="RESULTS", help="print the table of a results file and exit")
    parser.set_defaults(tune_seed=None)
    args = parser.parse_args()
    if args.control and args.untrained:
        parser.error("--control and --untrained are two studies: give one")
    if args.tune_seed is not None:
        parser.error("--tune-seed: this study tunes nothing (every cell trains with its config's lr)")
    args.tune_seed = PUBLISHED_TUNE_SEED
    if args.table:
        print(table(json.loads(args.table.read_text())))
        return
    s = settings_for(args.data, args.quick, args.control, args.untrained)
    seeds = [args.seeds[0]] if args.quick else args.seeds
    base = f"synthetic_{args.data}" + ("_control" if args.control else "_untrained" if args.untrained else "")
    name = "synthetic_quick" if args.quick else result_name(base, args)
    path = Path(args.out) / f"{name}.json"
    settings = {**s, "cells": [[d, str(e)] for d, e in s["cells"]], "seeds": seeds}
    done = cells_on_disk(path, settings) if args.resume else []
    todo = cells_to_run(s["cells"], seeds, done, args.epsilons, by_seed=s.get("order") == "seed")
    print(f"[synthetic] {name}: {len(todo)} of {len(s['cells']) * len(seeds)} cells to run "
          f"({s['steps']} steps of B = {s['batch_size']}, then "
          f"{' / '.join(str(n) for n in s['rows'].values())} records each)", file=sys.stderr, flush=True)
    for data, epsilon, seed in todo:
        key = f"{data} {epsilon} {seed}"
        if args.resume and not claim(path, key, lambda: cells_to_run([(data, epsilon)], [seed],
                                                                     cells_on_disk(path, settings), by_seed=True)):
            continue  # another process of the same study ran it meanwhile, or is running it
        folder = Path(tempfile.mkdtemp(prefix=f"synthetic-{data}-"))
        try:
            result = cell(data, epsilon, seed, s, folder)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
            if args.resume:
                release(path, key)
        done.append(result)
        print(f"[synthetic] {data} eps={epsilon} seed={seed}: TSTR {result['tstr_accuracy']:.3f} "
              f"(real {result['real_accuracy']:.3f}), MAUVE {result['mauve']}, {result['seconds']:.0f} s",
              file=sys.stderr, flush=True)
        with locked(path):  # two processes of one study (``--epsilons`` apart) each add their cells to one file
            done = merge_cells(done, cells_on_disk(path, settings) if args.resume else [])
            save(name, {"settings": settings, "cells": done, "summary": summary(done)}, args.out)


if __name__ == "__main__":
    RESULTS.mkdir(parents=True, exist_ok=True)
    main()
