"""`mlp_offload.stale`: the factors a gradient without a new one goes through, step by step, as stock
DeepSpeed's in-place products of its fp32 buffer apply them (the bit-exact rows with a block dropped
from some steps check it against DeepSpeed itself)."""

from __future__ import annotations

import pytest
import torch

from mlp_offload import stale

# Two parameters of subgroup 0 (elements 0-9, 10-29) and one of subgroup 1 (0-4).
PARAMS = [(1, 0, 0, 10), (2, 0, 10, 20), (3, 1, 0, 5)]

# name, per step: (reduced ids, "taken" with its factor or "skipped"), the stale ranges of the last step
CASES = [
    ("every gradient new every step", [({1, 2, 3}, 0.5), ({1, 2, 3}, 0.25)], {}),
    (
        "a parameter without a gradient: the step's factor before",
        [({1, 2, 3}, 0.5), ({1, 3}, 0.25)],
        {0: [(10, 20, [0.5])]},
    ),
    (
        "two steps without: both factors, in order",
        [({1, 2, 3}, 0.5), ({1, 3}, 0.25), ({1, 3}, 0.125)],
        {0: [(10, 20, [0.5, 0.25])]},
    ),
    ("factors of 1 change nothing", [({1, 2, 3}, 1.0), ({1, 3}, 1.0), ({1, 3}, 0.5)], {}),
    ("never reduced: zeros, left alone", [({1}, 0.5), ({1}, 0.5)], {}),
    (
        "a skipped step: its gradients replace the old, no factor",
        [({1, 2, 3}, 0.5), ({1, 2, 3}, None), ({1}, 0.25)],
        {0: [], 1: []},
    ),
    (
        "a skipped step, then steps taken",
        [({1, 2, 3}, 0.5), ({2, 3}, None), ({1, 3}, 0.25), ({1}, 0.125)],
        {0: [(10, 20, [0.25])], 1: [(0, 5, [0.25])]},
    ),
]


@pytest.mark.parametrize(("name", "steps", "expected"), CASES, ids=[c[0] for c in CASES])
def test_the_ranges_without_a_new_gradient_carry_the_factors_since_their_last(
    name: str, steps: list[tuple[set[int], float | None]], expected: dict[int, list[object]]
) -> None:
    gradients = stale.StaleGradients()
    ranges: stale.StaleRanges = {}
    for reduced, factor in steps:
        for pid in reduced:
            gradients.reduced(pid)
        if factor is None:
            gradients.skipped()
        else:
            ranges = gradients.taken(factor, PARAMS)
    assert ranges == {i: r for i, r in expected.items() if r}


def test_gradients_of_earlier_micro_steps_alone_are_the_buffers_and_named() -> None:
    gradients = stale.StaleGradients()
    for pid in (1, 2, 3):
        gradients.reduced(pid)
    gradients.taken(0.5, PARAMS)
    # Parameter 2 in an earlier micro-step only, 3 in both, 1 in none.
    gradients.touched(2)
    gradients.touched(3)
    gradients.reduced(3)
    assert gradients.taken(0.25, PARAMS) == {0: [(0, 10, [0.5])]} and gradients.diverged == [2]
    # From then on, parameter 2's gradient is the buffer's, scaled by the steps after it.
    gradients.reduced(1)
    assert gradients.taken(0.125, PARAMS) == {0: [(10, 20, [0.25])], 1: [(0, 5, [0.25])]}
    assert gradients.diverged == []


def test_pending_names_a_parameter_whose_old_gradient_was_scaled() -> None:
    gradients = stale.StaleGradients()
    for pid in (1, 2):
        gradients.reduced(pid)
    gradients.taken(0.5, PARAMS)
    assert gradients.pending([1, 2]), "neither has a gradient of this boundary yet"
    gradients.reduced(2)
    assert gradients.pending([1, 2]) and not gradients.pending([2, 3])


def test_apply_multiplies_in_order_within_the_window() -> None:
    grad = torch.full((8,), 3.0)
    # The window holds elements 4-11 of the subgroup; the range 2-6 overlaps its first three.
    stale.apply(grad, 4, [(2, 5, [0.1, 0.7])])
    expected = torch.full((3,), 3.0)
    expected.mul_(0.1)
    expected.mul_(0.7)
    assert torch.equal(grad[:3], expected) and torch.equal(grad[3:], torch.full((5,), 3.0))
    assert stale.touches(4, 8, [(2, 5, [])]) and not stale.touches(7, 8, [(2, 5, [])])
