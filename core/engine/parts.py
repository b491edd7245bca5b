"""What an engine steps, as built from settings (:class:`EngineParts`), and the settings resolved on the way
that the engine and the ranks read again."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from patchbay.contract.settings import Settings
from patchbay.engine.admission import AdmissionLimits
from patchbay.engine.kv_sizing import KVSizing
from patchbay.engine.pooling import PoolingRun
from patchbay.engine.ranks import ParallelRanks
from patchbay.interfaces import KVConnector
from patchbay.scheduling.kv_cache_manager import KVCacheManager
from patchbay.scheduling.kv_cache_spec import KVCacheGroup
from patchbay.scheduling.scheduler import Scheduler
from patchbay.scheduling.structured_output import GrammarCompilations
from patchbay.worker.cpu.fused_modules import FusedModules
from patchbay.worker.cpu.tuning import LinearPaths, Tuning
from patchbay.worker.lora.manager import LoRAManager
from patchbay.worker.model.hf_model import HFCausalLM
from patchbay.worker.model_runner import ModelRunner
from patchbay.worker.parallel.torchrun import torchrun_launch


def ranks_on_this_machine(settings: Settings) -> int:
    """The run's ranks whose memory this machine holds: all of them, or torchrun's ``LOCAL_WORLD_SIZE``."""
    launch = torchrun_launch()
    return launch.local_world_size if launch is not None else settings.runtime.world_size


def single_thread_max_tokens(setting: int | str, dtype: str, tuning: Tuning | None) -> int:
    """``runtime.single_thread_max_tokens`` resolved: ``auto`` is the tuning's limit for ``dtype`` (0 without one)."""
    if setting != "auto":
        return int(setting)
    return tuning.single_thread_max_tokens.get(dtype, 0) if tuning is not None else 0


def pipeline_depth(settings: Settings) -> int:
    """Batches in flight at once: one per pipeline stage; 1 with one stage, or with a KV connector (every rank
    joins its transfer reports with the others' after each batch, so the stages go in lockstep)."""
    return settings.runtime.pipeline_parallel_size if settings.kv_connector is None else 1


@dataclass
class EngineParts:
    """Everything an engine steps, built from settings by :func:`patchbay.engine.builder.build_engine_parts` and
    checked to fit together."""

    device: torch.device
    dtype: str
    """``model.dtype`` resolved (``auto``: see :func:`patchbay.engine.builder.resolve_dtype`)."""
    tuning: Tuning | None
    """The CPU's measured defaults, when a setting is left to them (``None``: none were needed)."""
    heap: str
    """What was done to the allocator (for the run summary)."""
    model_dir: Path
    tokenizer: Any
    ranks: ParallelRanks | None
    """The other ranks: tensor-parallel shards or pipeline stages (``None``: this process runs the whole model)."""
    model: HFCausalLM
    quantized_linears: int
    linear_paths: LinearPaths
    fused_modules: FusedModules
    max_model_len: int
    groups: list[KVCacheGroup]
    backend_name: str
    num_blocks: int
    kv_sizing: KVSizing | None
    """How ``cache.memory: auto`` sized the KV pool (``None``: sized by ``cache.memory`` or ``num_blocks``)."""
    kv_connector: KVConnector | None
    kv_cache_manager: KVCacheManager
    grammars: GrammarCompilations
    scheduler: Scheduler
    runner: ModelRunner
    single_thread_max_tokens: int
    limits: AdmissionLimits
    lora: LoRAManager | None
    """The LoRA adapter slots (``None``: no ``lora:`` section, so requests naming an adapter are refused)."""
    pooling: PoolingRun | None = None
    """A pooling run's task and limits (``None``: the run generates)."""
