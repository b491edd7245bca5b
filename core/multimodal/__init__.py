"""Image inputs.

Images reach a prompt from files, bytes, arrays and URLs; :mod:`patchbay.multimodal.images` decodes them and
checks them against the ``multimodal:`` limits before the engine sees them.
"""
