"""``dpl evaluate-synthetic SYNTHETIC REAL_VALIDATION [--train REAL_TRAIN]``: what a synthetic data set is worth,
against the real data, in one page (``evaluation.md``, ``evaluation.json``, ``evaluation.png``).

* Downstream (records with a label): one fixed classifier recipe (:mod:`dpl.synthetic.fidelity`) trained on the
  synthetic rows and tested on the real validation split (TSTR), beside the same recipe trained on as many real
  training rows.
* Fidelity: MAUVE of the synthetic texts against the real validation texts (and, for scale, of as many real training
  texts against them), on the encoder's features; length, distinct-1/2 and label proportions.
* Leakage (with ``--train``): exact and near duplicates of training records (:mod:`dpl.synthetic.leakage`), beside
  the same measure for the real validation texts; with ``--canaries FILE`` (one canary a line, inserted into the
  training data before the run), whether the synthetic data reproduces them, and with ``--run RUN`` their exposure
  under the trained model (:mod:`dpl.synthetic.exposure`).

The evaluation reads the real data: its figures are not differentially private. Keep it with the data owner.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import sys
from pathlib import Path
from typing import Any

from dpl.errors import ConfigError, DPLError

NOT_DP = ("This evaluation reads the real training and validation data: its figures (accuracies, MAUVE, lengths, "
          "label proportions, duplicates) are not differentially private. Keep it with the data owner; publish the "
          "synthetic data with its own privacy report (privacy.md), not with this page.")


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a CSV/TSV/JSON(L)/Parquet file."""
    if not path.is_file():
        raise ConfigError(f"{path} not found")
    if path.suffix.lower() == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    from dpl.trained.predict import read_inputs

    return read_inputs(str(path), "text")


def as_text(row: dict[str, Any], column: str) -> str:
    """A row's text: the column's value, or a conversation's turns as ``role: content`` lines."""
    value = row.get(column)
    if isinstance(value, list):
        return "\n".join(f"{t.get('role')}: {t.get('content')}" for t in value if isinstance(t, dict))
    return "" if value is None else str(value)


def synthetic_input(path: Path) -> tuple[Path, dict[str, Any] | None]:
    """The synthetic data file and its ``dpl synthesize`` report (``None`` for a bare file)."""
    if path.is_dir():
        report_path = path / "privacy.json"
        if not report_path.is_file():
            raise ConfigError(f"{path} holds no privacy.json: give the folder dpl synthesize wrote, or its data file")
        report = json.loads(report_path.read_text())
        return path / report["synthetic_data"]["file"], report
    return path, None


def _columns(args: argparse.Namespace, report: dict[str, Any] | None, rows: list[dict[str, Any]]
             ) -> tuple[str, str | None]:
    text = args.text_column or (report["synthetic_data"]["columns"][0] if report else None)
    label = args.label_column or ((report.get("label_counts") or {}).get("column") if report else None)
    if text is None:
        text = "text" if rows and "text" in rows[0] else next(iter(rows[0]), "text") if rows else "text"
    if args.label_column is None and report is None and rows and "label" in rows[0]:
        label = "label"
    for name in (text, label):
        if name is not None and rows and name not in rows[0]:
            raise ConfigError(f"the synthetic data has no column {name!r} (columns: {', '.join(rows[0])})")
    return text, label


def _split(rows: list[dict[str, Any]], text: str, label: str | None, what: str) -> tuple[list[str], list[str] | None]:
    if rows and text not in rows[0]:
        raise ConfigError(f"{what} has no column {text!r} (columns: {', '.join(rows[0])})")
    if label is not None and rows and label not in rows[0]:
        raise ConfigError(f"{what} has no label column {label!r} (columns: {', '.join(rows[0])})")
    texts = [as_text(r, text) for r in rows]
    return texts, ([str(r[label]) for r in rows] if label is not None else None)


def evaluate(args: argparse.Namespace) -> dict[str, Any]:
    """Every measure of the module docstring, as plain values."""
    from dpl.synthetic import fidelity, leakage

    def say(message: str) -> None:
        print(f"dpl: evaluate-synthetic: {message}", file=sys.stderr, flush=True)

    data_file, report = synthetic_input(Path(args.synthetic))
    synthetic_rows = read_rows(data_file)
    if not synthetic_rows:
        raise ConfigError(f"{data_file} has no rows")
    text, label = _columns(args, report, synthetic_rows)
    synth_texts, synth_labels = _split(synthetic_rows, text, label, str(data_file))
    valid_texts, valid_labels = _split(read_rows(Path(args.real_validation)), text, label, args.real_validation)
    train_texts, train_labels = (_split(read_rows(Path(args.train)), text, label, args.train) if args.train
                                 else (None, None))
    n = len(synth_texts)
    rng = random.Random(args.seed)
    baseline = sorted(rng.sample(range(len(train_texts)), min(n, len(train_texts)))) if train_texts else []
    say(f"embedding {n} synthetic, {len(valid_texts)} validation and {len(baseline)} real training texts")
    features = fidelity.embed(synth_texts + valid_texts + [train_texts[i] for i in baseline], args.encoder)
    f_synth, f_valid, f_real = features[:n], features[n:n + len(valid_texts)], features[n + len(valid_texts):]
    result: dict[str, Any] = {"synthetic": str(data_file), "rows": n, "text_column": text, "label_column": label,
                              "encoder": args.encoder, "seed": args.seed, "not_dp": NOT_DP,
                              "guarantee": (report or {}).get("guarantee"),
                              "label_counts": ((report or {}).get("label_counts") or {}).get("method")}
    if label is not None:
        classes = sorted(set(valid_labels) | set(synth_labels) | set(train_labels or []))
        say("training the classifier on the synthetic rows (TSTR)")
        tstr = fidelity.accuracy(fidelity.train_classifier(f_synth, synth_labels, classes)(f_valid), valid_labels)
        real = None
        if baseline:
            real_labels = [train_labels[i] for i in baseline]
            real = fidelity.accuracy(fidelity.train_classifier(f_real, real_labels, classes)(f_valid), valid_labels)
        majority = max(valid_labels.count(c) for c in classes) / len(valid_labels)
        result["downstream"] = {"tstr_accuracy": tstr, "real_accuracy": real, "real_rows": len(baseline),
                                "majority_accuracy": majority, "classes": len(classes),
                                "recipe": "frozen encoder, mean-pooled; logistic regression (L2 1e-3, L-BFGS 200)"}
    say("MAUVE")
    result["mauve"] = fidelity.mauve_score(f_valid, f_synth, args.seed)
    if baseline:
        result["mauve_real"] = fidelity.mauve_score(f_valid, f_real, args.seed)
    result["distribution"] = {"synthetic": fidelity.distribution(synth_texts, synth_labels),
                              "validation": fidelity.distribution(valid_texts, valid_labels)}
    if train_texts is not None:
        say(f"leakage against {len(train_texts)} training texts")
        index = leakage.TrainingIndex(train_texts)
        result["leakage"] = {"synthetic": leakage.duplicates(synth_texts, index, args.near_words),
                             "validation": leakage.duplicates(valid_texts, index, args.near_words)}
    if args.canaries:
        canaries = [line.strip() for line in Path(args.canaries).read_text().splitlines() if line.strip()]
        result["canaries"] = leakage.canaries(synth_texts, canaries)
        if args.run:
            say(f"exposure of {len(canaries)} canaries under {args.run} ({args.exposure_candidates} alternatives each)")
            result["canaries"]["exposure"] = _exposure(args, canaries, text)
    return result


