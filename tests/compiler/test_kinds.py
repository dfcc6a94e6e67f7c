"""Rule, group and task kinds are str enums (compiler/kinds.py): checked where they are
made, printed and compared as their names."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import nimblejax as nimble
from nimblejax.compiler.kinds import GroupKind, RuleKind, TaskKind
from nimblejax.compiler.lowering import RULES
from nimblejax.compiler.lowering.registry import register
from nimblejax.compiler.lowering.task import Task


def test_every_registered_rule_has_a_rule_kind():
    assert RULES and all(type(r.kind) is RuleKind for r in RULES.values())
    assert {r.kind for r in RULES.values()} == set(RuleKind)


def test_a_misspelt_kind_fails_where_it_is_made():
    with pytest.raises(ValueError):
        register("nimble_test_only", kind="kernal")
    assert "nimble_test_only" not in RULES
    with pytest.raises(ValueError):
        Task("t", "kernal", (), (), ())
    assert Task("t", "view", (), (), ()).kind is TaskKind.VIEW  # a string is converted


def test_plan_kinds_are_enums_that_read_as_strings():
    f = nimble.jit(lambda x: jnp.tanh(x @ x).reshape(-1).sum(), backend="interpret")
    plan = f.plan(np.ones((8, 8), np.float32))
    assert [g.kind for g in plan.groups] == [GroupKind.GEMM, GroupKind.REDUCTION]
    assert [t.kind for t in plan.tasks] == [TaskKind.GEMM, TaskKind.KERNEL]
    assert [t.kind for t in plan.tasks] == ["gemm", "kernel"]
    assert [f"{t.kind}" for t in plan.tasks] == ["gemm", "kernel"]
