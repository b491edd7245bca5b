"""``POST /v1/responses`` (OpenAI's Responses API) and ``GET /v1/responses/{id}``.

A request becomes a chat conversation: ``instructions`` a system message,
``input`` (a text, or message, ``function_call`` and ``function_call_output``
items) the messages after the stored conversation ``previous_response_id``
names.  A message's ``input_image`` parts (``image_url`` a ``data:`` URL) are
images for a vision-language model, placed by the chat template as chat
completions' ``image_url`` parts are; errors name the ``input`` part.  Tools,
tool choice and answer reading are chat.py's (:func:`plan_tools`,
:class:`AnswerReader`); ``text.format`` is the run's structured output.  The
answer comes back as output items (``message``, ``function_call``,
``reasoning``), whole or as the API's stream events.

Answers are kept for ``previous_response_id`` in a bounded in-memory store
(``server.stored_responses``, least recently used dropped first) unless the
request says ``store: false``.
"""

from __future__ import annotations

import asyncio

import json
import time
import uuid
from collections import OrderedDict
from dataclasses import replace
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from patchbay.engine import RequestOutput
from patchbay.entrypoints.chat import (
    AnswerReader,
    ChatAnswer,
    ChatRequestError,
    plan_tools,
    template_messages,
)
from patchbay.entrypoints.chat_images import refuse_images_for_text_model, split_image_parts
from patchbay.entrypoints.serve.app import (
    ResponseFormat,
    ServerState,
    _check_model,
    _enforce_tool_choice,
    _prepare,
    _Prepared,
    _render_with_images,
    _respond,
)
from patchbay.entrypoints.serve.protocol import OPENAI_DEFAULT_TEMPERATURE, APIError, Number
from patchbay.multimodal.images import ImageInputError


class ResponsesRequest(BaseModel):
    """``POST /v1/responses``; other fields must be patchbay sampling parameters (as for chat)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: StrictBool | None = None
    text: dict[str, Any] | None = None
    max_output_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: Number | None = None
    top_p: Number | None = None
    stream: StrictBool = False
    store: StrictBool = True
    metadata: dict[str, str] | None = None
    include: list[str] | None = None
    """Accepted; patchbay has no extra output to include."""
    truncation: Literal["disabled"] | None = None
    """Only ``disabled``: a conversation too long for the model is a 400, never cut."""
    user: str | None = None
    """Accepted and ignored (OpenAI uses it for abuse monitoring)."""

    def sampling_fields(self) -> dict[str, Any]:
        fields: dict[str, Any] = {"temperature": OPENAI_DEFAULT_TEMPERATURE}
        for name in ("temperature", "top_p"):
            if getattr(self, name) is not None:
                fields[name] = getattr(self, name)
        fields.update(self.model_extra or {})
        constraint = self.structured_output()
        if constraint is not None:
            fields["structured_output"] = constraint
        return fields

    def structured_output(self) -> dict[str, Any] | None:
        """``text.format`` as patchbay's ``structured_output`` constraint (``None`` for plain text)."""
        text_format = (self.text or {}).get("format")
        if text_format is None:
            return None
        kind = text_format.get("type") if isinstance(text_format, dict) else None
        if kind == "text":
            return None
        if kind == "json_object":
            return {"json_object": True}
        if kind == "json_schema":
            if not isinstance(text_format.get("schema"), dict):
                raise APIError(400, "text.format.schema: a JSON schema object is required", param="text.format.schema")
            return {"json_schema": text_format["schema"]}
        raise APIError(
            400, f"text.format.type: {kind!r} is not one of text, json_object, json_schema", param="text.format.type"
        )


# -- the request as a chat conversation ----------------------------------------------------------------------


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses function tools (``{"type": "function", "name", "parameters"}``) in chat's shape."""
    if tools is None:
        return None
    found = []
    for index, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise APIError(
                400,
                f"tools.{index}.type: only function tools are supported, got {tool.get('type')!r}",
                param=f"tools.{index}.type",
            )
        function = {key: tool[key] for key in ("name", "description", "parameters") if tool.get(key) is not None}
        found.append({"type": "function", "function": function})
    return found


