"""Continuous batching, first come first served: the vLLM v1 scheduling policy.

Each step spends a token budget: first on running requests (decodes, drafts
to verify, continuing prefill chunks), preempting the latest arrivals when
blocks run out, then on waiting requests in arrival order.  A request's
``num_computed_tokens`` is advanced when the runner's output comes back.
"""

from __future__ import annotations

import bisect
import itertools
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from patchbay.kv_cache_manager import KVCacheManager
from patchbay.request import FINISHED_STATUS_BY_REASON, Request, RequestStatus
from patchbay.scheduler_output import BlockIds, CachedRequestData, ModelRunnerOutput, NewRequestData, SchedulerOutput


@dataclass
class RequestUpdate:
    """What one step produced for one request, for the output processor."""

    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    """``"stop"``, ``"length"`` or ``None`` while the request runs on."""
    stop_reason: int | str | None = None
    """The stop token id that finished the request (``None`` for EOS and length)."""
    num_cached_tokens: int = 0
    """Prompt tokens served by the prefix cache (for metrics)."""


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
    ) -> None:
        for name, value in (("max_num_seqs", max_num_seqs), ("max_num_batched_tokens", max_num_batched_tokens),
                            ("max_model_len", max_model_len)):
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

        self.requests: dict[str, Request] = {}
        """Unfinished requests by id."""
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        """Kept in arrival order, so the last one is the first to preempt."""
        self._finished_req_ids: set[str] = set()
        self._arrival_order: dict[str, tuple[float, int]] = {}
        self._counter = itertools.count()

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
        request.status = RequestStatus.WAITING
        self.requests[request_id] = request
        self._arrival_order[request_id] = (request.arrival_time, next(self._counter))
        self.waiting.append(request)

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
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # -- one step ----------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Choose this step's requests and token counts, allocating their blocks."""
        token_budget = self.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        spec_tokens: dict[str, list[int]] = {}
        new_reqs: list[NewRequestData] = []
        cached = CachedRequestData()
        preempted: set[str] = set()

        index = 0
        while index < len(self.running) and token_budget > 0:
            request = self.running[index]
            num_new = min(
                request.num_tokens_with_spec - request.num_computed_tokens,
                token_budget,
                self.max_model_len - request.num_computed_tokens,
            )
            if num_new <= 0:
                index += 1
                continue
            new_block_ids = self._allocate_or_preempt(request, num_new, preempted)
            if new_block_ids is None:
                break  # the request preempted itself: every one after it is gone too
            # Drafts are the last scheduled tokens; the budget may cut some off.
            num_drafts = num_new - (request.num_tokens - request.num_computed_tokens)
            if num_drafts > 0:
                del request.spec_token_ids[num_drafts:]
                spec_tokens[request.request_id] = list(request.spec_token_ids)
            else:
                request.spec_token_ids.clear()
            cached.req_ids.append(request.request_id)
            cached.new_block_ids.append(new_block_ids if any(new_block_ids) else None)
            cached.num_computed_tokens.append(request.num_computed_tokens)
            num_scheduled[request.request_id] = num_new
            token_budget -= num_new
            index += 1

        # A step that preempted admits no one: the freed blocks go to running requests first.
        if not preempted:
            token_budget = self._schedule_waiting(token_budget, num_scheduled, new_reqs)

        if not num_scheduled and not self.running and self.waiting:
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
        )
        self._finished_req_ids = set()
        return output

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[RequestUpdate]:
        """Advance requests by the runner's results; returns one update per request with news."""
        rows = {request_id: row for row, request_id in enumerate(runner_output.req_ids)}
        updates = []
        for request_id, num_scheduled in scheduler_output.num_scheduled_tokens.items():
            request = self.requests.get(request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # finished or aborted since it was scheduled
            row = rows.get(request_id)
            sampled = runner_output.sampled_token_ids[row] if row is not None else []
            drafts = scheduler_output.scheduled_spec_decode_tokens.get(request_id, [])
            # 3 drafts, 2 accepted: 4 tokens scheduled, 3 sampled (2 drafts + 1 correction),
            # 1 rejected, so 3 tokens join the cache.
            num_rejected = len(drafts) + 1 - len(sampled) if drafts and sampled else 0
            request.num_computed_tokens += num_scheduled - num_rejected
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
            if new_token_ids or request.is_finished:
                updates.append(RequestUpdate(
                    request_id, new_token_ids, request.finish_reason, request.stop_reason,
                    max(request.num_cached_tokens, 0),
                ))
        return updates

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
        self, token_budget: int, num_scheduled: dict[str, int], new_reqs: list[NewRequestData]
    ) -> int:
        """Admit waiting requests in arrival order while budget, seats and blocks last; returns the budget left."""
        skipped: list[Request] = []
        while self.waiting and token_budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            computed_block_ids, num_computed = self.kv_cache_manager.get_computed_blocks(request)
            num_new = request.num_tokens - num_computed
            # Without chunked prefill a request runs whole or waits, unless it can never fit
            # whole (a resumed request whose outputs pushed it past the budget).
            must_fit_whole = not self.chunked_prefill and num_new <= self.max_num_batched_tokens
            if must_fit_whole and num_new > token_budget:
                skipped.append(self.waiting.popleft())
                continue
            num_new = min(num_new, token_budget)
            if self.kv_cache_manager.allocate_slots(request, num_new, computed_block_ids, num_computed) is None:
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_computed
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_computed
            bisect.insort(self.running, request, key=lambda r: self._arrival_order[r.request_id])
            new_reqs.append(NewRequestData(
                req_id=request.request_id,
                prompt_token_ids=list(request.prompt_token_ids),
                output_token_ids=list(request.output_token_ids),
                sampling_params=request.sampling_params,
                block_ids=self.kv_cache_manager.get_block_ids(request.request_id),
                num_computed_tokens=num_computed,
            ))
            num_scheduled[request.request_id] = num_new
            token_budget -= num_new
        self.waiting.extendleft(reversed(skipped))
        return token_budget

    def _preempt(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids.clear()
        request.num_preemptions += 1
        self.waiting.appendleft(request)

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
        """Record a finished request (already out of the running and waiting queues)."""
        request.status = status
        self.kv_cache_manager.free(request)
        self._finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]
        self._arrival_order.pop(request.request_id, None)
