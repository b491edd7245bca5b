"""The sections that choose plugins: each plugin is chosen by a ``name`` with its ``options`` (at the section's
top where the section is about one plugin, under a key of its own where a section chooses two), the places
listed in :data:`patchbay.contract.kinds.KINDS`; and the policy of which installed plugins load."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, PositiveFloat, PositiveInt, field_validator, model_validator
from pydantic_settings import NoDecode

from patchbay.contract.settings.sections import (
    PluginChoice,
    Section,
    _expand_home,
    _split_names,
    choice_shorthand,
    renamed_keys,
)

Choice = Annotated[PluginChoice, BeforeValidator(choice_shorthand)]
"""A plugin choice: ``{name, options}``, or the name alone."""


class AttentionSettings(Section):
    """The attention backend plugin and its options."""

    name: str = "auto"
    """A registered attention backend (``patchbay plugins --kind attention``), or ``auto``: the highest-priority
    one that accepts every KV-cache group on this device and dtype. A named backend that cannot serve the run is
    an error with its reasons."""
    options: dict[str, Any] = Field(default_factory=dict)
    """The backend's options, validated against its ``Options`` model (the built-in ones are below). Needs a
    named backend: with ``auto``, options are an error."""
    metadata_builder: Choice | None = None
    """A registered metadata builder to use instead of the one the backend names (rarely needed), as ``{name,
    options}`` or its name alone."""

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        return renamed_keys(data, "attention", {"backend": "name"})


class SamplerSettings(Section):
    """The sampler plugin that turns logits into tokens."""

    name: str = "standard"
    """A registered sampler (``patchbay plugins --kind sampler``): the built-in ``standard`` serves every
    sampling parameter, ``greedy`` only greedy requests."""
    options: dict[str, Any] = Field(default_factory=dict)
    """The sampler's options, validated against its ``Options`` model (the built-in ones are below)."""


class SpecDecodeSettings(Section):
    """Speculative decoding: a drafter proposes tokens that the target model verifies in its next step, so
    outputs are the target's alone (docs/design/speculative-decoding.md)."""

    name: str
    """A registered drafter (``ngram``, ``eagle``, ``eagle3``, ``medusa``, ...)."""
    options: dict[str, Any] = Field(default_factory=dict)
    """The drafter's options, validated against its ``Options`` model (the built-in ones are below)."""
    num_speculative_tokens: PositiveInt = 3
    """Draft tokens proposed per request and step."""
    rejection_sampler: Choice = PluginChoice(name="rejection")
    """A registered sampler of role ``verify``, as ``{name, options}`` or its name alone: it keeps the longest
    draft prefix the target agrees with, plus one token of the target's own."""

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        return renamed_keys(data, "spec_decode", {"method": "name"})


class KVConnectorSettings(Section):
    """Prompt blocks a store holds are loaded instead of computed, and new full ones are saved
    for other runs (docs/design/kv-connectors.md)."""

    name: str
    """A registered KV connector (``host_offload``, ``shared_storage``, ``redis``, ...)."""
    options: dict[str, Any] = Field(default_factory=dict)
    """The connector's options, validated against its ``Options`` model (the built-in ones are below)."""
    role: Literal["both", "producer", "consumer"] = "both"
    """``producer`` only saves KV, ``consumer`` only loads it, ``both`` does both."""
    stall_timeout: PositiveFloat = 60.0
    """Seconds the engine waits, with nothing else to run, on requests only the connector holds before it fails
    the run naming them; results finished before are written."""


class StructuredOutputSettings(Section):
    """The grammar backend for requests' ``structured_output`` constraints, built on the
    first constrained request (docs/configuration.md#structured-output)."""

    name: str = "xgrammar"
    """A registered structured-output backend: ``xgrammar`` or ``llguidance`` built in."""
    options: dict[str, Any] = Field(default_factory=dict)
    """The backend's options, validated against its ``Options`` model (the built-in ones are below)."""
    compile_timeout: PositiveFloat | None = 30.0
    """Seconds one constraint may take to compile; past it the requests waiting on it fail alone (a 400 on the
    server) and the next constraints compile at once while the runaway compile ends in the background.  The
    same constraint sent again fails at once.  ``null``: no limit."""
    cache_bytes: PositiveInt = 1 << 30
    """Compiled grammars are kept for reuse while their estimated sizes add up to at most this many bytes
    (least recently used out first); one 100k-value ``choice`` can hold hundreds of MB."""
    compile_workers: PositiveInt = 2
    """Constraints compiled at once. Queued ones start smallest first, and one more worker is kept for small
    constraints, so a short ``choice`` never waits behind a huge schema."""
    max_queued_compiles: PositiveInt = 64
    """Distinct constraints that may wait for a worker; one more fails at once (a 503 on the server)."""

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        return renamed_keys(data, "structured_output", {"backend": "name"})


