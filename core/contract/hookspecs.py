"""The hook specifications: the whole surface through which plugins reach patchbay.

A plugin is a module (or object) registered under the ``patchbay`` entry-point
group, for example in the plugin's ``pyproject.toml``::

    [project.entry-points.patchbay]
    my_plugin = "my_package.patchbay_hooks"

The module implements one or more of the hooks below, each marked with
:data:`hookimpl`.  Every hook receives a ``register`` callback; calling it
announces one implementation of that kind::

    from patchbay import hookimpl

    @hookimpl
    def register_samplers(register):
        register("my_sampler", "my_package.sampling:MySampler")

``register(name, target, *, description="")`` takes:

``name``
    The name operators write in YAML (``sampler: {name: my_sampler}``).  Names
    are open strings: lowercase letters, digits, ``_`` and ``-``.  Two plugins
    registering the same name for the same kind is an error that names both
    distributions; deny one of them (``plugins.deny``) to choose.
``target``
    The implementation, either as a class or, preferably, as a lazy
    ``"module:Class"`` reference that patchbay imports only when the
    implementation is first used.
``description``
    One line shown by ``patchbay plugins``.

Registration must be free of side effects: do not import torch kernels,
compile extensions, touch a device or read files inside a hook.  Do that in
the implementation's constructor, which runs only when a run selects it.

Hooks are called once per loaded plugin with per-plugin error containment:
an exception raised by one plugin's hook is reported against that plugin
(distribution, version, error) and the other plugins still register.
Return values are ignored.
"""

from __future__ import annotations

from typing import Protocol

import pluggy

PROJECT_NAME = "patchbay"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


class RegisterCallback(Protocol):
    """The ``register`` callback every registration hook receives."""

    def __call__(self, name: str, target: str | type, *, description: str = "") -> None:
        """Announce implementation ``target`` under ``name`` (see the module docstring)."""


@hookspec
def register_attention_backends(register: RegisterCallback) -> None:
    """Register attention backends.

    Each target must be a subclass of
    :class:`patchbay.interfaces.AttentionBackend`.  A backend computes
    attention for one layer over the paged KV cache and writes that layer's
    new keys and values into the cache.  It names the metadata builder it
    consumes through its ``metadata_builder`` class attribute; that builder is
    registered separately through :func:`register_attention_metadata_builders`
    (by the same plugin or another one).

    Called once per plugin when the registry loads.  The return value is
    ignored.
    """


@hookspec
def register_attention_metadata_builders(register: RegisterCallback) -> None:
    """Register attention-metadata builders.

    Each target must be a subclass of
    :class:`patchbay.interfaces.AttentionMetadataBuilder`.  A builder turns
    the runner's backend-neutral :class:`patchbay.interfaces.CommonAttentionMetadata`
    for one KV-cache group into the metadata object its backends read.  It is
    built once per step per KV-cache group and shared by all layers in the group.

    Called once per plugin when the registry loads.  The return value is
    ignored.
    """


@hookspec
def register_drafters(register: RegisterCallback) -> None:
    """Register speculative-decoding drafters (proposers).

    Each target must be a subclass of :class:`patchbay.interfaces.Drafter`.
    A drafter proposes up to ``num_speculative_tokens`` draft tokens per
    request after each step; the target model verifies them in the next step
    through a rejection sampler, so a drafter can only change speed, never
    the output.  Drafters declare what they need from the runner (token ids
    only, last hidden states, auxiliary hidden states, attention metadata) in
    their capabilities.

    Called once per plugin when the registry loads.  The return value is
    ignored.
    """


@hookspec
def register_samplers(register: RegisterCallback) -> None:
    """Register samplers and rejection samplers.

    Each target must be a subclass of :class:`patchbay.interfaces.Sampler`
    (turns logits into next tokens, with logprobs when asked) or of
    :class:`patchbay.interfaces.RejectionSampler` (verifies draft tokens for
    speculative decoding).  Both share the ``sampler`` kind and one namespace
    of names.

    Called once per plugin when the registry loads.  The return value is
    ignored.
    """


@hookspec
def register_kv_connectors(register: RegisterCallback) -> None:
    """Register KV-cache connectors.

    Each target must be a subclass of :class:`patchbay.interfaces.KVConnector`,
    a factory for the connector's two roles: the scheduler side
    (:class:`patchbay.interfaces.KVConnectorScheduler`, decides how many
    prompt tokens can be loaded instead of computed) and the worker side
    (:class:`patchbay.interfaces.KVConnectorWorker`, moves KV blocks between
    the paged cache and the connector's store around the forward pass).

    Called once per plugin when the registry loads.  The return value is
    ignored.
    """


@hookspec
def register_structured_output_backends(register: RegisterCallback) -> None:
    """Register structured-output (grammar) backends.

    Each target must be a subclass of
    :class:`patchbay.interfaces.StructuredOutputBackend`.  A backend compiles
    a request's constraint (JSON schema, any JSON object, regex, choice,
    grammar) into a grammar, off the step's critical path, and makes a
    :class:`patchbay.interfaces.GrammarMatcher` per request; the runner asks
    each matcher to fill its row of a shared token bitmask, masks the logits
    of constrained rows before the sampler and advances the matcher by the
    tokens accepted.  The run's backend is chosen by
    ``structured_output: {name: NAME}`` in settings.

    Called once per plugin when the registry loads.  The return value is
    ignored.
    """


