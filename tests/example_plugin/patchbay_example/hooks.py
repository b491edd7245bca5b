"""The entry-point module: registers one implementation of each kind by lazy "module:Class" reference.

Importing this module must stay cheap and side-effect free (no torch), so
patchbay can list the plugin without paying for its implementations.
"""

from patchbay import hookimpl


@hookimpl
def register_attention_backends(register):
    register(
        "example_dense",
        "patchbay_example.attention:ExampleDenseBackend",
        description="dense causal attention per request over the gathered paged blocks (example plugin)",
    )


@hookimpl
def register_attention_metadata_builders(register):
    register(
        "example_passthrough",
        "patchbay_example.metadata:PassthroughMetadataBuilder",
        description="hands the common attention metadata to the backend unchanged (example plugin)",
    )


@hookimpl
def register_drafters(register):
    register(
        "example_repeat",
        "patchbay_example.drafter:RepeatLastTokenDrafter",
        description="proposes the last token again, k times (example plugin)",
    )


@hookimpl
def register_samplers(register):
    register(
        "example_argmax",
        "patchbay_example.sampler:ArgmaxSampler",
        description="greedy argmax, optionally over the first vocab_limit ids (example plugin)",
    )
    register(
        "example_verify",
        "patchbay_example.sampler:ArgmaxVerifier",
        description="greedy verification of draft tokens (example plugin)",
    )


@hookimpl
def register_kv_connectors(register):
    register(
        "example_memory",
        "patchbay_example.kv_connector:InMemoryKVConnector",
        description="keeps prompt KV blocks in an in-process dict keyed by block hash (example plugin)",
    )


@hookimpl
def register_structured_output_backends(register):
    register(
        "example_choice",
        "patchbay_example.structured_output:ExampleChoiceBackend",
        description="choice constraints matched on the exact bytes of tokens, in pure Python (example plugin)",
    )
