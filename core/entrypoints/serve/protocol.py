"""The OpenAI request bodies patchbay serves, their translation to :class:`SamplingParams`, and its errors.

Fields OpenAI defines are declared, or accepted and dropped where patchbay
has no use for them (:mod:`.unused_fields`); any other field must be a
patchbay sampling parameter (``top_k``, ``min_p``, ``repetition_penalty``,
``min_tokens``, ``ignore_eos``, ``stop_token_ids``, ``bad_words``,
``allowed_token_ids``, ``prompt_logprobs`` ...), as vLLM accepts them, and an
unknown one is a 400 naming it.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, Strict, StrictBool, StrictInt, ValidationError

from patchbay.entrypoints.serve.unused_fields import CHAT, COMPLETIONS, UnusableFieldValue, drop_unused_fields
from patchbay.sampling_params import SamplingParams

OPENAI_DEFAULT_TEMPERATURE = 1.0
"""What OpenAI's API samples with when a request names no temperature."""


class APIError(Exception):
    """An error answered in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

    TYPES = {
        400: "invalid_request_error",
        401: "authentication_error",
        404: "not_found_error",
        413: "invalid_request_error",
        429: "rate_limit_error",
        500: "internal_error",
        503: "overloaded_error",
    }

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.TYPES.get(self.status, "error"),
                "param": self.param,
                "code": self.code or self.status,
            }
        }


def validation_error(exc: ValidationError, prefix: str = "") -> APIError:
    """A 400 naming the first field pydantic rejected (``temperature: Input should be ...``)."""
    error = exc.errors()[0]
    param = ".".join(str(part) for part in error["loc"]) or None
    if param is not None and prefix:
        param = f"{prefix}.{param}"
    message = "unknown field" if error["type"] == "extra_forbidden" else error["msg"]
    if "input" in error and not isinstance(error["input"], (dict, list)) and error["type"] != "extra_forbidden":
        message += f" (got {error['input']!r})"
    return APIError(400, f"{param}: {message}" if param else message, param=param)


def _encodable(text: str, where: str = "") -> str:
    """``text`` if it is valid Unicode; a lone surrogate (``"\\ud800"`` in JSON) cannot reach a tokenizer."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{where}holds a lone surrogate at character {exc.start}; send valid Unicode text") from None
    return text


def lone_surrogate(value: Any, path: str = "") -> tuple[str, int] | None:
    """The field (``tools.0.function.description``) and character index of the first string in ``value`` (nested
    lists, objects and their keys, pydantic models) that holds a lone surrogate; ``None`` if every string is valid
    Unicode.  JSON's ``"\\ud800"`` escape is the only way such text arrives, and no tokenizer can take it."""
    pending: list[tuple[str, Any]] = [(path, value)]
    while pending:
        where, item = pending.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as exc:
                return where, exc.start
        elif isinstance(item, BaseModel):
            fields = {name: getattr(item, name) for name in type(item).model_fields}
            pending.extend(_children(where, {**fields, **(item.model_extra or {})}))
        elif isinstance(item, dict):
            pending.extend(_children(where, item))
            pending.extend((where, key) for key in item if isinstance(key, str))
        elif isinstance(item, (list, tuple)):
            pending.extend((f"{where}.{index}" if where else str(index), inner) for index, inner in enumerate(item))
    return None


def _children(where: str, items: dict[Any, Any]) -> list[tuple[str, Any]]:
    return [(f"{where}.{key}" if where else str(key), inner) for key, inner in items.items()]


def check_unicode(body: Any) -> None:
    """Refuse (400 naming the field) a request body holding a lone surrogate anywhere: tools, content parts,
    instructions, extra fields; see :func:`lone_surrogate`."""
    found = lone_surrogate(body)
    if found is not None:
        field, index = found
        raise APIError(
            400,
            f"{field or 'body'}: holds a lone surrogate at character {index}; send valid Unicode text",
            param=field or None,
        )


def _checked_texts_and_ids(value: Any) -> Any:
    """``value`` (a text, or a list of texts, of token ids or of lists of token ids) with every text valid Unicode
    and every token id a JSON integer: ``true`` or ``"5"`` is refused, not read as token 1 or 5."""
    if isinstance(value, str):
        return _encodable(value)
    if not isinstance(value, list):
        return value
    texts = value and isinstance(value[0], str)
    for index, item in enumerate(value):
        if texts:
            if not isinstance(item, str):
                raise ValueError(f"item {index}: a list of texts holds a {type(item).__name__}")
            _encodable(item, f"item {index}: ")
            continue
        for inner, token_id in enumerate(item) if isinstance(item, list) else [(None, item)]:
            if type(token_id) is not int:
                where = f"item {index}: " if inner is None else f"item {index}.{inner}: "
                raise ValueError(f"{where}token ids must be integers, got {type(token_id).__name__} {token_id!r}")
    return value


