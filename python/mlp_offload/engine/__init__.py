"""The engine: the optimizer state in chunks (state) streamed through one pool of host buffers (pipeline,
memory, buffers) to the object store (store), the update behind the next forward and during backward
(overlap), the plan, its model and the tuner (planning, profiles), the state's dtypes (state_dtypes), and
the fused update pass (fused_update, which mirrors DeepSpeed's CPU Adam). Imports the common base and
the Rust core, never the adapter or the application."""
