"""Ways in: the offline ``LLM`` API, the ``patchbay`` command line and ``patchbay run``; they use only ``patchbay.engine``."""
