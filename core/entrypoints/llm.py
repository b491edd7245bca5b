"""The offline API: ``patchbay.LLM(settings).generate(prompts, sampling_params)``."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

from patchbay.contract.registry import Registry, registry_for
from patchbay.contract.settings import Settings, load_settings
from patchbay.engine import Engine, Prompt, RequestOutput, encode_prompt
from patchbay.engine.admission import check_num_sequences
from patchbay.sampling_params import SamplingParams



class LLM:
    """Generate text with a model on patchbay's engine.

    ``settings`` is a :class:`Settings`, a path to a YAML file, or ``None``
    for the defaults (the bundled SmolLM2-135M-Instruct); keyword overrides
    use dotted keys with ``__`` for dots, e.g. ``LLM(scheduler__max_num_seqs=8)``.
    """

    def __init__(self, settings: Settings | str | os.PathLike[str] | None = None, *,
                 registry: Registry | None = None, **overrides: Any) -> None:
        assignments = [f"{key.replace('__', '.')}={_yaml_scalar(value)}" for key, value in overrides.items()]
        if isinstance(settings, Settings):
            if assignments:
                raise TypeError("pass overrides either in the Settings object or as keywords, not both")
            self.settings = settings
        else:
            self.settings = load_settings(settings, overrides=assignments, registry=registry or registry_for)
        self.engine = Engine(self.settings, registry=registry)
        self.tokenizer = self.engine.tokenizer

    @property
    def spec_stats(self):  # noqa: ANN201 - patchbay.worker.spec_decode.SpecDecodeStats
        """Speculative-decoding counters since this LLM was created (drafted, accepted, per position)."""
        return self.engine.spec_stats

    def encode(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        """Prompt text (if any) and token ids; ``messages`` go through the chat template."""
        return encode_prompt(self.tokenizer, prompt)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        request_ids: Sequence[str] | None = None,
        on_finished: Callable[[RequestOutput], None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion, batched continuously; outputs come back in prompt order.

        ``sampling_params`` is one for all prompts or one per prompt (default:
        greedy, 16 tokens).  ``on_finished`` is called as each request ends
        (progress bars, streaming to a file).  ``request_ids`` names the
        requests (default: the engine numbers them).

        A request that cannot run raises ``ValueError`` naming it before any
        runs; one that fails inside a step comes back with ``finish_reason``
        ``"error"`` and its ``error`` while the others finish.  Whatever is
        raised, none of these requests is left queued in the engine.
        """
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"{len(prompts)} prompts but {len(params_list)} sampling parameter sets")
        if request_ids is not None and len(request_ids) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(request_ids)} request ids")
        for index, params in enumerate(params_list):
            check_num_sequences(index if request_ids is None else request_ids[index], params,
                                self.settings.scheduler.max_n)
        order: dict[str, int] = {}
        results: list[RequestOutput | None] = [None] * len(prompts)
        try:
            for index, (prompt, params) in enumerate(zip(prompts, params_list, strict=True)):
                request_id = None if request_ids is None else request_ids[index]
                try:
                    text, token_ids = self.encode(prompt)
                except ValueError as exc:
                    raise ValueError(f"request {request_id if request_id is not None else index!r}: {exc}") from None
                request_id = self.engine.add_request(token_ids, params, prompt=text, request_id=request_id)
                order[request_id] = index
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if output.request_id in order:
                        results[order[output.request_id]] = output
                        if on_finished is not None:
                            on_finished(output)
        except BaseException:
            # Whatever stopped us (a bad request, a callback, Ctrl-C), none of ours stays queued in the engine.
            if not self.engine.is_dead:
                self.engine.discard([request_id for request_id, index in order.items() if results[index] is None])
            raise
        return [result for result in results if result is not None]


def _yaml_scalar(value: Any) -> str:
    import json

    return value if isinstance(value, str) else json.dumps(value)
