"""Empirical privacy audit in one training run (``dpl audit``), through dpl's private engine.

:mod:`~dpl.audit.bound` turns membership guesses into a lower bound on epsilon; :mod:`~dpl.audit.canaries` makes the
canary data and model; :mod:`~dpl.audit.injections` holds the deliberately broken mechanisms that check the audit;
:mod:`~dpl.audit.config` its settings and result; :mod:`~dpl.audit.runner` plays the canary game;
:mod:`~dpl.audit.command` is the command. See docs/audit.md.
"""

from dpl.audit.bound import (DEFAULT_GUESS_FRACTIONS, Guess, epsilon_lower_bound, guesses_for, p_value,
                             perfect_guess_ceiling, score_guesses)
from dpl.audit.command import audit_command, build_parser
from dpl.audit.injections import INJECTIONS, NoClip, WeakNoise
from dpl.audit.config import AuditConfig, AuditResult
from dpl.audit.runner import run_audit

__all__ = ["DEFAULT_GUESS_FRACTIONS", "INJECTIONS", "AuditConfig", "AuditResult", "Guess", "NoClip", "WeakNoise",
           "audit_command", "build_parser", "epsilon_lower_bound", "guesses_for", "p_value", "perfect_guess_ceiling",
           "run_audit", "score_guesses"]
