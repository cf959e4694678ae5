"""The docs' GPU tables from the results of benchmarks/gpu.py, written into docs/benchmarks.md.

    python benchmarks/gpu_tables.py [--results benchmarks/results/gpu] [--docs docs/benchmarks.md]

Reads every ``<results>/*.json`` that gpu.py wrote on a GPU (dry runs are left out) and the fine-tuning study files
under ``<results>/finetune/``, and replaces what lies between ``<!-- gpu-tables:begin -->`` and
``<!-- gpu-tables:end -->`` in the docs with: the runs (GPU, date, status and seconds per stage), the GPU tests, the
speed and memory rows (a run measured again later replaces the earlier one), and the fine-tuning rows so far. With no
result file it writes "no GPU run yet".
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- gpu-tables:begin -->", "<!-- gpu-tables:end -->"
STAGES = ("tests", "speed_memory", "finetune")


def load_reports(folder: Path) -> list[tuple[str, dict[str, Any]]]:
    """(file name, report) of every GPU run in ``folder``, oldest first (dry runs left out)."""
    reports = [(p.name, json.loads(p.read_text())) for p in sorted(folder.glob("*.json"))]
    return [(name, r) for name, r in reports if not r.get("dry_run")]


def runs_table(reports: list[tuple[str, dict[str, Any]]]) -> str:
    lines = ["| file | GPU | budget s | " + " | ".join(STAGES) + " |", "|---|---|---:|" + "---|" * len(STAGES)]
    for name, r in reports:
        stages = [r["stages"].get(s) for s in STAGES]
        cells = [f"{s['status']} ({s['seconds']:.0f} s)" if s else "not reached" for s in stages]
        lines.append(f"| {name} | {r['gpu']} | {r['budget_seconds']:.0f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def tests_table(reports: list[tuple[str, dict[str, Any]]]) -> str:
    lines = ["| file | passed | failed | skipped | failed tests |", "|---|---:|---:|---:|---|"]
    for name, r in reports:
        stage = r["stages"].get("tests") or {}
        results = stage.get("results") or {}
        if "counts" not in results:
            continue
        failed = [t for t, v in results["tests"].items() if v == "failed"]
        c = results["counts"]
        lines.append(f"| {name} | {c['passed']} | {c['failed']} | {c['skipped']} | {', '.join(failed) or '-'} |")
    errors = [f"* {name}, `{test}`: {last_line(text)}" for name, r in reports
              for test, text in (((r["stages"].get("tests") or {}).get("results") or {}).get("failures") or {}).items()]
    return "\n".join(lines + ([""] + errors if errors else []))


def last_line(text: str) -> str:
    """The last line of a failure's text that says what went wrong (its ``E   `` lines, else the message)."""
    said = [line[1:].strip() for line in text.splitlines() if line.startswith("E ")]
    return "`" + (said[-1] if said else text.splitlines()[0]).replace("`", "'")[:200] + "`"


def speed_rows(reports: list[tuple[str, dict[str, Any]]]) -> dict[tuple, dict[str, Any]]:
    """The rows of every passed speed run, keyed by GPU, run settings and step; later files replace earlier ones."""
    rows = {}
    for _, r in reports:
        for run in (r["stages"].get("speed_memory") or {}).get("results") or []:
            if run.get("profile"):  # one profiled repeat: its timings do not replace a timed run's
                continue
            for row in run.get("rows") or []:
                key = (r["gpu"], row["model"], "LoRA r=8" if run["lora"] else "full", run["precision"],
                       f"{run['batch']} x {run['tokens']}", row["step"])
                rows[key] = row
    return rows


def profile_table(reports: list[tuple[str, dict[str, Any]]]) -> str:
    """Kernels per step and the kernels that take most of its time, from the profiled speed runs."""
    lines = ["| GPU | model | step | kernels | most time: kernel ms (launches) |", "|---|---|---|---:|---|"]
    for _, r in reports:
        for run in (r["stages"].get("speed_memory") or {}).get("results") or []:
            for p in run.get("profiles") or []:
                most = "; ".join(f"`{t['name'][:48]}` {t['ms']:.2f} ({t['calls']})" for t in p["top"][:3])
                lines.append(f"| {r['gpu']} | {p['model']} | {p['step']} | {p['kernels']} | {most} |")
    return "\n".join(lines) if len(lines) > 2 else ""


def number(value: float | None, spec: str) -> str:
    return "failed" if value is None else format(value, spec)


def speed_table(reports: list[tuple[str, dict[str, Any]]]) -> str:
    lines = ["| GPU | model | tuning | precision | batch x tokens | step | examples/s | x non-private | "
             "peak memory GiB |", "|---|---|---|---|---|---|---:|---:|---:|"]
    for key, row in speed_rows(reports).items():
        memory = "n/a" if row["median_s"] and row["peak_memory_gib"] is None else number(row["peak_memory_gib"], ".2f")
        lines.append("| " + " | ".join(key) + f" | {number(row['examples_per_s'], '.1f')} | "
                     f"{number(row['x_nonprivate'], '.2f')} | {memory} |")
    return "\n".join(lines)


def finetune_tables(folder: Path) -> str:
    """finetune.py's own tables of the study files so far."""
    sys.path.insert(0, str(ROOT / "benchmarks" / "studies"))
    from finetune import denoise_table, ftrl_table, paired

    parts = []
    for study, table in (("denoise", denoise_table), ("ftrl", ftrl_table)):
        path = folder / f"finetune_{study}.json"
        if path.is_file():
            results = json.loads(path.read_text())
            if study == "denoise":
                results["paired"] = paired(results)
            cells = len(results["cells"])
            parts.append(f"{study} ({cells} cell{'' if cells == 1 else 's'} so far, `finetune/{path.name}`):\n\n"
                         + table(results))
    return "\n\n".join(parts)


def markdown(folder: Path) -> str:
    """The GPU tables of the results in ``folder`` ("no GPU run yet" without any)."""
    reports = load_reports(folder)
    if not reports:
        return "No GPU run yet."
    parts = ["Runs of `benchmarks/gpu.py` (status and seconds per stage):", runs_table(reports),
             "GPU tests (`pytest -m gpu`):", tests_table(reports),
             "dpl's DP step vs non-private vs opacus (`benchmarks/dp_step_vs_opacus.py`):", speed_table(reports)]
    profiles = profile_table(reports)
    if profiles:
        parts += ["One profiled step of each (fp32, 32 x 128; `dp_step_vs_opacus.py --profile`):", profiles]
    finetune = finetune_tables(folder / "finetune")
    if finetune:
        parts += ["Fine-tuning study rows (`benchmarks/studies/finetune.py`, bfloat16 autocast):", finetune]
    return "\n\n".join(parts)


def replace_between_markers(text: str, body: str) -> str:
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    return text[:start] + "\n" + body + "\n" + text[end:]


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results" / "gpu")
    parser.add_argument("--docs", type=Path, default=ROOT / "docs" / "benchmarks.md")
    args = parser.parse_args(argv)
    body = markdown(args.results)
    args.docs.write_text(replace_between_markers(args.docs.read_text(), body))
    print(f"wrote the GPU tables into {args.docs}")
    return body


if __name__ == "__main__":
    main()
