"""Write dpl's quickstart data set as TSV (``sentence<TAB>label``): by default the 2,000 / 400 rows shipped in
``dpl/tasks/data/quickstart/{train,validation}.tsv``. The sentences and labels come from
:mod:`dpl.tasks.data.quickstart_gen` (templates, rules, 3% flipped labels; see its docstring); the output is
deterministic (fixed seed). The quickstart config does not read these files: it generates its (larger) training
set in memory with the same generator (``data.train_size``)::

    python scripts/make_quickstart_data.py            # rewrite the shipped files
    python scripts/make_quickstart_data.py --out DIR  # write elsewhere
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

from dpl.tasks.data.quickstart_gen import LABELS, SEED, TRAIN_SIZE, VALIDATION_SIZE, Generator, generate

OUT = Path(__file__).resolve().parents[1] / "dpl" / "data" / "quickstart"
__all__ = ["LABELS", "SEED", "TRAIN_SIZE", "VALIDATION_SIZE", "Generator", "generate", "write", "main"]


def write(out: Path, splits: dict[str, list[tuple[str, str]]]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in splits.items():
        with open(out / f"{name}.tsv", "w", newline="", encoding="utf-8") as f:
            writer = csv.writer(f, delimiter="\t", lineterminator="\n")
            writer.writerow(["sentence", "label"])
            writer.writerows(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=OUT, help=f"output folder (default: {OUT})")
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--train-size", type=int, default=TRAIN_SIZE)
    parser.add_argument("--validation-size", type=int, default=VALIDATION_SIZE)
    parser.add_argument("--simple-weight", type=float, default=Generator.simple_weight,
                        help="template weight of plain statements (the other templates weigh 18.6 together)")
    args = parser.parse_args()
    stats: dict[str, int] = {}
    splits = generate(seed=args.seed, train_size=args.train_size, validation_size=args.validation_size,
                      simple_weight=args.simple_weight, stats=stats)
    write(args.out, splits)
    for name, rows in splits.items():
        counts = {label: sum(1 for _, y in rows if y == label) for label in LABELS.values()}
        print(f"{args.out / (name + '.tsv')}: {len(rows)} rows {counts}")
    print(f"validation sentences redrawn because the training set already had them: {stats['validation_in_train']}")


if __name__ == "__main__":
    main()
