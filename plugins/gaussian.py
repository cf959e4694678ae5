"""Default ``privatize``: independent Gaussian noise N(0, sigma^2 C^2) on the clipped sum, divided by the
expected batch size; Poisson sampling and PRV accounting (``configure_mechanism``)."""

from __future__ import annotations

from dpl.api import (GradientSum, Mechanism, PoissonGaussian, PrivateGradient, RunSetup, StepContext,
                     UserLevelExampleSampling, hookimpl, noisy_means_)


class GaussianPlugin:
    """The Gaussian mechanism of DP-SGD."""

    description = "default privatize: independent Gaussian noise N(0, sigma^2 C^2), Poisson sampling, PRV accounting"

    @hookimpl(trylast=True)
    def configure_mechanism(self, setup: RunSetup) -> Mechanism:
        if setup.unit.bounds_rows:
            return UserLevelExampleSampling(setup.sampling_rate, setup.unit.max_rows, accountant=setup.accountant)
        return PoissonGaussian(setup.sampling_rate, accountant=setup.accountant, unit=setup.unit.kind)

    @hookimpl(trylast=True)
    def privatize(self, ctx: StepContext, gradient_sum: GradientSum) -> PrivateGradient:
        # sigma = 0 means no noise (even with C = inf, where sigma * C would be nan).
        std = ctx.noise_multiplier * ctx.max_grad_norm if ctx.noise_multiplier > 0 else 0.0
        batch = float(ctx.expected_batch_size)
        if std > 0:  # written into the clipped sum, which dpl wipes after privatize: no buffer of noise beside it
            values = noisy_means_(gradient_sum.values, std, batch, ctx.noise_source)
        else:
            values = {key: total / batch for key, total in gradient_sum.values.items()}
        return PrivateGradient(values, noise_std=std / batch, mechanism="gaussian",
                               expected_batch_size=batch, step=ctx.step)
