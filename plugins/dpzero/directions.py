"""DPZero's public random direction z, regenerated tensor by tensor, never stored whole.

Two distributions, both with E[z z^T] = I (what makes the two-point estimate unbiased):

* ``gaussian``: z ~ N(0, I), as in Zhang et al.'s DPZero and Malladi et al.'s MeZO;
* ``rademacher``: independent signs z_i = +-1 with probability 1/2 (SPSA: Spall, "Multivariate stochastic
  approximation using a simultaneous perturbation gradient approximation", IEEE TAC 1992).
  The signs are drawn once per step as packed bits (1 bit per parameter: 1/32 of fp32 weights) and expanded
  chunk by chunk through a 256-row table (a byte -> its 8 signs as int8), so each pass over the parameters costs
  a table lookup and an add instead of a Gaussian draw (``benchmarks/dpzero_memory.py`` measures both).

With ``keep``, z is expanded once per step and kept until the update instead of being regenerated at each pass:
a Gaussian z rounded to bfloat16 (2 bytes per parameter), a Rademacher z as int8 signs (1 byte per parameter,
exact). The passes then only widen the kept chunks (into one reused buffer) and add them.

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
# byte -> its 8 bits as int8 signs -1/+1 (bit k -> sign k), the 8 signs packed in one int64: one lookup per byte
_SIGN_BYTES = (((torch.arange(256).unsqueeze(-1) >> torch.arange(8)) & 1).mul(2).sub(1).to(torch.int8)
               .view(torch.int64).view(-1))


class DirectionSampler:
    """Regenerates z for one step: ``z(name, param)`` is the same tensor every time it is asked for.

    A tensor's slice of z is drawn in flat chunks of at most ``CHUNK`` elements (``SIGN_CHUNK`` for Rademacher
    signs), in order, from its own seed; ``chunks(name, param)`` yields them one at a time (perturbing and updating
    a large embedding matrix then needs a few MiB of scratch, not a copy of the matrix), and ``z`` concatenates the
    same chunks.

    With ``keep``, z is expanded at its first use and kept for the step: one draw instead of one per pass
    (perturb, perturb back, update). A Gaussian z is rounded to bfloat16 (2 bytes per parameter; the rounded z is
    the direction: every pass and the update use the same values), a Rademacher z is kept as int8 signs (1 byte
    per parameter, the same values).
    """

    def __init__(self, public_seed: int, keep: bool = False, distribution: Distribution = "gaussian") -> None:
        if distribution not in ("gaussian", "rademacher"):
            raise ValueError(f"unknown direction distribution {distribution!r}")
        self.public_seed = int(public_seed)
        self.keep = bool(keep)
        self.distribution = distribution
        self._generators: dict[torch.device, torch.Generator] = {}
        self._kept: dict[str, list[Tensor]] = {}
        self._bits: dict[str, Tensor] = {}  # rademacher: packed signs per tensor (bit k of byte j: element 8j + k)
        self._tables: dict[torch.device, Tensor] = {}
        self._buffers: dict[tuple[torch.dtype, torch.device], Tensor] = {}  # widened chunks, reused

    def _generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device)
        return self._generators[device]

    def _draw(self, name: str, param: Tensor) -> Iterator[tuple[int, Tensor]]:
        """(flat offset, chunk): Gaussian chunks in the parameter's dtype, Rademacher chunks as int8 signs."""
        if self.distribution == "rademacher":
            yield from self._signs(name, param)
            return
        gen = self._generator(param.device)
        gen.manual_seed(tensor_seed(self.public_seed, name))
        total = param.numel()
        for start in range(0, total, CHUNK):
            size = min(CHUNK, total - start)
            yield start, torch.randn(size, generator=gen, device=param.device, dtype=param.dtype)

    def _bits_of(self, name: str, param: Tensor) -> Tensor:
        """A Rademacher z's packed signs (uint8; bit k of byte j: element 8j + k), drawn once per step from its seed."""
        if name not in self._bits:
            gen = self._generator(param.device)
            gen.manual_seed(tensor_seed(self.public_seed, name))
            words = torch.empty((param.numel() + 63) // 64, dtype=torch.int64, device=param.device)
            words.random_(-2 ** 63, None, generator=gen)  # 64 uniform bits per draw (uint8 draws: 8 per draw)
            self._bits[name] = words.view(torch.uint8)
        return self._bits[name]

    def _table(self, device: torch.device) -> Tensor:
        if device not in self._tables:
            self._tables[device] = _SIGN_BYTES.to(device)
        return self._tables[device]

    def _signs(self, name: str, param: Tensor) -> Iterator[tuple[int, Tensor]]:
        """Rademacher chunks (int8): the tensor's bits expanded 8 signs per byte."""
        total = param.numel()
        bits = self._bits_of(name, param)
        table = self._table(param.device)
        for start in range(0, total, SIGN_CHUNK):
            size = min(SIGN_CHUNK, total - start)
            packed = table.index_select(0, bits[start // 8:(start + size + 7) // 8].long())
            yield start, packed.view(torch.int8)[:size]

    def _stored(self, name: str, param: Tensor, store: bool = True) -> Iterator[tuple[int, Tensor]]:
        """Like :meth:`_draw`, but with ``keep`` the chunks are compact (bfloat16 or int8) and come from the store,
        filled at the first use (``store``); kept chunks must not be modified."""
        if not self.keep:
            yield from self._draw(name, param)
            return
        if name not in self._kept:
            compact = ((start, chunk if chunk.dtype == torch.int8 else chunk.to(torch.bfloat16))
                       for start, chunk in self._draw(name, param))
            if not store:
                yield from compact
                return
            self._kept[name] = [chunk for _, chunk in compact]
        start = 0
        for chunk in self._kept[name]:
            yield start, chunk
            start += chunk.numel()

    def _widened(self, chunk: Tensor, dtype: torch.dtype) -> Tensor:
        """``chunk`` in ``dtype``, in a buffer reused by every pass (a mixed-dtype add would allocate its own)."""
        key = (dtype, chunk.device)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < chunk.numel():
            size = max(CHUNK, SIGN_CHUNK, chunk.numel())
            buffer = self._buffers[key] = torch.empty(size, dtype=dtype, device=chunk.device)
        return buffer[:chunk.numel()].copy_(chunk)

    def chunks(self, name: str, param: Tensor) -> Iterator[tuple[int, Tensor]]:
        """(flat offset, flat chunk of z) for parameter ``name``, in order (fresh tensors in the parameter's dtype:
        callers may modify them in place)."""
        # nothing is stored from here: the update, the last use of z in a step, reads it this way
        for start, chunk in self._stored(name, param, store=False):
            fresh = not self.keep and chunk.dtype == param.dtype  # drawn for this call alone
            yield start, chunk if fresh else chunk.to(param.dtype, copy=True)

    @torch.no_grad()
    def rows(self, name: str, param: Tensor, rows: Tensor) -> Tensor:
        """``z[name][rows]`` for a 2-D parameter (``rows``: sorted int64 row indices), in the parameter's dtype.

        Rademacher: read from the bits directly. Gaussian: picked from the chunks (drawn, or kept)."""
        width = param.shape[1]
        if self.distribution == "rademacher" and width % 8 == 0:  # whole bytes per row: expand them
            per_row = width // 8
            bytes_ = (rows.unsqueeze(-1) * per_row + torch.arange(per_row, device=rows.device)).reshape(-1)
            signs = self._table(param.device).index_select(0, self._bits_of(name, param)[bytes_].long())
            return signs.view(torch.int8).to(param.dtype).view(-1, width)
        index = (rows.unsqueeze(-1) * width + torch.arange(width, device=rows.device)).reshape(-1)  # sorted
        if self.distribution == "rademacher":
            bits = self._bits_of(name, param)[index >> 3].long()
            return ((bits >> (index & 7)) & 1).mul_(2).sub_(1).to(param.dtype).view(-1, width)
        out = torch.empty(index.numel(), dtype=param.dtype, device=param.device)
        for start, chunk in self._stored(name, param):
            bounds = torch.searchsorted(index, torch.tensor([start, start + chunk.numel()], device=index.device))
            low, high = int(bounds[0]), int(bounds[1])
            if high > low:
                out[low:high] = chunk[index[low:high] - start]
        return out.view(-1, width)

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
            if chunk.dtype != param.dtype:
                chunk = self._widened(chunk, param.dtype)
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