def chat_tool_choice(choice: Any) -> Any:
    """A Responses ``tool_choice`` in chat's shape (a named function is ``{"type": "function", "name"}``)."""
    if isinstance(choice, dict):
        if choice.get("type") != "function":
            raise APIError(
                400,
                f"tool_choice.type: only 'function' is supported, got {choice.get('type')!r}",
                param="tool_choice.type",
            )
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def responses_param(param: str) -> str:
    """A chat field as the Responses API names it (``tools.0.function.name`` -> ``tools.0.name``)."""
    return param.replace(".function", "")


def input_messages(items: str | list[dict[str, Any]], known_calls: set[str]) -> list[dict[str, Any]]:
    """``input`` as chat messages; ``known_calls`` (the call ids made so far) grows with the calls it makes."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for index, item in enumerate(items):
        where = f"input.{index}"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise ChatRequestError(f"{where}.role", f"{role!r} is not one of user, assistant, system, developer")
            messages.append(
                {
                    "role": "system" if role == "developer" else role,
                    "content": _message_content(item.get("content"), f"{where}.content"),
                }
            )
        elif kind == "function_call":
            call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments", "{}")
            for field_name, value in (("call_id", call_id), ("name", name), ("arguments", arguments)):
                if not isinstance(value, str):
                    raise ChatRequestError(f"{where}.{field_name}", "a string is required")
            try:
                json.loads(arguments or "{}")
            except json.JSONDecodeError as exc:
                raise ChatRequestError(f"{where}.arguments", f"not valid JSON: {exc}") from None
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            if messages and messages[-1]["role"] == "assistant" and messages[-1].get("tool_calls"):
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            known_calls.add(str(call_id))  # checked to be a string above
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if call_id not in known_calls:
                made = ", ".join(sorted(known_calls)) or "none"
                raise ChatRequestError(
                    f"{where}.call_id",
                    f"{call_id!r} answers no function_call made earlier in the conversation (calls: {made})",
                )
            messages.append(
                {"role": "tool", "tool_call_id": call_id, "content": _text_of(item.get("output"), f"{where}.output")}
            )
        elif kind == "reasoning":
            continue  # the model's own earlier thinking; chat templates leave it out of the prompt
        else:
            raise ChatRequestError(
                f"{where}.type", f"{kind!r} is not one of message, function_call, function_call_output, reasoning"
            )
    return messages


def _message_content(content: Any, where: str) -> str | list[dict[str, Any]]:
    """A message's content for the chat template: its text, or, with ``input_image`` parts, chat parts (text
    and ``image_url``, each image carrying the ``input`` field it came from, to name it in errors)."""
    if not isinstance(content, list) or not any(
        isinstance(part, dict) and part.get("type") == "input_image" for part in content
    ):
        return _text_of(content, where)
    parts: list[dict[str, Any]] = []
    for number, part in enumerate(content):
        at = f"{where}.{number}"
        if part.get("type") == "input_image":
            parts.append({"type": "image_url", "image_url": {"url": _image_url_of(part, at)}, IMAGE_ORIGIN: at})
        else:
            parts.append({"type": "text", "text": _part_text(part, at)})
    return parts


IMAGE_ORIGIN = "patchbay_input_field"
"""The key of a chat image part that records the ``input`` field it came from (``input.0.content.1``)."""


def _image_url_of(part: dict[str, Any], at: str) -> str:
    """An ``input_image`` part's URL: OpenAI's ``image_url`` string (a ``data:`` URL; ``file_id`` is refused)."""
    url = part.get("image_url")
    if isinstance(url, dict):  # the chat API's {"url": ...}, taken too
        url = url.get("url")
    if isinstance(url, str) and url:
        return url
    if part.get("file_id") is not None:
        raise ChatRequestError(f"{at}.file_id", "uploaded files are not supported; send image_url as a data: URL")
    raise ChatRequestError(f"{at}.image_url", 'an input_image part needs "image_url": "data:image/...;base64,..."')


def _part_text(part: Any, at: str) -> str:
    if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text"):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        raise ChatRequestError(f"{at}.type", f"a content part is input_text or input_image, got {kind!r}")
    text = part.get("text", "")
    if not isinstance(text, str):
        raise ChatRequestError(f"{at}.text", f"must be a string, got {type(text).__name__}")
    return text


def image_origins(messages: list[dict[str, Any]]) -> list[str]:
    """The ``input`` field of each image part of ``messages``, in prompt order (as chat parts find them)."""
    return [
        part[IMAGE_ORIGIN] + ".image_url"
        for message in messages
        if isinstance(message.get("content"), list)
        for part in message["content"]
        if isinstance(part, dict) and part.get("type") == "image_url"
    ]


def _text_of(content: Any, where: str) -> str:
    """A message's text: a string, or its text parts joined."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise ChatRequestError(where, f"must be a string or a list of text parts, got {type(content).__name__}")
    texts = []
    for number, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text"):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ChatRequestError(f"{where}.{number}.type", f"only text parts are supported, got {kind!r}")
        texts.append(str(part.get("text", "")))
    return "".join(texts)


