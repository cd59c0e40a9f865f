"""The gradients a step did not reduce, as DeepSpeed's CPU offload updates with them.

With the optimizer offloaded, stock DeepSpeed copies each parameter's reduced gradient into a persistent
fp32 buffer at the accumulation boundary, and in every step it takes multiplies the whole buffer in place
by `1 / combined_scale` (the loss scale and the clipping factor, `unscale_and_clip_grads`). A parameter
that got no gradient at a boundary (a layer left out of the step, an expert no token was routed to) keeps
in that buffer the gradient of its last boundary, times every step's factor since, and the step updates
it with that. The engine keeps no fp32 gradient buffer: it widens the half-precision gradient DeepSpeed
reduced, whose slice of a parameter without a gradient still holds that last one. `StaleGradients`
records the factors each such gradient has been through, so that the update applies them first, one
product after another in fp32, as DeepSpeed's in-place products rounded them (a factor of exactly 1
changes no value and is left out). Once a gradient has been through `KEEP_AFTER` such factors it is kept
in fp32, as stock keeps it, and takes one product a step from then on, not one per step since (an
expert no token reaches for thousands of steps would otherwise cost more every step); it is dropped at
the parameter's next gradient. Those fp32 copies are outside `host_memory`: 4 bytes per element of the
parameters without a gradient for that long, where stock holds 4 bytes per element of every one.

One case stays apart from stock: with gradient accumulation, a parameter that got a gradient in an
earlier micro-step of the boundary but not in its last. DeepSpeed's host buffer then holds the earlier
micro-steps' gradients, which stock leaves out of its fp32 buffer (it copies at the last micro-step
only, and updates with the old one); the engine updates with them, and names the parameter
(`diverged`)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field

import torch

from mlp_offload.engine.telemetry import StaleStep

log = logging.getLogger("mlp_offload")

# How many factors other than 1 a gradient goes through before it is kept in fp32.
KEEP_AFTER = 8


@dataclass
class StaleRange:
    """Elements `offset` to `offset + numel` of a subgroup's gradient, taken from an earlier boundary:
    the half-precision buffer's through `factors` in order, or `kept` (fp32, already through them)."""

    offset: int
    numel: int
    factors: list[float] = field(default_factory=list)
    kept: torch.Tensor | None = None


# Per subgroup, its ranges whose gradient is from an earlier boundary.
StaleRanges = dict[int, list[StaleRange]]


