"""The plugin kinds: each kind's name, registration hook, interface, and where settings choose its plugins.

This table is the one source every kind-generic part reads: the registry (hooks and interfaces), the settings
(which keys choose a plugin of which kind, :data:`CHOICE_SITES`), ``patchbay plugins``, the kit and the generated
reference.  Adding a kind starts here (docs/adding-a-kind.md lists every other file it touches).
"""

from __future__ import annotations

from dataclasses import dataclass

from patchbay.interfaces import (
    Architecture,
    AttentionBackend,
    AttentionMetadataBuilder,
    Drafter,
    KVConnector,
    LoRAKernel,
    LoRAResolver,
    Plugin,
    Pooler,
    ReasoningParser,
    SamplerBase,
    StructuredOutputBackend,
    ToolParser,
    WeightFormat,
)


@dataclass(frozen=True)
class ChoiceSite:
    """A place in the settings that chooses one plugin: ``name`` and ``options`` keys under ``path``.

    ``path`` is a section (``("sampler",)``: ``sampler.name``, ``sampler.options``) or a key within one
    (``("lora", "kernel")``: ``lora.kernel.name``, ``lora.kernel.options``).
    """

    path: tuple[str, ...]
    role: str | None = None
    """For samplers: ``sample`` (the main sampler) or ``verify`` (speculative decoding's rejection sampler)."""
    checked_by_default: bool = False
    """Whether the default choice is checked against the registry when its section is not given (the sampler's
    is; the defaults of other sections are checked when the engine or server starts, where they are needed)."""

    @property
    def dotted(self) -> str:
        """``lora.kernel``."""
        return ".".join(self.path)


@dataclass(frozen=True)
class Kind:
    """One plugin kind: its name in ``KIND:NAME`` references, its hook, its interface and its settings keys."""

    name: str
    hook: str
    interface: type[Plugin]
    label: str
    choices: tuple[ChoiceSite, ...] = ()
    """Where settings choose a plugin of this kind (a kind chosen nowhere is picked by the runner)."""
    purpose: str = ""
    """When to write one, in a phrase (the plugin guide's table of kinds)."""
    guide: str = "plugin-guide.md"
    """The page of ``docs/`` that guides an author of this kind."""


KINDS: dict[str, Kind] = {
    kind.name: kind
    for kind in (
        Kind(
            "attention",
            "register_attention_backends",
            AttentionBackend,
            "attention backends",
            (ChoiceSite(("attention",)),),
            "you have a faster or different attention kernel over the paged KV cache",
            "plugin-kinds/attention.md",
        ),
        Kind(
            "attention_metadata_builder",
            "register_attention_metadata_builders",
            AttentionMetadataBuilder,
            "attention-metadata builders",
            (ChoiceSite(("attention", "metadata_builder")),),
            "your backend wants per-step data (masks, plans, ragged indices) built once per step, not per layer",
            "plugin-kinds/attention.md",
        ),
        Kind(
            "drafter",
            "register_drafters",
            Drafter,
            "speculative-decoding drafters",
            (ChoiceSite(("spec_decode",)),),
            "you propose draft tokens for speculative decoding (n-gram, EAGLE, Medusa, ...)",
            "plugin-kinds/drafter.md",
        ),
        Kind(
            "sampler",
            "register_samplers",
            SamplerBase,
            "samplers",
            (
                ChoiceSite(("sampler",), role="sample", checked_by_default=True),
                ChoiceSite(("spec_decode", "rejection_sampler"), role="verify"),
            ),
            "you turn logits into tokens differently (sampling methods, penalties), or verify drafts",
        ),
        Kind(
            "kv_connector",
            "register_kv_connectors",
            KVConnector,
            "KV-cache connectors",
            (ChoiceSite(("kv_connector",)),),
            "you load prompt KV from somewhere instead of computing it, or save it for others",
            "plugin-kinds/kv-connector.md",
        ),
        Kind(
            "structured_output",
            "register_structured_output_backends",
            StructuredOutputBackend,
            "structured-output backends",
            (ChoiceSite(("structured_output",)),),
            "you constrain outputs with another grammar engine (JSON schemas, regexes, choices, grammars)",
            "plugin-kinds/structured-output.md",
        ),
        Kind(
            "lora_kernel",
            "register_lora_kernels",
            LoRAKernel,
            "LoRA kernels",
            (ChoiceSite(("lora", "kernel")),),
            "you compute many LoRA adapters over one batch faster (a native or GPU shrink/expand)",
            "plugin-kinds/lora.md",
        ),
        Kind(
            "lora_resolver",
            "register_lora_resolvers",
            LoRAResolver,
            "LoRA adapter resolvers",
            (ChoiceSite(("lora", "resolver")),),
            "adapters come from somewhere other than the settings' list (a folder, a hub, a database)",
            "plugin-kinds/lora.md",
        ),
        Kind(
            "tool_parser",
            "register_tool_parsers",
            ToolParser,
            "tool-call parsers",
            (ChoiceSite(("chat", "tool_parser")),),
            "your model writes tool calls in a format no installed parser reads",
            "plugin-kinds/parsers.md",
        ),
        Kind(
            "architecture",
            "register_architectures",
            Architecture,
            "architectures",
            (ChoiceSite(("model", "architecture")),),
            "you run a model family the installed plugins do not (or faster, or with its own KV-cache layout)",
            "plugin-kinds/architecture.md",
        ),
        Kind(
            "reasoning_parser",
            "register_reasoning_parsers",
            ReasoningParser,
            "reasoning parsers",
            (ChoiceSite(("chat", "reasoning_parser")),),
            "your model marks its reasoning in another way than `<think> ... </think>`",
            "plugin-kinds/parsers.md",
        ),
        Kind(
            "weight_format",
            "register_weight_formats",
            WeightFormat,
            "weight formats",
            (ChoiceSite(("model", "weight_format")),),
            "your checkpoints store weights in a format no installed plugin reads, or you multiply by one faster",
            "plugin-kinds/weight-format.md",
        ),
        Kind(
            "pooler",
            "register_poolers",
            Pooler,
            "poolers",
            (ChoiceSite(("pooling",)),),
            "you turn a prompt's hidden states into an embedding, class probabilities or a score another way",
            "plugin-kinds/pooler.md",
        ),
    )
}
"""Every plugin kind, by name, in the order ``patchbay plugins`` and the reference list them."""
