"""Typed flags of ``patchbay serve``, ``run`` and ``chat``, generated from the settings models.

:data:`FLAGS` is the one table: each flag names the settings key it sets and the commands that take it.
Its type, choices, default and help come from that key's pydantic field (annotation and docstring), and
``--help`` ends each flag's line with the key.  Given values reach :func:`~patchbay.contract.settings.load_settings`
as a source of their own, after the YAML file and the environment and before ``--set``, labelled with the
flag, so an error names the flag (``--max-model-len 0: model.max_model_len: ...``).

``MODEL`` (a model directory, a ``.gguf`` file or ``default``) is ``model.path``; a ``.yaml`` file in its
place is read as the settings file, as ``patchbay serve CONFIG.yaml`` always did.
"""

from __future__ import annotations

import argparse
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from patchbay.contract.settings import DEFAULT_MODEL, ConfigError, ConfigProblem, Settings

Command = Literal["serve", "run", "chat"]
ENGINE: tuple[Command, ...] = ("serve", "run", "chat")
"""The commands that load an engine (every flag of the model, runtime, cache and scheduler)."""

FlagKind = Literal["value", "list", "switch", "section", "named_paths"]


@dataclass(frozen=True)
class Flag:
    """One typed flag: ``--max-model-len`` sets ``model.max_model_len``."""

    name: str
    key: str
    commands: tuple[Command, ...] = ENGINE
    kind: FlagKind = "value"
    """``value``: one value of the field's type; ``list``: the flag repeated, values collected (``--api-key``);
    ``switch``: a boolean field as ``--x`` / ``--no-x``; ``section``: a switch that gives the section with its
    defaults (``--enable-lora``); ``named_paths``: ``NAME=PATH`` pairs into a mapping (``--lora-modules``)."""
    secret: bool = False
    """The value is hidden in error labels (``--api-key ***``)."""


FLAGS: tuple[Flag, ...] = (
    Flag("--model", "model.path", ("run",)),
    Flag("--host", "server.host", ("serve",)),
    Flag("--port", "server.port", ("serve",)),
    Flag("--api-key", "server.api_keys", ("serve",), kind="list", secret=True),
    Flag("--served-model-name", "server.served_model_name", ("serve",)),
    Flag("--max-model-len", "model.max_model_len"),
    Flag("--dtype", "model.dtype"),
    Flag("--quantization", "model.weight_format"),
    Flag("--kv-cache-dtype", "cache.dtype"),
    Flag("--kv-cache-memory", "cache.memory"),
    Flag("--block-size", "cache.block_size"),
    Flag("--enable-prefix-caching", "cache.prefix_caching", kind="switch"),
    Flag("--max-num-seqs", "scheduler.max_num_seqs"),
    Flag("--max-num-batched-tokens", "scheduler.max_num_batched_tokens"),
    Flag("--device", "runtime.device"),
    Flag("--threads", "runtime.threads"),
    Flag("--seed", "runtime.seed"),
    Flag("--tensor-parallel-size", "runtime.tensor_parallel_size"),
    Flag("--pipeline-parallel-size", "runtime.pipeline_parallel_size"),
    Flag("--data-parallel-size", "runtime.data_parallel_size", ("serve",)),
    Flag("--enable-lora", "lora", kind="section"),
    Flag("--lora-modules", "lora.adapters", kind="named_paths"),
    Flag("--chat-template", "chat.template"),
    Flag("--tool-call-parser", "chat.tool_parser", ("serve", "run")),
    Flag("--reasoning-parser", "chat.reasoning_parser"),
)
"""Every typed flag, in ``--help`` order: the names vLLM users type, each onto one settings key."""


# -- reading the settings models ------------------------------------------------------------------------------


