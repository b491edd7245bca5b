"""Per-request sampling parameters, validated with errors that name the field."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from patchbay.interfaces.structured_output import StructuredOutputParams


class SamplingParams(BaseModel):
    """How one request is sampled and when it stops.

    Greedy decoding is ``temperature == 0``.  Which parameters a run may use
    depends on the sampler plugin: each declares the ones it supports, and a
    request using another one is rejected with the sampler's reasons.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_tokens: int = Field(default=16, ge=1)
    temperature: float = Field(default=0.0, ge=0.0)
    top_k: int = Field(default=0, ge=0)
    """0 disables top-k."""
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[int, float] | None = None
    min_tokens: int = Field(default=0, ge=0)
    bad_words: list[str] | None = None
    """Words that must not be generated (tokenized by the engine into :attr:`bad_words_token_ids`)."""
    bad_words_token_ids: list[list[int]] | None = None
    """Token sequences that must not be generated; filled from :attr:`bad_words` by the engine, or given directly."""
    allowed_token_ids: list[int] | None = None
    stop: list[str] = Field(default_factory=list)
    """Stop strings: generation ends when the text contains one; it is not included in the output."""
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = Field(default=None, ge=0)
    prompt_logprobs: int | None = Field(default=None, ge=0)
    n: int = Field(default=1, ge=1)
    structured_output: StructuredOutputParams | None = None
    """Constrain the output to a JSON schema, any JSON object, a regex, one of several strings or a grammar
    (exactly one); the run's ``structured_output`` backend compiles it."""

    @model_validator(mode="before")
    @classmethod
    def _stop_as_list(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("stop"), str):
            data = {**data, "stop": [data["stop"]]}
        return data

    @model_validator(mode="after")
    def _consistent(self) -> SamplingParams:
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.structured_output is not None and self.ignore_eos:
            raise ValueError("structured_output ends where the grammar does, with EOS; it cannot be combined with "
                             "ignore_eos")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def params_used(self) -> frozenset[str]:
        """Names of the parameters this request sets away from their neutral value (for sampler checks)."""
        defaults = type(self)()
        # structured_output is applied by the runner before the sampler, so no sampler needs to support it.
        neutral = {"max_tokens", "stop", "stop_token_ids", "ignore_eos", "n", "bad_words_token_ids", "structured_output"}
        used = {name for name in type(self).model_fields
                if name not in neutral and getattr(self, name) != getattr(defaults, name)}
        if self.bad_words_token_ids:
            used.add("bad_words")
        return frozenset(used)
