"""Sharded parameters (FSDP) with the privacy guarantee of one process.

:class:`DPFSDPStrategy` is Lightning's ``ModelParallelStrategy`` (PyTorch's FSDP2, ``fully_shard``: every parameter
a ``DTensor`` sharded on its first dimension over the ranks) set up for dpl:

* **Sharding**: ``DPModule.configure_model`` calls :meth:`DPFSDPStrategy.shard_module`, which applies
  ``fully_shard`` to every block of every ``nn.ModuleList`` (the transformer layers) and then to the whole model.
  A parameter's full value exists only while its block runs forward or backward.
* **Clipping**: dpl's engine (:mod:`dpl.core.per_example`) needs no parameter: it records each layer's input and output
  gradient through the sharded model (FSDP gathers a block's parameters for its forward and backward) and forms
  each example's norm and the clipped sum from them. Every rank computes the full-size clipped sum of its own
  examples, and the sums are all-reduced before ``privatize`` - exactly as under DDP (:mod:`dpl.lightning.ddp`;
  both strategies are :class:`~dpl.lightning.strategy.DataParallel`, over the mesh's data-parallel group here).
* **Sampling**: every rank's shard of a logical batch is padded to the largest shard with zero-weight *fillers*
  (:class:`~dpl.lightning.samplers.ShardedBatchSampler` with ``pad_to``), and evaluation cuts every rank's examples
  into the same number of batches: FSDP's forward and backward are collectives.
* **Noise, plugins**: every rank holds the same noise generator and the same all-reduced sum, so ``privatize``,
  ``post_process`` and ``precondition`` run on full-size tensors, identically on every rank, with no plugin
  knowing about shards (denoise sees whole matrices, ftrl whole buffers). Plugins that read parameter *values*
  get them through :class:`~dpl.core.sharding.FullParameters` (gathered on first access, in the same order on every rank).
* **Update**: each rank keeps its own slice of the released direction as the gradient of its parameter shard
  (:func:`~dpl.core.sharding.as_gradient_of`) and the optimizer steps on the shards: parameters and optimizer state stay sharded.
* **Checkpoints**: a single full checkpoint gathered on rank 0 (``save_distributed_checkpoint=False``), written by
  dpl's :class:`~dpl.lightning.checkpoint.SidecarCheckpointIO`: the public ``.ckpt`` plus the owner-only ``.secret`` sidecar.

What this does not save: the gradient (clipped sum and release) is full size on every rank, as under DDP; only
parameters and optimizer state are sharded (see docs/scaling.md for the memory per rank).
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn

from dpl.errors import ConfigError
from dpl.lightning import checkpoint as ckpt_io
from dpl.lightning.strategy import DataParallel

try:
    from torch.distributed.constants import default_pg_timeout
except ImportError:  # pragma: no cover
    default_pg_timeout = timedelta(minutes=30)


class DPFSDPStrategy(DataParallel, ModelParallelStrategy):
    """FSDP (``fully_shard``) over all ranks for dpl's private training (``configs/strategies/fsdp.yaml``).

    Args:
        start_method: ``popen`` (Lightning re-launches the command for every rank, as ``strategy: ddp``), or
            ``fork`` / ``spawn`` (processes started from this one, e.g. in notebooks and tests).
        reshard_after_forward: free each block's gathered parameters after its forward (FSDP's default; less
            memory, one more all-gather in backward).
        process_group_backend: ``nccl`` (GPUs) / ``gloo`` (CPU); default: by device.
        timeout: collective timeout.
    """

    strategy_name = "dpl_fsdp"
    shards_parameters = True

    def __init__(self, start_method: Literal["popen", "fork", "spawn"] = "popen", reshard_after_forward: bool = True,
                 process_group_backend: str | None = None, timeout: timedelta | None = default_pg_timeout) -> None:
        super().__init__(data_parallel_size="auto", tensor_parallel_size=1, save_distributed_checkpoint=False,
                         process_group_backend=process_group_backend, timeout=timeout)
        if start_method not in ("popen", "fork", "spawn"):
            raise ValueError(f"start_method must be popen, fork or spawn, got {start_method!r}")
        self.start_method = start_method
        self.reshard_after_forward = reshard_after_forward

    def _configure_launcher(self) -> None:
        if self.start_method == "popen":
            super()._configure_launcher()
            return
        self._launcher = _launcher(self, self.start_method)

    def setup_environment(self) -> None:
        # one data-parallel dimension over every rank of every node (no tensor parallelism)
        self._data_parallel_size = self.num_nodes * self.num_processes
        self._tensor_parallel_size = 1
        super().setup_environment()

    @property
    def dp_process_group(self) -> Any:
        """The data-parallel group of the device mesh (every rank)."""
        return self.device_mesh["data_parallel"].get_group()

    def shard_module(self, model: nn.Module) -> None:
        """``fully_shard`` every block of every ``nn.ModuleList`` (the transformer layers), then ``model``."""
        from torch.distributed.fsdp import FSDPModule, fully_shard

        if isinstance(model, FSDPModule):
            return
        mesh = self.device_mesh["data_parallel"]
        for module in list(model.modules()):
            if isinstance(module, nn.ModuleList):
                for block in module:
                    if any(p.numel() for p in block.parameters()):
                        fully_shard(block, mesh=mesh, reshard_after_forward=self.reshard_after_forward)
        fully_shard(model, mesh=mesh, reshard_after_forward=self.reshard_after_forward)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(checkpoint_path))
        if not path.is_file():
            raise ConfigError(f"checkpoint {path} does not exist (dpl's FSDP writes single-file checkpoints)")
        checkpoint = super().load_checkpoint(path, weights_only=False)
        ckpt_io.attach_secret(checkpoint, path)  # every rank reads the owner-only sidecar, as under DDP
        return checkpoint


def _launcher(strategy: DPFSDPStrategy, start_method: str) -> Any:
    """Lightning's fork/spawn launcher, handing the *full* trained weights back to the main process (the stock one
    pickles the sharded ``DTensor`` state, which the main process cannot load)."""
    from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher

    class FullWeightsLauncher(_MultiProcessingLauncher):
        def _collect_rank_zero_results(self, trainer: Any, results: Any) -> Any:
            module = trainer.lightning_module
            full = self._strategy.lightning_module_state_dict()  # a collective: gathered on rank 0
            module.state_dict = lambda *args, **kwargs: full
            try:
                return super()._collect_rank_zero_results(trainer, results)
            finally:
                del module.state_dict

    return FullWeightsLauncher(strategy, start_method=start_method)


def _register() -> None:
    """Make ``--trainer.strategy dpl_fsdp`` name :class:`DPFSDPStrategy` (Lightning's strategy registry)."""
    from lightning.pytorch.strategies import StrategyRegistry

    if DPFSDPStrategy.strategy_name not in StrategyRegistry:
        StrategyRegistry.register(DPFSDPStrategy.strategy_name, DPFSDPStrategy,
                                  description="dpl: FSDP2 (fully_shard) with the privacy guarantee of one process")


_register()