def _model_class(annotation: Any) -> type[BaseModel] | None:
    """The settings model an annotation holds (``LoRASettings | None`` -> ``LoRASettings``)."""
    for candidate in (annotation, *typing.get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def settings_field(key: str) -> FieldInfo:
    """The pydantic field of a dotted settings key (``model.max_model_len``); a :class:`KeyError` naming the
    key's first unknown part if there is none."""
    model: type[BaseModel] | None = Settings
    field: FieldInfo | None = None
    for part in key.split("."):
        if model is None or part not in model.model_fields:
            raise KeyError(f"{key}: no settings key {part!r} there")
        field = model.model_fields[part]
        model = _model_class(field.annotation)
    assert field is not None  # a key has at least one part
    return field


def _plain(annotation: Any) -> list[Any]:
    """The alternatives of an annotation, ``Annotated`` and ``None`` taken away (``int | None`` -> ``[int]``)."""
    if typing.get_origin(annotation) is typing.Annotated:
        return _plain(typing.get_args(annotation)[0])
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return [alt for arg in typing.get_args(annotation) for alt in _plain(arg) if alt is not type(None)]
    return [annotation]


def _value_type(flag: Flag, field: FieldInfo) -> tuple[Any, list[str] | None, str | None]:
    """The argparse ``type``, ``choices`` and metavar of a field's values."""
    alternatives = _plain(field.annotation)
    if len(alternatives) == 1 and typing.get_origin(alternatives[0]) is Literal:
        return str, [str(choice) for choice in typing.get_args(alternatives[0])], None
    if alternatives == [int]:
        return int, None, "N"
    if alternatives == [float]:
        return float, None, "X"
    if alternatives == [Path]:
        return str, None, "PATH"
    # A string, a plugin's name, or a mixed type its validator parses (``2GiB`` or ``auto``).
    return str, None, _metavar(flag)


def _metavar(flag: Flag) -> str:
    """``--served-model-name`` -> ``SERVED_MODEL_NAME``."""
    return flag.name.lstrip("-").replace("-", "_").upper()


def _first_sentence(text: str) -> str:
    """The first sentence of a docstring, on one line, without reStructuredText's double backquotes."""
    text = " ".join(text.replace("``", "").split())
    end = text.find(". ")
    return text if end < 0 else text[: end + 1]


def _help(flag: Flag, field: FieldInfo) -> str:
    doc = _first_sentence(field.description or "").replace("%", "%%")
    default = field.default
    shown = ""
    if flag.kind in ("value", "switch") and isinstance(default, (int, float, str)) and default is not PydanticUndefined:
        shown = f"; default {default}"
    return f"{doc} [{flag.key}{shown}]".strip()


def flag_usage(flag: Flag) -> str:
    """How ``--help`` shows a flag's use: ``--max-model-len N``, ``--dtype {auto,float32,...}``."""
    if flag.kind == "switch":
        return f"{flag.name}, --no-{flag.name.removeprefix('--')}"
    if flag.kind == "section":
        return flag.name
    if flag.kind == "named_paths":
        return f"{flag.name} NAME=PATH ..."
    if flag.kind == "list":
        return f"{flag.name} {_metavar(flag)}"
    _, choices, metavar = _value_type(flag, settings_field(flag.key))
    return f"{flag.name} {{{','.join(choices)}}}" if choices else f"{flag.name} {metavar}"


def _dest(flag: Flag) -> str:
    return "flag_" + flag.name.lstrip("-").replace("-", "_")


def add_flags(parser: argparse.ArgumentParser, command: Command) -> None:
    """Add the typed flags of ``command`` to its parser, in a group of their own."""
    group = parser.add_argument_group("settings (each flag sets the key in brackets; --set sets any key)")
    for flag in FLAGS:
        if command not in flag.commands:
            continue
        field = settings_field(flag.key)
        dest = _dest(flag)
        if flag.kind == "switch":
            group.add_argument(flag.name, dest=dest, action=argparse.BooleanOptionalAction, help=_help(flag, field))
        elif flag.kind == "section":
            doc = _first_sentence((_model_class(field.annotation) or BaseModel).__doc__ or "")
            group.add_argument(flag.name, dest=dest, action="store_true", help=f"{doc} [{flag.key}: with defaults]")
        elif flag.kind == "named_paths":
            group.add_argument(
                flag.name,
                dest=dest,
                nargs="+",
                metavar="NAME=PATH",
                help=f"{_help(flag, field)} (implies --enable-lora)",
            )
        elif flag.kind == "list":
            group.add_argument(
                flag.name, dest=dest, action="append", metavar=_metavar(flag), help=f"{_help(flag, field)} (repeatable)"
            )
        else:
            value_type, choices, metavar = _value_type(flag, field)
            group.add_argument(
                flag.name, dest=dest, type=value_type, choices=choices, metavar=metavar, help=_help(flag, field)
            )


# -- from parsed arguments to settings -----------------------------------------------------------------------


def _nest(key: str, value: Any) -> dict[str, Any]:
    nested: Any = value
    for part in reversed(key.split(".")):
        nested = {part: nested}
    return nested


def _named_paths(flag: Flag, pairs: list[str]) -> dict[str, str]:
    found: dict[str, str] = {}
    for pair in pairs:
        name, sep, path = pair.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ConfigError([ConfigProblem(f"{flag.name} {pair}", flag.key, "expected NAME=PATH")])
        found[name.strip()] = path.strip()
    return found


def flag_sources(args: argparse.Namespace) -> list[tuple[str, Mapping[str, Any]]]:
    """The typed flags given on the command line as ``(label, nested settings)`` sources, in table order."""
    sources: list[tuple[str, Mapping[str, Any]]] = []
    for flag in FLAGS:
        value = getattr(args, _dest(flag), None)
        if value is None or (flag.kind == "section" and not value):
            continue
        if flag.kind == "section":
            sources.append((flag.name, _nest(flag.key, {})))
            continue
        if flag.kind == "named_paths":
            value = _named_paths(flag, value)
        shown = "***" if flag.secret else (" ".join(value) if isinstance(value, list) else value)
        if flag.kind == "switch":
            label = flag.name if value else f"--no-{flag.name.removeprefix('--')}"
        else:
            label = f"{flag.name} {shown}"
        sources.append((label, _nest(flag.key, value)))
    return sources


SETTINGS_SUFFIXES = (".yaml", ".yml")


def model_argument(model: str | None, config: str | None) -> tuple[str | None, list[tuple[str, Mapping[str, Any]]]]:
    """The settings file and the ``model.path`` source that ``MODEL`` and ``--config`` give.

    ``MODEL`` is a model directory, a ``.gguf`` file or ``default`` (the bundled model); a ``.yaml`` file there
    is the settings file (``patchbay serve job.yaml``).  Anything else is a :class:`ConfigError` naming it.
    """
    if model is None:
        return config, []
    path = Path(model).expanduser()
    if path.suffix in SETTINGS_SUFFIXES:
        if config is not None:
            raise ConfigError(
                [ConfigProblem(f"MODEL {model}", "<file>", f"a settings file, but --config {config} gives one too")]
            )
        return model, []
    if model != DEFAULT_MODEL:
        problem = None
        if not path.exists():
            problem = "no such file or directory"
        elif path.is_file() and path.suffix != ".gguf":
            problem = "a file that is neither a .gguf model nor a .yaml settings file"
        elif path.is_dir() and not (path / "config.json").is_file():
            problem = "a directory without config.json (not a Hugging Face model)"
        if problem:
            raise ConfigError(
                [
                    ConfigProblem(
                        f"MODEL {model}",
                        "model.path",
                        f"{problem}; give a Hugging Face model directory, a .gguf file, 'default' (the bundled "
                        "SmolLM2-135M-Instruct) or a settings .yaml file (models are never downloaded)",
                    )
                ]
            )
    return config, [(f"MODEL {model}", {"model": {"path": model}})]
