"""Structured output: grammar backends that constrain decoding to JSON, a regex, a choice or a grammar.

A request's constraint (:class:`StructuredOutputParams`, the ``structured_output``
field of its sampling parameters) is compiled once by the run's backend
(:meth:`StructuredOutputBackend.compile`, on a worker thread, off the step's
critical path; compiled grammars are cached by :attr:`StructuredOutputParams.key`).
The request waits in the scheduler until its grammar is ready.  While it runs,
the model runner keeps one :class:`GrammarMatcher` per constrained request:
before each sampling it asks the matcher to fill the request's row of a shared
token bitmask (one row per logits row, every draft position included), masks
the logits of constrained rows only, and advances the matcher by the tokens
accepted.  Draft positions are filled by accepting each draft in turn and
rolling back afterwards.  Over several ranks (tensor-parallel shards,
pipeline stages) only rank 0 builds the backend, compiles and keeps
matchers; the rows they fill travel to the other ranks with each step, so
grammars and matchers never need to pickle.

The bitmask format is the one xgrammar and llguidance share: a numpy
``int32`` array of shape ``[rows, ceil(vocab_size / 32)]``; token ``t`` is
allowed in a row when bit ``t % 32`` of word ``t // 32`` is set.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from patchbay.interfaces.base import Capabilities, Plugin, ServingConfig

if TYPE_CHECKING:
    import numpy as np

CONSTRAINT_KINDS: tuple[ConstraintKind, ...] = ("json_schema", "json_object", "regex", "choice", "grammar")
"""The constraint fields of :class:`StructuredOutputParams`, which are also the kinds backends declare."""

ConstraintKind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]
JsonWhitespace = Literal["compact", "flexible"]
"""How much whitespace a JSON constraint allows between tokens (:attr:`StructuredOutputParams.json_whitespace`)."""


class StructuredOutputParams(BaseModel):
    """One request's output constraint: exactly one of the fields below.

    In YAML or a JSONL request: ``structured_output: {regex: "[0-9]{3}"}``,
    ``{choice: [yes, no]}``, ``{json_schema: {type: object, ...}}``,
    ``{json_object: true}`` or ``{grammar: 'root ::= "a" | "b"'}``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    json_schema: dict[str, Any] | None = None
    """A JSON schema the output must be an instance of (a JSON string of one is accepted too)."""
    json_object: bool | None = None
    """``true``: the output is any JSON object (OpenAI's ``response_format: json_object``)."""
    regex: str | None = Field(default=None, min_length=1)
    """A regular expression the whole output must match."""
    choice: list[str] | None = Field(default=None, min_length=1)
    """The output is exactly one of these strings."""
    grammar: str | None = Field(default=None, min_length=1)
    """A context-free grammar in GBNF (llama.cpp's EBNF dialect, root rule ``root``)."""
    json_whitespace: JsonWhitespace | None = None
    """With ``json_schema`` or ``json_object``: ``compact`` allows no whitespace outside strings
    (``{"a":1,"b":[2,3]}``), ``flexible`` any; null: the backend's own option. A backend whose capabilities
    declare ``json_whitespace`` honours it; another ignores it (the JSON is the same, spaced its way)."""

    @field_validator("json_schema", mode="before")
    @classmethod
    def _schema_from_text(cls, value: Any) -> Any:
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"not valid JSON: {exc}") from None
        if value is not None and not isinstance(value, dict):
            raise ValueError(f"a JSON schema is an object, got {type(value).__name__}")
        return value

    @field_validator("choice")
    @classmethod
    def _choices_not_empty(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and any(choice == "" for choice in value):
            raise ValueError("choices must be non-empty strings")
        return value

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputParams:
        if self.json_object is False:
            raise ValueError("json_object: only true is meaningful; leave it out instead")
        given = [name for name in CONSTRAINT_KINDS if getattr(self, name) is not None]
        if len(given) != 1:
            found = ", ".join(given) if given else "none"
            raise ValueError(f"give exactly one of {', '.join(CONSTRAINT_KINDS)} (found: {found})")
        if self.json_whitespace is not None and given[0] not in ("json_schema", "json_object"):
            raise ValueError(f"json_whitespace applies to json_schema and json_object, not {given[0]}")
        return self

    @property
    def kind(self) -> ConstraintKind:
        """The constraint field that is set (``regex``, ``json_schema``, ...)."""
        return next(name for name in CONSTRAINT_KINDS if getattr(self, name) is not None)

    @property
    def spec(self) -> str:
        """The constraint as text: the schema or choices as canonical JSON, the regex or grammar as given."""
        value = getattr(self, self.kind)
        if self.kind in ("json_schema", "choice"):
            return json.dumps(value, sort_keys=True, separators=(",", ":"))
        return "" if self.kind == "json_object" else value

    @property
    def key(self) -> tuple[str, ...]:
        """What compiled grammars are cached by: ``(kind, spec)``, and ``json_whitespace`` when set."""
        return (self.kind, self.spec) if self.json_whitespace is None else (self.kind, self.spec, self.json_whitespace)

    @property
    def field_path(self) -> str:
        """Where the constraint sits in a request, for error messages: ``structured_output.regex``."""
        return f"structured_output.{self.kind}"


@dataclass(frozen=True)
class StructuredOutputConfig(ServingConfig):
    """What a run asks of its grammar backend."""

    needs_rollback: bool = False
    """Speculative decoding is on: matchers must roll back the drafts they accepted to fill draft rows."""


@dataclass(frozen=True)
class StructuredOutputCapabilities(Capabilities):
    """What a grammar backend offers."""

    devices: tuple[str, ...] = ("cpu", "cuda")
    """The bitmask is filled on the host; the runner moves it to the logits' device, so any device works."""
    constraint_kinds: tuple[str, ...] = CONSTRAINT_KINDS
    """The :class:`StructuredOutputParams` fields the backend compiles; requests using another are rejected."""
    supports_rollback: bool = True
    """Matchers can undo accepted tokens (needed for speculative decoding)."""
    canonical_forced_tokens: bool = False
    """Where the grammar forces the next bytes, the bitmask allows only their canonical tokenization, not
    every token that spells a prefix of them (llguidance does this); the mask is otherwise exact."""
    json_whitespace: bool = False
    """JSON constraints honour :attr:`StructuredOutputParams.json_whitespace` (enforced tool calls ask for
    ``compact``, so a model cannot spend its ``max_tokens`` on indentation)."""

    def reasons(self, config: ServingConfig) -> list[str]:
        found = super().reasons(config)
        if isinstance(config, StructuredOutputConfig) and config.needs_rollback and not self.supports_rollback:
            found.append("speculative decoding needs matchers that roll back; this backend's cannot")
        return found


def _byte_level_alphabet() -> dict[str, int]:
    """The reversible byte <-> printable character table of byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM).

    Printable bytes stand for themselves; the 68 others are shifted to U+0100 onwards, in byte order.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars = {byte: chr(byte) for byte in printable}
    shifted = 0
    for byte in range(256):
        if byte not in chars:
            chars[byte] = chr(256 + shifted)
            shifted += 1
    return {char: byte for byte, char in chars.items()}


_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
"""Sentencepiece's byte-fallback tokens: ``<0xE2>`` is the single byte 0xE2."""
_METASPACE = "\u2581"
"""Sentencepiece's word-boundary mark (``▁``), which stands for a space."""


def _is_byte_level(tokenizer: Any) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        decoder = json.loads(backend.to_str()).get("decoder") or {}
        kinds = {decoder.get("type")} | {part.get("type") for part in decoder.get("decoders") or []}
        return "ByteLevel" in kinds
    return False


def token_bytes(tokenizer: Any, vocab_size: int) -> list[bytes | None]:
    """The exact bytes each token id stands for, for ids ``0 .. vocab_size - 1``; ``None`` where none.

    ``None`` marks the ids a grammar must never allow as text: special and
    added tokens (EOS, chat markers) and ids at or past ``len(tokenizer)``
    (the padding of the logits, when ``vocab_size`` exceeds the tokenizer).
    Handles byte-level BPE (every byte spelled by one printable character),
    sentencepiece with byte fallback (``<0xE2>`` is one byte, ``▁`` a space)
    and, for other tokenizers, the UTF-8 of the token's decoded text.  A token
    may hold part of a UTF-8 character (``b"\\xc3"``): concatenating the
    pieces of an output gives its exact UTF-8 bytes, so a backend matches the
    constraint against that text decoded as UTF-8, never as Latin-1.

    Call it once, in the backend's ``__init__`` (it walks the whole vocabulary).
    """
    special = {int(token_id) for token_id in getattr(tokenizer, "all_special_ids", [])}
    special |= {int(token_id) for token_id in getattr(tokenizer, "added_tokens_decoder", {})}
    known = min(len(tokenizer), vocab_size)
    pieces = tokenizer.convert_ids_to_tokens(list(range(known)))
    alphabet = _byte_level_alphabet() if _is_byte_level(tokenizer) else None
    found: list[bytes | None] = []
    for token_id, piece in enumerate(pieces):
        if piece is None or token_id in special:
            found.append(None)
        elif alphabet is not None and all(char in alphabet for char in piece):
            found.append(bytes(alphabet[char] for char in piece))
        elif (fallback := _BYTE_FALLBACK.match(piece)) is not None:
            found.append(bytes([int(fallback.group(1), 16)]))
        elif alphabet is None and _METASPACE in piece:
            found.append(piece.replace(_METASPACE, " ").encode())
        else:
            found.append(tokenizer.convert_tokens_to_string([piece]).encode())
    found.extend([None] * (vocab_size - known))
    return found


class GrammarCompileError(ValueError):
    """A constraint the backend cannot compile; the message says why (the runner adds backend and field)."""


class GrammarMatcher(ABC):
    """The grammar state of one request: what it accepted so far and what may come next.

    Used by one thread at a time (the model runner's).  A fresh matcher has
    accepted nothing; a request resumed after preemption gets a new one,
    advanced by the tokens it generated before.
    """

    @abstractmethod
    def accept_tokens(self, token_ids: Sequence[int]) -> int:
        """Advance by ``token_ids`` in order, stopping at the first token the grammar rejects.

        Returns how many were accepted; a rejected token leaves the state as
        it was before that token.  Accepting a stop token (EOS) where the
        grammar may end terminates the matcher.
        """

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (at most as many as were accepted)."""

    @abstractmethod
    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        """Write row ``row`` of ``bitmask`` (int32, ``[rows, ceil(vocab_size / 32)]``): the tokens allowed next.

        Every bit of the row is written.  Stop tokens are allowed exactly
        where the grammar may end.  The state does not change.
        """

    @abstractmethod
    def is_accepting(self) -> bool:
        """Whether what was accepted so far is a complete match, so that a stop token may come next."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """Whether the matcher accepted a stop token: nothing more may be accepted."""


class StructuredOutputBackend(Plugin):
    """A grammar backend: compiles constraints for one tokenizer and makes matchers of them."""

    kind: ClassVar[str] = "structured_output"
    capabilities: ClassVar[StructuredOutputCapabilities] = StructuredOutputCapabilities()

    def __init__(
        self, options: BaseModel | None = None, *, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]
    ) -> None:
        """Prepare the backend for one model.

        ``tokenizer`` is the model's Hugging Face tokenizer; ``vocab_size`` is
        the width of the model's logits (it may exceed the tokenizer's
        vocabulary; the extra ids are never allowed); ``stop_token_ids`` are
        the ids that end a request (EOS), allowed only where the grammar may end.
        Building tokenizer tables may take a second; it happens here, once.
        """
        self.options = options if options is not None else self.Options()
        self.vocab_size = vocab_size
        self.stop_token_ids = tuple(stop_token_ids)

    def token_bytes(self, tokenizer: Any) -> list[bytes | None]:
        """The exact bytes of every id below :attr:`vocab_size` (see :func:`token_bytes`); ``None``: never allowed."""
        return token_bytes(tokenizer, self.vocab_size)

    @property
    def bitmask_width(self) -> int:
        """int32 words per bitmask row: ``ceil(vocab_size / 32)``."""
        return -(-self.vocab_size // 32)

    @abstractmethod
    def compile(self, params: StructuredOutputParams) -> Any:
        """Compile one constraint into an immutable grammar object that matchers share.

        Called on a worker thread (never two at once for one key; different
        keys may compile concurrently, so it must be thread-safe; the engine
        compiles one at a time today) and cached by ``params.key``.  It
        should take well under a second for typical constraints: the request
        waits for it (the kit bounds it, see ``StructuredOutputSuite.compile_time_bound``).  Raises
        :class:`GrammarCompileError` (or any exception) when the constraint
        cannot be compiled; the request then fails alone with that message.
        """

    @abstractmethod
    def matcher(self, grammar: Any) -> GrammarMatcher:
        """A fresh matcher over a grammar returned by :meth:`compile`."""

    def grammar_size_bytes(self, grammar: Any, params: StructuredOutputParams) -> int:
        """An estimate of the memory ``grammar`` (compiled from ``params``) holds, in bytes.

        The engine keeps compiled grammars while their estimates add up to at
        most ``structured_output.cache_bytes``.  The default guesses 256 bytes
        per character of the constraint's text plus 16 bitmask rows; a backend
        that can measure its grammars says so here.
        """
        return 256 * len(params.spec) + 16 * 4 * self.bitmask_width
