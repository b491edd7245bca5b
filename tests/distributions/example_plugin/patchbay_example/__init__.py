"""patchbay-example-plugin: one small, correct implementation of every patchbay plugin kind.

Nothing is imported here: patchbay loads :mod:`patchbay_example.hooks` (the
entry point) to learn the names, and imports an implementation module only
when a run or a conformance check selects it.
"""

__version__ = "0.3.1"
