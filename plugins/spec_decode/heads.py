"""What the Medusa and EAGLE drafters share: their small modules, the target's parts they reuse, weight files.

A trained drafter is a directory of two files::

    config.json        {"kind": "medusa" | "eagle" | "eagle3", "format_version": 1, sizes...,
                        "draft_vocab_size": N | null, "aux_layers": [...] (eagle3 only),
                        "target": {...}, "training": {...}}
    model.safetensors  the drafter's own weights, and its draft vocabulary ``token_map`` when it has one;
                       never the target's embeddings or lm head, which are shared

``target`` records the model the weights were trained for (architecture,
sizes, a signature of its embedding matrix).  Loading for a target of other
sizes is an error; for a target whose embeddings merely differ it is a
warning: drafts can never change the output, only how many get accepted.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from transformers import PreTrainedModel

logger = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
FORMAT_VERSION = 1
AUTO_PATH = "auto"
"""``options.path: auto`` means the directory ``patchbay-train-drafter`` writes by default for the run's model."""


class DrafterFileError(ValueError):
    """A drafter weights directory that cannot serve this target; the message names the file and the problem."""


# -- the target's parts ----------------------------------------------------------------------------


@dataclass(frozen=True)
class TargetParts:
    """The pieces of a transformers causal LM a drafter reuses, and the sizes it needs."""

    embeddings: nn.Module
    """``[vocab, hidden]`` token embeddings (``get_input_embeddings()``)."""
    lm_head: nn.Linear
    """``hidden -> vocab`` projection (``get_output_embeddings()``)."""
    rotary: nn.Module | None
    """The decoder's rotary embedding module (``cos, sin = rotary(x, position_ids)``), if it has one."""
    hidden_size: int
    vocab_size: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float


def text_config(model: PreTrainedModel) -> Any:
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def target_parts(model: PreTrainedModel) -> TargetParts:
    """Find the embeddings, lm head, rotary embedding and sizes of a transformers causal LM."""
    config = text_config(model)
    lm_head = model.get_output_embeddings()
    if lm_head is None:
        raise ValueError(f"{type(model).__name__} has no output embeddings (lm head); drafters project through it")
    shard = getattr(lm_head, "vocab_shard", None)
    if shard is not None:  # patchbay.worker.parallel.tensor_parallel.VocabShard
        raise ValueError(
            f"{type(model).__name__}'s embedding and lm head hold {shard.rows_per_rank} of its "
            f"{shard.vocab_size} vocabulary rows on each of {shard.world_size} ranks "
            "(runtime.tensor_parallel_size); a drafter that reads their whole weights declares "
            "DrafterCapabilities.reads_vocabulary_weights, and the ranks keep the vocabulary whole"
        )
    num_heads = config.num_attention_heads
    rope = getattr(config, "rope_parameters", None) or {}
    return TargetParts(
        embeddings=model.get_input_embeddings(),
        lm_head=lm_head,
        rotary=getattr(model.base_model, "rotary_emb", None),
        hidden_size=config.hidden_size,
        vocab_size=config.vocab_size,
        num_heads=num_heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
        head_size=getattr(config, "head_dim", None) or config.hidden_size // num_heads,
        intermediate_size=getattr(config, "intermediate_size", None) or 4 * config.hidden_size,
        rms_norm_eps=float(getattr(config, "rms_norm_eps", None) or 1e-6),
        rope_theta=float(rope.get("rope_theta") or getattr(config, "rope_theta", None) or 10000.0),
    )


def model_id(model: PreTrainedModel) -> str:
    """A short name for the target: its model directory's name (the bundled model's is keyed by its file hash)."""
    name = getattr(model, "name_or_path", "") or ""
    return Path(name).name or type(model).__name__


def default_drafter_dir(target_model_id: str, kind: str) -> Path:
    """``~/.cache/patchbay/drafters/<model-id>/<kind>`` (``$PATCHBAY_CACHE_DIR`` replaces ``~/.cache/patchbay``)."""
    from patchbay.toolkit.paths import cache_dir

    return cache_dir() / "drafters" / target_model_id / kind


