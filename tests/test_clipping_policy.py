"""One clipping policy: the rules of per-example clipping live in dpl/core/clipping_policy.py only; the clipper's
modules and ``dpl plan``'s prediction import them and restate none."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dpl.core import clipping_policy as policy
from dpl.core import layer_gradients, per_example, privacy, streaming
from dpl.errors import ConfigError
from dpl.planning import memory, quick

ROOT = Path(__file__).resolve().parents[1]

#: each rule's tell-tale fragment, in the policy's own spelling and the algebra a copy would use
RULES = {
    "the per-example path": r"\(d_in \+ d_out\) *(>=|<) *d_in \* d_out",
    "the norm chunk": r"NORM_CHUNK *//|1 *<< *24",
    "the book's extra bytes": r"4 \* \w+ \* (layer\.)?d_in \* (layer\.)?d_out",
    "the one-pass choice": r"kept <= book",
    "auto's default budget": r"256(\.0)? *\*|= *256|256 MiB|\[0\] *// *4|AUTO_BUDGET_SHARE *\*",
    "the mode names": r"\(\"fast\", \"low\", \"auto\"\)",
}


#: the modules that clip, plan or validate clipping
USERS = ["dpl/core/layer_gradients.py", "dpl/core/streaming.py", "dpl/core/per_example.py", "dpl/core/privacy.py",
         "dpl/core/micro_batch.py", "dpl/core/group_clipping.py", "plugins/clip.py", *(
             str(p.relative_to(ROOT)) for p in sorted((ROOT / "dpl/planning").glob("*.py")))]


def test_no_module_restates_a_rule():
    """The modules that clip or plan are free of each rule's fragment (a copy would drift from the clipper)."""
    found = []
    for path in [ROOT / name for name in USERS if (ROOT / name).exists()]:
        text = path.read_text()
        found += [f"{path.relative_to(ROOT)}: {rule}" for rule, pattern in RULES.items() if re.search(pattern, text)]
    assert not found
    policy_text = (ROOT / "dpl/core/clipping_policy.py").read_text()
    assert all(re.search(RULES[rule], policy_text) for rule in ("the per-example path", "the norm chunk",
                                                               "the one-pass choice", "the mode names"))


def test_core_and_planning_share_the_policys_objects():
    assert layer_gradients.per_example_path is policy.per_example_path
    assert memory.NORM_CHUNK is policy.NORM_CHUNK and memory.MIB is policy.MIB
    assert memory.policy.default_budget_bytes is policy.default_budget_bytes
    for module in (layer_gradients, streaming, per_example, privacy, memory):
        assert module.policy is policy, module.__name__
    assert "torch" not in policy.__dict__ and "torch" not in memory.__dict__ and quick is not None


def test_one_validation_for_the_names():
    with pytest.raises(ConfigError) as info:
        privacy.PrivacyConfig(clipping_memory="medium").validate()
    assert str(info.value) == "privacy.clipping_memory must be fast, low or auto, got 'medium'"


@pytest.mark.parametrize(("steps", "d_in", "d_out", "expected"), [(1, 2, 2, False), (4, 8, 8, True), (3, 8, 8, False)])
def test_per_example_path(steps, d_in, d_out, expected):
    # 4 * 16 = 64 >= 64: per-example gradients; 3 * 16 = 48 < 64: Gram matrices; one position: neither
    assert policy.per_example_path(steps, d_in, d_out) is expected


def test_one_pass_takes_the_smaller_of_each_layer():
    costs = [(10, 4), (None, 6), (3, None)]  # a linear layer, an embedding, a norm layer
    assert policy.one_pass(costs, 13) and not policy.one_pass(costs, 12) and not policy.one_pass(costs, None)
    assert [policy.one_pass_choice(*c) for c in costs] == ["booked", "booked", "kept"]
