"""Text deltas of a growing token sequence, decoded incrementally.

Decoding the whole sequence at every step costs its length each time; this
decodes only a short window.  Two things make the window subtle:

- a character may span several tokens (byte-level BPE splits an emoji into
  byte tokens), so a token whose text ends in an incomplete character
  (decoded as U+FFFD) is held back until the rest arrives;
- a token's text may depend on the tokens before it (SentencePiece drops the
  leading space of the first token it decodes), so the window keeps a few
  already-emitted tokens in front and only the text past them is new.

e.g. tokens ``[" caf", "\\xc3", "\\xa9"]``: after ``" caf"`` the delta is ``" caf"``;
after ``"\\xc3"`` nothing (half of ``é``); after ``"\\xa9"`` it is ``"é"``.

With stop strings, :class:`StreamingText` also holds back the text that
could still turn out to be the start of a stop string, so a stream never
sends text the final output does not contain.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

REPLACEMENT_CHARACTER = "\ufffd"
CONTEXT_TOKENS = 5
"""Already-emitted tokens decoded in front of the new ones (for tokenizers whose decoding depends on context)."""


class IncrementalDetokenizer:
    """Turns the token ids of one sequence, as they grow, into text deltas whose sum is the full decode."""

    def __init__(self, tokenizer: Any, *, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.text = ""
        """The text emitted so far."""
        self._prefix_offset = 0
        """Start of the context window (tokens already emitted, decoded again for context)."""
        self._read_offset = 0
        """First token whose text has not been emitted yet."""

    def add(self, new_token_ids: list[int]) -> str:
        """Append tokens; returns the text they complete (may be empty while a character is incomplete)."""
        self.token_ids.extend(new_token_ids)
        if self._read_offset == len(self.token_ids):
            return ""
        context = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
        window = self._decode(self.token_ids[self._prefix_offset :])
        if len(window) <= len(context) or window.endswith(REPLACEMENT_CHARACTER):
            return ""
        delta = window[len(context) :]
        self.text += delta
        self._prefix_offset = max(self._read_offset, len(self.token_ids) - CONTEXT_TOKENS)
        self._read_offset = len(self.token_ids)
        return delta

    def _decode(self, token_ids: list[int]) -> str:
        # The tokenizer's own clean-up setting, as the engine's full decode of the final text uses it.
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)


class StreamingText:
    """The text of one generated sequence as a stream may send it: incremental, held back before stop strings.

    :meth:`add` returns the text safe to send now; :meth:`finish` the rest,
    given the engine's final text of the sequence (which ends before a stop
    string that finished it).
    """

    def __init__(self, tokenizer: Any, stop: list[str]) -> None:
        self.detokenizer = IncrementalDetokenizer(tokenizer)
        self.holdback = max((len(s) for s in stop), default=1) - 1
        """Characters kept back: the longest a partial stop string at the end of the text can be."""
        self.sent = ""

    def add(self, new_token_ids: list[int]) -> str:
        self.detokenizer.add(new_token_ids)
        text = self.detokenizer.text
        safe = text[: len(text) - self.holdback] if self.holdback else text
        if len(safe) <= len(self.sent):
            return ""
        delta = safe[len(self.sent) :]
        self.sent = safe
        return delta

    def finish(self, final_text: str) -> str:
        """The remaining delta, so that everything sent adds up to ``final_text``.

        If text already sent is not a prefix of the final text (a tokenizer
        whose decoding of a window differs from that of the whole; a stream
        cannot take text back), this logs a warning and sends nothing more.
        """
        if not final_text.startswith(self.sent):
            logger.warning(
                "streamed text %r is not a prefix of the final text %r; the stream ends as sent",
                self.sent[-40:],
                final_text[-60:],
            )
            return ""
        delta = final_text[len(self.sent) :]
        self.sent = final_text
        return delta
