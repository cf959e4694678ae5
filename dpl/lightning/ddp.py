"""Replicated parameters (DDP) with the privacy guarantee of one process.

:class:`DPDDPStrategy` is Lightning's ``DDPStrategy`` (same options, same launchers) that answers
:class:`~dpl.lightning.strategy.DPStrategy` over the process group of its ``DistributedDataParallel`` wrapper:
every rank draws the same global batch and keeps its shard, the clipped sums are all-reduced before ``privatize``,
every rank holds rank 0's secret state (hence adds the same noise; ``privacy.secure_noise``: rank 0's draws,
broadcast), and the replicas are checked at the first, every 100th and the last step (docs/scaling.md).

**Lightning's own gradient all-reduce** never runs: under manual optimization Lightning arms DDP's reducer only in
``manual_backward`` (its forward redirection switches ``require_backward_grad_sync`` off around ``training_step``),
which dpl never calls; dpl computes gradients with ``torch.autograd.grad`` on layer outputs (or no backward at all,
DPZero) and writes ``param.grad`` itself, so the reducer's hooks (on the parameters' gradient accumulators) never
fire (tests/test_ddp.py counts them: zero).

Names: ``dpl_ddp`` (``popen``: Lightning re-launches the command for every rank), ``dpl_ddp_spawn``,
``dpl_ddp_fork``. The ``dpl`` command also gives Lightning's own names (``ddp``, ``ddp_spawn``, ``ddp_fork``,
``ddp_notebook``, and ``auto`` on several devices) this strategy (:func:`use_for_lightning_names`). In Python:
``Trainer(strategy=DPDDPStrategy(), use_distributed_sampler=False)`` (dpl's sampler shards the batches itself).
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from torch.nn.parallel import DistributedDataParallel

from dpl.lightning.strategy import DataParallel

#: dpl's names for the strategy and the start method of each; Lightning's names map to the same start methods
NAMES = {"dpl_ddp": "popen", "dpl_ddp_spawn": "spawn", "dpl_ddp_fork": "fork"}
LIGHTNING_NAMES = {"ddp": "popen", "ddp_spawn": "spawn", "ddp_fork": "fork", "ddp_notebook": "fork"}


class DPDDPStrategy(DataParallel, DDPStrategy):
    """DDP over all ranks for dpl's private training (``configs/strategies/ddp.yaml``); the options are
    ``DDPStrategy``'s (``start_method``: ``popen``, ``spawn``, ``fork``; ``process_group_backend``; ``timeout``)."""

    strategy_name = "dpl_ddp"

    @property
    def dp_process_group(self) -> Any:
        """The group ``DistributedDataParallel`` replicates the model over (torch's default group until it wraps)."""
        model = self.model
        return model.process_group if isinstance(model, DistributedDataParallel) else None


def _register(names: dict[str, str], override: bool = False) -> None:
    for name, start_method in names.items():
        if override or name not in StrategyRegistry:
            StrategyRegistry.register(name, DPDDPStrategy, override=override, start_method=start_method,
                                      description=f"dpl: DDP with the privacy guarantee of one process ({start_method})")


def use_for_lightning_names() -> None:
    """Make Lightning's DDP names (``ddp``, ``ddp_spawn``, ``ddp_fork``, ``ddp_notebook``) build
    :class:`DPDDPStrategy` in this process (Lightning's strategy registry; ``auto`` on several devices picks ``ddp``).
    The ``dpl`` command calls it: there every strategy is dpl's."""
    _register(LIGHTNING_NAMES, override=True)


_register(NAMES)