class LoRASettings(Section):
    """LoRA adapters over the base model: which exist, how many run at once, and the two LoRA plugins."""

    adapters: dict[str, Path] = Field(default_factory=dict)
    """Adapter name -> directory in PEFT's format (``adapter_config.json`` and ``adapter_model.safetensors``);
    a request picks one by name with its ``lora`` field.  Each is checked when the run starts."""
    max_loras: PositiveInt = 4
    """Adapters one step may use at once (the runner's slots); requests of further adapters wait."""
    max_lora_rank: PositiveInt = 16
    """The largest rank an adapter may have; a larger one is refused naming the adapter."""
    max_cpu_loras: PositiveInt | None = None
    """Adapters kept loaded in memory, least recently used evicted first; default: ``max_loras``.  At least
    ``max_loras``."""
    kernel: Choice = PluginChoice(name="torch")
    """The ``lora_kernel`` plugin that applies each row's adapter in the target linears, as ``{name, options}``
    or its name alone."""
    resolver: Choice | None = None
    """A ``lora_resolver`` plugin that finds adapters a request names but ``adapters`` does not list, as ``{name,
    options}`` (``{name: directory, options: {root: FOLDER}}``) or its name alone; default: none, so only listed
    adapters exist."""
    allow_runtime_updates: bool = False
    """Whether the server's ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (behind the API key)
    may add and remove adapters while it runs; off by default, so they answer 404.  Refused with
    ``runtime.tensor_parallel_size`` > 1: the other ranks would not see the change."""

    @field_validator("adapters", mode="before")
    @classmethod
    def _adapter_names(cls, value: Any) -> Any:
        if isinstance(value, Mapping):
            for name in value:
                if not isinstance(name, str) or not name.strip():
                    raise ValueError(f"adapter names are non-empty strings, got {name!r}")
            return {name: _expand_home(path) for name, path in value.items()}
        return value

    @model_validator(mode="after")
    def _cpu_slots_hold_the_active_ones(self) -> LoRASettings:
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras})")
        return self

    @property
    def cpu_capacity(self) -> int:
        """Adapters kept loaded: ``max_cpu_loras`` or, unset, ``max_loras``."""
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        return renamed_keys(
            data,
            "lora",
            {"kernel_options": "kernel.options", "resolver_options": "resolver.options"},
            {"kernel": {"name": "torch"}},
        )


class ChatSettings(Section):
    """How chat messages become a prompt and how answers are read: the template, the tool-call parser and the
    reasoning parser ([tool calling](tool-calling.md))."""

    template: Path | None = None
    """A Jinja chat-template file used instead of the tokenizer's; default: the tokenizer's (for the bundled
    model, patchbay's copy of it with a tools section)."""
    tool_parser: Choice = PluginChoice(name="hermes")
    """The tool-call parser that reads calls out of answers to requests offering ``tools`` (``tool_choice:
    auto``), as ``{name, options}`` or its name alone: ``hermes``, ``llama3_json`` or ``mistral`` built in; a
    request may name another (``tool_parser``)."""
    reasoning_parser: Choice | None = None
    """A reasoning parser that splits answers into ``reasoning_content`` and ``content``, as ``{name, options}``
    or its name alone (``think`` built in, with option ``starts_in_reasoning`` for templates that open
    ``<think>`` in the prompt); default: none; a request may name one (``reasoning_parser``)."""

    compact_tool_calls: bool = True
    """Decode enforced tool calls (``tool_choice: required`` or a named function) as compact JSON, without
    whitespace outside strings, so ``max_tokens`` go on the calls; ``false``: the structured-output backend's
    own whitespace option applies."""

    _home = field_validator("template")(lambda value: _expand_home(value))

    @field_validator("template")
    @classmethod
    def _template_exists(cls, value: Path | None) -> Path | None:
        if value is not None and not value.is_file():
            raise ValueError(f"no chat template file at {value}")
        return value

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        return renamed_keys(
            data,
            "chat",
            {"tool_parser_options": "tool_parser.options", "reasoning_parser_options": "reasoning_parser.options"},
            {"tool_parser": {"name": "hermes"}},
        )


class PoolingSettings(Section):
    """The engine pools instead of generating: each prompt runs once through the model and its hidden states
    become an embedding, class probabilities or a score (docs/pooling.md); ``LLM.generate`` and the
    completion routes are then refused, as ``LLM.embed`` and ``/v1/embeddings`` are on an engine without it."""

    name: str = "auto"
    """A registered pooler (``mean``, ``cls``, ``last``, ``classify``, ``score`` built in), or ``auto``: what the
    model's sentence-transformers files say (``modules.json`` and its pooling module's ``config.json``,
    normalized when it lists a ``Normalize`` module), else ``score`` for a classification head of one label and
    ``classify`` for one of several. A model with neither needs a name."""
    options: dict[str, Any] = Field(default_factory=dict)
    """The pooler's options, validated against its ``Options`` model (the built-in ones are below). Needs a
    named pooler: with ``auto``, options are an error."""


class PluginPolicy(Section):
    """Which installed plugins load, by entry-point name (``example``), distribution name
    (``patchbay-example-plugin``) or implementation (``sampler:example_argmax``)."""

    strict: bool = False
    """A plugin that fails to load, or registers a name another plugin already has, is an error instead of a
    report."""
    allow: Annotated[list[str], NoDecode] = Field(default_factory=list)
    """If non-empty, only the plugins it names load. A comma-separated string works too (handy in environment
    variables)."""
    deny: Annotated[list[str], NoDecode] = Field(default_factory=list)
    """These plugins never load; wins over ``allow``. A plugin denied by entry-point or distribution name is not
    even imported. A comma-separated string works too."""

    _split = field_validator("allow", "deny", mode="before")(_split_names)
