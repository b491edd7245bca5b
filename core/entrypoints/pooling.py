"""The offline side of pooling: inputs to requests (texts, token ids, text pairs) and vectors back.

``LLM.embed``, ``LLM.classify`` and ``LLM.score`` (and ``patchbay serve``'s pooling routes) run here: texts are
tokenized as sentence-transformers tokenizes them (special tokens added; a cross-encoder's pair as the
tokenizer's pair, with its token types), each input becomes a request of the pooling engine, and what comes back
is a :class:`PoolingOutput`.  ``score`` on an embedding model is the cosine similarity of the two embeddings (as
vLLM's), on a cross-encoder the model's own score of the pair.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from patchbay.engine import Engine, RequestOutput
from patchbay.interfaces import PoolingParams

PoolingInput = str | list[int] | dict[str, Any]
"""A text, its token ids, or ``{"prompt_token_ids": [...], "token_type_ids": [...]}``."""


@dataclass
class PoolingOutput:
    """What one pooling request returns."""

    request_id: str
    prompt_token_ids: list[int]
    data: list[float] = field(default_factory=list)
    """The vector: the embedding, the class probabilities, or ``[score]`` (empty when the request failed)."""
    error: str | None = None
    """Why the request failed inside a step (``None``: it did not)."""

    @property
    def embedding(self) -> list[float]:
        """The embedding (task ``embed``)."""
        return self.data

    @property
    def probs(self) -> list[float]:
        """The class probabilities, or logits with ``activation`` off (task ``classify``)."""
        return self.data

    @property
    def score(self) -> float:
        """The relevance score (task ``score``; for an embedding model, the cosine similarity)."""
        if len(self.data) != 1:
            raise ValueError(f"request {self.request_id!r} has {len(self.data)} values, not one score")
        return self.data[0]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def as_dict(self, task: str) -> dict[str, Any]:
        """JSON-ready form, as ``patchbay run`` writes it: the vector under the task's name."""
        key = {"embed": "embedding", "classify": "probs", "score": "score"}[task]
        result: dict[str, Any] = {"id": self.request_id, "num_prompt_tokens": self.num_prompt_tokens}
        if self.error is not None:
            result["error"] = self.error
        else:
            result[key] = self.score if task == "score" else self.data
        return result

    @classmethod
    def of(cls, output: RequestOutput) -> PoolingOutput:
        return cls(output.request_id, list(output.prompt_token_ids), list(output.pooled or []), output.error)


@dataclass(frozen=True)
class PoolingPrompt:
    """One input, tokenized."""

    token_ids: list[int]
    text: str | None = None
    token_type_ids: list[int] | None = None


def tokenize_input(tokenizer: Any, item: PoolingInput, where: str) -> PoolingPrompt:
    """A text (special tokens added, as sentence-transformers does), token ids, or a prompt object; a malformed
    input raises ``ValueError`` naming ``where``."""
    if isinstance(item, str):
        return PoolingPrompt(list(tokenizer(item)["input_ids"]), item)
    if isinstance(item, list):
        return PoolingPrompt(_ids(item, where), None)
    if isinstance(item, dict) and "prompt_token_ids" in item:
        types = item.get("token_type_ids")
        return PoolingPrompt(
            _ids(item["prompt_token_ids"], where),
            item.get("prompt"),
            _ids(types, f"{where}.token_type_ids") if types is not None else None,
        )
    if isinstance(item, dict) and isinstance(item.get("prompt"), str):
        return tokenize_input(tokenizer, item["prompt"], where)
    raise ValueError(f"{where}: an input is a string, a list of token ids or {{'prompt_token_ids': [...]}}")


def tokenize_pair(tokenizer: Any, first: str, second: str, where: str) -> PoolingPrompt:
    """A cross-encoder's (query, document) pair as its tokenizer joins them, with token types where it gives any."""
    if not isinstance(first, str) or not isinstance(second, str):
        raise ValueError(f"{where}: a pair to score is two strings")
    encoded = tokenizer(first, second)
    types = encoded.get("token_type_ids")
    return PoolingPrompt(list(encoded["input_ids"]), None, list(types) if types is not None else None)


