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
import string
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

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


def _field(row: dict[str, Any], name: str, where: int) -> str:
    if name not in row:
        raise ConfigError(f"input row {where}: no field {name!r} (fields: {', '.join(map(str, row)) or 'none'})")
    return str(row[name])


def _prompt_fields(template: str) -> list[str]:
    return [name for _, name, _, _ in string.Formatter().parse(template) if name]


def _classification_batches(run: LoadedRun, rows: list[dict[str, Any]], size: int) -> Iterator[dict[str, Any]]:
    column = run.data.get("text_column") or "sentence"
    pair = run.data.get("text_pair_column")
    length = run.data.get("max_length") or 512
    for start in range(0, len(rows), size):
        chunk = rows[start:start + size]
        texts = [_field(r, column, start + i + 1) for i, r in enumerate(chunk)]
        pairs = [_field(r, pair, start + i + 1) for i, r in enumerate(chunk)] if pair else None
        if run.data.get("template"):  # prompt-based classification: each text in its cloze template
            from dpl.tasks.data.prompt import render_ids

            ids = [{"input_ids": render_ids(run.tokenizer, run.data["template"], t, length)} for t in texts]
            yield dict(run.tokenizer.pad(ids, return_tensors="pt"))
        else:
            yield dict(run.tokenizer(texts, pairs, truncation=True, max_length=length, padding=True,
                                     return_tensors="pt"))


def render_prompt(run: LoadedRun, row: dict[str, Any], where: int) -> str:
    """The prompt of a generation input: ``row`` through the run's prompt template (a row with only ``text``, as
    from plain-text input, fills the template's one field)."""
    template = run.data.get("prompt_template") or "{prompt}"
    fields = _prompt_fields(template)
    if set(row) == {"text"} and len(fields) == 1:
        row = {fields[0]: row["text"]}
    return template.format_map({name: _field(row, name, where) for name in fields})


def _generation_batches(run: LoadedRun, prompts: list[str], size: int) -> Iterator[dict[str, Any]]:
    import torch

    tokenizer = run.tokenizer
    budget = max(1, int(run.data.get("max_length") or 512) - 1)
    for start in range(0, len(prompts), size):
        ids = [list(x)[-budget:] for x in tokenizer(prompts[start:start + size])["input_ids"]]
        length = max(len(x) for x in ids)
        pad = tokenizer.pad_token_id
        yield {"input_ids": torch.tensor([[pad] * (length - len(x)) + x for x in ids]),
               "attention_mask": torch.tensor([[0] * (length - len(x)) + [1] * len(x) for x in ids])}


def predict(run: LoadedRun, rows: list[dict[str, Any]], batch_size: int = 32) -> list[dict[str, Any]]:
    """One output row per input row: its fields plus ``label``/``probabilities`` or ``prompt``/``completion``."""
    import torch

    module = run.module
    if run.task == "generation":
        prompts = [render_prompt(run, row, i + 1) for i, row in enumerate(rows)]
        batches = _generation_batches(run, prompts, batch_size)
        extra = [{"prompt": p} for p in prompts]
    else:
        batches, extra = _classification_batches(run, rows, batch_size), [{} for _ in rows]
    outputs: list[dict[str, Any]] = []
    with torch.inference_mode():
        for index, batch in enumerate(batches):
            outputs += module.predict_step(batch, index)
    return [{**row, **more, **out} for row, more, out in zip(rows, extra, outputs)]


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
        if args.max_new_tokens is not None and run.task == "generation":
            run.module.generation.max_new_tokens = args.max_new_tokens
        default_field = run.data.get("text_column") or "sentence" if run.task == "classification" else "text"
        rows = predict(run, read_inputs(args.input, default_field), args.batch_size)
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
