"""The FastAPI application: OpenAI routes over an :class:`AsyncLLM`, health, tokenizer and metrics routes.

Admission is bounded: a request whose sequences would take the server past
``scheduler.max_num_seqs + server.max_waiting`` gets 503 at once, so the
queue never grows without limit.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from patchbay.contract.registry import registry_for
from patchbay.contract.settings import DEFAULT_MODEL, Settings
from patchbay.engine import (
    AsyncLLM,
    EngineDeadError,
    MultiModalInputError,
    ProcessedImages,
    RequestDelta,
    RequestOutput,
)
from patchbay.entrypoints.chat import (
    AnswerReader,
    AnswerStream,
    ChatParsers,
    ChatRequestError,
    ToolPlan,
    check_constraint_compiles,
    plan_tools,
    render_chat,
    template_messages,
)
from patchbay.entrypoints.chat_images import (
    ImagePart,
    load_chat_images,
    refuse_images_for_text_model,
    split_image_parts,
)
from patchbay.entrypoints.serve.metrics import ServerMetrics
from patchbay.entrypoints.serve.http_errors import answer_http_errors_in_openai_shape
from patchbay.entrypoints.serve.keys import accepted_api_keys
from patchbay.entrypoints.serve.lora_routes import add_lora_routes
from patchbay.entrypoints.serve.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    sampling_params,
)
from patchbay.interfaces import StructuredOutputParams
from patchbay.multimodal.images import ImageInputError
from patchbay.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class ServerState:
    """What the routes share: the engine front end, the settings, admission and metrics."""

    llm: AsyncLLM
    settings: Settings
    model_name: str
    metrics: ServerMetrics
    chat: ChatParsers
    admitted: int = 0
    """Sequences of the requests in flight, counted on admission (before the engine sees them)."""
    accepting: bool = True
    grace_over: bool = False
    """The shutdown's grace period is over: requests in flight were aborted (non-streamed ones get a 503)."""
    created: int = field(default_factory=lambda: int(time.time()))
    compiled_tool_constraints: dict[str, None] = field(default_factory=dict)
    """Keys of tool constraints known to compile (insertion-ordered, bounded), so each is checked once."""

    @property
    def admission_limit(self) -> int:
        return self.settings.scheduler.max_num_seqs + self.settings.server.max_waiting


@dataclass
class _Prepared:
    """One prompt of a request, ready for the engine."""

    text: str | None
    token_ids: list[int]
    params: SamplingParams
    multi_modal_data: ProcessedImages | None = None
    """The prompt's images, decoded and processed (markers expanded) once, before admission."""


BUNDLED_MODEL_NAME = "SmolLM2-135M-Instruct"
"""What clients call the bundled model (``model.path: default``)."""


def model_name_of(settings: Settings) -> str:
    """``server.served_model_name``, else the model directory's name."""
    if settings.server.served_model_name:
        return settings.server.served_model_name
    if settings.model.path == DEFAULT_MODEL:
        return BUNDLED_MODEL_NAME
    return Path(settings.model.path).name


