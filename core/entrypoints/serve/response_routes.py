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

Answers are kept for ``previous_response_id`` in an in-memory store per API
key, bounded in count and bytes (``server.stored_responses``,
``server.stored_response_bytes``, least recently used dropped first), unless
the request says ``store: false``; only the key that made a response reads or
continues it.  The input is read off the event loop: a body of hundreds of
thousands of items must not stall other clients.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator

from patchbay.engine import RequestOutput
from patchbay.entrypoints.chat import (
    AnswerReader,
    ChatAnswer,
    ChatRequestError,
    ToolPlan,
    plan_tools,
    template_messages,
)
from patchbay.entrypoints.chat_images import ImagePart, refuse_images_for_text_model, split_image_parts
from patchbay.entrypoints.serve.answering import ResponseFormat, respond
from patchbay.entrypoints.serve.keys import caller_of
from patchbay.entrypoints.serve.prompts import (
    PreparedPrompt,
    RenderedChat,
    enforce_tool_choice,
    prepare_chat,
    render_with_images,
)
from patchbay.entrypoints.serve.json_body import read_json_body
from patchbay.entrypoints.serve.protocol import (
    OPENAI_DEFAULT_TEMPERATURE,
    APIError,
    Number,
    check_unicode,
    extra_sampling_fields,
)
from patchbay.entrypoints.serve.state import ServerState
from patchbay.entrypoints.serve.unused_fields import RESPONSES
from patchbay.multimodal.images import ImageInputError


MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512
"""OpenAI's bounds on a response's ``metadata`` (it is echoed and stored with the response)."""


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
    """OpenAI's limits: at most 16 pairs, keys of at most 64 characters, values of at most 512."""
    include: list[str] | None = None
    """Accepted; patchbay has no extra output to include."""
    truncation: Literal["disabled", "auto"] | None = None
    """Either: a conversation too long for the model is a 400, never cut (so ``auto`` answers as ``disabled``
    does whenever the conversation fits)."""
    user: str | None = None
    """Accepted and ignored (OpenAI uses it for abuse monitoring)."""

    @field_validator("metadata")
    @classmethod
    def _bounded_metadata(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is None:
            return None
        if len(value) > MAX_METADATA_PAIRS:
            raise ValueError(f"at most {MAX_METADATA_PAIRS} pairs, got {len(value)}")
        for key, item in value.items():
            if len(key) > MAX_METADATA_KEY or len(item) > MAX_METADATA_VALUE:
                raise ValueError(
                    f"key {key[:20]!r}: keys hold at most {MAX_METADATA_KEY} characters, values {MAX_METADATA_VALUE}"
                )
        return value

    def sampling_fields(self) -> dict[str, Any]:
        fields: dict[str, Any] = {"temperature": OPENAI_DEFAULT_TEMPERATURE}
        for name in ("temperature", "top_p"):
            if getattr(self, name) is not None:
                fields[name] = getattr(self, name)
        fields.update(extra_sampling_fields(self.model_extra, RESPONSES))
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
        if isinstance(part, dict) and part.get("type") == "input_image":
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
    """Each API key's last responses and their conversations, least recently used dropped first.

    A key's store holds at most ``capacity`` responses and ``max_bytes`` bytes (their JSON size); one key's
    flood drops only its own, and only the key that made a response reads or continues it.
    """

    def __init__(self, capacity: int, max_bytes: int) -> None:
        self.capacity = capacity
        self.max_bytes = max_bytes
        self._owners: dict[str, OwnerResponses] = {}

    def for_owner(self, owner: str) -> OwnerResponses:
        """The store of the API key ``owner`` names (:func:`~patchbay.entrypoints.serve.keys.caller_of`)."""
        if owner not in self._owners:
            self._owners[owner] = OwnerResponses(self.capacity, self.max_bytes)
        return self._owners[owner]

    def get(self, owner: str, response_id: str, param: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """``owner``'s response ``response_id`` and its conversation; a 404 naming ``param`` if ``owner`` has none
        of that id (made by another key, never stored, or dropped: the answer does not say which)."""
        return self.for_owner(owner).get(response_id, param)


class OwnerResponses:
    """One API key's stored responses: at most ``capacity`` of them and ``max_bytes`` bytes."""

    def __init__(self, capacity: int, max_bytes: int) -> None:
        self.capacity = capacity
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._kept: OrderedDict[str, tuple[dict[str, Any], list[dict[str, Any]], int]] = OrderedDict()

    def keep(self, response: dict[str, Any], conversation: list[dict[str, Any]], num_bytes: int) -> None:
        """Keep ``response`` and the whole conversation it ends (its answer included), ``num_bytes`` in all;
        one larger than the whole store is not kept."""
        if self.capacity == 0 or num_bytes > self.max_bytes:
            return
        self._kept[response["id"]] = (response, conversation, num_bytes)
        self.num_bytes += num_bytes
        while len(self._kept) > self.capacity or self.num_bytes > self.max_bytes:
            self.num_bytes -= self._kept.popitem(last=False)[1][2]

    def get(self, response_id: str, param: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """The response and conversation of ``response_id``; a 404 naming ``param`` if it is not kept."""
        if response_id not in self._kept:
            raise APIError(
                404,
                f"{param}: no stored response {response_id!r} for this API key (it was never stored, was made "
                f"with store: false or by another key, or was dropped; this server keeps {self.capacity} per key)",
                param=param,
                code="response_not_found",
            )
        self._kept.move_to_end(response_id)
        response, conversation, _ = self._kept[response_id]
        return response, conversation


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
        read: _Conversation,
        store: OwnerResponses,
    ) -> None:
        super().__init__(state)
        self.reader = reader
        self.body = body
        self.conversation = read.conversation
        self.stored_bytes = read.stored_bytes
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
        prepared: list[PreparedPrompt],
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
            output = response["output"]
            num_bytes = self.stored_bytes + len(json.dumps(output, ensure_ascii=False))
            self.store.keep(response, [*self.conversation, *answer_messages(output)], num_bytes)
        return response

    def response(
        self, response_id: str, prepared: list[PreparedPrompt], outputs: list[RequestOutput]
    ) -> dict[str, Any]:
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

    def first_chunks(self, response_id: str, prepared: list[PreparedPrompt]) -> list[dict[str, Any]]:
        started = self.response_object(response_id, [], "in_progress", None, prepared, None)
        return [
            self._event("response.created", response=started),
            self._event("response.in_progress", response=started),
        ]

    def _open(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        self._items.append(item)
        return [self._event("response.output_item.added", output_index=len(self._items) - 1, item=item)]

    def chunks(
        self,
        response_id: str,
        prepared: list[PreparedPrompt],
        prompt_index: int,
        choice: Any,
        output: RequestOutput | None,
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


@dataclass
class _Conversation:
    """A Responses request read as a chat: what the template renders, the images, the tools and their plan."""

    conversation: list[dict[str, Any]]
    """The stored conversation it continues, then its ``input`` (without ``instructions``): what is kept."""
    messages: list[dict[str, Any]]
    image_parts: list[ImagePart]
    tools: list[dict[str, Any]] | None
    plan: ToolPlan
    stored_bytes: int
    """The request's size as kept (conversation, tools, instructions, metadata), JSON-encoded."""


def _read_conversation(body: ResponsesRequest, previous: list[dict[str, Any]]) -> _Conversation:
    """Check and read a request whose ``input`` may hold hundreds of thousands of items: it runs off the event
    loop.  Raises :class:`ChatRequestError` (or :class:`APIError`) naming the field at fault."""
    check_unicode(body)
    known_calls = {call["id"] for message in previous for call in message.get("tool_calls") or ()}
    conversation = [*previous, *input_messages(body.input, known_calls)]
    if not conversation:
        raise ChatRequestError("input", "must not be empty")
    tools = chat_tools(body.tools)
    plan = plan_tools(tools, chat_tool_choice(body.tool_choice), body.parallel_tool_calls)
    system = [{"role": "system", "content": body.instructions}] if body.instructions is not None else []
    messages, image_parts = split_image_parts(template_messages([*system, *conversation]))
    image_parts = [
        replace(part, where=origin) for part, origin in zip(image_parts, image_origins(conversation), strict=True)
    ]
    kept = [conversation, body.tools, body.instructions, body.metadata, body.text, body.tool_choice]
    stored_bytes = len(json.dumps(kept, ensure_ascii=False, default=str))
    return _Conversation(conversation, messages, image_parts, tools, plan, stored_bytes)


def response_router(state: ServerState, dependencies: list[Any]) -> APIRouter:
    """The routes of the Responses API over ``state`` (each behind ``dependencies``: the API key)."""
    router = APIRouter(dependencies=dependencies)
    server = state.settings.server
    store = StoredResponses(server.stored_responses, server.stored_response_bytes)
    llm = state.llm

    @router.post("/v1/responses")
    async def create_response(request: Request) -> Response:
        body = await read_json_body(request, ResponsesRequest)
        adapter = state.adapter_for(body.model)
        owner = caller_of(request)
        previous: list[dict[str, Any]] = []
        if body.previous_response_id is not None:
            previous = store.get(owner, body.previous_response_id, "previous_response_id")[1]
        rendered: RenderedChat | None = None
        try:
            try:
                read = await asyncio.to_thread(_read_conversation, body, previous)
                tool_parser, reasoning_parser = state.chat.for_request(None, None)
                if read.image_parts and llm.engine.image_inputs is None:
                    refuse_images_for_text_model(read.image_parts, state.model_name)
                # Off the event loop, as for chat completions.
                rendered = await render_with_images(state, read.messages, read.tools, read.image_parts, "input")
                fields = {**body.sampling_fields(), "lora": adapter}
                await enforce_tool_choice(state, read.plan, fields, "text.format")
            except ChatRequestError as exc:
                param = responses_param(exc.param)
                message = str(exc).replace(exc.param, param, 1)
                raise APIError(400, message, param=param) from None
            except ImageInputError as exc:
                raise APIError(400, str(exc), param=exc.where) from None
            prepared = [prepare_chat(state, rendered, fields, body.max_output_tokens, "input")]
            if prepared[0].params.n != 1:
                raise APIError(400, "n: the Responses API answers with one output", param="n")
            reader = AnswerReader(read.plan, tool_parser, reasoning_parser)
            response_format = ResponsesFormat(state, reader, body, read, store.for_owner(owner))
            return await respond(state, request, body.stream, None, prepared, response_format)
        except BaseException:
            if rendered is not None:
                rendered.release()
            raise

    @router.get("/v1/responses/{response_id}")
    async def get_response(response_id: str, request: Request) -> dict[str, Any]:
        return store.get(caller_of(request), response_id, "response_id")[0]

    return router
