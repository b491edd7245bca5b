"""patchbay's built-in plugins, registered through the ``patchbay`` entry-point group like any other."""
