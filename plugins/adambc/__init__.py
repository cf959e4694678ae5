"""The ``adambc`` plugin: DP-Adam with the DP noise variance removed from the second moment (DP-AdamBC).

``precondition`` turns the private gradient g~ into Adam's update direction

    m_t = b1 m + (1 - b1) g~          v_t = b2 v + (1 - b2) g~^2
    m^ = m_t / (1 - b1^t)             v^ = v_t / (1 - b2^t)
    Phi^_t = the same bias-corrected moving average of Phi_s = gradient.std_of(name)^2, s <= t
    direction = m^ / sqrt(max(v^ - Phi^, gamma')) + weight_decay * theta,    gamma' = max(gamma, gamma_relative * Phi^)

and the configured optimizer, which must be plain ``torch.optim.SGD`` (no momentum, no weight decay), applies
``theta <- theta - lr * direction``: its ``lr`` is Adam's learning rate and any scheduler scales it.

Phi is read from the release's metadata at every step, never recomputed from sigma, so the correction is right
whichever mechanism produced the noise (sigma C / B for the default Gaussian mechanism, the per-step marginal
std of ``ftrl``). When the std is the same at every step Phi^ equals it exactly; when it changes (ftrl), Phi^ is
what the noise contributes in expectation to v^, E[v^] = E[g^2]^ + Phi^.

``bias_correction: false`` drops Phi (plain DP-Adam with the floor gamma under the square root, the baseline of
Tang, Shpilevskiy and Lécuyer, AAAI 2024). The moments are functions of the released gradients only:
post-processing, no privacy cost, and they go into the public ``state_dict`` (checkpoint); there is no secret state.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from dpl.api import ConfigError, Contract, PluginError, PrivateGradient, ReleaseContext, RunSetup, hookimpl

def inspect_optimizer(factory: Any) -> torch.optim.Optimizer:
    """Build the configured optimizer on a dummy parameter so that its class and settings can be checked (works
    for a class, a ``functools.partial`` and LightningCLI's optimizer callables alike)."""
    return factory([torch.nn.Parameter(torch.zeros(1))])


def check_optimizer(optimizer: torch.optim.Optimizer, name: str = "") -> None:
    """Raise :class:`ConfigError` (one line) unless ``optimizer`` is plain SGD: adambc returns Adam's full
    direction, so the optimizer may only multiply it by the learning rate."""
    kind = type(optimizer).__name__ if not name or name == type(optimizer).__name__ else f"{name} ({type(optimizer).__name__})"
    if type(optimizer) is not torch.optim.SGD:
        raise ConfigError(f"adambc returns Adam's full update direction: use optimizer torch.optim.SGD (momentum 0, "
                          f"lr = the Adam learning rate), not {kind}, which would stack a second optimizer on AdamBC")
    defaults = optimizer.defaults
    settings = {"momentum": defaults.get("momentum", 0), "weight_decay": defaults.get("weight_decay", 0),
                "nesterov": defaults.get("nesterov", False), "maximize": defaults.get("maximize", False)}
    bad = {k: v for k, v in settings.items() if v}
    if bad:
        hint = " (set adambc's weight_decay instead)" if "weight_decay" in bad else ""
        raise ConfigError(f"adambc needs plain SGD (momentum 0, no weight decay, no nesterov/maximize), got "
                          f"{', '.join(f'{k}={v}' for k, v in bad.items())}{hint}")


class AdamBCPlugin:
    """DP-AdamBC (``precondition``); with ``bias_correction: false``, plain DP-Adam.

    Args:
        beta1: decay of the first moment.
        beta2: decay of the second moment.
        gamma: the absolute floor under the square root: gamma' = max(gamma, gamma_relative * Phi^) in
            max(v^ - Phi^, gamma'). It bounds the per-coordinate step where the corrected second moment is at or
            below zero (there the step is m^ / sqrt(gamma')).
        gamma_relative: the floor relative to the noise variance Phi^ (with ``bias_correction`` only). Default 1:
            the floor is the noise variance itself, the best of Phi x {0.01, 0.1, 1, 10, 100} in the method
            studies (docs/methods.md); 0 gives the fixed floor ``gamma`` alone (a fixed 1e-8 fitted the
            rarest classes 22 points worse there). A tuned hyperparameter; see plugins/adambc/README.md.
        weight_decay: decoupled weight decay (AdamW-style): ``weight_decay * theta`` is added to the direction,
            not to the gradient, so it bypasses the moments; the optimizer's lr multiplies it.
        bias_correction: remove the DP noise variance Phi from the second moment (DP-AdamBC). ``false`` gives
            plain DP-Adam (Phi = 0), the papers' baseline. (Adam's usual 1 - beta^t correction is always on.)
    """

    description = "DP-Adam with the DP noise variance removed from the second moment (DP-AdamBC)"

    def __init__(self, beta1: float = 0.9, beta2: float = 0.999, gamma: float = 1e-8, gamma_relative: float = 1.0,
                 weight_decay: float = 0.0, bias_correction: bool = True) -> None:
        if not 0.0 <= beta1 < 1.0:
            raise ConfigError(f"adambc: beta1 must be in [0, 1), got {beta1}")
        if not 0.0 <= beta2 < 1.0:
            raise ConfigError(f"adambc: beta2 must be in [0, 1), got {beta2}")
        if not (gamma > 0 and math.isfinite(gamma)):
            raise ConfigError(f"adambc: gamma must be > 0 (the floor under the square root), got {gamma}")
        if not (gamma_relative >= 0 and math.isfinite(gamma_relative)):
            raise ConfigError(f"adambc: gamma_relative must be a finite number >= 0, got {gamma_relative}")
        if not weight_decay >= 0:
            raise ConfigError(f"adambc: weight_decay must be >= 0, got {weight_decay}")
        self.beta1 = float(beta1)
        self.beta2 = float(beta2)
        self.gamma = float(gamma)
        self.gamma_relative = float(gamma_relative)
        self.weight_decay = float(weight_decay)
        self.bias_correction = bias_correction
        self.contract = Contract(needs_noise_std=bias_correction)  # Phi is read from the release's noise std
        self.steps = 0  # Adam's t: steps taken
        self.exp_avg: dict[str, Tensor] = {}
        self.exp_avg_sq: dict[str, Tensor] = {}
        self.noise_var_avg: dict[str, float] = {}  # (1 - b2) sum_s b2^(t-s) Phi_s, not yet bias-corrected
        self._checked_optimizer: int | None = None

    # --- setup ----------------------------------------------------------------------------------------------
    @hookimpl
    def validate_setup(self, setup: RunSetup) -> None:
        if setup.optimizer_factory is not None:
            check_optimizer(inspect_optimizer(setup.optimizer_factory), setup.optimizer_name)

    # --- the step -------------------------------------------------------------------------------------------
    @hookimpl
    @torch.no_grad()
    def precondition(self, ctx: ReleaseContext, gradient: PrivateGradient) -> dict[str, Tensor]:
        if ctx.optimizer is not None and self._checked_optimizer != id(ctx.optimizer):
            check_optimizer(ctx.optimizer)  # also when used as a library, without validate_setup
            self._checked_optimizer = id(ctx.optimizer)
        unknown = [k for k in gradient.values if k not in ctx.trainable]
        if unknown:
            raise PluginError(f"adambc: gradient key {unknown[0]!r} is not a trainable parameter (an estimator with "
                              "its own keys needs its own precondition)")
        self.steps += 1
        t = self.steps
        b1, b2 = self.beta1, self.beta2
        correction1 = 1.0 - b1 ** t
        correction2 = 1.0 - b2 ** t
        direction: dict[str, Tensor] = {}
        floored: list[Tensor] = []
        total = 0
        for name, grad in gradient.values.items():
            param = ctx.trainable[name]
            g = grad.detach().to(_state_dtype(grad))
            m = self._moment(self.exp_avg, name, g)
            v = self._moment(self.exp_avg_sq, name, g)
            m.lerp_(g, 1.0 - b1)
            v.mul_(b2).addcmul_(g, g, value=1.0 - b2)
            std = float(gradient.std_of(name))
            phi_avg = b2 * self.noise_var_avg.get(name, 0.0) + (1.0 - b2) * std * std
            self.noise_var_avg[name] = phi_avg
            second = v / correction2
            floor = self.gamma
            if self.bias_correction:
                second.sub_(phi_avg / correction2)
                floor = max(floor, self.gamma_relative * phi_avg / correction2)
            floored.append((second < floor).sum().cpu())
            total += second.numel()
            denom = second.clamp_(min=floor).sqrt_()
            step = (m / correction1).div_(denom)
            if self.weight_decay:
                step.add_(param.detach().to(step.dtype), alpha=self.weight_decay)
            direction[name] = step
        # Public: functions of the released gradients only.
        ctx.log("adambc/fraction_floored", float(sum(floored)) / max(1, total) if floored else 0.0)
        return direction

    @torch.no_grad()
    def corrected_second_moment(self, name: str) -> Tensor:
        """v^ - Phi^ for ``name`` after the last step (v^ for plain DP-Adam), before the floor gamma: the
        estimate of the clean gradient's second moment (public, for diagnostics and tests)."""
        correction2 = 1.0 - self.beta2 ** self.steps
        second = self.exp_avg_sq[name] / correction2
        if self.bias_correction:
            second = second - self.noise_var_avg[name] / correction2
        return second

    @staticmethod
    def _moment(store: dict[str, Tensor], name: str, like: Tensor) -> Tensor:
        buf = store.get(name)
        if buf is None:
            buf = store[name] = torch.zeros_like(like)
        elif buf.device != like.device or buf.dtype != like.dtype:  # loaded from a checkpoint on another device
            buf = store[name] = buf.to(device=like.device, dtype=like.dtype)
        return buf

    # --- checkpoints (public state: post-processing of DP releases) -----------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "exp_avg": dict(self.exp_avg), "exp_avg_sq": dict(self.exp_avg_sq),
                "noise_var_avg": dict(self.noise_var_avg),
                "hyper": {"beta1": self.beta1, "beta2": self.beta2, "bias_correction": self.bias_correction}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        hyper = state.get("hyper", {})
        if hyper and (hyper["beta1"], hyper["beta2"]) != (self.beta1, self.beta2):
            raise ConfigError(f"adambc: the checkpoint's moments were built with beta1, beta2 = {hyper['beta1']}, "
                              f"{hyper['beta2']}, not {self.beta1}, {self.beta2}; resume with the same betas")
        self.steps = int(state["steps"])
        self.exp_avg = {k: v.clone() for k, v in state["exp_avg"].items()}
        self.exp_avg_sq = {k: v.clone() for k, v in state["exp_avg_sq"].items()}
        self.noise_var_avg = {k: float(v) for k, v in state["noise_var_avg"].items()}


def _state_dtype(grad: Tensor) -> torch.dtype:
    """Moments in float32 for half-precision gradients, else in the gradient's dtype."""
    return torch.float32 if grad.dtype in (torch.float16, torch.bfloat16) else grad.dtype
