"""From ``model.path`` to a checkpoint, the weight format that reads it, and the model directory the run uses.

A model directory (``config.json``, tokenizer, weights) is its own checkpoint.  A single file holding its own
config and tokenizer (a ``.gguf``) gets a model directory of its own in patchbay's cache, written once by its
weight format (:meth:`~patchbay.interfaces.WeightFormat.model_files`): ``config.json``,
``generation_config.json``, the tokenizer's files and a link to the file, never its tensors.  Everything that
reads a model directory (tokenizer, config, the KV identity of its weights) reads that one; the weights are read
from the file by the format.

The format is ``model.weight_format``: a named one must read the checkpoint (else the run fails with its
reason); ``auto`` takes the format of highest priority that reads it, and none for a float checkpoint that no
format claims (it then loads as it is).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from patchbay.contract.registry import PluginError, Registry
from patchbay.contract.settings import ConfigError, ConfigProblem, PluginChoice, Settings, plugin_options
from patchbay.interfaces import Checkpoint, WeightFormat, WeightFormatConfig
from patchbay.toolkit.model_files import ModelLoadError, bundled_gguf
from patchbay.toolkit.paths import cache_dir

KEY = "model.weight_format"
MODEL_FILES_VERSION = "v1"
"""Bumped when the model directories written for single-file checkpoints change shape."""
LINK_NAME = "weights"
"""The name, in a written model directory, of the link to the checkpoint file (its suffix kept)."""


@dataclass(frozen=True)
class ResolvedModel:
    """What ``model.path`` and ``model.weight_format`` resolve to."""

    checkpoint: Checkpoint
    model_dir: Path
    """A Hugging Face model directory: the checkpoint itself, or the one written for a single-file checkpoint."""
    weight_format: WeightFormat | None
    """The format that loads the weights (``None``: a float checkpoint loaded as it is)."""
    weight_format_name: str | None


def checkpoint_of(path: str) -> Checkpoint:
    """The checkpoint ``model.path`` names: ``default`` (the bundled GGUF file), a file, or a model directory."""
    from patchbay.contract.settings import DEFAULT_MODEL

    candidate = bundled_gguf() if path == DEFAULT_MODEL else Path(path).expanduser()
    if candidate.is_file():
        return Checkpoint(candidate.resolve())
    if candidate.is_dir():
        config_path = candidate / "config.json"
        if not config_path.is_file():
            raise ModelLoadError(f"model.path {path!r} is a directory without config.json; not a Hugging Face model")
        try:
            config = json.loads(config_path.read_text())
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"{config_path}: not readable JSON ({exc})") from None
        return Checkpoint(candidate.resolve(), config if isinstance(config, dict) else {})
    raise ModelLoadError(
        f"model.path {path!r} does not exist; give a local Hugging Face model directory, a .gguf file, "
        "or 'default' for the bundled SmolLM2-135M-Instruct (models are never downloaded)"
    )


def checkpoint_in(model_dir: Path) -> Checkpoint:
    """The checkpoint a run's model directory stands for: the file it links to (a directory written for a
    single-file checkpoint), or the directory itself; with the directory's config either way."""
    config = json.loads((model_dir / "config.json").read_text())
    links = sorted(model_dir.glob(f"{LINK_NAME}.*"))
    path = links[0].resolve() if links and links[0].is_symlink() else model_dir
    return Checkpoint(path, config if isinstance(config, dict) else {})


