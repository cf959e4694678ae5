"""``dpl synthesize RUN --rows N --out FOLDER``: a synthetic copy of a run's training data, sampled from the model
trained on it privately (:class:`~dpl.tasks.modules.DPSyntheticModule`), in the input's format and columns, with its
privacy report.

The folder gets ``train.<tsv|csv|jsonl|parquet>`` (the training file's type; ``--format`` to choose), which
``dpl fit`` and any other tool read as they read the original, and ``privacy.json`` / ``privacy.md``
(:mod:`dpl.synthetic.report`). It is written into a hidden folder beside the target and renamed when complete:
a failure leaves nothing behind. Refused in one line: a run without privacy report or not trained private (unless
``--non_private_ok``), an unknown label, ``--rows`` <= 0, an existing output (unless ``--overwrite``).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import random
import shutil
import sys
import tempfile
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from dpl.errors import ConfigError, DPLError
from dpl.synthetic import counts as label_counts
from dpl.synthetic.sampling import Progress, Sampler, SamplingOptions, sample_conversations, sample_tables

FILE_TYPES = ("tsv", "csv", "jsonl", "parquet")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dpl synthesize", description=__doc__.split("\n\n")[0])
    parser.add_argument("run", help="a run folder (lightning_logs/version_N or its root), a .ckpt file, or an "
                                    "exported folder of a DPSyntheticModule run")
    parser.add_argument("--rows", type=int, required=True, help="how many records to generate")
    parser.add_argument("--out", required=True, help="the output folder (new, unless --overwrite)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (public)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top_p", type=float, default=1.0)
    parser.add_argument("--max_new_tokens", type=int, default=None, help="tokens per record (conversations: per "
                                                                         "turn); default: the run's generation setting")
    parser.add_argument("--batch_size", type=int, default=None, help="records per batch (default 32 on CPU, "
                                                                     "256 on a GPU)")
    parser.add_argument("--turns", type=int, default=1, help="conversations: user/assistant exchanges per record")
    parser.add_argument("--proportions", default=None, metavar="LABEL=W,...",
                        help="label proportions to generate (public; default: uniform)")
    parser.add_argument("--label_epsilon", type=float, default=None,
                        help="take the label proportions from a DP histogram of the training labels at this epsilon "
                             "(at the run's delta), composed with the training's in the report and the ledger")
    parser.add_argument("--format", choices=FILE_TYPES, default=None, help="the data file's type (default: the "
                                                                          "training file's)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output folder")
    parser.add_argument("--non_private_ok", action="store_true",
                        help="accept a run trained without a guarantee (epsilon inf: a non-private baseline)")
    return parser


def _check_args(args: argparse.Namespace) -> None:
    if args.rows <= 0:
        raise ConfigError(f"--rows must be positive, got {args.rows}")
    if not args.temperature > 0:
        raise ConfigError(f"--temperature must be positive, got {args.temperature}")
    if not 0 < args.top_p <= 1:
        raise ConfigError(f"--top_p must be in (0, 1], got {args.top_p}")
    for name in ("batch_size", "max_new_tokens"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ConfigError(f"--{name} must be positive, got {getattr(args, name)}")
    if args.turns < 1:
        raise ConfigError(f"--turns must be positive, got {args.turns}")
    if args.proportions is not None and args.label_epsilon is not None:
        raise ConfigError("give --proportions or --label_epsilon, not both")
    out = Path(args.out)
    if out.exists() and not args.overwrite and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out} exists: choose a new folder, or add --overwrite")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{out} is a file: name a folder")
    from dpl.folders import check_writable

    check_writable(out, "output folder")


def training_report(run: Any) -> dict[str, Any] | None:
    """The privacy report of the loaded run: the run folder's (a run) or the exported folder's."""
    from dpl.lightning.report import REPORT_JSON, REPORT_KEY

    source = Path(run.source) if run.source is not None else None
    if run.checkpoint is None:
        path = source / REPORT_JSON if source is not None else None
        return json.loads(path.read_text()) if path is not None and path.is_file() else None
    report = run.checkpoint.get(REPORT_KEY)
    final = source.parent.parent / REPORT_JSON if source is not None else None
    if final is not None and final.is_file():
        latest = json.loads(final.read_text())
        if report is None or ((latest.get("run") or {}).get("id") == (report.get("run") or {}).get("id")
                              and latest.get("steps_taken") == report.get("steps_taken")):
            return latest
    return report


def _check_private(report: dict[str, Any] | None, non_private_ok: bool, where: str) -> dict[str, Any]:
    if report is None:
        raise ConfigError(f"{where} has no privacy report: it was not trained by dpl fit, so its data carries no "
                          f"guarantee")
    eps = float(report.get("epsilon", math.inf))
    if not math.isfinite(eps) and not non_private_ok:
        raise ConfigError(f"{where} was not trained private (epsilon = inf): its samples carry no guarantee "
                          f"(--non_private_ok to sample it anyway, as a non-private baseline)")
    return report


def _histogram(args: argparse.Namespace, run: Any, report: dict[str, Any], schema: dict[str, Any],
               labels: list[str]) -> label_counts.LabelCounts:
    """The DP histogram of the run's training labels (the training data read again, as the run's config says)."""
    if run.checkpoint is None:
        raise ConfigError("--label_epsilon needs the run folder (its config names the training data), not an export")
    data = run_data_module(Path(run.source))
    values = [str(row[0]) for row in data.train_controls()]
    users = data.train_user_keys() if report.get("unit") == "user" else None
    return label_counts.dp_histogram(values, users, labels, args.label_epsilon, float(report["delta"]),
                                     str(report.get("adjacency")))


def run_data_module(ckpt: Path, **overrides: Any) -> Any:
    """The data module of the run of checkpoint ``ckpt``, rebuilt from its ``config.yaml`` (``overrides``: init
    arguments to replace, e.g. another ``data_dir``)."""
    import yaml
    from lightning.pytorch.cli import LightningArgumentParser

    from dpl.lightning.data import DPDataModule

    config = next((yaml.safe_load(p.read_text()) for p in (ckpt.parent.parent / "config.yaml",
                                                             ckpt.parent / "config.yaml") if p.is_file()), None)
    if not config or "data" not in config:
        raise ConfigError(f"{ckpt}: no config.yaml with the run's data beside it")
    if overrides:
        config["data"]["init_args"] = {**(config["data"].get("init_args") or {}), **overrides}
    parser = LightningArgumentParser(exit_on_error=False)
    parser.add_subclass_arguments(DPDataModule, "data", required=True)
    try:
        return parser.instantiate_classes(parser.parse_object({"data": config["data"]}))["data"]
    except Exception as exc:  # noqa: BLE001 - jsonargparse wraps everything
        raise ConfigError(f"cannot rebuild the run's data module from its config.yaml ({exc})") from exc


def _controls(rows: int, schema: dict[str, Any], counts: label_counts.LabelCounts | None,
              rng: random.Random) -> list[dict[str, str]]:
    """The control values of every record: the label by the counts, the other control columns uniformly."""
    label_column = schema.get("label_column")
    labels: list[str] = []
    if counts is not None:
        counts.counts = label_counts.allocate(rows, counts.proportions)
        labels = [label for label, n in counts.counts.items() for _ in range(n)]
    out = []
    for i in range(rows):
        controls = {label_column: labels[i]} if counts is not None else {}
        for column in schema["control_columns"]:
            if column != label_column:
                controls[column] = rng.choice(schema["values"][column])
        out.append(controls)
    rng.shuffle(out)
    return out


def _write_data(path: Path, file_type: str, rows: list[dict[str, Any]], columns: list[str]) -> None:
    if file_type == "jsonl":
        path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
    elif file_type == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        with open(path, "w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, fieldnames=columns, delimiter="\t" if file_type == "tsv" else ",",
                                    lineterminator="\n")
            writer.writeheader()
            writer.writerows(rows)


def _record_histogram(report: dict[str, Any], counts: label_counts.LabelCounts, ckpt: Path, out: Path,
                      release: str) -> Path:
    """The DP histogram's line in the run's privacy ledger (its events composed with the training's by
    ``dpl ledger``)."""
    from dpl.lightning.data_ledger import LEDGER_NAME, append_entry, data_label

    histogram = counts.histogram or {}
    root = ckpt.parent.parent.parent.parent  # <root>/lightning_logs/version_N/checkpoints/last.ckpt
    ledger = next((folder / LEDGER_NAME for folder in (root, ckpt.parent.parent, ckpt.parent.parent.parent)
                   if (folder / LEDGER_NAME).is_file()), root / LEDGER_NAME)
    data = report.get("training_data") or {}
    now = datetime.now(timezone.utc).isoformat(timespec="seconds")
    entry = {"run_id": release, "started": now, "ended": now, "status": "finished",
             "data_id": data.get("id"), "data": data_label(data),
             "data_files": [f["hash"] for f in data.get("files") or [] if f.get("split") == "train"],
             "epsilon": histogram["epsilon"], "delta": histogram["delta"], "steps": 1, "steps_this_run": 1,
             "steps_planned": 1, "unit": report.get("unit") or "example", "adjacency": report.get("adjacency"),
             "mechanism": "label histogram (Gaussian) of dpl synthesize", "sampling": "none",
             "accountant": "gaussian", "noise_multiplier": histogram["noise_multiplier"], "sampling_rate": 1.0,
             "events": [histogram["event"]], "scope": None, "continues": None, "release_of": (report.get("run") or {})
             .get("id"), "base_model_id": None, "run_folder": str(out.absolute()),
             "dpl_version": report.get("dpl_version")}
    append_entry(ledger, entry)
    return ledger


def synthesize(args: argparse.Namespace) -> tuple[Path, dict[str, Any], Path | None]:
    """Sample, write the folder; return it, its report and the ledger the histogram was recorded in (if any)."""
    import torch

    from dpl.synthetic import report as reporting
    from dpl.trained.runs import load_run

    _check_args(args)
    run = load_run(args.run)
    schema = getattr(run.module, "schema", None)
    if run.module.task != "synthetic" or not schema:
        raise ConfigError(f"{args.run} is a {run.module.task} run: dpl synthesize samples a run trained with "
                          f"DPSyntheticModule and SyntheticDataModule (configs/synthetic/)")
    training = _check_private(training_report(run), args.non_private_ok, args.run)
    label_column = schema.get("label_column")
    labels = list(schema["values"].get(label_column) or []) if label_column else []
    counts: label_counts.LabelCounts | None = None
    if label_column is None and (args.proportions is not None or args.label_epsilon is not None):
        raise ConfigError("the run has no label column: --proportions and --label_epsilon do not apply")
    if label_column is not None:
        if args.proportions is not None:
            counts = label_counts.given(args.proportions, labels)
        elif args.label_epsilon is not None:
            counts = _histogram(args, run, training, schema, labels)
        else:
            counts = label_counts.uniform(labels)
    conversations = schema["format"] == "messages"
    file_type = args.format or ("jsonl" if conversations or schema["file_type"] == "json" else schema["file_type"])
    if file_type not in FILE_TYPES:
        file_type = "csv"
    if conversations and file_type != "jsonl":
        raise ConfigError("conversations are written as JSON lines (--format jsonl)")
    ledger, release = None, str(uuid.uuid4())
    if counts is not None and counts.histogram is not None:  # released: recorded now, whatever happens next
        ledger = _record_histogram(training, counts, Path(run.source), Path(args.out), release)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = run.module.model.to(device).eval()
    options = SamplingOptions(temperature=args.temperature, top_p=args.top_p, seed=args.seed, turns=args.turns,
                              max_new_tokens=args.max_new_tokens or run.module.generation.max_new_tokens,
                              batch_size=args.batch_size or (256 if device.type == "cuda" else 32))
    controls = _controls(args.rows, schema, counts, random.Random(args.seed))
    sampler = Sampler(model, run.tokenizer, options, device)
    torch.manual_seed(args.seed)
    progress = Progress(args.rows, "synthesize")
    if conversations:
        sampled = sample_conversations(sampler, controls, progress.update)
        field = schema.get("messages_field") or "messages"
        rows = [{field: messages, **c} for messages, c in zip(sampled, controls)]
        columns = [field, *schema["control_columns"]]
        empty = sum(1 for m in sampled if not all(t["content"] for t in m))
    else:
        chat = (run.data.get("chat_template") or "none") != "none" and bool(getattr(run.tokenizer, "chat_template",
                                                                                      None))
        texts = sample_tables(sampler, controls, schema["text_column"], chat, progress.update)
        rows = [{schema["text_column"]: text, **c} for text, c in zip(texts, controls)]
        columns = [schema["text_column"], *schema["control_columns"]]
        empty = sum(1 for t in texts if not t)
    progress.close()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    try:
        data_file = f"train.{file_type}"
        _write_data(partial / data_file, file_type, rows, columns)
        sampling = {"temperature": args.temperature, "top_p": args.top_p, "max_new_tokens": options.max_new_tokens,
                    "seed": args.seed, "batch_size": options.batch_size, "retries": options.retries,
                    **({"turns": args.turns} if conversations else {})}
        source = Path(run.source).name if run.source is not None else str(args.run)
        report = reporting.build(training, source, data_file, args.rows, columns,
                                 "conversations" if conversations else "records", counts, label_column, sampling,
                                 empty)
        if ledger is not None:
            report["run"] = {"id": release}  # the histogram's line in the ledger names this folder
        reporting.write(report, partial)
        if out.exists():
            shutil.rmtree(out)
        partial.replace(out)
        for path in [out, *out.iterdir()]:
            path.chmod(0o755 if path.is_dir() else 0o644)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return out, report, ledger


def synthesize_command(argv: list[str]) -> int:
    """``dpl synthesize RUN --rows N --out FOLDER [...]``."""
    args = _parser().parse_args(argv)
    try:
        out, report, ledger = synthesize(args)
    except DPLError as exc:
        print(f"dpl: error: {exc}", file=sys.stderr)
        return 2
    guarantee = report["guarantee"]
    eps = float(guarantee["epsilon"])
    print(f"dpl: {args.rows} synthetic {report['synthetic_data']['kind']} written to "
          f"{out / report['synthetic_data']['file']}; epsilon = {eps:.3f}" if math.isfinite(eps) else
          f"dpl: {args.rows} synthetic {report['synthetic_data']['kind']} written to "
          f"{out / report['synthetic_data']['file']}; no guarantee (a non-private run)", end="")
    print(f", delta = {float(guarantee['delta']):.3g} ({guarantee['how']}); report {out / 'privacy.md'}"
          + (f"; the label histogram recorded in {ledger}" if ledger else ""))
    return 0
