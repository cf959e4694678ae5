"""The ``denoise`` post-processing plugin: random-matrix-theory optimal shrinkage of noisy gradient matrices.

After ``privatize``, each selected 2-D gradient matrix Y (per-entry noise std s, read from the private
gradient's metadata) whose top singular value exceeds kappa * s * (sqrt(m) + sqrt(n)) is replaced by its
Shabalin-Nobel optimal low-rank estimate, rescaled to Y's Frobenius norm (norm correction). It reads only the
released gradient, so it is post-processing: no privacy cost. See ``shrinkage.py`` for the formulas.

Opt-in and NOT private: ``nonprivate_diagnostics`` logs the Improvement(t) = cos(D(g~), g) - cos(g~, g) of
Dadsetan and Rudzicz (arXiv 2510.01137, 2025), which reads the clean clipped gradient g (see
:meth:`DenoisePlugin.privatize`).
"""

from __future__ import annotations

import fnmatch
import math
import warnings
from collections.abc import Generator, Mapping
from dataclasses import replace
from typing import Literal

import torch
from torch import Tensor

from dpl.api import ConfigError, Contract, GradientSum, PrivacyWarning, PrivateGradient, RunSetup, StepContext, hookimpl
from dpl_plugins.denoise.shrinkage import DenoiseStats, Method, ShrinkageOptions, denoise_matrices

#: the parameter presets of ``parameters`` (else a list of glob patterns)
PARAMETER_PRESETS = {"all": ["*"], "lora": ["*lora_A*", "*lora_B*"]}
NONPRIVATE_PREFIX = "nonprivate/"
NONPRIVATE_WARNING = ("denoise: non-private diagnostics enabled: logged values read the clean gradient and are not "
                      "covered by the privacy guarantee (metrics named 'nonprivate/...'; use for research only, "
                      "never release them)")