def choose_weight_format(
    checkpoint: Checkpoint, choice: PluginChoice, registry: Registry, config: WeightFormatConfig
) -> tuple[str, WeightFormat] | None:
    """The run's weight format, built with its options: the named one (which must read ``checkpoint`` and
    serve ``config``), or for ``auto`` the highest-priority format that does; ``None`` when ``auto`` finds
    none (a float checkpoint)."""
    if choice.name != "auto":
        format_class = cast("type[WeightFormat]", registry.resolve("weight_format", choice.name))
        problems = format_class.validate(config)
        if problems:
            raise ConfigError(
                [ConfigProblem("<run>", f"{KEY}.name", f"weight_format:{choice.name}: {'; '.join(problems)}")]
            )
        weight_format = format_class(plugin_options(format_class, choice.options, where=f"{KEY}.options"))
        reason = weight_format.reads(checkpoint)
        if reason is not None:
            raise ConfigError(
                [
                    ConfigProblem(
                        "<run>", f"{KEY}.name", f"weight_format:{choice.name} cannot read {checkpoint.path}: {reason}"
                    )
                ]
            )
        return choice.name, weight_format
    if choice.options:
        raise ConfigError([ConfigProblem("<run>", f"{KEY}.options", "options need a named weight format, not auto")])
    candidates = []
    passed_over: list[str] = []
    for registration in registry.registrations("weight_format"):
        try:
            format_class = cast("type[WeightFormat]", registration.resolve())
        except PluginError as exc:
            passed_over.append(f"weight_format:{registration.name} failed to load ({exc})")
            continue
        capabilities = format_class.capabilities
        problems = format_class.validate(config)
        if problems:
            passed_over.append(f"weight_format:{registration.name} cannot serve this run ({'; '.join(problems)})")
        elif capabilities.priority >= 0:  # below zero: only when named
            candidates.append((capabilities.priority, registration.name, format_class))
    for _, name, format_class in sorted(candidates, key=lambda item: (-item[0], item[1])):
        weight_format = format_class(format_class.Options())
        if weight_format.reads(checkpoint) is None:
            return name, weight_format
    if checkpoint.is_file:
        why = f"; passed over: {'; '.join(passed_over)}" if passed_over else ""
        raise ModelLoadError(f"{checkpoint.path}: no installed weight format reads this file ({KEY}: auto){why}")
    return None


def resolve_model(path: str, choice: PluginChoice, registry: Registry, config: WeightFormatConfig) -> ResolvedModel:
    """``model.path`` and ``model.weight_format`` resolved (see the module docstring)."""
    checkpoint = checkpoint_of(path)
    chosen = choose_weight_format(checkpoint, choice, registry, config)
    name, weight_format = chosen if chosen is not None else (None, None)
    if not checkpoint.is_file:
        return ResolvedModel(checkpoint, checkpoint.path, weight_format, name)
    assert weight_format is not None  # a file no format reads raised above
    model_dir = written_model_dir(checkpoint, weight_format)
    model_config = json.loads((model_dir / "config.json").read_text())
    return ResolvedModel(Checkpoint(checkpoint.path, model_config), model_dir, weight_format, name)


def run_model_dir(settings: Settings, registry: Registry) -> Path:
    """The model directory of ``settings``' model (for what reads config and tokenizer before any weight)."""
    import torch

    device = settings.runtime.device.split(":")[0]
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    config = WeightFormatConfig(device=device, tensor_parallel_size=settings.runtime.tensor_parallel_size)
    return resolve_model(settings.model.path, settings.model.weight_format, registry, config).model_dir


def _file_key(path: Path) -> str:
    """What names a file's written model directory: its path, size and modification time, and a hash of its
    first and last MiB (a rewritten file gets a new directory; hashing all of a 5 GB file would take seconds)."""
    info = path.stat()
    digest = hashlib.sha256(f"{path}\0{info.st_size}\0{info.st_mtime_ns}\0".encode())
    with path.open("rb") as file:
        digest.update(file.read(1 << 20))
        file.seek(max(0, info.st_size - (1 << 20)))
        digest.update(file.read(1 << 20))
    return digest.hexdigest()[:16]


def written_model_dir(checkpoint: Checkpoint, weight_format: WeightFormat) -> Path:
    """The model directory written once for the single-file ``checkpoint`` by ``weight_format`` (its config,
    tokenizer and a link to the file), in patchbay's cache; written to a staging folder and renamed into place,
    so concurrent first runs cannot leave half of one."""
    path = checkpoint.path
    target = cache_dir() / "models" / f"{path.stem}-{_file_key(path)}-{MODEL_FILES_VERSION}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".writing-", dir=target.parent))
    try:
        weight_format.model_files(checkpoint, staging)
        if not (staging / "config.json").is_file():
            raise ModelLoadError(f"{path}: the weight format wrote no config.json for it")
        (staging / f"{LINK_NAME}{path.suffix}").symlink_to(path)
        try:
            staging.rename(target)
        except OSError:
            if not (target / "config.json").is_file():  # lost a race only if the winner finished
                raise
    except ModelLoadError:
        raise
    except Exception as exc:
        raise ModelLoadError(f"could not read the config and tokenizer of {path}: {type(exc).__name__}: {exc}") from exc
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
