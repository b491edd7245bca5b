"""Image inputs, decoded and checked.

Images reach a prompt from files, bytes, arrays and URLs; :mod:`patchbay.multimodal.images` decodes them and
checks them against the ``multimodal:`` limits before the engine sees them.
"""
