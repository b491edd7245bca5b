"""Continuous batching, first come first served: the vLLM v1 scheduling policy.

Each step spends a token budget: first on running requests (decodes, drafts
to verify, continuing prefill chunks), preempting the latest arrivals when
blocks run out, then on waiting requests in arrival order.  A request's
``num_computed_tokens`` is advanced when the runner's output comes back.

With a KV connector, a waiting request's prompt may be partly loaded instead
of computed: after the local prefix-cache lookup the connector says how many
more tokens it can supply.  A synchronous load happens in the same step,
before the forward pass, so those tokens count as computed at once; an
asynchronous one parks the request (``WAITING_FOR_REMOTE_KVS``) until the
runner reports it in ``finished_recving``.  Blocks that failed to load are
recomputed, never trusted.

With ``max_batches_in_flight`` above 1 (pipeline parallelism: one per
stage) the engine schedules the next batch before the earlier ones'
outputs are back (``pipelined`` asks for the same bookkeeping with one
batch in flight: stages in lockstep).  A request scheduled in a batch whose output has
not come back is *in flight*: it is not scheduled again until that output
is applied, whether it decodes (its next token is not known yet) or
prefills (its next chunk waits too: ``num_computed_tokens`` advances only
when an output comes back, so chunks of one prompt never overlap, while
different requests' batches do).  Outputs must be applied in the order the
batches were scheduled.  A request preempted, finished or aborted while in
flight has its late output ignored, and a preempted one is admitted again
only once that output is back.  Cached requests then carry the tokens
sampled since they last ran (``CachedRequestData.new_token_ids``): only the
last stage samples, the others learn the tokens this way.  A batch then
takes at most its share of the unfinished requests (their number divided
by ``max_batches_in_flight``, rounded up), so that the next batches find
requests that are not in flight: 16 decoding requests over 2 stages run as
two batches of 8 in turn, not one of 16 and an empty one (vLLM's v0
pipeline kept a scheduler per stage, with the requests spread among them,
for the same reason).
"""

from __future__ import annotations

import bisect
import itertools
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from patchbay.scheduling.encoder_cache_manager import EncoderCacheManager
from patchbay.scheduling.kv_cache_manager import KVCacheManager
from patchbay.scheduling.request import FINISHED_STATUS_BY_REASON, Request, RequestStatus
from patchbay.scheduling.scheduler_output import (
    BlockIds,
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)

if TYPE_CHECKING:
    from concurrent.futures import Future

    from patchbay.interfaces import KVConnectorScheduler
    from patchbay.scheduling.structured_output import GrammarCompilations


@dataclass
class RequestUpdate:
    """What one step produced for one request, for the output processor."""

    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    """``"stop"``, ``"length"``, ``"error"`` or ``None`` while the request runs on."""
    stop_reason: int | str | None = None
    """The stop token id that finished the request (``None`` for EOS and length)."""
    num_cached_tokens: int = 0
    """Prompt tokens served by the prefix cache (for metrics)."""
    pooled: Any = None
    """A pooling request's vector, in the update that finishes it."""


@dataclass
class KVConnectorStats:
    """What a KV connector did for this scheduler, over its life."""

    num_loaded_tokens: int = 0
    """Prompt tokens the connector was asked to load instead of computing them."""
    num_recomputed_blocks: int = 0
    """Blocks whose load failed, recomputed instead."""
    num_recomputed_requests: int = 0
    """Times a request was rolled back because one of its blocks failed to load."""


