"""Dynamic local steps: H_i = max(1, floor(H * v_i / v_max)) from each trainer's measured rate."""

from __future__ import annotations

import pytest

from psserver.server.engine.local_steps import LocalStepPlanner


def test_speeds_4_4_4_1_and_h_100_give_100_100_100_25():
    planner = LocalStepPlanner()
    for name, steps in (("a", 40), ("b", 40), ("c", 40), ("d", 10)):
        planner.observe(name, steps, 10.0)
    assert [planner.steps_for(n, 100) for n in "abcd"] == [100, 100, 100, 25]


def test_at_least_one_step_unknown_keeps_h_and_a_gone_trainer_sets_nobodys_window():
    planner = LocalStepPlanner()
    planner.observe("fast", 1000, 1.0)
    planner.observe("slow", 1, 1.0)
    assert planner.steps_for("slow", 100) == 1
    assert planner.steps_for("new", 100) == 100
    planner.forget("fast")
    assert planner.steps_for("slow", 100) == 100
    with pytest.raises(ValueError, match="window"):
        planner.observe("x", 0, 1.0)