def _checked_text(value: Any) -> Any:
    """``value``, checked as valid Unicode if it is a string (anything else is for the field's type to judge)."""
    return _encodable(value) if isinstance(value, str) else value


Number = Annotated[float, Strict()]
"""A JSON number (an integer too); ``"0.5"`` or ``true`` is a 400, not 0.5 or 1.0."""

Text = Annotated[str, BeforeValidator(_checked_text)]
"""A string a tokenizer can take: refused (400 naming the field) if it holds a lone surrogate."""

TokenIds = list[StrictInt]
"""Token ids: integers as JSON writes them; ``true`` or ``"5"`` is a 400, not token 1 or 5."""

Prompt = Annotated[str | list[str] | list[int] | list[list[int]], BeforeValidator(_checked_texts_and_ids)]
"""A completion prompt: a text, texts, token ids or lists of token ids (texts valid Unicode, ids JSON integers)."""


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False
    include_obfuscation: StrictBool | None = None
    """Accepted and ignored: OpenAI pads its stream events against side channels; patchbay's carry no padding."""


class _GenerationRequest(BaseModel):
    """Fields common to completions and chat completions."""

    model_config = ConfigDict(extra="allow")
    endpoint: ClassVar[str]
    """The endpoint's name in :mod:`.unused_fields`' tables."""

    model: str | None = None
    n: StrictInt = Field(default=1, ge=1)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: Annotated[str | list[str] | None, BeforeValidator(_checked_texts_and_ids)] = None
    temperature: Number | None = None
    top_p: Number | None = None
    frequency_penalty: Number | None = None
    presence_penalty: Number | None = None
    seed: StrictInt | None = None
    logit_bias: dict[str, Number] | None = None
    user: str | None = None
    """Accepted and ignored (OpenAI uses it for abuse monitoring)."""
    skip_special_tokens: StrictBool = True
    """vLLM's; patchbay's text always leaves special tokens out. vLLM's router adds this and the fields below to
    every body it forwards, at the values patchbay has; any other value is a 400 naming the field."""
    no_stop_trim: StrictBool = False
    return_hidden_states: StrictBool = False
    kv_transfer_params: dict[str, Any] | None = None
    """vLLM's disaggregated-prefill handshake, which its router sends to prefill and decode workers. Accepted and
    not needed: patchbay's KV connectors find a prompt's blocks by their hashes (docs/fleet.md)."""

    ROUTER_FIELDS: ClassVar[dict[str, bool]] = {
        "skip_special_tokens": True,
        "no_stop_trim": False,
        "return_hidden_states": False,
    }
    """Fields vLLM's router adds, with the one value patchbay serves."""

    def check_router_fields(self) -> None:
        """A 400 naming a field vLLM's router may send that is set to a behaviour patchbay does not have."""
        for name, served in self.ROUTER_FIELDS.items():
            if getattr(self, name) != served:
                raise APIError(400, f"{name}: only {str(served).lower()} is supported by patchbay", param=name)

    def sampling_fields(self) -> dict[str, Any]:
        """The sampling parameters this request sets, by :class:`SamplingParams` name."""
        fields: dict[str, Any] = {"n": self.n, "temperature": OPENAI_DEFAULT_TEMPERATURE}
        for name in ("stop", "temperature", "top_p", "frequency_penalty", "presence_penalty", "seed"):
            value = getattr(self, name)
            if value is not None:
                fields[name] = value
        if self.logit_bias is not None:
            try:
                fields["logit_bias"] = {int(token): bias for token, bias in self.logit_bias.items()}
            except ValueError:
                raise APIError(400, "logit_bias: keys must be token ids", param="logit_bias") from None
        fields.update(extra_sampling_fields(self.model_extra, self.endpoint))
        return fields


def extra_sampling_fields(extra: dict[str, Any] | None, endpoint: str) -> dict[str, Any]:
    """A request's undeclared fields less the OpenAI ones patchbay does not use (:mod:`.unused_fields`): its
    patchbay sampling parameters; a 400 for an OpenAI field at a value patchbay cannot honour."""
    try:
        return drop_unused_fields(extra, endpoint)
    except UnusableFieldValue as exc:
        raise APIError(400, str(exc), param=exc.param) from None


def sampling_params(fields: dict[str, Any], *, max_tokens: int | None, default_max_tokens: int) -> SamplingParams:
    """Validate ``fields`` as :class:`SamplingParams`; a bad or unknown field is a 400 naming it."""
    fields = {**fields, "max_tokens": max_tokens if max_tokens is not None else max(default_max_tokens, 1)}
    try:
        return SamplingParams.model_validate(fields)
    except ValidationError as exc:
        raise validation_error(exc) from None


