"""Starlette's own HTTP errors (a body that is not JSON or nested too deeply, a wrong method, an unknown route)
answered in OpenAI's ``{"error": ...}`` shape instead of FastAPI's ``{"detail": ...}``."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from patchbay.entrypoints.serve.protocol import APIError


def answer_http_errors_in_openai_shape(app: FastAPI) -> None:
    """Register the handler on ``app``: same status and message, OpenAI's body."""

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, exc: HTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 400 and "parsing the body" in message:
            message = "the body is not valid JSON, or is nested too deeply"
        return JSONResponse(
            APIError(exc.status_code, message).body(),
            status_code=exc.status_code,
            headers=getattr(exc, "headers", None),
        )
