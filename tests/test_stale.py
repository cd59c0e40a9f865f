"""`mlp_offload.adapter.stale_gradients`: the factors a gradient without a new one goes through, step by
step, as stock DeepSpeed's in-place products of its fp32 buffer apply them (the bit-exact rows with a
block dropped from some steps check it against DeepSpeed itself)."""

from __future__ import annotations

import pytest
import torch

from mlp_offload.adapter import stale_gradients
from mlp_offload.adapter.stale_gradients import StaleRange

# Two parameters of subgroup 0 (elements 0-9, 10-29) and one of subgroup 1 (0-4).
PARAMS = [(1, 0, 0, 10), (2, 0, 10, 20), (3, 1, 0, 5)]
NUMELS = {pid: numel for pid, _, _, numel in PARAMS}
# Each parameter's half-precision gradient as the host buffer holds it.
HALF = {pid: torch.full((n,), 0.75 * pid, dtype=torch.bfloat16) for pid, n in NUMELS.items()}


def half_gradient(pid: int) -> torch.Tensor:
    return HALF[pid]


# name, per step: (reduced ids, the factor of a step taken, or None for one skipped), the last step's
# stale ranges as (subgroup, offset, elements, factors)
CASES = [
    ("every gradient new every step", [({1, 2, 3}, 0.5), ({1, 2, 3}, 0.25)], []),
    (
        "a parameter without a gradient: the step's factor before",
        [({1, 2, 3}, 0.5), ({1, 3}, 0.25)],
        [(0, 10, 20, [0.5])],
    ),
    (
        "two steps without: both factors, in order",
        [({1, 2, 3}, 0.5), ({1, 3}, 0.25), ({1, 3}, 0.125)],
        [(0, 10, 20, [0.5, 0.25])],
    ),
    ("factors of 1 change nothing", [({1, 2, 3}, 1.0), ({1, 3}, 1.0), ({1, 3}, 0.5)], []),
    ("factors of 1 are left out", [({1, 2, 3}, 0.5), ({1, 3}, 1.0), ({1, 3}, 0.25)], [(0, 10, 20, [0.5])]),
    ("never reduced: zeros, left alone", [({1}, 0.5), ({1}, 0.5)], []),
    (
        "a skipped step: its gradients replace the old, no factor",
        [({1, 2, 3}, 0.5), ({1, 2, 3}, None), ({1}, 0.25)],
        [],
    ),
    (
        "a skipped step, then steps taken",
        [({1, 2, 3}, 0.5), ({2, 3}, None), ({1, 3}, 0.25), ({1}, 0.125)],
        [(0, 10, 20, [0.25]), (1, 0, 5, [0.25])],
    ),
]


@pytest.mark.parametrize(("name", "steps", "expected"), CASES, ids=[c[0] for c in CASES])
def test_the_ranges_without_a_new_gradient_carry_the_factors_since_their_last(
    name: str, steps: list[tuple[set[int], float | None]], expected: list[tuple[int, int, int, list[float]]]
) -> None:
    gradients = stale_gradients.StaleGradients()
    ranges: stale_gradients.StaleRanges = {}
    for reduced, factor in steps:
        for pid in reduced:
            gradients.reduced(pid)
        if factor is None:
            gradients.skipped()
        else:
            ranges = gradients.taken(factor, PARAMS, half_gradient)
    got = [(i, r.offset, r.numel, r.factors) for i, rs in sorted(ranges.items()) for r in rs]
    assert got == expected and all(r.kept is None for rs in ranges.values() for r in rs)


def test_a_gradient_long_without_a_new_one_is_kept_and_takes_one_product_a_step() -> None:
    """After `KEEP_AFTER` factors other than 1 the gradient is kept in fp32, bit for bit the products
    one after another; from then on each step multiplies it once; a new gradient drops it. Between
    backward and each step, `held` gives it as DeepSpeed's buffer holds it then (through the factors
    before that step), and changes nothing."""
    gradients = stale_gradients.StaleGradients()
    factors = [0.9 - 0.01 * k for k in range(stale_gradients.KEEP_AFTER + 3)]
    for pid in (1, 2, 3):
        gradients.reduced(pid)
    gradients.taken(factors[0], PARAMS, half_gradient)
    expected = HALF[2].float()
    expected.mul_(factors[0])
    for k in range(1, len(factors)):
        gradients.reduced(1)
        gradients.reduced(3)
        held = gradients.held(PARAMS)
        assert list(held) == [0], held
        now = HALF[2].float()
        stale_gradients.apply(now, 10, held[0])
        assert torch.equal(now, expected), k
        ranges = gradients.taken(factors[k], PARAMS, half_gradient)
        (r,) = ranges[0]
        if k < stale_gradients.KEEP_AFTER:
            assert r.kept is None and len(r.factors) == k
        else:
            assert r.kept is not None and r.factors == [] and torch.equal(r.kept, expected), k
            assert gradients.kept_bytes() == 4 * NUMELS[2]
        grad = HALF[2].float()
        stale_gradients.apply(grad, 10, [r])
        assert torch.equal(grad, expected), k
        expected.mul_(factors[k])
    for pid in (1, 2, 3):
        gradients.reduced(pid)
    assert gradients.taken(0.5, PARAMS, half_gradient) == {} and gradients.kept_bytes() == 0


def test_gradients_of_earlier_micro_steps_alone_are_the_buffers_and_named() -> None:
    gradients = stale_gradients.StaleGradients()
    for pid in (1, 2, 3):
        gradients.reduced(pid)
    gradients.taken(0.5, PARAMS, half_gradient)
    # Parameter 2 in an earlier micro-step only, 3 in both, 1 in none.
    gradients.touched(2)
    gradients.touched(3)
    gradients.reduced(3)
    ranges = gradients.taken(0.25, PARAMS, half_gradient)
    assert [(r.offset, r.factors) for r in ranges[0]] == [(0, [0.5])] and gradients.diverged == [2]
    # From then on, parameter 2's gradient is the buffer's, scaled by the steps after it.
    gradients.reduced(1)
    ranges = gradients.taken(0.125, PARAMS, half_gradient)
    assert {i: [(r.offset, r.factors) for r in rs] for i, rs in ranges.items()} == {
        0: [(10, [0.25])],
        1: [(0, [0.25])],
    }
    assert gradients.diverged == []


def test_pending_names_a_parameter_whose_old_gradient_was_scaled() -> None:
    gradients = stale_gradients.StaleGradients()
    for pid in (1, 2):
        gradients.reduced(pid)
    gradients.taken(0.5, PARAMS, half_gradient)
    assert gradients.pending([1, 2]), "neither has a gradient of this boundary yet"
    gradients.reduced(2)
    assert gradients.pending([1, 2]) and not gradients.pending([2, 3])


def test_apply_multiplies_in_order_within_the_window() -> None:
    grad = torch.full((8,), 3.0)
    # The window holds elements 4-11 of the subgroup; the range 2-6 overlaps its first three.
    stale_gradients.apply(grad, 4, [StaleRange(2, 5, [0.1, 0.7])])
    expected = torch.full((3,), 3.0)
    expected.mul_(0.1)
    expected.mul_(0.7)
    assert torch.equal(grad[:3], expected) and torch.equal(grad[3:], torch.full((5,), 3.0))
    kept = torch.arange(5, dtype=torch.float32)
    stale_gradients.apply(grad, 4, [StaleRange(2, 5, kept=kept)])
    assert torch.equal(grad[:3], kept[2:])
    assert stale_gradients.touches(4, 8, [StaleRange(2, 5)]) and not stale_gradients.touches(
        7, 8, [StaleRange(2, 5)]
    )
