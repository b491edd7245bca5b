"""Built-in spec decode plugins (registered through the patchbay entry points)."""
