"""Ways in: the offline ``LLM`` API, the ``patchbay`` command line and ``patchbay run``.

They use only ``patchbay.engine``.
"""