class DenoisePlugin:
    """RMT gradient denoising (``post_process``).

    Its shrinkage works on each parameter's gradient matrix and changes the noise left in it in a data-dependent
    way (its ``contract``), so it is refused with a rank-one estimator and before a plugin that reads the noise std.

    Args:
        kappa: denoise a matrix only if its top singular value exceeds kappa times the noise bulk edge.
        norm_correction: rescale each denoised matrix to the noisy matrix's Frobenius norm (turn off only for
            the ablation).
        parameters: ``all`` (every 2-D gradient: linear layers, LoRA A/B, trainable embeddings), ``lora``
            (LoRA A/B matrices only), or a list of glob patterns of parameter names.
        svd: ``auto`` (default: a Cholesky certificate on the Gram matrix leaves pure-noise matrices alone without
            any decomposition; the others get an eigendecomposition of their float64 Gram matrix), ``full``
            (batched SVD, the reference) or ``randomized`` (leading components, growing the rank as needed).
            All three give the same result (to float rounding; ``randomized`` to about 1e-3).
        rank: first rank tried by ``randomized`` (at least 1; default 8).
        nonprivate_diagnostics: NOT PRIVATE, off by default. Log, every step, the paper's
            Improvement = cos(D(g~), g) - cos(g~, g) of the denoiser D on the privatized gradient g~ against the
            clean clipped gradient g (clipped sum / expected batch size), for the whole gradient and per denoised
            matrix, under ``nonprivate/...`` names. The values are functions of the clean gradient: they are not
            covered by the privacy guarantee. Training is unaffected (bit for bit).
    """

    description = "random-matrix-theory shrinkage of each noisy gradient matrix (post-processing: no privacy cost)"

    contract = Contract(changes_noise=True, needs_gradient_matrices=True)

    def __init__(self, kappa: float = 1.02, norm_correction: bool = True,
                 parameters: Literal["all", "lora"] | list[str] = "all",
                 svd: Method = "auto", rank: int | None = None, nonprivate_diagnostics: bool = False) -> None:
        if not kappa > 0:
            raise ConfigError(f"denoise: kappa must be > 0, got {kappa}")
        if rank is not None and rank < 1:
            raise ConfigError(f"denoise: rank must be at least 1, got {rank}")
        self.kappa = kappa
        self.norm_correction = norm_correction
        self.patterns = PARAMETER_PRESETS[parameters] if isinstance(parameters, str) else list(parameters)
        self.svd = svd
        self.options = ShrinkageOptions(kappa=kappa, norm_correction=norm_correction, method=svd, rank=rank)
        self.rank = rank
        self.nonprivate_diagnostics = nonprivate_diagnostics
        self.step_calls = 0

    def _selected(self, name: str) -> bool:
        return any(fnmatch.fnmatch(name, p) for p in self.patterns)

    def _denoise(self, values: Mapping[str, Tensor], gradient: PrivateGradient,
                 seed: int) -> tuple[dict[str, Tensor], DenoiseStats]:
        """D applied to ``values`` (a new dict; the input tensors are not modified)."""
        selected = {k: v for k, v in values.items() if v.dim() == 2 and self._selected(k)}
        stds = {k: gradient.std_of(k) for k in selected}
        return denoise_matrices(selected, stds, replace(self.options, seed=seed))

    @hookimpl
    def validate_setup(self, setup: RunSetup) -> None:
        matrices = [n for n, p in setup.trainable.items() if p.dim() == 2 and self._selected(n)]
        if not matrices:
            raise ConfigError(f"denoise: no trainable 2-D parameter matches {self.patterns}")
        if self.nonprivate_diagnostics:
            warnings.warn(NONPRIVATE_WARNING, PrivacyWarning, stacklevel=2)

    @hookimpl(wrapper=True)
    def privatize(self, ctx: StepContext, gradient_sum: GradientSum) -> Generator[None, PrivateGradient | None,
                                                                                    PrivateGradient | None]:
        """A wrapper around whichever plugin privatizes (it adds nothing to the release and replaces nothing).

        With ``nonprivate_diagnostics`` off (the default) it only passes the result through. With it on, it copies
        the clean clipped sum before the inner ``privatize`` (which may write the release into the sum), then
        denoises a copy of the private gradient and logs the cosines against the clean clipped gradient
        (``nonprivate/...``); the copy is dropped on return: nothing derived from it is kept in the plugin,
        ``ctx.scratch`` or the gradient.
        """
        clean = {k: v.detach().clone() for k, v in gradient_sum.values.items()} if self.nonprivate_diagnostics \
            else None
        private = yield
        if clean is not None and private is not None:
            self._log_nonprivate(ctx, clean, private)
        del clean
        return private

    @hookimpl
    def post_process(self, ctx: StepContext, gradient: PrivateGradient) -> None:
        denoised, stats = self._denoise(gradient.values, gradient, seed=ctx.step)
        gradient.values.update(denoised)
        self.step_calls += 1
        self._log(ctx, stats)

    @staticmethod
    def _log(ctx: StepContext, stats: DenoiseStats) -> None:
        # Functions of the released gradient only: public.
        ctx.log("denoise/fraction_denoised", stats.num_denoised / max(1, stats.num_matrices))
        ctx.log("denoise/spikes", float(stats.num_spikes))
        ctx.log("denoise/max_edge_ratio", float(stats.max_edge_ratio))

    @torch.no_grad()
    def _log_nonprivate(self, ctx: StepContext, clean: dict[str, Tensor], private: PrivateGradient) -> None:
        """Log Improvement = cos(D(g~), g) - cos(g~, g), whole gradient and per denoised-eligible matrix.

        NOT PRIVATE: reads the clean clipped sum. Only the logged floats leave this function.
        """
        noisy = private.values
        denoised, _ = self._denoise(noisy, private, seed=ctx.step)  # new tensors: the release is not touched
        whole = torch.zeros(5, dtype=torch.float64)  # <D, g>, <g~, g>, |D|^2, |g~|^2, |g|^2
        per_layer: dict[str, float] = {}
        for key, noisy_value in noisy.items():
            if key not in clean:
                continue
            g = clean[key].detach().double().flatten()     # the clipped sum; the 1/B scale cancels in a cosine
            y = noisy_value.detach().double().flatten()
            d = denoised.get(key, noisy_value).detach().double().flatten()
            sums = torch.stack([d @ g, y @ g, d @ d, y @ y, g @ g])
            whole += sums.cpu()
            if noisy_value.dim() == 2 and self._selected(key):
                value = _improvement(*sums.tolist())
                if value is not None:
                    per_layer[key] = value
        value = _improvement(*whole.tolist())
        if value is not None:
            ctx.log(NONPRIVATE_PREFIX + "denoise_improvement", value)
            dg, yg, dd, yy, gg = whole.tolist()
            ctx.log(NONPRIVATE_PREFIX + "denoise_cosine_noisy", yg / math.sqrt(yy * gg))
            ctx.log(NONPRIVATE_PREFIX + "denoise_cosine_denoised", dg / math.sqrt(dd * gg))
        for key, value in per_layer.items():
            ctx.log(f"{NONPRIVATE_PREFIX}denoise_improvement/{key}", value)

    def state_dict(self) -> dict:
        return {"step_calls": self.step_calls}

    def load_state_dict(self, state: dict) -> None:
        self.step_calls = int(state.get("step_calls", 0))


def _improvement(dg: float, yg: float, dd: float, yy: float, gg: float) -> float | None:
    """cos(D, g) - cos(y, g) from the inner products; None where a cosine is undefined (a zero vector)."""
    if not (dd > 0 and yy > 0 and gg > 0):
        return None
    return dg / math.sqrt(dd * gg) - yg / math.sqrt(yy * gg)
