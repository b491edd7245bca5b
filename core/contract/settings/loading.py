"""Loading the whole run's settings: the :class:`Settings` model of every section, read from YAML, environment
variables and ``--set`` overrides, with each plugin's options checked against its ``Options`` model."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from pydantic import BaseModel, Field, ValidationError, model_validator
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
)

from patchbay.contract.bounded_yaml import DocumentTooLarge, check_bounds, load_bounded
from patchbay.contract.kinds import KINDS
from patchbay.contract.redaction import HIDDEN, is_secret_path, redact, redact_assignment
from patchbay.contract.settings.engine_sections import (
    CacheSettings,
    KVEventsSettings,
    ModelSettings,
    RuntimeSettings,
    SchedulerSettings,
)
from patchbay.contract.settings.job_sections import (
    InputSettings,
    MultimodalSettings,
    OutputSettings,
    RouterSettings,
    ServerSettings,
)
from patchbay.contract.settings.plugin_sections import (
    AttentionSettings,
    ChatSettings,
    KVConnectorSettings,
    LoRASettings,
    PluginPolicy,
    PoolingSettings,
    SamplerSettings,
    SpecDecodeSettings,
    StructuredOutputSettings,
)
from patchbay.contract.settings.sections import renamed_keys

if TYPE_CHECKING:
    from patchbay.contract.registry import Registry
    from patchbay.interfaces.base import Plugin

ENV_PREFIX = "PATCHBAY_"
ENV_NESTED_DELIMITER = "__"


class Settings(BaseSettings):
    """Every setting of a run.  See docs/configuration.md for the YAML form."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, env_nested_delimiter=ENV_NESTED_DELIMITER, extra="forbid", validate_default=True
    )

    model: ModelSettings = Field(default_factory=ModelSettings)
    runtime: RuntimeSettings = Field(default_factory=RuntimeSettings)
    cache: CacheSettings = Field(default_factory=CacheSettings)
    kv_events: KVEventsSettings = Field(default_factory=KVEventsSettings)
    scheduler: SchedulerSettings = Field(default_factory=SchedulerSettings)
    attention: AttentionSettings = Field(default_factory=AttentionSettings)
    sampler: SamplerSettings = Field(default_factory=SamplerSettings)
    spec_decode: SpecDecodeSettings | None = None
    kv_connector: KVConnectorSettings | None = None
    structured_output: StructuredOutputSettings = Field(default_factory=StructuredOutputSettings)
    lora: LoRASettings | None = None
    pooling: PoolingSettings | None = None
    chat: ChatSettings = Field(default_factory=ChatSettings)
    multimodal: MultimodalSettings = Field(default_factory=MultimodalSettings)
    plugins: PluginPolicy = Field(default_factory=PluginPolicy)
    inputs: InputSettings = Field(default_factory=InputSettings)
    outputs: OutputSettings = Field(default_factory=OutputSettings)
    server: ServerSettings = Field(default_factory=ServerSettings)
    router: RouterSettings = Field(default_factory=RouterSettings)

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

    @model_validator(mode="before")
    @classmethod
    def _renamed_sections(cls, data: Any) -> Any:
        return renamed_keys(data, "", {"speculative": "spec_decode"})

    def plugin_choices(self) -> list[ChosenPlugin]:
        """Every plugin this run names, with its options and the key paths of its name and options: one entry per
        :class:`~patchbay.contract.kinds.ChoiceSite` of :data:`~patchbay.contract.kinds.KINDS` whose section is
        given (or whose default is checked regardless), ``auto`` attention backends left out unless given
        options (which need a named backend)."""
        found = []
        for kind in KINDS.values():
            for site in kind.choices:
                section, *key = site.path
                if section not in self.model_fields_set and not site.checked_by_default:
                    continue
                choice = getattr(self, section)
                for part in key:
                    choice = getattr(choice, part, None) if choice is not None else None
                if choice is None:
                    continue
                name, options = choice.name, choice.options
                if name == "auto" and not options:
                    continue
                found.append(
                    ChosenPlugin(kind.name, name, options, (*site.path, "name"), (*site.path, "options"), site.role)
                )
        return found


@dataclass(frozen=True)
class ChosenPlugin:
    """A plugin named in settings: kind, name, raw options and where they sit."""

    kind: str
    name: str
    options: Mapping[str, Any]
    name_path: tuple[str, ...]
    options_path: tuple[str, ...]
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
    flags: Iterable[tuple[str, Mapping[str, Any]]] = (),
    registry: Registry | Callable[[PluginPolicy], Registry] | None = None,
) -> Settings:
    """Load settings from ``path`` (optional), the environment, typed command-line ``flags`` and ``--set``
    overrides, in that order of precedence (the last wins).

    ``flags`` are ``(label, nested mapping)`` pairs, such as ``("--port 9000", {"server": {"port": 9000}})``;
    an error in one names its label (:mod:`patchbay.entrypoints.cli_flags` makes them).
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
    for override_label, override in [*env_overrides(), *flags, *cli_overrides(overrides)]:
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
                    sources.of(choice.options_path),
                    ".".join(choice.options_path),
                    f"options need a named backend, but {'.'.join(choice.name_path)} is 'auto' "
                    f"(from {sources.of(choice.name_path)}), which picks one at run time; clear "
                    f"the options with --set {'.'.join(choice.options_path)}=null",
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
    """A named backend's own metadata builder must be installed too (one chosen in ``attention.metadata_builder``
    is checked as a choice of its own)."""
    from patchbay.contract.registry import PluginError

    if settings.attention.metadata_builder is not None:
        return []
    builder = getattr(backend, "metadata_builder", None)
    key = ("attention", "name")
    if not builder:
        return [ConfigProblem(sources.of(key), ".".join(key), f"{reference} names no metadata_builder", reference)]
    try:
        registry.resolve("attention_metadata_builder", builder)
    except PluginError as exc:
        return [
            ConfigProblem(
                sources.of(key),
                ".".join(key),
                f"{reference}'s metadata builder {builder!r} cannot be used: {exc}",
                reference,
            )
        ]
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
