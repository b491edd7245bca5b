"""A pooling engine's choices: its pooler (``pooling.name: auto`` read from the model's sentence-transformers files
or its classification head), the settings it cannot combine with, and the length its model's files allow.

sentence-transformers describes a pooling model as data beside the weights: ``modules.json`` lists its modules
(the transformer, a ``Pooling`` module whose ``config.json`` names the pooling mode, maybe ``Normalize``), and
``sentence_bert_config.json`` its ``max_seq_length``.  ``auto`` reads them rather than guessing; a module patchbay
does not run (a ``Dense`` projection, say) is an error naming it, never skipped.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from patchbay.contract.settings import ConfigError, ConfigProblem, Settings
from patchbay.sampling_params import SamplingParams

POOLING_SAMPLING = SamplingParams(max_tokens=1, temperature=0.0)
"""The sampling parameters every pooling request carries: the batch's rows need some, and nothing is sampled."""

_MODES = {"mean": "mean", "cls": "cls", "lasttoken": "last"}
"""sentence-transformers' pooling modes patchbay's built-in poolers compute, to the pooler's name."""
_MODE_FLAGS = ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens", "weightedmean_tokens", "lasttoken")
"""The modes as older releases write them: one ``pooling_mode_FLAG: true`` each (``cls_token`` is ``cls``,
``mean_tokens`` ``mean``)."""
_MODULES = ("Transformer", "Pooling", "Normalize")
"""The module classes patchbay runs, by name (``sentence_transformers.models.Pooling`` in older releases,
``sentence_transformers.sentence_transformer.modules.pooling.Pooling`` in newer ones)."""


@dataclass(frozen=True)
class PoolingRun:
    """What a pooling engine checks its requests against."""

    task: str
    """What every request of the run gets: ``embed``, ``classify`` or ``score``."""
    pooler_name: str
    hidden_size: int
    """Features of the model's hidden states: the most ``dimensions`` an embedding request may keep."""
    whole_prompt: bool
    """The pooler reads more than the last position: requests never start from a prefix-cache hit."""
    type_vocab_size: int | None
    """Token types the model embeds (``None``: it takes none); a request's token types must be below it."""


@dataclass(frozen=True)
class PoolerChoice:
    """The pooler a run uses: its registered name, its raw options and where the choice came from."""

    name: str
    options: dict[str, Any]
    source: str
    """``pooling.name`` when named in the settings, else the file ``auto`` read (or the head it found)."""


def choose_pooler(settings: Settings, model_dir: Path, architecture: str, num_labels: int | None) -> PoolerChoice:
    """``pooling.name`` and its options, with ``auto`` resolved from ``model_dir``'s files or its head."""
    section = settings.pooling
    assert section is not None, "only a pooling run chooses a pooler"
    if section.name != "auto":
        return PoolerChoice(section.name, dict(section.options), "pooling.name")
    found = sentence_transformers_pooler(model_dir)
    if found is not None:
        return found
    if num_labels is not None:
        name = "score" if num_labels == 1 else "classify"
        return PoolerChoice(name, {}, f"{architecture}'s classification head ({num_labels} labels)")
    raise ConfigError(
        [
            ConfigProblem(
                "<run>",
                "pooling.name",
                f"auto: {model_dir} has no sentence-transformers modules.json and {architecture} no classification "
                "head, so nothing says how to pool it; name a pooler (mean, cls, last)",
            )
        ]
    )


