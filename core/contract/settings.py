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
from pydantic_settings import BaseSettings, EnvSettingsSource, NoDecode, SettingsConfigDict, SettingsError

from patchbay.contract.redaction import redact
from patchbay.contract.bounded_yaml import DocumentTooLarge, check_bounds, load_bounded

if TYPE_CHECKING:
    from patchbay.contract.registry import Registry

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
    path: str = DEFAULT_MODEL
    """A local Hugging Face model directory, or ``default`` for the bundled SmolLM2-135M-Instruct."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """``auto``: on CPUs the fastest dtype the CPU computes natively (measured, see ``patchbay tune``);
    bfloat16 on GPUs."""
    quantization: Literal["none", "int8", "int4"] = "none"
    """``int8`` (per-row scales) or ``int4`` (per 32-feature group, Q4_1's layout): weight-only integer
    weights for steps of few rows on the CPU, activations in ``dtype``."""
    max_model_len: PositiveInt | None = None
    """Longest prompt + output in tokens; default: the model's own limit."""
    max_logprobs: int = Field(default=20, ge=-1)
    """Most ``logprobs`` / ``prompt_logprobs`` a request may ask for per position; ``-1``: the whole vocabulary."""

    _home = field_validator("path")(lambda value: _expand_home(value))


class RuntimeSettings(Section):
    device: str = "auto"
    """``auto`` (CUDA when available, else CPU), ``cpu``, ``cuda``, ``cuda:1``, ..."""
    threads: PositiveInt | None = None
    """CPU threads for torch; default: all cores."""
    linear_kernel: Literal["auto", "tiles", "onednn", "row_split", "torch"] = "auto"
    """Linear layers on the CPU: ``tiles`` reorders each weight once into output tiles that patchbay's
    own kernel streams on every core (float32 with AVX-512 or AVX2, bfloat16 with AVX512-BF16);
    ``onednn`` packs each weight once into oneDNN's layout (float32, bfloat16); ``row_split`` cuts each float32 weight into one slice per thread for steps of few
    rows; ``torch`` keeps torch's own products; ``auto`` is what the machine's tuning measured
    fastest for the run's dtype."""
    fuse_projections: bool = True
    """Compute the q/k/v projections (and gate/up) of each layer as one matrix product."""
    fused_ops: bool = True
    """Run Llama-style RMS norms and SiLU MLPs (Llama, Mistral, Qwen2) through patchbay's C++ kernels on CPU
    float32 and bfloat16, one pass per row instead of transformers' chain of small ops (built at install, or in
    the background while transformers' own ops serve)."""
    single_thread_max_tokens: NonNegativeInt | Literal["auto"] = "auto"
    """Steps of at most this many tokens run on one CPU thread (0: never); ``auto``: as the machine's
    tuning measured for the run's dtype, 0 without a tuning."""
    seed: int = 0
    tensor_parallel_size: PositiveInt = 1
    """Ranks the model is split over, one process each on this machine (attention heads and MLP columns sharded)."""
    pipeline_parallel_size: PositiveInt = 1
    """Pipeline stages the decoder layers are split over (contiguous layers), one process each on this machine."""
    pipeline_layer_partition: Annotated[list[PositiveInt] | None, NoDecode] = None
    """Decoder layers of each pipeline stage, in stage order (e.g. ``19,11``: the last stage also computes the
    logits); default: an even split, the first stages one more when it does not divide."""
    distributed_backend: Literal["auto", "gloo", "nccl"] = "auto"
    """torch.distributed backend joining the ranks: ``auto`` is NCCL on CUDA, gloo on the CPU."""
    distributed_timeout: PositiveFloat = 300.0
    """Seconds a collective waits for a rank that is alive but silent before the run fails."""
    master_addr: str | None = None
    """Rank 0's address as the other ranks reach it (the store and step channel listen there); default: torchrun's
    ``MASTER_ADDR`` under torchrun, else the loopback interface."""
    master_port: Annotated[int, Field(ge=1, le=65535)] | None = None
    """Port of the run's torch.distributed store; default: torchrun's ``MASTER_PORT`` under torchrun, else a free
    port."""

    _partition = field_validator("pipeline_layer_partition", mode="before")(
        lambda value: _split_names(value) if isinstance(value, str) else value)

    @model_validator(mode="after")
    def _one_partition_per_stage(self) -> RuntimeSettings:
        partition = self.pipeline_layer_partition
        if partition is not None and len(partition) != self.pipeline_parallel_size:
            raise ValueError(f"pipeline_layer_partition gives {len(partition)} stages' layers "
                             f"({','.join(map(str, partition))}); pipeline_parallel_size is {self.pipeline_parallel_size}")
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
    block_size: PositiveInt = 16
    num_blocks: PositiveInt | None = None
    """Size the KV pool by block count ..."""
    memory: Annotated[int | Literal["auto"], BeforeValidator(_byte_size_or_auto)] = "auto"
    """... or by a memory budget (``512MiB``, ``2GB``); ``auto``: what remains of
    ``memory_utilization`` of the device's memory once the model and a measured largest step are counted."""
    memory_utilization: float | None = Field(default=None, gt=0, le=1)
    """The share of the device's memory (the machine's, on the CPU) ``memory: auto`` may fill, model
    included; default 0.9 on a GPU, 0.5 on the CPU (shared with the rest of the machine)."""
    prefix_caching: bool = True

    @model_validator(mode="after")
    def _one_sizing(self) -> CacheSettings:
        if self.num_blocks is not None and self.memory != "auto":
            raise ValueError("give either num_blocks or memory, not both")
        return self


class SchedulerSettings(Section):
    max_num_seqs: PositiveInt = 64
    """Most requests running at once."""
    max_num_batched_tokens: PositiveInt = 2048
    """Token budget of one step (prefill chunks plus decodes)."""
    chunked_prefill: bool = True
    """Split long prompts across steps; when off, a prompt must fit the token budget whole."""


class AttentionSettings(Section):
    backend: str = "auto"
    """A registered attention backend, or ``auto`` to pick by capabilities."""
    metadata_builder: str | None = None
    """Override the backend's own metadata builder (rarely needed)."""
    options: dict[str, Any] = Field(default_factory=dict)


class SamplerSettings(Section):
    name: str = "standard"
    options: dict[str, Any] = Field(default_factory=dict)


class SpeculativeSettings(Section):
    method: str
    """A registered drafter (``ngram``, ``eagle``, ``medusa``, ...)."""
    num_speculative_tokens: PositiveInt = 3
    rejection_sampler: str = "rejection"
    options: dict[str, Any] = Field(default_factory=dict)


class KVConnectorSettings(Section):
    name: str
    role: Literal["both", "producer", "consumer"] = "both"
    options: dict[str, Any] = Field(default_factory=dict)
    stall_timeout: PositiveFloat = 60.0
    """Seconds the engine waits on requests only the connector holds before it fails the run naming them."""


class StructuredOutputSettings(Section):
    backend: str = "xgrammar"
    """The grammar backend that compiles requests' ``structured_output`` constraints (``xgrammar``, ``llguidance``, ...)."""
    options: dict[str, Any] = Field(default_factory=dict)


class ChatSettings(Section):
    """Chat prompts and answers: the template that renders messages and tools, the parsers that read answers."""

    template: Path | None = None
    """A Jinja chat-template file used instead of the tokenizer's; default: the tokenizer's (for the bundled
    model, patchbay's copy of it with a tools section)."""
    tool_parser: str = "hermes"
    """The tool-call parser that reads calls out of answers to requests offering ``tools`` (``tool_choice: auto``)."""
    tool_parser_options: dict[str, Any] = Field(default_factory=dict)
    reasoning_parser: str | None = None
    """A reasoning parser (``think``) that splits answers into ``reasoning_content`` and ``content``; default: none."""
    reasoning_parser_options: dict[str, Any] = Field(default_factory=dict)

    _home = field_validator("template")(lambda value: _expand_home(value))

    @field_validator("template")
    @classmethod
    def _template_exists(cls, value: Path | None) -> Path | None:
        if value is not None and not value.is_file():
            raise ValueError(f"no chat template file at {value}")
        return value


def _split_names(value: Any) -> Any:
    if isinstance(value, str) and value.lstrip().startswith("["):
        return json.loads(value)
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    return value


class PluginPolicy(Section):
    strict: bool = False
    """Any plugin that fails to load is an error instead of a report."""
    allow: Annotated[list[str], NoDecode] = Field(default_factory=list)
    """If non-empty, only these plugins (entry-point or distribution names, or ``KIND:NAME``) load."""
    deny: Annotated[list[str], NoDecode] = Field(default_factory=list)
    """These plugins never load (a comma-separated string is accepted, handy in env vars)."""

    _split = field_validator("allow", "deny", mode="before")(_split_names)


class InputSettings(Section):
    prompts: list[str | dict[str, Any]] = Field(default_factory=list)
    """Inline prompts: strings, or objects with ``prompt`` / ``messages`` and per-request sampling parameters."""
    file: Path | None = None
    """A JSONL file of requests, one object per line, same shape as inline objects."""
    chat_template: bool = True
    """Send plain string prompts as a user message through the tokenizer's chat template (an error if it has none)."""
    sampling: dict[str, Any] = Field(default_factory=dict)
    """Default sampling parameters for every request (``max_tokens``, ``stop``, ...)."""

    _home = field_validator("file")(lambda value: _expand_home(value))


class OutputSettings(Section):
    path: Path | None = None
    """Where ``patchbay run`` writes JSONL results; default: not written."""
    progress: bool = True

    _home = field_validator("path")(lambda value: _expand_home(value))


class ServerSettings(Section):
    """``patchbay serve``: where it listens, who may call it, how much it queues."""

    host: str = "127.0.0.1"
    """Address to listen on (``0.0.0.0`` for every interface)."""
    port: int = Field(default=8000, ge=0, le=65535)
    """TCP port (0: any free port, printed at start)."""
    api_keys: Annotated[list[str], NoDecode] = Field(default_factory=list)
    """Accepted ``Authorization: Bearer`` keys; empty: no key needed.  A comma-separated string is accepted."""
    served_model_name: str | None = None
    """The model name clients send; default: the model directory's name."""
    max_waiting: int = Field(default=256, ge=0)
    """Sequences admitted beyond ``scheduler.max_num_seqs``; a request over the limit gets 503, never an unbounded queue."""
    shutdown_grace_period: float = Field(default=30.0, ge=0.0)
    """Seconds after SIGTERM during which requests in flight may finish; the rest are aborted."""
    log_requests: bool = False
    """Log one line per HTTP request (uvicorn's access log)."""

    _split = field_validator("api_keys", mode="before")(_split_names)


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
    chat: ChatSettings = Field(default_factory=ChatSettings)
    plugins: PluginPolicy = Field(default_factory=PluginPolicy)
    inputs: InputSettings = Field(default_factory=InputSettings)
    outputs: OutputSettings = Field(default_factory=OutputSettings)
    server: ServerSettings = Field(default_factory=ServerSettings)

    @classmethod
    def settings_customise_sources(cls, settings_cls: type[BaseSettings], init_settings: Any,
                                   **other_sources: Any) -> tuple:
        # load_settings merges the environment itself (env_overrides), so each variable is named in errors and
        # PATCHBAY_KEY=null can clear a key; reading it again here would undo that.
        return (init_settings,)

    def plugin_choices(self) -> list[PluginChoice]:
        """Every plugin this run names, with its options and the key path of its YAML section."""
        choices = []
        if self.attention.backend != "auto":
            choices.append(PluginChoice("attention", self.attention.backend, self.attention.options,
                                        ("attention", "backend"), ("attention", "options")))
        elif self.attention.options:
            choices.append(PluginChoice("attention", "auto", self.attention.options,
                                        ("attention", "backend"), ("attention", "options")))
        if self.attention.metadata_builder is not None:
            choices.append(PluginChoice("attention_metadata_builder", self.attention.metadata_builder, {},
                                        ("attention", "metadata_builder"), None))
        choices.append(PluginChoice("sampler", self.sampler.name, self.sampler.options,
                                    ("sampler", "name"), ("sampler", "options"), sampler_role="sample"))
        if self.speculative is not None:
            choices.append(PluginChoice("drafter", self.speculative.method, self.speculative.options,
                                        ("speculative", "method"), ("speculative", "options")))
            choices.append(PluginChoice("sampler", self.speculative.rejection_sampler, {},
                                        ("speculative", "rejection_sampler"), None, sampler_role="verify"))
        if self.kv_connector is not None:
            choices.append(PluginChoice("kv_connector", self.kv_connector.name, self.kv_connector.options,
                                        ("kv_connector", "name"), ("kv_connector", "options")))
        if "structured_output" in self.model_fields_set:  # the default backend is checked when the engine starts
            choices.append(PluginChoice("structured_output", self.structured_output.backend,
                                        self.structured_output.options, ("structured_output", "backend"),
                                        ("structured_output", "options")))
        if "chat" in self.model_fields_set:  # the default parser is checked when the server starts
            choices.append(PluginChoice("tool_parser", self.chat.tool_parser, self.chat.tool_parser_options,
                                        ("chat", "tool_parser"), ("chat", "tool_parser_options")))
            if self.chat.reasoning_parser is not None:
                choices.append(PluginChoice("reasoning_parser", self.chat.reasoning_parser,
                                            self.chat.reasoning_parser_options, ("chat", "reasoning_parser"),
                                            ("chat", "reasoning_parser_options")))
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


class _Sources:
    """Remembers which source set each key path, to name it in errors."""

    def __init__(self, default: str) -> None:
        self.default = default
        self._by_path: dict[tuple[str, ...], str] = {}

    def mark(self, data: Mapping[str, Any], label: str | Callable[[tuple[str, ...]], str],
             prefix: tuple[str, ...] = ()) -> None:
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
        raise ConfigError([ConfigProblem(source, "<file>", f"expected a mapping at top level, got {type(data).__name__}")])
    not_names = [key for key in data if not isinstance(key, str)]
    if not_names:
        raise ConfigError([ConfigProblem(source, str(key), "unknown key (section names are strings)")
                           for key in not_names])
    return data


def env_overrides() -> list[tuple[str, dict[str, Any]]]:
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
                raise ConfigError([ConfigProblem(f"env {', '.join(variables)}", "<env>", str(exc) if isinstance(
                    exc, DocumentTooLarge) else "nested too deeply")]) from None
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
        label = f"--set {assignment}"
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


def _problem_from_error(error: Mapping[str, Any], sources: _Sources, prefix: tuple[str, ...] = (),
                        plugin: str | None = None) -> ConfigProblem:
    loc = (*prefix, *(str(part) for part in error["loc"]))
    message = error["msg"]
    if error["type"] == "extra_forbidden":
        message = "unknown key"
    elif error["type"] == "missing":
        message = "required key is missing"
    elif "input" in error and not isinstance(error["input"], (dict, list)):
        message = f"{message} (got {error['input']!r})"
    return ConfigProblem(sources.of(loc), ".".join(loc) or "<root>", message, plugin)


def validate_plugin_choices(settings: Settings, registry: Registry, sources: _Sources | None = None) -> list[ConfigProblem]:
    """Check that every plugin named in ``settings`` exists and that its options are valid."""
    from patchbay.contract.registry import PluginError

    sources = sources or _Sources("<settings>")
    problems: list[ConfigProblem] = []
    for choice in settings.plugin_choices():
        reference = f"{choice.kind}:{choice.name}"
        if choice.name == "auto":
            problems.append(ConfigProblem(sources.of(choice.options_path or choice.name_path),
                                          ".".join(choice.options_path or choice.name_path),
                                          f"options need a named backend, but {'.'.join(choice.name_path)} is 'auto' "
                                          f"(from {sources.of(choice.name_path)}), which picks one at run time; clear "
                                          f"the options with --set {'.'.join(choice.options_path or choice.name_path)}=null"))
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
            problems.append(ConfigProblem(sources.of(choice.name_path), ".".join(choice.name_path),
                                          f"{reference} is a {role!r} sampler; this key needs a {choice.sampler_role!r} one",
                                          reference))
        if choice.options_path is None:
            continue
        try:
            implementation.Options.model_validate(dict(choice.options))
        except ValidationError as exc:
            problems.extend(_problem_from_error(error, sources, choice.options_path, reference) for error in exc.errors())
    return problems


def _metadata_builder_problems(settings: Settings, backend: Any, reference: str, registry: Registry,
                               sources: _Sources) -> list[ConfigProblem]:
    """A named backend's metadata builder (its own, or ``attention.metadata_builder``) must be installed too."""
    from patchbay.contract.registry import PluginError

    chosen = settings.attention.metadata_builder
    builder = chosen or getattr(backend, "metadata_builder", None)
    if not builder:
        return [ConfigProblem(sources.of(("attention", "backend")), "attention.backend",
                              f"{reference} names no metadata_builder", reference)]
    try:
        registry.resolve("attention_metadata_builder", builder)
    except PluginError as exc:
        key = ("attention", "metadata_builder") if chosen else ("attention", "backend")
        whose = "attention.metadata_builder" if chosen else f"{reference}'s metadata builder"
        return [ConfigProblem(sources.of(key), ".".join(key), f"{whose} {builder!r} cannot be used: {exc}", reference)]
    return []


def plugin_options(implementation: type, options: Mapping[str, Any], *, where: str) -> BaseModel:
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
