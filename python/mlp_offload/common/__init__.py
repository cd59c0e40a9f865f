"""The common base under every layer: the `"mlp_offload"` section's schema, the contract between the
layers (config), and sizes and counts as users write them (units). Imports nothing of mlp-offload's but
the Rust core."""
