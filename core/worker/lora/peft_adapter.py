"""Reading one LoRA adapter saved in PEFT's format, checked against the base model it will run on.

PEFT saves ``adapter_config.json`` (``r``, ``lora_alpha``, ``use_rslora``,
``target_modules``, ...) and ``adapter_model.safetensors`` whose keys read
``base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}.weight``;
``lora_A`` is ``[r, in_features]`` and ``lora_B`` ``[out_features, r]``.  The
scale PEFT multiplies the product by is ``lora_alpha / r``, or
``lora_alpha / sqrt(r)`` with ``use_rslora``.

Both files are read once, as regular files (a FIFO or device is refused, not
waited on), within :data:`READ_TIMEOUT` seconds and a size an adapter of
``max_lora_rank`` could have.  The adapter's identity
(:attr:`LoRAAdapter.fingerprint`) is the digest of exactly those bytes,
weights and config: two adapters that compute differently never share one.
Weights that are not finite, or that overflow the run's dtype, are refused:
one adapter's NaN must not reach other requests' rows.

Every problem raises :class:`LoRAAdapterError` naming the adapter and the reason.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from patchbay.toolkit.local_files import LocalFileError, call_with_timeout, open_regular_file, read_capped

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
LEGACY_WEIGHTS_FILE = "adapter_model.bin"

TARGET_MODULES: dict[str, str] = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}
"""The linears an adapter may target, with the block that holds each."""

_KEY = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_(A|B)(?:\.default)?\.weight$"
)

_UNSUPPORTED: dict[str, str] = {
    "use_dora": "DoRA (use_dora) is not supported",
    "modules_to_save": "modules_to_save (fully trained extra modules) is not supported",
    "fan_in_fan_out": "fan_in_fan_out (Conv1D-style weights) is not supported",
    "rank_pattern": "per-module ranks (rank_pattern) are not supported",
    "alpha_pattern": "per-module alphas (alpha_pattern) are not supported",
    "layer_replication": "layer_replication is not supported",
    "lora_bias": "a bias on lora_B (lora_bias) is not supported",
    "target_parameters": "target_parameters (LoRA on parameters, not modules) is not supported",
    "trainable_token_indices": "trainable_token_indices is not supported",
    "use_qalora": "QALoRA (use_qalora) is not supported",
}
"""Config keys that, when set to anything truthy, change what the adapter computes in ways patchbay does not."""

READ_TIMEOUT = 60.0
"""Seconds reading one adapter file may take (a stalled network filesystem fails the adapter, not the engine)."""

MAX_CONFIG_BYTES = 1 << 20
"""The largest ``adapter_config.json`` read."""


class LoRAAdapterError(ValueError):
    """An adapter that cannot run on this base model; the message names the adapter and says why."""


@dataclass(frozen=True)
class LinearShape:
    """A target linear's ``in_features`` and ``out_features`` in the base model."""

    in_features: int
    out_features: int


def base_model_shapes(hf_config: Any) -> tuple[int, dict[str, LinearShape]]:
    """The number of decoder layers and each target module's shape, from a Llama-like Hugging Face config."""
    hidden = hf_config.hidden_size
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hidden // heads
    intermediate = hf_config.intermediate_size
    shapes = {
        "q_proj": LinearShape(hidden, heads * head_dim),
        "k_proj": LinearShape(hidden, kv_heads * head_dim),
        "v_proj": LinearShape(hidden, kv_heads * head_dim),
        "o_proj": LinearShape(heads * head_dim, hidden),
        "gate_proj": LinearShape(hidden, intermediate),
        "up_proj": LinearShape(hidden, intermediate),
        "down_proj": LinearShape(intermediate, hidden),
    }
    return hf_config.num_hidden_layers, shapes


@dataclass
class LoRAAdapter:
    """One adapter read from disk: its scale, rank and float32 A/B per (layer, module)."""

    name: str
    path: Path
    rank: int
    scaling: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(repr=False)
    """``(layer, module) -> (A [rank, in], B [out, rank])``; layers and modules it does not target are absent."""
    fingerprint: str = ""
    """SHA-256 of the weights file's and the config's bytes, as read: the adapter's identity in prefix-cache and
    KV-connector keys and in the runner's slots."""

    @property
    def target_modules(self) -> frozenset[str]:
        """The modules (``q_proj``, ...) it adapts in at least one layer."""
        return frozenset(module for _, module in self.weights)