def answer_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items as the chat messages that continue its conversation."""
    return input_messages([item for item in output if item["type"] in ("message", "function_call")], set())


# -- the stored conversations -------------------------------------------------------------------------------


class StoredResponses:
    """The last ``capacity`` responses and their conversations, least recently used dropped first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._kept: OrderedDict[str, tuple[dict[str, Any], list[dict[str, Any]]]] = OrderedDict()

    def keep(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        """Keep ``response`` and the whole conversation it ends (its answer included)."""
        if self.capacity == 0:
            return
        self._kept[response["id"]] = (response, conversation)
        self._kept.move_to_end(response["id"])
        while len(self._kept) > self.capacity:
            self._kept.popitem(last=False)

    def get(self, response_id: str, param: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """The response and conversation of ``response_id``; a 404 naming ``param`` if it is not kept."""
        if response_id not in self._kept:
            raise APIError(
                404,
                f"{param}: no stored response {response_id!r} (it was never stored, was made with "
                f"store: false, or was dropped; this server keeps {self.capacity})",
                param=param,
                code="response_not_found",
            )
        self._kept.move_to_end(response_id)
        return self._kept[response_id]


# -- the answer's shapes ------------------------------------------------------------------------------------


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def message_item(text: str, status: str = "completed") -> dict[str, Any]:
    return {
        "type": "message",
        "id": _item_id("msg"),
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    }


def call_item(call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": _item_id("fc"),
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def reasoning_item(text: str) -> dict[str, Any]:
    return {
        "type": "reasoning",
        "id": _item_id("rs"),
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
    }


def output_items(answer: ChatAnswer) -> list[dict[str, Any]]:
    items = [reasoning_item(answer.reasoning)] if answer.reasoning else []
    if answer.content:
        items.append(message_item(answer.content))
    items += [call_item(call.id, call.name, call.arguments) for call in answer.tool_calls]
    return items


class ResponsesFormat(ResponseFormat):
    """Shapes one Responses request's answer, whole or as stream events, and stores it when it is done."""

    id_prefix = "resp"

    def __init__(
        self,
        state: ServerState,
        reader: AnswerReader,
        body: ResponsesRequest,
        conversation: list[dict[str, Any]],
        store: StoredResponses,
    ) -> None:
        super().__init__(state)
        self.reader = reader
        self.body = body
        self.conversation = conversation
        self.store = store
        self.created_at = int(time.time())
        self._stream = reader.stream()
        self._items: list[dict[str, Any]] = []
        self._message: dict[str, Any] | None = None
        self._reasoning: dict[str, Any] | None = None
        self._calls: dict[int, dict[str, Any]] = {}
        self._sequence = 0

    def response_object(
        self,
        response_id: str,
        output: list[dict[str, Any]],
        status: str,
        outputs: RequestOutput | None,
        prepared: list[_Prepared],
        finish: str | None,
    ) -> dict[str, Any]:
        body = self.body
        usage = None
        if outputs is not None:
            input_tokens = len(outputs.prompt_token_ids)  # the engine's: image markers expanded
            output_tokens = sum(len(c.token_ids) for c in outputs.completions)
            usage = {
                "input_tokens": input_tokens,
                "input_tokens_details": {"cached_tokens": outputs.metrics.num_cached_tokens},
                "output_tokens": output_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": input_tokens + output_tokens,
            }
        if status == "completed" and finish == "length":
            status = "incomplete"
        return {
            "id": response_id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "model": self.state.model_name,
            "output": output,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "temperature": body.temperature if body.temperature is not None else OPENAI_DEFAULT_TEMPERATURE,
            "top_p": body.top_p if body.top_p is not None else 1.0,
            "tool_choice": body.tool_choice if body.tool_choice is not None else "auto",
            "tools": body.tools or [],
            "text": body.text or {"format": {"type": "text"}},
            "truncation": "disabled",
            "store": body.store,
            "metadata": body.metadata or {},
            "usage": usage,
        }

    def _finished(self, response: dict[str, Any]) -> dict[str, Any]:
        if self.body.store:
            self.store.keep(response, [*self.conversation, *answer_messages(response["output"])])
        return response

    def response(self, response_id: str, prepared: list[_Prepared], outputs: list[RequestOutput]) -> dict[str, Any]:
        (output,) = outputs
        completion = output.completions[0]
        items = output_items(self.reader.read(completion.text))
        return self._finished(
            self.response_object(response_id, items, "completed", output, prepared, completion.finish_reason)
        )

    # -- streaming

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self._sequence += 1
        return {"type": kind, "sequence_number": self._sequence - 1, **fields}

    def first_chunks(self, response_id: str, prepared: list[_Prepared]) -> list[dict[str, Any]]:
        started = self.response_object(response_id, [], "in_progress", None, prepared, None)
        return [
            self._event("response.created", response=started),
            self._event("response.in_progress", response=started),
        ]

    def _open(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        self._items.append(item)
        return [self._event("response.output_item.added", output_index=len(self._items) - 1, item=item)]

    def chunks(
        self, response_id: str, prepared: list[_Prepared], prompt_index: int, choice: Any, output: RequestOutput | None
    ) -> list[dict[str, Any]]:
        delta = self._stream.feed(choice.text)
        events = self._delta_events(delta.reasoning, delta.content, delta.tool_calls)
        if choice.finish_reason is None:
            return events
        last = self._stream.finish()
        events += self._delta_events(last.reasoning, last.content, last.tool_calls)
        events += self._close_events()
        response = self._finished(
            self.response_object(response_id, self._items, "completed", output, prepared, choice.finish_reason)
        )
        kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
        return [*events, self._event(kind, response=response)]

    def _delta_events(self, reasoning: str, content: str, pieces: Any) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if reasoning:
            if self._reasoning is None:
                self._reasoning = {**reasoning_item(""), "status": "in_progress"}
                events += self._open(self._reasoning)
            self._reasoning["content"][0]["text"] += reasoning
        if content:
            if self._message is None:
                self._message = message_item("", status="in_progress")
                events += self._open(self._message)
                events.append(
                    self._event(
                        "response.content_part.added",
                        item_id=self._message["id"],
                        output_index=self._items.index(self._message),
                        content_index=0,
                        part={"type": "output_text", "text": "", "annotations": []},
                    )
                )
            self._message["content"][0]["text"] += content
            events.append(
                self._event(
                    "response.output_text.delta",
                    item_id=self._message["id"],
                    output_index=self._items.index(self._message),
                    content_index=0,
                    delta=content,
                    logprobs=[],
                )
            )
        for piece in pieces:
            if piece.index not in self._calls:
                self._calls[piece.index] = call_item(piece.id, piece.name, "", status="in_progress")
                events += self._open(self._calls[piece.index])
            item = self._calls[piece.index]
            item["arguments"] += piece.arguments
            if piece.arguments:
                events.append(
                    self._event(
                        "response.function_call_arguments.delta",
                        item_id=item["id"],
                        output_index=self._items.index(item),
                        delta=piece.arguments,
                    )
                )
        return events

    def _close_events(self) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        for index, item in enumerate(self._items):
            item["status"] = "completed"
            if item is self._message:
                part = item["content"][0]
                events += [
                    self._event(
                        "response.output_text.done",
                        item_id=item["id"],
                        output_index=index,
                        content_index=0,
                        text=part["text"],
                        logprobs=[],
                    ),
                    self._event(
                        "response.content_part.done", item_id=item["id"], output_index=index, content_index=0, part=part
                    ),
                ]
            elif item["type"] == "function_call":
                events.append(
                    self._event(
                        "response.function_call_arguments.done",
                        item_id=item["id"],
                        output_index=index,
                        name=item["name"],
                        arguments=item["arguments"],
                    )
                )
            elif item["type"] == "reasoning":
                del item["status"]
            events.append(self._event("response.output_item.done", output_index=index, item=item))
        return events


# -- the routes ---------------------------------------------------------------------------------------------


def add_responses_routes(app: FastAPI, state: ServerState, dependencies: list[Any]) -> None:
    """Serve ``POST /v1/responses`` and ``GET /v1/responses/{id}`` on ``app``."""
    store = StoredResponses(state.settings.server.stored_responses)
    llm = state.llm

    @app.post("/v1/responses", dependencies=dependencies)
    async def create_response(body: ResponsesRequest, request: Request) -> Response:
        adapter = _check_model(state, body.model)
        conversation: list[dict[str, Any]] = []
        if body.previous_response_id is not None:
            conversation = list(store.get(body.previous_response_id, "previous_response_id")[1])
        known_calls = {call["id"] for message in conversation for call in message.get("tool_calls") or ()}
        try:
            conversation += input_messages(body.input, known_calls)
            if not conversation:
                raise ChatRequestError("input", "must not be empty")
            tools = chat_tools(body.tools)
            plan = plan_tools(tools, chat_tool_choice(body.tool_choice), body.parallel_tool_calls)
            tool_parser, reasoning_parser = state.chat.for_request(None, None)
            system = [{"role": "system", "content": body.instructions}] if body.instructions is not None else []
            messages, image_parts = split_image_parts(template_messages([*system, *conversation]))
            image_parts = [
                replace(part, where=origin)
                for part, origin in zip(image_parts, image_origins(conversation), strict=True)
            ]
            if image_parts and llm.engine.image_inputs is None:
                refuse_images_for_text_model(image_parts, state.model_name)
            # Rendering and image decoding run off the event loop, as for chat completions.
            text, token_ids, processed = await asyncio.to_thread(
                _render_with_images, state, messages, tools, image_parts, "input"
            )
            fields = {**body.sampling_fields(), "lora": adapter}
            await _enforce_tool_choice(state, plan, fields, "text.format")
        except ChatRequestError as exc:
            param = responses_param(exc.param)
            message = str(exc).replace(exc.param, param, 1)
            raise APIError(400, message, param=param) from None
        except ImageInputError as exc:
            raise APIError(400, str(exc), param=exc.where) from None
        num_prompt_tokens = processed.num_prompt_tokens if processed is not None else None
        prepared = [_prepare(state, text, token_ids, fields, body.max_output_tokens, "input", num_prompt_tokens)]
        prepared[0].multi_modal_data = processed
        if prepared[0].params.n != 1:
            raise APIError(400, "n: the Responses API answers with one output", param="n")
        response_format = ResponsesFormat(
            state, AnswerReader(plan, tool_parser, reasoning_parser), body, conversation, store
        )
        return await _respond(state, request, body.stream, None, prepared, response_format)

    @app.get("/v1/responses/{response_id}", dependencies=dependencies)
    async def get_response(response_id: str) -> dict[str, Any]:
        return store.get(response_id, "response_id")[0]
