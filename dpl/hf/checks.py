"""What a Hugging Face trainer may not do under dpl, refused in one line before anything runs: each setting below
would break the guarantee or the accounting (the sampler, the per-example loss, the division and the noise must be
dpl's; the trainer keeps its optimizer, scheduler, logging and saving).

* ``gradient_accumulation_steps`` other than 1: the trainer would clip and noise each micro-batch and sum the
  releases; dpl accumulates the micro-batches of one logical batch itself (``privacy.batch_size``, the expected
  logical batch; ``per_device_train_batch_size``, the micro-batch);
* a train sampling strategy other than ``random`` (``group_by_length``, ``batch_rebalance``, ``sequential``) or a
  subclass's own train sampler or loader: who is in a batch must be Poisson-sampled as accounted;
* packing or padding-free batches (TRL): several examples in one row would share one clipped gradient;
* an iterable training set: Poisson sampling draws from N indexed rows;
* several processes, DeepSpeed, FSDP, float16: not driven by this integration (``dpl fit`` runs DDP and FSDP).
"""

from __future__ import annotations

from typing import Any

from dpl.errors import ConfigError

#: the modules whose classes may define the train loader and sampler
OWN_MODULES = ("transformers.", "trl.", "dpl.hf.")


def check_args(args: Any, batch_size: int) -> None:
    """Refuse the trainer settings that break private training (module docstring)."""
    steps = getattr(args, "gradient_accumulation_steps", 1)
    if steps != 1:
        logical = args.per_device_train_batch_size * steps
        raise ConfigError(f"gradient_accumulation_steps={steps}: dpl draws each logical batch and accumulates its "
                          f"micro-batches itself; set gradient_accumulation_steps=1, privacy.batch_size to the logical "
                          f"batch (e.g. {logical}) and per_device_train_batch_size to the micro-batch")
    strategy = getattr(args, "train_sampling_strategy", "random")
    if getattr(args, "group_by_length", False) or strategy == "group_by_length":
        raise ConfigError("group_by_length chooses batches by length, not by Poisson sampling as the privacy "
                          "accounting assumes: unset it (dpl draws the batches)")
    if strategy not in (None, "random"):
        raise ConfigError(f"train_sampling_strategy={strategy!r}: dpl draws the batches by Poisson sampling; leave "
                          "it at 'random'")
    if getattr(args, "packing", False):
        raise ConfigError("packing=True puts several examples in one row, so one clipped gradient would cover "
                          "several privacy units: set packing=False")
    if getattr(args, "padding_free", False):
        raise ConfigError("padding_free=True flattens the batch into one row, so examples cannot be clipped one by "
                          "one: set padding_free=False")
    if getattr(args, "world_size", 1) > 1 or getattr(args, "n_gpu", 1) > 1:
        raise ConfigError("dpl's trainers run in one process on one device; for several GPUs use dpl fit "
                          "(strategy ddp or fsdp)")
    if getattr(args, "deepspeed", None) or getattr(args, "fsdp", None):
        raise ConfigError("DeepSpeed and FSDP are not supported by dpl's trainers; dpl fit runs FSDP")
    if getattr(args, "fp16", False):
        raise ConfigError("fp16=True needs loss scaling, which per-example clipping does not do; use bf16=True or "
                          "float32")
    if getattr(args, "auto_find_batch_size", False):
        raise ConfigError("auto_find_batch_size would change the micro-batch during training; set "
                          "per_device_train_batch_size (the micro-batch)")
    if batch_size < 1:
        raise ConfigError(f"privacy.batch_size must be >= 1, got {batch_size}")


def check_own_sampler(trainer: Any) -> None:
    """Refuse a subclass that draws its own training batches (its own ``_get_train_sampler`` or
    ``get_train_dataloader``)."""
    for name in ("_get_train_sampler", "get_train_dataloader"):
        owner = next(c for c in type(trainer).__mro__ if name in c.__dict__)
        if not owner.__module__.startswith(OWN_MODULES):
            raise ConfigError(f"{owner.__name__}.{name} draws its own training batches: dpl's Poisson sampler must "
                              "draw them, as the privacy accounting assumes; remove the override")


def check_dataset(dataset: Any) -> int:
    """The number of training rows, or a one-line refusal for a set that cannot be sampled."""
    if dataset is None:
        raise ConfigError("training needs a train_dataset")
    try:
        from torch.utils.data import IterableDataset

        iterable = isinstance(dataset, IterableDataset)
    except ImportError:  # pragma: no cover
        iterable = False
    if iterable or type(dataset).__name__ == "IterableDataset" or not hasattr(dataset, "__len__"):
        raise ConfigError("the training set is iterable: Poisson sampling draws from N indexed rows; pass a "
                          "datasets.Dataset or another map-style dataset")
    n = len(dataset)
    if n < 1:
        raise ConfigError("the training set is empty")
    return n
