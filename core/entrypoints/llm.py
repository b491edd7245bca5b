"""The offline API: ``patchbay.LLM(settings).generate(prompts, sampling_params)``."""

from __future__ import annotations

import os
from pathlib import Path
from collections.abc import Callable, Sequence
from typing import Any

from patchbay.contract.registry import Registry, registry_for
from patchbay.contract.settings import DEFAULT_MODEL, Settings, load_settings
from patchbay.engine import Engine, ProcessedImages, Prompt, RequestOutput, encode_prompt
from patchbay.engine import check_num_sequences
from patchbay.entrypoints.chat import (
    AnswerReader,
    ChatAnswer,
    ChatParsers,
    check_constraint_compiles,
    plan_tools,
    render_chat,
    template_messages,
)
from patchbay.entrypoints.chat_images import load_chat_images, refuse_images_for_text_model, split_image_parts
from patchbay.entrypoints.pooling import (
    PoolingInput,
    PoolingOutput,
    cosine_scores,
    pool,
    score_pairs,
    tokenize_input,
    tokenize_pair,
)
from patchbay.interfaces import PoolingParams, StructuredOutputParams
from patchbay.sampling_params import SamplingParams


class LLM:
    """Generate text with a model on patchbay's engine.

    ``settings`` is a :class:`Settings`, a path to a YAML file, or ``None``
    for the defaults (the bundled SmolLM2-135M-Instruct); keyword overrides
    use dotted keys with ``__`` for dots, e.g. ``LLM(scheduler__max_num_seqs=8)``.
    """

    def __init__(
        self,
        settings: Settings | str | os.PathLike[str] | None = None,
        *,
        registry: Registry | None = None,
        **overrides: Any,
    ) -> None:
        assignments = [f"{key.replace('__', '.')}={_yaml_scalar(value)}" for key, value in overrides.items()]
        if isinstance(settings, Settings):
            if assignments:
                raise TypeError("pass overrides either in the Settings object or as keywords, not both")
            self.settings = settings
        else:
            self.settings = load_settings(settings, overrides=assignments, registry=registry or registry_for)
        self.engine = Engine(self.settings, registry=registry)
        self.tokenizer = self.engine.tokenizer
        self._registry = registry
        self._chat: ChatParsers | None = None

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

        A prompt object may carry ``multi_modal_data={"image": image or [images]}`` for a
        vision-language model, one image marker per image in its text (vLLM's shape); an
        image is a path, bytes, a ``PIL.Image.Image``, a numpy array or a ``data:`` URL,
        decoded and checked against the ``multimodal:`` limits first.

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
            check_num_sequences(
                index if request_ids is None else request_ids[index], params, self.settings.scheduler.max_n
            )
        order: dict[str, int] = {}
        results: list[RequestOutput | None] = [None] * len(prompts)
        try:
            for index, (prompt, params) in enumerate(zip(prompts, params_list, strict=True)):
                request_id = None if request_ids is None else request_ids[index]
                try:
                    prompt = self._images_loaded(prompt)
                    text, token_ids = self.encode(prompt)
                except ValueError as exc:
                    raise ValueError(f"request {request_id if request_id is not None else index!r}: {exc}") from None
                images = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
                request_id = self.engine.add_request(
                    token_ids, params, prompt=text, request_id=request_id, multi_modal_data=images
                )
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

    def pool(
        self,
        inputs: PoolingInput | Sequence[PoolingInput],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        request_ids: Sequence[str] | None = None,
    ) -> list[PoolingOutput]:
        """The pooler's vector of every input, in input order, whatever the engine's task (``pooling:`` section).

        An input is a text (tokenized with the model's special tokens, as sentence-transformers does), a list
        of token ids, or ``{"prompt_token_ids": [...], "token_type_ids": [...]}``.  An input that cannot run
        (too long for the model, say) raises ``ValueError`` naming it before any runs.
        """
        items: list[Any] = [inputs] if isinstance(inputs, (str, dict)) or _is_token_ids(inputs) else list(inputs)
        prompts = [tokenize_input(self.tokenizer, item, f"input {index}") for index, item in enumerate(items)]
        return pool(self.engine, prompts, pooling_params, request_ids)

    def embed(
        self,
        inputs: PoolingInput | Sequence[PoolingInput],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
    ) -> list[PoolingOutput]:
        """Each input's embedding (``output.embedding``): an engine whose pooler's task is ``embed``."""
        self._require_task("embed", "embed")
        return self.pool(inputs, pooling_params)

    def classify(
        self,
        inputs: PoolingInput | Sequence[PoolingInput],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
    ) -> list[PoolingOutput]:
        """Each input's class probabilities (``output.probs``): an engine whose pooler's task is ``classify``."""
        self._require_task("classify", "classify")
        return self.pool(inputs, pooling_params)

    def score(
        self,
        first: str | Sequence[str],
        second: str | Sequence[str],
        pooling_params: PoolingParams | None = None,
    ) -> list[PoolingOutput]:
        """The relevance of each (first, second) pair (``output.score``): one text against each of a list, or two
        lists pair by pair.  A cross-encoder (task ``score``) reads each pair whole, as
        sentence-transformers' ``CrossEncoder.predict``; an embedding model's score is the cosine similarity
        of the two embeddings."""
        pairs = score_pairs(first, second)
        task = self._require_task("score", "embed", "score")
        if task == "score":
            prompts = [tokenize_pair(self.tokenizer, a, b, f"pair {index}") for index, (a, b) in enumerate(pairs)]
            return pool(self.engine, prompts, pooling_params)
        texts = list(dict.fromkeys(text for pair in pairs for text in pair))
        embeddings = self.pool(texts, pooling_params)
        where = {text: index for index, text in enumerate(texts)}
        return cosine_scores(
            [(where[a], where[b]) for a, b in pairs], embeddings, [str(index) for index in range(len(pairs))]
        )

    def _require_task(self, method: str, *tasks: str) -> str:
        """The engine's pooling task, when it is one of ``tasks``; else ``ValueError`` saying what runs it."""
        run = self.engine.pooling
        if run is None:
            raise ValueError(
                f"LLM.{method} needs a pooling engine (a pooling: section in the settings); this one generates"
            )
        if run.task not in tasks:
            raise ValueError(
                f"LLM.{method} needs a pooler for {' or '.join(tasks)}; this engine's pooler:{run.pooler_name} "
                f"serves {run.task}"
            )
        return run.task

    def _images_loaded(self, prompt: Prompt) -> Prompt:
        """``prompt`` with each image of its ``multi_modal_data`` decoded and checked (``multimodal:`` limits)."""
        if not isinstance(prompt, dict) or "multi_modal_data" not in prompt:
            return prompt
        if isinstance(prompt["multi_modal_data"], ProcessedImages):
            return prompt  # decoded and processed already (Engine.process_images)
        from patchbay.multimodal.images import load_multi_modal_data

        data = load_multi_modal_data(
            prompt["multi_modal_data"], limits=self.settings.multimodal, where="multi_modal_data"
        )
        return {**prompt, "multi_modal_data": data}

    def chat(
        self,
        messages: Sequence[dict[str, Any]],
        sampling_params: SamplingParams | None = None,
        *,
        tools: Sequence[dict[str, Any]] | None = None,
        tool_choice: Any = None,
        parallel_tool_calls: bool | None = None,
        tool_parser: str | None = None,
        reasoning_parser: str | None = None,
    ) -> ChatAnswer:
        """Answer one conversation the way ``patchbay serve``'s chat completions do, tools and reasoning included.

        ``tools``, ``tool_choice`` and ``parallel_tool_calls`` take OpenAI's
        shapes; ``required`` and a named function are enforced by the run's
        structured-output backend, ``auto`` is read by ``chat.tool_parser``
        (or ``tool_parser``).  Returns the content, the reasoning (with a
        reasoning parser) and the calls.  A message's ``content`` may be a
        list of parts: ``{"type": "text", "text": ...}``, OpenAI's
        ``{"type": "image_url", "image_url": {"url": ...}}`` and
        ``{"type": "image", "image": <path, bytes, PIL image or array>}``;
        the chat template places each image.  Bad input raises
        :class:`patchbay.entrypoints.chat.ChatRequestError` naming the field
        (:class:`patchbay.multimodal.images.ImageInputError` for an image).
        """
        if self._chat is None:
            registry = self._registry or registry_for(self.settings.plugins)
            self._chat = ChatParsers(self.settings, registry, bundled_model=self.settings.model.path == DEFAULT_MODEL)
        plan = plan_tools(tools, tool_choice, parallel_tool_calls)
        parsers = self._chat.for_request(tool_parser, reasoning_parser)
        messages, images = split_image_parts(template_messages(messages))
        if images and self.engine.image_inputs is None:
            refuse_images_for_text_model(images, Path(str(self.engine.model_dir)).name)
        text, token_ids = render_chat(self.tokenizer, messages, tools=tools, template=self._chat.template)
        prompt: dict[str, Any] = {"prompt_token_ids": token_ids, "prompt": text}
        if images:
            prompt["multi_modal_data"] = {"image": load_chat_images(images, self.settings.multimodal)}
        params = sampling_params or SamplingParams()
        if plan.enforced:
            if params.structured_output is not None:
                raise ValueError(
                    "tool_choice: required and named tool calls are enforced by a JSON schema; "
                    "they cannot be combined with structured_output"
                )
            grammars = self.engine.grammars
            check_constraint_compiles(
                plan, lambda schema: grammars.submit(StructuredOutputParams(json_schema=schema)).result()
            )
            params = SamplingParams.model_validate(
                {
                    **params.model_dump(exclude_unset=True),
                    "structured_output": plan.constraint(compact=self.settings.chat.compact_tool_calls),
                }
            )
        (output,) = self.generate(prompt, params)
        return AnswerReader(plan, *parsers).read(output.completions[0].text)


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(item, int) for item in value)


def _yaml_scalar(value: Any) -> str:
    import json

    return value if isinstance(value, str) else json.dumps(value)
