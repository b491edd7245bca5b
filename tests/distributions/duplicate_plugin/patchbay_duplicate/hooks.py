"""The entry-point module: one sampler, under a name another distribution already claims."""

from patchbay import hookimpl


@hookimpl
def register_samplers(register):
    register(
        "example_argmax",
        "patchbay_duplicate.sampler:LowestIdSampler",
        description="picks token 0 of every row (clashes with patchbay-example-plugin)",
    )
