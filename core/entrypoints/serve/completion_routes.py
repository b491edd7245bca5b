"""The chat and completions API: completions, chat completions, and vLLM's tokenize and detokenize.

``POST /v1/completions``, ``POST /v1/chat/completions``, ``POST /tokenize`` and
``POST /detokenize`` (for the same prompts), with their response shapes.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from patchbay.engine import RequestOutput
from patchbay.entrypoints.chat import (
    AnswerReader,
    AnswerStream,
    ChatRequestError,
    plan_tools,
    template_messages,
)
from patchbay.entrypoints.chat_images import refuse_images_for_text_model, split_image_parts
from patchbay.entrypoints.serve.answering import ResponseFormat, check_admission, json_logprob, respond, usage_of
from patchbay.entrypoints.serve.prompts import (
    PreparedPrompt,
    RenderedChat,
    enforce_tool_choice,
    prepare_chat,
    prepare_prompt,
    render_with_images,
)
from patchbay.entrypoints.serve.json_body import read_json_body
from patchbay.entrypoints.serve.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    check_unicode,
)
from patchbay.entrypoints.serve.state import ServerState
from patchbay.multimodal.images import ImageInputError


def completion_router(state: ServerState, dependencies: list[Any]) -> APIRouter:
    """The routes of the chat and completions API over ``state`` (each behind ``dependencies``: the API key)."""
    router = APIRouter(dependencies=dependencies)
    llm = state.llm

    @router.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        state.adapter_for(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", param="prompt")
        if body.messages is not None:
            for index, message in enumerate(body.messages):
                if message.has_parts_other_than_text():
                    where = f"messages.{index}.content"
                    raise APIError(400, f"{where}: /tokenize takes text parts only", param=where)
            messages = [m.as_template_message(i) for i, m in enumerate(body.messages)]
            _, token_ids = await asyncio.to_thread(llm.encode, {"messages": messages})
        else:
            token_ids = await asyncio.to_thread(
                llm.tokenizer.encode, body.prompt, add_special_tokens=body.add_special_tokens
            )
        return {"tokens": token_ids, "count": len(token_ids), "max_model_len": llm.max_model_len}

    @router.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        state.adapter_for(body.model)
        vocab = len(llm.tokenizer)
        bad = [token for token in body.tokens if not 0 <= token < vocab]
        if bad:
            raise APIError(400, f"tokens: ids outside the vocabulary (0..{vocab - 1}): {bad[:5]}", param="tokens")
        return {"prompt": llm.tokenizer.decode(body.tokens)}

    @router.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await read_json_body(request, CompletionRequest)
        adapter = state.adapter_for(body.model)
        body.check_supported()
        fields = {**body.sampling_fields(), "lora": adapter}
        prompts = body.prompts()
        # Counted before tokenizing: a list of 200k tiny prompts is refused without encoding any of them.
        check_admission(state, len(prompts) * (body.n or 1))
        # Tokenized off the event loop: a huge prompt must not stall every other client (/health included).
        encoded = await asyncio.to_thread(lambda: [llm.encode(prompt) for prompt in prompts])
        prepared = [
            prepare_prompt(state, text, token_ids, fields, body.max_tokens, "prompt") for text, token_ids in encoded
        ]
        return await respond(state, request, body.stream, body.stream_options, prepared, CompletionFormat(state))

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await read_json_body(request, ChatCompletionRequest)
        adapter = state.adapter_for(body.model)
        body.check_supported()
        rendered: RenderedChat | None = None
        try:
            try:
                plan = plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls)
                tool_parser, reasoning_parser = state.chat.for_request(body.tool_parser, body.reasoning_parser)
                messages, image_parts = split_image_parts(
                    template_messages([message.as_template_message(i) for i, message in enumerate(body.messages)])
                )
                await asyncio.to_thread(check_unicode, body)  # what the message checks above do not name
                if image_parts and llm.engine.image_inputs is None:
                    refuse_images_for_text_model(image_parts, state.model_name)
                # Off the event loop: rendering on the default executor, images on the server's image pool.
                rendered = await render_with_images(state, messages, body.tools, image_parts)
                fields = {**body.sampling_fields(), "lora": adapter}
                await enforce_tool_choice(state, plan, fields, "response_format")
            except ChatRequestError as exc:
                raise APIError(400, str(exc), param=exc.param) from None
            except ImageInputError as exc:
                raise APIError(400, str(exc), param=exc.where) from None
            prepared = [prepare_chat(state, rendered, fields, body.output_limit(), "messages")]
            reader = AnswerReader(plan, tool_parser, reasoning_parser)
            return await respond(state, request, body.stream, body.stream_options, prepared, ChatFormat(state, reader))
        except BaseException:
            if rendered is not None:
                rendered.release()
            raise

    return router


# -- response shapes -------------------------------------------------------------------------------------


class CompletionFormat(ResponseFormat):
    id_prefix = "cmpl"
    object_name = chunk_object_name = "text_completion"

    def logprobs(self, entries: list[Any] | None, text_offset: int) -> dict[str, Any] | None:
        if entries is None:
            return None
        tokens, token_logprobs, top, offsets = [], [], [], []
        for entry in entries:
            token = self.token_text(entry.token_ids[0])
            offsets.append(text_offset)
            text_offset += len(token)
            tokens.append(token)
            token_logprobs.append(json_logprob(entry.logprobs[0]))
            top.append(
                {
                    self.token_text(t): json_logprob(lp)
                    for t, lp in zip(entry.token_ids[1:], entry.logprobs[1:], strict=True)
                }
            )
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}

    def chunk(self, response_id: str, prepared: list[PreparedPrompt], prompt_index: int, choice: Any) -> dict[str, Any]:
        return self.envelope(
            response_id,
            [
                {
                    "index": self.choice_index(prepared, prompt_index, choice.index),
                    "text": choice.text,
                    "logprobs": self.logprobs(choice.logprobs, 0),
                    "finish_reason": choice.finish_reason,
                    "stop_reason": choice.stop_reason,
                }
            ],
        )

    def response(
        self, response_id: str, prepared: list[PreparedPrompt], outputs: list[RequestOutput]
    ) -> dict[str, Any]:
        choices = [
            {
                "index": self.choice_index(prepared, p, c.index),
                "text": c.text,
                "logprobs": self.logprobs(c.logprobs, 0),
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
            for p, output in enumerate(outputs)
            for c in output.completions
        ]
        return self.envelope(response_id, choices, chunk=False, usage=usage_of(prepared, list(outputs)))


class ChatFormat(ResponseFormat):
    id_prefix = "chatcmpl"
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def logprobs(self, entries: list[Any] | None) -> dict[str, Any] | None:
        if entries is None:
            return None

        def item(token_id: int, logprob: float) -> dict[str, Any]:
            token = self.token_text(token_id)
            return {"token": token, "logprob": json_logprob(logprob), "bytes": list(token.encode())}

        return {
            "content": [
                {
                    **item(entry.token_ids[0], entry.logprobs[0]),
                    "top_logprobs": [
                        item(t, lp) for t, lp in zip(entry.token_ids[1:], entry.logprobs[1:], strict=True)
                    ],
                }
                for entry in entries
            ]
        }

    def __init__(self, state: ServerState, reader: AnswerReader) -> None:
        super().__init__(state)
        self.reader = reader
        self._streams: dict[int, AnswerStream] = {}
        self._called: set[int] = set()
        """Choices that streamed a tool call (their ``stop`` is reported as ``tool_calls``)."""

    def first_chunks(self, response_id: str, prepared: list[PreparedPrompt]) -> list[dict[str, Any]]:
        return [
            self.envelope(
                response_id,
                [
                    {
                        "index": index,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ],
            )
            for index in range(sum(p.params.n for p in prepared))
        ]

    def chunk(self, response_id: str, prepared: list[PreparedPrompt], prompt_index: int, choice: Any) -> dict[str, Any]:
        index = self.choice_index(prepared, prompt_index, choice.index)
        stream = self._streams.get(index)
        if stream is None:  # once per choice: setdefault would build (and drop) a new stream on every chunk
            stream = self._streams[index] = self.reader.stream()
        answer = stream.feed(choice.text)
        pieces = list(answer.tool_calls)
        content, reasoning = answer.content, answer.reasoning
        if choice.finish_reason is not None:
            last = stream.finish()
            content, reasoning = content + last.content, reasoning + last.reasoning
            pieces += last.tool_calls
        delta: dict[str, Any] = {}
        if content or (choice.finish_reason is None and not reasoning and not pieces):
            delta["content"] = content
        if reasoning:
            delta["reasoning_content"] = reasoning
        if pieces:
            delta["tool_calls"] = [piece.as_openai() for piece in pieces]
            self._called.add(index)
        return self.envelope(
            response_id,
            [
                {
                    "index": index,
                    "delta": delta,
                    "logprobs": self.logprobs(choice.logprobs),
                    "finish_reason": _finish_reason(choice.finish_reason, index in self._called),
                    "stop_reason": choice.stop_reason,
                }
            ],
        )

    def response(
        self, response_id: str, prepared: list[PreparedPrompt], outputs: list[RequestOutput]
    ) -> dict[str, Any]:
        choices = []
        for p, output in enumerate(outputs):
            for c in output.completions:
                answer = self.reader.read(c.text)
                message: dict[str, Any] = {"role": "assistant", "content": answer.content}
                if self.reader.reasoning_parser is not None:
                    message["reasoning_content"] = answer.reasoning
                if answer.tool_calls:
                    message["tool_calls"] = [call.as_openai() for call in answer.tool_calls]
                choices.append(
                    {
                        "index": self.choice_index(prepared, p, c.index),
                        "message": message,
                        "logprobs": self.logprobs(c.logprobs),
                        "finish_reason": _finish_reason(c.finish_reason, bool(answer.tool_calls)),
                        "stop_reason": c.stop_reason,
                    }
                )
        return self.envelope(response_id, choices, chunk=False, usage=usage_of(prepared, list(outputs)))


def _finish_reason(reason: str | None, called: bool) -> str | None:
    """OpenAI reports an answer that ends in tool calls as ``tool_calls``."""
    return "tool_calls" if called and reason == "stop" else reason
