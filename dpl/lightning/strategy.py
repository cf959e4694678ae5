"""What :class:`~dpl.lightning.module.DPModule` asks of the trainer's strategy: one small interface.

:class:`DPStrategy` lists the calls; :class:`SingleProcess` answers them for one process (nothing to share);
:class:`DataParallel` answers them for ranks that run one private step together, over the strategy's process group
(:mod:`dpl.lightning.collectives`). dpl's two multi-process strategies are Lightning strategies that mix it in:
:class:`~dpl.lightning.ddp.DPDDPStrategy` (replicated parameters) and :class:`~dpl.lightning.fsdp.DPFSDPStrategy`
(sharded parameters). :func:`dp_strategy` picks the one a trainer uses and refuses the others in one line.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.utils.data import BatchSampler, Sampler

from dpl.core.gradients import GradientSum
from dpl.core.noise import SecureNormal
from dpl.errors import ConfigError
from dpl.lightning import collectives
from dpl.lightning.samplers import BalancedShardBatchSampler, ShardedBatchSampler, ShardSampler

if TYPE_CHECKING:  # pragma: no cover
    import lightning as L

    from dpl.core.engine import PrivateEngine

#: check that the replicas agree at the first step, every this many steps, and at the last
REPLICA_CHECK_EVERY = 100


class DPStrategy:
    """The calls ``DPModule`` makes on its strategy. These defaults are one process's answers."""

    #: whether the parameters are sharded over the ranks (FSDP): shards padded to equal passes, no full tensors
    shards_parameters: bool = False

    def shard_train_sampler(self, sampler: Sampler, num_examples: int, unit_of: list[int] | None = None) -> Sampler:
        """This rank's share of the logical batches ``sampler`` (the mechanism's) draws over ``num_examples`` rows;
        ``unit_of``: the user of every row (user-level sampling), whose rows stay on one rank."""
        return sampler

    def eval_batch_sampler(self, num_examples: int, batch_size: int) -> Sampler | None:
        """This rank's evaluation batches of a set of ``num_examples``; ``None``: all of them, in order."""
        return None

    def secure_noise_source(self) -> SecureNormal:
        """The ``privacy.secure_noise`` source (the OS CSPRNG)."""
        return SecureNormal()

    def gradient_reducer(self) -> Callable[[GradientSum], None] | None:
        """``reduce_sum`` for the engine's step: sums the clipped sum over the ranks before ``privatize``."""
        return None

    def sync_run_state(self, engine: PrivateEngine) -> None:
        """Give every rank rank 0's secret and public generator states and plugin secrets."""

    def after_private_step(self, engine: PrivateEngine, trainable: Mapping[str, Tensor]) -> None:
        """Bookkeeping after each private step (the replica check)."""

    def gather_objects(self, items: list[Any]) -> list[Any]:
        """Every rank's ``items`` concatenated in rank order, on every rank."""
        return items


class SingleProcess(DPStrategy):
    """One process: no rank to shard for or to agree with."""


SINGLE_PROCESS = SingleProcess()


class DataParallel(DPStrategy):
    """Ranks that run one private step together: one global batch sharded over them, the clipped sum all-reduced
    before ``privatize``, rank 0's secret state and secure noise on every rank, replicas checked.

    Mixed into a Lightning strategy, which provides ``world_size``, ``global_rank`` and ``root_device``; the strategy
    names its process group in :attr:`dp_process_group`."""

    world_size: int
    global_rank: int
    root_device: torch.device

    @property
    def dp_process_group(self) -> Any:
        """The process group the ranks of the private step form (``None``: torch's default group)."""
        return None

    @property
    def dp_group(self) -> collectives.Group:
        return collectives.Group(self.dp_process_group, self.root_device)

    @property
    def several_ranks(self) -> bool:
        return self.world_size > 1

    def shard_train_sampler(self, sampler: Sampler, num_examples: int, unit_of: list[int] | None = None) -> Sampler:
        if not self.several_ranks:
            return sampler
        return ShardedBatchSampler(sampler, self.global_rank, self.world_size,
                                   pad_to=num_examples if self.shards_parameters else None, unit_of=unit_of)

    def eval_batch_sampler(self, num_examples: int, batch_size: int) -> Sampler | None:
        if not self.several_ranks or num_examples < self.world_size:
            return None
        if self.shards_parameters:  # FSDP's forward is a collective: the same number of batches on every rank
            return BalancedShardBatchSampler(num_examples, self.global_rank, self.world_size, batch_size)
        # each rank evaluates its shard, without the padding duplicates of DistributedSampler
        return BatchSampler(ShardSampler(num_examples, self.global_rank, self.world_size), batch_size, drop_last=False)

    def secure_noise_source(self) -> SecureNormal:
        return collectives.RankZeroSecureNormal(self.dp_group) if self.several_ranks else SecureNormal()

    def gradient_reducer(self) -> Callable[[GradientSum], None] | None:
        if not self.several_ranks:
            return None
        group = self.dp_group
        return lambda gradient_sum: collectives.all_reduce_gradient_sum(gradient_sum, group)

    def sync_run_state(self, engine: PrivateEngine) -> None:
        if self.several_ranks:
            collectives.sync_run_state(engine, self.dp_group)

    def after_private_step(self, engine: PrivateEngine, trainable: Mapping[str, Tensor]) -> None:
        done = engine.steps_done
        if self.several_ranks and (done == 1 or done % REPLICA_CHECK_EVERY == 0 or done == engine.plan.steps):
            collectives.check_replicas_agree(engine, trainable, self.dp_group)

    def gather_objects(self, items: list[Any]) -> list[Any]:
        return collectives.gather_objects(items, self.dp_group) if self.several_ranks else items


def dp_strategy(trainer: L.Trainer | None) -> DPStrategy:
    """The :class:`DPStrategy` of ``trainer``: its strategy if it is one of dpl's, :data:`SINGLE_PROCESS` for any
    other one-process strategy; anything else is refused (one-line ``ConfigError``)."""
    strategy = getattr(trainer, "strategy", None)
    if isinstance(strategy, DPStrategy):
        return strategy
    name = type(strategy).__name__
    if "FSDP" in name or "ModelParallel" in name or "DeepSpeed" in name:
        raise ConfigError(f"strategy {name} (sharded parameters) is not supported: for FSDP use dpl's "
                          "dpl.lightning.fsdp.DPFSDPStrategy (configs/strategies/fsdp.yaml)")
    if trainer is None or trainer.world_size <= 1:
        return SINGLE_PROCESS
    if "DDP" in name:
        raise ConfigError(f"strategy {name}: dpl runs DDP through its own dpl.lightning.ddp.DPDDPStrategy "
                          "(dpl fit --trainer.strategy ddp uses it; in Python: Trainer(strategy=DPDDPStrategy(), "
                          "use_distributed_sampler=False))")
    raise ConfigError(f"strategy {name} is not supported by dpl; use strategy ddp (configs/strategies/ddp.yaml)")
