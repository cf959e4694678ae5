"""Samplers for several processes: each rank's share of dpl's logical batches and of the evaluation sets.

* :class:`ShardedBatchSampler` (training): every rank holds the same secret sampler generator, so every rank draws
  the same *global* batch (Poisson over all N examples, or the mechanism's own scheme) and keeps the members of its
  shard (index i with ``i % world_size == rank``; under user-level sampling, whole users). The union of the shards
  is the global batch: the batch one process draws from the same generator state (docs/scaling.md).
* :class:`PaddedDataset` / :class:`PaddedCollate` (FSDP): shards padded to equal size with zero-weight fillers,
  flagged under :data:`~dpl.core.step.PADDING_KEY`.
* :class:`ShardSampler` (DDP) and :class:`BalancedShardBatchSampler` (FSDP): each rank's evaluation examples.

The strategies (:mod:`dpl.lightning.strategy`) decide which one a run uses.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import Dataset, Sampler

from dpl.core.step import PADDING_KEY
from dpl.errors import ConfigError

__all__ = ["PADDING_KEY", "BalancedShardBatchSampler", "PaddedCollate", "PaddedDataset", "ShardSampler",
           "ShardedBatchSampler"]


class ShardedBatchSampler(Sampler[list[int]]):
    """This rank's share of the global logical batches drawn by ``inner`` (any batch sampler yielding index
    lists over the whole training set): the indices ``i`` with ``i % world_size == rank``.

    Every rank holds the same generator state, so ``inner`` yields the same global batch on every rank; the
    shards are disjoint and their union is the global batch. A rank's share may be empty (it then contributes a
    zero sum and still joins the all-reduce). Every rank yields ``len(inner)`` batches.

    With ``pad_to = num_examples`` (FSDP, whose forward and backward are collectives: every rank must run as many
    micro-batches as the others) every shard is padded to the largest shard of that global batch with *fillers*,
    yielded as ``num_examples + i`` for a member ``i`` of the global batch (:class:`PaddedDataset` maps them back
    and flags them); a filler's gradient is weighted zero, so the clipped sum is that of the shard alone.
    """

    def __init__(self, inner: Sampler, rank: int, world_size: int, pad_to: int | None = None,
                 unit_of: list[int] | None = None) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world size {world_size}")
        self.inner = inner
        self.rank = rank
        self.world_size = world_size
        self.pad_to = pad_to
        self.unit_of = unit_of  # user-level sampling: shard by user (unit_of[i] % world == rank), never split one

    @property
    def pads(self) -> bool:
        return self.pad_to is not None

    def __len__(self) -> int:
        return len(self.inner)

    def __iter__(self) -> Iterator[list[int]]:
        rank, world = self.rank, self.world_size
        owner = (lambda i: i) if self.unit_of is None else self.unit_of.__getitem__
        for batch in self.inner:
            batch = [int(i) for i in batch]
            mine = [i for i in batch if owner(i) % world == rank]
            if self.pad_to is not None and batch:
                largest = max(sum(1 for i in batch if owner(i) % world == r) for r in range(world))
                fillers = mine or batch  # a filler repeats an example of the batch (weighted zero)
                mine = mine + [self.pad_to + fillers[k % len(fillers)] for k in range(largest - len(mine))]
            yield mine


class PaddedDataset(Dataset):
    """``dataset`` indexed as by :class:`ShardedBatchSampler` with ``pad_to = len(dataset)``: index ``i`` is example
    ``i``, index ``len(dataset) + i`` is example ``i`` as a filler. Items are ``(example, is_filler)``."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset
        self.size = len(dataset)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[Any, bool]:
        if index >= self.size:
            return self.dataset[index - self.size], True
        return self.dataset[index], False


class PaddedCollate:
    """Collates ``(example, is_filler)`` items with ``collate`` and adds the flags under :data:`PADDING_KEY`."""

    def __init__(self, collate: Any) -> None:
        self.collate = collate

    def __call__(self, items: list[tuple[Any, bool]]) -> dict[str, Any]:
        examples = [example for example, _ in items]
        batch = self.collate(examples)
        batch[PADDING_KEY] = torch.tensor([flag for _, flag in items], dtype=torch.bool)
        _check_order_kept(examples, batch)
        return batch


def _check_order_kept(examples: list[Any], batch: dict[str, Any]) -> None:
    """The filler flags are positional: refuse a collate that reorders examples (checked on the token counts)."""
    mask = batch.get("attention_mask")
    if not torch.is_tensor(mask) or mask.dim() != 2 or not all(isinstance(e, dict) and "input_ids" in e
                                                                 for e in examples):
        return
    if mask.sum(1).tolist() != [len(e["input_ids"]) for e in examples]:
        raise RuntimeError("dpl: under FSDP a data module's collate must keep the examples' order (its filler "
                           "flags are positional); this one reorders them")


class BalancedShardBatchSampler(Sampler[list[int]]):
    """Evaluation under FSDP: this rank's indices ``i % world_size == rank`` in order, cut into the same number of
    batches on every rank (FSDP's forward is a collective), each of at most ``batch_size`` examples."""

    def __init__(self, num_examples: int, rank: int, world_size: int, batch_size: int) -> None:
        self.indices = list(range(rank, num_examples, world_size))
        largest = len(range(0, num_examples, world_size))
        self.num_batches = -(-largest // batch_size)
        if len(self.indices) < self.num_batches:
            raise ConfigError("FSDP evaluation: every rank must run the same number of batches; set "
                              "data.eval_batch_size >= 2")

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self) -> Iterator[list[int]]:
        n, k = len(self.indices), self.num_batches
        bounds = [n * j // k for j in range(k + 1)]
        for j in range(k):
            yield self.indices[bounds[j]:bounds[j + 1]]


class ShardSampler(Sampler[int]):
    """Evaluation: this rank's indices ``i % world_size == rank`` of ``range(num_examples)``, in order, without
    the padding duplicates of ``DistributedSampler`` (so metrics summed over ranks count each example once)."""

    def __init__(self, num_examples: int, rank: int, world_size: int) -> None:
        self.num_examples, self.rank, self.world_size = num_examples, rank, world_size

    def __len__(self) -> int:
        return len(range(self.rank, self.num_examples, self.world_size))

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.rank, self.num_examples, self.world_size))
