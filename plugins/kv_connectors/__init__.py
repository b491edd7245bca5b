"""Built-in kv connectors plugins (registered through the patchbay entry points)."""
