"""Cost per step of ftrl's correlated noise on MiniLM full fine-tuning (22.7M parameters), side by side in one run.

    OMP_NUM_THREADS=1 nice -n 5 python benchmarks/ftrl_cost.py [--repeats 8] [--batch 32] [--tokens 64] \
        [--steps 1000] [--full] [--json out.json] [--method full|lora]

Variants (same model, same batch): the default Gaussian mechanism, ftrl independent, ftrl banded (shuffled,
bands=4: 3 stored vectors), ftrl BLT (nbuf <= 4: the fit keeps the fewest buffers within 1% of the best), amplified banded (cyclic Poisson, bands=4 and 16), and, for
reference, banded and BLT with the unfused streams (one elementwise pass per buffer and operation). The cost of the
noise is the ``privatize`` hook alone on a zero clipped sum of the model's shapes, minus the default's, as a
fraction of one full private step of the default (forward, per-example clipping, noise, SGD update); every step
runs through dpl's training loop (``dpl.PrivateTraining``), the noise alone timed inside a step on an empty batch.
Timings are interleaved round-robin (machine noise hits all alike); medians. ``--full`` also times the full step of
every variant (slow: ~9 s a step here). Memory: the floats the noise stream holds between steps (exact, counted from
its tensors) against the goal, and the process's peak RSS growth while the variant is set up and warmed up
(coarse: the allocator keeps freed memory).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time

import torch

from dpl_plugins.ftrl.streams import BandedStream, BLTStream

# benchmarks/ is on sys.path when run as a script
from step_time import classification_loss, fixed_batch_training, load, make_batch  # noqa: E402


class UnfusedBLT(BLTStream):
    """Reference: the BLT update as 3 nbuf elementwise passes over the model (the implementation before fusion)."""

    def push(self, key, z):
        buf = self.buffers.get(key)
        if buf is None:
            buf = self.buffers[key] = torch.zeros((len(self.omega), *z.shape), dtype=z.dtype, device=z.device)
        for j, om in enumerate(self.omega):
            z.sub_(buf[j], alpha=om)
        for j, th in enumerate(self.theta):
            buf[j].mul_(th).add_(z)
        return z


class UnfusedBanded(BandedStream):
    """Reference: the banded solve as bands - 1 elementwise passes over a list of past outputs (before fusion)."""

    in_place = False

    def push(self, key, z):
        for j, past in enumerate(getattr(self, "history", []), start=1):
            z.sub_(past[key], alpha=self.c[j])
        self.__dict__.setdefault("current", {})[key] = z
        return z

    def end_step(self):
        self.history = ([self.__dict__.pop("current", {})] + getattr(self, "history", []))[:len(self.c) - 1]

    def memory_floats(self):
        return sum(t.numel() for h in getattr(self, "history", []) for t in h.values())


UNFUSED = {"blt": UnfusedBLT, "banded": UnfusedBanded}


def variant(model, batch, plugins: dict | None, steps: int, unfused: bool = False):
    size = batch["labels"].shape[0]
    training = fixed_batch_training(model, classification_loss(model), size, plugins, lr=1e-5, steps=steps)
    pm = training.engine.plugin_manager
    plugin = dict(pm.list_name_plugin()).get("ftrl")
    if unfused:
        new_stream = plugin._new_stream
        plugin._new_stream = lambda: UNFUSED[plugin.strategy.family](*_stream_args(new_stream()))
    empty = {key: value[:0] for key, value in batch.items()}

    def step():
        training.step(batch)

    def privatize_only():
        """The privatize hook alone, timed inside a step on an empty batch (a zero clipped sum of the model's
        shapes, no forward pass): isolates the noise cost."""
        started, spent = {}, []

        def before(name, impls, kwargs):
            started[name] = time.perf_counter()

        def after(outcome, name, impls, kwargs):
            if name == "privatize":
                spent.append(time.perf_counter() - started[name])

        undo = pm.add_hookcall_monitoring(before, after)
        try:
            training.step(empty)
        finally:
            undo()
        return spent[0]

    def held_floats() -> int:
        stream = getattr(plugin, "stream", None)
        return 0 if stream is None else stream.memory_floats()

    held_floats.blt_buffers = plugin.strategy.params.get("nbuf") if plugin is not None else None  # the fit's count
    return step, held_floats, privatize_only


def _stream_args(stream) -> tuple:
    return (stream.omega, stream.theta) if isinstance(stream, BLTStream) else (stream.c,)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--steps", type=int, default=1000, help="planned run length (for the fits)")
    parser.add_argument("--full", action="store_true", help="time the full step of every variant, not only the default")
    parser.add_argument("--json", default=None)
    parser.add_argument("--method", choices=("full", "lora"), default="full",
                        help="lora: LoRA r 8 (0.3M trainable), a quick check")
    args = parser.parse_args()
    from dpl.allocator import keep_freed_memory

    keep_freed_memory()  # as the dpl command does (DPL_MALLOC=system: glibc's default)
    torch.manual_seed(0)
    model = load(args.method)
    d = sum(p.numel() for p in model.parameters() if p.requires_grad)
    batch = make_batch(args.batch, args.tokens)
    configs = {
        "gaussian (default)": None,
        "ftrl independent": {"ftrl": {"noise": "independent"}},
        "ftrl banded (bands=4)": {"ftrl": {"noise": "banded", "sampling": "shuffle", "bands": 4}},
        "ftrl blt (nbuf<=4)": {"ftrl": {"noise": "blt", "nbuf": 4}},
        "amplified banded (bands=4)": {"ftrl": {"noise": "banded", "sampling": "cyclic_poisson", "bands": 4}},
        "amplified banded (bands=16)": {"ftrl": {"noise": "banded", "sampling": "cyclic_poisson", "bands": 16}},
        "unfused banded (bands=4)": {"ftrl": {"noise": "banded", "sampling": "shuffle", "bands": 4}},
        "unfused blt (nbuf<=4)": {"ftrl": {"noise": "blt", "nbuf": 4}},
    }
    goal_floats = {"ftrl banded (bands=4)": 3 * d, "amplified banded (bands=4)": 3 * d,
                   "amplified banded (bands=16)": 15 * d, "unfused banded (bands=4)": 3 * d}
    variants, held, rss, privs = {}, {}, {}, {}
    for name, plugins in configs.items():
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        step, floats, priv = variant(model, batch, plugins, args.steps, unfused=name.startswith("unfused"))
        if args.full or plugins is None:
            step()  # warm-up
        for _ in range(16):  # fills the banded ring / BLT buffers
            priv()
        rss[name] = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024  # MiB (peak growth)
        variants[name], held[name], privs[name] = step, floats, priv
        if "blt" in name:  # BLT keeps the fewest buffers within 1% of the best fit (at most nbuf): fitted x d
            goal_floats[name] = floats.blt_buffers * d
    times: dict[str, list[float]] = {k: [] for k in variants}
    timed = variants if args.full else {"gaussian (default)": variants["gaussian (default)"]}
    for _ in range(args.repeats if args.full else 3):
        for name, fn in timed.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    noise_times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(args.repeats):
        for name, fn in privs.items():
            noise_times[name].append(fn())
    base = statistics.median(times["gaussian (default)"])
    base_noise = statistics.median(noise_times["gaussian (default)"])
    rows = []
    print(f"MiniLM {args.method} fine-tuning, d = {d:,} trainable parameters, batch {args.batch} x {args.tokens} tokens, "
          f"{args.repeats} interleaved repeats, torch threads {torch.get_num_threads()}; the denominator: the default's "
          f"full step, {len(times['gaussian (default)'])} repeats")
    print(f"{'variant':28s} {'median s':>9s} {'vs default':>10s} {'held floats':>14s} {'goal floats':>12s} "
          f"{'peak RSS growth MiB':>20s} {'privatize s':>11s} {'noise overhead / step':>22s}")
    for name in variants:
        med = statistics.median(times[name]) if times[name] else None
        row = {"variant": name, "median_s": med, "ratio": None if med is None else med / base, "held_floats": held[name](),
               "goal_floats": goal_floats.get(name), "rss_growth_mib": rss[name],
               "times": times[name], "privatize_s": statistics.median(noise_times[name]),
               "noise_overhead": (statistics.median(noise_times[name]) - base_noise) / base}
        rows.append(row)
        goal = f"{row['goal_floats']:,}" if row["goal_floats"] else "-"
        shown = "-" if med is None else f"{med:.3f}"
        ratio = "-" if med is None else f"{med / base:.3f}"
        print(f"{name:28s} {shown:>9s} {ratio:>10s} {row['held_floats']:14,d} {goal:>12s} "
              f"{rss[name]:20.0f} {row['privatize_s']:11.3f} {100 * row['noise_overhead']:21.1f}%")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"d": d, "batch": args.batch, "tokens": args.tokens, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
