"""``POST /v1/completions/render`` and ``/v1/chat/completions/render``: a request's prompt token ids, nothing run.

vLLM serves these so that a router can see the tokens a request will run
before it picks a replica: vLLM's router asks a worker for them and routes by
the token prefix (``cache_aware``) or by the blocks each replica's KV-cache
events say it holds (``kv_aware``).  The answers take vLLM's shape: a list of
``{"request_id", "token_ids", "model"}`` per prompt for completions, one such
object for chat.  Chat image parts are a 400, as in ``/tokenize``.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence
from typing import Any

from fastapi import APIRouter, Request

from patchbay.entrypoints.chat import ChatRequestError, render_chat, template_messages
from patchbay.entrypoints.serve.json_body import read_json_body
from patchbay.entrypoints.serve.protocol import APIError, ChatCompletionRequest, CompletionRequest
from patchbay.entrypoints.serve.state import ServerState


def render_router(state: ServerState, dependencies: Sequence[Any]) -> APIRouter:
    """The two render routes over ``state`` (each behind ``dependencies``: the API key)."""
    router = APIRouter(dependencies=list(dependencies))
    llm = state.llm

    def rendered(token_ids: list[int]) -> dict[str, Any]:
        return {"request_id": f"render-{uuid.uuid4().hex}", "token_ids": token_ids, "model": state.model_name}

    @router.post("/v1/completions/render")
    async def render_completion(request: Request) -> list[dict[str, Any]]:
        body = await read_json_body(request, CompletionRequest)
        state.adapter_for(body.model)
        prompts = body.prompts()
        encoded = await asyncio.to_thread(lambda: [llm.encode(prompt)[1] for prompt in prompts])
        return [rendered(token_ids) for token_ids in encoded]

    @router.post("/v1/chat/completions/render")
    async def render_chat_completion(request: Request) -> dict[str, Any]:
        body = await read_json_body(request, ChatCompletionRequest)
        state.adapter_for(body.model)
        for index, message in enumerate(body.messages):
            if message.has_parts_other_than_text():
                where = f"messages.{index}.content"
                raise APIError(400, f"{where}: rendering takes text parts only", param=where)
        try:
            messages = template_messages([m.as_template_message(i) for i, m in enumerate(body.messages)])
            _, token_ids = await asyncio.to_thread(
                render_chat, llm.tokenizer, messages, tools=body.tools, template=state.chat.template
            )
        except ChatRequestError as exc:
            raise APIError(400, str(exc), param=exc.param) from None
        return rendered(token_ids)

    return router
