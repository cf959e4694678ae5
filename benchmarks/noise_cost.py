"""Cost of drawing DP noise, float32 as the step draws it, side by side in one run:

* ``keyed``: the default source on the CPU (:class:`dpl.core.noise.KeyedNormal`: ChaCha20 under a secret key,
  52-bit uniforms, float64 Box-Muller rounded once);
* ``secure``: ``privacy.secure_noise`` (the same under a fresh ``os.urandom`` key every draw);
* ``float64``: a ``torch.Generator`` drawn in float64 and rounded once (how dpl draws from a CUDA generator; on
  the CPU for comparison);
* ``float32 randn``: torch's float32 ``randn``, the reference cost, which dpl does not use for noise: its 24-bit
  uniforms cut the tails at 5.77 standard deviations (``tests/test_noise.py``).

    OMP_NUM_THREADS=1 python benchmarks/noise_cost.py [--sizes 300000 22700000] [--repeats 5]

22.7M is MiniLM's parameter count (full fine-tuning: one noise draw per parameter per step); 0.3M a LoRA r=8.
Reports the best of ``--repeats`` seconds per draw and each source's ratio to float32 ``randn``.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from dpl.core.noise import KeyedNormal, SecureNormal, normal
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
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    rows = []
    for size in args.sizes:
        gen = secure_generator()
        draws = {"float32 randn": lambda: torch.randn(size, generator=gen),
                 "keyed": lambda: normal((size,), keyed),
                 "secure": lambda: normal((size,), secure),
                 "float64": lambda: normal((size,), gen)}
        keyed, secure = KeyedNormal(), SecureNormal()
        seconds = {name: best_of(draw, args.repeats) for name, draw in draws.items()}
        base = seconds["float32 randn"]
        rows.append({"coordinates": size, "threads": torch.get_num_threads(), "seconds": seconds,
                     "ratio_to_float32_randn": {k: v / base for k, v in seconds.items()}})
        print(f"{size:>11,d} coordinates: " + ", ".join(f"{k} {v:.4f} s ({v / base:.2f}x)" for k, v in seconds.items()),
              flush=True)
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
