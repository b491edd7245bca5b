"""The llguidance backend: an Earley parser over a lazily built lexer, masks computed per step."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
from pydantic import BaseModel, ConfigDict

from patchbay.interfaces import (
    GrammarCompileError,
    GrammarMatcher,
    StructuredOutputBackend,
    StructuredOutputCapabilities,
    StructuredOutputParams,
)


class LLGuidanceOptions(BaseModel):
    """Options of ``structured_output: {name: llguidance, options: {...}}``."""

    model_config = ConfigDict(extra="forbid")

    any_whitespace: bool = True
    """JSON: allow any whitespace between tokens (llguidance's ``whitespace_flexible``); ``false``: compact form."""
    lenient: bool = False
    """JSON: ignore schema keywords llguidance does not support instead of failing the request."""


class LLGuidanceMatcher(GrammarMatcher):
    """One request's state in an llguidance ``LLMatcher``.

    Stop tokens are handled here, not by llguidance: its ``validate_tokens``
    refuses them, and a consumed stop token is not in its rollback history
    (rolling it back undoes the token before it too).  A stop token is
    accepted where the matcher is accepting, and only marks this wrapper terminated.
    """

    def __init__(self, matcher: Any, stop_token_ids: frozenset[int]) -> None:
        self._matcher = matcher
        self._stop_token_ids = stop_token_ids
        self._terminated = False

    def accept_tokens(self, token_ids: Sequence[int]) -> int:
        matcher = self._matcher
        for count, token in enumerate(int(token) for token in token_ids):
            if self._terminated:
                return count
            if token in self._stop_token_ids:
                if not matcher.is_accepting():
                    return count
                self._terminated = True
                continue
            # validate_tokens leaves the state alone, so a refused token never puts the matcher in its error state.
            if matcher.validate_tokens([token]) != 1:
                return count
            if not matcher.consume_token(token):
                raise RuntimeError(f"llguidance refused a token it had validated: {matcher.get_error()}")
        return len(token_ids)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens and self._terminated:
            self._terminated = False
            num_tokens -= 1
        if num_tokens:
            self._matcher.rollback(num_tokens)

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        from llguidance.numpy import fill_next_token_bitmask

        fill_next_token_bitmask(self._matcher, bitmask, row)

    def is_accepting(self) -> bool:
        return self._matcher.is_accepting()

    def is_terminated(self) -> bool:
        return self._terminated


class LLGuidanceBackend(StructuredOutputBackend):
    """llguidance: JSON schemas, any JSON object, regexes, choices and GBNF grammars (converted to Lark).

    Compiling validates the grammar and builds a prototype matcher; each
    request gets a copy.  Masks are computed per step by the parser, with no
    precomputation, so compiling is fast.
    """

    contract_version = "1.1"

    Options: ClassVar[type[BaseModel]] = LLGuidanceOptions
    options: LLGuidanceOptions  # an instance of Options: plugin_options() validated it
    capabilities: ClassVar[StructuredOutputCapabilities] = StructuredOutputCapabilities(
        canonical_forced_tokens=True, json_whitespace=True
    )

    @classmethod
    def unavailable_reason(cls) -> str | None:
        import importlib.util

        return None if importlib.util.find_spec("llguidance") else "the llguidance package is not installed"

    def __init__(
        self, options: BaseModel | None = None, *, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]
    ) -> None:
        super().__init__(options, tokenizer=tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        import llguidance
        import llguidance.hf

        self._llguidance = llguidance
        self._tokenizer = llguidance.hf.from_tokenizer(
            tokenizer, n_vocab=vocab_size, eos_token=list(self.stop_token_ids) or None
        )

    def _grammar_text(self, params: StructuredOutputParams) -> str:
        llguidance = self._llguidance
        if params.kind in ("json_schema", "json_object"):
            schema = params.json_schema if params.json_schema is not None else {"type": "object"}
            flexible = (
                self.options.any_whitespace if params.json_whitespace is None else params.json_whitespace == "flexible"
            )
            defaults: dict[str, Any] = {"whitespace_flexible": flexible, "lenient": self.options.lenient}
            if params.json_whitespace == "compact":
                defaults.update(item_separator=",", key_separator=":")
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=defaults)
        if params.kind == "regex":
            return llguidance.grammar_from("regex", params.regex)
        if params.kind == "choice":
            return llguidance.grammar_from("choice", params.spec)
        return llguidance.grammar_from("gbnf", params.grammar)

    def compile(self, params: StructuredOutputParams) -> Any:
        try:
            grammar = self._grammar_text(params)
            prototype = self._llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
        except Exception as exc:
            raise GrammarCompileError(f"{type(exc).__name__}: {exc}".strip()) from exc
        if prototype.is_error():
            raise GrammarCompileError(prototype.get_error())
        return prototype

    def matcher(self, grammar: Any) -> GrammarMatcher:
        return LLGuidanceMatcher(grammar.deep_copy(), frozenset(self.stop_token_ids))
