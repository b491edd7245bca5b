"""Per-request sampling parameters, validated with errors that name the field."""

from __future__ import annotations

import numbers
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

from patchbay.interfaces.structured_output import StructuredOutputParams

MIN_RANDOM_TEMPERATURE = 1e-2
"""Smallest temperature that samples: below it, logits divided by the temperature overflow float32."""
MAX_SEED = 2**63 - 1
MAX_TOP_K = 2**31 - 1


def _strict_token_id(value: Any) -> Any:
    # JSON and Python hand us floats and bools that pydantic would quietly turn into ints (1.7 -> error,
    # 2.0 -> 2, True -> 1); a token id is only ever an integer.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"a token id must be an integer, got {type(value).__name__} {value!r}")
    return value


def _token_id_key(value: Any) -> Any:
    # logit_bias keys arrive as strings from JSON ({"42": 5.0}); accept decimal strings, nothing looser.
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    return _strict_token_id(value)


def _real_number(value: Any) -> Any:
    # "0.5" and true are not numbers: refused, not read as 0.5 and 1.0.
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"expected a number, got {type(value).__name__} {value!r}")
    return value


Number = Annotated[float, BeforeValidator(_real_number)]
"""A real number as JSON or Python writes it (an integer too); a string or a boolean is refused."""

TokenId = Annotated[int, BeforeValidator(_strict_token_id), Field(ge=0)]
"""A vocabulary index: a non-negative integer (its upper bound is the model's, checked by the engine)."""
TokenIdKey = Annotated[int, BeforeValidator(_token_id_key), Field(ge=0)]


class SamplingParams(BaseModel):
    """How one request is sampled and when it stops.

    Greedy decoding is ``temperature == 0``.  Which parameters a run may use
    depends on the sampler plugin: each declares the ones it supports, and a
    request using another one is rejected with the sampler's reasons.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    max_tokens: int = Field(default=16, ge=1)
    temperature: float = Field(default=0.0, ge=0.0, le=1e30)
    """0 is greedy; a random temperature is at least 0.01 (smaller ones overflow the logits)."""
    top_k: int = Field(default=0, ge=0, le=MAX_TOP_K)
    """0 disables top-k."""
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=1e30)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[TokenIdKey, Number] | None = None
    """Added to the logits of these token ids (finite values)."""
    min_tokens: int = Field(default=0, ge=0)
    bad_words: list[str] | None = None
    """Words that must not be generated (tokenized by the engine into :attr:`bad_words_token_ids`)."""
    bad_words_token_ids: list[Annotated[list[TokenId], Field(min_length=1)]] | None = None
    """Token sequences that must not be generated; filled from :attr:`bad_words` by the engine, or given directly."""
    allowed_token_ids: Annotated[list[TokenId], Field(min_length=1)] | None = None
    """Only these tokens may be sampled (a non-empty list; ``None``: any)."""
    stop: list[str] = Field(default_factory=list)
    """Stop strings: generation ends when the text contains one; it is not included in the output."""
    stop_token_ids: list[TokenId] = Field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    logprobs: int | None = Field(default=None, ge=0)
    prompt_logprobs: int | None = Field(default=None, ge=0)
    n: int = Field(default=1, ge=1)
    structured_output: StructuredOutputParams | None = None
    """Constrain the output to a JSON schema, any JSON object, a regex, one of several strings or a grammar
    (exactly one); the run's ``structured_output`` backend compiles it."""
    lora: str | None = Field(default=None, min_length=1)
    """The LoRA adapter to run this request with, by name (``lora.adapters`` or the run's resolver); ``None``:
    the base model."""
    cache_salt: str | None = Field(default=None, min_length=1)
    """Enters the hash of the request's first KV block, so only requests with the same salt share cached
    blocks (prefix cache and KV connector entries): give each tenant its own to keep their prompts apart."""

    @model_validator(mode="before")
    @classmethod
    def _stop_as_list(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("stop"), str):
            data = {**data, "stop": [data["stop"]]}
        return data

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, stops: list[str]) -> list[str]:
        if any(stop == "" for stop in stops):
            raise ValueError("a stop string must not be empty (it would match before the first token)")
        return stops

    @field_validator("temperature")
    @classmethod
    def _sampling_temperature(cls, temperature: float) -> float:
        if 0.0 < temperature < MIN_RANDOM_TEMPERATURE:
            raise ValueError(
                f"temperature {temperature!r} is too small to sample with (logits overflow): "
                f"use 0 for greedy decoding or at least {MIN_RANDOM_TEMPERATURE}"
            )
        return temperature

    @field_validator("seed", "max_tokens", "min_tokens", "n", "top_k", "logprobs", "prompt_logprobs", mode="before")
    @classmethod
    def _integer(cls, value: Any) -> Any:
        # Not coerced: "5", 5.0 and true are refused, not read as 5, 5 and 1.
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral)):
            raise ValueError(f"expected an integer, got {type(value).__name__} {value!r}")
        return value

    @field_validator(
        "temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty", mode="before"
    )
    @classmethod
    def _number(cls, value: Any) -> Any:
        return _real_number(value)

    @field_validator("ignore_eos", mode="before")
    @classmethod
    def _boolean(cls, value: Any) -> Any:
        if not isinstance(value, bool):
            raise ValueError(f"expected true or false, got {type(value).__name__} {value!r}")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> SamplingParams:
        if self.seed is not None and self.seed + self.n - 1 > MAX_SEED:
            raise ValueError(
                f"seed {self.seed} + n - 1 exceeds {MAX_SEED} (each of the n sequences takes the next seed)"
            )
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.structured_output is not None and self.ignore_eos:
            raise ValueError(
                "structured_output ends where the grammar does, with EOS; it cannot be combined with ignore_eos"
            )
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def params_used(self) -> frozenset[str]:
        """Names of the parameters this request sets away from their neutral value (for sampler checks)."""
        defaults = type(self)()
        # structured_output is applied by the runner before the sampler, lora in the model and cache_salt in the
        # block hashes, so no sampler needs to support them.
        neutral = {
            "max_tokens",
            "stop",
            "stop_token_ids",
            "ignore_eos",
            "n",
            "bad_words_token_ids",
            "structured_output",
            "lora",
            "cache_salt",
        }
        used = {
            name
            for name in type(self).model_fields
            if name not in neutral and getattr(self, name) != getattr(defaults, name)
        }
        if self.bad_words_token_ids:
            used.add("bad_words")
        return frozenset(used)
