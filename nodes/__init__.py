"""The ComfyUI side of the pack: the override adapter (no ComfyUI imports) and the V3 nodes (ComfyUI only)."""
