"""Reading one LoRA adapter saved in PEFT's format, checked against the base model it will run on.

PEFT saves ``adapter_config.json`` (``r``, ``lora_alpha``, ``use_rslora``,
``target_modules``, ...) and ``adapter_model.safetensors`` whose keys read
``base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}.weight``;
``lora_A`` is ``[r, in_features]`` and ``lora_B`` ``[out_features, r]``.  The
scale PEFT multiplies the product by is ``lora_alpha / r``, or
``lora_alpha / sqrt(r)`` with ``use_rslora``.

Every problem raises :class:`LoRAAdapterError` naming the adapter and the reason.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

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
    """SHA-256 of the weights file: the adapter's identity in prefix-cache and KV-connector keys."""

    @property
    def target_modules(self) -> frozenset[str]:
        """The modules (``q_proj``, ...) it adapts in at least one layer."""
        return frozenset(module for _, module in self.weights)


def read_adapter_config(name: str, path: Path) -> dict[str, Any]:
    """``adapter_config.json`` of adapter ``name`` at ``path``, parsed, with every unsupported feature refused."""
    if not path.is_dir():
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {path} is not a directory")
    config_path = path / CONFIG_FILE
    if not config_path.is_file():
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {config_path} is missing (not an adapter in PEFT's format)")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
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
    name: str, path: Path | str, *, num_layers: int, shapes: Mapping[str, LinearShape], max_lora_rank: int
) -> LoRAAdapter:
    """Read adapter ``name`` from ``path`` and check it fits the base model (``num_layers``, ``shapes``)."""
    path = Path(path)
    config = read_adapter_config(name, path)
    rank = config["r"]
    if rank > max_lora_rank:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: rank {rank} exceeds lora.max_lora_rank ({max_lora_rank})")
    tensors, weights_path = _read_weights(name, path)
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
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
        weights[(layer, module)] = (a.to(torch.float32).contiguous(), b.to(torch.float32).contiguous())
    if not weights:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {weights_path.name} holds no LoRA weights")
    return LoRAAdapter(
        name=name,
        path=path,
        rank=rank,
        scaling=peft_scaling(config),
        weights=weights,
        fingerprint=_fingerprint(weights_path),
    )


def _read_weights(name: str, path: Path) -> tuple[dict[str, torch.Tensor], Path]:
    safetensors_path, legacy_path = path / WEIGHTS_FILE, path / LEGACY_WEIGHTS_FILE
    try:
        if safetensors_path.is_file():
            from safetensors.torch import load_file

            return load_file(str(safetensors_path)), safetensors_path
        if legacy_path.is_file():
            loaded = torch.load(legacy_path, map_location="cpu", weights_only=True)
            if not isinstance(loaded, dict):
                raise ValueError(f"holds {type(loaded).__name__}, not a state dict")
            return loaded, legacy_path
    except Exception as exc:  # a truncated or foreign file: say which adapter and file
        bad = safetensors_path if safetensors_path.is_file() else legacy_path
        raise LoRAAdapterError(f"LoRA adapter {name!r}: cannot read {bad}: {type(exc).__name__}: {exc}") from None
    raise LoRAAdapterError(
        f"LoRA adapter {name!r}: {safetensors_path} is missing (nor is there an {LEGACY_WEIGHTS_FILE})"
    )


def _fingerprint(weights_path: Path) -> str:
    digest = hashlib.sha256()
    with weights_path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
