"""The collectives of private data-parallel training, over an explicit process group.

Every function takes the :class:`Group` its strategy trains over (:mod:`dpl.lightning.strategy`): the process group
and the device its collectives need. Every rank runs the same private step on its share of ONE logical batch, and
the ranks together compute exactly what one process would (docs/scaling.md argues it; tests/test_ddp.py checks it):

* **Clipped sums** (:func:`all_reduce_gradient_sum`): every tensor of the rank's
  :class:`~dpl.core.gradients.GradientSum` and its count are summed over the ranks (``all_reduce(SUM)``) before
  ``privatize``. A DPZero sum (one scalar) takes the same path.
* **Noise**: every rank's noise generator has the same state, so every rank adds the *same* noise to the same
  summed gradient: noise is added once per logical batch. With ``privacy.secure_noise`` (an OS CSPRNG, stateless,
  which cannot be shared) rank 0 draws the noise and broadcasts it (:class:`RankZeroSecureNormal`).
* **Shared secret state** (:func:`sync_run_state`): rank 0's secret state - what it would write to the
  checkpoint's ``.secret`` sidecar: noise and sampler generator states, every plugin's ``secret_state_dict`` - and
  its public per-step generator are broadcast to all ranks and loaded there, through the same code path as a resume.
* **Replicas** (:func:`check_replicas_agree`): the ranks compare fingerprints of their parameters and generators.

The process group carries clipped, *un-noised* gradient sums and the secret generator states: it is inside the
trust boundary, like the GPUs' memory (see docs/scaling.md).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

from dpl.core.gradients import GradientSum
from dpl.core.noise import SecureNormal
from dpl.core.sharding import is_sharded

if TYPE_CHECKING:  # pragma: no cover
    from dpl.core.engine import PrivateEngine

log = logging.getLogger("dpl")

BUCKET_BYTES = 64 << 20  # all-reduce the clipped sum in flat buckets of at most this size


@dataclass(frozen=True)
class Group:
    """A process group and the device of its rank (NCCL collectives run on it; gloo ones on the CPU).

    ``group=None`` is torch's default group. ``src`` is the global rank of the group's rank 0, whose state and
    secure noise every rank takes."""

    group: Any
    device: torch.device

    @property
    def size(self) -> int:
        return dist.get_world_size(self.group)

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    @property
    def src(self) -> int:
        return dist.get_global_rank(self.group, 0) if self.group is not None else 0

    def comm_device(self, like: Tensor | None = None) -> torch.device:
        """Where a collective's tensor must be: the rank's device under NCCL (``like``'s if it is a GPU tensor),
        else the CPU."""
        if "nccl" not in str(dist.get_backend(self.group)):
            return torch.device("cpu")
        if like is not None and like.is_cuda:
            return like.device
        return self.device


# --- clipped sums -------------------------------------------------------------------------------------------
def all_reduce_gradient_sum(gradient_sum: GradientSum, group: Group, bucket_bytes: int = BUCKET_BYTES) -> None:
    """Sum a :class:`GradientSum` over the ranks of ``group``, in place (its tensors and its count).

    Tensors are flattened into buckets of at most ``bucket_bytes`` per (device, dtype), one ``all_reduce`` each.
    """
    values = gradient_sum.values
    groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for tensor in values.values():
        groups.setdefault((tensor.device, tensor.dtype), []).append(tensor)
    for tensors in groups.values():
        target = group.comm_device(tensors[0])
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
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group.group)
            offset = 0
            for t in bucket:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()
            del flat
    like = next(iter(values.values()), None)
    count = torch.tensor([gradient_sum.count], dtype=torch.int64, device=group.comm_device(like))
    dist.all_reduce(count, op=dist.ReduceOp.SUM, group=group.group)
    gradient_sum.set_count(int(count.item()))  # the global number of examples in the logical batch


# --- noise --------------------------------------------------------------------------------------------------
class RankZeroSecureNormal(SecureNormal):
    """``privacy.secure_noise`` on several ranks: rank 0 draws from the OS CSPRNG and broadcasts; every rank returns
    the same values. Every rank calls it in the same order (all ranks run the same hooks on the same release), which
    is what a collective needs."""

    def __init__(self, group: Group) -> None:
        self.group = group

    def __repr__(self) -> str:
        return "RankZeroSecureNormal(os.urandom on rank 0, broadcast)"

    def standard_normals(self, sizes: Sequence[int], dtype: torch.dtype = torch.float64) -> list[Tensor]:
        if not sizes:
            return []
        device = self.group.comm_device()
        if self.group.rank == 0:
            flat = torch.cat([v.to(device) for v in super().standard_normals(sizes, dtype)])
        else:
            flat = torch.empty(sum(sizes), dtype=dtype, device=device)
        dist.broadcast(flat, src=self.group.src, group=self.group.group)
        return list(flat.split(list(sizes)))


# --- shared state -------------------------------------------------------------------------------------------
def broadcast_object(obj: Any, group: Group) -> Any:
    """Rank 0's ``obj`` on every rank of ``group``."""
    holder = [obj]
    dist.broadcast_object_list(holder, src=group.src, group=group.group, device=group.comm_device())
    return holder[0]


def sync_run_state(engine: PrivateEngine, group: Group) -> None:
    """Give every rank rank 0's secret state (noise and sampler generators, plugin secrets) and public per-step
    generator, loaded through the resume path (:meth:`~dpl.core.engine.PrivateEngine.load_secret_state_dict`, the
    generators replayed exactly): whatever each rank holds before, all hold rank 0's state after."""
    first = group.rank == 0
    secret = broadcast_object(engine.secret_state_dict() if first else None, group)
    public = broadcast_object(engine.public_rng_state() if first else None, group)
    if not first:
        engine.load_secret_state_dict(secret, replay=True)
        engine.load_public_rng_state(public)


def gather_objects(items: list[Any], group: Group) -> list[Any]:
    """Concatenate a list held by every rank of ``group`` (rank order), on every rank."""
    parts: list[Any] = [None] * group.size
    dist.all_gather_object(parts, items, group=group.group)
    return [item for part in parts for item in part]


# --- replicas -----------------------------------------------------------------------------------------------
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


def check_replicas_agree(engine: PrivateEngine, trainable: Mapping[str, Tensor], group: Group,
                         drift: float = 1e-5) -> None:
    """Check that every rank holds rank 0's parameters and generator states; one small all-gather.

    Generator states must match exactly. Parameters may drift apart by float rounding when an estimator perturbs
    them in place and restores them to rounding only (DPZero's theta +- mu z, once per micro-batch, and ranks hold
    different numbers of micro-batches): a relative difference below ``drift`` is removed by copying rank 0's
    parameters (public values) to every rank; anything larger means the ranks applied different updates: an error.
    """
    step = engine.steps_done
    params, gens = _fingerprints(engine, trainable)
    mine = torch.cat([params, gens]).to(group.comm_device())
    gathered = [torch.empty_like(mine) for _ in range(group.size)]
    dist.all_gather(gathered, mine, group=group.group)
    reference = gathered[0].cpu()
    k = params.numel()
    resync = False
    for rank, other in enumerate(gathered[1:], start=1):
        other = other.cpu()
        if not torch.equal(other[k:], reference[k:]):
            raise RuntimeError(f"dpl: rank {rank} holds other generator states than rank 0 at step "
                               f"{step}: the ranks would draw different noise or batches")
        if torch.equal(other[:k], reference[:k]):
            continue
        sums, squares, sizes = (reference[i:k:3] for i in range(3))
        scale = (squares * sizes).sqrt().clamp_min(1e-30)
        gap = torch.maximum((other[0:k:3] - sums).abs() / scale,
                            (other[1:k:3] - squares).abs() / squares.clamp_min(1e-30)).max().item()
        if gap > drift:
            raise RuntimeError(f"dpl: rank {rank} diverged from rank 0 at step {step} (relative "
                               f"parameter difference {gap:.2g}): the ranks no longer apply the same private update")
        resync = True
    if resync:  # every rank reached the same decision (same gathered values)
        with torch.no_grad():
            for param in trainable.values():
                if is_sharded(param):
                    continue
                buffer = param.data.to(group.comm_device(param.data))
                dist.broadcast(buffer, src=group.src, group=group.group)
                if buffer is not param.data:
                    param.data.copy_(buffer)
        log.debug("dpl: step %d: parameters re-synchronized from rank 0 (float rounding drift)", step)
