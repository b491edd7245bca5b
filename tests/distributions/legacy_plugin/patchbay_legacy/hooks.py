"""Registers the legacy sampler lazily."""

from patchbay import hookimpl


@hookimpl
def register_samplers(register):
    register("legacy_temperature", "patchbay_legacy.sampler:LegacyTemperatureSampler")
