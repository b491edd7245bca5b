"""The engine joins the scheduler, the worker and the plugins, and turns each step into request outputs.

The names below are its public API, the only way the entry points reach it;
they import lazily so that ``patchbay --help`` does not pay for torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from patchbay.engine.admission import check_num_sequences
    from patchbay.engine.async_llm import AsyncLLM, ChoiceDelta, EngineSnapshot, RequestDelta
    from patchbay.engine.builder import measure_machine_defaults
    from patchbay.engine.detokenizer import IncrementalDetokenizer, StreamingText
    from patchbay.engine.engine import Engine, KVConnectorStalledError
    from patchbay.engine.kv_event_publisher import offset_port
    from patchbay.engine.multimodal_inputs import MultiModalInputError, ProcessedImages
    from patchbay.engine.outputs import Completion, RequestMetrics, RequestOutput
    from patchbay.engine.prompts import Prompt, encode_prompt
    from patchbay.engine.ranks import run_launched_rank
    from patchbay.engine.report import EngineReport, EngineStats
    from patchbay.engine.step_failures import EngineDeadError
    from patchbay.scheduling.structured_output import GrammarCompileBusy
    from patchbay.worker.lora.catalog import AdapterExistsError, AdapterInUseError, UnknownAdapterError
    from patchbay.worker.lora.peft_adapter import LoRAAdapterError
    from patchbay.toolkit.model_files import ModelLoadError

__all__ = [
    "AdapterExistsError",
    "AdapterInUseError",
    "AsyncLLM",
    "ChoiceDelta",
    "Completion",
    "Engine",
    "EngineDeadError",
    "EngineReport",
    "EngineSnapshot",
    "EngineStats",
    "GrammarCompileBusy",
    "IncrementalDetokenizer",
    "KVConnectorStalledError",
    "LoRAAdapterError",
    "ModelLoadError",
    "MultiModalInputError",
    "ProcessedImages",
    "Prompt",
    "RequestDelta",
    "RequestMetrics",
    "RequestOutput",
    "StreamingText",
    "UnknownAdapterError",
    "check_num_sequences",
    "encode_prompt",
    "measure_machine_defaults",
    "offset_port",
    "run_launched_rank",
]
_ASYNC = "patchbay.engine.async_llm"
_MODULE_OF = {
    "Engine": "patchbay.engine.engine",
    "KVConnectorStalledError": "patchbay.engine.engine",
    "EngineReport": "patchbay.engine.report",
    "EngineStats": "patchbay.engine.report",
    "ModelLoadError": "patchbay.toolkit.model_files",
    "MultiModalInputError": "patchbay.engine.multimodal_inputs",
    "ProcessedImages": "patchbay.engine.multimodal_inputs",
    "measure_machine_defaults": "patchbay.engine.builder",
    "AsyncLLM": _ASYNC,
    "ChoiceDelta": _ASYNC,
    "EngineSnapshot": _ASYNC,
    "EngineDeadError": "patchbay.engine.step_failures",
    "RequestDelta": _ASYNC,
    "IncrementalDetokenizer": "patchbay.engine.detokenizer",
    "StreamingText": "patchbay.engine.detokenizer",
    "Prompt": "patchbay.engine.prompts",
    "encode_prompt": "patchbay.engine.prompts",
    "run_launched_rank": "patchbay.engine.ranks",
    "offset_port": "patchbay.engine.kv_event_publisher",
    "check_num_sequences": "patchbay.engine.admission",
    "AdapterExistsError": "patchbay.worker.lora.catalog",
    "AdapterInUseError": "patchbay.worker.lora.catalog",
    "UnknownAdapterError": "patchbay.worker.lora.catalog",
    "LoRAAdapterError": "patchbay.worker.lora.peft_adapter",
    "GrammarCompileBusy": "patchbay.scheduling.structured_output",
}
"""Where each public name lives when it is not in :mod:`patchbay.engine.outputs`."""


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'patchbay.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_MODULE_OF.get(name, "patchbay.engine.outputs")), name)
