"""The ``denoise`` post-processing plugin: random-matrix-theory optimal shrinkage of noisy gradient matrices.

After ``privatize``, each selected 2-D gradient matrix Y (per-entry noise std s, read from the private
gradient's metadata) whose top singular value exceeds kappa * s * (sqrt(m) + sqrt(n)) is replaced by its
Shabalin-Nobel optimal low-rank estimate, rescaled to Y's Frobenius norm (norm correction). It reads only the
released gradient, so it is post-processing: no privacy cost. See ``shrinkage.py`` for the formulas.
"""

from __future__ import annotations

import fnmatch
from typing import Literal

from dpl.errors import ConfigError
from dpl.gradients import PrivateGradient
from dpl.hookspecs import hookimpl
from dpl.step import RunSetup, StepContext
from dpl_plugins.denoise.shrinkage import DenoiseStats, denoise_matrices

RANK_ONE_ESTIMATORS = ("dpzero",)


class DenoisePlugin:
    """RMT gradient denoising (``post_process``).

    Args:
        kappa: denoise a matrix only if its top singular value exceeds kappa times the noise bulk edge.
        norm_correction: rescale each denoised matrix to the noisy matrix's Frobenius norm (turn off only for
            the ablation).
        parameters: ``all`` (every 2-D gradient: linear layers, LoRA A/B, trainable embeddings), ``lora``
            (LoRA A/B matrices only), or a list of glob patterns of parameter names.
        svd: ``full`` (batched SVD) or ``randomized`` (leading components, growing the rank as needed).
        rank: first rank tried by ``randomized``.
    """

    def __init__(self, kappa: float = 1.02, norm_correction: bool = True,
                 parameters: Literal["all", "lora"] | list[str] = "all",
                 svd: Literal["full", "randomized"] = "full", rank: int | None = None) -> None:
        if not kappa > 0:
            raise ConfigError(f"denoise: kappa must be > 0, got {kappa}")
        if svd not in ("full", "randomized"):
            raise ConfigError(f"denoise: svd must be 'full' or 'randomized', got {svd!r}")
        self.kappa = kappa
        self.norm_correction = norm_correction
        self.patterns = {"all": ["*"], "lora": ["*lora_A*", "*lora_B*"]}.get(parameters, parameters) \
            if isinstance(parameters, str) else list(parameters)
        if isinstance(parameters, str) and parameters not in ("all", "lora"):
            raise ConfigError(f"denoise: parameters must be 'all', 'lora' or a list of patterns, got {parameters!r}")
        self.svd = svd
        self.rank = rank
        self.step_calls = 0

    def _selected(self, name: str) -> bool:
        return any(fnmatch.fnmatch(name, p) for p in self.patterns)

    @hookimpl
    def validate_setup(self, setup: RunSetup) -> None:
        rank_one = [n for n in setup.plugin_names if n in RANK_ONE_ESTIMATORS]
        if rank_one:
            raise ConfigError(f"denoise cannot be combined with {rank_one[0]!r}: its update is rank one along a "
                              "public direction, there is no noisy gradient matrix to denoise")
        matrices = [n for n, p in setup.trainable.items() if p.dim() == 2 and self._selected(n)]
        if not matrices:
            raise ConfigError(f"denoise: no trainable 2-D parameter matches {self.patterns}")

    @hookimpl
    def post_process(self, ctx: StepContext, gradient: PrivateGradient) -> None:
        selected = {k: v for k, v in gradient.values.items() if v.dim() == 2 and self._selected(k)}
        stds = {k: gradient.std_of(k) for k in selected}
        denoised, stats = denoise_matrices(selected, stds, kappa=self.kappa, norm_correction=self.norm_correction,
                                           method=self.svd, rank=self.rank, seed=ctx.step)
        gradient.values.update(denoised)
        self.step_calls += 1
        self._log(ctx, stats)

    @staticmethod
    def _log(ctx: StepContext, stats: DenoiseStats) -> None:
        # Functions of the released gradient only: public.
        ctx.log("denoise/fraction_denoised", stats.num_denoised / max(1, stats.num_matrices))
        ctx.log("denoise/spikes", float(stats.num_spikes))
        ctx.log("denoise/max_edge_ratio", float(stats.max_edge_ratio))

    def state_dict(self) -> dict:
        return {"step_calls": self.step_calls}

    def load_state_dict(self, state: dict) -> None:
        self.step_calls = int(state.get("step_calls", 0))
