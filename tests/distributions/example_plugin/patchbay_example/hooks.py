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


@hookimpl
def register_weight_formats(register):
    register(
        "example_int4",
        "patchbay_example.weight_format:ExampleInt4Format",
        description="a toy 4-bit format: levels per 32 inputs, products in torch (example plugin)",
    )


@hookimpl
def register_poolers(register):
    register(
        "example_max",
        "patchbay_example.pooler:MaxPooler",
        description="embeddings as the maximum of each feature over the prompt's tokens (example plugin)",
    )


@hookimpl
def register_architectures(register):
    register(
        "example_gpt_neo",
        "patchbay_example.architecture:ExampleGPTNeoArchitecture",
        description="GPT-Neo, whose transformers classes refuse the AttentionInterface (example plugin)",
    )
