"""Structured-output backends of the defective plugin, each example_choice wrong in one way a real run shows."""

import time

import numpy as np

from patchbay_example.structured_output import ChoiceMatcher, ExampleChoiceBackend


class SharedStateBackend(ExampleChoiceBackend):
    """Hands out one matcher per grammar: requests with the same constraint share their state."""

    def matcher(self, grammar):
        shared = getattr(self, "_shared", None)
        if shared is None:
            shared = self._shared = {}
        if id(grammar) not in shared:
            shared[id(grammar)] = super().matcher(grammar)
        return shared[id(grammar)]


class HalfWayMatcher(ChoiceMatcher):
    """Feeds a token byte by byte and keeps the bytes that fitted when a later byte does not."""

    def accept_tokens(self, token_ids):
        accepted = 0
        for token_id in token_ids:
            piece = self._backend.pieces[token_id] if 0 <= token_id < len(self._backend.pieces) else None
            if self.is_terminated() or token_id in self._backend.stop_token_ids or piece is None:
                return accepted + super().accept_tokens([token_id])
            text = self._text
            for index in range(len(piece)):
                if not self._keeps_a_match_possible(text + piece[: index + 1]):
                    if index:
                        self._history.append((text + piece[:index], False))
                    return accepted
            self._history.append((text + piece, False))
            accepted += 1
        return accepted


class HalfWayBackend(ExampleChoiceBackend):
    """example_choice whose matchers keep the fitting bytes of a token they refuse."""

    def matcher(self, grammar):
        return HalfWayMatcher(self, grammar)


class Latin1Backend(ExampleChoiceBackend):
    """Takes each token's bytes from its text encoded as Latin-1: right for ASCII, wrong for é, € or 日."""

    def __init__(self, options=None, *, tokenizer, vocab_size, stop_token_ids):
        super().__init__(options, tokenizer=tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        self.pieces = [
            tokenizer.convert_tokens_to_string([tokenizer.convert_ids_to_tokens(token_id)]).encode("latin-1", "replace")
            if piece is not None
            else None
            for token_id, piece in enumerate(self.pieces)
        ]
        self.tokens_by_first_byte = {}
        for token_id, piece in enumerate(self.pieces):
            if piece:
                self.tokens_by_first_byte.setdefault(piece[0], []).append(token_id)


class HalfSentMatcher(ChoiceMatcher):
    """Computes its mask from the complete characters only, forgetting a character's first byte."""

    @property
    def _text(self):
        return self._history[-1][0].decode("utf-8", "ignore").encode()


class HalfSentBackend(ExampleChoiceBackend):
    """example_choice whose masks ignore a half-sent UTF-8 character."""

    def matcher(self, grammar):
        return HalfSentMatcher(self, grammar)


class SlowCompileBackend(ExampleChoiceBackend):
    """Takes six seconds to compile a constraint (a grammar compiler with no cache and a slow path)."""

    def compile(self, params):
        time.sleep(6)
        return super().compile(params)


class RacyCompileBackend(ExampleChoiceBackend):
    """Keeps the constraint being compiled on the backend: concurrent compiles swap grammars."""

    def compile(self, params):
        self._pending = params
        time.sleep(0.05)
        return super().compile(self._pending)


class PaddedIdsBackend(ExampleChoiceBackend):
    """Allows the ids between the tokenizer's size and the logits' width (it never cleared the padding)."""

    def matcher(self, grammar):
        matcher = super().matcher(grammar)
        fill = matcher.fill_bitmask
        known = len(self._tokenizer)

        def fill_with_padding(bitmask, row):
            fill(bitmask, row)
            bits = np.unpackbits(bitmask[row].view(np.uint8), bitorder="little")
            bits[known : self.vocab_size] = 1
            bitmask[row] = np.packbits(bits, bitorder="little").view(np.int32)

        matcher.fill_bitmask = fill_with_padding
        return matcher

    def __init__(self, options=None, *, tokenizer, vocab_size, stop_token_ids):
        super().__init__(options, tokenizer=tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        self._tokenizer = tokenizer
