"""Time to calibrate sigma: dpl.core.accounting vs prv-accountant's own search, side by side.

    python benchmarks/calibration.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

from dpl.core import accounting
from dpl.core.accounting import prv

CASES = [(0.03, 400, 3.0, 1e-5), (0.01, 3000, 3.0, 1e-5), (0.032, 93, 8.0, 2.3e-4)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from prv_accountant.dpsgd import find_noise_multiplier

    accounting.epsilon_for(1.0, 0.03, 10, 1e-5)  # import and warm-up outside the timings
    print("| q | T | ε | δ | dpl σ | dpl s (median) | prv-accountant σ | prv-accountant s |")
    print("|---|---|---|---|---|---|---|---|")
    for q, steps, eps, delta in CASES:
        dpl_times, ref_times = [], []
        for _ in range(args.repeats):
            prv._prv_bounds.cache_clear()  # time a cold calibration each repeat
            start = time.perf_counter()
            sigma = accounting.calibrate_noise_multiplier(eps, delta, q, steps)
            dpl_times.append(time.perf_counter() - start)
        start = time.perf_counter()
        ref = find_noise_multiplier(sampling_probability=q, num_steps=steps, target_epsilon=eps, target_delta=delta,
                                    eps_error=0.01)
        ref_times.append(time.perf_counter() - start)
        print(f"| {q} | {steps} | {eps} | {delta:g} | {sigma:.4f} | {statistics.median(dpl_times):.3f} | "
              f"{ref:.4f} | {ref_times[0]:.2f} |")


if __name__ == "__main__":
    main()
