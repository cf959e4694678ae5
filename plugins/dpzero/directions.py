"""DPZero's public random direction z, regenerated tensor by tensor, never stored whole.

Two distributions, both with E[z z^T] = I (what makes the two-point estimate unbiased):

* ``gaussian``: z ~ N(0, I), as in Zhang et al.'s DPZero and Malladi et al.'s MeZO;
* ``rademacher``: independent signs z_i = +-1 with probability 1/2 (SPSA: Spall, "Multivariate stochastic
  approximation using a simultaneous perturbation gradient approximation", IEEE TAC 1992).
  The signs are drawn once per step as packed bits (1 bit per parameter: 1/32 of fp32 weights) and expanded
  chunk by chunk through a 256-row table, so each pass over the parameters costs a table lookup and an add
  instead of a Gaussian draw (``benchmarks/dpzero_memory.py`` measures both).

Each trainable tensor gets its own seed derived from the step's public seed and the parameter's name, and its
slice of z is drawn from one dedicated ``torch.Generator`` reseeded with it. So any tensor of z can be
regenerated alone, in any order, on any DDP rank (the public seed is the same everywhere), and the whole of z
never exists in memory: perturbing, restoring and updating each touch one tensor at a time.

This generator is public (its seed is the core's public per-step seed). It never draws DP noise, and nothing
here ever touches the run's noise generator.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping
from typing import Literal

import torch
from torch import Tensor, nn


def tensor_seed(public_seed: int, name: str) -> int:
    """A 63-bit seed for the slice of z that belongs to parameter ``name`` at this step."""
    digest = hashlib.blake2b(f"dpzero:{int(public_seed)}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


CHUNK = 1 << 20  # elements of z drawn at once: bounds the transient memory of a large tensor (4 MiB in fp32)
SIGN_CHUNK = 1 << 18  # elements of a Rademacher z expanded at once (a multiple of 8; 1 MiB in fp32 stays in cache)
Distribution = Literal["gaussian", "rademacher"]
_SIGNS = ((torch.arange(256).unsqueeze(-1) >> torch.arange(8)) & 1).mul(2).sub(1)  # byte -> its 8 bits as -1/+1


class DirectionSampler:
    """Regenerates z for one step: ``z(name, param)`` is the same tensor every time it is asked for.

    A tensor's slice of z is drawn in flat chunks of at most ``CHUNK`` elements, in order, from its own seed;
    ``chunks(name, param)`` yields them one at a time (perturbing and updating a large embedding matrix then needs
    4 MiB of scratch, not a copy of the matrix), and ``z`` concatenates the same chunks.

    With ``keep`` (a dtype, e.g. ``torch.bfloat16``), z is rounded to that dtype and kept for the step after its
    first use: one draw instead of one per pass (perturb, perturb back, restore, update), for 2 bytes per
    parameter in bfloat16. The rounded z is the direction: every pass and the update use the same values.
    """

    def __init__(self, public_seed: int, keep: torch.dtype | None = None,
                 distribution: Distribution = "gaussian") -> None:
        if distribution not in ("gaussian", "rademacher"):
            raise ValueError(f"unknown direction distribution {distribution!r}")
        if keep is not None and distribution == "rademacher":
            raise ValueError("a Rademacher direction is always kept, as bits: there is nothing to round")
        self.public_seed = int(public_seed)
        self.keep = keep
        self.distribution = distribution
        self._generators: dict[torch.device, torch.Generator] = {}
        self._kept: dict[str, list[Tensor]] = {}
        self._bits: dict[str, Tensor] = {}  # rademacher: packed signs per tensor (bit k of byte j: element 8j + k)
        self._tables: dict[tuple[torch.dtype, torch.device], Tensor] = {}

    def _generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device)
        return self._generators[device]

    def _draw(self, name: str, param: Tensor) -> Iterator[tuple[int, Tensor]]:
        if self.distribution == "rademacher":
            yield from self._signs(name, param)
            return
        gen = self._generator(param.device)
        gen.manual_seed(tensor_seed(self.public_seed, name))
        total = param.numel()
        for start in range(0, total, CHUNK):
            size = min(CHUNK, total - start)
            yield start, torch.randn(size, generator=gen, device=param.device, dtype=param.dtype)

    def _signs(self, name: str, param: Tensor) -> Iterator[tuple[int, Tensor]]:
        """Rademacher chunks: the tensor's bits drawn once per step from its seed, expanded 8 signs per byte."""
        total = param.numel()
        if name not in self._bits:
            gen = self._generator(param.device)
            gen.manual_seed(tensor_seed(self.public_seed, name))
            words = torch.empty((total + 63) // 64, dtype=torch.int64, device=param.device)
            words.random_(-2 ** 63, None, generator=gen)  # 64 uniform bits per draw (uint8 draws: 8 per draw)
            self._bits[name] = words.view(torch.uint8)
        key = (param.dtype, param.device)
        if key not in self._tables:
            self._tables[key] = _SIGNS.to(device=param.device, dtype=param.dtype)
        table, bits = self._tables[key], self._bits[name]
        for start in range(0, total, SIGN_CHUNK):
            size = min(SIGN_CHUNK, total - start)
            rows = table.index_select(0, bits[start // 8:(start + size + 7) // 8].long())
            yield start, rows.view(-1)[:size]

    def _stored(self, name: str, param: Tensor) -> Iterator[tuple[int, Tensor]]:
        """Like :meth:`chunks`, but kept chunks come in the kept dtype and must not be modified."""
        if self.keep is None:
            yield from self._draw(name, param)
            return
        if name not in self._kept:
            self._kept[name] = [chunk.to(self.keep) for _, chunk in self._draw(name, param)]
        start = 0
        for chunk in self._kept[name]:
            yield start, chunk
            start += chunk.numel()

    def chunks(self, name: str, param: Tensor) -> Iterator[tuple[int, Tensor]]:
        """(flat offset, flat chunk of z) for parameter ``name``, in order (fresh tensors in the parameter's dtype:
        callers may modify them in place)."""
        for start, chunk in self._stored(name, param):
            yield start, chunk if self.keep is None else chunk.to(param.dtype, copy=True)

    def z(self, name: str, param: Tensor) -> Tensor:
        """The whole slice of z for ``name`` (shape of ``param``)."""
        parts = [chunk for _, chunk in self.chunks(name, param)]
        flat = parts[0] if len(parts) == 1 else torch.cat(parts)
        return flat.reshape(param.shape)

    @torch.no_grad()
    def add_to_(self, name: str, param: Tensor, scale: float) -> None:
        """param <- param + scale * z[name], chunk by chunk."""
        if not param.is_contiguous():
            param.add_(self.z(name, param), alpha=scale)
            return
        flat = param.view(-1)
        for start, chunk in self._stored(name, param):
            flat[start:start + chunk.numel()].add_(chunk, alpha=scale)

    @torch.no_grad()
    def perturb_(self, params: Mapping[str, nn.Parameter], scale: float) -> None:
        """theta <- theta + scale * z, in place, one chunk at a time."""
        for name, param in params.items():
            self.add_to_(name, param, scale)

    @torch.no_grad()
    def squared_norm(self, params: Mapping[str, nn.Parameter]) -> float:
        """||z||^2 over all trainable tensors (DPGD-0th clips the whole vector d_i * z)."""
        if self.distribution == "rademacher":
            return float(sum(p.numel() for p in params.values()))
        return float(sum(float(chunk.double().pow(2).sum()) for name, p in params.items()
                         for _, chunk in self.chunks(name, p)))