def _exposure(args: argparse.Namespace, canaries: list[str], text: str) -> dict[str, Any]:
    """:func:`dpl.synthetic.exposure.canary_exposure` of the canaries, each with its row of the training file."""
    from dpl.synthetic.exposure import canary_exposure

    rows = {as_text(r, text).strip(): r for r in read_rows(Path(args.train))}
    missing = next((c for c in canaries if c not in rows), None)
    if missing is not None:
        raise ConfigError(f"the canary {missing[:60]!r} is not a record of {args.train}: exposure scores each canary "
                          f"with its training row")
    return canary_exposure(args.run, [rows[c] for c in canaries], text, args.exposure_candidates, args.seed)


def evaluate_command(argv: list[str]) -> int:
    """``dpl evaluate-synthetic SYNTHETIC REAL_VALIDATION [--train FILE] [--out FOLDER] [...]``."""
    from dpl.synthetic.fidelity import ENCODER

    parser = argparse.ArgumentParser(prog="dpl evaluate-synthetic", description=__doc__.split("\n\n")[0])
    parser.add_argument("synthetic", help="the folder dpl synthesize wrote (or a data file)")
    parser.add_argument("real_validation", help="the real validation file (CSV, TSV, JSON lines, Parquet)")
    parser.add_argument("--train", default=None, help="the real training file: the real-data baseline and leakage")
    parser.add_argument("--out", default=None, help="the report's folder (default: SYNTHETIC/evaluation)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing report folder")
    parser.add_argument("--text_column", default=None, help="default: the synthetic report's text column")
    parser.add_argument("--label_column", default=None, help="default: the synthetic report's label column")
    parser.add_argument("--encoder", default=ENCODER, help="the feature model (a BERT-like encoder)")
    parser.add_argument("--canaries", default=None, help="a file of canaries inserted into the training data, one "
                                                         "a line")
    parser.add_argument("--run", default=None, help="the run trained on --train (a run folder or checkpoint): "
                                                    "with --canaries, each canary's exposure under its model")
    parser.add_argument("--exposure_candidates", type=int, default=99,
                        help="the random secrets each canary's is ranked among (default 99: at most 6.6 bits)")
    parser.add_argument("--near_words", type=int, default=8, help="a near duplicate shares this many consecutive "
                                                                   "words with a training record")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    synthetic = Path(args.synthetic)
    out = Path(args.out) if args.out else (synthetic / "evaluation" if synthetic.is_dir()
                                           else synthetic.with_name(synthetic.stem + "_evaluation"))
    try:
        if not synthetic.exists():
            raise ConfigError(f"{synthetic} not found")
        if out.exists() and not args.overwrite:
            raise ConfigError(f"{out} exists: choose a new folder (--out), or add --overwrite")
        if args.near_words < 4:
            raise ConfigError(f"--near_words must be at least 4, got {args.near_words}")
        if args.run is not None and not (args.canaries and args.train):
            raise ConfigError("--run measures the canaries' exposure: give --canaries and --train (the file the run "
                              "was trained on) too")
        if args.exposure_candidates < 1:
            raise ConfigError(f"--exposure_candidates must be positive, got {args.exposure_candidates}")
        result = evaluate(args)
    except DPLError as exc:
        print(f"dpl: error: {exc}", file=sys.stderr)
        return 2
    from dpl.synthetic.pages import write_page

    if out.exists():
        shutil.rmtree(out)
    write_page(result, out)
    down = result.get("downstream") or {}
    mauve = result["mauve"].get("mauve")
    print(f"dpl: evaluated {result['rows']} synthetic rows"
          + (f"; TSTR accuracy {down['tstr_accuracy']:.3f}" if down else "")
          + (f" (real rows: {down['real_accuracy']:.3f})" if down.get("real_accuracy") is not None else "")
          + (f"; MAUVE {mauve:.3f}" if mauve is not None and math.isfinite(mauve) else "")
          + f"; report {out / 'evaluation.md'}")
    return 0
