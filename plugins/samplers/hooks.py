"""Registers the built-in samplers (lazily)."""

from patchbay import hookimpl


@hookimpl
def register_samplers(register):
    register(
        "greedy",
        "patchbay.plugins.samplers.greedy:GreedySampler",
        description="argmax decoding with raw logprobs; no random sampling",
    )
    register(
        "standard",
        "patchbay.plugins.samplers.standard:StandardSampler",
        description="vLLM's sampling pipeline: masks, penalties, temperature, min-p, top-k, top-p, seeds",
    )
    register(
        "rejection",
        "patchbay.plugins.samplers.rejection:StandardRejectionSampler",
        description="lossless verification of draft tokens (accept min(1, p/q), resample max(p - q, 0))",
    )
