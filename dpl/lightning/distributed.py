"""Multi-process training under Lightning's DDP strategies, with the privacy guarantee of one process.

Every rank runs the same private step on its share of ONE logical batch; the ranks together compute exactly
what one process would (docs/scaling.md argues it; tests/test_ddp.py checks it):

* **Sampling** (:class:`ShardedBatchSampler`): every rank holds the same secret sampler generator, so every rank
  draws the same *global* batch (Poisson over all N examples, or the mechanism's own scheme) and keeps the
  members of its shard (index i with ``i % world_size == rank``). The union of the shards is the global batch:
  Poisson with rate q on the whole set, the same batch a single process draws from the same generator state.
* **Clipped sums** (:func:`all_reduce_gradient_sum`): every tensor of the rank's :class:`~dpl.core.gradients.GradientSum`
  and its count are summed over the ranks (``all_reduce(SUM)``) before ``privatize``. A DPZero sum (one scalar)
  takes the same path.
* **Noise**: every rank's noise generator has the same state, so every rank adds the *same* noise to the same
  summed gradient: noise is added once per logical batch, and every rank applies the same update. With
  ``privacy.secure_noise`` (an OS CSPRNG, stateless, which cannot be shared) rank 0 draws the noise and
  broadcasts it (:class:`RankZeroSecureNormal`).
* **Shared secret state** (:func:`sync_run_state`): rank 0's secret state - what it would write to the
  checkpoint's ``.secret`` sidecar: noise and sampler generator states, every plugin's ``secret_state_dict`` -
  and its public per-step generator are broadcast to all ranks and loaded there, through the same code path as
  a resume. With ``privacy.seed`` all ranks derive the same states anyway; without it rank 0's OS entropy is
  the one every rank uses.
* **Lightning's own gradient all-reduce** never runs: under manual optimization Lightning arms DDP's reducer
  only in ``manual_backward`` (its forward redirection switches ``require_backward_grad_sync`` off around
  ``training_step``), which dpl never calls; dpl computes gradients with ``torch.autograd.grad`` on layer outputs
  (or no backward at all, DPZero) and writes ``param.grad`` itself, so the reducer's hooks (on the parameters'
  gradient accumulators) never fire (tests/test_ddp.py counts them: zero).

The process group carries clipped, *un-noised* gradient sums and the secret generator states: it is inside the
trust boundary, like the GPUs' memory (see docs/scaling.md).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.utils.data import Dataset, Sampler

from dpl.errors import ConfigError
from dpl.core.gradients import GradientSum
from dpl.core.noise import SecureNormal
from dpl.core.sharding import is_sharded
from dpl.core.step import PADDING_KEY

if TYPE_CHECKING:  # pragma: no cover
    import lightning as L

    from dpl.core.engine import PrivateEngine

log = logging.getLogger("dpl")

BUCKET_BYTES = 64 << 20  # all-reduce the clipped sum in flat buckets of at most this size


# --- who am I -----------------------------------------------------------------------------------------------
def is_distributed() -> bool:
    """True inside an initialized process group with more than one rank."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank_and_world() -> tuple[int, int]:
    if not is_distributed():
        return 0, 1
    import torch.distributed as dist

    return dist.get_rank(), dist.get_world_size()


def _comm_device(like: Tensor | None = None) -> torch.device:
    """The device collectives of the default group need (NCCL: the rank's GPU; gloo: the CPU)."""
    import torch.distributed as dist

    if dist.get_backend() == "nccl":
        if like is not None and like.is_cuda:
            return like.device
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# --- setup checks -------------------------------------------------------------------------------------------
def check_strategy(trainer: L.Trainer) -> None:
    """Refuse strategies dpl does not support (one-line ``ConfigError``): other sharding strategies at any world size
    (they wrap or re-register the parameters and write their own checkpoint files), non-DDP multi-process ones."""
    from lightning.pytorch.strategies import DDPStrategy

    from dpl.lightning.fsdp import DPFSDPStrategy

    strategy = getattr(trainer, "strategy", None)
    name = type(strategy).__name__
    if isinstance(strategy, DPFSDPStrategy):
        return
    if "FSDP" in name or "ModelParallel" in name or "DeepSpeed" in name:
        raise ConfigError(f"strategy {name} (sharded parameters) is not supported: for FSDP use dpl's "
                          "dpl.lightning.fsdp.DPFSDPStrategy (configs/strategies/fsdp.yaml)")
    if trainer.world_size <= 1:
        return
    if not isinstance(strategy, DDPStrategy) or "DeepSpeed" in name or "XLA" in name:
        raise ConfigError(f"strategy {name} is not supported by dpl; use strategy ddp (configs/strategies/ddp.yaml)")


def shards_parameters(trainer: L.Trainer) -> bool:
    """Whether the trainer shards the parameters over its ranks (dpl's FSDP strategy)."""
    from dpl.lightning.fsdp import DPFSDPStrategy

    return isinstance(getattr(trainer, "strategy", None), DPFSDPStrategy)


