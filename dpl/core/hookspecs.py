"""The hooks a dpl plugin can implement (pluggy). Kept free of heavy imports.

A private training step, per logical batch, calls the four *step hooks* in this order:

1. ``estimate_gradient`` - once per physical micro-batch; the results are summed over the logical batch.
2. ``privatize``         - exactly once per logical batch; the only hook that may read the raw sum.
3. ``post_process``      - every active implementation, in the order the plugins are named in the config.
4. ``precondition``      - once; turns the private gradient into the update direction.

Two *setup hooks* run once before training: ``validate_setup`` (every plugin may refuse a configuration) and
``configure_mechanism`` (the privatizing plugin says how batches are drawn and how privacy is accounted).

``firstresult`` hooks take the first non-``None`` answer. The built-in defaults (``clip`` and ``gaussian``)
are registered ``trylast``, so any plugin named in the config that implements the same hook replaces them.
Two named plugins implementing the same ``firstresult`` step hook cannot be combined: the plugin manager
refuses them when it loads them. See ``docs/hooks.md`` for examples.

Besides the hooks, a plugin object may have:

* ``contract`` - a :class:`dpl.api.Contract` declaring what it does to the step: ``changes_noise`` (changes the
  noise left in the release), ``needs_noise_std`` (reads the release's noise std), ``rank_one_release`` (releases a
  scalar along a public direction), ``needs_gradient_matrices`` (needs a gradient per parameter), ``full_tensors``
  (works on whole tensors, not FSDP shards), ``clips_units`` (its estimator bounds each privacy unit as one); the core
  refuses conflicting combinations from these declarations (:func:`dpl.core.plugin_manager.check_contracts`).
* state, in pairs (:data:`dpl.core.plugin_manager.STATE_METHODS`, checked when the plugin is loaded):
  ``state_dict() -> dict`` / ``load_state_dict(state)`` for public state, written into the checkpoint a user may
  share (values that are functions of DP releases only, e.g. Adam moments); ``secret_state_dict() -> dict`` /
  ``load_secret_state_dict(state | None)`` for secrets (generator states, noise buffers, permutations), written only
  into the owner-only ``.secret`` sidecar; ``None`` means the sidecar is missing: continue from fresh OS entropy or
  raise ``ConfigError``. ``load_state_dict`` raises ``ConfigError`` when the saved state cannot continue this run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:  # pragma: no cover - typing only
    from dpl.core.gradients import GradientSum, PrivateGradient
    from dpl.core.mechanism import Mechanism
    from dpl.core.step import ReleaseContext, RunSetup, StepContext

PROJECT = "dpl"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

STEP_HOOKS = ("estimate_gradient", "privatize", "post_process", "precondition")
SETUP_HOOKS = ("validate_setup", "configure_mechanism")


@hookspec(firstresult=True)
def estimate_gradient(ctx: StepContext, batch: dict[str, Any]) -> GradientSum | None:
    """Return the sum over ``batch`` (one physical micro-batch) of per-example contributions, each with
    L2 norm at most ``ctx.max_grad_norm`` (the sensitivity of the sum under add/remove adjacency).

    Called once per micro-batch; dpl adds the results over the logical batch. ``batch`` may be empty
    (Poisson sampling can draw no example): return zeros then. The result must not depend on any example
    outside ``batch``.

    Privacy contract: every example's contribution is bounded by C; nothing is released here.
    Default: ``clip`` (per-example gradients by backpropagation, clipped to C, summed).
    Example: DPZero returns the sum of per-example finite differences along a public random direction,
    clipped to [-C, C].
    """


@hookspec(firstresult=True)
def privatize(ctx: StepContext, gradient_sum: GradientSum) -> PrivateGradient | None:
    """Add noise to the clipped sum of the logical batch and divide by the expected batch size.

    Called exactly once per logical batch. This is the only hook that reads ``gradient_sum``; dpl wipes it
    right after. It may write the release into the sum's tensors (the default does: no noise buffer of the
    model's size beside them), so a wrapper that reads the clean sum (non-private diagnostics) copies it first.
    The returned :class:`~dpl.core.gradients.PrivateGradient` must carry the per-coordinate standard deviation of
    the noise it contains (``noise_std``) so that later hooks can use it.

    Privacy contract: the noise is drawn from ``ctx.noise_source`` through :func:`dpl.core.noise.normal` (a
    secret ChaCha20 key from OS entropy unless the user set ``privacy.seed``; identical on every DDP rank, so the
    noise is added once; never torch's float32 ``randn``, whose tails stop at 5.77 sigma); no public value may
    determine it (never ``ctx.public_seed``). The release's ``mechanism`` must be the name of the
    mechanism the run accounts for (``configure_mechanism``); dpl checks it every step.
    Default: ``gaussian`` (independent N(0, sigma^2 C^2) per coordinate).
    Example: FTRL adds correlated noise built from the current and past draws.
    """


@hookspec
def post_process(ctx: ReleaseContext, gradient: PrivateGradient) -> None:
    """Transform the private gradient in place (``gradient.values``).

    Called once per step for every active plugin that implements it, in the order the plugins are named in
    the config.

    Privacy contract: read only ``gradient``, public data and the plugin's own state - never the clipped sum
    or per-example data. That makes it post-processing of a DP release, free of privacy cost. ``ctx`` is a
    :class:`~dpl.core.step.ReleaseContext`: it has no noise source and no forward pass on the examples.
    Example: ``denoise`` shrinks each 2-D gradient matrix with random-matrix theory, reading
    ``gradient.noise_std``.
    """


@hookspec(firstresult=True)
def precondition(ctx: ReleaseContext, gradient: PrivateGradient) -> dict[str, Any] | None:
    """Return the update direction per trainable parameter name; dpl writes it to ``param.grad`` and calls
    the configured torch optimizer.

    Called once per step, after ``post_process``. Default (no implementation answers): the private gradient
    itself.

    Privacy contract: as ``post_process`` (post-processing, no privacy cost).
    Example: ``adambc`` returns Adam's direction with the DP noise variance removed from the second moment
    (and requires a plain SGD optimizer).
    """


@hookspec
def validate_setup(setup: RunSetup) -> None:
    """Check the run's configuration before anything trains; raise ``dpl.errors.ConfigError`` with a one-line
    reason to refuse it (an unsupported model layer, an optimizer the plugin cannot work with).

    Called once for every active plugin, at ``engine.setup``, after the plugins' declared contracts were checked
    (:func:`dpl.core.plugin_manager.check_contracts` refuses conflicting combinations, such as ``denoise`` with
    ``dpzero``: no plugin names another). ``setup`` holds ``model``, ``trainable``, ``plugin_names`` (the active
    plugins), ``population``, ``expected_batch_size``, ``steps``, ``sampling_rate``, ``accountant``,
    ``optimizer_name``, ``replaced_hooks``, ``seed``, ``world_size``, ``optimizer_factory``, ``secure_noise``,
    ``sharded``, ``unit``, ``clipping_memory``, ``clipping_memory_budget`` and ``privacy`` (docs/hooks.md says what
    each is).
    Example: ``denoise`` refuses a model with no trainable 2-D parameter matching its patterns.
    """


@hookspec(firstresult=True)
def configure_mechanism(setup: RunSetup) -> Mechanism | None:
    """Return the :class:`~dpl.core.mechanism.Mechanism` that owns batch sampling and privacy accounting for the
    noise this run adds.

    Called once at setup. Default: ``gaussian`` (Poisson sampling, PRV accountant for the subsampled
    Gaussian). A plugin that replaces ``privatize`` with noise of another structure must implement it.
    """
