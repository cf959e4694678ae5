"""BLT's expected prefix-sum error per buffer count: why ``nbuf`` is a maximum and the fit keeps the fewest buffers
within 1% of the best (``plugins/ftrl/strategies.py``, ``BLT_TOLERANCE``).

    python benchmarks/blt_buffers.py [--steps 100 500 2000] [--participations 1 3 10 20] [--nbuf 4]

For each run length T and number of participations k (every = T // k), one BLT fit per buffer count 1..nbuf
(``_blt_strategy``) and the plugin's choice (``make_strategy("blt", ...)``); errors in units of sigma * C. Each
buffer is a model-size vector read and written every step, so fewer buffers at (almost) the same error is cheaper.
"""

from __future__ import annotations

import argparse

from dpl_plugins.ftrl import strategies as S


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, nargs="+", default=[100, 500, 2000])
    parser.add_argument("--participations", type=int, nargs="+", default=[1, 3, 10, 20])
    parser.add_argument("--nbuf", type=int, default=4)
    args = parser.parse_args()
    counts = range(1, args.nbuf + 1)
    print("| T | participations | " + " | ".join(f"{n} buffer{'s' * (n > 1)}" for n in counts)
          + f" | 2 vs {args.nbuf} | chosen |")
    print("|---" * (len(counts) + 4) + "|")
    for steps in args.steps:
        for k in args.participations:
            every = max(1, steps // k)
            errors = [S._blt_strategy(steps, every, n, S.default_nu(steps)).expected_error for n in counts]
            chosen = S.make_strategy("blt", steps, every, nbuf=args.nbuf)
            pair = f"{errors[1] / errors[-1]:.3f}" if args.nbuf >= 2 else "-"
            print(f"| {steps} | {k} | " + " | ".join(f"{e:.3f}" for e in errors)
                  + f" | {pair} | {chosen.params['nbuf']} ({chosen.expected_error:.3f}) |", flush=True)


if __name__ == "__main__":
    main()
