"""The asynchronous front end: the engine steps in its own thread, asyncio tasks add, stream and abort requests.

One thread owns the :class:`Engine` (it is not thread-safe): it runs the
commands asyncio queued (add, abort), then one step, then hands each
request's news to its asyncio queue, and sleeps while there is no work.
All concurrent requests share each step (continuous batching).

    llm = AsyncLLM(settings)
    async for delta in llm.generate(token_ids, SamplingParams(max_tokens=32)):
        print(delta.choices[0].text, end="")

Leaving the ``async for`` early (a client disconnect cancels the task)
aborts the request; its blocks are freed before the next step.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from patchbay.contract.registry import Registry, registry_for
from patchbay.contract.settings import Settings, load_settings
from patchbay.engine.engine import Engine
from patchbay.engine.multimodal_inputs import ProcessedImages
from patchbay.engine.detokenizer import StreamingText
from patchbay.engine.outputs import RequestOutput
from patchbay.engine.prompts import Prompt, encode_prompt
from patchbay.interfaces import PoolingParams
from patchbay.sampling_params import SamplingParams
from patchbay.engine.step_failures import EngineDeadError  # one error for a dead engine, whichever front end

logger = logging.getLogger(__name__)


@dataclass
class ChoiceDelta:
    """What one step added to one sequence of a request."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[Any] | None = None
    """Per new token, its logprobs entry (when the request asked for ``logprobs``)."""
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class RequestDelta:
    """One update of a streamed request: the sequences that changed; ``output`` once it has finished."""

    request_id: str
    choices: list[ChoiceDelta]
    output: RequestOutput | None = None

    @property
    def finished(self) -> bool:
        return self.output is not None


@dataclass(frozen=True)
class EngineSnapshot:
    """Load and counters of the engine, taken by its thread after each step (safe to read from any thread)."""

    num_running: int = 0
    num_waiting: int = 0
    num_blocks: int = 0
    num_free_blocks: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_steps: int = 0
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_preemptions: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    kv_connector_loaded_tokens: int = 0
    kv_connector_recomputed_blocks: int = 0
    step_timings: dict[str, float] = field(default_factory=dict)


