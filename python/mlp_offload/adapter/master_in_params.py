"""DeepSpeed's half-precision master weights kept in the parameters only (`master_in_params`).

With `bf16.bf16_master_weights_and_grads` or `fp16.fp16_master_weights_and_grads`, DeepSpeed keeps its
master weights in the parameters' dtype and copies them into the half-precision partition after every
step (`_reassign_or_swap_out_partitioned_parameters`), so the partition holds their bits. The chunks then
keep the moments alone (`StateDtypes.master_in_params`), and the fused pass reads and writes the master
weights in the partition itself: a third fewer bytes to store and move in the 6-byte mode, a fifth in
the 10-byte ones, bit for bit the same.

Where they could part, the engine follows DeepSpeed. Its fp32-param setters set the master weights alone:
those are kept apart until the chunk's next update (`ChunkedState.set_master`). Anything that changes
the parameters alone (`GatheredParameters` with a `modifier_rank`, a write to `ds_tensor`) DeepSpeed's
next step overwrites from its master weights, which this engine no longer has: each pass sums the
parameters as it reads them, and a sum that is not the one the engine left is an error at that step
(`check_params`), never a silent difference. The update during backward would need the master weights
apart to undo a chunk, so `"auto"` turns it off, and `overlap_backward: true` keeps them in the store.
Whether they are kept in the parameters, and why, is decided with the other settings at start
(`adapter.settings`).
"""

from __future__ import annotations

from mlp_offload.adapter import troubleshooting
from mlp_offload.engine.state import ChunkedState


def check_params(state: ChunkedState, chunk: int, as_read: int | None, as_written: int | None) -> None:
    """After a chunk's pass: the parameters it read as the master weights were those the engine left
    (`ChunkedState.params_as_left`), else the step is stopped, naming them. A chunk whose master weights
    were set apart (`take_master_set_apart`) is passed `as_read` None: DeepSpeed's step starts from
    those, whatever the parameters hold."""
    if not state.params_as_left(chunk, as_read, as_written):
        i, first, count = state.chunks[chunk]
        raise RuntimeError(
            troubleshooting.PARAMS_CHANGED.message(subgroup=i, first=first, last=first + count - 1)
        )
