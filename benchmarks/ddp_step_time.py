"""DDP and FSDP on 2 CPU processes vs 1 process at the same global batch: private step time, examples/s and what
each rank holds (parameters, gradients, optimizer state), side by side.

    OMP_NUM_THREADS=1 python benchmarks/ddp_step_time.py [--steps 12] [--batch 64] [--hidden 256] [--layers 4]

A BERT-shaped classifier built from a config (random weights, no download) on random tokens, DP-SGD (default
clip + gaussian, Poisson sampling at q = batch / N, the same seed, hence the same global batches in every run).
Three runs in one invocation, one after the other:

* ``1 process, 1 thread``: the reference;
* ``1 process, 2 threads``: the same two cores used by intra-op parallelism instead of processes;
* ``DDP, 2 processes x 1 thread``: dpl's ``DPDDPStrategy`` (Lightning's DDP, forked, gloo), dpl shards each global batch;
* ``FSDP, 2 processes x 1 thread``: dpl's ``DPFSDPStrategy`` (FSDP2 ``fully_shard``, forked, gloo).

"Held" is counted from the tensors rank 0 holds after training (this rank's shard of each parameter, its gradient
and the AdamW moments); peak RSS (``ru_maxrss``) is the process's, shared copy-on-write pages of the fork included.

Step time is measured on rank 0 around ``training_step`` (the clipped-sum all-reduce and the noise included);
the first ``--warmup`` steps are dropped. Results: a table on stdout and ``benchmarks/results/ddp_step_time.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from dpl.lightning.data import DPDataModule
from dpl.lightning.ddp import DPDDPStrategy
from dpl.lightning.fsdp import DPFSDPStrategy
from dpl.lightning.module import DPModule
from dpl.core.privacy import PrivacyConfig


class RandomTokens(Dataset):
    def __init__(self, n: int, seq: int, vocab: int = 1000) -> None:
        gen = torch.Generator().manual_seed(0)
        self.ids = torch.randint(1, vocab, (n, seq), generator=gen)
        self.labels = torch.randint(0, 2, (n,), generator=gen)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


class TokenData(DPDataModule):
    def __init__(self, n: int, seq: int) -> None:
        super().__init__(eval_batch_size=64)
        self.n, self.seq = n, seq

    def setup(self, stage: str | None = None) -> None:
        self.train_set = RandomTokens(self.n, self.seq)
        self.val_set = RandomTokens(64, self.seq)

    def collate(self, examples):
        if not examples:
            return {"input_ids": torch.zeros(0, self.seq, dtype=torch.long), "labels": torch.zeros(0, dtype=torch.long)}
        return {k: torch.stack([e[k] for e in examples]) for k in ("input_ids", "labels")}


class BertModule(DPModule):
    task = "classification"

    def __init__(self, hidden: int = 256, layers: int = 4, **kwargs) -> None:
        super().__init__(**kwargs)
        self.hidden, self.layers = hidden, layers

    def build_model(self):
        from transformers import BertConfig, BertForSequenceClassification

        torch.manual_seed(0)
        config = BertConfig(vocab_size=1000, hidden_size=self.hidden, num_hidden_layers=self.layers,
                            num_attention_heads=4, intermediate_size=4 * self.hidden, max_position_embeddings=512,
                            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=2)
        return BertForSequenceClassification(config).train()

    def per_example_loss(self, batch):
        logits = self.model(input_ids=batch["input_ids"]).logits
        return F.cross_entropy(logits, batch["labels"], reduction="none")


class StepTimer(L.Callback):
    def __init__(self, out: Path) -> None:
        self.out, self.times, self.sizes, self.t0 = out, [], [], 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.times.append(time.perf_counter() - self.t0)
        self.sizes.append(int(batch["labels"].shape[0]))

    def on_train_end(self, trainer, pl_module):
        import resource

        from dpl.core.sharding import is_sharded

        def local(t):
            return t.to_local() if is_sharded(t) else t

        params = list(pl_module.model.parameters())
        held = {"parameters": sum(local(p).numel() * local(p).element_size() for p in params),
                "gradients": sum(local(p.grad).numel() * local(p.grad).element_size() for p in params
                                 if p.grad is not None),
                "optimizer": sum(local(v).numel() * local(v).element_size()
                                 for state in trainer.optimizers[0].state.values() for v in state.values()
                                 if torch.is_tensor(v) and v.dim() > 0)}
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(
            {"times": self.times, "sizes": self.sizes, "held": held,
             "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
             "params": sum(p.numel() for p in pl_module.trainable.values())}))


def run(label: str, devices: int, threads: int, args, fsdp: bool = False) -> dict:
    torch.set_num_threads(threads)
    out = Path(tempfile.mkdtemp(prefix="ddp_bench_"))
    n = args.batch * 20
    module = BertModule(hidden=args.hidden, layers=args.layers,
                        privacy=PrivacyConfig(noise_multiplier=1.0, batch_size=args.batch,
                                              physical_batch_size=args.batch, seed=1),
                        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4))
    strategy = ("auto" if devices == 1 else DPFSDPStrategy(start_method="fork") if fsdp
                else DPDDPStrategy(start_method="fork"))
    trainer = L.Trainer(max_epochs=1, limit_train_batches=args.steps, accelerator="cpu", devices=devices,
                        strategy=strategy, use_distributed_sampler=False, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        limit_val_batches=0, callbacks=[StepTimer(out)])
    start = time.perf_counter()
    trainer.fit(module, TokenData(n, args.seq))
    wall = time.perf_counter() - start
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(devices)]
    times = ranks[0]["times"][args.warmup:]
    global_examples = sum(sum(r["sizes"][args.warmup:]) for r in ranks)
    step = sum(times) / len(times)
    return {"run": label, "processes": devices, "threads_per_process": threads, "params": ranks[0]["params"],
            "steps_timed": len(times), "mean_step_s": step, "examples_per_s": global_examples / sum(times),
            "mean_global_batch": global_examples / len(times), "wall_s_incl_startup": wall,
            "held_mb_rank0": {k: v / 2 ** 20 for k, v in ranks[0]["held"].items()},
            "peak_rss_mb_rank0": ranks[0]["peak_rss_mb"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--json", default=str(Path(__file__).parent / "results" / "ddp_step_time.json"))
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rows = [run("1 process, 1 thread", 1, 1, args), run("1 process, 2 threads", 1, 2, args),
            run("DDP, 2 processes x 1 thread", 2, 1, args), run("FSDP, 2 processes x 1 thread", 2, 1, args, True)]
    base = rows[0]["mean_step_s"]
    print(f"\nBERT-shaped classifier, {rows[0]['params'] / 1e6:.2f}M trainable parameters, seq {args.seq}, "
          f"expected global batch {args.batch}, {rows[0]['steps_timed']} timed steps, cpu count {os.cpu_count()}")
    print(f"{'run':32s} {'step (s)':>9s} {'examples/s':>11s} {'speed-up':>9s} {'held MB (p/g/opt)':>20s} {'RSS MB':>7s}")
    for row in rows:
        row["speedup_vs_1x1"] = base / row["mean_step_s"]
        held = row["held_mb_rank0"]
        print(f"{row['run']:32s} {row['mean_step_s']:9.3f} {row['examples_per_s']:11.1f} {row['speedup_vs_1x1']:8.2f}x "
              f"{held['parameters']:6.1f}/{held['gradients']:5.1f}/{held['optimizer']:6.1f} "
              f"{row['peak_rss_mb_rank0']:7.0f}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows,
                                           "load_average_at_end": os.getloadavg()}, indent=2))


if __name__ == "__main__":
    main()