class Scheduler:
    """Decides, step by step, which requests run and how many tokens each computes."""

    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        block_size: int,
        chunked_prefill: bool = True,
        num_speculative_tokens: int = 0,
        kv_connector: KVConnectorScheduler | None = None,
        kv_connector_role: str = "both",
        grammars: GrammarCompilations | None = None,
        max_batches_in_flight: int = 1,
        pipelined: bool = False,
        max_loras: int | None = None,
        max_num_encoder_input_tokens: int = 8192,
        encoder_cache_size: int = 8192,
    ) -> None:
        for name, value in (
            ("max_num_seqs", max_num_seqs),
            ("max_num_batched_tokens", max_num_batched_tokens),
            ("max_model_len", max_model_len),
            ("max_num_encoder_input_tokens", max_num_encoder_input_tokens),
        ):
            if value < 1:
                raise ValueError(f"{name} must be positive, got {value}")
        if block_size != kv_cache_manager.block_size:
            raise ValueError(
                f"scheduler block_size {block_size} differs from the KV cache's {kv_cache_manager.block_size}"
            )
        needed = kv_cache_manager.max_blocks_per_request(max_model_len, max_num_batched_tokens)
        usable = kv_cache_manager.num_blocks - 1
        if needed > usable:
            raise ValueError(
                f"the KV cache is too small for one request of model.max_model_len={max_model_len} tokens: "
                f"it needs {needed} blocks of {block_size} tokens but the pool has {usable} usable blocks "
                f"({kv_cache_manager.num_blocks} minus the reserved null block); raise cache.num_blocks or "
                f"cache.memory, or lower model.max_model_len"
            )
        self.kv_cache_manager = kv_cache_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.chunked_prefill = chunked_prefill
        self.num_speculative_tokens = num_speculative_tokens
        self.kv_connector = kv_connector
        self.kv_connector_role = kv_connector_role
        self.max_loras = max_loras
        """LoRA adapters the running requests may use at once (``lora.max_loras``); ``None``: no adapters."""
        """``producer`` never loads; ``consumer`` and ``both`` ask the connector for every waiting request."""
        self.kv_connector_stats = KVConnectorStats()
        self.max_num_encoder_input_tokens = max_num_encoder_input_tokens
        """Encoder budget of one step: placeholder tokens of the images encoded in it."""
        self.encoder_cache = EncoderCacheManager(encoder_cache_size)
        self.grammars = grammars
        """Compiles structured-output constraints; ``None``: constrained requests are refused."""
        self.grammar_wait_seconds = 0.0
        """Seconds :meth:`schedule` spent blocked on grammar compilations with nothing else to run."""
        self._failed_updates: list[RequestUpdate] = []
        """Requests failed while scheduling (a constraint that cannot compile), reported by the next update."""

        self.requests: dict[str, Request] = {}
        """Unfinished requests by id."""
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        """Kept in arrival order, so the last one is the first to preempt."""
        self._finished_req_ids: set[str] = set()
        self._arrival_order: dict[str, tuple[float, int]] = {}
        self._counter = itertools.count()
        self._loading: dict[str, tuple[int, int]] = {}
        """Requests whose blocks a connector loads asynchronously.

        Each maps to (local prefix-cache tokens, tokens computed once loaded).
        """
        self._loaded: set[str] = set()
        """Of those, the ones the runner reported in ``finished_recving``."""
        self._held: dict[str, tuple[Request, set[str]]] = {}
        """Finished requests whose blocks stay allocated until the connector is done: ``sending`` and/or ``recving``."""
        self._reset_req_ids: set[str] = set()
        """Running requests rolled back after a load error: sent to the runner as new at their next step."""
        self.max_batches_in_flight = max_batches_in_flight
        self.overlapped = pipelined or max_batches_in_flight > 1
        """Batches go through pipeline stages: they may be scheduled before earlier ones' outputs are applied, and
        cached requests carry their new tokens (see the module docstring); ``pipelined`` asks for the tokens even
        with one batch in flight."""
        self._in_flight: dict[str, Request] = {}
        """With overlapped batches: requests of batches whose output is not applied yet, by id (the object
        tells a request apart from a later one that reuses its id)."""
        self._num_tokens_sent: dict[str, int] = {}
        """With overlapped batches: per request, its tokens the runners were told of (prompt and outputs)."""

    # -- requests in and out -----------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a new request; reject it if it can never run under these limits."""
        request_id = request.request_id
        if request_id in self.requests:
            raise ValueError(f"request {request_id!r} is already scheduled")
        if request.num_prompt_tokens == 0:
            raise ValueError(f"request {request_id!r} has an empty prompt")
        if request.num_prompt_tokens > self.max_model_len:
            raise ValueError(
                f"request {request_id!r}: prompt of {request.num_prompt_tokens} tokens exceeds "
                f"model.max_model_len={self.max_model_len}"
            )
        if not self.chunked_prefill and request.num_prompt_tokens > self.max_num_batched_tokens:
            raise ValueError(
                f"request {request_id!r}: prompt of {request.num_prompt_tokens} tokens exceeds "
                f"scheduler.max_num_batched_tokens={self.max_num_batched_tokens} and chunked prefill is off; "
                f"enable scheduler.chunked_prefill or raise the budget"
            )
        if request.block_size != self.block_size:
            raise ValueError(
                f"request {request_id!r} hashes blocks of {request.block_size} tokens, the cache uses {self.block_size}"
            )
        self._check_images(request)
        request.status = RequestStatus.WAITING
        constraint = request.sampling_params.structured_output
        if constraint is not None:
            if self.grammars is None:
                raise ValueError(f"request {request_id!r} sets structured_output but this run has no grammar backend")
            request.status = RequestStatus.WAITING_FOR_GRAMMAR
            request.grammar_future = self.grammars.submit(constraint)
        self.requests[request_id] = request
        self._arrival_order[request_id] = (request.arrival_time, next(self._counter))
        self.waiting.append(request)

    def _check_images(self, request: Request) -> None:
        """Refuse a request with an image larger than one step's encoder budget or the whole encoder cache."""
        for index, feature in enumerate(request.mm_features):
            for key, limit in (
                ("scheduler.max_num_encoder_input_tokens", self.max_num_encoder_input_tokens),
                ("scheduler.encoder_cache_size", self.encoder_cache.capacity),
            ):
                if feature.length > limit:
                    raise ValueError(
                        f"request {request.request_id!r}: image {index} takes {feature.length} placeholder tokens, "
                        f"more than {key}={limit}; raise it or send a smaller image"
                    )
        if not self.chunked_prefill and request.mm_features:
            # A prompt that runs whole encodes all its (distinct) images in one step.
            total = sum({feature.content_hash: feature.length for feature in request.mm_features}.values())
            limit = min(self.max_num_encoder_input_tokens, self.encoder_cache.capacity)
            if total > limit:
                raise ValueError(
                    f"request {request.request_id!r}: its images take {total} placeholder tokens, more than one "
                    f"step's encoder budget and cache ({limit}) while scheduler.chunked_prefill is off; enable "
                    "it, raise scheduler.max_num_encoder_input_tokens and scheduler.encoder_cache_size, or send "
                    "fewer images"
                )

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Finish the requests as aborted and free their blocks; unknown or finished ids are ignored."""
        self.finish_requests(request_ids, "abort")

    def finish_requests(self, request_ids: Iterable[str], reason: str, stop_reason: int | str | None = None) -> None:
        """Finish requests from outside (``"stop"`` for a stop string found in the text, ``"abort"``, ...)."""
        status = FINISHED_STATUS_BY_REASON.get(reason)
        if status is None:
            raise ValueError(f"unknown finish reason {reason!r}; expected one of {sorted(FINISHED_STATUS_BY_REASON)}")
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.stop_reason = stop_reason
            self._finish(request, status)

    def has_unfinished_requests(self) -> bool:
        """Requests still to run, or finished ones whose blocks a connector still uses (steps must go on)."""
        return bool(self.requests) or bool(self._held)

    def connector_waits(self) -> list[str]:
        """Requests whose progress waits on the connector: finished ones it holds, waiting ones it loads, sorted."""
        return sorted({*self._held, *(request_id for request_id in self._loading if request_id not in self._loaded)})

    def connector_holdings(self) -> str:
        """What the KV connector's held requests keep of the pool, and which request waits for it (for errors)."""
        held = {
            request_id: sum(len(ids) for ids in self.kv_cache_manager.get_block_ids(request_id))
            for request_id in sorted(self._held)
        }
        shown = ", ".join(f"{request_id!r}: {count}" for request_id, count in list(held.items())[:10])
        more = f" and {len(held) - 10} more requests" if len(held) > 10 else ""
        text = f"they hold {sum(held.values())} blocks of the pool ({shown}{more})"
        if self.waiting and not self.running:
            head = self.waiting[0]
            text += (
                f", and request {head.request_id!r} ({head.num_tokens} tokens) cannot be scheduled with the "
                f"{self.kv_cache_manager.num_free_blocks} free blocks of {self.block_size} tokens left"
            )
        return text

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # -- one step ----------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Choose this step's requests and token counts, allocating their blocks."""
        token_budget = self.max_num_batched_tokens
        encoder_budget = self.max_num_encoder_input_tokens
        encoder_inputs: dict[str, list[int]] = {}
        num_scheduled: dict[str, int] = {}
        spec_tokens: dict[str, list[int]] = {}
        new_reqs: list[NewRequestData] = []
        cached = CachedRequestData()
        preempted: set[str] = set()
        reset: set[str] = set()
        self._wait_for_grammars_if_idle()
        seats = self.max_num_seqs
        """Requests this batch may take: with overlapped batches, its share of the unfinished ones."""
        if self.overlapped:
            seats = max(1, -(-(len(self.running) + len(self.waiting)) // self.max_batches_in_flight))

        index = 0
        while index < len(self.running) and token_budget > 0 and len(num_scheduled) < seats:
            request = self.running[index]
            if request.request_id in self._in_flight:
                index += 1
                continue  # its output is not back: its next tokens are not known yet
            num_new = min(
                request.num_tokens_with_spec - request.num_computed_tokens,
                token_budget,
                self.max_model_len - request.num_computed_tokens,
            )
            plan: list[tuple[int, bool]] = []
            if request.mm_features:
                num_new, plan = self._plan_encoder_inputs(request, request.num_computed_tokens, num_new, encoder_budget)
            if num_new <= 0:
                index += 1
                continue
            new_block_ids = self._allocate_or_preempt(request, num_new, preempted)
            if new_block_ids is None:
                break  # the request preempted itself: every one after it is gone too
            if plan:
                encoder_budget -= self._commit_encoder_inputs(request, plan, encoder_inputs)
            # Drafts are the last scheduled tokens; the budget may cut some off.
            num_drafts = num_new - (request.num_tokens - request.num_computed_tokens)
            if num_drafts > 0:
                del request.spec_token_ids[num_drafts:]
                spec_tokens[request.request_id] = list(request.spec_token_ids)
            else:
                request.spec_token_ids.clear()
            if any(new_block_ids):
                self._tell_connector_after_alloc(request, 0)
            if request.request_id in self._reset_req_ids:
                self._reset_req_ids.discard(request.request_id)
                reset.add(request.request_id)
                new_reqs.append(self._new_request_data(request))
            else:
                cached.req_ids.append(request.request_id)
                cached.new_block_ids.append(new_block_ids if any(new_block_ids) else None)
                cached.num_computed_tokens.append(request.num_computed_tokens)
                if self.overlapped:
                    sent = self._num_tokens_sent.get(request.request_id, request.num_tokens)
                    cached.new_token_ids.append(request.all_token_ids[sent:])
                    self._num_tokens_sent[request.request_id] = request.num_tokens
            num_scheduled[request.request_id] = num_new
            token_budget -= num_new
            index += 1

        # A step that preempted admits no one: the freed blocks go to running requests first.
        if not preempted:
            token_budget = self._schedule_waiting(
                token_budget, num_scheduled, new_reqs, seats, encoder_budget, encoder_inputs
            )

        if (
            not num_scheduled
            and not self.running
            and self.waiting
            and not self._loading
            and not self._in_flight
            and not self._grammar_futures()
            and not self._held  # the connector frees them once its saves are done (kv_connector.stall_timeout)
        ):
            # The pool check at construction makes this unreachable; fail loudly rather than spin.
            head = self.waiting[0]
            raise RuntimeError(
                f"cannot schedule request {head.request_id!r} ({head.num_tokens} tokens) with nothing running: "
                f"{self.kv_cache_manager.num_free_blocks} free blocks of {self.block_size} tokens"
            )
        output = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=self.max_num_batched_tokens - token_budget,
            scheduled_spec_decode_tokens=spec_tokens,
            finished_req_ids=self._finished_req_ids,
            preempted_req_ids=preempted,
            reset_req_ids=reset,
            scheduled_encoder_inputs=encoder_inputs,
            free_encoder_hashes=self.encoder_cache.take_freed(),
        )
        output.highest_block_ids = self.kv_cache_manager.highest_block_ids
        if self.kv_connector is not None:
            output.kv_connector_metadata = self.kv_connector.build_connector_meta(list(num_scheduled))
        self._finished_req_ids = set()
        if self.overlapped:
            self._in_flight.update((request_id, self.requests[request_id]) for request_id in num_scheduled)
        return output

    @property
    def num_in_flight(self) -> int:
        """Requests scheduled in batches whose output is not applied yet (0 without overlapped batches)."""
        return len(self._in_flight)

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[RequestUpdate]:
        """Advance requests by the runner's results; returns one update per request with news."""
        rows = {request_id: row for row, request_id in enumerate(runner_output.req_ids)}
        updates, self._failed_updates = self._failed_updates, []
        if runner_output.failed:
            updates.extend(self._fail_running(runner_output.failed))
        if self.kv_connector is not None:
            self._update_transfers(runner_output)
        rolled_back = (
            self._handle_load_errors(runner_output.invalid_block_ids) if runner_output.invalid_block_ids else set()
        )
        for request_id, num_scheduled in scheduler_output.num_scheduled_tokens.items():
            request = self.requests.get(request_id)
            if self.overlapped and self._in_flight.pop(request_id, None) is not request:
                continue  # finished or aborted while in flight (and maybe its id reused since)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # finished, aborted or preempted since it was scheduled
            if request_id in rolled_back:
                continue  # it ran on KV that failed to load: this step's work and sample are void
            row = rows.get(request_id)
            sampled = runner_output.sampled_token_ids[row] if row is not None else []
            drafts = scheduler_output.scheduled_spec_decode_tokens.get(request_id, [])
            # 3 drafts, 2 accepted: 4 tokens scheduled, 3 sampled (2 drafts + 1 correction),
            # 1 rejected, so 3 tokens join the cache.
            num_rejected = len(drafts) + 1 - len(sampled) if drafts and sampled else 0
            request.num_computed_tokens += num_scheduled - num_rejected
            if request.mm_features:
                self._release_consumed_images(request)
            if request.pooling is not None:
                update = self._pooling_update(request, runner_output)
                if update is not None:
                    updates.append(update)
                continue
            if request.num_computed_tokens < request.num_tokens:
                sampled = []  # a partial prefill samples nothing; a runner that did anyway is ignored

            new_token_ids = []
            for token_id in sampled:
                request.append_output_token_ids(token_id)
                new_token_ids.append(token_id)
                if self._check_stop(request):
                    break  # tokens after a stop are dropped

            if request.is_finished:
                self.running.remove(request)
                self._finish(request, request.status)
            elif self.num_speculative_tokens and runner_output.draft_token_ids and row is not None:
                request.spec_token_ids = list(runner_output.draft_token_ids[row][: self.num_speculative_tokens])
            finished = request.is_finished
            if new_token_ids or finished:
                updates.append(
                    RequestUpdate(
                        request_id,
                        new_token_ids,
                        request.finish_reason if finished else None,
                        request.stop_reason,
                        max(request.num_cached_tokens, 0),
                    )
                )
        return updates

    def _pooling_update(self, request: Request, runner_output: ModelRunnerOutput) -> RequestUpdate | None:
        """A pooling request whose prompt has all run finishes with the runner's vector (``None``: it runs on)."""
        if request.num_computed_tokens < request.num_tokens:
            return None
        self.running.remove(request)
        pooled = runner_output.pooled.get(request.request_id)
        if pooled is None:
            return self._fail(request, "its prompt ran to the end but the runner pooled nothing for it", report=False)
        request.pooled = pooled
        self._finish(request, RequestStatus.FINISHED_STOPPED)
        return RequestUpdate(request.request_id, [], "stop", None, max(request.num_cached_tokens, 0), pooled=pooled)

    # -- helpers -----------------------------------------------------------

    def _allocate_or_preempt(self, request: Request, num_new: int, preempted: set[str]) -> BlockIds | None:
        """Allocate for a running request, preempting the latest arrivals until it fits.

        Returns ``None`` when the request itself had to be preempted.
        """
        while True:
            new_block_ids = self.kv_cache_manager.allocate_slots(request, num_new)
            if new_block_ids is not None:
                return new_block_ids
            victim = self.running.pop()
            self._preempt(victim)
            preempted.add(victim.request_id)
            if victim is request:
                return None

    def _schedule_waiting(
        self,
        token_budget: int,
        num_scheduled: dict[str, int],
        new_reqs: list[NewRequestData],
        seats: int,
        encoder_budget: int,
        encoder_inputs: dict[str, list[int]],
    ) -> int:
        """Admit waiting requests in arrival order while budget, seats (``max_num_seqs`` running, ``seats`` in this
        batch), blocks and the encoder budget last; returns the token budget left."""
        skipped: list[Request] = []
        adapters = {r.sampling_params.lora for r in self.running} - {None}
        while (
            self.waiting and token_budget > 0 and len(self.running) < self.max_num_seqs and len(num_scheduled) < seats
        ):
            request = self.waiting[0]
            request_id = request.request_id
            num_external = 0
            lora = request.sampling_params.lora
            if lora is not None and lora not in adapters and len(adapters) >= (self.max_loras or 0):
                skipped.append(self.waiting.popleft())  # its adapter waits for a slot: the running ones use them all
                continue
            if request_id in self._in_flight:
                skipped.append(self.waiting.popleft())  # preempted while in flight: its output comes back first
                continue
            if request.status == RequestStatus.WAITING_FOR_GRAMMAR and not self._grammar_ready(request):
                if not request.is_finished:
                    skipped.append(self.waiting.popleft())  # still compiling
                continue
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                if request_id not in self._loaded:
                    skipped.append(self.waiting.popleft())  # its blocks are still on their way
                    continue
                # Loaded: it holds its blocks already, and the loaded tokens are computed.
                computed_block_ids, num_local, num_computed = None, *self._loading[request_id]
            else:
                computed_block_ids, num_local = self.kv_cache_manager.get_computed_blocks(request)
                num_external, load_async = self._external_tokens(request, num_local)
                num_computed = num_local + num_external
                if load_async:
                    if not self._start_async_load(request, computed_block_ids, num_local, num_external):
                        if self._evict_parked(request, skipped):
                            continue
                        break
                    skipped.append(self.waiting.popleft())
                    continue
            num_new = request.num_tokens - num_computed
            # Without chunked prefill a request runs whole or waits, unless it can never fit
            # whole (a resumed request whose outputs pushed it past the budget).
            must_fit_whole = not self.chunked_prefill and num_new <= self.max_num_batched_tokens
            if must_fit_whole and num_new > token_budget:
                skipped.append(self.waiting.popleft())
                continue
            num_new = min(num_new, token_budget)
            plan: list[tuple[int, bool]] = []
            if request.mm_features:
                wanted = num_new
                num_new, plan = self._plan_encoder_inputs(request, num_computed, num_new, encoder_budget)
                if num_new <= 0 or (must_fit_whole and num_new < wanted):
                    break  # its next image waits for encoder budget or cache room; later arrivals wait behind it
            if computed_block_ids is None:
                request.num_computed_tokens = num_computed
                allocated = self.kv_cache_manager.allocate_slots(request, num_new)
            else:
                # Tokens loaded by the connector this step take blocks like the chunk computed after them.
                allocated = self.kv_cache_manager.allocate_slots(
                    request, num_external + num_new, computed_block_ids, num_local
                )
            if allocated is None:
                if self._evict_parked(request, skipped):
                    continue
                break
            self.waiting.popleft()
            self._loading.pop(request_id, None)
            self._loaded.discard(request_id)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_computed
            encoder_budget -= self._commit_encoder_inputs(request, plan, encoder_inputs)
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_local
            self._tell_connector_after_alloc(request, num_external)
            self.kv_connector_stats.num_loaded_tokens += num_external
            bisect.insort(self.running, request, key=lambda r: self._arrival_order[r.request_id])
            if lora is not None:
                adapters.add(lora)
            new_reqs.append(self._new_request_data(request))
            num_scheduled[request_id] = num_new
            token_budget -= num_new
        self.waiting.extendleft(reversed(skipped))
        return token_budget

    def _new_request_data(self, request: Request) -> NewRequestData:
        if self.overlapped:
            self._num_tokens_sent[request.request_id] = request.num_tokens
        return NewRequestData(
            req_id=request.request_id,
            prompt_token_ids=list(request.prompt_token_ids),
            output_token_ids=list(request.output_token_ids),
            sampling_params=request.sampling_params,
            block_ids=self.kv_cache_manager.get_block_ids(request.request_id),
            num_computed_tokens=request.num_computed_tokens,
            grammar=request.grammar,
            mm_features=request.mm_features,
            pooling=request.pooling,
        )

    def _preempt(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        self.encoder_cache.release_all(request.request_id, request.mm_features)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids.clear()
        request.num_preemptions += 1
        self._reset_req_ids.discard(request.request_id)
        self.waiting.appendleft(request)

    # -- images ----------------------------------------------------------------

    def _plan_encoder_inputs(
        self, request: Request, start: int, num_new: int, encoder_budget: int
    ) -> tuple[int, list[tuple[int, bool]]]:
        """The images the chunk ``[start, start + num_new)`` needs, and the chunk cut to what can be served.

        Returns the tokens to schedule and ``(image index, cached)`` for each image the request does not hold
        yet whose placeholders the chunk reaches: a cached one is shared, another is encoded whole this step.
        An image the step's encoder budget or the cache's free room cannot take stops the chunk before its
        first placeholder (0 tokens when the chunk starts inside it or on it).  Nothing is recorded yet.
        """
        cache = self.encoder_cache
        plan: list[tuple[int, bool]] = []
        planned: set[str] = set()
        budget, room = encoder_budget, cache.num_reclaimable_tokens
        for index, feature in enumerate(request.mm_features):
            if feature.offset >= start + num_new:
                break
            if feature.end <= start or cache.uses(request.request_id, index, feature):
                continue  # its placeholders are computed already, or its output is held
            if feature.content_hash in planned:
                plan.append((index, True))
                continue
            if cache.is_cached(feature):
                plan.append((index, True))
                planned.add(feature.content_hash)
                if cache.is_released(feature):
                    room -= feature.length  # taken back: no longer room a new image may evict
                continue
            if feature.length > budget or feature.length > room:
                return max(0, feature.offset - start), plan
            plan.append((index, False))
            planned.add(feature.content_hash)
            budget -= feature.length
            room -= feature.length
        return num_new, plan

    def _commit_encoder_inputs(
        self, request: Request, plan: list[tuple[int, bool]], encoder_inputs: dict[str, list[int]]
    ) -> int:
        """Record a scheduled chunk's images (:meth:`_plan_encoder_inputs`); returns the encoder budget spent.

        The cached images are taken first, so the new ones' room never evicts them.  A request preempted in
        between (to make KV room for this one) only released its images: they stay cached, so a planned hit
        is still one and the step encodes nothing its budget did not count.
        """
        cache = self.encoder_cache
        spent = 0
        taken_first = [item for item in plan if item[1] and cache.is_cached(request.mm_features[item[0]])]
        for index, cached in taken_first + [item for item in plan if item not in taken_first]:
            feature = request.mm_features[index]
            if cached and not cache.is_cached(feature):
                raise RuntimeError(
                    f"request {request.request_id!r}: image {index} was planned as cached but its encoder output "
                    "was dropped before the step was committed"
                )
            cache.use(request.request_id, index, feature)
            if cached:
                cache.stats.hits += 1
                continue
            cache.stats.misses += 1
            cache.stats.encoded_tokens += feature.length
            encoder_inputs.setdefault(request.request_id, []).append(index)
            spent += feature.length
        return spent

    def _release_consumed_images(self, request: Request) -> None:
        """Release the images whose placeholders are all computed: their outputs are needed no more."""
        for index, feature in enumerate(request.mm_features):
            if feature.end <= request.num_computed_tokens:
                self.encoder_cache.release(request.request_id, index, feature)

    # -- structured output ---------------------------------------------------

    def _grammar_futures(self) -> list[Future[Any]]:
        return [
            r.grammar_future
            for r in self.waiting
            if r.status == RequestStatus.WAITING_FOR_GRAMMAR and r.grammar_future is not None
        ]

    def _wait_for_grammars_if_idle(self) -> None:
        """With nothing running and only compiling requests waiting, wait a little for a grammar instead of spinning."""
        if self.running or self._loading or not self.waiting or self.grammars is None:
            return
        futures = self._grammar_futures()
        if len(futures) == len(self.waiting):
            started = time.perf_counter()
            self.grammars.wait_any(futures, timeout=1.0)
            self.grammar_wait_seconds += time.perf_counter() - started

    def _grammar_ready(self, request: Request) -> bool:
        """Whether the head request's grammar is compiled (it becomes ``WAITING``).

        A failed one finishes it as ``error``.
        """
        future = request.grammar_future
        assert future is not None and self.grammars is not None
        if not future.done():
            return False
        request.grammar_future = None
        error = future.exception()
        if error is None:
            request.grammar = future.result()
            request.status = RequestStatus.WAITING
            return True
        constraint = request.sampling_params.structured_output
        assert constraint is not None  # only a constrained request compiles a grammar
        self.waiting.popleft()
        self._fail(request, self.grammars.error_message(constraint, error))
        return False

    def _fail_running(self, failed: dict[str, str]) -> list[RequestUpdate]:
        """Finish running requests the runner reported as failed (e.g. their grammar backend raised)."""
        updates = []
        for request_id, message in failed.items():
            request = self.requests.get(request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue
            self.running.remove(request)
            self.encoder_cache.drop_all(request_id, request.mm_features)  # their encoding may be what failed
            updates.append(self._fail(request, message, report=False))
        return updates

    def _fail(self, request: Request, message: str, *, report: bool = True) -> RequestUpdate:
        """Finish a request, already out of the queues, as ``error`` with ``message`` as its stop reason."""
        request.stop_reason = message
        self._finish(request, RequestStatus.FINISHED_ERROR)
        update = RequestUpdate(request.request_id, [], "error", message)
        if report:
            self._failed_updates.append(update)
        return update

    # -- KV connector --------------------------------------------------------

    def _external_tokens(self, request: Request, num_local: int) -> tuple[int, bool]:
        """Tokens past the local prefix-cache hit the connector can supply, and whether it loads them asynchronously."""
        if self.kv_connector is None or self.kv_connector_role == "producer":
            return 0, False
        if request.computes_whole_prompt:
            return 0, False  # prompt logprobs and some poolers need every prompt position computed
        num_external, load_async = self.kv_connector.get_num_new_matched_tokens(request, num_local)
        # Never the whole request: its last token is computed for its logits.
        num_external = max(0, min(num_external, request.num_tokens - 1 - num_local))
        return num_external, bool(load_async) and num_external > 0

    def _start_async_load(
        self, request: Request, computed_block_ids: BlockIds, num_local: int, num_external: int
    ) -> bool:
        """Allocate blocks for a request whose external tokens load asynchronously and park it; ``False``: no room."""
        if self.kv_cache_manager.allocate_slots(request, num_external, computed_block_ids, num_local) is None:
            return False
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        num_computed = num_local + num_external
        self._loading[request.request_id] = (num_local, num_computed)
        # Their contents are not there yet: no other request may hit them in the prefix cache until they are.
        block_ids = self._connector_block_ids(request)
        self._uncache(block_ids[num_local // self.block_size :])
        self.kv_connector_stats.num_loaded_tokens += num_external
        assert self.kv_connector is not None
        self.kv_connector.update_state_after_alloc(request, block_ids, num_external)
        return True

    def _evict_parked(self, request: Request, skipped: list[Request]) -> bool:
        """With nothing running, free the latest parked request whose load is done, so ``request`` can get blocks.

        Parked requests hold blocks while nothing runs to free any; without
        this, several parked requests can hold the whole pool and each wait
        for one more block.  The evicted request's loaded blocks keep their
        hashes, so it finds them in the prefix cache when it is admitted again.
        Returns ``False`` when nothing was evicted.
        """
        if self.running:
            return False  # running requests finish or are preempted, and free blocks
        for candidate in reversed([*skipped, *self.waiting]):
            request_id = candidate.request_id
            if candidate is request or request_id not in self._loaded:
                continue
            self.kv_cache_manager.free(candidate)
            self._loading.pop(request_id, None)
            self._loaded.discard(request_id)
            candidate.status = RequestStatus.WAITING
            candidate.num_computed_tokens = 0
            return True
        return False

    def _tell_connector_after_alloc(self, request: Request, num_external: int) -> None:
        if self.kv_connector is not None:
            self.kv_connector.update_state_after_alloc(request, self._connector_block_ids(request), num_external)

    def _connector_block_ids(self, request: Request) -> list[int]:
        """The request's block ids in KV-cache group 0, the group a connector moves."""
        return self.kv_cache_manager.get_block_ids(request.request_id)[0]

    def _uncache(self, block_ids: Sequence[int]) -> None:
        """Drop blocks from group 0's prefix cache (their contents are not, or no longer, what their hash says)."""
        pool = self.kv_cache_manager.pools[0]
        for block_id in block_ids:
            block = pool.blocks[block_id]
            if block.block_hash is not None and pool.cached_blocks.get(block.block_hash) is block:
                del pool.cached_blocks[block.block_hash]
            block.block_hash = None

    def _update_transfers(self, runner_output: ModelRunnerOutput) -> None:
        """Note finished async loads; free finished requests' blocks once the connector is done with them."""
        for request_id in runner_output.finished_recving:
            if request_id in self._held:
                self._release(request_id, "recving")
            elif request_id in self._loading:
                self._loaded.add(request_id)
                request = self.requests[request_id]
                num_local, num_computed = self._loading[request_id]
                pool = self.kv_cache_manager.pools[0]
                blocks = [pool.blocks[block_id] for block_id in self._connector_block_ids(request)]
                # Loaded blocks may now be shared through the prefix cache.
                pool.cache_full_blocks(
                    blocks,
                    request.block_hashes,
                    num_local // self.block_size,
                    min(num_computed // self.block_size, len(request.block_hashes)),
                )
        for request_id in runner_output.finished_sending:
            if request_id in self._held:
                self._release(request_id, "sending")

    def _release(self, request_id: str, transfer: str) -> None:
        request, pending = self._held[request_id]
        pending.discard(transfer)
        if not pending:
            del self._held[request_id]
            self.kv_cache_manager.free(request)

    def _handle_load_errors(self, invalid_block_ids: set[int]) -> set[str]:
        """Roll requests holding blocks that failed to load back to the first such block; returns the running ones.

        Blocks of 4 tokens, a request with 12 computed tokens and table
        ``[7, 2, 9]``: block 2 failed, so it is back to 4 computed tokens
        and recomputes ``[4, 12)``; whatever it computed this step read bad
        KV and is discarded, and the runner rebuilds its row.
        """
        rolled_back: set[str] = set()
        recomputed: set[int] = set()
        block_size = self.block_size
        parked = [r for r in self.waiting if r.request_id in self._loading]
        for request in [*self.running, *parked]:
            block_ids = self._connector_block_ids(request)
            request_id = request.request_id
            if request_id in self._loading:
                num_local, num_computed = self._loading[request_id]
            else:
                num_computed = request.num_computed_tokens  # before this step's tokens are counted
            bad = [
                index
                for index, block_id in enumerate(block_ids[: -(-num_computed // block_size)])
                if block_id in invalid_block_ids
            ]
            if not bad:
                continue
            rollback_to = bad[0] * block_size
            recomputed.update(block_ids[index] for index in bad)
            self._uncache(block_ids[bad[0] :])
            self.kv_connector_stats.num_recomputed_requests += 1
            if request_id in self._loading:
                self._loading[request_id] = (min(num_local, rollback_to), rollback_to)
                continue
            request.num_computed_tokens = rollback_to
            request.spec_token_ids.clear()
            self._reset_req_ids.add(request_id)
            rolled_back.add(request_id)
        self.kv_connector_stats.num_recomputed_blocks += len(recomputed)
        return rolled_back

    def _check_stop(self, request: Request) -> bool:
        """Set a finished status if the last token ends the request.

        EOS and stop tokens count only once ``min_tokens`` outputs exist;
        length limits always apply.
        """
        params = request.sampling_params
        last = request.output_token_ids[-1]
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and last == request.eos_token_id:
                request.status = RequestStatus.FINISHED_STOPPED
                return True
            if last in params.stop_token_ids:
                request.status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = last
                return True
        if request.num_output_tokens >= params.max_tokens or request.num_tokens >= self.max_model_len:
            request.status = RequestStatus.FINISHED_LENGTH
            return True
        return False

    def _finish(self, request: Request, status: RequestStatus) -> None:
        """Record a finished request (already out of the running and waiting queues).

        Its blocks are freed now, unless the connector still uses them: an
        async save it asked to finish (``request_finished`` returned ``True``)
        or an async load still writing into them.
        """
        request_id = request.request_id
        request.status = status
        pending: set[str] = set()
        if self.kv_connector is not None:
            if self.kv_connector.request_finished(request, self._connector_block_ids(request)):
                pending.add("sending")
            if request_id in self._loading and request_id not in self._loaded:
                pending.add("recving")
        self._loading.pop(request_id, None)
        self._loaded.discard(request_id)
        self._reset_req_ids.discard(request_id)
        self._num_tokens_sent.pop(request_id, None)
        self.encoder_cache.release_all(request_id, request.mm_features)
        if pending:
            self._held[request_id] = (request, pending)
        else:
            self.kv_cache_manager.free(request)
        self._finished_req_ids.add(request_id)
        del self.requests[request.request_id]
        self._arrival_order.pop(request.request_id, None)
