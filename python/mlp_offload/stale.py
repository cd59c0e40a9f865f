"""The gradients a step did not reduce, as DeepSpeed's CPU offload updates with them.

With the optimizer offloaded, stock DeepSpeed copies each parameter's reduced gradient into a persistent
fp32 buffer at the accumulation boundary, and in every step it takes multiplies the whole buffer in place
by `1 / combined_scale` (the loss scale and the clipping factor, `unscale_and_clip_grads`). A parameter
that got no gradient at a boundary (a layer left out of the step, an expert no token was routed to) keeps
in that buffer the gradient of its last boundary, times every step's factor since, and the step updates
it with that. The engine keeps no fp32 gradient buffer: it widens the half-precision gradient DeepSpeed
reduced, whose slice of a parameter without a gradient still holds that last one. `StaleGradients`
records the factors each such gradient has been through, so that the update applies them first, one
product after another in fp32, as DeepSpeed's in-place products rounded them.

One case stays apart from stock: with gradient accumulation, a parameter that got a gradient in an
earlier micro-step of the boundary but not in its last. DeepSpeed's host buffer then holds the earlier
micro-steps' gradients, which stock leaves out of its fp32 buffer (it copies at the last micro-step
only, and updates with the old one); the engine updates with them, and names the parameter
(`diverged`)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

# Per subgroup, the ranges (offset, elements) of its gradient that are stale, and the factors to apply
# to each, in order.
StaleRanges = dict[int, list[tuple[int, int, list[float]]]]


class StaleGradients:
    """Per parameter id, from which step its gradient was last reduced, and the factors of the steps
    taken since."""

    def __init__(self) -> None:
        # The factor of every step taken since the oldest parameter's last gradient; `_first` is the
        # number of the step of `_factors[0]`, counted from the first step taken.
        self._factors: list[float] = []
        self._first = 0
        # Parameter id -> the number of the first step taken after its gradient was last reduced.
        self._since: dict[int, int] = {}
        self._reduced: set[int] = set()
        self._touched: set[int] = set()
        # The parameters of the last step taken whose gradient came from earlier micro-steps only.
        self.diverged: list[int] = []

    def reduced(self, pid: int) -> None:
        """The parameter's gradient was reduced at this boundary."""
        self._reduced.add(pid)

    def touched(self, pid: int) -> None:
        """The parameter's gradient was reduced in a micro-step before the boundary's last, into the
        host buffer only."""
        self._touched.add(pid)

    def skipped(self) -> None:
        """The step was skipped (an overflow): the gradients reduced replaced the old ones in DeepSpeed's
        buffer, and no factor was applied."""
        end = self._first + len(self._factors)
        for pid in self._reduced | self._touched:
            self._since[pid] = end
        self._reduced.clear()
        self._touched.clear()

    def pending(self, pids: Iterable[int]) -> bool:
        """Whether any of `pids` has no gradient reduced at this boundary so far, and one from an earlier
        boundary that the steps since have scaled (the update during backward leaves its chunk to the
        step, which knows whether it came). Called on the update thread during backward, while the
        boundary's gradients come in (`reduced`); `taken` and `skipped` run after it has ended."""
        for pid in pids:
            since = self._since.get(pid)
            if pid in self._reduced or since is None:
                continue
            if any(f != 1.0 for f in self._factors[since - self._first :]):
                return True
        return False

    def taken(self, factor: float, params: Iterable[tuple[int, int, int, int]]) -> StaleRanges:
        """A step taken with gradient factor `factor`: of `params` (id, subgroup, offset in it, elements:
        each parameter with a partition on this rank), the ranges whose gradient this step's update takes
        from an earlier boundary, and the factors the steps since then applied to it (none where they
        were all 1, which change nothing). Then this step's factor joins them."""
        stale: StaleRanges = {}
        end = self._first + len(self._factors)
        self.diverged = sorted(self._touched - self._reduced)
        for pid, i, offset, numel in params:
            since = self._since.get(pid)
            if pid in self._reduced or pid in self._touched or since is None:
                # A gradient of this boundary (of its last micro-step, or only of earlier ones), or none
                # ever: each is the half-precision buffer's.
                continue
            factors = self._factors[since - self._first :]
            if any(f != 1.0 for f in factors):
                stale.setdefault(i, []).append((offset, numel, factors))
        for pid in self._reduced | self._touched:
            self._since[pid] = end
        self._reduced.clear()
        self._touched.clear()
        self._factors.append(factor)
        oldest = min(self._since.values(), default=end + 1)
        if oldest > self._first:
            del self._factors[: oldest - self._first]
            self._first = oldest
        return stale


def apply(grad: torch.Tensor, first: int, ranges: list[tuple[int, int, list[float]]]) -> None:
    """Applies the factors of `ranges` to `grad`, which holds elements `first` on of a subgroup's
    gradient widened to fp32, in place and in order, as DeepSpeed's `mul_` of its buffer did step by
    step."""
    last = first + grad.numel()
    for offset, numel, factors in ranges:
        lo, hi = max(offset, first), min(offset + numel, last)
        if lo < hi:
            part = grad[lo - first : hi - first]
            for factor in factors:
                part.mul_(factor)


def touches(first: int, count: int, ranges: list[tuple[int, int, list[float]]]) -> bool:
    """Whether elements `first` to `first + count` of the subgroup hold any of `ranges`."""
    return any(offset < first + count and first < offset + numel for offset, numel, _ in ranges)