def pool(
    engine: Engine,
    prompts: Sequence[PoolingPrompt],
    params: PoolingParams | Sequence[PoolingParams] | None = None,
    request_ids: Sequence[str] | None = None,
    on_finished: Callable[[PoolingOutput], None] | None = None,
) -> list[PoolingOutput]:
    """Run every prompt through the pooling engine, batched continuously; outputs in prompt order
    (``on_finished`` is called as each finishes).

    A prompt that cannot run raises ``ValueError`` naming it before any runs; one that fails inside a step comes
    back with its ``error``.  Whatever is raised, none of these requests is left queued in the engine.
    """
    params_list = _params_list(params, len(prompts))
    for index, (prompt, request) in enumerate(zip(prompts, params_list, strict=True)):
        name = request_ids[index] if request_ids is not None else str(index)
        engine.check_pooling_request(f"input {name}", prompt.token_ids, request, prompt.token_type_ids)
    order: dict[str, int] = {}
    results: list[PoolingOutput | None] = [None] * len(prompts)
    try:
        for index, (prompt, request) in enumerate(zip(prompts, params_list, strict=True)):
            request_id = engine.add_pooling_request(
                prompt.token_ids,
                request,
                prompt=prompt.text,
                request_id=None if request_ids is None else request_ids[index],
                token_type_ids=prompt.token_type_ids,
            )
            order[request_id] = index
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.request_id in order:
                    result = results[order[output.request_id]] = PoolingOutput.of(output)
                    if on_finished is not None:
                        on_finished(result)
    except BaseException:
        if not engine.is_dead:
            engine.discard([request_id for request_id, index in order.items() if results[index] is None])
        raise
    return [result for result in results if result is not None]


def score_pairs(first: str | Sequence[str], second: str | Sequence[str]) -> list[tuple[str, str]]:
    """vLLM's pairing: one query against every document, or the two lists pair by pair."""
    firsts = [first] if isinstance(first, str) else list(first)
    seconds = [second] if isinstance(second, str) else list(second)
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    if len(firsts) != len(seconds):
        raise ValueError(
            f"score pairs one text with many or lists of equal length; got {len(firsts)} and {len(seconds)}"
        )
    return list(zip(firsts, seconds, strict=True))


def cosine_scores(
    pairs: Sequence[tuple[int, int]], embeddings: Sequence[PoolingOutput], request_ids: Sequence[str]
) -> list[PoolingOutput]:
    """An embedding model's score of each pair (indices into ``embeddings``): their cosine similarity."""
    found = []
    for (a, b), request_id in zip(pairs, request_ids, strict=True):
        left, right = embeddings[a], embeddings[b]
        error = left.error or right.error
        tokens = left.prompt_token_ids + right.prompt_token_ids
        if error is not None:
            found.append(PoolingOutput(request_id, tokens, [], error))
            continue
        dot = sum(x * y for x, y in zip(left.data, right.data, strict=True))
        norms = math.sqrt(sum(x * x for x in left.data)) * math.sqrt(sum(y * y for y in right.data))
        found.append(PoolingOutput(request_id, tokens, [dot / norms if norms else 0.0]))
    return found


def _params_list(params: PoolingParams | Sequence[PoolingParams] | None, count: int) -> list[PoolingParams]:
    if params is None or isinstance(params, PoolingParams):
        return [params or PoolingParams()] * count
    found = list(params)
    if len(found) != count:
        raise ValueError(f"{count} inputs but {len(found)} pooling parameter sets")
    return found


def _ids(values: Any, where: str) -> list[int]:
    if not isinstance(values, list) or any(isinstance(v, bool) or not isinstance(v, int) for v in values):
        raise ValueError(f"{where}: token ids must be a list of integers")
    return list(values)