def keep_dpl_batch_sampler(trainer: L.Trainer) -> None:
    """Stop Lightning from replacing dpl's training batch sampler with a ``DistributedSampler``.

    dpl's sampler already shards (:class:`ShardedBatchSampler`) and Lightning cannot inject a sampler into it;
    :class:`~dpl.tasks.data.DPDataModule` shards its evaluation loaders itself. Equivalent to
    ``trainer.use_distributed_sampler: false`` (which ``configs/strategies/ddp.yaml`` sets).
    """
    if trainer.world_size <= 1:
        return
    connector = getattr(trainer, "_accelerator_connector", None)
    if connector is None or not hasattr(connector, "use_distributed_sampler"):
        raise ConfigError("set trainer.use_distributed_sampler: false (dpl's mechanism draws and shards the "
                          "training batches itself)")
    if connector.use_distributed_sampler:
        connector.use_distributed_sampler = False
        log.info("dpl: trainer.use_distributed_sampler set to false: dpl shards the training batches (and its data "
                 "modules the evaluation sets) itself")


# --- sampling -----------------------------------------------------------------------------------------------


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


def shard_batch_sampler(sampler: Sampler, num_examples: int | None = None, pad: bool = False,
                        unit_of: list[int] | None = None) -> Sampler:
    """``sampler`` itself in one process; its :class:`ShardedBatchSampler` for this rank under DDP (``pad``: FSDP,
    every shard padded to the largest with fillers; ``unit_of``: the user of every row, sharded whole)."""
    rank, world = rank_and_world()
    if world == 1:
        return sampler
    return ShardedBatchSampler(sampler, rank, world, pad_to=num_examples if pad else None, unit_of=unit_of)


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


# --- clipped sums -------------------------------------------------------------------------------------------
def all_reduce_gradient_sum(gradient_sum: GradientSum, bucket_bytes: int = BUCKET_BYTES) -> None:
    """Sum a :class:`GradientSum` over all ranks, in place (its tensors and its count).

    Tensors are flattened into buckets of at most ``bucket_bytes`` per (device, dtype), one ``all_reduce`` each.
    """
    import torch.distributed as dist

    values = gradient_sum.values
    groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for tensor in values.values():
        groups.setdefault((tensor.device, tensor.dtype), []).append(tensor)
    for tensors in groups.values():
        target = _comm_device(tensors[0])
        buckets: list[list[Tensor]] = []
        current: list[Tensor] = []
        size = 0
        for tensor in tensors:
            nbytes = tensor.numel() * tensor.element_size()
            if current and size + nbytes > bucket_bytes:
                buckets.append(current)
                current, size = [], 0
            current.append(tensor)
            size += nbytes
        if current:
            buckets.append(current)
        for bucket in buckets:
            flat = torch.cat([t.reshape(-1) for t in bucket]).to(target)
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            offset = 0
            for t in bucket:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()
            del flat
    like = next(iter(values.values()), None)
    count = torch.tensor([gradient_sum.count], dtype=torch.int64, device=_comm_device(like))
    dist.all_reduce(count, op=dist.ReduceOp.SUM)
    gradient_sum.set_count(int(count.item()))  # the global number of examples in the logical batch


def gradient_reducer():
    """``reduce_sum`` for :func:`dpl.core.step.private_step`: :func:`all_reduce_gradient_sum` under DDP, else None."""
    return all_reduce_gradient_sum if is_distributed() else None


# --- noise --------------------------------------------------------------------------------------------------
class RankZeroSecureNormal(SecureNormal):
    """``privacy.secure_noise`` under DDP: rank 0 draws from the OS CSPRNG and broadcasts; every rank returns the
    same values. Every rank calls it in the same order (all ranks run the same hooks on the same release), which
    is what a collective needs."""

    def __repr__(self) -> str:
        return "RankZeroSecureNormal(os.urandom on rank 0, broadcast)"

    def standard_normals(self, sizes: Sequence[int], dtype: torch.dtype = torch.float64) -> list[Tensor]:
        import torch.distributed as dist

        device = _comm_device()
        if not sizes:
            return []
        if dist.get_rank() == 0:
            flat = torch.cat([v.to(device) for v in super().standard_normals(sizes, dtype)])
        else:
            flat = torch.empty(sum(sizes), dtype=dtype, device=device)
        dist.broadcast(flat, src=0)
        return list(flat.split(list(sizes)))


# --- shared state -------------------------------------------------------------------------------------------
def _broadcast_object(obj: Any) -> Any:
    import torch.distributed as dist

    holder = [obj]
    dist.broadcast_object_list(holder, src=0, device=_comm_device())
    return holder[0]


def secure_noise_source() -> SecureNormal:
    """The ``privacy.secure_noise`` source: the OS CSPRNG in one process, rank 0's draws broadcast under DDP."""
    return RankZeroSecureNormal() if is_distributed() else SecureNormal()


