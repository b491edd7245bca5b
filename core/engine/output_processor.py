"""Turning each step's news into request outputs: new tokens, stop strings, n > 1 groups, finishing.

The engine owns one :class:`OutputProcessor`.  It holds a growing
:class:`RequestOutput` per sequence (a request with ``n > 1`` runs as ``n``
sequences ``ID#0``, ``ID#1``, ...), advances them by the scheduler's
updates after each step, finds stop strings (detokenising only the
requests that have them) and hands back a request's output once all its
sequences have finished.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from patchbay.engine.outputs import RequestMetrics, RequestOutput, find_stop_string, merge_completions
from patchbay.sampling_params import SamplingParams
from patchbay.scheduling.scheduler import RequestUpdate
from patchbay.scheduling.scheduler_output import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)


@dataclass
class AppliedStep:
    """What one step's updates did to the outputs, for the engine to tell the scheduler and count."""

    finished_ids: list[str] = field(default_factory=list)
    """Sequences that finished in the step (errors and aborts first), in order."""
    stopped: list[tuple[str, str]] = field(default_factory=list)
    """Sequences a stop string ended: ``(sequence id, the stop string)``; the scheduler has still to finish them."""
    num_generated_tokens: int = 0


class OutputProcessor:
    """The unfinished requests' outputs, by sequence, and the groups of ``n > 1`` requests."""

    def __init__(self, tokenizer: Any) -> None:
        """``tokenizer``: the model's (Hugging Face) tokenizer, to decode texts and find stop strings."""
        self.tokenizer = tokenizer
        self.sequences: dict[str, RequestOutput] = {}
        """Unfinished sequences by id (a request with n > 1 has n of them)."""
        self.groups: dict[str, tuple[list[str], dict[str, RequestOutput]]] = {}
        """Requests with n > 1: their sequence ids and the sequences finished so far."""
        self.group_of: dict[str, str] = {}
        """The request each sequence of an ``n > 1`` request belongs to."""
        self.aborted: list[str] = []
        """Sequences aborted since the last step (the next step returns them)."""

    def in_use(self, request_id: str) -> bool:
        """Whether ``request_id`` names an unfinished request or sequence."""
        return request_id in self.sequences or request_id in self.groups

    def is_empty(self) -> bool:
        """Whether no request is held (every one finished, was returned or discarded)."""
        return not self.sequences and not self.groups and not self.group_of and not self.aborted

    def add_sequence(
        self,
        sequence_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float,
        request_id: str | None = None,
    ) -> None:
        """Start the output of a sequence; ``request_id``: the ``n > 1`` request it belongs to."""
        self.sequences[sequence_id] = RequestOutput(
            sequence_id, prompt, list(prompt_token_ids), params, metrics=RequestMetrics(arrival_time)
        )
        if request_id is not None:
            self.group_of[sequence_id] = request_id

    def add_group(self, request_id: str, sequence_ids: list[str]) -> None:
        """Record an ``n > 1`` request's sequences (before adding them)."""
        self.groups[request_id] = (sequence_ids, {})

    def sequence_ids(self, request_ids: list[str]) -> list[str]:
        """The sequences of ``request_ids``: a request's own id, or its ``n`` sequences' ids."""
        return [
            child
            for request_id in request_ids
            for child in (self.groups[request_id][0] if request_id in self.groups else [request_id])
        ]

    def abort(self, sequence_ids: list[str], now: float) -> None:
        """Finish unfinished sequences with reason ``abort``; the next step returns them."""
        for sequence_id in sequence_ids:
            output = self.sequences.get(sequence_id)
            if output is not None and not output.finished:
                output.finish_reason = "abort"
                output.metrics.finish_time = now
                self.aborted.append(sequence_id)

    def discard(self, request_ids: list[str], sequence_ids: list[str]) -> None:
        """Forget requests and their sequences: nothing returns their outputs, and their ids are free again."""
        for sequence_id in sequence_ids:
            self.sequences.pop(sequence_id, None)
            self.group_of.pop(sequence_id, None)
        for request_id in request_ids:
            self.groups.pop(request_id, None)
        dropped = set(sequence_ids)
        self.aborted = [sequence_id for sequence_id in self.aborted if sequence_id not in dropped]

    def live_outputs(self, request_id: str) -> list[RequestOutput]:
        """The growing outputs of an unfinished request, one per sequence in index order (see ``Engine``)."""
        if request_id in self.groups:
            children, done = self.groups[request_id]
            return [done[child] if child in done else self.sequences[child] for child in children]
        output = self.sequences.get(request_id)
        return [] if output is None else [output]

    def fail(self, failed: dict[str, str], now: float) -> list[str]:
        """Finish the sequences a step failed for with ``error`` (``failed``: the message by sequence id)."""
        for sequence_id, message in failed.items():
            logger.warning("request %r failed: %s", self.group_of.get(sequence_id, sequence_id), message)
            output = self.sequences[sequence_id]
            output.finish_reason, output.stop_reason, output.error = "error", message, message
            output.metrics.finish_time = now
        return list(failed)

    def record_step_details(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput) -> None:
        """Count each sequence's drafted and accepted tokens, keep the prompt logprobs computed in the step, and
        note when each new sequence was first scheduled."""
        now = time.monotonic()
        for new in scheduler_output.scheduled_new_reqs:
            scheduled = self.sequences.get(new.req_id)
            if scheduled is not None and scheduled.metrics.first_scheduled_time is None:
                scheduled.metrics.first_scheduled_time = now
        sampled_by_id = dict(zip(runner_output.req_ids, runner_output.sampled_token_ids, strict=True))
        for sequence_id, drafts in scheduler_output.scheduled_spec_decode_tokens.items():
            output = self.sequences.get(sequence_id)
            if output is not None and sampled_by_id.get(sequence_id):
                output.metrics.num_draft_tokens += len(drafts)
                output.metrics.num_accepted_tokens += len(sampled_by_id[sequence_id]) - 1
        for sequence_id, prompt_logprobs in runner_output.prompt_logprobs.items():
            output = self.sequences.get(sequence_id)
            if output is not None and output.prompt_logprobs is None:  # a preempted request computes them again
                output.prompt_logprobs = prompt_logprobs

    def apply(
        self, updates: list[RequestUpdate], runner_output: ModelRunnerOutput, errored: list[str], now: float
    ) -> AppliedStep:
        """Add the step's new tokens (and logprobs) to the outputs, end those a stop string or the scheduler ended."""
        applied = AppliedStep(finished_ids=self.aborted + errored)
        self.aborted = []
        logprobs_by_id = dict(zip(runner_output.req_ids, runner_output.logprobs or [], strict=False))
        for update in updates:
            output = self.sequences[update.request_id]
            if update.new_token_ids:
                if output.metrics.first_token_time is None:
                    output.metrics.first_token_time = now
                    output.metrics.num_cached_tokens = max(update.num_cached_tokens, 0)
                output.metrics.token_times.extend([now] * len(update.new_token_ids))
                output.token_ids.extend(update.new_token_ids)
                applied.num_generated_tokens += len(update.new_token_ids)
                if output.sampling_params.logprobs is not None:
                    output.logprobs = (output.logprobs or []) + [logprobs_by_id.get(update.request_id)]
            if update.pooled is not None:
                output.pooled = update.pooled.tolist()
            if update.finish_reason is None and output.sampling_params.stop:
                stop = self._stop_string(output, len(update.new_token_ids))
                if stop is not None:
                    applied.stopped.append((update.request_id, stop))
                    update.finish_reason, update.stop_reason = "stop", stop
            if update.finish_reason is not None:
                output.finish_reason = update.finish_reason
                output.stop_reason = update.stop_reason
                if update.finish_reason == "error":  # the scheduler failed it: a grammar, a matcher, a connector
                    output.error = str(update.stop_reason)
                output.metrics.finish_time = now
                applied.finished_ids.append(update.request_id)
        return applied

    def finish(self, sequence_ids: list[str]) -> list[RequestOutput]:
        """Retire finished sequences; the outputs of the requests all of whose sequences are now done."""
        return [output for sequence_id in sequence_ids if (output := self._finish(sequence_id)) is not None]

    def _finish(self, sequence_id: str) -> RequestOutput | None:
        output = self.sequences.pop(sequence_id)
        cut_at_stop_string = output.finish_reason == "stop" and isinstance(output.stop_reason, str)
        if not cut_at_stop_string:  # a stop string's cut is final, even when it leaves no text at all
            output.text = self.tokenizer.decode(output.token_ids, skip_special_tokens=True)
        request_id = self.group_of.pop(sequence_id, None)
        if request_id is None:
            output.completions = [output.completion()]
            return output
        children, done = self.groups[request_id]
        done[sequence_id] = output
        if len(done) < len(children):
            return None
        del self.groups[request_id]
        return merge_completions(request_id, [done[child] for child in children])

    def _stop_string(self, output: RequestOutput, num_new_tokens: int) -> str | None:
        """The stop string the output's text now holds (its text then cut before it); ``None`` if none."""
        decode = self.tokenizer.decode
        text = decode(output.token_ids, skip_special_tokens=True)
        tail_text = decode(output.token_ids[-num_new_tokens:], skip_special_tokens=True)
        found = find_stop_string(text, output.sampling_params.stop, len(tail_text) + 1)
        if found is None:
            return None
        stop, index = found
        output.text = text[:index]
        return stop