@dataclass
class _Stream:
    """A request being streamed: where its deltas go and what was sent of each sequence."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    texts: list[StreamingText]
    num_sent_tokens: list[int]
    finished: list[bool]


class AsyncLLM:
    """Serve many concurrent requests from asyncio on one engine stepping in a background thread.

    ``settings`` is a :class:`Settings`, a path to a YAML file, or ``None``
    for the defaults; the model loads in the constructor.  Call
    :meth:`shutdown` when done.
    """

    def __init__(
        self, settings: Settings | str | os.PathLike[str] | None = None, *, registry: Registry | None = None
    ) -> None:
        if not isinstance(settings, Settings):
            settings = load_settings(settings, registry=registry or registry_for)
        self.engine = Engine(settings, registry=registry)
        self.settings = settings
        self.tokenizer = self.engine.tokenizer
        self.max_model_len = self.engine.max_model_len
        self._condition = threading.Condition()
        self._commands: list[tuple[Callable[[], Any], concurrent.futures.Future | None]] = []
        self._streams: dict[str, _Stream] = {}
        self._num_sequences = 0
        """Sequences of the requests in flight (what admission limits count)."""
        self._finish_listeners: list[Callable[[RequestOutput], None]] = []
        self._stopping = False
        self.error: BaseException | None = None
        """Why the engine thread died, if it did."""
        self.snapshot = self._take_snapshot()
        self._thread = threading.Thread(target=self._run, name="patchbay-engine", daemon=True)
        self._thread.start()

    # -- the asyncio side -------------------------------------------------------------------

    @property
    def alive(self) -> bool:
        """The engine thread runs and has not failed."""
        return self._thread.is_alive() and self.error is None

    def encode(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        """Prompt text (if any) and token ids, as :meth:`patchbay.LLM.encode` gives them."""
        return encode_prompt(self.tokenizer, prompt)

    def add_finish_listener(self, listener: Callable[[RequestOutput], None]) -> None:
        """Call ``listener(output)`` in the engine thread for every request that finishes (aborted ones too)."""
        self._finish_listeners.append(listener)

    async def add_request(
        self,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        *,
        prompt: str | None = None,
        request_id: str | None = None,
        multi_modal_data: dict[str, Any] | ProcessedImages | None = None,
    ) -> RequestStream:
        """Queue a request; returns its stream of deltas.  Invalid requests raise ``ValueError``
        (from :meth:`Engine.add_request`, naming the request).  ``multi_modal_data`` carries the prompt's
        images (``{"image": [PIL images]}``, or :meth:`Engine.process_images`'s result), as
        :meth:`Engine.add_request` takes them."""
        request_id = request_id or uuid.uuid4().hex
        n = sampling_params.n
        stream = _Stream(
            asyncio.get_running_loop(),
            asyncio.Queue(),
            [StreamingText(self.tokenizer, sampling_params.stop) for _ in range(n)],
            [0] * n,
            [False] * n,
        )
        await self._call(
            lambda: self._add(request_id, prompt_token_ids, sampling_params, prompt, stream, multi_modal_data)
        )
        return RequestStream(self, request_id, stream.queue)

    async def generate(
        self,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        *,
        prompt: str | None = None,
        request_id: str | None = None,
        multi_modal_data: dict[str, Any] | ProcessedImages | None = None,
    ) -> AsyncIterator[RequestDelta]:
        """Add a request and yield its deltas until the last one (whose ``output`` is the finished request).

        Leaving the loop early (or the task being cancelled) aborts the request.
        """
        stream = await self.add_request(
            prompt_token_ids, sampling_params, prompt=prompt, request_id=request_id, multi_modal_data=multi_modal_data
        )
        try:
            async for delta in stream:
                yield delta
        finally:
            stream.close()

    async def pool(
        self,
        prompt_token_ids: list[int],
        params: PoolingParams | None = None,
        *,
        prompt: str | None = None,
        request_id: str | None = None,
        token_type_ids: list[int] | None = None,
    ) -> RequestOutput:
        """Add a request to a pooling engine and wait for its output (``output.pooled``: the pooler's vector).

        Invalid requests raise ``ValueError`` (from :meth:`Engine.add_pooling_request`, naming the request);
        a cancelled wait aborts the request.
        """
        request_id = request_id or uuid.uuid4().hex
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue(), [StreamingText(self.tokenizer, [])], [0], [False])
        await self._call(
            lambda: self._add_pooling(request_id, prompt_token_ids, params, prompt, token_type_ids, stream)
        )
        deltas = RequestStream(self, request_id, stream.queue)
        try:
            async for delta in deltas:
                if delta.output is not None:
                    return delta.output
        finally:
            deltas.close()
        raise EngineDeadError(f"request {request_id!r} ended without an output")

    async def abort(self, request_id: str) -> None:
        """Abort a request: its blocks are freed before the next step, and its stream ends with a last delta
        of finish reason ``abort``.  Unknown or finished ids are ignored."""
        await self._call(lambda: self._abort(request_id))

    def abort_soon(self, request_id: str) -> None:
        """:meth:`abort` without waiting (from a ``finally`` or a callback): done before the engine's next step."""
        self._submit(lambda: self._abort(request_id))

    def abort_all_soon(self) -> None:
        """Abort every request in flight without waiting (a server's grace period is over); each stream ends
        with a last delta of finish reason ``abort``."""
        self._submit(self._abort_all)

    async def call(self, function: Callable[[Engine], Any]) -> Any:
        """Run ``function(engine)`` in the engine thread between steps; its result (for reads that need a
        consistent view, e.g. tests checking the block pool)."""
        return await self._call(lambda: function(self.engine))

    async def shutdown(self, grace_period: float = 0.0) -> None:
        """Let requests in flight finish for up to ``grace_period`` seconds, abort the rest, stop the thread.

        Steps go on until a KV connector has finished its transfers, so its
        saves are complete when this returns.
        """
        deadline = time.monotonic() + grace_period
        while self._num_sequences and self.alive and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.alive:
            await self._call(self._abort_all)
        with self._condition:
            self._stopping = True
            self._condition.notify()
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join)

    def _submit(self, command: Callable[[], Any]) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._condition:
            if not self.alive or self._stopping:
                future.set_exception(EngineDeadError(f"the engine is not running ({self.error or 'shut down'})"))
                return future
            self._commands.append((command, future))
            self._condition.notify()
        return future

    async def _call(self, command: Callable[[], Any]) -> Any:
        return await asyncio.wrap_future(self._submit(command))

    # -- the engine thread ------------------------------------------------------------------

    def _add(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None,
        stream: _Stream,
        multi_modal_data: dict[str, Any] | ProcessedImages | None = None,
    ) -> None:
        self.engine.add_request(
            prompt_token_ids, params, prompt=prompt, request_id=request_id, multi_modal_data=multi_modal_data
        )
        self._streams[request_id] = stream
        self._num_sequences += params.n

    def _add_pooling(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: PoolingParams | None,
        prompt: str | None,
        token_type_ids: list[int] | None,
        stream: _Stream,
    ) -> None:
        self.engine.add_pooling_request(
            prompt_token_ids, params, prompt=prompt, request_id=request_id, token_type_ids=token_type_ids
        )
        self._streams[request_id] = stream
        self._num_sequences += 1

    def _abort(self, request_id: str) -> None:
        # The stream stays: the next step returns the aborted request, and its last delta ends the stream.
        if request_id in self._streams:
            self.engine.abort([request_id])

    def _abort_all(self) -> None:
        for request_id in list(self._streams):
            self._abort(request_id)

    def _run(self) -> None:
        try:
            while True:
                with self._condition:
                    while not (self._commands or self._stopping or self.engine.has_unfinished_requests()):
                        self._condition.wait()
                    commands, self._commands = self._commands, []
                    stopping = self._stopping
                for command, future in commands:
                    try:
                        result = command()
                    except Exception as exc:  # noqa: BLE001 - handed to the caller
                        if future is not None:
                            future.set_exception(exc)
                    else:
                        if future is not None:
                            future.set_result(result)
                if stopping and not self.engine.has_unfinished_requests():
                    break
                if self.engine.has_unfinished_requests():
                    finished = self.engine.step()
                    self._publish(finished)
                self.snapshot = self._take_snapshot()
        except BaseException as exc:  # noqa: BLE001 - every stream learns why the engine stopped
            logger.exception("the engine thread stopped")
            self.error = exc
            self._fail_all(exc)
        finally:
            self._reject_pending(EngineDeadError("the engine has shut down"))
            self._close_connector()

    def _reject_pending(self, error: BaseException) -> None:
        """Fail the commands still queued (they came in as the thread stopped)."""
        with self._condition:
            commands, self._commands = self._commands, []
        for _, future in commands:
            if future is not None and not future.done():
                future.set_exception(error)

    def _fail_all(self, exc: BaseException) -> None:
        error = EngineDeadError(f"the engine stopped: {type(exc).__name__}: {exc}")
        self._reject_pending(error)
        for stream in self._streams.values():
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, error)
        self._streams.clear()
        self._num_sequences = 0

    def _close_connector(self) -> None:
        connector = self.engine.kv_connector
        close = getattr(connector, "close", None)
        if callable(close):
            try:
                close()
            except Exception:  # noqa: BLE001 - shutting down; report and go on
                logger.exception("KV connector %r failed to close", self.settings.kv_connector)

    def _publish(self, finished: list[RequestOutput]) -> None:
        """Hand each streamed request what this step added to it."""
        deltas: list[tuple[_Stream, RequestDelta]] = []
        for output in finished:
            for listener in self._finish_listeners:
                try:
                    listener(output)
                except Exception:  # noqa: BLE001 - a listener (metrics) must not stop the engine
                    logger.exception("finish listener %r failed on request %s", listener, output.request_id)
            stream = self._streams.pop(output.request_id, None)
            if stream is None:  # not added through this front end
                continue
            self._num_sequences -= len(stream.texts)
            completions = output.completions or [output.completion()]
            choices = [
                self._choice_delta(stream, index, c.token_ids, c.logprobs, c.text, c.finish_reason, c.stop_reason)
                for index, c in enumerate(completions)
            ]
            deltas.append((stream, RequestDelta(output.request_id, [c for c in choices if c is not None], output)))
        for request_id, stream in self._streams.items():
            sequences = self.engine.live_outputs(request_id)
            choices = [
                self._choice_delta(stream, index, s.token_ids, s.logprobs, s.text, s.finish_reason, s.stop_reason)
                for index, s in enumerate(sequences)
            ]
            changed = [c for c in choices if c is not None]
            if changed:
                deltas.append((stream, RequestDelta(request_id, changed)))
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, RequestDelta]]] = {}
        for stream, delta in deltas:
            by_loop.setdefault(stream.loop, []).append((stream, delta))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_deliver, items)

    @staticmethod
    def _choice_delta(
        stream: _Stream,
        index: int,
        token_ids: list[int],
        logprobs: list[Any] | None,
        text: str,
        finish_reason: str | None,
        stop_reason: int | str | None,
    ) -> ChoiceDelta | None:
        """What sequence ``index`` gained since the last delta; ``None`` when nothing."""
        if stream.finished[index]:
            return None
        sent = stream.num_sent_tokens[index]
        new_ids = list(token_ids[sent:])
        stream.num_sent_tokens[index] = len(token_ids)
        new_logprobs = None if logprobs is None else list(logprobs[sent : len(token_ids)])
        if finish_reason == "abort":  # cut off where it stood: no text held back is sent
            stream.finished[index] = True
            new_text = ""
        elif finish_reason is not None:
            stream.finished[index] = True
            stream.texts[index].detokenizer.add(new_ids)
            new_text = stream.texts[index].finish(text)
        else:
            new_text = stream.texts[index].add(new_ids)
        if not new_ids and not new_text and finish_reason is None:
            return None
        return ChoiceDelta(index, new_text, new_ids, new_logprobs, finish_reason, stop_reason)

    def _take_snapshot(self) -> EngineSnapshot:
        engine = self.engine
        kv = engine.kv_cache_manager
        connector = engine.scheduler.kv_connector_stats
        return EngineSnapshot(
            num_running=len(engine.scheduler.running),
            num_waiting=len(engine.scheduler.waiting),
            num_blocks=kv.num_blocks,
            num_free_blocks=kv.num_free_blocks,
            kv_cache_usage=kv.usage,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            num_steps=engine.stats.num_steps,
            num_prompt_tokens=engine.stats.num_prompt_tokens,
            num_generated_tokens=engine.stats.num_generated_tokens,
            num_preemptions=engine.stats.num_preemptions,
            num_draft_tokens=engine.spec_stats.num_draft_tokens,
            num_accepted_tokens=engine.spec_stats.num_accepted_tokens,
            kv_connector_loaded_tokens=connector.num_loaded_tokens,
            kv_connector_recomputed_blocks=connector.num_recomputed_blocks,
            step_timings=dict(engine.step_timings()),
        )


class RequestStream:
    """The deltas of one request, as an async iterator; :meth:`close` aborts it if it has not finished.

    Whoever iterates must call :meth:`close` when done (in a ``finally``), so
    that a cancelled consumer frees the request's blocks.
    """

    def __init__(self, llm: AsyncLLM, request_id: str, queue: asyncio.Queue) -> None:
        self.llm = llm
        self.request_id = request_id
        self._queue = queue
        self.finished = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestDelta:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = item.finished
        return item

    def close(self) -> None:
        """Abort the request unless it has finished.

        No wait: the engine thread frees its blocks before its next step.
        """
        if not self.finished:
            self.finished = True
            self.llm.abort_soon(self.request_id)


def _deliver(items: list[tuple[_Stream, RequestDelta]]) -> None:
    for stream, delta in items:
        stream.queue.put_nowait(delta)
