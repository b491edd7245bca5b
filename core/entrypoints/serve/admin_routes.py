"""The operator's routes, without the API key: ``GET /health``, ``GET /ready`` and ``GET /metrics``.

``/health`` says whether the engine is alive, ``/ready`` whether it also takes
requests (not shutting down), ``/metrics`` is Prometheus' text format.
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from patchbay.entrypoints.serve.state import ServerState


def admin_router(state: ServerState) -> APIRouter:
    """The operator's routes over ``state``."""
    router = APIRouter()
    llm = state.llm

    @router.get("/health")
    async def health() -> Response:
        if not llm.alive:
            return JSONResponse({"status": "dead", "error": str(llm.error)}, status_code=503)
        return JSONResponse({"status": "ok"})

    @router.get("/ready")
    async def ready() -> Response:
        if not llm.alive or not state.accepting:
            return JSONResponse({"status": "not ready"}, status_code=503)
        return JSONResponse({"status": "ready"})

    @router.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return router
