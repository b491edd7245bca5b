"""Running a request and answering it: admission, the engine's streams, the answer whole or streamed.

Shared by the routers, with the base of each API's response shapes
(:class:`ResponseFormat`); a stream is server-sent events.

Admission is bounded: a request whose sequences would take the server past
``scheduler.max_num_seqs + server.max_waiting`` gets 503 at once, so the
queue never grows without limit.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from patchbay.engine import EngineDeadError, GrammarCompileBusy, RequestDelta, RequestOutput
from patchbay.entrypoints.serve.prompts import PreparedPrompt
from patchbay.entrypoints.serve.protocol import APIError
from patchbay.entrypoints.serve.state import ServerState
from patchbay.sampling_params import SamplingParams


def check_admission(state: ServerState, sequences: int) -> None:
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


async def respond(
    state: ServerState,
    request: Request,
    stream: bool,
    stream_options: Any,
    prepared: list[PreparedPrompt],
    format: ResponseFormat,
) -> Response:
    """Admit, start and answer a request of one or more prompts (``n`` sequences each)."""
    sequences = sum(p.params.n for p in prepared)
    check_admission(state, sequences)
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
        _give_back_images(prepared)
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
            _give_back_images(prepared)

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


def _give_back_images(prepared: list[PreparedPrompt]) -> None:
    """The prompts' images end with the request: the bytes they held are free for others."""
    for item in prepared:
        if item.image_bytes is not None:
            item.image_bytes.release()


async def _compile_constraints(state: ServerState, prepared: list[PreparedPrompt]) -> None:
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
        except GrammarCompileBusy as exc:  # the workers are busy, not the constraint at fault
            raise APIError(503, grammars.error_message(constraint, exc), code="grammar_busy") from None
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
    prepared: list[PreparedPrompt],
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
                yield _event(format.envelope(response_id, [], usage=usage_of(prepared, outputs)))
    except EngineDeadError as exc:
        yield _event(APIError(500, str(exc)).body())
    finally:
        release()
    yield "data: [DONE]\n\n"


def from_chunks(chunks: list[dict[str, Any]]) -> str:
    """Stream chunks as server-sent events."""
    return "".join(_event(chunk) for chunk in chunks)


def _event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def usage_of(prepared: list[PreparedPrompt], outputs: list[RequestOutput | None]) -> dict[str, Any]:
    """OpenAI's ``usage`` of a request's prompts and their outputs (``None``: not finished)."""
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


IMPOSSIBLE_LOGPROB = -9999.0
"""What a token that cannot come (masked by a grammar, ``logit_bias`` or ``bad_words``: ``-inf``) is reported with,
as OpenAI and vLLM do: JSON has no infinity."""


def json_logprob(logprob: float) -> float:
    """``logprob``, with ``-inf`` as :data:`IMPOSSIBLE_LOGPROB`."""
    return max(logprob, IMPOSSIBLE_LOGPROB)


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
    def choice_index(prepared: list[PreparedPrompt], prompt_index: int, index: int) -> int:
        """Choices of prompt ``i`` come after the ``n`` choices of each earlier prompt."""
        return sum(p.params.n for p in prepared[:prompt_index]) + index

    def token_text(self, token_id: int) -> str:
        text = self.tokenizer.decode([token_id])
        assert isinstance(text, str)  # one list of ids decodes to one text
        return text

    def first_chunks(self, response_id: str, prepared: list[PreparedPrompt]) -> list[dict[str, Any]]:
        return []

    def chunk(self, response_id: str, prepared: list[PreparedPrompt], prompt_index: int, choice: Any) -> dict[str, Any]:
        raise NotImplementedError

    def chunks(
        self,
        response_id: str,
        prepared: list[PreparedPrompt],
        prompt_index: int,
        choice: Any,
        output: RequestOutput | None,
    ) -> list[dict[str, Any]]:
        """The stream's chunks for one choice's delta (``output``: the request's, once finished)."""
        return [self.chunk(response_id, prepared, prompt_index, choice)]

    def response(
        self, response_id: str, prepared: list[PreparedPrompt], outputs: list[RequestOutput]
    ) -> dict[str, Any]:
        raise NotImplementedError
