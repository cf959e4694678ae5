"""The plugin API: everything a dpl plugin may use, in one module (``from dpl.api import ...``).

A plugin is an object whose methods are marked with :data:`hookimpl` (the hooks are documented in
:mod:`dpl.core.hookspecs` and docs/hooks.md), registered in the entry-point group ``dpl``. Its constructor's keyword
arguments are its options (typed: they are checked when the config is parsed); its ``contract`` attribute
(:class:`Contract`) declares what it does to the step, so that the core refuses combinations without an analysis;
``state_dict()`` / ``load_state_dict()`` hold its public state (checkpoint) and ``secret_state_dict()`` /
``load_secret_state_dict()`` its secrets (owner-only sidecar). The built-in plugins use nothing else, and
``test_built_in_plugins_use_only_the_plugin_api`` in tests/test_plugin_contracts.py checks it.

A plugin declares what its mechanism releases as events (:mod:`dpl.core.accounting.events`, ``steps_event``); it
computes no epsilon and calibrates no sigma: dpl does both from the events, for every run, resume and ledger.
"""

from dpl.core import clipping_policy
from dpl.core.gradients import GradientSum, PrivateGradient
from dpl.core.group_clipping import noisy_fractions
from dpl.core.hookspecs import hookimpl
from dpl.core.accounting import events
from dpl.core.mechanism import Mechanism, PoissonGaussian, UserLevelExampleSampling, steps_event
from dpl.core.noise import (NoiseSource, SecureNormal, noisy_mean_, noisy_means_, normal, normals, normals_like,
                            replay_source)
from dpl.core.per_example import PerExampleClipper
from dpl.core.plugin_manager import Contract
from dpl.core.sampling import PoissonBatchSampler, poisson_mask
from dpl.core.step import CLIPPING_COUNTS_KEY, PADDING_KEY, UNITS_KEY, ReleaseContext, RunSetup, StepContext, batch_size_of
from dpl.core.units import unit_sizes
from dpl.core.update import StreamingDirection, streaming_refusal
from dpl.errors import ConfigError, PluginError, PrivacyViolation, PrivacyWarning

__all__ = ["CLIPPING_COUNTS_KEY", "ConfigError", "Contract", "GradientSum", "Mechanism", "NoiseSource", "PADDING_KEY", "PerExampleClipper",
           "PluginError", "PoissonBatchSampler", "PoissonGaussian", "PrivacyViolation", "PrivacyWarning",
           "PrivateGradient", "ReleaseContext", "RunSetup", "SecureNormal", "StepContext", "StreamingDirection",
           "batch_size_of", "clipping_policy", "events", "hookimpl", "noisy_fractions", "noisy_mean_", "noisy_means_", "normal", "normals", "normals_like",
           "poisson_mask", "replay_source", "steps_event", "streaming_refusal", "UNITS_KEY", "UserLevelExampleSampling",
           "unit_sizes"]
