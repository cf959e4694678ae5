"""The privacy unit: which training rows belong to one user, and how sampled units become rows.

With ``privacy.unit: user`` the guarantee covers all the rows of one user (neighbouring data sets differ in one
user). :class:`Users` holds the rows of each user (from the data's ``user_column``) and the contribution bound k
(``privacy.max_rows_per_user``). Two samplers, after Charles et al., "Fine-tuning large language models with
user-level differential privacy" (SaTML 2025):

* user-level sampling (``user_sampling: users``): the mechanism samples *users*; :class:`UserRowsSampler` turns each
  sampled user into up to k of its rows, chosen uniformly with the secret sampler generator (a choice that depends
  on that user's rows alone), the rows of one user contiguous in the batch; the estimator clips each user's mean
  gradient as one unit;
* example-level sampling (``user_sampling: rows``): each user is bounded once to k rows (:meth:`Users.bounded_rows`);
  the mechanism samples those rows, each clipped on its own, and the accountant is user-level
  (:func:`dpl.core.accounting.els_epsilon`).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import Sampler

from dpl.errors import ConfigError


@dataclass(frozen=True)
class Users:
    """The rows of each user (users in order of first appearance) and the contribution bound ``max_rows`` (k)."""

    rows: tuple[tuple[int, ...], ...]
    max_rows: int

    @classmethod
    def from_keys(cls, keys: Sequence[Any], max_rows: int) -> Users:
        """Group row indices by user key (``keys[i]``: the user of row i)."""
        if max_rows < 1:
            raise ConfigError(f"privacy.max_rows_per_user must be >= 1, got {max_rows}")
        groups: dict[Any, list[int]] = {}
        for row, key in enumerate(keys):
            groups.setdefault(key, []).append(row)
        return cls(tuple(tuple(rows) for rows in groups.values()), int(max_rows))

    @property
    def num_users(self) -> int:
        return len(self.rows)

    @property
    def num_rows(self) -> int:
        return sum(len(r) for r in self.rows)

    def sampled(self, whole_users: bool) -> int:
        """How many things the mechanism samples: users (``whole_users``) or the rows left after bounding."""
        return self.num_users if whole_users else sum(min(len(r), self.max_rows) for r in self.rows)

    def unit_of_row(self) -> list[int]:
        """The user index of every row."""
        out = [0] * self.num_rows
        for user, rows in enumerate(self.rows):
            for row in rows:
                out[row] = user
        return out

    def pick(self, user: int, generator: torch.Generator) -> list[int]:
        """The rows a sampled user contributes: all of them if at most k, else k chosen uniformly (secret)."""
        rows = self.rows[user]
        if len(rows) <= self.max_rows:
            return list(rows)
        chosen = torch.randperm(len(rows), generator=generator)[:self.max_rows].sort().values
        return [rows[i] for i in chosen.tolist()]

    def bounded_rows(self, generator: torch.Generator) -> list[int]:
        """Every user bounded to at most k rows (chosen uniformly with ``generator``), in row order."""
        return sorted(row for user in range(self.num_users) for row in self.pick(user, generator))

    def summary(self) -> dict[str, Any]:
        """Users, rows, rows per user (min / median / max), k, and the rows beyond the bound (never used at a
        time: ULS picks k of a larger user's rows at each sampling, ELS keeps k of them for the run)."""
        sizes = [len(r) for r in self.rows]
        return {"users": self.num_users, "rows": self.num_rows, "rows_per_user_min": min(sizes),
                "rows_per_user_median": float(statistics.median(sizes)), "rows_per_user_max": max(sizes),
                "max_rows_per_user": self.max_rows,
                "rows_beyond_bound": sum(max(0, s - self.max_rows) for s in sizes)}

    def describe(self) -> str:
        s = self.summary()
        return (f"{s['users']} users, {s['rows']} rows (per user: min {s['rows_per_user_min']}, median "
                f"{s['rows_per_user_median']:g}, max {s['rows_per_user_max']}); k = {self.max_rows} rows per user, "
                f"{s['rows_beyond_bound']} rows beyond it")


class UserRowsSampler(Sampler[list[int]]):
    """Wraps a sampler of user indices: each sampled user becomes the rows it contributes (:meth:`Users.pick`),
    a user's rows contiguous."""

    def __init__(self, users_sampler: Sampler, users: Users, generator: torch.Generator) -> None:
        self.users_sampler, self.users, self.generator = users_sampler, users, generator

    def __len__(self) -> int:
        return len(self.users_sampler)

    def __iter__(self) -> Iterator[list[int]]:
        for batch in self.users_sampler:
            yield [row for user in batch for row in self.users.pick(int(user), self.generator)]


class RowsSampler(Sampler[list[int]]):
    """Wraps a sampler of positions in ``rows`` (the bounded rows of ELS): yields the rows themselves."""

    def __init__(self, sampler: Sampler, rows: Sequence[int]) -> None:
        self.sampler, self.rows = sampler, list(rows)

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator[list[int]]:
        for batch in self.sampler:
            yield [self.rows[int(i)] for i in batch]


def unit_sizes(units: torch.Tensor) -> torch.Tensor:
    """Per row: the number of rows of its unit in this batch (``units``: the unit id of every row)."""
    _, inverse, counts = torch.unique(units, return_inverse=True, return_counts=True)
    return counts[inverse]


class Grouping:
    """The units of a batch (``units``: unit id per example, a unit's examples contiguous): per-unit sums of
    per-example tensors, and per-unit token sequences made of all the unit's examples' tokens."""

    def __init__(self, units: Tensor, cache: bool = True) -> None:
        self.cache = cache  # keep each token sequence for the layers that read the same tensor (no: make it per use)
        _, self.inverse, counts = torch.unique_consecutive(units, return_inverse=True, return_counts=True)
        self.count, self.rows = int(counts.numel()), int(units.numel())
        if self.count != int(torch.unique(units).numel()):
            raise ValueError("the rows of a privacy unit must be contiguous in the batch")
        widest = int(counts.max()) if self.count else 0
        starts = torch.cumsum(counts, 0) - counts
        slot = torch.arange(widest, device=units.device)
        index = starts[:, None] + slot[None, :]  # (units, widest): rows of each unit, then padding (= rows)
        self.index = torch.where(slot[None, :] < counts[:, None], index, torch.full_like(index, self.rows))
        self._tokens: dict[tuple, Tensor] = {}

    def sum(self, t: Tensor) -> Tensor:
        """(examples, ...) -> (units, ...): the sum over each unit's examples."""
        out = torch.zeros((self.count, *t.shape[1:]), dtype=t.dtype, device=t.device)
        return out.index_add_(0, self.inverse.to(t.device), t)

    def all_rows(self, flags: Tensor) -> Tensor:
        """Per unit: whether every example of it is flagged."""
        return self.sum((~flags).to(torch.int64)) == 0

    def tokens(self, t: Tensor) -> Tensor:
        """(examples, [positions,] ...) -> (units, widest * positions, ...): each unit's examples concatenated
        along the positions, padded with zeros (which add nothing to a gradient); computed once per tensor."""
        key = (t.data_ptr(), tuple(t.shape), t.stride())
        if not self.cache:
            self._tokens.clear()
        if key not in self._tokens:
            x = t.unsqueeze(1) if t.dim() == 2 and t.is_floating_point() else t  # (B, d) -> (B, 1, d)
            padded = torch.cat([x, x.new_zeros((1, *x.shape[1:]))])
            grouped = padded[self.index.to(t.device)]  # (units, widest, positions, ...)
            self._tokens[key] = grouped.reshape(self.count, -1, *x.shape[2:])
        return self._tokens[key]
