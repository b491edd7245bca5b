"""The application factory: one FastAPI app over an :class:`AsyncLLM`, built from one router per API.

:func:`build_app` makes the routers' shared :class:`ServerState`, answers
every error in OpenAI's shape and mounts the routers: chat and completions
(:mod:`.completion_routes`), the Responses API (:mod:`.response_routes`),
models and LoRA adapters (:mod:`.model_routes`), embeddings, scores and classes
(:mod:`.pooling_routes`), vLLM's render routes for routers (:mod:`.render_routes`),
all behind the API key, and
the operator's health and metrics (:mod:`.admin_routes`) without it.
"""

from __future__ import annotations

import logging

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from patchbay.contract.registry import registry_for
from patchbay.contract.settings import DEFAULT_MODEL, Settings
from patchbay.engine import AsyncLLM
from patchbay.entrypoints.chat import ChatParsers
from patchbay.entrypoints.serve.admin_routes import admin_router
from patchbay.entrypoints.serve.completion_routes import completion_router
from patchbay.entrypoints.serve.images import ServerImages
from patchbay.entrypoints.serve.http_errors import answer_http_errors_in_openai_shape
from patchbay.entrypoints.serve.keys import api_key_check
from patchbay.entrypoints.serve.metrics import ServerMetrics
from patchbay.entrypoints.serve.model_routes import model_router
from patchbay.entrypoints.serve.pooling_routes import add_pooling_routes
from patchbay.entrypoints.serve.protocol import APIError
from patchbay.entrypoints.serve.render_routes import render_router
from patchbay.entrypoints.serve.response_routes import response_router
from patchbay.entrypoints.serve.state import ServerState, model_name_of
from patchbay.entrypoints.serve.version_route import add_version_route

logger = logging.getLogger(__name__)


def build_app(llm: AsyncLLM, settings: Settings) -> FastAPI:
    """The application serving ``llm``; the caller owns ``llm`` (and shuts it down)."""
    model_name = model_name_of(settings)
    chat = ChatParsers(settings, registry_for(settings.plugins), bundled_model=settings.model.path == DEFAULT_MODEL)
    images = ServerImages(settings.multimodal)
    state = ServerState(llm, settings, model_name, ServerMetrics(llm, model_name), chat, images)
    # No /docs, /redoc nor /openapi.json: they would answer without an API key.
    app = FastAPI(title="patchbay", version=_version(), docs_url=None, redoc_url=None, openapi_url=None)
    app.state.patchbay = state
    _answer_errors_in_openai_shape(app, state)
    authorized = [Depends(api_key_check(settings.server))]
    app.include_router(admin_router(state))
    app.include_router(model_router(state, authorized))
    app.include_router(completion_router(state, authorized))
    app.include_router(response_router(state, authorized))
    app.include_router(render_router(state, authorized))
    add_pooling_routes(app, state, authorized)
    add_version_route(app)
    return app


def _answer_errors_in_openai_shape(app: FastAPI, state: ServerState) -> None:
    """Every error as ``{"error": ...}``: ours (:class:`APIError`), a body pydantic refuses, and anything else."""
    answer_http_errors_in_openai_shape(app)

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        if exc.status in (429, 503):
            state.metrics.rejected.labels(state.model_name, str(exc.status)).inc()
        headers = {"Retry-After": "1"} if exc.status == 503 else None
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def body_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        error = exc.errors()[0]
        loc = [str(part) for part in error["loc"] if part != "body"]
        param = ".".join(loc) or None
        message = "unknown field" if error["type"] == "extra_forbidden" else error["msg"]
        return JSONResponse(
            APIError(400, f"{param}: {message}" if param else message, param=param).body(), status_code=400
        )

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("request failed")
        return JSONResponse(APIError(500, f"{type(exc).__name__}: {exc}").body(), status_code=500)


def _version() -> str:
    import patchbay

    return patchbay.__version__
