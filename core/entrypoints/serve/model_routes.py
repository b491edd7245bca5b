"""The models API: ``GET /v1/models`` and vLLM's runtime loading and unloading of LoRA adapters.

``/v1/models`` lists the base model and its LoRA adapters; runtime updates are
vLLM's ``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter``.

The updates are off unless ``lora.allow_runtime_updates`` is set (they answer 404
saying so) and sit behind the API key.  Each change runs in the engine
thread between steps, so no step sees half an adapter.  Unloading an adapter
that unfinished requests use is refused with 409 (the client retries once
they finish) rather than waiting or aborting them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from patchbay.engine import AdapterExistsError, AdapterInUseError, LoRAAdapterError, UnknownAdapterError
from patchbay.entrypoints.serve.protocol import APIError
from patchbay.entrypoints.serve.state import ServerState

if TYPE_CHECKING:
    from patchbay.engine import Engine


class LoadLoRAAdapterRequest(BaseModel):
    """vLLM's body: the name requests will use as ``model`` and the adapter's PEFT directory on the server."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(BaseModel):
    """vLLM's body: the adapter to stop serving (``lora_int_id`` is accepted and ignored, as names identify)."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None


def model_router(state: ServerState, dependencies: list[Any]) -> APIRouter:
    """The routes of the models API over ``state`` (each behind ``dependencies``: the API key)."""
    router = APIRouter(dependencies=dependencies)

    @router.get("/v1/models")
    async def models() -> dict[str, Any]:
        base = {
            "id": state.model_name,
            "object": "model",
            "created": state.created,
            "owned_by": "patchbay",
            "max_model_len": state.llm.max_model_len,
        }
        adapters = [{**base, "id": name, "parent": state.model_name, "root": name} for name in state.adapter_names()]
        return {"object": "list", "data": [base, *adapters]}

    @router.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> JSONResponse:
        _check_enabled(state)
        name = body.lora_name
        if name == state.model_name:
            raise APIError(400, f"lora_name: {name!r} is the base model's name", param="lora_name")

        def load(engine: Engine) -> None:
            engine.load_lora_adapter(name, body.lora_path)

        await _change(state, load, name)
        return JSONResponse({"status": "loaded", "lora_name": name}, status_code=200)

    @router.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> JSONResponse:
        _check_enabled(state)
        name = body.lora_name

        def unload(engine: Engine) -> None:
            engine.unload_lora_adapter(name)

        await _change(state, unload, name)
        return JSONResponse({"status": "unloaded", "lora_name": name}, status_code=200)

    return router


def _check_enabled(state: ServerState) -> None:
    section = state.settings.lora
    if section is None:
        raise APIError(
            404, "runtime LoRA updates need a lora: section (with allow_runtime_updates: true)", code="not_found"
        )
    if not section.allow_runtime_updates:
        raise APIError(
            404, "runtime LoRA updates are off; set lora.allow_runtime_updates: true to enable them", code="not_found"
        )


async def _change(state: ServerState, change: Any, name: str) -> None:
    """Run ``change(engine)`` in the engine thread; the adapter errors become OpenAI-shaped answers."""
    try:
        await state.llm.call(change)
    except UnknownAdapterError as exc:
        raise APIError(404, str(exc), param="lora_name", code="lora_adapter_not_found") from None
    except AdapterInUseError as exc:
        raise APIError(409, str(exc), param="lora_name", code="lora_adapter_in_use") from None
    except AdapterExistsError as exc:
        raise APIError(400, str(exc), param="lora_name", code="lora_adapter_exists") from None
    except LoRAAdapterError as exc:
        raise APIError(400, str(exc), param="lora_path", code="invalid_lora_adapter") from None
