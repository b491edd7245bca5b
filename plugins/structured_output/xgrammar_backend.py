"""The xgrammar backend: grammars compiled to pushdown automata with precomputed token masks."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from patchbay.interfaces import (
    GrammarCompileError,
    GrammarMatcher,
    StructuredOutputBackend,
    StructuredOutputCapabilities,
    StructuredOutputParams,
)


class XGrammarOptions(BaseModel):
    """Options of ``structured_output: {name: xgrammar, options: {...}}``."""

    model_config = ConfigDict(extra="forbid")

    any_whitespace: bool = True
    """JSON: allow any whitespace between tokens; ``false`` pins the compact form (``{"a": 1}``)."""
    max_whitespace_cnt: int | None = Field(default=None, ge=1)
    """JSON with ``any_whitespace``: at most this many whitespace characters in a row (unbounded when unset)."""
    strict_mode: bool = True
    """JSON: objects take no properties the schema does not name, unless it says ``additionalProperties``."""
    max_threads: int = Field(default=8, ge=1)
    """Threads xgrammar uses to compile one grammar."""


def choice_grammar(choices: Sequence[str]) -> str:
    """A GBNF grammar matching exactly one of ``choices``: ``root ::= "yes" | "no"``."""
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)


class XGrammarMatcher(GrammarMatcher):
    """One request's state in an xgrammar ``GrammarMatcher``."""

    def __init__(self, matcher: Any) -> None:
        self._matcher = matcher

    def accept_tokens(self, token_ids: Sequence[int]) -> int:
        for count, token_id in enumerate(token_ids):
            if self._matcher.is_terminated() or not self._matcher.accept_token(int(token_id)):
                return count
        return len(token_ids)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self._matcher.rollback(num_tokens)

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def is_accepting(self) -> bool:
        return self._matcher.is_completed()

    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()


class XGrammarBackend(StructuredOutputBackend):
    """xgrammar (the default): JSON schemas, any JSON object, regexes, choices and GBNF grammars.

    Compiles each constraint once into a pushdown automaton whose token masks
    are mostly precomputed, so filling a row per step is cheap; rollback is
    unbounded, so speculative decoding works.
    """

    contract_version = "1.1"

    Options: ClassVar[type[BaseModel]] = XGrammarOptions
    options: XGrammarOptions  # an instance of Options: plugin_options() validated it
    capabilities: ClassVar[StructuredOutputCapabilities] = StructuredOutputCapabilities(json_whitespace=True)
    known_gaps: ClassVar[Mapping[str, str]] = {
        "test_json_bounded_strings_refuse_raw_control_characters": (
            "xgrammar 0.2.9 compiles strings with maxLength/minLength to a character class "
            "that admits raw control characters (U+0000..U+001F), which strict JSON parsers reject"
        ),
    }

    @classmethod
    def unavailable_reason(cls) -> str | None:
        import importlib.util

        return None if importlib.util.find_spec("xgrammar") else "the xgrammar package is not installed"

    def __init__(
        self, options: BaseModel | None = None, *, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]
    ) -> None:
        super().__init__(options, tokenizer=tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        import xgrammar

        self._xgrammar = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(self.stop_token_ids) or None
        )
        # patchbay caches compiled grammars itself (by key), so xgrammar's own cache would hold a second copy.
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=self.options.max_threads, cache_enabled=False)

    def compile(self, params: StructuredOutputParams) -> Any:
        options = self.options
        compiler = self._compiler
        try:
            if params.kind in ("json_schema", "json_object"):
                schema = params.json_schema if params.json_schema is not None else {"type": "object"}
                if params.json_whitespace is None:
                    spacing: dict[str, Any] = {"any_whitespace": options.any_whitespace}
                elif params.json_whitespace == "compact":
                    spacing = {"any_whitespace": False, "separators": (",", ":")}
                else:
                    spacing = {"any_whitespace": True}
                return compiler.compile_json_schema(
                    json.dumps(schema),
                    strict_mode=options.strict_mode,
                    max_whitespace_cnt=options.max_whitespace_cnt if spacing["any_whitespace"] else None,
                    **spacing,
                )
            if params.kind == "regex":
                assert params.regex is not None  # the kind is the field that is set
                return compiler.compile_regex(params.regex)
            if params.kind == "choice":
                return compiler.compile_grammar(choice_grammar(params.choice or []))
            assert params.grammar is not None  # the only kind left
            return compiler.compile_grammar(params.grammar)
        except Exception as exc:  # xgrammar raises RuntimeError / ValueError / its own errors, with a message
            raise GrammarCompileError(f"{type(exc).__name__}: {exc}".strip()) from exc

    def grammar_size_bytes(self, grammar: Any, params: StructuredOutputParams) -> int:
        return int(grammar.memory_size_bytes)

    def matcher(self, grammar: Any) -> GrammarMatcher:
        return XGrammarMatcher(self._xgrammar.GrammarMatcher(grammar))
