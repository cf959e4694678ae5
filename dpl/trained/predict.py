"""``dpl predict``: labels and probabilities (classification) or completions (generation) for new inputs, from a
run (its checkpoint) or an exported folder.

Inputs: a ``.jsonl``/``.json``, ``.csv``/``.tsv`` file (columns named as in training: ``data.text_column``, or the
fields of the prompt template), or plain text with one input per line (a file or stdin, ``-``). Outputs: JSON lines
(default) or CSV, on stdout or into ``--output``; each row repeats the input's fields.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dpl.errors import ConfigError, DPLError

if TYPE_CHECKING:  # torch and the run loader are imported when used: dpl predict --help stays fast
    from dpl.trained.runs import LoadedRun


def read_inputs(source: str, default_field: str) -> list[dict[str, Any]]:
    """Rows of fields: JSON lines/JSON, CSV/TSV by extension; anything else (and stdin) one text per line, as
    ``{default_field: line}`` (a stdin line that starts with ``{`` is read as JSON)."""
    if source == "-":
        text, suffix = sys.stdin.read(), ""
    else:
        path = Path(source)
        if not path.is_file():
            raise ConfigError(f"input {source} not found")
        text, suffix = path.read_text(encoding="utf-8"), path.suffix.lower()
    if suffix in (".csv", ".tsv"):
        return [dict(r) for r in csv.DictReader(io.StringIO(text), delimiter="\t" if suffix == ".tsv" else ",")]
    if suffix == ".json":
        data = json.loads(text)
        return list(data) if isinstance(data, list) else [data]
    rows = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        if suffix == ".jsonl" or (suffix == "" and line.lstrip().startswith("{")):
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{source} line {number}: not JSON ({exc.msg})") from None
        else:
            rows.append({default_field: line})
    return rows


def predict(run: LoadedRun, rows: list[dict[str, Any]], batch_size: int = 32) -> list[dict[str, Any]]:
    """One output row per input row: its fields plus what the task predicts (``label``/``probabilities``,
    ``prompt``/``completion``)."""
    import torch

    outputs: list[dict[str, Any]] = []
    with torch.inference_mode():
        batches = run.module.inference_batches(rows, run.tokenizer, run.data, batch_size)
        for index, (batch, extras) in enumerate(batches):
            outputs += [{**more, **out} for more, out in zip(extras, run.module.predict_step(batch, index))]
    return [{**row, **out} for row, out in zip(rows, outputs)]


def write_outputs(rows: list[dict[str, Any]], out: Any, fmt: str) -> None:
    if fmt == "jsonl":
        for row in rows:
            out.write(json.dumps(row, ensure_ascii=False) + "\n")
        return
    flat = []
    for row in rows:
        probabilities = row.get("probabilities") or {}
        flat.append({**{k: v for k, v in row.items() if k != "probabilities"},
                     **{f"p_{name}": value for name, value in probabilities.items()}})
    columns = list(dict.fromkeys(k for row in flat for k in row))
    writer = csv.DictWriter(out, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    writer.writerows(flat)


def predict_command(argv: list[str]) -> int:
    """``dpl predict RUN [INPUT] [--output FILE] [--format jsonl|csv] [--batch_size N] [--max_new_tokens N]``."""
    parser = argparse.ArgumentParser(prog="dpl predict", description=__doc__.split("\n\n")[0])
    parser.add_argument("run", help="a run folder (lightning_logs/version_N), a .ckpt file, or an exported folder")
    parser.add_argument("input", nargs="?", default="-", help="input file (.jsonl .json .csv .tsv, or one text a "
                                                               "line); - or nothing: stdin")
    parser.add_argument("--output", "-o", default="-", help="output file (default: stdout)")
    parser.add_argument("--format", choices=("jsonl", "csv"), default=None,
                        help="output format (default: from --output's extension, else jsonl)")
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--max_new_tokens", type=int, default=None, help="generation: tokens per completion")
    args = parser.parse_args(argv)
    fmt = args.format or ("csv" if args.output.endswith((".csv", ".tsv")) else "jsonl")
    from dpl.trained.runs import load_run

    try:
        run = load_run(args.run)
        if args.max_new_tokens is not None and hasattr(run.module, "generation"):
            run.module.generation.max_new_tokens = args.max_new_tokens
        rows = predict(run, read_inputs(args.input, run.module.input_field(run.data)), args.batch_size)
    except DPLError as exc:
        print(f"dpl: error: {exc}", file=sys.stderr)
        return 2
    if args.output == "-":
        write_outputs(rows, sys.stdout, fmt)
    else:
        with open(args.output, "w", encoding="utf-8", newline="") as out:
            write_outputs(rows, out, fmt)
        print(f"dpl: {len(rows)} predictions written to {args.output}", file=sys.stderr)
    return 0