def build_app(llm: AsyncLLM, settings: Settings) -> FastAPI:
    """The application serving ``llm``; the caller owns ``llm`` (and shuts it down)."""
    model_name = model_name_of(settings)
    chat = ChatParsers(settings, registry_for(settings.plugins), bundled_model=settings.model.path == DEFAULT_MODEL)
    state = ServerState(llm, settings, model_name, ServerMetrics(llm, model_name), chat)
    # No /docs, /redoc nor /openapi.json: they would answer without an API key.
    app = FastAPI(title="patchbay", version=_version(), docs_url=None, redoc_url=None, openapi_url=None)
    app.state.patchbay = state
    answer_http_errors_in_openai_shape(app)
    api_keys = accepted_api_keys(settings.server)

    def check_api_key(request: Request) -> None:
        if not api_keys:
            return
        header = request.headers.get("authorization", "")
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or key.strip() not in api_keys:
            raise APIError(401, "invalid or missing API key (send Authorization: Bearer KEY)", code="invalid_api_key")

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        if exc.status in (429, 503):
            state.metrics.rejected.labels(model_name, str(exc.status)).inc()
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

    authorized = [Depends(check_api_key)]

    @app.get("/health")
    async def health() -> Response:
        if not llm.alive:
            return JSONResponse({"status": "dead", "error": str(llm.error)}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/ready")
    async def ready() -> Response:
        if not llm.alive or not state.accepting:
            return JSONResponse({"status": "not ready"}, status_code=503)
        return JSONResponse({"status": "ready"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=authorized)
    async def models() -> dict[str, Any]:
        base = {
            "id": model_name,
            "object": "model",
            "created": state.created,
            "owned_by": "patchbay",
            "max_model_len": llm.max_model_len,
        }
        adapters = [{**base, "id": name, "parent": model_name, "root": name} for name in _adapter_names(state)]
        return {"object": "list", "data": [base, *adapters]}

    @app.post("/tokenize", dependencies=authorized)
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        _check_model(state, body.model)
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

    @app.post("/detokenize", dependencies=authorized)
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        _check_model(state, body.model)
        vocab = len(llm.tokenizer)
        bad = [token for token in body.tokens if not 0 <= token < vocab]
        if bad:
            raise APIError(400, f"tokens: ids outside the vocabulary (0..{vocab - 1}): {bad[:5]}", param="tokens")
        return {"prompt": llm.tokenizer.decode(body.tokens)}

    @app.post("/v1/completions", dependencies=authorized)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        adapter = _check_model(state, body.model)
        body.check_supported()
        fields = {**body.sampling_fields(), "lora": adapter}
        prompts = body.prompts()
        # Counted before tokenizing: a list of 200k tiny prompts is refused without encoding any of them.
        _check_admission(state, len(prompts) * (body.n or 1))
        # Tokenized off the event loop: a huge prompt must not stall every other client (/health included).
        encoded = await asyncio.to_thread(lambda: [llm.encode(prompt) for prompt in prompts])
        prepared = [_prepare(state, text, token_ids, fields, body.max_tokens, "prompt") for text, token_ids in encoded]
        return await _respond(state, request, body.stream, body.stream_options, prepared, CompletionFormat(state))

    @app.post("/v1/chat/completions", dependencies=authorized)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        adapter = _check_model(state, body.model)
        body.check_supported()
        try:
            plan = plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls)
            tool_parser, reasoning_parser = state.chat.for_request(body.tool_parser, body.reasoning_parser)
            messages, image_parts = split_image_parts(
                template_messages([message.as_template_message(index) for index, message in enumerate(body.messages)])
            )
            if image_parts and llm.engine.image_inputs is None:
                refuse_images_for_text_model(image_parts, model_name)
            # Rendering and image decoding run off the event loop: a large image must not stall other clients.
            text, token_ids, processed = await asyncio.to_thread(
                _render_with_images, state, messages, body.tools, image_parts
            )
            fields = {**body.sampling_fields(), "lora": adapter}
            await _enforce_tool_choice(state, plan, fields, "response_format")
        except ChatRequestError as exc:
            raise APIError(400, str(exc), param=exc.param) from None
        except ImageInputError as exc:
            raise APIError(400, str(exc), param=exc.where) from None
        num_prompt_tokens = processed.num_prompt_tokens if processed is not None else None
        prepared = [_prepare(state, text, token_ids, fields, body.output_limit(), "messages", num_prompt_tokens)]
        prepared[0].multi_modal_data = processed
        reader = AnswerReader(plan, tool_parser, reasoning_parser)
        return await _respond(state, request, body.stream, body.stream_options, prepared, ChatFormat(state, reader))

    add_lora_routes(app, state, authorized)
    from patchbay.entrypoints.serve.responses import add_responses_routes  # it builds on this module

    add_responses_routes(app, state, authorized)
    return app


def _render_with_images(
    state: ServerState,
    messages: list[dict[str, Any]],
    tools: Any,
    image_parts: list[ImagePart],
    field: str = "messages",
) -> tuple[str, list[int], ProcessedImages | None]:
    """The prompt's text and token ids (image markers not yet expanded) and its images decoded and processed
    (``None`` without images): the engine takes them as they are, so the image processor runs once.
    ``field`` is the request field errors about the prompt as a whole name (``messages``, ``input``)."""
    images = load_chat_images(image_parts, state.settings.multimodal, field) if image_parts else []
    text, token_ids = render_chat(state.llm.tokenizer, messages, tools=tools, template=state.chat.template)
    if not images:
        return text, token_ids, None
    return text, token_ids, process_prompt_images(state, field, token_ids, images)


def process_prompt_images(state: ServerState, field: str, token_ids: list[int], images: list[Any]) -> ProcessedImages:
    """Run the image processor once on a prompt's decoded images (a 400 naming ``field`` when the prompt's
    image markers do not pair up with them, e.g. a chat template that writes none)."""
    try:
        return state.llm.engine.process_images(field, token_ids, {"image": images})
    except MultiModalInputError as exc:
        message = str(exc).removeprefix(f"request {field!r}: ")
        raise ChatRequestError(field, message) from None


def _version() -> str:
    import patchbay

    return patchbay.__version__


def _check_model(state: ServerState, model: str | None) -> str | None:
    """The LoRA adapter a request's ``model`` names (``None``: the base model); 404 for a name nobody serves."""
    if model is None or model == state.model_name:
        return None
    lora = state.llm.engine.lora
    if lora is not None:
        try:
            lora.catalog.path_of(model)
            return model
        except LookupError:
            pass
    adapters = f" and LoRA adapters {', '.join(_adapter_names(state))}" if lora is not None else ""
    raise APIError(
        404,
        f"model {model!r} does not exist; this server serves {state.model_name!r}{adapters}",
        param="model",
        code="model_not_found",
    )


def _adapter_names(state: ServerState) -> list[str]:
    lora = state.llm.engine.lora
    return lora.catalog.known_names() if lora is not None else []


COMPILED_CONSTRAINTS_KEPT = 256


async def _enforce_tool_choice(state: ServerState, plan: ToolPlan, fields: dict[str, Any], format_field: str) -> None:
    """Hold a ``required`` or named tool choice to the tools' JSON schema through the run's structured-output
    backend, compiled before the request is admitted; ``format_field`` names the request's own output format."""
    if not plan.enforced:
        return
    if "structured_output" in fields:
        raise ChatRequestError(
            "tool_choice",
            f"{plan.mode} tool calls are enforced by a JSON schema; they cannot be combined with {format_field} "
            "or structured_output",
        )
    fields["structured_output"] = plan.constraint()
    await _check_tool_constraint(state, plan)


async def _check_tool_constraint(state: ServerState, plan: ToolPlan) -> None:
    """Compile an enforced tool constraint before admitting the request, so a tool schema the backend refuses is
    a 400 naming the tool, not a failed generation."""
    key = json.dumps(plan.constraint(), sort_keys=True)
    if key in state.compiled_tool_constraints:
        return
    grammars = state.llm.engine.grammars

    def compile_schema(schema: dict[str, Any]) -> None:
        # Through the run's compilations: cached, and bounded by structured_output.compile_timeout.
        grammars.submit(StructuredOutputParams(json_schema=schema)).result()

    await asyncio.to_thread(check_constraint_compiles, plan, compile_schema)
    state.compiled_tool_constraints[key] = None
    while len(state.compiled_tool_constraints) > COMPILED_CONSTRAINTS_KEPT:
        del state.compiled_tool_constraints[next(iter(state.compiled_tool_constraints))]


def _prepare(
    state: ServerState,
    text: str | None,
    token_ids: list[int],
    fields: dict[str, Any],
    max_tokens: int | None,
    prompt_field: str,
    num_prompt_tokens: int | None = None,
) -> _Prepared:
    """Check the prompt's length against the model and build the sampling parameters (400 naming the field).

    ``num_prompt_tokens`` is the prompt's length in the engine when it differs from ``token_ids``'s (each image
    marker expanded to the image's placeholder tokens)."""
    limit = state.llm.max_model_len
    if not token_ids:
        raise APIError(400, f"{prompt_field}: the prompt is empty", param=prompt_field)
    length = len(token_ids) if num_prompt_tokens is None else num_prompt_tokens
    if length >= limit:
        raise APIError(
            400,
            f"{prompt_field}: the prompt has {length} tokens; this model's context is "
            f"{limit} tokens, prompt and output together",
            param=prompt_field,
            code="context_length_exceeded",
        )
    if max_tokens is not None and length + max_tokens > limit:
        raise APIError(
            400,
            f"max_tokens: {length} prompt tokens + {max_tokens} output tokens exceed this "
            f"model's context of {limit} tokens",
            param="max_tokens",
            code="context_length_exceeded",
        )
    params = sampling_params(fields, max_tokens=max_tokens, default_max_tokens=limit - length)
    return _Prepared(text, token_ids, params)


# -- running a request -------------------------------------------------------------------------------------


def _check_admission(state: ServerState, sequences: int) -> None:
    """Refuse a request of ``sequences`` sequences the server cannot take now (503) or ever (400)."""
    if not state.accepting:
        raise APIError(503, "the server is shutting down", code="shutting_down")
    if sequences > state.admission_limit:
        raise APIError(
            400,
            f"n: {sequences} sequences can never be admitted; the limit is {state.admission_limit} "
            f"(scheduler.max_num_seqs + server.max_waiting)",
            param="n",
        )
    if state.admitted + sequences > state.admission_limit:
        raise APIError(
            503,
            f"the server is at its limit of {state.admission_limit} sequences in flight "
            f"(scheduler.max_num_seqs + server.max_waiting); retry later",
            code="queue_full",
        )


async def _respond(
    state: ServerState,
    request: Request,
    stream: bool,
    stream_options: Any,
    prepared: list[_Prepared],
    format: ResponseFormat,
) -> Response:
    """Admit, start and answer a request of one or more prompts (``n`` sequences each)."""
    sequences = sum(p.params.n for p in prepared)
    _check_admission(state, sequences)
    state.admitted += sequences
    streams: list[Any] = []
    try:
        await _compile_constraints(state, prepared)
        request_id = uuid.uuid4().hex
        for index, item in enumerate(prepared):
            try:
                streams.append(
                    await state.llm.add_request(
                        item.token_ids,
                        item.params,
                        prompt=item.text,
                        request_id=f"{format.id_prefix}-{request_id}-{index}",
                        multi_modal_data=item.multi_modal_data,
                    )
                )
            except ValueError as exc:  # the engine refuses it (e.g. a parameter the sampler cannot serve)
                if isinstance(exc, LookupError):  # an adapter the resolver stopped knowing
                    raise APIError(404, str(exc), param="model", code="model_not_found") from None
                raise APIError(400, str(exc), param=_named_parameter(str(exc), item.params)) from None
            except EngineDeadError as exc:
                raise APIError(500, str(exc)) from None
    except BaseException:
        for opened in streams:
            opened.close()
        state.admitted -= sequences
        raise
    response_id = f"{format.id_prefix}-{request_id}"
    format.model = prepared[0].params.lora or state.model_name  # responses name the adapter that answered
    include_usage = bool(stream_options and stream_options.include_usage)

    released = False

    def release() -> None:
        nonlocal released
        if not released:
            released = True
            for opened in streams:
                opened.close()
            state.admitted -= sequences

    if stream:
        return _ReleasingStreamingResponse(
            _sse(format, response_id, prepared, streams, include_usage, release), release
        )
    try:
        outputs = await _collect_unless_disconnected(request, streams)
    finally:
        release()
    if outputs is not None and state.grace_over and _aborted(outputs):
        raise APIError(
            503,
            f"the server shut down before the request finished (server.shutdown_grace_period="
            f"{state.settings.server.shutdown_grace_period:g} s); retry it on another server",
            code="shutting_down",
        )
    if outputs is None:
        return Response(status_code=499)  # nobody is listening; the requests were aborted by release()
    return JSONResponse(format.response(response_id, prepared, outputs))


async def _compile_constraints(state: ServerState, prepared: list[_Prepared]) -> None:
    """Compile the prompts' structured-output constraints before the engine sees them, so a constraint the
    backend cannot compile (or not within ``structured_output.compile_timeout``) is a 400 naming the field,
    not a failed generation.  The grammars are cached: the engine's own compile is a cache hit."""
    grammars = state.llm.engine.grammars
    for item in prepared:
        constraint = item.params.structured_output
        if constraint is None or constraint.kind not in grammars.constraint_kinds:
            continue  # an unsupported kind is refused by the engine, naming it
        try:
            await asyncio.wrap_future(grammars.submit(constraint))
        except Exception as exc:  # noqa: BLE001 - the backend's reason, in the request's error
            raise APIError(400, grammars.error_message(constraint, exc), param=constraint.field_path) from None


DISCONNECT_POLL_SECONDS = 0.5


async def _collect_unless_disconnected(request: Request, streams: list[Any]) -> list[RequestOutput] | None:
    """:func:`_collect`, or ``None`` as soon as the client has gone (checked every half second)."""
    collecting = asyncio.ensure_future(_collect(streams))
    try:
        while True:
            done, _ = await asyncio.wait({collecting}, timeout=DISCONNECT_POLL_SECONDS)
            if done:
                return collecting.result()
            if await request.is_disconnected():
                return None
    finally:
        collecting.cancel()


def _named_parameter(message: str, params: SamplingParams) -> str | None:
    """The first sampling parameter the request sets that the engine's refusal names."""
    return next((name for name in sorted(params.params_used()) if name in message), None)


class _ReleasingStreamingResponse(StreamingResponse):
    """An SSE response that releases its requests however it ends, even if its body never started."""

    def __init__(self, content: AsyncIterator[str], release: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream")
        self._release = release

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._release()


async def _collect(streams: list[Any]) -> list[RequestOutput]:
    """Every stream run to its end; its final outputs in order."""

    async def last(stream: Any) -> RequestOutput:
        output = None
        async for delta in stream:
            output = delta.output
        assert output is not None
        return output

    try:
        outputs = await asyncio.gather(*(last(stream) for stream in streams))
    except EngineDeadError as exc:
        raise APIError(500, str(exc)) from None
    failed = [o for o in outputs if any(c.finish_reason == "error" for c in o.completions)]
    if failed:
        raise APIError(500, _error_message(failed[0]), code="engine_error")
    return outputs


def _aborted(outputs: list[RequestOutput]) -> bool:
    return any(c.finish_reason == "abort" for o in outputs for c in o.completions)


def _error_message(output: RequestOutput) -> str:
    detail = getattr(output, "error", None) or next(
        (c.stop_reason for c in output.completions if c.finish_reason == "error"), None
    )
    return f"request {output.request_id} failed: {detail or 'a plugin failed'}"


async def _merge(streams: list[Any]) -> AsyncIterator[tuple[int, RequestDelta]]:
    """The deltas of several streams as they come, tagged with the stream's index."""
    if len(streams) == 1:
        async for delta in streams[0]:
            yield 0, delta
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: Any) -> None:
        try:
            async for delta in stream:
                await queue.put((index, delta))
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            await queue.put((index, exc))
            return
        await queue.put((index, None))

    tasks = [asyncio.create_task(pump(index, stream)) for index, stream in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()


async def _sse(
    format: ResponseFormat,
    response_id: str,
    prepared: list[_Prepared],
    streams: list[Any],
    include_usage: bool,
    release: Callable[[], None],
) -> AsyncIterator[str]:
    """Server-sent events: one chunk per delta and choice, the usage chunk if asked, then ``[DONE]``."""
    outputs: list[RequestOutput | None] = [None] * len(streams)
    try:
        yield from_chunks(format.first_chunks(response_id, prepared))
        async for prompt_index, delta in _merge(streams):
            if delta.output is not None:
                outputs[prompt_index] = delta.output
            errors = [c for c in delta.choices if c.finish_reason == "error"]
            if errors and delta.output is not None:
                yield _event(APIError(500, _error_message(delta.output), code="engine_error").body())
                break
            chunks = [
                chunk
                for choice in delta.choices
                for chunk in format.chunks(response_id, prepared, prompt_index, choice, delta.output)
            ]
            yield from_chunks(chunks)
        else:
            if include_usage:
                yield _event(format.envelope(response_id, [], usage=_usage(prepared, outputs)))
    except EngineDeadError as exc:
        yield _event(APIError(500, str(exc)).body())
    finally:
        release()
    yield "data: [DONE]\n\n"


def from_chunks(chunks: list[dict[str, Any]]) -> str:
    return "".join(_event(chunk) for chunk in chunks)


def _event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _usage(prepared: list[_Prepared], outputs: list[RequestOutput | None]) -> dict[str, Any]:
    # The engine's prompt: an image's marker expanded to its placeholder tokens, so usage counts image tokens.
    prompt_tokens = sum(
        len(o.prompt_token_ids) if o is not None else len(p.token_ids) for p, o in zip(prepared, outputs, strict=True)
    )
    completion_tokens = sum(len(c.token_ids) for o in outputs if o is not None for c in o.completions)
    cached = sum(o.metrics.num_cached_tokens for o in outputs if o is not None)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


# -- response shapes -------------------------------------------------------------------------------------


class ResponseFormat:
    """How one endpoint shapes responses and stream chunks."""

    id_prefix = ""
    object_name = ""
    chunk_object_name = ""

    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.tokenizer = state.llm.tokenizer
        self.model = state.model_name
        """The ``model`` responses report: the base model's name, or the adapter's when one answered."""

    def envelope(
        self,
        response_id: str,
        choices: list[dict[str, Any]],
        *,
        chunk: bool = True,
        usage: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": response_id,
            "object": self.chunk_object_name if chunk else self.object_name,
            "created": int(time.time()),
            "model": self.model,
            "choices": choices,
        }
        if usage is not None or not chunk:
            body["usage"] = usage
        return body

    @staticmethod
    def choice_index(prepared: list[_Prepared], prompt_index: int, index: int) -> int:
        """Choices of prompt ``i`` come after the ``n`` choices of each earlier prompt."""
        return sum(p.params.n for p in prepared[:prompt_index]) + index

    def token_text(self, token_id: int) -> str:
        text = self.tokenizer.decode([token_id])
        assert isinstance(text, str)  # one list of ids decodes to one text
        return text

    def first_chunks(self, response_id: str, prepared: list[_Prepared]) -> list[dict[str, Any]]:
        return []

    def chunk(self, response_id: str, prepared: list[_Prepared], prompt_index: int, choice: Any) -> dict[str, Any]:
        raise NotImplementedError

    def chunks(
        self, response_id: str, prepared: list[_Prepared], prompt_index: int, choice: Any, output: RequestOutput | None
    ) -> list[dict[str, Any]]:
        """The stream's chunks for one choice's delta (``output``: the request's, once finished)."""
        return [self.chunk(response_id, prepared, prompt_index, choice)]

    def response(self, response_id: str, prepared: list[_Prepared], outputs: list[RequestOutput]) -> dict[str, Any]:
        raise NotImplementedError


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
            token_logprobs.append(entry.logprobs[0])
            top.append({self.token_text(t): lp for t, lp in zip(entry.token_ids[1:], entry.logprobs[1:], strict=True)})
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}

    def chunk(self, response_id: str, prepared: list[_Prepared], prompt_index: int, choice: Any) -> dict[str, Any]:
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

    def response(self, response_id: str, prepared: list[_Prepared], outputs: list[RequestOutput]) -> dict[str, Any]:
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
        return self.envelope(response_id, choices, chunk=False, usage=_usage(prepared, list(outputs)))


class ChatFormat(ResponseFormat):
    id_prefix = "chatcmpl"
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def logprobs(self, entries: list[Any] | None) -> dict[str, Any] | None:
        if entries is None:
            return None

        def item(token_id: int, logprob: float) -> dict[str, Any]:
            token = self.token_text(token_id)
            return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

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

    def first_chunks(self, response_id: str, prepared: list[_Prepared]) -> list[dict[str, Any]]:
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

    def chunk(self, response_id: str, prepared: list[_Prepared], prompt_index: int, choice: Any) -> dict[str, Any]:
        index = self.choice_index(prepared, prompt_index, choice.index)
        stream = self._streams.setdefault(index, self.reader.stream())
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

    def response(self, response_id: str, prepared: list[_Prepared], outputs: list[RequestOutput]) -> dict[str, Any]:
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
        return self.envelope(response_id, choices, chunk=False, usage=_usage(prepared, list(outputs)))


def _finish_reason(reason: str | None, called: bool) -> str | None:
    """OpenAI reports an answer that ends in tool calls as ``tool_calls``."""
    return "tool_calls" if called and reason == "stop" else reason