class StaleGradients:
    """Per parameter id, from which step its gradient was last reduced (or last brought up to date in
    fp32), and the factors of the steps taken since."""

    def __init__(self) -> None:
        # The dtype of stock's gradient buffer (the master weights'), in which the kept gradients are
        # held and the factors applied.
        self.dtype = torch.float32
        # The factor of every step taken since the oldest parameter's last gradient; `_first` is the
        # number of the step of `_factors[0]`, counted from the first step taken.
        self._factors: list[float] = []
        self._first = 0
        # Parameter id -> the number of the first step whose factor its gradient has not been through
        # (in `_kept`, where kept; else the half-precision buffer's, through none since it was reduced).
        self._since: dict[int, int] = {}
        self._kept: dict[int, torch.Tensor] = {}
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

    def kept_bytes(self) -> int:
        """The fp32 gradients kept, in bytes."""
        return sum(t.numel() * t.element_size() for t in self._kept.values())

    def _renewed(self, end: int) -> None:
        """The gradients of this boundary replace the old ones (their kept copies go)."""
        for pid in self._reduced | self._touched:
            self._since[pid] = end
            self._kept.pop(pid, None)
        self._reduced.clear()
        self._touched.clear()

    def skipped(self) -> None:
        """The step was skipped (an overflow): the gradients reduced replaced the old ones in DeepSpeed's
        buffer, and no factor was applied."""
        self._renewed(self._first + len(self._factors))

    def pending(self, pids: Iterable[int]) -> bool:
        """Whether any of `pids` has no gradient reduced at this boundary so far, and one from an earlier
        boundary that the steps since have scaled (the update during backward leaves its chunk to the
        step, which knows whether it came). Called on the update thread during backward, while the
        boundary's gradients come in (`reduced`); `taken` and `skipped` run after it has ended."""
        for pid in pids:
            since = self._since.get(pid)
            if pid in self._reduced or since is None:
                continue
            if pid in self._kept or any(f != 1.0 for f in self._factors[since - self._first :]):
                return True
        return False

    def _earlier(self, pid: int) -> tuple[list[float], torch.Tensor | None] | None:
        """Where the parameter's gradient is from an earlier boundary: the factors other than 1 of the
        steps taken since it was reduced or last brought up to date, and its kept fp32 copy (None where
        the half-precision buffer holds it). None where it has a gradient of this boundary (of its last
        micro-step, or only of earlier ones) or never had one: each is the half-precision buffer's."""
        since = self._since.get(pid)
        if pid in self._reduced or pid in self._touched or since is None:
            return None
        return [f for f in self._factors[since - self._first :] if f != 1.0], self._kept.get(pid)

    def held(self, params: Iterable[tuple[int, int, int, int]]) -> StaleRanges:
        """Of `params` (as `taken` has them), the ranges whose gradient DeepSpeed's fp32 buffer holds
        from an earlier boundary, as it holds it now: through the factors of the steps taken since, not
        yet this step's (what its `safe_get_*_grad` helpers read between backward and step, and what
        its gradient setters write back beside the value they set). Changes nothing."""
        held: StaleRanges = {}
        for pid, i, offset, numel in params:
            if (earlier := self._earlier(pid)) is None:
                continue
            factors, kept = earlier
            if kept is not None and factors:
                kept = kept.clone()
                for f in factors:
                    kept.mul_(f)
            if kept is not None:
                held.setdefault(i, []).append(StaleRange(offset, numel, kept=kept))
            elif factors:
                held.setdefault(i, []).append(StaleRange(offset, numel, factors))
        return held

    def taken(
        self,
        factor: float,
        params: Iterable[tuple[int, int, int, int]],
        half_gradient: Callable[[int], torch.Tensor],
    ) -> StaleRanges:
        """A step taken with gradient factor `factor`: of `params` (id, subgroup, offset in it, elements:
        each parameter with a partition on this rank), the ranges whose gradient this step's update takes
        from an earlier boundary (none where every factor since was 1). `half_gradient(pid)`: the
        parameter's slice of the half-precision buffer, widened when its gradient is to be kept. Then
        this step's factor joins the others. The kept tensors handed out are read by this step's update
        and changed only by the next call, after it."""
        stale: StaleRanges = {}
        end = self._first + len(self._factors)
        self.diverged = sorted(self._touched - self._reduced)
        for pid, i, offset, numel in params:
            if (earlier := self._earlier(pid)) is None:
                continue
            factors, kept = earlier
            if kept is None and len(factors) >= KEEP_AFTER:
                kept = half_gradient(pid).to(self.dtype, copy=True)
                self._kept[pid] = kept
            if kept is not None:
                # Brought up to this step: the factors since, once each, in place.
                for f in factors:
                    kept.mul_(f)
                self._since[pid] = end
                stale.setdefault(i, []).append(StaleRange(offset, numel, kept=kept))
            elif factors:
                stale.setdefault(i, []).append(StaleRange(offset, numel, factors))
        self._renewed(end)
        self._factors.append(factor)
        oldest = min(self._since.values(), default=end + 1)
        if oldest > self._first:
            del self._factors[: oldest - self._first]
            self._first = oldest
        return stale

    def take(
        self,
        factor: float,
        params: Iterable[tuple[int, int, int, int]],
        half_gradient: Callable[[int], torch.Tensor],
        fp32_grads: Collection[int],
        name_of: Callable[[int], str],
    ) -> tuple[StaleRanges, StaleStep]:
        """`taken` for a step's update, with the step record's part: the subgroups whose fp32 gradient a
        gradient setter wrote (`fp32_grads`) have it whole, and take none. A parameter that got gradients
        in earlier micro-steps of the boundary but none in its last is named (`name_of` its id) in a
        warning: there this step differs from stock's."""
        stale = self.taken(factor, params, half_gradient)
        record: StaleStep = {
            "params": sum(len(ranges) for ranges in stale.values()),
            # Their fp32 gradients kept, outside host_memory (as stock keeps every one).
            "kept_bytes": self.kept_bytes(),
            "diverged": len(self.diverged),
        }
        if self.diverged:
            names = [name_of(pid) for pid in self.diverged]
            log.warning(
                "mlp_offload: %d parameter(s) got gradients in earlier micro-steps of this accumulation "
                "boundary but none in its last (%s): stock DeepSpeed updates them with their gradient of an "
                "earlier boundary and drops these; mlp-offload updates them with these, so this step differs "
                "from stock's",
                len(names),
                ", ".join(names[:5]) + (", ..." if len(names) > 5 else ""),
            )
        return {i: r for i, r in stale.items() if i not in fp32_grads}, record


def apply(grad: torch.Tensor, first: int, ranges: list[StaleRange]) -> None:
    """Puts the gradient of `ranges` into `grad`, which holds elements `first` on of a subgroup's
    gradient widened to fp32 from the half-precision buffer: a kept one copied over, else the factors
    applied in place and in order, as DeepSpeed's `mul_` of its buffer did step by step."""
    last = first + grad.numel()
    for r in ranges:
        lo, hi = max(r.offset, first), min(r.offset + r.numel, last)
        if lo >= hi:
            continue
        part = grad[lo - first : hi - first]
        if r.kept is not None:
            part.copy_(r.kept[lo - r.offset : hi - r.offset])
            continue
        for factor in r.factors:
            part.mul_(factor)


def touches(first: int, count: int, ranges: list[StaleRange]) -> bool:
    """Whether elements `first` to `first + count` of the subgroup hold any of `ranges`."""
    return any(r.offset < first + count and first < r.offset + r.numel for r in ranges)
