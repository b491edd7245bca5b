"""Building an engine's parts from settings, and checking them against each other before the first step.

In order: the process (threads, allocator, seed), the device, the CPU's
tuning and the dtype; the other ranks (tensor-parallel shards or pipeline
stages) when the run has several; then rank 0's model, the attention backend
and sampler chosen and checked, the KV pool sized and checked against free
memory, the drafter and KV connector checked, and the KV cache manager,
grammars, scheduler and model runner built.  :func:`build_engine_parts`
returns them as :class:`EngineParts`; :class:`patchbay.engine.engine.Engine`
steps them.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from patchbay.contract.registry import Registry
from patchbay.contract.selection import select_architecture
from patchbay.contract.settings import ConfigError, ConfigProblem, Settings
from patchbay.engine.parts import EngineParts
from patchbay.engine.rank_zero import RankZeroBuild
from patchbay.engine.ranks import ParallelRanks, check_parallel
from patchbay.interfaces import WeightFormatConfig
from patchbay.worker.parallel import distributed
from patchbay.worker.cpu.caching_allocator import set_up_heap
from patchbay.worker.cpu.quantization import rounds_activations_to_int8
from patchbay.worker.model.checkpoints import ResolvedModel, resolve_model, run_model_dir
from patchbay.worker.parallel.pipeline_parallel import stage_layout
from patchbay.worker.runner_build import (
    check_lora_layout,
)
from patchbay.worker.model.architectures import architecture_config
from patchbay.worker.parallel.tensor_parallel import shard_layout
from patchbay.worker.cpu.tuning import LayerShapes, Tuning, tune

logger = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    """``auto`` is CUDA when available, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError) as exc:
        raise ConfigError(
            [
                ConfigProblem(
                    "<run>", "runtime.device", f"{name!r} is not a device (auto, cpu, cuda, cuda:1, ...): {exc}"
                )
            ]
        ) from None
    if device.type not in ("cpu", "cuda"):
        raise ConfigError([ConfigProblem("<run>", "runtime.device", f"{name!r}: patchbay runs on cpu or cuda")])
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError([ConfigProblem("<run>", "runtime.device", f"{name!r} requested but CUDA is not available")])
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ConfigError(
            [
                ConfigProblem(
                    "<run>", "runtime.device", f"{name!r}: this machine has {torch.cuda.device_count()} CUDA devices"
                )
            ]
        )
    return device


def resolve_dtype(name: str, device: torch.device, tuning: Tuning | None, integer_products: bool = False) -> str:
    """``auto`` is bfloat16 on GPUs; on a CPU, what its tuning measured fastest among its native dtypes, except
    that with ``integer_products`` (every product runs integer tiles that round activations to int8 themselves,
    so their speed does not depend on the dtype) a CPU that computes bfloat16 natively gets bfloat16: the KV
    cache, the attention and the ops between products then read half float32's bytes."""
    if name != "auto":
        return name
    if device.type != "cpu":
        return "bfloat16"
    if tuning is None:
        return "float32"
    if integer_products and "bfloat16" in tuning.native_dtypes:
        return "bfloat16"
    return tuning.dtype


def machine_tuning(settings: Settings, model_dir: Path, device: torch.device) -> Tuning | None:
    """The CPU's measured defaults (cached per machine and model shape) when a setting is left to them."""
    runtime = settings.runtime
    if device.type != "cpu" or not (
        settings.model.dtype == "auto"
        or runtime.linear_kernel == "auto"
        or runtime.fuse_projections
        or runtime.single_thread_max_tokens == "auto"
    ):
        return None
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    return tune(LayerShapes.of(getattr(config, "text_config", config)))


def measure_machine_defaults(settings: Settings, registry: Registry, fresh: bool = True) -> Tuning:
    """``patchbay tune``: measure this CPU's defaults for the settings' model now, replacing the cached ones
    (``fresh=False``: only where none are cached)."""
    from transformers import AutoConfig

    if settings.runtime.threads is not None:
        torch.set_num_threads(settings.runtime.threads)
    config = AutoConfig.from_pretrained(run_model_dir(settings, registry))
    return tune(LayerShapes.of(getattr(config, "text_config", config)), fresh=fresh)


def _rounds_activations(resolved: ResolvedModel) -> bool:
    """Whether the run's products round their activations to int8 themselves (so ``model.dtype: auto`` needs
    not pick the fastest float products)."""
    if resolved.weight_format is None:
        return False
    scheme = resolved.weight_format.worker_scheme()
    if scheme is not None:
        return rounds_activations_to_int8(scheme)
    return resolved.weight_format.capabilities.integer_activations


def build_engine_parts(settings: Settings, registry: Registry) -> EngineParts:
    """Build the run's parts (starting the other ranks when it has several); a :class:`ConfigError` names the
    setting a part cannot serve.  A failure after the ranks started ends them."""
    from transformers import AutoTokenizer

    import patchbay

    if patchbay.OMP_POLICY_TOO_LATE:
        logger.warning(
            "torch was imported before patchbay, so OpenMP threads busy-wait; with another busy "
            "process on the machine steps can be ~10x slower. Import patchbay first or set "
            "OMP_WAIT_POLICY=PASSIVE before starting Python."
        )
    threads = distributed.rank_threads(settings)
    if threads is not None:
        torch.set_num_threads(threads)
    heap = set_up_heap(settings.runtime.cpu_allocator)
    torch.manual_seed(settings.runtime.seed)
    device = resolve_device(settings.runtime.device)
    resolved = resolve_model(
        settings.model.path,
        settings.model.weight_format,
        registry,
        WeightFormatConfig(device=device.type, tensor_parallel_size=settings.runtime.tensor_parallel_size),
    )
    model_dir = resolved.model_dir
    tuning = machine_tuning(settings, model_dir, device)
    integer_products = device.type == "cpu" and _rounds_activations(resolved)
    dtype = resolve_dtype(settings.model.dtype, device, tuning, integer_products)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ranks = _start_ranks(settings, registry, model_dir, device, dtype, tuning)
    try:
        return RankZeroBuild(
            settings,
            registry,
            device=device,
            dtype=dtype,
            tuning=tuning,
            heap=heap,
            model_dir=model_dir,
            tokenizer=tokenizer,
            ranks=ranks,
        ).build()
    except BaseException:
        if ranks is not None:
            ranks.close()
        raise


def _start_ranks(
    settings: Settings, registry: Registry, model_dir: Path, device: torch.device, dtype: str, tuning: Tuning | None
) -> ParallelRanks | None:
    """Check the parallel layout and start the other ranks; ``None`` when this process runs the whole model."""
    if settings.runtime.world_size == 1:
        return None
    from transformers import AutoConfig

    check_parallel(settings, device)
    if settings.lora is not None:
        check_lora_layout(settings)
    config = AutoConfig.from_pretrained(model_dir)
    if settings.runtime.tensor_parallel_size > 1:
        # The architecture plugin must declare it shards the model, before any rank starts to load it.
        wanted = architecture_config(
            config, device=device, dtype=dtype, tensor_parallel_size=settings.runtime.tensor_parallel_size
        )
        select_architecture(registry, settings.model.architecture.name, wanted)
        shard_layout(config, settings.runtime.tensor_parallel_size)
    if settings.runtime.pipeline_parallel_size > 1:
        stage_layout(config, settings.runtime.pipeline_parallel_size, settings.runtime.pipeline_layer_partition)
    return ParallelRanks(settings, model_dir, device=device, dtype=dtype, tuning=tuning)
