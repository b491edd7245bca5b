"""Settings of a whole run: pydantic models, loaded from YAML, overridden from env and CLI.

Precedence, lowest first: defaults, the YAML file, environment variables
(``PATCHBAY_`` prefix, ``__`` between nested keys, e.g.
``PATCHBAY_SCHEDULER__MAX_NUM_SEQS=8``), then ``--set key.path=value``
overrides on the command line.  Unknown keys are errors everywhere.  Every
problem is reported with where the offending value came from (file, env var
or CLI flag), its key path and, for plugin sections, the plugin.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ByteSize,
    ConfigDict,
    Field,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
)

from patchbay.contract.redaction import HIDDEN, is_secret_path, redact, redact_assignment
from patchbay.contract.bounded_yaml import DocumentTooLarge, check_bounds, load_bounded

if TYPE_CHECKING:
    from patchbay.contract.registry import Registry
    from patchbay.interfaces.base import Plugin

ENV_PREFIX = "PATCHBAY_"
ENV_NESTED_DELIMITER = "__"
DEFAULT_MODEL = "default"
"""The model path that means the bundled SmolLM2-135M-Instruct."""


def _expand_home(value: Any) -> Any:
    """``~/x`` and ``~user/x`` as the home directory's path (a path setting never means a directory named ``~``)."""
    if isinstance(value, Path):
        return value.expanduser()
    if isinstance(value, str) and value.startswith("~"):
        return str(Path(value).expanduser())
    return value