def sync_run_state(engine: PrivateEngine) -> None:
    """Give every rank rank 0's secret state (noise and sampler generators, plugin secrets) and public per-step
    generator, loaded through the resume path (:meth:`~dpl.core.engine.PrivateEngine.load_secret_state_dict`, the
    generators replayed exactly).
    A no-op in one process.

    Called at fit start (after a resume from a checkpoint, whose sidecar every rank read) and after a late
    restore: whatever each rank holds before, all hold rank 0's state after.
    """
    if not is_distributed():
        return
    import torch.distributed as dist

    rank = dist.get_rank()
    secret = _broadcast_object(engine.secret_state_dict() if rank == 0 else None)
    public = _broadcast_object(engine.public_rng_state() if rank == 0 else None)
    if rank != 0:
        engine.load_secret_state_dict(secret, replay=True)
        engine.load_public_rng_state(public)


def _fingerprints(engine: PrivateEngine, trainable: Mapping[str, Tensor]) -> tuple[Tensor, Tensor]:
    """float64 fingerprints of the trainable parameters (per parameter: sum, sum of squares, size) and of the
    generator states, comparable across ranks."""
    params = []
    for param in trainable.values():
        if is_sharded(param):  # FSDP: each shard exists on one rank only, there is no replica to compare
            continue
        p = param.detach().double()
        params += [p.sum(), p.square().sum(), torch.tensor(float(p.numel()), dtype=torch.float64, device=p.device)]
    gens = [torch.zeros((), dtype=torch.float64)]
    for state in engine.generator_states():
        state = state.double()
        gens.append((state * torch.arange(1, state.numel() + 1, dtype=torch.float64)).sum())
    params = torch.stack([v.cpu() for v in params]) if params else torch.zeros(0, dtype=torch.float64)
    return params, torch.stack(gens)


def state_fingerprint(engine: PrivateEngine, trainable: Mapping[str, Tensor]) -> Tensor:
    """One float64 vector fingerprinting the trainable parameters and the generator states (for tests)."""
    return torch.cat(_fingerprints(engine, trainable))


def check_replicas_agree(engine: PrivateEngine, trainable: Mapping[str, Tensor], drift: float = 1e-5) -> None:
    """Check that every rank holds rank 0's parameters and generator states; one small all-gather.

    Generator states must match exactly. Parameters may drift apart by float rounding when an estimator perturbs
    them in place and restores them to rounding only (DPZero's theta +- mu z, once per micro-batch, and ranks hold
    different numbers of micro-batches): a relative difference below ``drift`` is removed by copying rank 0's
    parameters (public values) to every rank; anything larger means the ranks applied different updates: an error.
    """
    if not is_distributed():
        return
    import torch.distributed as dist

    step = engine.steps_done
    params, gens = _fingerprints(engine, trainable)
    mine = torch.cat([params, gens]).to(_comm_device())
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    reference = gathered[0].cpu()
    k = params.numel()
    resync = False
    for rank, other in enumerate(gathered[1:], start=1):
        other = other.cpu()
        if not torch.equal(other[k:], reference[k:]):
            raise RuntimeError(f"dpl: DDP rank {rank} holds other generator states than rank 0 at step "
                               f"{step}: the ranks would draw different noise or batches")
        if torch.equal(other[:k], reference[:k]):
            continue
        sums, squares, sizes = (reference[i:k:3] for i in range(3))
        scale = (squares * sizes).sqrt().clamp_min(1e-30)
        gap = torch.maximum((other[0:k:3] - sums).abs() / scale,
                            (other[1:k:3] - squares).abs() / squares.clamp_min(1e-30)).max().item()
        if gap > drift:
            raise RuntimeError(f"dpl: DDP rank {rank} diverged from rank 0 at step {step} (relative "
                               f"parameter difference {gap:.2g}): the ranks no longer apply the same private update")
        resync = True
    if resync:  # every rank reached the same decision (same gathered values)
        with torch.no_grad():
            for param in trainable.values():
                if is_sharded(param):
                    continue
                buffer = param.data.to(_comm_device(param.data))
                dist.broadcast(buffer, src=0)
                if buffer is not param.data:
                    param.data.copy_(buffer)
        log.debug("dpl: step %d: parameters re-synchronized from rank 0 (float rounding drift)", step)


def after_step(engine: PrivateEngine, trainable: Mapping[str, Tensor], every: int = 100) -> None:
    """Per-step bookkeeping under DDP: check the replicas agree at the first, every ``every``-th and last step."""
    if not is_distributed():
        return
    done = engine.steps_done
    if done == 1 or done % every == 0 or done == engine.plan.steps:
        check_replicas_agree(engine, trainable)


def gather_objects(items: list[Any]) -> list[Any]:
    """Concatenate a list held by every rank (rank order) on every rank; ``items`` itself in one process."""
    if not is_distributed():
        return items
    import torch.distributed as dist

    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, items)
    return [item for part in parts for item in part]
