"""Default ``privatize``: independent Gaussian noise N(0, sigma^2 C^2) on the clipped sum, divided by the
expected batch size; Poisson sampling and PRV accounting (``configure_mechanism``). With adaptive clipping thresholds
(``privacy.clipping_thresholds: adaptive``) it also releases the groups' counts (:mod:`dpl.core.group_clipping`):
sigma is the pair's, the gradient's noise multiplier sigma / sqrt(1 - share)."""

from __future__ import annotations

from dpl.api import (CLIPPING_COUNTS_KEY, GradientSum, Mechanism, PluginError, PoissonGaussian, PrivateGradient,
                     RunSetup, StepContext, UserLevelExampleSampling, clipping_policy, hookimpl, noisy_fractions,
                     noisy_means_)


class GaussianPlugin:
    """The Gaussian mechanism of DP-SGD."""

    description = "default privatize: independent Gaussian noise N(0, sigma^2 C^2), Poisson sampling, PRV accounting"

    def __init__(self) -> None:
        self.count_share: float | None = None  # adaptive clipping thresholds: the counts' part of 1/sigma^2

    @hookimpl(trylast=True)
    def configure_mechanism(self, setup: RunSetup) -> Mechanism:
        if setup.unit.bounds_rows:
            mechanism = UserLevelExampleSampling(setup.sampling_rate, setup.unit.max_rows, accountant=setup.accountant)
        else:
            mechanism = PoissonGaussian(setup.sampling_rate, accountant=setup.accountant, unit=setup.unit.kind)
        privacy = setup.privacy
        if privacy.adaptive_clipping:
            self.count_share = share = privacy.clipping_count_share
            groups = len(clipping_policy.clipping_groups(list(setup.trainable), privacy.clipping_groups))
            mechanism.noise_scale = 1 / (1 - share) ** 0.5
            mechanism.clipping = (f"per_layer adaptive over {groups} groups: the counts take {share:g} of 1/sigma^2 "
                                  f"(gradient noise sigma x {mechanism.noise_scale:.4g}, counts' noise std "
                                  f"{groups ** 0.5 / (2 * share ** 0.5):.4g} sigma)")
        return mechanism

    @hookimpl(trylast=True)
    def privatize(self, ctx: StepContext, gradient_sum: GradientSum) -> PrivateGradient:
        sigma, info = ctx.noise_multiplier, {}
        batch = float(ctx.expected_batch_size)
        counts = gradient_sum.values.pop(CLIPPING_COUNTS_KEY, None)
        if counts is not None:  # adaptive thresholds: the counts released with the gradient, one mechanism
            if self.count_share is None:
                raise PluginError("the clipped sum carries clipping counts but the run's mechanism does not account "
                                  "for them")
            sigma, count_std = clipping_policy.count_noise(sigma, counts.numel(), self.count_share)
            info["clipping_fractions"] = noisy_fractions(counts, count_std, batch, ctx.noise_source)
        # sigma = 0 means no noise (even with C = inf, where sigma * C would be nan).
        std = sigma * ctx.max_grad_norm if sigma > 0 else 0.0
        if std > 0:  # written into the clipped sum, which dpl wipes after privatize: no buffer of noise beside it
            values = noisy_means_(gradient_sum.values, std, batch, ctx.noise_source)
        else:
            values = {key: total / batch for key, total in gradient_sum.values.items()}
        return PrivateGradient(values, noise_std=std / batch, mechanism="gaussian",
                               expected_batch_size=batch, step=ctx.step, info=info)