def read_adapter_config(name: str, path: Path) -> dict[str, Any]:
    """``adapter_config.json`` of adapter ``name`` at ``path``, parsed, with every unsupported feature refused."""
    return _parse_config(name, path, _read_config_bytes(name, path))


def _read_config_bytes(name: str, path: Path) -> bytes:
    if not path.is_dir():
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {path} is not a directory")
    config_path = path / CONFIG_FILE
    if not config_path.exists():
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {config_path} is missing (not an adapter in PEFT's format)")
    return _read_file(name, config_path, MAX_CONFIG_BYTES)


def _read_file(name: str, file: Path, max_bytes: int) -> bytes:
    """The bytes of ``file``, a regular file of at most ``max_bytes``, read within :data:`READ_TIMEOUT` seconds."""
    try:
        data = call_with_timeout(lambda: read_capped(open_regular_file(file), max_bytes), READ_TIMEOUT)
    except (LocalFileError, TimeoutError) as exc:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: cannot read {file}: {exc}") from None
    if data is None:
        raise LoRAAdapterError(
            f"LoRA adapter {name!r}: {file} is over {max_bytes} bytes, more than an adapter this run takes can hold"
        )
    return data


def _parse_config(name: str, path: Path, data: bytes) -> dict[str, Any]:
    config_path = path / CONFIG_FILE
    try:
        config = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {config_path} is not valid JSON: {exc}") from None
    if not isinstance(config, Mapping):
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {config_path} holds {type(config).__name__}, not an object")
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise LoRAAdapterError(f"LoRA adapter {name!r}: peft_type {peft_type!r} is not LORA")
    for key, reason in _UNSUPPORTED.items():
        if config.get(key):
            raise LoRAAdapterError(f"LoRA adapter {name!r}: {reason} ({CONFIG_FILE}: {key}={config[key]!r})")
    bias = config.get("bias", "none")
    if bias != "none":
        raise LoRAAdapterError(
            f"LoRA adapter {name!r}: trained biases are not supported ({CONFIG_FILE}: bias={bias!r})"
        )
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {CONFIG_FILE} needs a positive integer r, got {rank!r}")
    alpha = config.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise LoRAAdapterError(f"LoRA adapter {name!r}: lora_alpha must be a number, got {alpha!r}")
    return dict(config)


def peft_scaling(config: Mapping[str, Any]) -> float:
    """The factor PEFT multiplies ``B·A`` by: ``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with ``use_rslora``."""
    rank, alpha = config["r"], config.get("lora_alpha", 8)
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def load_adapter(
    name: str,
    path: Path | str,
    *,
    num_layers: int,
    shapes: Mapping[str, LinearShape],
    max_lora_rank: int,
    dtype: torch.dtype = torch.float32,
) -> LoRAAdapter:
    """Read adapter ``name`` from ``path`` and check it fits the base model (``num_layers``, ``shapes``) and runs in
    ``dtype`` (every weight finite there)."""
    path = Path(path)
    config_bytes = _read_config_bytes(name, path)
    config = _parse_config(name, path, config_bytes)
    rank = config["r"]
    if rank > max_lora_rank:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: rank {rank} exceeds lora.max_lora_rank ({max_lora_rank})")
    weights_bytes, weights_path = _read_weights_file(name, path, max_weights_bytes(num_layers, shapes, max_lora_rank))
    tensors = _parse_weights(name, weights_path, weights_bytes)
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in sorted(tensors.items()):  # a stable order, so errors name the same weight each time
        match = _KEY.match(key)
        if match is None:
            raise LoRAAdapterError(
                f"LoRA adapter {name!r}: weight {key!r} in {weights_path.name} is not a LoRA "
                f"A or B of a decoder layer's linear (supported targets: {', '.join(TARGET_MODULES)})"
            )
        layer, block, module, half = int(match[1]), match[2], match[3], match[4]
        if TARGET_MODULES.get(module) != block:
            raise LoRAAdapterError(
                f"LoRA adapter {name!r}: weight {key!r} targets {block}.{module}, which is not "
                f"supported (supported targets: {', '.join(TARGET_MODULES)})"
            )
        if layer >= num_layers:
            raise LoRAAdapterError(
                f"LoRA adapter {name!r} was built for another base model: weight {key!r} is for "
                f"layer {layer}, but the model has {num_layers} layers"
            )
        halves.setdefault((layer, module), {})[half] = tensor
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for (layer, module), pair in sorted(halves.items()):
        where = f"layers.{layer}.{TARGET_MODULES[module]}.{module}"
        if set(pair) != {"A", "B"}:
            missing = ({"A", "B"} - set(pair)).pop()
            raise LoRAAdapterError(
                f"LoRA adapter {name!r}: {where} has no lora_{missing} weight in {weights_path.name}"
            )
        shape = shapes[module]
        a, b = pair["A"], pair["B"]
        expected_a, expected_b = (rank, shape.in_features), (shape.out_features, rank)
        if tuple(a.shape) != expected_a or tuple(b.shape) != expected_b:
            raise LoRAAdapterError(
                f"LoRA adapter {name!r} was built for another base model: {where} has lora_A {tuple(a.shape)} and "
                f"lora_B {tuple(b.shape)}, but this model (rank {rank}) needs {expected_a} and {expected_b}"
            )
        a, b = a.to(torch.float32).contiguous(), b.to(torch.float32).contiguous()
        for half, tensor in (("A", a), ("B", b)):
            _check_finite(name, f"{where}.lora_{half}", tensor, dtype)
        weights[(layer, module)] = (a, b)
    if not weights:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {weights_path.name} holds no LoRA weights")
    return LoRAAdapter(
        name=name,
        path=path,
        rank=rank,
        scaling=peft_scaling(config),
        weights=weights,
        fingerprint=adapter_fingerprint(weights_bytes, config_bytes),
    )


def adapter_fingerprint(weights: bytes, config: bytes) -> str:
    """The identity of an adapter read as these bytes: SHA-256 over the weights file and ``adapter_config.json``
    (its scale, rslora and every other setting change what it computes), each length-prefixed."""
    digest = hashlib.sha256()
    for part in (weights, config):
        digest.update(len(part).to_bytes(8, "little"))
        digest.update(part)
    return digest.hexdigest()


WEIGHTS_HEADROOM = 256 << 20
"""Bytes a weights file may hold beyond what the supported targets need: room for weights of targets patchbay
refuses (embeddings, ``lm_head``), so such an adapter is refused by name, not by size."""


def max_weights_bytes(num_layers: int, shapes: Mapping[str, LinearShape], max_lora_rank: int) -> int:
    """The largest weights file read for an adapter of rank up to ``max_lora_rank`` on this model: every target
    of every layer in float64, plus :data:`WEIGHTS_HEADROOM` (a file past it is refused before it is read)."""
    values = num_layers * sum(max_lora_rank * (shape.in_features + shape.out_features) for shape in shapes.values())
    return 8 * values + WEIGHTS_HEADROOM


def _check_finite(name: str, where: str, tensor: torch.Tensor, dtype: torch.dtype) -> None:
    """Refuse a weight holding NaN or inf, or a value beyond ``dtype``'s range (it would be inf once cast)."""
    bad = int((~torch.isfinite(tensor)).sum())
    if bad:
        raise LoRAAdapterError(
            f"LoRA adapter {name!r}: {where} holds {bad} non-finite value(s) (NaN or inf); the adapter cannot run"
        )
    limit = torch.finfo(dtype).max if dtype.is_floating_point else None
    largest = float(tensor.abs().max()) if tensor.numel() else 0.0
    if limit is not None and largest > limit:
        raise LoRAAdapterError(
            f"LoRA adapter {name!r}: {where} holds {largest:.3g}, beyond what {str(dtype).removeprefix('torch.')} "
            f"(this run's dtype) can hold ({limit:.3g}); the adapter cannot run"
        )


def _read_weights_file(name: str, path: Path, max_bytes: int) -> tuple[bytes, Path]:
    safetensors_path, legacy_path = path / WEIGHTS_FILE, path / LEGACY_WEIGHTS_FILE
    for candidate in (safetensors_path, legacy_path):
        if candidate.exists():
            return _read_file(name, candidate, max_bytes), candidate
    raise LoRAAdapterError(
        f"LoRA adapter {name!r}: {safetensors_path} is missing (nor is there an {LEGACY_WEIGHTS_FILE})"
    )


def _parse_weights(name: str, weights_path: Path, data: bytes) -> dict[str, torch.Tensor]:
    try:
        if weights_path.name == WEIGHTS_FILE:
            from safetensors.torch import load

            return load(data)
        loaded = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        if not isinstance(loaded, dict):
            raise ValueError(f"holds {type(loaded).__name__}, not a state dict")
        return loaded
    except Exception as exc:  # a truncated or foreign file: say which adapter and file
        raise LoRAAdapterError(
            f"LoRA adapter {name!r}: cannot read {weights_path}: {type(exc).__name__}: {exc}"
        ) from None
