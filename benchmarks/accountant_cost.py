"""The accountant's cost per training step: epsilon for the current step, logged every step of a 10^4-step plan.

    python benchmarks/accountant_cost.py [--steps 10000] [--step-time 0.005] [--samples 40]

"before": one PRV evaluation per step (``accounting.epsilon_for(sigma, q, t, delta)``: every t is a new
composition), timed on ``--samples`` step counts spread over the plan and extrapolated to all steps. "after":
``PrivacyLedger.epsilon``, i.e. an :class:`~dpl.core.accounting.EpsilonSchedule` over the composition of the run's
events (:func:`dpl.core.accounting.events.epsilon`), asked at
every step of the plan after the setup's ask for the total, with ``--step-time`` seconds of idle CPU between
steps (a GPU step waits on the device); reports the time the training loop spends in it and the time its
background thread computes. Side by side in one run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

from dpl.core import accounting
from dpl.core.accounting import events
from dpl.core.ledger import PrivacyLedger, make_plan
from dpl.core.mechanism import PoissonGaussian
from dpl.core.privacy import PrivacyConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--step-time", type=float, default=0.005)
    parser.add_argument("--samples", type=int, default=40)
    parser.add_argument("--sample-rate", type=float, default=0.01)
    parser.add_argument("--delta", type=float, default=1e-5)
    args = parser.parse_args()
    q, delta, steps = args.sample_rate, args.delta, args.steps
    sigma = accounting.calibrate_noise_multiplier(3.0, delta, q, steps)

    before = []
    for i in range(args.samples):
        t = 1 + (steps - 1) * i // max(args.samples - 1, 1)
        start = time.perf_counter()
        accounting.epsilon_for(sigma * (1 + 1e-9), q, t, delta)  # a sigma no cache has seen
        before.append(time.perf_counter() - start)

    spent = {"loop": 0.0, "thread": 0.0, "evaluations": 0}

    def timed_epsilon(*a, **k):  # the ledger's evaluations, timed by thread
        start = time.perf_counter()
        try:
            return original(*a, **k)
        finally:
            if threading.current_thread() is not threading.main_thread():
                spent["thread"] += time.perf_counter() - start
            spent["evaluations"] += 1

    original, events.epsilon = events.epsilon, timed_epsilon
    try:
        privacy = PrivacyConfig(noise_multiplier=sigma, batch_size=64, target_delta=delta)
        ledger = PrivacyLedger(privacy, make_plan(privacy, population=round(64 / q), steps=steps), PoissonGaussian(q))
        setup = time.perf_counter()
        ledger.epsilon(steps)  # setup: the plan's epsilon
        setup = time.perf_counter() - setup
        per_step = []
        for t in range(1, steps + 1):
            time.sleep(args.step_time)
            start = time.perf_counter()
            ledger.epsilon(t)
            per_step.append(time.perf_counter() - start)
    finally:
        events.epsilon = original
    row = {"steps": steps, "sample_rate": q, "delta": delta, "sigma": sigma, "step_time_s": args.step_time,
           "before_mean_s": statistics.mean(before), "before_max_s": max(before),
           "before_total_s": statistics.mean(before) * steps,
           "after_setup_s": setup, "after_mean_s": statistics.mean(per_step),
           "after_median_s": statistics.median(per_step), "after_max_s": max(per_step),
           "after_total_s": sum(per_step), "after_thread_s": spent["thread"],
           "after_evaluations": spent["evaluations"]}
    print(f"before: {row['before_mean_s'] * 1e3:.1f} ms a step (max {row['before_max_s'] * 1e3:.0f} ms), "
          f"{row['before_total_s']:.0f} s for {steps} steps (extrapolated from {args.samples} step counts)")
    print(f"after:  {row['after_mean_s'] * 1e3:.3f} ms a step (median {row['after_median_s'] * 1e6:.1f} us, max "
          f"{row['after_max_s'] * 1e3:.0f} ms), {row['after_total_s']:.2f} s in the loop + {setup:.2f} s at setup; "
          f"{row['after_thread_s']:.0f} s in the background thread ({spent['evaluations']} PRV evaluations)")
    print(f"ratio (loop time per step, before / after): {row['before_mean_s'] / row['after_mean_s']:.0f}x")
    print(json.dumps(row))


if __name__ == "__main__":
    main()
