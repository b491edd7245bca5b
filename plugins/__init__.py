"""patchbay's built-in plugins, registered through the ``patchbay`` entry-point group like any other.

Each folder holds the plugins of one kind (``spec_decode`` holds the ``drafter`` plugins of speculative
decoding) and imports only public names: :mod:`patchbay.interfaces`, :mod:`patchbay.contract` and the
toolkit (:mod:`patchbay.toolkit`), as a third party's plugin would.
"""
