"""Accuracy of a quickstart run per sentence template (which kinds of sentences DP learns and which it does not).

    python benchmarks/quickstart_templates.py                                  # the quickstart as shipped
    python benchmarks/quickstart_templates.py --model.init_args.privacy.noise_multiplier 0   # sigma = 0
    python benchmarks/quickstart_templates.py --trainer.callbacks.size 300   # 300 evaluation sentences

Runs ``dpl fit --config configs/quickstart.yaml`` with any extra dpl arguments, then evaluates the trained model
on 3,000 fresh generated sentences (seed 7, none of them a training sentence, labels without the 3% flips) and
prints the accuracy per template of :mod:`dpl.tasks.data.quickstart_gen` (``negated``: "the plot was not dull", ...).
The evaluation sentences are public (generated), so this reads nothing private beyond the trained model.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path

import torch
from lightning.pytorch import Callback

SIZE, SEED = 3000, 7


class TemplateAccuracy(Callback):
    """At the end of fit: accuracy per template on ``size`` fresh generated sentences, printed as one table."""

    def __init__(self, size: int = SIZE) -> None:
        self.size = size

    def on_fit_end(self, trainer, pl_module) -> None:
        from dpl.tasks.data.quickstart_gen import by_template

        data = trainer.datamodule
        train = set(data._splits["train"].dataset["sentence"])
        rows = by_template(SEED, self.size, exclude=train)
        right: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        was_training = pl_module.training
        pl_module.eval()
        with torch.no_grad():
            for start in range(0, len(rows), 128):
                chunk = rows[start:start + 128]
                batch = dict(data.tokenizer([r[0] for r in chunk], padding=True, return_tensors="pt"))
                preds = pl_module(batch).argmax(-1).tolist()
                for (_, label, template), pred in zip(chunk, preds):
                    right[template][0] += int(pred == data.label_map[label])
                    right[template][1] += 1
        pl_module.train(was_training)
        total = sum(r[0] for r in right.values()) / len(rows)
        print(f"\nper-template accuracy ({len(rows)} fresh sentences, seed {SEED}, no label noise): all {total:.3f}")
        for template, (ok, n) in sorted(right.items(), key=lambda kv: kv[1][0] / kv[1][1]):
            print(f"  {template:<16} {ok / n:.3f}  ({n})")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from dpl.cli import main

    config = Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml"  # from any working directory
    main(["fit", "--config", str(config), "--trainer.enable_checkpointing", "false",
          "--trainer.callbacks+=quickstart_templates.TemplateAccuracy", *sys.argv[1:]])
