"""Registers a lazy string, but the hooks module itself imports torch: listing plugins pays for it."""

import torch  # noqa: F401  (the defect)

from patchbay import hookimpl


@hookimpl
def register_samplers(register):
    register("defect_torch_hooks", "patchbay_defective.sampler:EagerSampler")
