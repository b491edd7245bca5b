"""Registers a class instead of a "module:Class" string: listing plugins imports the implementation (and torch)."""

from patchbay import hookimpl
from patchbay_defective.sampler import EagerSampler


@hookimpl
def register_samplers(register):
    register("defect_class_target", EagerSampler)
