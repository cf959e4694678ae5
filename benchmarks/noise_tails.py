"""How far the default noise reaches: the largest |z| of torch's CPU ``randn`` in float32 and float64 from a
``torch.Generator``, against the bound its Box-Muller transform allows (uniforms of 24 / 53 bits:
|z| <= sqrt(-2 ln 2^-bits)), and what each costs for MiniLM's 22.7M coordinates.

    python benchmarks/noise_tails.py            # 10 x 22.7M draws per dtype

An untruncated standard Gaussian exceeds t in n draws about 2 n (1 - Phi(t)) times; the script prints that count
for the largest float32 value seen, so a shortfall is visible.
"""

from __future__ import annotations

import argparse
import math
import time

import torch
from scipy import stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--coordinates", type=int, default=22_700_000)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(0)
    for dtype, bits in ((torch.float32, 24), (torch.float64, 53)):
        largest, seconds = 0.0, []
        for _ in range(args.repeats):
            start = time.perf_counter()
            z = torch.randn(args.coordinates, generator=generator, dtype=dtype)
            seconds.append(time.perf_counter() - start)
            largest = max(largest, float(z.abs().max()))
        n = args.coordinates * args.repeats
        expected = 2 * n * stats.norm.sf(largest)
        print(f"{str(dtype):14s} bound {math.sqrt(-2 * math.log(2.0 ** -bits)):.3f}  largest |z| over {n:.2e} draws "
              f"{largest:.3f}  (an untruncated Gaussian exceeds it {expected:.1f} times in expectation)  "
              f"median {sorted(seconds)[len(seconds) // 2]:.3f} s per {args.coordinates:,} draws")


if __name__ == "__main__":
    main()