def sentence_transformers_pooler(model_dir: Path) -> PoolerChoice | None:
    """The pooler ``modules.json`` describes (``None`` without that file); a module or mode patchbay does not run
    is a :class:`ConfigError` naming it."""
    modules_file = model_dir / "modules.json"
    if not modules_file.is_file():
        return None
    modules = _read_json(modules_file)
    if not isinstance(modules, list) or not all(isinstance(module, dict) for module in modules):
        raise _problem(modules_file, "expected a list of modules, each an object with type and path")
    kinds = [_module_class(module.get("type")) for module in modules]
    unsupported = [str(module.get("type")) for module, kind in zip(modules, kinds, strict=True) if kind is None]
    if unsupported:
        raise _problem(
            modules_file, f"module {unsupported[0]} is not run by patchbay (only Transformer, Pooling and Normalize)"
        )
    pooling = [module for module, kind in zip(modules, kinds, strict=True) if kind == "Pooling"]
    if len(pooling) != 1:
        raise _problem(modules_file, f"expected one Pooling module, found {len(pooling)}")
    config_file = model_dir / str(pooling[0].get("path", "")) / "config.json"
    if not config_file.is_file():
        raise _problem(config_file, "the Pooling module's config.json is missing")
    config = _read_json(config_file)
    if not isinstance(config, dict):
        raise _problem(config_file, "expected an object")
    modes = _pooling_modes(config)
    if len(modes) != 1 or modes[0] not in _MODES:
        raise _problem(
            config_file, f"pooling modes {modes or 'none'}: patchbay pools with exactly one of {', '.join(_MODES)}"
        )
    if config.get("include_prompt") is False:
        raise _problem(config_file, "include_prompt false (instruction tokens left out of the mean) is not supported")
    return PoolerChoice(_MODES[modes[0]], {"normalize": "Normalize" in kinds}, str(config_file))


def _module_class(kind: Any) -> str | None:
    """``Pooling`` for a sentence-transformers Pooling module's type, and so on; ``None`` for one patchbay does not
    run."""
    if not isinstance(kind, str) or not kind.startswith("sentence_transformers."):
        return None
    name = kind.rsplit(".", 1)[-1]
    return name if name in _MODULES else None


def _pooling_modes(config: dict[str, Any]) -> list[str]:
    """The modes a Pooling config turns on: ``pooling_mode: mean`` (newer releases) or ``pooling_mode_mean_tokens:
    true`` (older ones)."""
    mode = config.get("pooling_mode")
    if isinstance(mode, str):
        return [mode]
    short = {"cls_token": "cls", "mean_tokens": "mean"}
    return [short.get(flag, flag) for flag in _MODE_FLAGS if config.get(f"pooling_mode_{flag}")]


def max_seq_length(model_dir: Path) -> int | None:
    """``sentence_bert_config.json``'s ``max_seq_length``: sentence-transformers cuts longer inputs; patchbay
    refuses them, naming the input (``None``: no such file or key)."""
    path = model_dir / "sentence_bert_config.json"
    if not path.is_file():
        return None
    value = _read_json(path)
    length = value.get("max_seq_length") if isinstance(value, dict) else None
    return int(length) if isinstance(length, int) and length > 0 else None


def check_pooling_settings(settings: Settings) -> None:
    """Refuse what a pooling run cannot combine with, every problem at once."""
    if settings.pooling is None:
        return
    problems = []
    why = "a pooling engine samples nothing"
    for section, reason in (
        ("spec_decode", f"speculative decoding drafts tokens, and {why}"),
        ("lora", "LoRA adapters are not applied to pooling models yet"),
        ("kv_connector", "KV connectors move generation's prompt blocks; pooling models are not served by them yet"),
    ):
        if getattr(settings, section) is not None:
            problems.append(ConfigProblem("<run>", section, f"{reason}; remove the {section} section or pooling"))
    if settings.runtime.world_size > 1:
        problems.append(
            ConfigProblem(
                "<run>",
                "runtime.tensor_parallel_size",
                "a pooling model runs in one process; set tensor_parallel_size and pipeline_parallel_size to 1",
            )
        )
    if problems:
        raise ConfigError(problems)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise _problem(path, f"cannot be read as JSON: {exc}") from None


def _problem(path: Path, message: str) -> ConfigError:
    return ConfigError([ConfigProblem(str(path), "pooling.name", f"auto: {message}")])
