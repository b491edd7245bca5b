"""The built-in drafters of speculative decoding (registered through the patchbay entry points)."""