def resolve_drafter_path(path: str, model: PreTrainedModel, kind: str) -> Path:
    """``options.path`` as a directory: ``auto`` is :func:`default_drafter_dir` of ``model``."""
    if path == AUTO_PATH:
        found = default_drafter_dir(model_id(model), kind)
        if not (found / CONFIG_FILE).is_file():
            raise DrafterFileError(
                f"{kind} options.path 'auto': no trained {kind} weights for {model_id(model)} at {found}; "
                f"train them with `patchbay-train-drafter {kind}` or give a directory"
            )
        return found
    return Path(path).expanduser()


def warn_vocab_size(configured: int, target: int) -> None:
    """Drafts are cut to the run's ``vocab_size``; say so when it differs from the lm head's width."""
    if configured != target:
        logger.warning(
            "drafter: the run's vocab_size is %d but the target's lm head has %d outputs; "
            "drafts are limited to ids below %d",
            configured,
            target,
            min(configured, target),
        )


SIGNATURE_ROWS = 8


def embedding_signature(model: PreTrainedModel) -> list[float]:
    """Norms of a few embedding rows spread over the vocabulary: tells two checkpoints of one shape apart.

    Norms, not a hash of the bytes, so the same weights in bfloat16 and float32 still match.
    """
    weight = model.get_input_embeddings().weight
    assert isinstance(weight, torch.Tensor)  # an embedding's weight
    rows = torch.linspace(0, weight.shape[0] - 1, SIGNATURE_ROWS).long()
    return [round(float(value), 4) for value in weight.detach()[rows].float().norm(dim=-1).cpu()]


def target_identity(model: PreTrainedModel) -> dict[str, Any]:
    """What a drafter's ``config.json`` records of the target it was trained for."""
    config = text_config(model)
    architectures = getattr(model.config, "architectures", None) or [type(model).__name__]
    return {
        "model_id": model_id(model),
        "architecture": architectures[0],
        "hidden_size": config.hidden_size,
        "vocab_size": config.vocab_size,
        "num_hidden_layers": config.num_hidden_layers,
        "embedding_signature": embedding_signature(model),
    }


def check_target(config: dict[str, Any], model: PreTrainedModel, where: Path) -> None:
    """Raise if the weights at ``where`` cannot run on ``model``; warn if they were trained for another model."""
    recorded = config.get("target") or {}
    actual = target_identity(model)
    for key in ("hidden_size", "vocab_size"):
        if key in recorded and recorded[key] != actual[key]:
            raise DrafterFileError(
                f"{where / CONFIG_FILE}: target.{key} is {recorded[key]} but the run's model has {actual[key]}; "
                f"these drafter weights were trained for {recorded.get('model_id', 'another model')}"
            )
    signature, actual_signature = recorded.get("embedding_signature"), actual["embedding_signature"]
    if signature is not None and (
        len(signature) != len(actual_signature)
        or not all(
            math.isclose(a, b, rel_tol=2e-2, abs_tol=1e-3) for a, b in zip(signature, actual_signature, strict=True)
        )
    ):
        logger.warning(
            "%s: trained for %s, the run's model is %s (embeddings differ); expect low acceptance",
            where,
            recorded.get("model_id", "another model"),
            actual["model_id"],
        )


# -- weight files ----------------------------------------------------------------------------------


def save_drafter(directory: Path, config: dict[str, Any], module: nn.Module) -> Path:
    """Write ``config.json`` and ``model.safetensors`` into ``directory``.

    The safetensors file holds ``module``'s state dict, floats as float32.
    """
    from safetensors.torch import save_file

    directory = Path(directory).expanduser()
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {
        name: (tensor.detach().float() if tensor.is_floating_point() else tensor.detach()).cpu().contiguous()
        for name, tensor in module.state_dict().items()
    }
    save_file(tensors, str(directory / WEIGHTS_FILE), metadata={"format": "pt", "kind": config["kind"]})
    (directory / CONFIG_FILE).write_text(json.dumps({"format_version": FORMAT_VERSION, **config}, indent=2) + "\n")
    return directory


