"""Cost of drawing DP noise: the default generator (torch MT19937, whole state from OS entropy) vs
``privacy.secure_noise`` (ChaCha20 keyed from os.urandom, float64 Box-Muller, :mod:`dpl.core.noise`), float32 noise
as the step draws it, side by side in one run.

    OMP_NUM_THREADS=1 python benchmarks/noise_cost.py [--sizes 1000000 22700000] [--repeats 3]

22.7M is MiniLM's parameter count (full fine-tuning: one noise draw per parameter per step); 0.3M a LoRA r=8.
Reports seconds per draw and the ratio; compare with a step's time (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import time

from dpl.core.noise import SecureNormal, normal
from dpl.core.sampling import secure_generator


def best_of(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[300_000, 22_700_000])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rows = []
    for size in args.sizes:
        gen, secure = secure_generator(), SecureNormal()
        mt = best_of(lambda: normal((size,), gen), args.repeats)
        cs = best_of(lambda: normal((size,), secure), args.repeats)
        rows.append({"coordinates": size, "mt19937_s": mt, "secure_s": cs, "ratio": cs / mt})
        print(f"{size:>11,d} coordinates: MT19937 {mt:.4f} s, secure {cs:.4f} s ({cs / mt:.2f}x)", flush=True)
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
