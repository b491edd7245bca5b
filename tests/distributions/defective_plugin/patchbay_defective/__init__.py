"""patchbay-defective-plugin: implementations each wrong in exactly one way (see hooks.py for the list)."""