def load_drafter(directory: Path, kind: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Read a drafter directory written by :func:`save_drafter`; ``kind`` must match its config's."""
    from safetensors.torch import load_file

    directory = Path(directory).expanduser()
    config_path, weights_path = directory / CONFIG_FILE, directory / WEIGHTS_FILE
    for path in (config_path, weights_path):
        if not path.is_file():
            raise DrafterFileError(f"{kind} weights directory {directory}: {path.name} is missing")
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as exc:
        raise DrafterFileError(f"{config_path}: not valid JSON ({exc})") from exc
    if config.get("kind") != kind:
        raise DrafterFileError(f"{config_path}: kind is {config.get('kind')!r}, expected {kind!r}")
    if config.get("format_version") != FORMAT_VERSION:
        raise DrafterFileError(
            f"{config_path}: format_version {config.get('format_version')!r}, this patchbay reads {FORMAT_VERSION}"
        )
    return config, load_file(str(weights_path))


def load_trained(path: str, model: PreTrainedModel, kind: str) -> tuple[Path, dict[str, Any], dict[str, torch.Tensor]]:
    """Find, read and check trained ``kind`` weights for ``model``: the directory, its config and its tensors."""
    directory = resolve_drafter_path(path, model, kind)
    config, state = load_drafter(directory, kind)
    check_target(config, model, directory)
    return directory, config, state


def load_state(module: nn.Module, state: dict[str, torch.Tensor], where: Path) -> None:
    """``module.load_state_dict(state)`` with an error naming the file and the mismatched tensors."""
    expected = module.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    wrong = sorted(name for name in set(expected) & set(state) if expected[name].shape != state[name].shape)
    if missing or unexpected or wrong:
        details = []
        if missing:
            details.append(f"missing {missing}")
        if unexpected:
            details.append(f"unexpected {unexpected}")
        if wrong:
            details.append(
                "wrong shape "
                + ", ".join(
                    f"{name} {tuple(state[name].shape)} (expected {tuple(expected[name].shape)})" for name in wrong
                )
            )
        raise DrafterFileError(f"{Path(where) / WEIGHTS_FILE} does not match its config.json: {'; '.join(details)}")
    module.load_state_dict(state)


# -- Medusa ----------------------------------------------------------------------------------------


class ResidualBlock(nn.Module):
    """``h + SiLU(W h + b)``; zero-initialised, so an untrained block is the identity."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + nn.functional.silu(self.linear(hidden))


class DraftVocab:
    """The tokens a drafter may propose and their rows of the target's (frozen) lm head.

    All of the target's tokens (up to ``limit``), or the subset ``token_map``
    lists (ascending ids): the tokens the target emits most, as chosen at
    training time.  A subset makes drafting and training cheaper (fewer
    rows of the vocabulary-wide projection); tokens outside it are never
    drafted, which costs acceptance only.
    """

    def __init__(self, lm_head: nn.Linear, token_map: torch.Tensor | None = None, limit: int | None = None) -> None:
        weight = lm_head.weight.detach()
        bias = getattr(lm_head, "bias", None)
        bias = bias.detach() if bias is not None else None
        if token_map is not None:
            token_map = token_map.to(device=weight.device, dtype=torch.long)
            if limit is not None:
                token_map = token_map[token_map < limit]
            weight, bias = weight[token_map], bias[token_map] if bias is not None else None
        elif limit is not None and limit < weight.shape[0]:
            weight, bias = weight[:limit], bias[:limit] if bias is not None else None
        self.weight, self.bias, self.token_map = weight, bias, token_map
        self.target_vocab_size = lm_head.weight.shape[0]

    @property
    def size(self) -> int:
        return self.weight.shape[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[..., size]`` logits over the draft vocabulary (differentiable in ``hidden`` only)."""
        bias = None if self.bias is None else self.bias.to(hidden.dtype)
        return nn.functional.linear(hidden, self.weight.to(hidden.dtype), bias)

    def token_ids(self, indices: torch.Tensor) -> torch.Tensor:
        """Target token ids of draft-vocabulary indices."""
        return indices if self.token_map is None else self.token_map.to(indices.device)[indices]

    def indices_of(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary indices of target token ids; -100 (cross-entropy's ignore index) where absent."""
        lookup = torch.full((self.target_vocab_size,), -100, dtype=torch.long, device=token_ids.device)
        if self.token_map is None:
            lookup[: self.size] = torch.arange(self.size, device=token_ids.device)
        else:
            lookup[self.token_map.to(token_ids.device)] = torch.arange(self.size, device=token_ids.device)
        found = lookup[token_ids.clamp(min=0)]
        return torch.where(token_ids >= 0, found, torch.full_like(found, -100))

    def argmax(self, hidden: torch.Tensor, rows: int = 512) -> torch.Tensor:
        """The draft token (a target id) each hidden state scores highest, a few hundred rows at a time."""
        flat = hidden.reshape(-1, hidden.shape[-1])
        found = torch.cat([self.logits(flat[i : i + rows]).argmax(dim=-1) for i in range(0, len(flat), rows)])
        return self.token_ids(found).reshape(hidden.shape[:-1])


def token_map_buffer(module: nn.Module, draft_vocab_size: int | None) -> None:
    """Give ``module`` a ``token_map`` buffer (saved with its weights) of ``draft_vocab_size`` ids, or ``None``."""
    module.register_buffer("token_map", torch.zeros(draft_vocab_size, dtype=torch.long) if draft_vocab_size else None)


class MedusaHead(nn.Module):
    """Residual blocks; the draft vocabulary's projection (the target's lm head) turns their output into logits."""

    def __init__(self, hidden_size: int, num_layers: int) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(ResidualBlock(hidden_size) for _ in range(num_layers)))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.blocks(hidden)


class MedusaHeads(nn.Module):
    """``num_heads`` Medusa heads over the target's final hidden state.

    The hidden state at position ``p`` is the one the target's lm head turns
    into token ``p + 1``; head ``i`` (from 0) predicts token ``p + 2 + i``.
    """

    token_map: torch.Tensor | None  # the buffer token_map_buffer registers

    def __init__(
        self, hidden_size: int, num_heads: int, num_layers: int = 1, draft_vocab_size: int | None = None
    ) -> None:
        super().__init__()
        self.heads = nn.ModuleList(MedusaHead(hidden_size, num_layers) for _ in range(num_heads))
        token_map_buffer(self, draft_vocab_size)

    @property
    def num_heads(self) -> int:
        return len(self.heads)

    def vocab(self, lm_head: nn.Linear, limit: int | None = None) -> DraftVocab:
        return DraftVocab(lm_head, self.token_map, limit)

    def logits(self, hidden: torch.Tensor, vocab: DraftVocab, num_heads: int | None = None) -> list[torch.Tensor]:
        """``[rows, vocab.size]`` logits of each of the first ``num_heads`` heads (all by default)."""
        return [vocab.logits(head(hidden)) for head in self.heads[: num_heads or self.num_heads]]


# -- EAGLE -----------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        dtype = hidden.dtype
        hidden = hidden.float()
        hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * hidden.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[a, b] -> [-b, a]`` over the last dimension's halves (the Llama/NeoX rotary layout)."""
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class Rotary:
    """cos and sin of positions: the target's rotary module when it has one, else plain RoPE with ``theta``."""

    def __init__(self, parts: TargetParts) -> None:
        self.module = parts.rotary
        self.inv_freq = 1.0 / parts.rope_theta ** (torch.arange(0, parts.head_size, 2).float() / parts.head_size)

    def __call__(self, like: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions`` ``[..., T]`` (long) -> cos, sin ``[..., T, head_size]`` in ``like``'s dtype."""
        if self.module is not None:
            flat = positions.reshape(1, -1)
            cos, sin = self.module(like, flat)
            shape = (*positions.shape, cos.shape[-1])
            return cos.reshape(shape).to(like.dtype), sin.reshape(shape).to(like.dtype)
        angles = positions.float()[..., None] * self.inv_freq.to(positions.device)
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos().to(like.dtype), angles.sin().to(like.dtype)


class EagleLayer(nn.Module):
    """One Llama decoder layer, split around its attention so the caller decides how attention runs.

    EAGLE-1 drops the input norm of the draft's first layer (the fc output
    goes straight into attention)::

        q, k, v = layer.qkv(x, cos, sin)               # [..., T, heads, head_size]
        out = layer.finish(x, attend(q, k, v))          # attend: paged (inference) or dense (training)
    """

    def __init__(
        self, hidden_size: int, num_heads: int, num_kv_heads: int, head_size: int, intermediate_size: int, eps: float
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_size = num_heads, num_kv_heads, head_size
        self.q_proj = nn.Linear(hidden_size, num_heads * head_size, bias=False)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_size, bias=False)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_size, bias=False)
        self.o_proj = nn.Linear(num_heads * head_size, hidden_size, bias=False)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps)
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    @property
    def scale(self) -> float:
        return self.head_size**-0.5

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Rotated queries ``[..., T, heads, D]``, rotated keys and values ``[..., T, kv_heads, D]``."""
        lead = x.shape[:-1]
        q = self.q_proj(x).view(*lead, self.num_heads, self.head_size)
        k = self.k_proj(x).view(*lead, self.num_kv_heads, self.head_size)
        v = self.v_proj(x).view(*lead, self.num_kv_heads, self.head_size)
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v

    def finish(self, x: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
        """Output projection, residual, MLP: ``attention`` is ``[..., T, heads, D]``."""
        hidden = x + self.o_proj(attention.flatten(-2))
        normed = self.post_attention_layernorm(hidden)
        return hidden + self.down_proj(nn.functional.silu(self.gate_proj(normed)) * self.up_proj(normed))


class EagleDraftModel(nn.Module):
    """EAGLE-1's draft model: ``fc(concat(embedding(token_{p+1}), feature_p))``, then one decoder layer.

    Its output at position ``p`` predicts the target's feature (final hidden
    state, after the final norm) at ``p + 1``; the target's lm head turns it
    into a token, and it is the feature fed back for the next draft.
    """

    token_map: torch.Tensor | None  # the buffer token_map_buffer registers

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_size: int,
        intermediate_size: int,
        eps: float,
        draft_vocab_size: int | None = None,
    ) -> None:
        super().__init__()
        self.fc = nn.Linear(2 * hidden_size, hidden_size)
        self.layer = EagleLayer(hidden_size, num_heads, num_kv_heads, head_size, intermediate_size, eps)
        token_map_buffer(self, draft_vocab_size)

    @classmethod
    def for_target(
        cls, parts: TargetParts, intermediate_size: int | None = None, draft_vocab_size: int | None = None
    ) -> EagleDraftModel:
        return cls(
            parts.hidden_size,
            parts.num_heads,
            parts.num_kv_heads,
            parts.head_size,
            intermediate_size or parts.intermediate_size,
            parts.rms_norm_eps,
            draft_vocab_size,
        )

    def vocab(self, lm_head: nn.Linear, limit: int | None = None) -> DraftVocab:
        return DraftVocab(lm_head, self.token_map, limit)

    def sizes(self) -> dict[str, Any]:
        """The constructor's arguments, as ``config.json`` records them."""
        layer = self.layer
        return {
            "hidden_size": self.fc.out_features,
            "num_heads": layer.num_heads,
            "num_kv_heads": layer.num_kv_heads,
            "head_size": layer.head_size,
            "intermediate_size": layer.gate_proj.out_features,
            "rms_norm_eps": layer.post_attention_layernorm.eps,
            "draft_vocab_size": None if self.token_map is None else len(self.token_map),
        }

    def fuse(self, token_embeddings: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.cat((token_embeddings, features), dim=-1))

    def target_features(self, target_inputs: torch.Tensor) -> torch.Tensor:
        """The feature the cache-filling pass fuses at each row, from what the target gave for it: its final
        hidden state, as is (EAGLE-1)."""
        return target_inputs


