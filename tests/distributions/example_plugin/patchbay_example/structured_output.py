"""``example_choice``: a structured-output backend for ``choice`` constraints, in pure Python."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from patchbay.interfaces import (
    GrammarCompileError,
    GrammarMatcher,
    StructuredOutputBackend,
    StructuredOutputCapabilities,
    StructuredOutputParams,
)


@dataclass(frozen=True)
class ChoiceGrammar:
    """A compiled ``choice`` constraint: the UTF-8 bytes of each allowed output (shared by its matchers)."""

    choices: tuple[bytes, ...]


class ChoiceMatcher(GrammarMatcher):
    """One request's state: the bytes accepted so far, one entry per accepted token (for rollback)."""

    def __init__(self, backend: ExampleChoiceBackend, grammar: ChoiceGrammar) -> None:
        self._backend = backend
        self._grammar = grammar
        self._history: list[tuple[bytes, bool]] = [(b"", False)]
        """(text, terminated) after each accepted token; the last entry is the current state."""

    @property
    def _text(self) -> bytes:
        return self._history[-1][0]

    def _keeps_a_match_possible(self, text: bytes) -> bool:
        return any(choice.startswith(text) for choice in self._grammar.choices)

    def accept_tokens(self, token_ids: Sequence[int]) -> int:
        accepted = 0
        for token_id in token_ids:
            if self.is_terminated():
                break
            if token_id in self._backend.stop_token_ids:
                if not self.is_accepting():
                    break
                self._history.append((self._text, True))
            else:
                piece = self._backend.pieces[token_id] if 0 <= token_id < len(self._backend.pieces) else None
                if piece is None or not self._keeps_a_match_possible(self._text + piece):
                    break  # nothing was changed for this token: the state is the one after the last accepted
                self._history.append((self._text + piece, False))
            accepted += 1
        return accepted

    def rollback(self, num_tokens: int) -> None:
        if not 0 <= num_tokens < len(self._history):
            raise ValueError(f"cannot roll back {num_tokens} tokens; {len(self._history) - 1} were accepted")
        del self._history[len(self._history) - num_tokens :]

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        allowed = np.zeros(bitmask.shape[1] * 32, dtype=bool)
        if self.is_terminated():
            allowed[list(self._backend.stop_token_ids)] = True  # only a stop token may follow the end
        else:
            text = self._text
            next_bytes = {choice[len(text)] for choice in self._grammar.choices if len(choice) > len(text)}
            for byte in next_bytes:
                for token_id in self._backend.tokens_by_first_byte.get(byte, ()):
                    if self._keeps_a_match_possible(text + self._backend.pieces[token_id]):
                        allowed[token_id] = True
            if self.is_accepting():
                allowed[list(self._backend.stop_token_ids)] = True
        bitmask[row] = np.packbits(allowed, bitorder="little").view(np.int32)

    def is_accepting(self) -> bool:
        return self._text in self._grammar.choices

    def is_terminated(self) -> bool:
        return self._history[-1][1]


class ExampleChoiceBackend(StructuredOutputBackend):
    """Constrains the output to one of a request's ``choice`` strings, matched on the exact bytes of tokens."""

    contract_version = "1.1"

    capabilities: ClassVar[StructuredOutputCapabilities] = StructuredOutputCapabilities(constraint_kinds=("choice",))

    def __init__(self, options: Any = None, *, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        super().__init__(options, tokenizer=tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        # The exact bytes of each id (None: special tokens and the logits' padding, never allowed as text).
        self.pieces: list[bytes | None] = self.token_bytes(tokenizer)
        self.tokens_by_first_byte: dict[int, list[int]] = {}
        for token_id, piece in enumerate(self.pieces):
            if piece:
                self.tokens_by_first_byte.setdefault(piece[0], []).append(token_id)

    def compile(self, params: StructuredOutputParams) -> ChoiceGrammar:
        if params.choice is None:
            raise GrammarCompileError(f"example_choice compiles only choice constraints, not {params.field_path}")
        return ChoiceGrammar(tuple(choice.encode() for choice in params.choice))

    def matcher(self, grammar: ChoiceGrammar) -> ChoiceMatcher:
        return ChoiceMatcher(self, grammar)
