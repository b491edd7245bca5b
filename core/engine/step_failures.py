"""When a step raises: find the request at fault, fail it alone, and go on; or stop the engine for good.

The runner works on a whole batch, so an exception from it (a plugin that
raises for one request's parameters, say) does not say whose it was.  The
scheduler has not advanced anything yet (it does that from the runner's
output), so the step can be replayed: every request of the step is dropped
from the runner's persistent batch and run again *alone*, as a new request
with its blocks.  Those that succeed give this step's output as if nothing
had happened (rewriting a block's KV with the same tokens writes the same
values); those that raise again are failed with ``finish_reason="error"``:
their blocks past what was computed before the step are dropped from the
prefix cache (their contents are not what their hashes say) and freed.

The drop is itself an (empty) step, so that tensor-parallel ranks, which
run every step rank 0 runs, replay in step: it puts each dropped request's
generator, and the default one, back where they were before the failed
step.  With a KV connector the failed step's loads are completed and its
saves handed over first (they are of blocks earlier steps computed, still
intact), and the replay runs without the connector, so no block is saved
that was never computed.

An exception where the engine's own bookkeeping was half-updated (the
scheduler, the output processing, the replay itself) cannot be undone, so
it makes the engine dead: :class:`EngineDeadError` on every later call.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from patchbay.scheduling.request import RequestStatus
from patchbay.scheduling.scheduler import Scheduler
from patchbay.scheduling.scheduler_output import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from patchbay.worker.model_runner import StepStage


class EngineDeadError(RuntimeError):
    """The engine stopped after an error that may have left its state inconsistent; make a new one."""


@dataclass
class IsolatedStep:
    """A failed step replayed request by request."""

    output: ModelRunnerOutput
    """The merged output of the requests that ran alone without error."""
    errors: dict[str, str] = field(default_factory=dict)
    """Request id to the error it raised when run alone."""


def describe_failure(exc: BaseException, plugins: Mapping[str, Iterable[Any]]) -> str:
    """``"sampler:standard raised ValueError: ..."``: the exception, naming the plugin whose code raised it.

    ``plugins`` maps ``KIND:NAME`` to the plugin's objects (instance, its
    implementation class); the innermost traceback frame that runs a method
    of one of them, or code of its module, names the plugin.
    """
    modules: dict[str, str] = {}
    instances: dict[int, str] = {}
    for reference, objects in plugins.items():
        for obj in objects:
            if obj is None:
                continue
            instances[id(obj)] = reference
            cls = obj if isinstance(obj, type) else type(obj)
            modules.setdefault(cls.__module__, reference)
    blamed = None
    for frame, _ in reversed(list(traceback.walk_tb(exc.__traceback__))):
        owner = frame.f_locals.get("self")
        blamed = (
            instances.get(id(owner))
            or instances.get(id(type(owner)))
            or modules.get(frame.f_globals.get("__name__", ""))
        )
        if blamed is not None:
            break
    message = f"{type(exc).__name__}: {exc}"
    return f"{blamed} raised {message}" if blamed else message


def replay_alone(
    runner: Any,
    scheduler: Scheduler,
    scheduler_output: SchedulerOutput,
    plugins: Mapping[str, Iterable[Any]],
    send: Callable[[SchedulerOutput], None] | None = None,
) -> IsolatedStep:
    """Run each request of a failed step alone; see the module docstring.

    ``send`` hands each step of the replay to the other ranks before this
    runner runs it (``None``: there are none).  With a KV connector, the
    failed step's loads and saves are settled first and the replay itself
    neither loads nor saves; the step's transfer reports join its output.
    """
    stage = runner.stage
    runner.settle_connector(scheduler_output, stage)

    def run(step: SchedulerOutput) -> ModelRunnerOutput:
        if send is not None:
            send(step)
        return runner.execute_model(step)

    logprobs: list[Any] = []
    draft_token_ids: list[list[int]] = []
    merged = ModelRunnerOutput(req_ids=[], sampled_token_ids=[], logprobs=logprobs, draft_token_ids=draft_token_ids)
    errors: dict[str, str] = {}
    with runner.connector_paused():
        # Every rank drops the step's requests, and its generators go back to where they were before the step.
        run(
            _dropping(
                scheduler_output.finished_req_ids,
                scheduler_output.preempted_req_ids
                | scheduler_output.reset_req_ids
                | set(scheduler_output.num_scheduled_tokens),
            )
        )
        for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            request = scheduler.requests[req_id]
            alone = SchedulerOutput(
                scheduled_new_reqs=[
                    NewRequestData(
                        req_id=req_id,
                        prompt_token_ids=list(request.prompt_token_ids),
                        output_token_ids=list(request.output_token_ids),
                        sampling_params=request.sampling_params,
                        block_ids=scheduler.kv_cache_manager.get_block_ids(req_id),
                        num_computed_tokens=request.num_computed_tokens,
                        mm_features=request.mm_features,
                    )
                ],
                scheduled_cached_reqs=CachedRequestData(),
                num_scheduled_tokens={req_id: num_tokens},
                total_num_scheduled_tokens=num_tokens,
                scheduled_spec_decode_tokens={req_id: drafts}
                if (drafts := scheduler_output.scheduled_spec_decode_tokens.get(req_id))
                else {},
                # The images this step encodes for it (those encoded before are still cached).
                scheduled_encoder_inputs={req_id: images}
                if (images := scheduler_output.scheduled_encoder_inputs.get(req_id))
                else {},
                free_encoder_hashes=scheduler_output.free_encoder_hashes,
            )
            try:
                output = run(alone)
            except Exception as exc:  # noqa: BLE001 - any failure of this request alone is its own
                if send is not None and runner.stage < StepStage.SAMPLING:
                    # The other ranks wait in a collective this rank never joined: nothing can be replayed.
                    failure = describe_failure(exc, plugins)
                    raise EngineDeadError(f"request {req_id!r} raised alone before the collectives: {failure}") from exc
                errors[req_id] = describe_failure(exc, plugins)
                run(_dropping({req_id}, set()))
                continue
            for row, row_id in enumerate(output.req_ids):
                merged.req_ids.append(row_id)
                merged.sampled_token_ids.append(output.sampled_token_ids[row])
                logprobs.append(output.logprobs[row] if output.logprobs else None)
                draft_token_ids.append(output.draft_token_ids[row] if output.draft_token_ids else [])
            merged.prompt_logprobs.update(output.prompt_logprobs)
            merged.pooled.update(output.pooled)
    if not any(logprobs):
        merged.logprobs = None
    if not any(draft_token_ids):
        merged.draft_token_ids = None
    runner.report_connector(scheduler_output, merged, stage)
    return IsolatedStep(merged, errors)


def _dropping(finished: set[str], again: set[str]) -> SchedulerOutput:
    """An empty step that drops ``finished`` for good and ``again`` to run again, rewinding their draws."""
    return SchedulerOutput(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=CachedRequestData(),
        num_scheduled_tokens={},
        total_num_scheduled_tokens=0,
        finished_req_ids=set(finished),
        reset_req_ids=set(again),
        drops_failed_step=True,
        grammar_bitmasks={},  # rank 0's matchers stay as they were before the step; no rank needs a row
    )


def fail_requests(scheduler: Scheduler, request_ids: Iterable[str]) -> None:
    """Finish requests whose step failed.

    Forgets the cached hashes of the blocks they did not finish computing, and frees them.
    """
    manager = scheduler.kv_cache_manager
    for request_id in request_ids:
        request = scheduler.requests.get(request_id)
        if request is None:
            continue
        first_unfinished = request.num_computed_tokens // manager.block_size
        if request.status == RequestStatus.RUNNING:
            for pool, block_ids in zip(manager.pools, manager.get_block_ids(request_id), strict=True):
                for block_id in block_ids[first_unfinished:]:
                    block = pool.blocks[block_id]
                    if block.block_hash is not None and pool.cached_blocks.get(block.block_hash) is block:
                        del pool.cached_blocks[block.block_hash]
                    block.block_hash = None
        scheduler.finish_requests([request_id], "abort")
