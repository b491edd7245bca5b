"""Registers the built-in samplers (lazily)."""

from patchbay import hookimpl


@hookimpl
def register_samplers(register):
    register("greedy", "patchbay.plugins.samplers.greedy:GreedySampler",
             description="argmax decoding with raw logprobs; no random sampling")
