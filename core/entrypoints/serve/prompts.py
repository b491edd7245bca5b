"""A request's prompt made ready for the engine: rendered, checked against the context, its constraint compiled.

Shared by the routers: the chat rendered (images decoded and processed), the
prompt's length checked against the model's context, the sampling parameters
built and an enforced tool choice's constraint compiled.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

from patchbay.engine import GrammarCompileBusy, MultiModalInputError, ProcessedImages
from patchbay.entrypoints.chat import ChatRequestError, ToolPlan, check_constraint_compiles, render_chat
from patchbay.entrypoints.chat_images import ImagePart
from patchbay.entrypoints.serve.images import ImageBytes
from patchbay.entrypoints.serve.protocol import APIError, sampling_params
from patchbay.entrypoints.serve.state import ServerState
from patchbay.interfaces import StructuredOutputParams
from patchbay.sampling_params import SamplingParams


@dataclass
class PreparedPrompt:
    """One prompt of a request, ready for the engine."""

    text: str | None
    token_ids: list[int]
    params: SamplingParams
    multi_modal_data: ProcessedImages | None = None
    """The prompt's images, decoded and processed (markers expanded) once, before admission."""
    image_bytes: ImageBytes | None = None
    """What its images hold against ``multimodal.max_decoded_bytes_in_flight``, given back when the request ends."""


@dataclass
class RenderedChat:
    """A conversation rendered: the prompt's text and token ids (image markers not yet expanded) and its images
    decoded and processed (``None`` without), with the bytes they hold."""

    text: str
    token_ids: list[int]
    processed: ProcessedImages | None = None
    image_bytes: ImageBytes | None = None

    def release(self) -> None:
        """Give back what the images hold (for a request that ends before it runs)."""
        if self.image_bytes is not None:
            self.image_bytes.release()


async def render_with_images(
    state: ServerState,
    messages: list[dict[str, Any]],
    tools: Any,
    image_parts: list[ImagePart],
    field: str = "messages",
) -> RenderedChat:
    """Render the conversation (tokenized on the default executor) and load its images (read, admitted and
    decoded on the server's image pool, :mod:`.images`); the engine takes the processed images as they
    are, so the image processor runs once.  ``field`` names the prompt as a whole in errors (``messages``,
    ``input``)."""
    limit = state.llm.max_model_len
    if len(messages) >= limit:  # each message renders to a token at least: refused before a minute of rendering
        raise APIError(
            400,
            f"{field}: {len(messages)} messages cannot fit this model's context of {limit} tokens",
            param=field,
            code="context_length_exceeded",
        )
    if not image_parts:
        text, token_ids = await asyncio.to_thread(_render, state, messages, tools)
        return RenderedChat(text, token_ids)
    images, held = await state.images.load(image_parts, field)
    try:
        text, token_ids = await asyncio.to_thread(_render, state, messages, tools)
        processed = await state.images.run(field, process_prompt_images, state, field, token_ids, images)
        held.add(_processed_bytes(processed))
    except BaseException:
        held.release()
        raise
    return RenderedChat(text, token_ids, processed, held)


def _render(state: ServerState, messages: list[dict[str, Any]], tools: Any) -> tuple[str, list[int]]:
    return render_chat(state.llm.tokenizer, messages, tools=tools, template=state.chat.template)


def _processed_bytes(processed: ProcessedImages) -> int:
    """Bytes of the image processor's tensors (``pixel_values`` ...) the request carries until it ends."""
    return sum(
        int(getattr(value, "nbytes", 0))
        for feature in processed.features
        if isinstance(feature.data, dict)
        for value in feature.data.values()
    )


def process_prompt_images(state: ServerState, field: str, token_ids: list[int], images: list[Any]) -> ProcessedImages:
    """Run the image processor once on a prompt's decoded images (a 400 naming ``field`` when the prompt's
    image markers do not pair up with them, e.g. a chat template that writes none)."""
    try:
        return state.llm.engine.process_images(field, token_ids, {"image": images})
    except MultiModalInputError as exc:
        message = str(exc).removeprefix(f"request {field!r}: ")
        raise ChatRequestError(field, message) from None


def prepare_prompt(
    state: ServerState,
    text: str | None,
    token_ids: list[int],
    fields: dict[str, Any],
    max_tokens: int | None,
    prompt_field: str,
    num_prompt_tokens: int | None = None,
) -> PreparedPrompt:
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
    return PreparedPrompt(text, token_ids, params)


def prepare_chat(
    state: ServerState, rendered: RenderedChat, fields: dict[str, Any], max_tokens: int | None, prompt_field: str
) -> PreparedPrompt:
    """:func:`prepare_prompt` for a rendered conversation: its images' expanded length counted, and the images
    (and the bytes they hold) carried to the engine."""
    processed = rendered.processed
    num_prompt_tokens = processed.num_prompt_tokens if processed is not None else None
    prepared = prepare_prompt(
        state, rendered.text, rendered.token_ids, fields, max_tokens, prompt_field, num_prompt_tokens
    )
    prepared.multi_modal_data = processed
    prepared.image_bytes = rendered.image_bytes
    return prepared


COMPILED_CONSTRAINTS_KEPT = 256
"""Tool constraints remembered as compiling (their keys only), so each is checked once."""


async def enforce_tool_choice(state: ServerState, plan: ToolPlan, fields: dict[str, Any], format_field: str) -> None:
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
    fields["structured_output"] = plan.constraint(compact=state.settings.chat.compact_tool_calls)
    await _check_tool_constraint(state, plan)


async def _check_tool_constraint(state: ServerState, plan: ToolPlan) -> None:
    """Compile an enforced tool constraint before admitting the request, so a tool schema the backend refuses is
    a 400 naming the tool, not a failed generation (503 while the compile workers are busy)."""
    constraint = plan.constraint()
    key = json.dumps(constraint, sort_keys=True)
    if constraint is None or key in state.compiled_tool_constraints:
        return
    grammars = state.llm.engine.grammars
    whole = StructuredOutputParams(json_schema=constraint["json_schema"])
    try:
        # Through the run's compilations: cached, and bounded by structured_output.compile_timeout.
        await asyncio.wrap_future(grammars.submit(whole))
    except GrammarCompileBusy as exc:
        raise APIError(503, grammars.error_message(whole, exc), code="grammar_busy") from None
    except Exception:  # noqa: BLE001 - some tool's schema is at fault: compile them one by one to name it

        def compile_schema(schema: dict[str, Any]) -> None:
            grammars.submit(StructuredOutputParams(json_schema=schema)).result()

        await asyncio.to_thread(check_constraint_compiles, plan, compile_schema)
    state.compiled_tool_constraints[key] = None
    while len(state.compiled_tool_constraints) > COMPILED_CONSTRAINTS_KEPT:
        del state.compiled_tool_constraints[next(iter(state.compiled_tool_constraints))]
