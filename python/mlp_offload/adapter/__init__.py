"""The DeepSpeed adapter: what DeepSpeed sees of mlp-offload. `install` and `initialize` (integration),
the check of the DeepSpeed release against the code the engine relies on (compat), the ZeRO-3 optimizer
over the engine's chunks (zero3), the settings it resolves once at start (settings) and the session its
helpers share (session) over a narrow view of DeepSpeed (deepspeed_view), the fused pass checked against
DeepSpeed's CPU Adam at start (kernel_check), DeepSpeed's checkpoints and swapper protocol (checkpoint),
and the parameters without a gradient at a boundary (stale_gradients). Imports the engine and the common
base, never the application."""
