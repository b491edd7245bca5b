"""Registers the built-in attention backends and metadata builders (lazily: nothing heavy is imported here)."""

from patchbay import hookimpl


@hookimpl
def register_attention_backends(register):
    register(
        "reference",
        "patchbay.plugins.attention.reference:ReferenceBackend",
        description="plain torch over the paged cache; the oracle, correctness over speed",
    )
    register(
        "torch_sdpa",
        "patchbay.plugins.attention.torch_sdpa:TorchSDPABackend",
        description="torch scaled_dot_product_attention; the fast CPU path",
    )
    register(
        "flex",
        "patchbay.plugins.attention.flex:FlexAttentionBackend",
        description="torch flex_attention with block masks from the paged layout",
    )
    register(
        "flash_attn",
        "patchbay.plugins.attention.flash_attn:FlashAttentionBackend",
        description="flash-attn varlen kernels with paged KV (CUDA)",
    )
    register(
        "xformers",
        "patchbay.plugins.attention.xformers_backend:XFormersBackend",
        description="xformers memory-efficient attention (CUDA)",
    )


@hookimpl
def register_attention_metadata_builders(register):
    register(
        "common",
        "patchbay.plugins.attention.common:CommonMetadataBuilder",
        description="passes the runner's common metadata through, with per-request lengths on the CPU",
    )
    register(
        "varlen",
        "patchbay.plugins.attention.common:VarlenMetadataBuilder",
        description="common, plus the cache slots of every request's keys as one ragged sequence",
    )
    register(
        "torch_sdpa",
        "patchbay.plugins.attention.torch_sdpa:TorchSDPAMetadataBuilder",
        description="plans each step's SDPA calls: batched short queries, per-request prefills",
    )
    register(
        "flex",
        "patchbay.plugins.attention.flex:FlexMetadataBuilder",
        description="varlen, plus the step's flex_attention BlockMask",
    )
    register(
        "xformers",
        "patchbay.plugins.attention.xformers_backend:XFormersMetadataBuilder",
        description="varlen, plus the step's xformers block-diagonal causal bias",
    )