@hookspec
def register_lora_kernels(register: RegisterCallback) -> None:
    """Register LoRA kernels: the batched computation of many adapters over one batch.

    Each target must be a subclass of :class:`patchbay.interfaces.LoRAKernel`.
    For every linear layer an adapter targets, the runner hands the kernel
    the layer's input rows, its base output, the stacked A and B matrices of
    the adapters in the step's slots, their scales and a per-step
    :class:`patchbay.interfaces.LoRAMapping` (row -> slot, ``-1`` for rows
    without an adapter); the kernel adds ``s·(x Aᵀ) Bᵀ`` to each row with an
    adapter (shrink, then expand, as vLLM's punica operations do) and leaves
    the other rows untouched.  The run's kernel is chosen by
    ``lora: {kernel: NAME}`` in settings.

    Called once per plugin when the registry loads.  The return value is
    ignored.
    """


@hookspec
def register_lora_resolvers(register: RegisterCallback) -> None:
    """Register LoRA adapter resolvers: where adapters a request names come from.

    Each target must be a subclass of :class:`patchbay.interfaces.LoRAResolver`.
    When a request names an adapter (its ``lora`` field) that the settings'
    ``lora.adapters`` does not list, the run asks its resolver (chosen by
    ``lora: {resolver: NAME}``) for a local directory holding the adapter in
    PEFT's format; a resolver that does not know the name returns ``None``
    and the request fails alone with an error naming the adapter.

    Called once per plugin when the registry loads.  The return value is
    ignored.
    """


@hookspec
def register_tool_parsers(register: RegisterCallback) -> None:
    """Register tool-call parsers.

    Each target must be a subclass of :class:`patchbay.interfaces.ToolParser`.
    A parser reads one model family's tool-call format (Hermes ``<tool_call>``
    tags, Llama 3 JSON, Mistral ``[TOOL_CALLS]``, ...) out of generated text:
    whole, from a finished output, and incrementally, as a
    :class:`patchbay.interfaces.ToolCallStream` of OpenAI-shaped deltas while
    the output streams.  Both must agree for every way the text is cut into
    pieces; malformed calls come back as content, never as an exception.
    The server's chat completions use it for ``tool_choice: auto``; the
    run's parser is chosen by ``chat: {tool_parser: NAME}`` in settings, a
    request may name another (``tool_parser``).

    Called once per plugin when the registry loads.  The return value is
    ignored.
    """


@hookspec
def register_reasoning_parsers(register: RegisterCallback) -> None:
    """Register reasoning parsers.

    Each target must be a subclass of
    :class:`patchbay.interfaces.ReasoningParser`.  A parser splits a
    reasoning model's output into its thinking (``reasoning_content`` in
    chat responses) and its answer (``content``), whole and as a
    :class:`patchbay.interfaces.ReasoningStream` of deltas that add up to the
    whole split for every way the text is cut.  The answer then goes to the
    tool-call parser, if the request offers tools.  The run's parser is chosen
    by ``chat: {reasoning_parser: NAME}`` in settings; a request may name
    another (``reasoning_parser``).

    Called once per plugin when the registry loads.  The return value is
    ignored.
    """


@hookspec
def register_weight_formats(register: RegisterCallback) -> None:
    """Register weight formats: how a checkpoint's weights are read and multiplied.

    Each target must be a subclass of :class:`patchbay.interfaces.WeightFormat`.
    A format reads one kind of checkpoint (a GGUF file of quantized blocks,
    GPTQ or AWQ groups in safetensors, or a float checkpoint it re-quantizes
    while loading) and hands the runner every tensor the model needs, the
    weights of linear layers kept packed in the format's own layout.  The
    run's format is ``model: {weight_format: {name: NAME}}``; ``auto`` picks
    the format of highest priority that reads the checkpoint, and a float
    checkpoint none of them claims loads as it is.

    Called once per plugin when the registry loads.  The return value is
    ignored.
    """


@hookspec
def register_poolers(register: RegisterCallback) -> None:
    """Register poolers.

    Each target must be a subclass of :class:`patchbay.interfaces.Pooler`.
    A pooling engine (one with a ``pooling:`` section) runs each prompt
    through the model without sampling; once its last token has run, the
    runner hands the hidden states of the positions the pooler reads
    (``Pooler.positions``: all, the first or the last) to the pooler, which
    returns one vector per request: an embedding (mean, CLS or last-token,
    normalized, cut to ``dimensions``), the probabilities of the model's
    classification head, or a cross-encoder's score.  The run's pooler is
    chosen by ``pooling: {name: NAME}`` in settings (``auto``: from the
    model's sentence-transformers files or its classification head).

    Called once per plugin when the registry loads.  The return value is
    ignored.
    """


@hookspec
def register_architectures(register: RegisterCallback) -> None:
    """Register architectures: what builds the model of a Hugging Face ``architectures`` name.

    Each target must be a subclass of :class:`patchbay.interfaces.Architecture`.
    Its capabilities list the names it serves (``LlamaForCausalLM``,
    ``DeepseekV3ForCausalLM``, ...) and those it shards over tensor-parallel
    ranks; its ``load`` builds the module from a
    :class:`patchbay.interfaces.ModelSource` and declares each attention
    layer's :class:`patchbay.interfaces.AttentionLayerSpec` (heads, head size,
    window, MLA's latent rows), which sizes and groups the paged KV cache.
    The run's plugin is chosen by ``model: {architecture: NAME}`` in settings;
    ``auto`` takes the highest-priority plugin that serves the model's
    ``config.json`` name (patchbay's generic ``transformers`` plugin serves
    any decoder whose transformers class takes the AttentionInterface).

    Called once per plugin when the registry loads.  The return value is
    ignored.
    """
