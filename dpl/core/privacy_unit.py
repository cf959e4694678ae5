"""The privacy unit of a run as one object: what one unit is, what the mechanism samples, how sampled indices become
rows and how batches are tagged with their units. Built once (:meth:`PrivacyUnit.of`) from ``PrivacyConfig`` and the
users; the engine, the mechanisms and the drivers ask it, and nothing else tests the unit's name.

Names: the *rows* are the training set's items; the *population* is what the mechanism samples (rows; users under
user-level sampling; the rows left after bounding each user to k under example-level sampling); the *units* are what
the guarantee protects (rows or users: delta's N).
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol

from dpl.errors import ConfigError

if TYPE_CHECKING:  # torch is imported where batches are drawn, not for planning (dpl plan loads no torch)
    import torch
    from torch.utils.data import Sampler

    from dpl.core.units import Users

Sampling = Literal["rows", "users", "bounded_rows"]
#: the batch key under which each row's unit travels under user-level sampling (:meth:`PrivacyUnit.tag`)
UNITS_KEY = "dpl_units"


class UnitSettings(Protocol):
    """The settings a unit is built from (:class:`~dpl.core.privacy.PrivacyConfig` has them; it imports this
    module to check them, so this module names only what it reads)."""

    unit: str
    user_sampling: str
    max_rows_per_user: int | None


def names_users(unit: str) -> bool:
    """Whether a ``unit`` setting (``privacy.unit``, ``dpl audit``'s ``unit``) asks for user-level DP."""
    return unit == "user"


def check_setting(unit: str, max_rows_per_user: int | None) -> None:
    """The unit's settings of :class:`~dpl.core.privacy.PrivacyConfig`, checked once: a user needs k."""
    if names_users(unit) and max_rows_per_user is None:
        raise ConfigError("privacy.unit: user needs privacy.max_rows_per_user (k, the most rows one user contributes)")


@dataclass(frozen=True)
class PrivacyUnit:
    """``kind``: ``example`` (one row) or ``user`` (all the rows of one user); ``sampling``: what the mechanism
    samples, ``rows`` (example-level DP), ``users`` (user-level sampling: each sampled user's rows are one unit,
    clipped together) or ``bounded_rows`` (example-level sampling with user-level accounting: each user bounded once
    to k rows, rows clipped one by one); ``users``: the rows of each user (``kind`` user)."""

    kind: Literal["example", "user"] = "example"
    sampling: Sampling = "rows"
    num_rows: int = 0
    users: Users | None = None

    @classmethod
    def of(cls, privacy: UnitSettings, num_rows: int, users: Users | Sequence[Any] | None = None) -> PrivacyUnit:
        """The unit of ``privacy`` over ``num_rows`` training rows. ``users``: the rows of each user, or the user key of
        every row (``None``: the data names no user), required for ``privacy.unit: user`` (one-line ConfigError
        otherwise). With ``privacy.unit: example``, a warning when the keys give users several rows (the per-row
        epsilon then protects a user only by group privacy)."""
        from dpl.core.units import Users

        if users is not None and not isinstance(users, Users):
            users = Users.from_keys(list(users), privacy.max_rows_per_user or 1)
            if privacy.unit != "user":
                _warn_if_users_own_rows(users)
        if privacy.unit != "user":
            return cls("example", "rows", int(num_rows))
        if users is None:
            raise ConfigError("privacy.unit: user needs the user of every training row: set data.user_column")
        if users.num_rows != num_rows:
            raise ConfigError(f"the user column names {users.num_rows} rows, the training set has {num_rows}")
        return cls("user", "users" if privacy.user_sampling == "users" else "bounded_rows", int(num_rows), users)

    # --- flags -------------------------------------------------------------------------------------------------
    @property
    def per_user(self) -> bool:
        """The guarantee covers all the rows of one user."""
        return self.kind == "user"

    @property
    def samples_users(self) -> bool:
        """User-level sampling: batches carry each row's user (``dpl.core.step.UNITS_KEY``), clipped per user."""
        return self.sampling == "users"

    @property
    def bounds_rows(self) -> bool:
        """Example-level sampling with a user-level accountant (ELS): rows clipped one by one, k per user."""
        return self.sampling == "bounded_rows"

    @property
    def max_rows(self) -> int | None:
        """k, the most rows one user contributes (``None`` for examples)."""
        return self.users.max_rows if self.users is not None else None

    # --- counts ------------------------------------------------------------------------------------------------
    @property
    def population(self) -> int:
        """How many things the mechanism samples."""
        if self.users is None:
            return self.num_rows
        return self.users.sampled(self.samples_users)

    @property
    def population_name(self) -> str:
        return "users" if self.samples_users else "examples"

    @property
    def num_units(self) -> int:
        """How many units the guarantee protects (delta's N)."""
        return self.users.num_users if self.users is not None else self.num_rows

    def setup_fields(self) -> dict[str, Any]:
        """The unit as the privacy report and ``RunSetup`` state it."""
        return {"unit": self.kind, "user_sampling": None if self.users is None else
                ("users" if self.samples_users else "rows"), "max_rows_per_user": self.max_rows}

    # --- wording -----------------------------------------------------------------------------------------------
    @property
    def noun(self) -> str:
        """What one unit is called: ``user`` or ``example``."""
        return "user" if self.per_user else "example"

    def adjacency_text(self, adjacency: str | None) -> str:
        """The neighbouring relation of ``adjacency`` (``Mechanism.adjacency``) for this unit, in words."""
        texts = USER_ADJACENCY_TEXT if self.per_user else ADJACENCY_TEXT
        return texts.get(adjacency, f"{adjacency} adjacency of one {'user' if self.per_user else 'training example'}")

    def sampling_text(self, rate: float, batch_size: int) -> str:
        """What Poisson sampling at ``rate`` draws, in words."""
        if self.samples_users:
            return (f"Poisson sampling of users with rate q = {rate:.4g} (expected {batch_size} users per step, up to "
                    f"{self.max_rows} rows of each)")
        if self.bounds_rows:
            return (f"Poisson sampling of rows with rate q = {rate:.4g} after bounding each user to {self.max_rows} "
                    f"rows (expected batch size {batch_size})")
        return f"Poisson sampling with rate q = {rate:.4g} (expected batch size {batch_size})"

    def protects(self) -> str:
        """Whom the guarantee protects, in words."""
        if self.per_user:
            return (f"all the records of each user, among {self.num_units} users ({self.num_rows} training rows; at "
                    f"most {self.max_rows} records of a user are used in training)")
        return f"each training example, among {self.num_rows} training examples"

    @property
    def sampled_noun(self) -> str:
        """What one draw of the mechanism is called: ``users``, ``rows`` (bounded rows) or ``examples``."""
        return "users" if self.samples_users else "rows" if self.bounds_rows else "examples"

    def data_text(self) -> str:
        """What the mechanism samples from, for ``dpl plan``."""
        if self.samples_users:
            return (f"N = {self.population:,} users ({self.num_rows:,} rows; up to k = {self.max_rows} rows of a "
                    "sampled user)")
        if self.bounds_rows:
            return (f"N = {self.population:,} rows (each of the {self.num_units:,} users bounded to k = "
                    f"{self.max_rows} of its rows; {self.num_rows:,} in all)")
        return f"N = {self.population:,} examples"

    def describe(self, rows: str, key: str, one_row: str) -> str:
        """What one unit of a data set is (a data module's ``unit_description``): ``one_row`` for examples; for users
        all the ``rows`` (``"rows of train.tsv"``) sharing the user ``key`` (``"column 'author'"``)."""
        if self.per_user:
            return f"one user: all the {rows} with the same value in {key} (data.user_column)"
        return one_row

    def wording(self, adjacency: str | None, rate: float | None, batch_size: int) -> dict[str, Any]:
        """The unit's words for the privacy report (``privacy.json``'s ``unit_text``)."""
        return {"noun": self.noun, "adjacency": self.adjacency_text(adjacency),
                "poisson_sampling": None if rate is None else self.sampling_text(float(rate), batch_size),
                "protects": self.protects(),
                "clipped": "each user's mean gradient" if self.samples_users else "each example's gradient",
                "not_protected": ["the number of users"] if self.per_user else []}

    # --- batches -----------------------------------------------------------------------------------------------
    def bound(self, generator: torch.Generator) -> list[int] | None:
        """ELS: every user bounded to k rows, chosen once with the secret ``generator`` (the rows the mechanism
        samples from); ``None`` otherwise."""
        return self.users.bounded_rows(generator) if self.bounds_rows else None

    def sampler(self, sampler: Sampler, generator: torch.Generator, bounded_rows: list[int] | None) -> Sampler:
        """The mechanism's ``sampler`` of population indices, as rows: each sampled user's rows (at most k, chosen
        with the secret ``generator``), or positions in the ``bounded_rows``, or the rows themselves."""
        from dpl.core.units import RowsSampler, UserRowsSampler

        if self.bounds_rows:
            return RowsSampler(sampler, bounded_rows)
        if self.samples_users:
            return UserRowsSampler(sampler, self.users, generator)
        return sampler

    def unit_of_row(self) -> list[int] | None:
        """Under user-level sampling the user of every row (what :meth:`tag` adds); else ``None``."""
        return self.users.unit_of_row() if self.samples_users else None

    def tag(self, batch: dict[str, Any], rows: list[int]) -> dict[str, Any]:
        """``batch`` (collated from ``rows``) with each row's unit under ``UNITS_KEY`` where units are sampled whole
        (user-level sampling); unchanged otherwise."""
        if not self.samples_users:
            return batch
        import torch

        unit_of = self._unit_of_tensor()
        batch[UNITS_KEY] = unit_of[torch.as_tensor(list(rows), dtype=torch.long)]
        return batch

    def _unit_of_tensor(self) -> torch.Tensor:
        import torch

        cached = self.__dict__.get("_unit_of")
        if cached is None:
            cached = torch.as_tensor(self.unit_of_row(), dtype=torch.long)
            object.__setattr__(self, "_unit_of", cached)
        return cached


def _warn_if_users_own_rows(users: Users) -> None:
    most = max((len(rows) for rows in users.rows), default=1)
    if most > 1:
        import warnings

        from dpl.errors import PrivacyWarning

        warnings.warn(f"data.user_column is set but privacy.unit is example: a user with {most} rows is protected "
                      f"only by group privacy (about {most} x epsilon, delta x {most} e^(({most} - 1) epsilon)); set "
                      "privacy.unit: user to protect users", PrivacyWarning, stacklevel=4)


#: the neighbouring relation of each adjacency a mechanism can state (``Mechanism.adjacency``), per example
ADJACENCY_TEXT = {"add_remove": "adding or removing one training example",
                  "zero_out": "replacing one training example's contribution by zero (zero-out)",
                  "replace_one": "replacing one training example by another"}
#: the same relations for the unit user (all the rows of one user)
USER_ADJACENCY_TEXT = {"add_remove": "adding or removing all the training rows of one user",
                       "zero_out": "replacing all of one user's contributions by zero (zero-out)",
                       "replace_one": "replacing all the rows of one user by another user's"}
#: the unit of example-level DP (one row), before a run builds its own
EXAMPLE = PrivacyUnit()