class Eagle3DraftModel(EagleDraftModel):
    """EAGLE-3's draft model: EAGLE-1's, but the target's feature comes from a low, a middle and a high layer.

    At the cache-filling pass, the outputs of the target's ``aux_layers`` at
    position ``p``, concatenated (``[..., len(aux_layers) * hidden]``), are
    each RMS-normed (``aux_norms``: unlike the final hidden state, the
    residual stream inside a model is not normed, and a few of its
    dimensions run to hundreds) and projected by ``aux_fc`` to one
    hidden-size feature, which takes the place of EAGLE-1's final hidden state; the drafting steps after it feed
    back the layer's own output, as EAGLE-3 does.  Everything else (the
    fusion with the token embedding, the decoder layer, the lm head) is
    EAGLE-1's, so only this input projection is new.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_size: int,
        intermediate_size: int,
        eps: float,
        aux_layers: Sequence[int],
        draft_vocab_size: int | None = None,
    ) -> None:
        super().__init__(hidden_size, num_heads, num_kv_heads, head_size, intermediate_size, eps, draft_vocab_size)
        if not aux_layers:
            raise ValueError("an EAGLE-3 draft model reads at least one target layer (aux_layers is empty)")
        self.aux_layers = tuple(int(index) for index in aux_layers)
        self.aux_norms = nn.ModuleList(RMSNorm(hidden_size, eps) for _ in self.aux_layers)
        self.aux_fc = nn.Linear(len(self.aux_layers) * hidden_size, hidden_size, bias=False)

    @classmethod
    def for_target(  # type: ignore[override]
        cls,
        parts: TargetParts,
        intermediate_size: int | None = None,
        draft_vocab_size: int | None = None,
        *,
        aux_layers: Sequence[int],
    ) -> Eagle3DraftModel:
        return cls(
            parts.hidden_size,
            parts.num_heads,
            parts.num_kv_heads,
            parts.head_size,
            intermediate_size or parts.intermediate_size,
            parts.rms_norm_eps,
            aux_layers,
            draft_vocab_size,
        )

    def sizes(self) -> dict[str, Any]:
        return {**super().sizes(), "aux_layers": list(self.aux_layers)}

    def target_features(self, target_inputs: torch.Tensor) -> torch.Tensor:
        """``aux_fc`` over the concatenated, each normed, layer outputs ``[..., len(aux_layers) * hidden]``."""
        chunks = target_inputs.chunk(len(self.aux_layers), dim=-1)
        return self.aux_fc(torch.cat([norm(chunk) for norm, chunk in zip(self.aux_norms, chunks, strict=True)], -1))


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """A low, a middle and a high layer of ``num_layers``, as vLLM's EAGLE-3 default ``(2, L // 2, L - 3)``.

    Clamped into the model so that shallow (test) models get valid indices too.
    """
    last = num_layers - 1
    return min(2, last), min(num_layers // 2, last), max(num_layers - 3, 0)


def repeat_kv(x: torch.Tensor, group: int) -> torch.Tensor:
    """``[..., T, kv_heads, D] -> [..., T, kv_heads * group, D]`` (query head ``h`` reads KV head ``h // group``)."""
    return x if group == 1 else x.repeat_interleave(group, dim=-2)
