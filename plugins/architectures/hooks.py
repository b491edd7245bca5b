"""Registers the built-in architectures (lazily: nothing heavy is imported here)."""

from patchbay import hookimpl


@hookimpl
def register_architectures(register):
    register(
        "transformers",
        "patchbay.plugins.architectures.transformers_generic:TransformersArchitecture",
        description="transformers' own model classes, attention through the AttentionInterface; the generic path",
    )
    register(
        "deepseek_mla",
        "patchbay.plugins.architectures.deepseek_mla:DeepseekMLAArchitecture",
        description="DeepSeek-V2/V3: multi-head latent attention over one cached latent row per token",
    )
    register(
        "stablelm",
        "patchbay.plugins.architectures.stablelm:StableLMArchitecture",
        description="StableLM: partial rotary and per-head q/k norms, attention through patchbay",
    )