class CompletionRequest(_GenerationRequest):
    """``POST /v1/completions``."""

    endpoint = COMPLETIONS
    prompt: Prompt
    max_tokens: StrictInt | None = 16
    logprobs: StrictInt | None = Field(default=None, ge=0, le=20)
    echo: StrictBool = False
    suffix: str | None = None
    best_of: StrictInt | None = None

    def prompts(self) -> list[str | list[int]]:
        """The prompts of this request: one text or token list each."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise APIError(400, "prompt: must not be empty", param="prompt")
        if isinstance(prompt[0], int):
            return [list(prompt)]
        return list(prompt)

    def check_supported(self) -> None:
        self.check_router_fields()
        for name, unsupported in (
            ("echo", self.echo),
            ("suffix", self.suffix is not None),
            ("best_of", self.best_of not in (None, self.n)),
        ):
            if unsupported:
                raise APIError(400, f"{name}: not supported by patchbay", param=name)

    def sampling_fields(self) -> dict[str, Any]:
        fields = super().sampling_fields()
        if self.logprobs is not None:
            fields["logprobs"] = self.logprobs
        return fields


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: Annotated[str | list[dict[str, Any]] | None, BeforeValidator(_checked_text)] = None

    def as_template_message(self, index: int) -> dict[str, Any]:
        """The message as the chat template takes it: text parts joined; a content list holding image parts is
        kept as parts for :func:`patchbay.entrypoints.chat_images.split_image_parts`."""
        content = self.content
        if isinstance(content, list):
            for part in content:
                if part.get("type") == "text":
                    try:
                        _encodable(str(part.get("text", "")))
                    except ValueError as exc:
                        where = f"messages.{index}.content"
                        raise APIError(400, f"{where}: {exc}", param=where) from None
            if any(part.get("type") != "text" for part in content):
                return {**(self.model_extra or {}), "role": self.role, "content": content}
            content = "".join(str(part.get("text", "")) for part in content)
        return {**(self.model_extra or {}), "role": self.role, "content": content or ""}

    def has_parts_other_than_text(self) -> bool:
        return isinstance(self.content, list) and any(part.get("type") != "text" for part in self.content)


class ChatCompletionRequest(_GenerationRequest):
    """``POST /v1/chat/completions``."""

    endpoint = CHAT
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: StrictBool | None = None
    tool_parser: str | None = None
    """patchbay's: the tool-call parser for this request instead of ``chat.tool_parser``."""
    reasoning_parser: str | None = None
    """patchbay's: the reasoning parser for this request instead of ``chat.reasoning_parser``."""
    response_format: dict[str, Any] | None = None
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    include_reasoning: StrictBool = True
    separate_reasoning: StrictBool = True
    stream_reasoning: StrictBool = True
    """The last four are SGLang's and vLLM's router sends them (see ``skip_special_tokens``): patchbay's chat
    answers carry ``reasoning_content`` apart from ``content``, streamed, whenever a reasoning parser is set."""

    ROUTER_FIELDS: ClassVar[dict[str, bool]] = {
        **_GenerationRequest.ROUTER_FIELDS,
        "continue_final_message": False,
        "include_reasoning": True,
        "separate_reasoning": True,
        "stream_reasoning": True,
    }

    def check_supported(self) -> None:
        self.check_router_fields()
        self.structured_output()  # a malformed response_format is a 400 before anything runs
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, "top_logprobs: needs logprobs: true", param="top_logprobs")

    def structured_output(self) -> dict[str, Any] | None:
        """``response_format`` as patchbay's ``structured_output`` constraint (``None`` for plain text)."""
        response_format = self.response_format
        if response_format is None:
            return None
        kind = response_format.get("type")
        if kind in (None, "text"):
            return None
        if kind == "json_object":
            return {"json_object": True}
        if kind == "json_schema":
            json_schema = response_format.get("json_schema")
            if not isinstance(json_schema, dict):
                raise APIError(
                    400,
                    "response_format.json_schema: an object with a 'schema' is required, got "
                    f"{type(json_schema).__name__}",
                    param="response_format.json_schema",
                )
            schema = json_schema.get("schema")
            if not isinstance(schema, dict):
                raise APIError(
                    400,
                    "response_format.json_schema.schema: a JSON schema object is required",
                    param="response_format.json_schema.schema",
                )
            return {"json_schema": schema}
        raise APIError(
            400,
            f"response_format.type: {kind!r} is not one of text, json_object, json_schema",
            param="response_format.type",
        )

    def output_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def sampling_fields(self) -> dict[str, Any]:
        fields = super().sampling_fields()
        if self.logprobs:
            fields["logprobs"] = self.top_logprobs or 0
        constraint = self.structured_output()
        if constraint is not None:
            if "structured_output" in fields:
                raise APIError(
                    400,
                    "structured_output: give response_format or structured_output, not both",
                    param="structured_output",
                )
            fields["structured_output"] = constraint
        return fields


class TokenizeRequest(BaseModel):
    """``POST /tokenize``: a ``prompt`` or chat ``messages``."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool = True


class DetokenizeRequest(BaseModel):
    """``POST /detokenize``."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: TokenIds