class Section(BaseModel):
    """Base of every settings section: unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", validate_default=True)


class ModelSettings(Section):
    """Which model runs, in which dtype and with which weights."""

    path: str = DEFAULT_MODEL
    """A local Hugging Face model directory (with ``config.json``), a ``.gguf`` file (converted once to
    safetensors under ``~/.cache/patchbay/models``), or ``default`` for the bundled SmolLM2-135M-Instruct.
    Nothing is downloaded."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weights and KV cache (unless ``cache.dtype`` sets the cache's). ``auto``: bfloat16 on CUDA; on a CPU the
    fastest dtype it computes natively, measured once (``patchbay tune``), or bfloat16 where it has it under
    ``w8a8`` or ``int4`` tiles. In bfloat16 greedy tokens can differ at near-ties as batching changes;
    ``float32`` keeps them (docs/design/cpu-fast-paths.md#dtypes)."""
    quantization: Literal["none", "int8", "w8a8", "int4"] = "none"
    """Integer weights on the CPU: ``int8`` per output row, for steps of up to 16 rows; ``w8a8`` the same
    weights for every step, times activations rounded to int8 per token (AVX512-VNNI); ``int4`` per 32 input
    features on Q4_1's grid, every step. Another device, or ``w8a8`` without AVX512-VNNI, is an error
    (docs/design/cpu-fast-paths.md#integer-weights)."""
    max_model_len: PositiveInt | None = None
    """Longest prompt plus output, in tokens. Null: the model's ``max_position_embeddings`` (a model that
    declares none needs this set); a larger value is capped to it."""
    max_logprobs: int = Field(default=20, ge=-1)
    """Most ``logprobs`` / ``prompt_logprobs`` a request may ask for per position, as vLLM's; ``-1``: the whole
    vocabulary. A request asking for more is refused when it is added."""

    _home = field_validator("path")(lambda value: _expand_home(value))


class RuntimeSettings(Section):
    """The device, the CPU kernels and how the model is spread over processes."""

    device: str = "auto"
    """``auto`` (CUDA when available, else the CPU), ``cpu``, ``cuda``, ``cuda:1``, ... Asking for CUDA where
    there is none is an error."""
    threads: PositiveInt | None = None
    """``torch.set_num_threads``. Null: torch's default; with several ranks or pipeline stages, the cores this
    process may use, shared evenly by the ranks on this machine."""
    linear_kernel: Literal["auto", "tiles", "onednn", "row_split", "torch"] = "auto"
    """The kernel of linear layers on the CPU (docs/design/cpu-fast-paths.md#linear-kernels). ``auto``: what the
    machine's tuning measured fastest for the run's dtype; a kernel named for a dtype or device it cannot run is
    an error."""
    fuse_projections: bool = True
    """Compute each layer's q/k/v projections (and gate/up) as one product over their concatenated weights, in
    steps of up to as many rows as the machine's tuning measured faster (16 without a tuning). Off with a ``lora:``
    section, whose adapters add to each projection's own output."""
    cpu_allocator: Literal["caching", "system"] = "caching"
    """Where torch's CPU tensors come from, for the whole process (the first engine's choice holds):
    ``caching``, patchbay's cache of freed blocks by size class (up to 512 MiB kept), built like the C++ kernels,
    so a step's temporaries skip the C library's search (docs/design/cpu-fast-paths.md#host-allocator);
    ``system``, the C library's allocator."""
    fused_ops: bool = True
    """Run Llama-style RMS norms, SiLU MLPs, rotary embeddings and, where all of a layer fused, whole decoder
    layers through patchbay's C++ kernels on CPU float32 and bfloat16. Without a C++ compiler nothing changes
    (docs/design/cpu-fast-paths.md#fused-kernels). With a ``lora:`` section whole layers do not fuse."""
    single_thread_max_tokens: NonNegativeInt | Literal["auto"] = "auto"
    """Steps of at most this many tokens run torch's ops on one CPU thread, where waking a second costs more than
    it gains (tiled products and the decode kernel keep their own awake helpers). ``auto``: up to the row count
    the machine's tuning measured faster for the run's dtype (0 without a tuning); 0: never."""
    seed: int = 0
    """``torch.manual_seed`` at engine start and again once the engine is built, on every rank and stage, so
    random samplers repeat run to run whatever the rank count."""
    tensor_parallel_size: PositiveInt = 1
    """Ranks the model is split over, one process each (Llama, Qwen2, Mistral): attention heads and
    ``intermediate_size`` must be divisible by it, KV heads must divide it or be divisible by it. Under
    ``torchrun``, ``WORLD_SIZE`` must equal it times ``pipeline_parallel_size`` (docs/design/parallelism.md)."""
    pipeline_parallel_size: PositiveInt = 1
    """Pipeline stages the decoder layers are split over, one process each; only the last stage computes logits.
    At most one stage per layer, and every stage must hold each kind of attention layer the model has
    (docs/design/parallelism.md#pipeline-stages)."""
    pipeline_layer_partition: Annotated[list[PositiveInt] | None, NoDecode] = None
    """Decoder layers of each stage, in stage order (``[19, 11]``, or ``19,11`` on the command line): one entry
    per stage, adding up to the model's layers. Null: an even split, the first stages one more. The last stage
    also computes the logits."""
    distributed_backend: Literal["auto", "gloo", "nccl"] = "auto"
    """The torch.distributed backend joining the ranks: ``auto`` is NCCL on CUDA (rank ``r`` on the ``r``-th
    device) and gloo on the CPU; ``nccl`` on the CPU is an error."""
    distributed_timeout: PositiveFloat = 300.0
    """Seconds a collective waits for a rank that is alive but silent before the run fails; a rank whose process
    ended fails the run at once."""
    master_addr: str | None = None
    """Rank 0's address as the other ranks reach it (the run's store and step channel). Null: torchrun's
    ``MASTER_ADDR`` under torchrun, else the loopback interface (``127.0.0.1``)."""
    master_port: Annotated[int, Field(ge=1, le=65535)] | None = None
    """Port of the run's torch.distributed store. Null: torchrun's ``MASTER_PORT`` under torchrun, else a free
    port; another port under torchrun makes rank 0 host a store of its own."""

    _partition = field_validator("pipeline_layer_partition", mode="before")(
        lambda value: _split_names(value) if isinstance(value, str) else value
    )

    @model_validator(mode="after")
    def _one_partition_per_stage(self) -> RuntimeSettings:
        partition = self.pipeline_layer_partition
        if partition is not None and len(partition) != self.pipeline_parallel_size:
            raise ValueError(
                f"pipeline_layer_partition gives {len(partition)} stages' layers "
                f"({','.join(map(str, partition))}); pipeline_parallel_size is {self.pipeline_parallel_size}"
            )
        return self

    @property
    def world_size(self) -> int:
        """Processes the run's model is spread over: tensor-parallel ranks times pipeline stages."""
        return self.tensor_parallel_size * self.pipeline_parallel_size


_BYTE_SIZE = TypeAdapter(ByteSize)


def _byte_size_or_auto(value: Any) -> Any:
    """``auto``, or a byte size (``512MiB``, ``2GB``, a number of bytes) as its number of bytes."""
    if value == "auto":
        return value
    try:
        return int(_BYTE_SIZE.validate_python(value))
    except ValidationError as exc:
        raise ValueError(exc.errors()[0]["msg"]) from None


class CacheSettings(Section):
    """The paged KV cache. The pool must hold one request of ``model.max_model_len`` tokens, and it
    must fit the memory free when the engine starts (docs/design/kv-cache.md)."""

    block_size: PositiveInt = 16
    """Tokens per KV-cache block."""
    num_blocks: PositiveInt | None = None
    """Size the KV pool by block count (block 0 is reserved); give this or ``memory``, not both."""
    memory: Annotated[int | Literal["auto"], BeforeValidator(_byte_size_or_auto)] = "auto"
    """Size the pool by a budget (``512MiB``, ``2GB``, a number of bytes). ``auto``: ``memory_utilization`` of
    the device's memory less the loaded model and the measured peak of the largest step
    (docs/design/kv-cache.md#sizing-the-pool)."""
    memory_utilization: float | None = Field(default=None, gt=0, le=1)
    """The share of the device's memory (the machine's or its cgroup's, on the CPU) ``memory: auto`` may fill,
    the model included. Null: 0.9 on a GPU, 0.5 on the CPU, whose memory the rest of the machine shares."""
    prefix_caching: bool = True
    """Share full blocks of identical prompt prefixes between requests."""
    dtype: Literal["auto", "int8"] = "auto"
    """``auto``: keys and values in the model's dtype. ``int8``: each token's features per KV head rounded to
    int8 with a float32 scale, about a quarter of float32's bytes (docs/design/kv-cache.md#int8-cache); the
    attention backend must support it."""

    @model_validator(mode="after")
    def _one_sizing(self) -> CacheSettings:
        if self.num_blocks is not None and self.memory != "auto":
            raise ValueError("give either num_blocks or memory, not both")
        return self


class SchedulerSettings(Section):
    """How many requests and tokens one step batches."""

    max_num_seqs: PositiveInt = 64
    """Most requests running at once."""
    max_num_batched_tokens: PositiveInt = 2048
    """Token budget of one step: prefill chunks plus decodes."""
    chunked_prefill: bool = True
    """Split long prompts across steps. When off, a prompt must fit the token budget whole; a longer one is
    rejected."""
    max_n: PositiveInt = 1024
    """Most sequences one request may ask for (its ``n``) in ``LLM.generate`` and ``patchbay run``: each sequence
    is a request of its own, built when the request is added, so a larger ``n`` is refused up front, naming the
    request.  The server bounds ``n`` by ``scheduler.max_num_seqs + server.max_waiting`` instead."""
    max_num_encoder_input_tokens: PositiveInt = 8192
    """Encoder budget of one step, for vision-language models: the placeholder tokens of the images whose encoder
    runs in it. An image is encoded whole in the step whose chunk first reaches it; when the budget cannot take
    it, the chunk stops before the image. A request with an image larger than this is refused."""
    encoder_cache_size: PositiveInt = 8192
    """Capacity of the encoder cache, in placeholder tokens: encoded images stay there, shared by identical
    images; once no request needs one it stays until a new image needs its room (least recently released
    first). A chunk whose image does not fit stops before it; a larger image is refused. ``cache.memory: auto``
    reserves it full (docs/design/multimodal.md)."""


class AttentionSettings(Section):
    """The attention backend plugin and its options."""

    backend: str = "auto"
    """A registered attention backend (``patchbay plugins --kind attention``), or ``auto``: the highest-priority
    one that accepts every KV-cache group on this device and dtype. A named backend that cannot serve the run is
    an error with its reasons."""
    metadata_builder: str | None = None
    """A registered metadata builder to use instead of the one the backend names (rarely needed); it runs with
    its default options."""
    options: dict[str, Any] = Field(default_factory=dict)
    """The backend's options, validated against its ``Options`` model (the built-in ones are below). Needs a
    named backend: with ``auto``, options are an error."""


class SamplerSettings(Section):
    """The sampler plugin that turns logits into tokens."""

    name: str = "standard"
    """A registered sampler (``patchbay plugins --kind sampler``): the built-in ``standard`` serves every
    sampling parameter, ``greedy`` only greedy requests."""
    options: dict[str, Any] = Field(default_factory=dict)
    """The sampler's options, validated against its ``Options`` model (the built-in ones are below)."""


class SpeculativeSettings(Section):
    """A drafter proposes tokens that the target model verifies in its next step, so outputs
    are the target's alone (docs/design/speculative-decoding.md)."""

    method: str
    """A registered drafter (``ngram``, ``eagle``, ``eagle3``, ``medusa``, ...)."""
    num_speculative_tokens: PositiveInt = 3
    """Draft tokens proposed per request and step."""
    rejection_sampler: str = "rejection"
    """A registered sampler of role ``verify``: it keeps the longest draft prefix the target agrees with, plus
    one token of the target's own."""
    options: dict[str, Any] = Field(default_factory=dict)
    """The drafter's options, validated against its ``Options`` model (the built-in ones are below)."""


class KVConnectorSettings(Section):
    """Prompt blocks a store holds are loaded instead of computed, and new full ones are saved
    for other runs (docs/design/kv-connectors.md)."""

    name: str
    """A registered KV connector (``host_offload``, ``shared_storage``, ``redis``, ...)."""
    role: Literal["both", "producer", "consumer"] = "both"
    """``producer`` only saves KV, ``consumer`` only loads it, ``both`` does both."""
    options: dict[str, Any] = Field(default_factory=dict)
    """The connector's options, validated against its ``Options`` model (the built-in ones are below)."""
    stall_timeout: PositiveFloat = 60.0
    """Seconds the engine waits, with nothing else to run, on requests only the connector holds before it fails
    the run naming them; results finished before are written."""


class StructuredOutputSettings(Section):
    """The grammar backend for requests' ``structured_output`` constraints, built on the
    first constrained request (docs/configuration.md#structured-output)."""

    backend: str = "xgrammar"
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
    kernel: str = "torch"
    """The ``lora_kernel`` plugin that applies each row's adapter in the target linears."""
    kernel_options: dict[str, Any] = Field(default_factory=dict)
    """Options of the kernel plugin."""
    resolver: str | None = None
    """A ``lora_resolver`` plugin (``directory``, ...) that finds adapters a request names but ``adapters``
    does not list; default: none, so only listed adapters exist."""
    resolver_options: dict[str, Any] = Field(default_factory=dict)
    """Options of the resolver plugin (``directory``: ``{root: FOLDER}``)."""
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


class ChatSettings(Section):
    """How chat messages become a prompt and how answers are read: the template, the tool-call parser and the
    reasoning parser ([tool calling](tool-calling.md))."""

    template: Path | None = None
    """A Jinja chat-template file used instead of the tokenizer's; default: the tokenizer's (for the bundled
    model, patchbay's copy of it with a tools section)."""
    tool_parser: str = "hermes"
    """The tool-call parser that reads calls out of answers to requests offering ``tools`` (``tool_choice:
    auto``): ``hermes``, ``llama3_json`` or ``mistral`` built in; a request may name another (``tool_parser``)."""
    tool_parser_options: dict[str, Any] = Field(default_factory=dict)
    """The tool parser's options, validated against its ``Options`` model."""
    reasoning_parser: str | None = None
    """A reasoning parser (``think`` built in) that splits answers into ``reasoning_content`` and ``content``;
    default: none; a request may name one (``reasoning_parser``)."""
    reasoning_parser_options: dict[str, Any] = Field(default_factory=dict)
    """The reasoning parser's options (``think``: ``starts_in_reasoning``, for templates that open ``<think>``
    in the prompt)."""

    _home = field_validator("template")(lambda value: _expand_home(value))

    @field_validator("template")
    @classmethod
    def _template_exists(cls, value: Path | None) -> Path | None:
        if value is not None and not value.is_file():
            raise ValueError(f"no chat template file at {value}")
        return value


class MultimodalSettings(Section):
    """How images in prompts are read and bounded: counts, sizes, and which local files and remote URLs may be
    read (docs/serving.md#images)."""

    max_images_per_prompt: PositiveInt = 8
    """Most images one prompt (one chat request, one offline prompt) may carry; more is an error naming the
    request."""
    max_image_pixels: PositiveInt = 16_777_216
    """Most pixels (width × height) of one image, checked from its header before it is decoded, so a small file
    that would decode to a huge bitmap (a decompression bomb) is refused first."""
    max_image_bytes: PositiveInt = 20 << 20
    """Largest encoded image read from a ``data:`` URL, a ``file://`` URL or a remote URL, in bytes."""
    allowed_local_media_path: Path | None = None
    """The folder ``file://`` image URLs may read from (symlinks and ``..`` leading out of it are refused);
    null: ``file://`` URLs are refused. Plain paths given to the offline API are read wherever they are."""
    allow_remote_urls: bool = False
    """Fetch ``http://`` and ``https://`` image URLs; off by default, since the server would then fetch any
    address a client names (its own network included)."""
    remote_fetch_timeout: PositiveFloat = 10.0
    """Seconds a remote image may take to connect and to send each piece before the fetch fails."""

    _home = field_validator("allowed_local_media_path")(lambda value: _expand_home(value))

    @field_validator("allowed_local_media_path")
    @classmethod
    def _folder_exists(cls, value: Path | None) -> Path | None:
        if value is not None and not value.is_dir():
            raise ValueError(f"no folder at {value}")
        return value


def _split_names(value: Any) -> Any:
    if isinstance(value, str) and value.lstrip().startswith("["):
        return json.loads(value)
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    return value


RENAMED_PLUGINS = {"spec_decode": "drafters"}
"""Built-in entry-point names that changed -> their new names (accepted in ``plugins.allow`` and ``deny``)."""


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

    @field_validator("allow", "deny")
    @classmethod
    def _renamed_plugins(cls, names: list[str]) -> list[str]:
        for old, new in RENAMED_PLUGINS.items():
            if old in names:
                warnings.warn(
                    f"plugins.allow/deny: the built-in plugin {old!r} is now called {new!r}; the old "
                    "name is deprecated",
                    FutureWarning,
                    stacklevel=2,
                )
        return [RENAMED_PLUGINS.get(name, name) for name in names]


class InputSettings(Section):
    """The requests ``patchbay run`` runs; ``prompts`` and ``file`` may both be given, and a run
    without either is an error."""

    prompts: list[str | dict[str, Any]] = Field(default_factory=list)
    """Inline requests: strings, or objects with ``prompt``, ``messages`` or ``prompt_token_ids`` and
    per-request sampling parameters (docs/configuration.md#requests)."""
    file: Path | None = None
    """A JSONL file of request objects, one per line, run after the inline ones; a relative path is relative to
    the YAML file's directory."""
    chat_template: bool = True
    """Send plain-string prompts as a user message through the tokenizer's chat template (an error if it has
    none)."""
    sampling: dict[str, Any] = Field(default_factory=dict)
    """Default sampling parameters of every request (``max_tokens``, ``stop``, ...); a request's own keys
    override them."""

    _home = field_validator("file")(lambda value: _expand_home(value))


class OutputSettings(Section):
    """Where ``patchbay run`` writes its results."""

    path: Path | None = None
    """Where ``patchbay run`` writes one JSON line per finished request; null: nowhere. Relative to the current
    directory, not the YAML file's; missing directories are created (docs/configuration.md#results)."""
    progress: bool = True
    """Show a progress bar of finished requests on stderr."""

    _home = field_validator("path")(lambda value: _expand_home(value))


class ServerSettings(Section):
    """Where ``patchbay serve`` listens, who may call it and how much it queues
    (docs/serving.md)."""

    host: str = "127.0.0.1"
    """Address to listen on (``0.0.0.0`` for every interface)."""
    port: int = Field(default=8000, ge=0, le=65535)
    """TCP port (0: any free port, printed at start)."""
    api_keys: Annotated[list[str], NoDecode] = Field(default_factory=list)
    """Accepted ``Authorization: Bearer`` keys; empty: no key needed. A comma-separated string works too (handy
    in ``PATCHBAY_SERVER__API_KEYS``)."""
    api_key_file: Path | None = None
    """A file of more accepted keys, one per line (blank lines and ``#`` comments skipped), readable by its owner
    alone (else the server refuses to start, naming it). With ``PATCHBAY_SERVER__API_KEYS``, the way to keep keys
    off the command line."""
    served_model_name: str | None = None
    """The model name clients send; default: the model directory's name."""
    max_waiting: int = Field(default=256, ge=0)
    """Sequences admitted beyond ``scheduler.max_num_seqs``; a request over the limit gets 503 instead of an
    unbounded queue."""
    stored_responses: int = Field(default=256, ge=0)
    """Responses kept in memory for ``previous_response_id`` and ``GET /v1/responses/{id}`` (least recently used
    dropped first; 0: none kept). A request with ``store: false`` is never kept."""
    shutdown_grace_period: float = Field(default=30.0, ge=0.0)
    """Seconds after SIGTERM during which requests in flight may finish; the rest are aborted."""
    log_requests: bool = False
    """Log one line per HTTP request (uvicorn's access log)."""
    max_body_bytes: int = Field(default=32 << 20, ge=1)
    """Largest request body; a larger one gets 413 before it is read whole."""
    idle_timeout: float = Field(default=5.0, gt=0.0)
    """Seconds a kept-alive connection may sit idle between requests before it is closed."""
    header_timeout: float = Field(default=10.0, gt=0.0)
    """Seconds a request's headers may take to arrive (from the connection's start or, kept alive, after
    ``idle_timeout``); a connection that sends nothing or trickles them is closed."""
    allowed_hosts: Annotated[list[str], NoDecode] = Field(default_factory=list)
    """``Host`` names accepted besides ``localhost``/``127.0.0.1``/``::1`` while ``host`` is a loopback address
    (``*``: any); others get 400, so a DNS-rebound web page cannot call the server."""

    _split = field_validator("api_keys", "allowed_hosts", mode="before")(_split_names)
    _home = field_validator("api_key_file")(lambda value: _expand_home(value))


class Settings(BaseSettings):
    """Every setting of a run.  See docs/configuration.md for the YAML form."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, env_nested_delimiter=ENV_NESTED_DELIMITER, extra="forbid", validate_default=True
    )

    model: ModelSettings = Field(default_factory=ModelSettings)
    runtime: RuntimeSettings = Field(default_factory=RuntimeSettings)
    cache: CacheSettings = Field(default_factory=CacheSettings)
    scheduler: SchedulerSettings = Field(default_factory=SchedulerSettings)
    attention: AttentionSettings = Field(default_factory=AttentionSettings)
    sampler: SamplerSettings = Field(default_factory=SamplerSettings)
    speculative: SpeculativeSettings | None = None
    kv_connector: KVConnectorSettings | None = None
    structured_output: StructuredOutputSettings = Field(default_factory=StructuredOutputSettings)
    lora: LoRASettings | None = None
    chat: ChatSettings = Field(default_factory=ChatSettings)
    multimodal: MultimodalSettings = Field(default_factory=MultimodalSettings)
    plugins: PluginPolicy = Field(default_factory=PluginPolicy)
    inputs: InputSettings = Field(default_factory=InputSettings)
    outputs: OutputSettings = Field(default_factory=OutputSettings)
    server: ServerSettings = Field(default_factory=ServerSettings)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # load_settings merges the environment itself (env_overrides), so each variable is named in errors and
        # PATCHBAY_KEY=null can clear a key; reading it again here would undo that.
        return (init_settings,)

    def plugin_choices(self) -> list[PluginChoice]:
        """Every plugin this run names, with its options and the key path of its YAML section."""
        choices = []
        if self.attention.backend != "auto":
            choices.append(
                PluginChoice(
                    "attention",
                    self.attention.backend,
                    self.attention.options,
                    ("attention", "backend"),
                    ("attention", "options"),
                )
            )
        elif self.attention.options:
            choices.append(
                PluginChoice(
                    "attention", "auto", self.attention.options, ("attention", "backend"), ("attention", "options")
                )
            )
        if self.attention.metadata_builder is not None:
            choices.append(
                PluginChoice(
                    "attention_metadata_builder",
                    self.attention.metadata_builder,
                    {},
                    ("attention", "metadata_builder"),
                    None,
                )
            )
        choices.append(
            PluginChoice(
                "sampler",
                self.sampler.name,
                self.sampler.options,
                ("sampler", "name"),
                ("sampler", "options"),
                sampler_role="sample",
            )
        )
        if self.speculative is not None:
            choices.append(
                PluginChoice(
                    "drafter",
                    self.speculative.method,
                    self.speculative.options,
                    ("speculative", "method"),
                    ("speculative", "options"),
                )
            )
            choices.append(
                PluginChoice(
                    "sampler",
                    self.speculative.rejection_sampler,
                    {},
                    ("speculative", "rejection_sampler"),
                    None,
                    sampler_role="verify",
                )
            )
        if self.kv_connector is not None:
            choices.append(
                PluginChoice(
                    "kv_connector",
                    self.kv_connector.name,
                    self.kv_connector.options,
                    ("kv_connector", "name"),
                    ("kv_connector", "options"),
                )
            )
        if "structured_output" in self.model_fields_set:  # the default backend is checked when the engine starts
            choices.append(
                PluginChoice(
                    "structured_output",
                    self.structured_output.backend,
                    self.structured_output.options,
                    ("structured_output", "backend"),
                    ("structured_output", "options"),
                )
            )
        if self.lora is not None:
            choices.append(
                PluginChoice(
                    "lora_kernel",
                    self.lora.kernel,
                    self.lora.kernel_options,
                    ("lora", "kernel"),
                    ("lora", "kernel_options"),
                )
            )
            if self.lora.resolver is not None:
                choices.append(
                    PluginChoice(
                        "lora_resolver",
                        self.lora.resolver,
                        self.lora.resolver_options,
                        ("lora", "resolver"),
                        ("lora", "resolver_options"),
                    )
                )
        if "chat" in self.model_fields_set:  # the default parser is checked when the server starts
            choices.append(
                PluginChoice(
                    "tool_parser",
                    self.chat.tool_parser,
                    self.chat.tool_parser_options,
                    ("chat", "tool_parser"),
                    ("chat", "tool_parser_options"),
                )
            )
            if self.chat.reasoning_parser is not None:
                choices.append(
                    PluginChoice(
                        "reasoning_parser",
                        self.chat.reasoning_parser,
                        self.chat.reasoning_parser_options,
                        ("chat", "reasoning_parser"),
                        ("chat", "reasoning_parser_options"),
                    )
                )
        return choices


@dataclass(frozen=True)
class PluginChoice:
    """A plugin named in settings: kind, name, raw options and where they sit."""

    kind: str
    name: str
    options: Mapping[str, Any]
    name_path: tuple[str, ...]
    options_path: tuple[str, ...] | None
    sampler_role: str | None = None
    """For samplers: ``sample`` (the main sampler) or ``verify`` (speculative decoding's rejection sampler)."""


@dataclass(frozen=True)
class ConfigProblem:
    """One thing wrong with a configuration, with where it came from."""

    source: str
    """The YAML file, ``env PATCHBAY_...`` or ``--set key=value``."""
    path: str
    """Dotted key path, e.g. ``sampler.options.temperature``."""
    message: str
    plugin: str | None = None
    """``KIND:NAME`` of the plugin whose section is at fault."""

    def __str__(self) -> str:
        plugin = f" (plugin {self.plugin})" if self.plugin else ""
        return f"{self.source}: {self.path}{plugin}: {self.message}"


class ConfigError(ValueError):
    """A configuration that cannot run; ``problems`` lists every problem found."""

    def __init__(self, problems: list[ConfigProblem]) -> None:
        self.problems = problems
        super().__init__("invalid configuration:\n" + "\n".join(f"  {problem}" for problem in problems))


SourceLabel = str | Callable[[tuple[str, ...]], str]
"""Where settings came from, for errors: a fixed label, or a function of the key path (one env variable per key)."""


class _Sources:
    """Remembers which source set each key path, to name it in errors."""

    def __init__(self, default: str) -> None:
        self.default = default
        self._by_path: dict[tuple[str, ...], str] = {}

    def mark(self, data: Mapping[str, Any], label: SourceLabel, prefix: tuple[str, ...] = ()) -> None:
        for key, value in data.items():
            path = (*prefix, str(key))
            self._by_path[path] = label if isinstance(label, str) else label(path)
            if isinstance(value, Mapping):
                self.mark(value, label, path)

    def of(self, path: tuple[str, ...]) -> str:
        for end in range(len(path), 0, -1):
            label = self._by_path.get(path[:end])
            if label is not None:
                return label
        return self.default


def _deep_merge(base: dict[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """``override`` over ``base``, mappings merged key by key; a ``None`` (``null``) value clears the key."""
    merged = dict(base)
    for key, value in override.items():
        if value is None:  # --set KEY=null / PATCHBAY_KEY=null: back to the default, a mapping emptied
            merged.pop(key, None)
        elif isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = _deep_merge(dict(merged[key]), value)
        else:
            merged[key] = value
    return merged


def _nest(path: Iterable[str], value: Any) -> dict[str, Any]:
    keys = list(path)
    nested: Any = value
    for key in reversed(keys):
        nested = {key: nested}
    return nested


def read_yaml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a settings YAML file; an unreadable file or a non-mapping top level is a :class:`ConfigError`."""
    source = str(path)
    try:
        data = load_bounded(Path(path).read_text())
    except OSError as exc:
        raise ConfigError([ConfigProblem(source, "<file>", f"cannot read: {exc.strerror or exc}")]) from exc
    except (DocumentTooLarge, UnicodeDecodeError) as exc:
        raise ConfigError([ConfigProblem(source, "<file>", str(exc))]) from None
    except yaml.YAMLError as exc:
        raise ConfigError([ConfigProblem(source, "<file>", f"not valid YAML: {exc}")]) from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            [ConfigProblem(source, "<file>", f"expected a mapping at top level, got {type(data).__name__}")]
        )
    not_names = [key for key in data if not isinstance(key, str)]
    if not_names:
        raise ConfigError(
            [ConfigProblem(source, str(key), "unknown key (section names are strings)") for key in not_names]
        )
    return data


def env_overrides() -> list[tuple[SourceLabel, dict[str, Any]]]:
    """Settings from ``PATCHBAY_*`` environment variables, parsed by pydantic-settings.

    Nested keys are joined by ``__`` (``PATCHBAY_CACHE__NUM_BLOCKS=64``);
    list and mapping values are JSON, except the plugin allow/deny lists,
    which also take comma-separated names.
    """
    try:
        data = EnvSettingsSource(Settings)()
        for section, value in data.items():
            try:
                check_bounds(value)
            except (DocumentTooLarge, RecursionError) as exc:
                variables = sorted(v for v in os.environ if v.upper().startswith(f"{ENV_PREFIX}{section.upper()}"))
                raise ConfigError(
                    [
                        ConfigProblem(
                            f"env {', '.join(variables)}",
                            "<env>",
                            str(exc) if isinstance(exc, DocumentTooLarge) else "nested too deeply",
                        )
                    ]
                ) from None
    except RecursionError:
        raise ConfigError([ConfigProblem("environment", "<env>", "a value nested too deeply")]) from None
    except SettingsError as exc:
        # pydantic-settings names the field ("error parsing value for field "inputs" from source ...").
        field = str(exc).split('"')[1] if '"' in str(exc) else ""
        variables = sorted(v for v in os.environ if v.upper().startswith(f"{ENV_PREFIX}{field.upper()}"))
        label = f"env {', '.join(variables)}" if variables else "environment"
        raise ConfigError([ConfigProblem(label, field or "<env>", f"not valid JSON: {exc.__cause__ or exc}")]) from None
    return [(_env_label, _nulls_cleared(data))] if data else []


def _nulls_cleared(data: Any) -> Any:
    """Environment values are strings: ``null`` (as in ``--set KEY=null``) means clear the key."""
    if isinstance(data, Mapping):
        return {key: _nulls_cleared(value) for key, value in data.items()}
    return None if isinstance(data, str) and data.strip() == "null" else data


def _env_label(path: tuple[str, ...]) -> str:
    return "env " + ENV_PREFIX + ENV_NESTED_DELIMITER.join(path).upper()


def cli_overrides(assignments: Iterable[str]) -> list[tuple[str, dict[str, Any]]]:
    """``key.path=value`` strings (``--set``) as ``(label, nested dict)`` pairs."""
    found = []
    for assignment in assignments:
        key, sep, raw = assignment.partition("=")
        label = f"--set {redact_assignment(key.strip(), raw) if sep else assignment}"
        if not sep or not key.strip():
            raise ConfigError([ConfigProblem(label, key or "<empty>", "expected KEY.PATH=VALUE")])
        try:
            value = _parse_scalar(raw)
        except DocumentTooLarge as exc:
            raise ConfigError([ConfigProblem(label, key.strip(), str(exc))]) from None
        found.append((label, _nest(key.strip().split("."), value)))
    return found


def _parse_scalar(raw: str) -> Any:
    # YAML scalars, so that --set scheduler.max_num_seqs=8 gives an int and --set a.b=[1,2] a list.
    try:
        return load_bounded(raw)
    except yaml.YAMLError:
        return raw


def load_settings(
    path: str | os.PathLike[str] | None = None,
    *,
    overrides: Iterable[str] = (),
    registry: Registry | Callable[[PluginPolicy], Registry] | None = None,
) -> Settings:
    """Load settings from ``path`` (optional), the environment and ``--set`` overrides.

    When ``registry`` is given, every plugin the settings name is looked up
    and its options are validated against the plugin's ``Options`` model.
    ``registry`` may also be a function of the settings' ``plugins:`` policy
    (such as :func:`patchbay.contract.registry.registry_for`), so the YAML's allow
    and deny lists decide what loads.
    Raises :class:`ConfigError` listing every problem found.
    """
    label = str(path) if path is not None else "<defaults>"
    sources = _Sources(label)
    data: dict[str, Any] = {}
    if path is not None:
        data = read_yaml(path)
        sources.mark(data, label)
    for override_label, override in [*env_overrides(), *cli_overrides(overrides)]:
        sources.mark(override, override_label)
        data = _deep_merge(data, override)
    try:
        settings = Settings.model_validate(data)
    except ValidationError as exc:
        raise ConfigError([_problem_from_error(error, sources) for error in exc.errors()]) from None
    if registry is not None:
        if callable(registry):
            registry = registry(settings.plugins)
        problems = validate_plugin_choices(settings, registry, sources)
        if problems:
            raise ConfigError(problems)
    return settings


def _problem_from_error(
    error: Mapping[str, Any], sources: _Sources, prefix: tuple[str, ...] = (), plugin: str | None = None
) -> ConfigProblem:
    loc = (*prefix, *(str(part) for part in error["loc"]))
    message = error["msg"]
    if error["type"] == "extra_forbidden":
        message = "unknown key"
    elif error["type"] == "missing":
        message = "required key is missing"
    elif "input" in error and not isinstance(error["input"], (dict, list)):
        message = f"{message} (got {HIDDEN if is_secret_path(loc) else repr(error['input'])})"
    return ConfigProblem(sources.of(loc), ".".join(loc) or "<root>", message, plugin)


def validate_plugin_choices(
    settings: Settings, registry: Registry, sources: _Sources | None = None
) -> list[ConfigProblem]:
    """Check that every plugin named in ``settings`` exists and that its options are valid."""
    from patchbay.contract.registry import PluginError

    sources = sources or _Sources("<settings>")
    problems: list[ConfigProblem] = []
    for choice in settings.plugin_choices():
        reference = f"{choice.kind}:{choice.name}"
        if choice.name == "auto":
            problems.append(
                ConfigProblem(
                    sources.of(choice.options_path or choice.name_path),
                    ".".join(choice.options_path or choice.name_path),
                    f"options need a named backend, but {'.'.join(choice.name_path)} is 'auto' "
                    f"(from {sources.of(choice.name_path)}), which picks one at run time; clear "
                    f"the options with --set {'.'.join(choice.options_path or choice.name_path)}=null",
                )
            )
            continue
        try:
            implementation = registry.resolve(choice.kind, choice.name)
        except PluginError as exc:
            problems.append(ConfigProblem(sources.of(choice.name_path), ".".join(choice.name_path), str(exc)))
            continue
        if choice.kind == "attention":
            problems.extend(_metadata_builder_problems(settings, implementation, reference, registry, sources))
        role = getattr(implementation.capabilities, "role", None)
        if choice.sampler_role is not None and role != choice.sampler_role:
            problems.append(
                ConfigProblem(
                    sources.of(choice.name_path),
                    ".".join(choice.name_path),
                    f"{reference} is a {role!r} sampler; this key needs a {choice.sampler_role!r} one",
                    reference,
                )
            )
        if choice.options_path is None:
            continue
        try:
            implementation.Options.model_validate(dict(choice.options))
        except ValidationError as exc:
            problems.extend(
                _problem_from_error(error, sources, choice.options_path, reference) for error in exc.errors()
            )
    return problems


def _metadata_builder_problems(
    settings: Settings, backend: Any, reference: str, registry: Registry, sources: _Sources
) -> list[ConfigProblem]:
    """A named backend's metadata builder (its own, or ``attention.metadata_builder``) must be installed too."""
    from patchbay.contract.registry import PluginError

    chosen = settings.attention.metadata_builder
    builder = chosen or getattr(backend, "metadata_builder", None)
    if not builder:
        return [
            ConfigProblem(
                sources.of(("attention", "backend")),
                "attention.backend",
                f"{reference} names no metadata_builder",
                reference,
            )
        ]
    try:
        registry.resolve("attention_metadata_builder", builder)
    except PluginError as exc:
        key = ("attention", "metadata_builder") if chosen else ("attention", "backend")
        whose = "attention.metadata_builder" if chosen else f"{reference}'s metadata builder"
        return [ConfigProblem(sources.of(key), ".".join(key), f"{whose} {builder!r} cannot be used: {exc}", reference)]
    return []


def plugin_options(implementation: type[Plugin], options: Mapping[str, Any], *, where: str) -> BaseModel:
    """Validate ``options`` against ``implementation.Options``; errors name ``where`` (a key path)."""
    try:
        return implementation.Options.model_validate(dict(options))
    except ValidationError as exc:
        sources = _Sources("<settings>")
        raise ConfigError(
            [_problem_from_error(error, sources, tuple(where.split("."))) for error in exc.errors()]
        ) from None


def dump_settings(settings: Settings) -> str:
    """The effective settings as YAML (what ``patchbay config show`` prints), secrets hidden (``***``)."""
    return yaml.safe_dump(redact(settings.model_dump(mode="json")), sort_keys=False)
