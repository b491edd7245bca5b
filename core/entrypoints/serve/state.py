"""What every router of the server shares: the engine, the settings, admission counts, metrics, model names."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from patchbay.contract.settings import DEFAULT_MODEL, Settings
from patchbay.engine import AsyncLLM
from patchbay.entrypoints.chat import ChatParsers
from patchbay.entrypoints.serve.images import ServerImages
from patchbay.entrypoints.serve.metrics import ServerMetrics
from patchbay.entrypoints.serve.protocol import APIError

BUNDLED_MODEL_NAME = "SmolLM2-135M-Instruct"
"""What clients call the bundled model (``model.path: default``)."""


def model_name_of(settings: Settings) -> str:
    """``server.served_model_name``, else the model directory's name."""
    if settings.server.served_model_name:
        return settings.server.served_model_name
    if settings.model.path == DEFAULT_MODEL:
        return BUNDLED_MODEL_NAME
    return Path(settings.model.path).name


@dataclass
class ServerState:
    """What the routes share: the engine front end, the settings, admission and metrics."""

    llm: AsyncLLM
    settings: Settings
    model_name: str
    metrics: ServerMetrics
    chat: ChatParsers
    images: ServerImages
    """The pool images are read and decoded on, and the bytes they hold (:mod:`.images`)."""
    admitted: int = 0
    """Sequences of the requests in flight, counted on admission (before the engine sees them)."""
    accepting: bool = True
    grace_over: bool = False
    """The shutdown's grace period is over: requests in flight were aborted (non-streamed ones get a 503)."""
    created: int = field(default_factory=lambda: int(time.time()))
    compiled_tool_constraints: dict[str, None] = field(default_factory=dict)
    """Keys of tool constraints known to compile (insertion-ordered, bounded), so each is checked once."""

    @property
    def admission_limit(self) -> int:
        """Sequences the server holds at once: ``scheduler.max_num_seqs + server.max_waiting``."""
        return self.settings.scheduler.max_num_seqs + self.settings.server.max_waiting

    def adapter_names(self) -> list[str]:
        """The LoRA adapters clients may name as ``model`` (none without a ``lora:`` section)."""
        lora = self.llm.engine.lora
        return lora.catalog.known_names() if lora is not None else []

    def adapter_for(self, model: str | None) -> str | None:
        """The LoRA adapter a request's ``model`` names (``None``: the base model); 404 for a name nobody serves."""
        if model is None or model == self.model_name:
            return None
        lora = self.llm.engine.lora
        if lora is not None:
            try:
                lora.catalog.path_of(model)
                return model
            except LookupError:
                pass
        adapters = f" and LoRA adapters {', '.join(self.adapter_names())}" if lora is not None else ""
        raise APIError(
            404,
            f"model {model!r} does not exist; this server serves {self.model_name!r}{adapters}",
            param="model",
            code="model_not_found",
        )
