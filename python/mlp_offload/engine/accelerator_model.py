"""What the split of a step's update between the host and the accelerator weighs (docs/model.md, "The
update on the accelerator"): a chunk's bytes there, the room of a slot, the slots the accelerator's memory
holds, and the model's inputs. Torch-free, so that the engine (`accelerator_chunks`) and `mlp-offload
plan` ask the same functions, and the plan prints the choice the engine would make at those rates."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

# Chunks in flight on the accelerator at once, at most: two let one chunk's copies run beside another's
# kernel.
SLOTS = 2
# Offsets of the arrays in a slot (the gradient and the parameters after the state), as the kernel's
# vector loads like them.
SLOT_ALIGN = 256


def align(n: int) -> int:
    """`n` bytes rounded up to a slot's alignment."""
    return -(-n // SLOT_ALIGN) * SLOT_ALIGN


@dataclass(frozen=True)
class SlotLayout:
    """Where a chunk's arrays lie in a slot: its state at 0, its gradient at `at_grad`, the parameters'
    scratch at `at_params`, each aligned; `nbytes` in all."""

    at_grad: int
    at_params: int
    nbytes: int

    @classmethod
    def of(cls, state: int, grad: int, params: int) -> SlotLayout:
        """The layout of `state` bytes of state, `grad` of gradient and `params` of parameters."""
        at_grad = align(state)
        at_params = at_grad + align(grad)
        return cls(at_grad, at_params, at_params + align(params))


def params_copied(master_in_params: bool, on_host: bool, params_size: int) -> tuple[int, int]:
    """The parameters' bytes an element that a chunk updated on the accelerator copies there and back:
    none where the partition is there (the kernel updates it in place); where it is in host memory, the
    new parameters back, and with the master weights in them (`master_in_params`) the old ones out too."""
    if not on_host:
        return (0, 0)
    return (params_size if master_in_params else 0, params_size)


@dataclass(frozen=True)
class ChunkBytes:
    """Bytes an element of a step's chunks: their state, their gradient, the parameters a chunk there
    copies out and back (`params_copied`), the host pass's memory traffic, and the room a gradient may
    take there (`grad_room`: a chunk with stale gradients, or a gradient setter's, goes over in the master
    weights' dtype, `ChunkUpdate.pass_gradient`)."""

    state: int
    grad: int
    params_copied: tuple[int, int]
    host: int
    grad_room: int

    @classmethod
    def of(
        cls,
        state: int,
        grad: int,
        params_size: int,
        master_size: int,
        *,
        master_in_params: bool,
        on_host: bool,
    ) -> ChunkBytes:
        """A state of `state` bytes an element, gradients of `grad`, parameters of `params_size` and
        master weights of `master_size`, the partition in host memory or not (`on_host`): the host pass
        reads and writes the state, and reads the gradient and writes the parameters."""
        copied = params_copied(master_in_params, on_host, params_size)
        return cls(state, grad, copied, 2 * state + grad + params_size, max(grad, master_size))

    def slot_bytes(self, elements: int) -> int:
        """The accelerator memory of a slot for chunks of up to `elements`: the state, the gradient's
        room and, where the parameters are copied, their scratch, each aligned
        (`SlotLayout`, as `AcceleratorChunks.dispatch` lays a chunk out)."""
        scratch = max(self.params_copied)
        return SlotLayout.of(elements * self.state, elements * self.grad_room, elements * scratch).nbytes


def slots_in(memory: int, slot: int) -> int:
    """The slots that `memory` bytes of the accelerator hold, `slot` bytes each, at most `SLOTS`."""
    return min(SLOTS, memory // slot) if slot else 0


@dataclass
class Rates:
    """What the model weighs, as last measured (None: not yet)."""

    host_elements_per_s: float | None = None
    device_elements_per_s: float | None = None
    h2d_bytes_per_s: float | None = None
    d2h_bytes_per_s: float | None = None

    def device_known(self) -> bool:
        return None not in (self.device_elements_per_s, self.h2d_bytes_per_s, self.d2h_bytes_per_s)


def split_inputs(elements: list[int], per_element: ChunkBytes, slots: int, rates: Rates) -> dict[str, Any]:
    """What `_core.accelerator_split` weighs for chunks of `elements` with `slots` in flight there: the
    rates given, and neither host memory's bandwidth nor storage's time (`I = 0`: the split balances the
    two sides' compute, docs/model.md)."""
    measured = asdict(rates)
    missing = [name for name, rate in measured.items() if rate is None]
    assert not missing, f"the model weighs measured rates: {missing} not measured"
    return {
        "chunk_elements": elements,
        "state_bytes_per_element": per_element.state,
        "grad_bytes_per_element": per_element.grad,
        "params_h2d_bytes_per_element": per_element.params_copied[0],
        "params_d2h_bytes_per_element": per_element.params_copied[1],
        **measured,
        "device_slots": slots,
        "host_memory_bytes_per_s": 0.0,
        "host_bytes_per_element": per_element.host,
        "io_secs": 0.0,
    }
