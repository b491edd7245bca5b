"""The pooling routes of ``patchbay serve``: OpenAI's ``/v1/embeddings``, vLLM's ``/score`` and ``/classify``, and
``/rerank`` in Jina's and Cohere's shape.

They answer on a pooling engine (a ``pooling:`` section) whose task they fit: embeddings need an ``embed``
pooler, classification a ``classify`` one; scores and reranking take a cross-encoder (``score``) or an embedding
model, whose score of a pair is the cosine similarity of the two embeddings (as vLLM's).  Inputs are tokenized as
offline (:mod:`patchbay.entrypoints.pooling`); one that the model cannot take (too long, say) is a 400 naming it.
``usage`` counts the prompt tokens the model ran.
"""

from __future__ import annotations

import asyncio
import base64
import time
import uuid
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from fastapi import FastAPI
from fastapi.params import Depends
from pydantic import BaseModel, ConfigDict, Field

from patchbay.engine import EngineDeadError
from patchbay.entrypoints.pooling import (
    PoolingOutput,
    PoolingPrompt,
    cosine_scores,
    score_pairs,
    tokenize_input,
    tokenize_pair,
)
from patchbay.entrypoints.serve.answering import check_admission
from patchbay.entrypoints.serve.protocol import APIError
from patchbay.interfaces import PoolingParams

if TYPE_CHECKING:
    from patchbay.entrypoints.serve.state import ServerState

TokenIds = list[int]


class EmbeddingRequest(BaseModel):
    """OpenAI's ``POST /v1/embeddings``: texts or token ids, ``dimensions`` and ``encoding_format``."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    input: str | list[str] | TokenIds | list[TokenIds]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    normalize: bool | None = None
    """vLLM's extension: whether to L2-normalize (default: the pooler's)."""
    user: str | None = None


class ScoreRequest(BaseModel):
    """vLLM's ``POST /score``: one text against many, or two lists pair by pair."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    activation: bool | None = None


class RerankDocument(BaseModel):
    """A document given as Cohere's ``{"text": ...}``."""

    model_config = ConfigDict(extra="forbid")
    text: str


class RerankRequest(BaseModel):
    """Jina's and Cohere's ``POST /rerank``: a query, documents, and how many of the best to return."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    query: str
    documents: list[str | RerankDocument]
    top_n: int | None = Field(default=None, ge=0)
    return_documents: bool = True
    max_tokens_per_doc: int | None = None
    """Cohere's: accepted only when unset (documents are never cut; a long one is a 400 naming it)."""


class ClassifyRequest(BaseModel):
    """vLLM's ``POST /classify``: texts or token ids."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    input: str | list[str] | TokenIds | list[TokenIds]
    activation: bool | None = None


def add_pooling_routes(app: FastAPI, state: ServerState, authorized: list[Depends]) -> None:
    """Register the pooling routes on ``app``."""

    @app.post("/v1/embeddings", dependencies=authorized)
    async def embeddings(body: EmbeddingRequest) -> dict[str, Any]:
        _check_model(state, body.model)
        _require_task(state, "/v1/embeddings", "embed")
        prompts = await _tokenized(state, _inputs(body.input))
        params = PoolingParams(dimensions=body.dimensions, normalize=body.normalize)
        outputs = await _pool(state, prompts, params)
        data = [
            {"object": "embedding", "index": index, "embedding": _encoded(output.embedding, body.encoding_format)}
            for index, output in enumerate(outputs)
        ]
        return {"object": "list", "data": data, "model": state.model_name, "usage": _usage(outputs)}

    @app.post("/classify", dependencies=authorized)
    @app.post("/v1/classify", dependencies=authorized)
    async def classify(body: ClassifyRequest) -> dict[str, Any]:
        _check_model(state, body.model)
        _require_task(state, "/classify", "classify")
        prompts = await _tokenized(state, _inputs(body.input))
        outputs = await _pool(state, prompts, PoolingParams(activation=body.activation))
        labels = getattr(state.llm.engine.model.model.config, "id2label", None) or {}
        data = [
            {
                "index": index,
                "label": labels.get(int(np.argmax(output.probs)), str(int(np.argmax(output.probs)))),
                "probs": output.probs,
                "num_classes": len(output.probs),
            }
            for index, output in enumerate(outputs)
        ]
        return _listing("classify", state, data, outputs)

    @app.post("/score", dependencies=authorized)
    @app.post("/v1/score", dependencies=authorized)
    async def score(body: ScoreRequest) -> dict[str, Any]:
        _check_model(state, body.model)
        try:
            pairs = score_pairs(body.text_1, body.text_2)
        except ValueError as exc:
            raise APIError(400, str(exc), param="text_2") from None
        outputs = await _scores(state, "/score", pairs, PoolingParams(activation=body.activation))
        data = [{"index": index, "object": "score", "score": output.score} for index, output in enumerate(outputs)]
        return _listing("score", state, data, outputs)

    @app.post("/rerank", dependencies=authorized)
    @app.post("/v1/rerank", dependencies=authorized)
    @app.post("/v2/rerank", dependencies=authorized)
    async def rerank(body: RerankRequest) -> dict[str, Any]:
        _check_model(state, body.model)
        if body.max_tokens_per_doc is not None:
            raise APIError(400, "max_tokens_per_doc: documents are never cut here", param="max_tokens_per_doc")
        texts = [document if isinstance(document, str) else document.text for document in body.documents]
        outputs = await _scores(state, "/rerank", [(body.query, text) for text in texts], PoolingParams())
        ranked = sorted(range(len(texts)), key=lambda index: -outputs[index].score)
        if body.top_n is not None:
            ranked = ranked[: body.top_n]
        results = [
            {
                "index": index,
                "relevance_score": outputs[index].score,
                **({"document": {"text": texts[index]}} if body.return_documents else {}),
            }
            for index in ranked
        ]
        usage = _usage(outputs)
        return {
            "id": f"rerank-{uuid.uuid4().hex}",
            "model": state.model_name,
            "usage": {"total_tokens": usage["total_tokens"], "prompt_tokens": usage["prompt_tokens"]},
            "results": results,
        }


def _check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model != state.model_name:
        raise APIError(
            404,
            f"model {model!r} does not exist; this server serves {state.model_name!r}",
            param="model",
            code="model_not_found",
        )


def _require_task(state: ServerState, route: str, *tasks: str) -> str:
    """The engine's pooling task, when ``route`` can answer with it; else a 400 saying what serves ``route``."""
    run = state.llm.engine.pooling
    if run is None:
        raise APIError(400, f"{route} needs a pooling model; this server generates (start it with a pooling: section)")
    if run.task not in tasks:
        raise APIError(
            400,
            f"{route} needs a pooler for {' or '.join(tasks)}; this server's pooler:{run.pooler_name} "
            f"serves {run.task}",
        )
    return run.task


