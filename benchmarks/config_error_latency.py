"""How long a config mistake takes to answer: wall-clock seconds from starting ``dpl`` to its ``dpl: error:`` line,
for a mistyped privacy option (answered before Lightning is imported) and, for comparison, what importing Lightning
alone costs (the time a mistake took to answer when the full parser was the first to read it).

    python benchmarks/config_error_latency.py [--repeats 5] [--results benchmarks/results/config_error_latency.json]

Each command runs in a fresh process from the repository's root; the result JSON holds every run's seconds, their
median and the machine's load average at the start.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CASES = {
    "privacy option typo": [sys.executable, "-m", "dpl.cli", "fit", "--config", "configs/quickstart.yaml",
                            "--privacy.batch_sise", "3"],
    "privacy option typo (model.privacy)": [sys.executable, "-m", "dpl.cli", "fit", "--config",
                                            "configs/quickstart.yaml", "--model.privacy.batch_sise", "3"],
    "import lightning.pytorch alone": [sys.executable, "-c", "import lightning.pytorch"],
}


def timed(command: list[str]) -> tuple[float, int, str]:
    start = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    return seconds, done.returncode, (done.stderr.strip().splitlines() or [""])[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--results", default=str(ROOT / "benchmarks" / "results" / "config_error_latency.json"))
    args = parser.parse_args()
    results = {"machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
                           "load_average_at_start": os.getloadavg()}, "cases": {}}
    for name, command in CASES.items():
        runs = [timed(command) for _ in range(args.repeats)]
        seconds = [round(s, 3) for s, _, _ in runs]
        results["cases"][name] = {"command": " ".join(["python", *command[1:]]), "seconds": seconds,
                                  "median_s": round(statistics.median(seconds), 3), "exit_code": runs[-1][1],
                                  "last_line": runs[-1][2]}
        print(f"{name}: median {statistics.median(seconds):.2f} s over {len(seconds)} runs (exit {runs[-1][1]}): "
              f"{runs[-1][2][:100]}")
    Path(args.results).parent.mkdir(parents=True, exist_ok=True)
    Path(args.results).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
