"""``GET /version``: the patchbay release serving, as vLLM answers it (``{"version": "0.1.0"}``).

Like ``/health`` it needs no API key: probes and dashboards read it before they hold one.
"""

from __future__ import annotations

from fastapi import FastAPI

import patchbay


def add_version_route(app: FastAPI) -> None:
    """Serve ``GET /version`` on ``app``."""

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": patchbay.__version__}