def _inputs(value: str | list[str] | TokenIds | list[TokenIds]) -> list[Any]:
    """OpenAI's ``input``: one text, texts, one prompt's token ids, or several prompts' token ids."""
    if isinstance(value, str):
        return [value]
    if value and all(isinstance(item, int) for item in value):
        return [list(value)]
    return list(value)


async def _tokenized(state: ServerState, items: list[Any]) -> list[PoolingPrompt]:
    """Each input tokenized off the event loop (a 400 naming a malformed one)."""
    if not items:
        raise APIError(400, "input: give at least one input", param="input")
    tokenizer = state.llm.tokenizer

    def tokenize() -> list[PoolingPrompt]:
        return [tokenize_input(tokenizer, item, f"input {index}") for index, item in enumerate(items)]

    try:
        return await asyncio.to_thread(tokenize)
    except ValueError as exc:
        raise APIError(400, str(exc), param="input") from None


async def _scores(
    state: ServerState, route: str, pairs: list[tuple[str, str]], params: PoolingParams
) -> list[PoolingOutput]:
    """Each pair's score: a cross-encoder's own, or the cosine similarity of an embedding model's embeddings."""
    task = _require_task(state, route, "score", "embed")
    tokenizer = state.llm.tokenizer
    if task == "score":
        try:
            prompts = await asyncio.to_thread(
                lambda: [tokenize_pair(tokenizer, a, b, f"pair {index}") for index, (a, b) in enumerate(pairs)]
            )
        except ValueError as exc:
            raise APIError(400, str(exc)) from None
        return await _pool(state, prompts, params)
    texts = list(dict.fromkeys(text for pair in pairs for text in pair))
    embeddings = await _pool(state, await _tokenized(state, texts), PoolingParams())
    where = {text: index for index, text in enumerate(texts)}
    return cosine_scores([(where[a], where[b]) for a, b in pairs], embeddings, [str(i) for i in range(len(pairs))])


async def _pool(state: ServerState, prompts: list[PoolingPrompt], params: PoolingParams) -> list[PoolingOutput]:
    """Admit the inputs, pool them concurrently, and return their vectors in order (a 400 for an input the model
    cannot take, a 500 naming the error for one that failed inside a step)."""
    engine = state.llm.engine
    for index, prompt in enumerate(prompts):
        try:
            engine.check_pooling_request(f"input {index}", prompt.token_ids, params, prompt.token_type_ids)
        except ValueError as exc:
            raise APIError(400, str(exc), param="input") from None
    check_admission(state, len(prompts))
    state.admitted += len(prompts)
    try:
        outputs = await asyncio.gather(
            *(
                state.llm.pool(prompt.token_ids, params, prompt=prompt.text, token_type_ids=prompt.token_type_ids)
                for prompt in prompts
            )
        )
    except ValueError as exc:
        raise APIError(400, str(exc), param="input") from None
    except EngineDeadError as exc:
        raise APIError(500, str(exc)) from None
    finally:
        state.admitted -= len(prompts)
    found = [PoolingOutput.of(output) for output in outputs]
    failed = [(index, output.error) for index, output in enumerate(found) if output.error is not None]
    if failed:
        index, error = failed[0]
        raise APIError(500, f"input {index} failed: {error}")
    return found


def _encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    """A vector as floats, or OpenAI's ``base64``: its float32 values' little-endian bytes."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector


def _usage(outputs: list[PoolingOutput]) -> dict[str, int]:
    tokens = sum(output.num_prompt_tokens for output in outputs)
    return {"prompt_tokens": tokens, "total_tokens": tokens}


def _listing(kind: str, state: ServerState, data: list[dict[str, Any]], outputs: list[PoolingOutput]) -> dict[str, Any]:
    return {
        "id": f"{kind}-{uuid.uuid4().hex}",
        "object": "list",
        "created": int(time.time()),
        "model": state.model_name,
        "data": data,
        "usage": _usage(outputs),
    }
