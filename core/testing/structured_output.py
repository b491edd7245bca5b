"""Conformance suite for structured-output (grammar) backends, against oracles that know nothing of grammars.

A backend author's test file::

    from patchbay.testing import StructuredOutputSuite

    class TestMyBackend(StructuredOutputSuite):
        plugin_name = "my_backend"

The suite builds the backend over the bundled model's tokenizer (a
byte-level BPE of 49,152 tokens) and walks matchers token by token:

- regexes and choices, ASCII and not: at every step, the bitmask must allow
  exactly the tokens whose bytes keep the output's *decoded text* a prefix of
  some match, as the ``regex`` package's partial matching says
  (``regex.fullmatch(p, text, partial=True)``; an output ending inside a
  UTF-8 character is a prefix when some character completing it keeps it
  one), and allow the stop token exactly where the output is a full match;
- JSON schemas: valid instances (checked with ``jsonschema``), tokenized,
  must be accepted token by token with the stop token allowed exactly where the
  text so far is itself a valid instance; invalid ones must be refused; random
  walks through the bitmask that end must parse and validate; a backend that
  declares ``json_whitespace`` allows no whitespace outside strings for
  ``json_whitespace: compact``;
- rollback restores the bitmask and the accepting state of every earlier
  step; a rejected token changes nothing, even one whose first bytes fit;
  rows are written whole and alone; matchers of one grammar never share
  state; ids past the tokenizer are never allowed;
- compiles take at most :attr:`StructuredOutputSuite.compile_time_bound`
  seconds and give the same grammars when run on several threads at once.

Options for ``patchbay check`` come from ``PATCHBAY_TEST_STRUCTURED_OUTPUT_OPTIONS`` (JSON).
"""

from __future__ import annotations

import json
import os
import random
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from typing import Any, ClassVar

import numpy as np
import pytest

from patchbay.interfaces import (
    GrammarMatcher,
    ServingConfig,
    StructuredOutputBackend,
    StructuredOutputCapabilities,
    StructuredOutputConfig,
    StructuredOutputParams,
)
from patchbay.interfaces import token_bytes as interface_token_bytes
from patchbay.testing.suite import PluginSuite, _replace, options_env, skip_not_declared

OPTIONS_ENV = options_env("structured_output")
COMPILE_BOUND_ENV = "PATCHBAY_TEST_STRUCTURED_OUTPUT_COMPILE_BOUND"
SEED = 20241201

REGEXES = (
    r"[0-9]{3}-[a-z]{2,4}",
    r"(yes|no|maybe)!?",
    r"-?[1-9][0-9]{0,3}\.[0-9]{2}",
    r"[A-Z][a-z]{1,6}( [A-Z][a-z]{1,6}){0,2}",
)
NON_ASCII_REGEXES = (
    r"(café|naïve|Zoë) [à-ö]{1,3}",
    r"[0-9]{1,2}(€|£|¥) — ok",
    r"«[a-zé]{1,5}»",
)
"""Patterns matched against the decoded text: multi-byte literals, classes and ranges of non-ASCII characters."""
CHOICES = (["positive", "negative", "neutral"], ["Paris", "Par", "Lyon", "Lille"])
NON_ASCII_CHOICES = (["café", "cafè", "naïve", "€5 — cinq", "日本"], ["Zoë", "Zoé", "Zo"])
SCHEMAS: tuple[dict[str, Any], ...] = (
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "age": {"type": "integer"},
            "admin": {"type": "boolean"},
        },
        "required": ["name", "age", "admin"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "sizes": {"type": "array", "items": {"type": "integer"}, "maxItems": 3},
            "point": {
                "type": "object",
                "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
                "required": ["x", "y"],
                "additionalProperties": False,
            },
        },
        "required": ["color", "sizes", "point"],
        "additionalProperties": False,
    },
)
VALID_INSTANCES = (
    [{"name": "Ada", "age": 36, "admin": True}, {"name": "", "age": -4, "admin": False}],
    [
        {"color": "red", "sizes": [], "point": {"x": 1.5, "y": -2}},
        {"color": "blue", "sizes": [1, 22, 333], "point": {"x": 0, "y": 1e3}},
    ],
)
INVALID_INSTANCES = (
    [
        {"name": "Ada", "age": 36},
        {"name": "Ada", "age": "36", "admin": True},
        {"name": "Ada", "age": 36, "admin": True, "extra": 1},
        {"name": "Adalovelace", "age": 36, "admin": True},
    ],
    [
        {"color": "pink", "sizes": [], "point": {"x": 1, "y": 2}},
        {"color": "red", "sizes": [1, 2, 3, 4], "point": {"x": 1, "y": 2}},
        {"color": "red", "sizes": [], "point": {"x": 1}},
    ],
)


# -- the oracle's view of the vocabulary ------------------------------------------------------------


@cache
def bundled_tokenizer() -> Any:
    from transformers import AutoTokenizer

    from patchbay.toolkit.model_files import resolve_model_dir

    return AutoTokenizer.from_pretrained(resolve_model_dir("default"))


@cache
def token_bytes(vocab_size: int) -> tuple[bytes | None, ...]:
    """Each token id's bytes in the bundled tokenizer; ``None`` for special tokens and ids past the tokenizer.

    The interface's :func:`patchbay.interfaces.token_bytes`, checked against the tokenizer's own encoding in
    the project's tests.
    """
    return tuple(interface_token_bytes(bundled_tokenizer(), vocab_size))


def _whitespace_outside_strings(text: str) -> bool:
    """Whether JSON ``text`` has a whitespace character outside its strings."""
    in_string = escaped = False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char.isspace():
            return True
    return False


def allowed_tokens(bitmask: np.ndarray, row: int, vocab_size: int) -> np.ndarray:
    """Token ids whose bit is set in ``bitmask[row]``."""
    bits = np.unpackbits(np.ascontiguousarray(bitmask[row]).view(np.uint8), bitorder="little")
    return np.flatnonzero(bits[:vocab_size])


NON_ASCII_HINT = (
    " [non-ASCII text: a token's bytes are its exact UTF-8 bytes (patchbay.interfaces.token_bytes), not its text "
    "encoded as Latin-1, and a mask after half a character allows only the bytes that complete it]"
)
_TWO_BYTE_CHARACTERS = "".join(chr(code) for code in range(0x80, 0x800))


def _split_utf8(data: bytes) -> tuple[str, bytes] | None:
    """``data`` as text plus the bytes of a character it has only begun; ``None`` when it is not UTF-8."""
    for cut in range(min(3, len(data)) + 1):
        head, tail = data[: len(data) - cut], data[len(data) - cut :]
        try:
            text = head.decode()
        except UnicodeDecodeError:
            continue
        if not tail:
            return text, b""
        lead = tail[0]
        width = 2 if 0xC2 <= lead <= 0xDF else 3 if 0xE0 <= lead <= 0xEF else 4 if 0xF0 <= lead <= 0xF4 else 0
        if len(tail) < width and all(0x80 <= byte <= 0xBF for byte in tail[1:]):
            return text, tail
        return None
    return None


class _PrefixOracle:
    """Which outputs are prefixes of a match, and which are matches, of a regex on *text* (``regex`` partial
    matching on the decoded characters, never on bytes).

    An output that ends inside a UTF-8 character is a prefix when some character starting with those bytes
    keeps it one; the characters tried are every two-byte character and the pattern's own non-ASCII
    characters (the kit's patterns use longer characters only as literals).
    """

    def __init__(self, pattern: str) -> None:
        import regex

        self._pattern = regex.compile(pattern)
        self._candidates = _TWO_BYTE_CHARACTERS + "".join(sorted({char for char in pattern if ord(char) >= 0x800}))
        self._prefix_cache: dict[bytes, bool] = {}

    def _text_is_prefix(self, text: str) -> bool:
        return self._pattern.fullmatch(text, partial=True) is not None

    def is_prefix(self, data: bytes) -> bool:
        if data not in self._prefix_cache:
            split = _split_utf8(data)
            if split is None:
                found = False
            elif not split[1]:
                found = self._text_is_prefix(split[0])
            else:
                text, tail = split
                found = any(
                    char.encode().startswith(tail) and self._text_is_prefix(text + char) for char in self._candidates
                )
            self._prefix_cache[data] = found
        return self._prefix_cache[data]

    def is_match(self, data: bytes) -> bool:
        split = _split_utf8(data)
        return split is not None and not split[1] and self._pattern.fullmatch(split[0]) is not None

    def allowed(self, text: bytes, vocabulary: Sequence[bytes | None]) -> set[int]:
        # A token whose first byte already breaks the prefix cannot keep it; test whole tokens only for the rest.
        first_bytes = {byte for byte in range(256) if self.is_prefix(text + bytes([byte]))}
        return {
            token_id
            for token_id, piece in enumerate(vocabulary)
            if piece and piece[0] in first_bytes and self.is_prefix(text + piece)
        }


def _choice_pattern(choices: Sequence[str]) -> str:
    import regex

    return "|".join(regex.escape(choice) for choice in choices)


# -- the suite ---------------------------------------------------------------------------------------


class StructuredOutputSuite(PluginSuite[StructuredOutputCapabilities]):
    """Bitmasks against regex, choice and JSON-schema oracles; rollback; rejection; row hygiene."""

    kind: ClassVar[str] = "structured_output"
    capabilities_class: ClassVar[type[StructuredOutputCapabilities]] = StructuredOutputCapabilities
    walk_steps: ClassVar[int] = 24
    """Longest oracle walk through a regex or choice grammar."""
    compile_time_bound: ClassVar[float] = 5.0
    """Seconds one typical constraint may take to compile (``PATCHBAY_TEST_STRUCTURED_OUTPUT_COMPILE_BOUND``)."""
    _backends: ClassVar[dict[tuple[type, str, int], StructuredOutputBackend]] = {}

    def supported_config(self, capabilities: StructuredOutputCapabilities) -> StructuredOutputConfig:
        return StructuredOutputConfig(device=capabilities.devices[0], dtype=capabilities.dtypes[0])

    def unsupported_configs(self, capabilities: StructuredOutputCapabilities) -> list[tuple[str, ServingConfig]]:
        found = super().unsupported_configs(capabilities)
        if not capabilities.supports_rollback:
            found.append(("speculative decoding", _replace(self.supported_config(capabilities), needs_rollback=True)))
        return found

    # -- fixtures ------------------------------------------------------------------------------

    @pytest.fixture
    def backend_options(self) -> dict[str, Any]:
        """Options the backend is built with (override, or set ``PATCHBAY_TEST_STRUCTURED_OUTPUT_OPTIONS``)."""
        return self.given_options() or {}

    def build(
        self, plugin_class: type[StructuredOutputBackend], options: dict[str, Any], vocab_size: int | None = None
    ) -> StructuredOutputBackend:
        """The backend over the bundled tokenizer, built once per class, options and vocabulary size."""
        tokenizer = bundled_tokenizer()
        vocab_size = vocab_size or len(tokenizer)
        key = (plugin_class, json.dumps(options, sort_keys=True), vocab_size)
        if key not in self._backends:
            self._backends[key] = plugin_class(
                plugin_class.Options.model_validate(options),
                tokenizer=tokenizer,
                vocab_size=vocab_size,
                stop_token_ids=[tokenizer.eos_token_id],
            )
        return self._backends[key]

    @pytest.fixture
    def backend(
        self, available: type[StructuredOutputBackend], backend_options: dict[str, Any]
    ) -> StructuredOutputBackend:
        return self.build(available, backend_options)

    def matcher_for(self, backend: StructuredOutputBackend, **constraint: Any) -> GrammarMatcher:
        params = StructuredOutputParams(**constraint)
        if params.kind not in backend.capabilities.constraint_kinds:
            skip_not_declared(f"the backend does not declare {params.field_path}")
        return backend.matcher(backend.compile(params))

    @staticmethod
    def choice_params(backend: StructuredOutputBackend, choices: Sequence[str]) -> StructuredOutputParams:
        """``choice: choices``, or the same language as a regex for a backend that compiles regexes only."""
        kinds = backend.capabilities.constraint_kinds
        if "choice" in kinds:
            return StructuredOutputParams(choice=list(choices))
        if "regex" in kinds:
            return StructuredOutputParams(regex=_choice_pattern(choices))
        skip_not_declared("the backend declares neither structured_output.choice nor structured_output.regex")
        raise AssertionError("unreachable")

    def choice_matcher(self, backend: StructuredOutputBackend, choices: Sequence[str]) -> GrammarMatcher:
        """A matcher for one of ``choices`` (see :meth:`choice_params`)."""
        return backend.matcher(backend.compile(self.choice_params(backend, choices)))

    def fill(self, backend: StructuredOutputBackend, matcher: GrammarMatcher) -> np.ndarray:
        bitmask = np.zeros((1, backend.bitmask_width), dtype=np.int32)
        matcher.fill_bitmask(bitmask, 0)
        return bitmask

    # -- regexes and choices against partial matching ------------------------------------------

    def _walk_against_oracle(
        self, backend: StructuredOutputBackend, matcher: GrammarMatcher, pattern: str, seed: int
    ) -> None:
        oracle = _PrefixOracle(pattern)
        vocabulary = token_bytes(backend.vocab_size)
        stop = backend.stop_token_ids[0]
        rng = random.Random(seed)
        text = b""
        for step in range(self.walk_steps):
            allowed = self._assert_mask_matches(backend, matcher, oracle, text, f"step {step} for pattern {pattern!r}")
            complete = oracle.is_match(text)
            choices = sorted(allowed - {stop})
            if not choices or (complete and rng.random() < 0.3):
                assert matcher.accept_tokens([stop]) == 1 and matcher.is_terminated()
                return
            # Tokens that stop inside a multi-byte character are rare in a vocabulary; take them half the time.
            half_sent = [t for t in choices if (_split_utf8(text + (vocabulary[t] or b"")) or ("", b""))[1]]
            token = rng.choice(half_sent if half_sent and rng.random() < 0.5 else choices)
            assert matcher.accept_tokens([token]) == 1, (
                f"after {text!r} (step {step}) for pattern {pattern!r}: the matcher refused token {token} it allowed"
            )
            assert not matcher.is_terminated()
            text += vocabulary[token] or b""

    def _assert_mask_matches(
        self, backend: StructuredOutputBackend, matcher: GrammarMatcher, oracle: _PrefixOracle, text: bytes, where: str
    ) -> set[int]:
        """The matcher's mask after ``text`` against the oracle's; returns the allowed ids."""
        vocabulary = token_bytes(backend.vocab_size)
        stop = backend.stop_token_ids[0]
        allowed = set(allowed_tokens(self.fill(backend, matcher), 0, backend.vocab_size).tolist())
        expected = oracle.allowed(text, vocabulary)
        context = f"after {text!r} ({text.decode(errors='replace')!r}, {where})"
        wrongly_allowed = sorted((allowed - expected) - {stop})[:5]
        if any(byte >= 0x80 for byte in text + b"".join(vocabulary[token] or b"" for token in wrongly_allowed)):
            context += NON_ASCII_HINT
        assert not wrongly_allowed, (
            f"{context}: allowed tokens that break the match: {[(t, vocabulary[t]) for t in wrongly_allowed]}"
        )
        wrongly_refused = sorted(expected - allowed)[:5]
        if wrongly_refused and backend.capabilities.canonical_forced_tokens:
            self._assert_forced(allowed - {stop}, expected, vocabulary, context)
        else:
            assert not wrongly_refused, (
                f"{context}: refused tokens that keep a match possible: {[(t, vocabulary[t]) for t in wrongly_refused]}"
            )
        complete = oracle.is_match(text)
        assert (stop in allowed) == complete, f"{context}: stop token allowed={stop in allowed}, full match={complete}"
        assert matcher.is_accepting() == complete, f"{context}: is_accepting() disagrees with the full match"
        return allowed

    @staticmethod
    def _assert_forced(kept: set[int], expected: set[int], vocabulary: Sequence[bytes | None], context: str) -> None:
        """A backend that narrows forced bytes to one canonical token.

        That token must spell what every valid token does.
        """
        assert len(kept) == 1, (
            f"{context}: refused tokens that keep a match possible, and allowed {len(kept)} tokens, "
            "not the one canonical token of forced bytes"
        )
        forced = vocabulary[next(iter(kept))] or b""
        clashing = [
            vocabulary[t]
            for t in expected
            if not (forced.startswith(vocabulary[t] or b"") or (vocabulary[t] or b"").startswith(forced))
        ]
        assert not clashing, f"{context}: allowed only {forced!r}, but {clashing[:5]} also keep a match possible"

    @pytest.mark.parametrize("pattern", REGEXES)
    def test_regex_bitmask_matches_partial_matching(self, backend: StructuredOutputBackend, pattern: str) -> None:
        for walk in range(2):
            self._walk_against_oracle(backend, self.matcher_for(backend, regex=pattern), pattern, SEED + walk)

    @pytest.mark.parametrize("pattern", NON_ASCII_REGEXES, ids=["accents", "currency", "guillemets"])
    def test_non_ascii_regex_bitmask_matches_partial_matching_on_text(
        self, backend: StructuredOutputBackend, pattern: str
    ) -> None:
        """The regex is matched against the output decoded as UTF-8: a token's bytes are its exact bytes."""
        for walk in range(3):
            self._walk_against_oracle(backend, self.matcher_for(backend, regex=pattern), pattern, SEED + walk)

    @pytest.mark.parametrize("choices", CHOICES, ids=["words", "shared-prefixes"])
    def test_choice_bitmask_matches_partial_matching(
        self, backend: StructuredOutputBackend, choices: list[str]
    ) -> None:
        for walk in range(3):
            self._walk_against_oracle(
                backend, self.matcher_for(backend, choice=choices), _choice_pattern(choices), SEED + walk
            )

    @pytest.mark.parametrize("choices", NON_ASCII_CHOICES, ids=["multi-byte", "shared-lead-byte"])
    def test_non_ascii_choice_bitmask_matches_partial_matching_on_text(
        self, backend: StructuredOutputBackend, choices: list[str]
    ) -> None:
        for walk in range(4):
            self._walk_against_oracle(
                backend, self.matcher_for(backend, choice=choices), _choice_pattern(choices), SEED + walk
            )

    def test_a_half_sent_character_narrows_the_mask(self, backend: StructuredOutputBackend) -> None:
        """After a token that ends inside a UTF-8 character, only the bytes that complete it may follow."""
        choices = ["café", "cafè", "cafe"]
        matcher = self.choice_matcher(backend, choices)
        oracle = _PrefixOracle(_choice_pattern(choices))
        vocabulary = token_bytes(backend.vocab_size)
        prefix = bundled_tokenizer().encode("caf", add_special_tokens=False)
        lead = vocabulary.index(b"\xc3")  # the token that is the lone first byte of é and è
        assert matcher.accept_tokens([*prefix, lead]) == len(prefix) + 1, "refused 'caf' then the byte 0xC3"
        allowed = self._assert_mask_matches(backend, matcher, oracle, b"caf\xc3", "half of é or è was sent")
        assert allowed, "after the first byte of é or è, nothing is allowed"

    # -- JSON schemas against jsonschema -------------------------------------------------------

    @staticmethod
    def _instance_texts(instance: Any) -> list[str]:
        return [json.dumps(instance), json.dumps(instance, separators=(",", ":"))]

    def _next_token(self, backend: StructuredOutputBackend, allowed: set[int], remaining: bytes) -> int:
        """The token that spells the start of ``remaining``: the tokenizer's choice, or a forced canonical one."""
        tokenizer = bundled_tokenizer()
        token = tokenizer.encode(remaining.decode(), add_special_tokens=False)[0]
        if token in allowed or not backend.capabilities.canonical_forced_tokens:
            return token
        vocabulary = token_bytes(backend.vocab_size)
        forced = allowed - set(backend.stop_token_ids)
        if len(forced) == 1 and remaining.startswith(vocabulary[next(iter(forced))] or b"\0"):
            return next(iter(forced))
        return token

    def _accepts_text(
        self, backend: StructuredOutputBackend, matcher: GrammarMatcher, text: str, schema: dict[str, Any]
    ) -> bool:
        """Feed ``text`` token by token.

        Checks the stop token and ``is_accepting`` against jsonschema at each prefix.
        """
        import jsonschema

        vocabulary = token_bytes(backend.vocab_size)
        stop = backend.stop_token_ids[0]
        remaining = text.encode()
        fed = b""
        while True:
            prefix = fed.decode()
            try:
                valid_here = jsonschema.Draft202012Validator(schema).is_valid(json.loads(prefix))
            except json.JSONDecodeError:
                valid_here = False
            allowed = set(allowed_tokens(self.fill(backend, matcher), 0, backend.vocab_size).tolist())
            # Whitespace may follow a complete document in some grammars and not in others; judge at its end only.
            if not prefix[-1:].isspace():
                assert (stop in allowed) == valid_here, (
                    f"after {prefix!r}: stop token allowed={stop in allowed}, but the prefix is "
                    f"{'a valid' if valid_here else 'not a valid'} instance of the schema"
                )
                assert matcher.is_accepting() == valid_here, (
                    f"after {prefix!r}: is_accepting() disagrees with jsonschema"
                )
            if not remaining:
                return valid_here and matcher.accept_tokens([stop]) == 1 and matcher.is_terminated()
            token = self._next_token(backend, allowed, remaining)
            if token not in allowed:
                assert matcher.accept_tokens([token]) == 0, (
                    f"after {prefix!r}: accepted token {token} its bitmask refused"
                )
                return False
            assert matcher.accept_tokens([token]) == 1, f"after {prefix!r}: refused token {token} its bitmask allowed"
            piece = vocabulary[token] or b""
            fed, remaining = fed + piece, remaining[len(piece) :]

    @pytest.mark.parametrize("index", range(len(SCHEMAS)))
    def test_json_schema_accepts_valid_instances_and_refuses_invalid_ones(
        self, backend: StructuredOutputBackend, index: int
    ) -> None:
        import jsonschema

        schema = SCHEMAS[index]
        for instance in VALID_INSTANCES[index]:
            jsonschema.validate(instance, schema)
            for text in self._instance_texts(instance):
                matcher = self.matcher_for(backend, json_schema=schema)
                assert self._accepts_text(backend, matcher, text, schema), f"refused a valid instance: {text}"
        for instance in INVALID_INSTANCES[index]:
            assert not jsonschema.Draft202012Validator(schema).is_valid(instance)
            for text in self._instance_texts(instance):
                matcher = self.matcher_for(backend, json_schema=schema)
                assert not self._accepts_text(backend, matcher, text, schema), f"accepted an invalid instance: {text}"

    @pytest.mark.parametrize("index", range(len(SCHEMAS)))
    def test_json_schema_walks_that_end_validate(self, backend: StructuredOutputBackend, index: int) -> None:
        """Random walks through the bitmask, preferring non-whitespace tokens; every one that ends validates."""
        import jsonschema

        schema = SCHEMAS[index]
        vocabulary = token_bytes(backend.vocab_size)
        stop = backend.stop_token_ids[0]
        rng = random.Random(SEED)
        ended = 0
        for _ in range(4):
            matcher = self.matcher_for(backend, json_schema=schema)
            text = b""
            for _ in range(400):
                allowed = allowed_tokens(self.fill(backend, matcher), 0, backend.vocab_size).tolist()
                if stop in allowed:
                    json_text = text.decode()
                    jsonschema.validate(json.loads(json_text), schema)
                    ended += 1
                    break
                # Short tokens of printable ASCII keep strings and numbers short, so walks end (raw control
                # characters in strings have their own test).
                solid = [
                    t
                    for t in allowed
                    if len(vocabulary[t] or b"") <= 2 and all(0x21 <= byte < 0x7F for byte in vocabulary[t] or b" ")
                ]
                token = rng.choice(solid or allowed)
                assert matcher.accept_tokens([token]) == 1
                text += vocabulary[token] or b""
        assert ended, "no random walk through the JSON grammar reached its end in 400 tokens"

    def _assert_string_refuses_control_characters(
        self, backend: StructuredOutputBackend, string_schema: dict[str, Any]
    ) -> None:
        """Inside a JSON string, characters U+0000..U+001F must be escaped (RFC 8259, section 7)."""
        schema = {"type": "object", "properties": {"a": string_schema}, "required": ["a"]}
        matcher = self.matcher_for(backend, json_schema=schema)
        prefix = bundled_tokenizer().encode('{"a": "x', add_special_tokens=False)
        assert matcher.accept_tokens(prefix) == len(prefix)
        vocabulary = token_bytes(backend.vocab_size)
        raw = [
            (token, vocabulary[token])
            for token in allowed_tokens(self.fill(backend, matcher), 0, backend.vocab_size)
            if any(byte < 0x20 for byte in vocabulary[token] or b"")
        ]
        assert not raw, f"inside a JSON string, allowed tokens with raw control characters: {raw[:8]}"

    def test_json_strings_refuse_raw_control_characters(self, backend: StructuredOutputBackend) -> None:
        self._assert_string_refuses_control_characters(backend, {"type": "string"})

    def test_json_bounded_strings_refuse_raw_control_characters(self, backend: StructuredOutputBackend) -> None:
        self._assert_string_refuses_control_characters(backend, {"type": "string", "maxLength": 8})

    def test_json_whitespace_is_honoured_where_declared(self, backend: StructuredOutputBackend) -> None:
        """``json_whitespace: compact`` allows no whitespace outside strings: no token that starts with one after
        ``{``, and walks through the bitmask that end hold none; ``flexible`` allows it."""
        if not backend.capabilities.json_whitespace:
            skip_not_declared("the backend does not declare json_whitespace")
        schema = SCHEMAS[1]
        vocabulary = token_bytes(backend.vocab_size)
        brace = bundled_tokenizer().encode("{", add_special_tokens=False)

        def spacing_after_brace(whitespace: str) -> list[int]:
            matcher = self.matcher_for(backend, json_schema=schema, json_whitespace=whitespace)
            assert matcher.accept_tokens(brace) == len(brace)
            allowed = allowed_tokens(self.fill(backend, matcher), 0, backend.vocab_size).tolist()
            return [token for token in allowed if (vocabulary[token] or b"x")[:1].isspace()]

        spacing = spacing_after_brace("compact")
        assert not spacing, f"compact JSON allowed tokens that start with whitespace after '{{': {spacing[:8]}"
        assert spacing_after_brace("flexible"), "flexible JSON allowed no whitespace after '{'"
        stop = backend.stop_token_ids[0]
        rng = random.Random(SEED)
        ended = 0
        for _ in range(4):
            matcher = self.matcher_for(backend, json_schema=schema, json_whitespace="compact")
            text = b""
            for _ in range(400):
                allowed = allowed_tokens(self.fill(backend, matcher), 0, backend.vocab_size).tolist()
                if stop in allowed:
                    assert not _whitespace_outside_strings(text.decode()), f"compact JSON with whitespace: {text!r}"
                    ended += 1
                    break
                short = [t for t in allowed if len(vocabulary[t] or b"") <= 2]
                token = rng.choice(short or allowed)
                assert matcher.accept_tokens([token]) == 1
                text += vocabulary[token] or b""
        assert ended, "no random walk through the compact JSON grammar reached its end in 400 tokens"

    def test_json_object_accepts_any_object_only(self, backend: StructuredOutputBackend) -> None:
        schema = {"type": "object"}
        for text in ('{"a": [1, {"b": null}], "c": "d"}', "{}"):
            assert self._accepts_text(backend, self.matcher_for(backend, json_object=True), text, schema), text
        for text in ("[1, 2]", '"text"', "12"):
            assert not self._accepts_text(backend, self.matcher_for(backend, json_object=True), text, schema), text

    # -- grammars ----------------------------------------------------------------------------

    def test_gbnf_grammar_matches_its_language(self, backend: StructuredOutputBackend) -> None:
        grammar = 'root ::= item ("," item)*\nitem ::= "a" | "bb" | digit\ndigit ::= [0-9]'
        pattern = r"(a|bb|[0-9])(,(a|bb|[0-9]))*"
        for walk in range(2):
            self._walk_against_oracle(backend, self.matcher_for(backend, grammar=grammar), pattern, SEED + walk)

    # -- state handling ------------------------------------------------------------------------

    def test_rollback_restores_every_earlier_state(self, backend: StructuredOutputBackend) -> None:
        if not backend.capabilities.supports_rollback:
            skip_not_declared("the backend declares no rollback")
        matcher = self.matcher_for(backend, regex=REGEXES[0])
        tokens = bundled_tokenizer().encode("123-abc", add_special_tokens=False)
        states = []
        for token in tokens:
            states.append((self.fill(backend, matcher), matcher.is_accepting()))
            assert matcher.accept_tokens([token]) == 1
        states.append((self.fill(backend, matcher), matcher.is_accepting()))
        assert matcher.accept_tokens([backend.stop_token_ids[0]]) == 1 and matcher.is_terminated()
        matcher.rollback(1)
        assert not matcher.is_terminated(), "rolling back the stop token must un-terminate the matcher"
        for back in range(len(tokens) + 1):
            bitmask, accepting = states[len(tokens) - back]
            assert np.array_equal(self.fill(backend, matcher), bitmask), f"bitmask differs after rolling back {back}"
            assert matcher.is_accepting() == accepting
            if back < len(tokens):
                matcher.rollback(1)
        # The state is usable after a rollback: the same tokens are accepted again.
        assert matcher.accept_tokens(tokens) == len(tokens) and matcher.is_accepting()

    def test_a_rejected_token_changes_nothing(self, backend: StructuredOutputBackend) -> None:
        matcher = self.matcher_for(backend, regex=REGEXES[0])
        tokenizer = bundled_tokenizer()
        digit = tokenizer.encode("1", add_special_tokens=False)
        letter = tokenizer.encode("x", add_special_tokens=False)
        assert matcher.accept_tokens(digit) == 1
        before = self.fill(backend, matcher)
        assert matcher.accept_tokens([*letter, *digit]) == 0
        assert np.array_equal(self.fill(backend, matcher), before)
        assert matcher.accept_tokens([*digit, *letter]) == 1, "accept_tokens must stop at the first rejected token"

    def test_fill_writes_its_row_whole_and_alone(self, backend: StructuredOutputBackend) -> None:
        matcher = self.matcher_for(backend, choice=CHOICES[0])
        reference = self.fill(backend, matcher)
        garbage = np.full((3, backend.bitmask_width), 0x5A5A5A5A, dtype=np.int32)
        for fill_value in (0x5A5A5A5A, -1):
            garbage[:] = fill_value
            matcher.fill_bitmask(garbage, 1)
            assert np.array_equal(garbage[1], reference[0]), "fill_bitmask must write every bit of its row"
            assert (garbage[[0, 2]] == fill_value).all(), "fill_bitmask wrote outside its row"

    def test_a_token_refused_half_way_changes_nothing(self, backend: StructuredOutputBackend) -> None:
        """A token whose first bytes fit and whose later bytes do not is refused whole, leaving the state as it was.

        N-gram and other drafters propose such tokens all the time; a matcher that keeps the bytes that fitted
        drifts from the request's text and refuses the next real token.
        """
        choices = ["cabbage", "carrot", "cab"]
        matcher = self.choice_matcher(backend, choices)
        oracle = _PrefixOracle(_choice_pattern(choices))
        vocabulary = token_bytes(backend.vocab_size)
        good = bundled_tokenizer().encode("ca", add_special_tokens=False)
        assert matcher.accept_tokens(good) == len(good)
        half_way = [
            token
            for token, piece in enumerate(vocabulary)
            if piece and len(piece) > 1 and oracle.is_prefix(b"ca" + piece[:1]) and not oracle.is_prefix(b"ca" + piece)
        ]
        assert half_way, "the kit found no token that fits half way after 'ca'"
        before = self.fill(backend, matcher)
        for token in half_way[:20]:
            assert matcher.accept_tokens([token]) == 0, f"after 'ca': accepted {vocabulary[token]!r}, which breaks it"
            assert np.array_equal(self.fill(backend, matcher), before), (
                f"after 'ca': refusing {vocabulary[token]!r} half way changed the bitmask (the bytes that fitted "
                "moved the state)"
            )
        # The state is still exactly 'ca': every choice can still be finished.
        self._assert_mask_matches(backend, matcher, oracle, b"ca", f"after refusing {len(half_way[:20])} tokens")
        rest = bundled_tokenizer().encode("rrot", add_special_tokens=False)
        assert matcher.accept_tokens([*rest, half_way[0]]) == len(rest), "stopped at the wrong token"
        assert matcher.is_accepting(), "refusing a token half way lost 'carrot'"

    def test_matchers_of_one_grammar_are_independent(self, backend: StructuredOutputBackend) -> None:
        """Two matchers of one compiled grammar, moved to states whose masks differ, never see each other."""
        choices = ["yes", "no", "maybe"]
        grammar = backend.compile(self.choice_params(backend, choices))
        first, second, third = backend.matcher(grammar), backend.matcher(grammar), backend.matcher(grammar)
        fresh = self.fill(backend, third)
        tokenizer = bundled_tokenizer()
        assert first.accept_tokens(tokenizer.encode("y", add_special_tokens=False)) == 1
        after_y = self.fill(backend, first)
        assert not np.array_equal(after_y, fresh), "the kit's states must have different masks"
        assert np.array_equal(self.fill(backend, second), fresh), (
            "advancing one matcher changed another matcher of the same grammar"
        )
        assert second.accept_tokens(tokenizer.encode("n", add_special_tokens=False)) == 1
        after_n = self.fill(backend, second)
        assert np.array_equal(self.fill(backend, first), after_y), (
            "advancing a second matcher of the same grammar changed the first one's mask"
        )
        assert not np.array_equal(after_n, after_y)
        assert np.array_equal(self.fill(backend, third), fresh)
        rest = tokenizer.encode("es", add_special_tokens=False)
        assert first.accept_tokens(rest) == len(rest) and first.is_accepting() and not second.is_accepting()

    def test_ids_past_the_tokenizer_are_never_allowed(
        self, available: type[StructuredOutputBackend], backend_options: dict[str, Any]
    ) -> None:
        """Models pad their logits past the tokenizer; those ids spell nothing and must never be allowed."""
        vocab_size = len(bundled_tokenizer()) + 64
        backend = self.build(available, backend_options, vocab_size)
        assert backend.bitmask_width == -(-vocab_size // 32)
        cases: list[tuple[StructuredOutputParams, str]] = []
        if "json_object" in backend.capabilities.constraint_kinds:
            cases += [(StructuredOutputParams(json_object=True), text) for text in ("", '{"a": "')]
        if {"choice", "regex"} & set(backend.capabilities.constraint_kinds):
            cases += [(self.choice_params(backend, NON_ASCII_CHOICES[0]), text) for text in ("", "caf")]
        if not cases:
            skip_not_declared("the backend declares none of json_object, choice and regex")
        for params, text in cases:
            matcher = backend.matcher(backend.compile(params))
            matcher.accept_tokens(bundled_tokenizer().encode(text, add_special_tokens=False))
            allowed = allowed_tokens(self.fill(backend, matcher), 0, vocab_size)
            padded = allowed[allowed >= len(bundled_tokenizer())]
            assert len(allowed) and not len(padded), (
                f"{params.field_path} after {text!r}: allowed ids past the tokenizer ({len(bundled_tokenizer())} "
                f"tokens, logits {vocab_size} wide): {padded[:5].tolist()}"
            )

    def test_a_terminated_matcher_accepts_nothing(self, backend: StructuredOutputBackend) -> None:
        """After its stop token a matcher accepts nothing (the runner never asks it for a bitmask again)."""
        matcher = self.choice_matcher(backend, ["yes", "no"])
        tokens = bundled_tokenizer().encode("yes", add_special_tokens=False)
        stop = backend.stop_token_ids[0]
        assert matcher.accept_tokens([*tokens, stop]) == len(tokens) + 1 and matcher.is_terminated()
        assert matcher.accept_tokens(tokens[:1]) == 0, "a terminated matcher accepted a token"
        assert matcher.accept_tokens([stop]) == 0, "a terminated matcher accepted a second stop token"

    # -- compiling ------------------------------------------------------------------------------

    def _typical_constraints(self, backend: StructuredOutputBackend) -> list[StructuredOutputParams]:
        every = [
            StructuredOutputParams(regex=REGEXES[2]),
            StructuredOutputParams(choice=CHOICES[1]),
            StructuredOutputParams(json_schema=SCHEMAS[1]),
            StructuredOutputParams(json_object=True),
            StructuredOutputParams(grammar='root ::= item ("," item)*\nitem ::= "a" | "bb" | [0-9]'),
        ]
        return [params for params in every if params.kind in backend.capabilities.constraint_kinds]

    def test_compiles_within_the_time_bound(self, backend: StructuredOutputBackend) -> None:
        """A request waits for its grammar before its first token: a slow compile makes the whole run slow.

        The bound is :attr:`compile_time_bound` seconds per constraint (``patchbay check`` reads
        ``PATCHBAY_TEST_STRUCTURED_OUTPUT_COMPILE_BOUND``).
        """
        bound = float(os.environ.get(COMPILE_BOUND_ENV, self.compile_time_bound))
        for params in self._typical_constraints(backend):
            started = time.perf_counter()
            backend.compile(params)
            took = time.perf_counter() - started
            assert took <= bound, (
                f"compiling {params.field_path} {params.spec[:60]!r} took {took:.1f} s, over the kit's compile "
                f"bound of {bound:g} s ({COMPILE_BOUND_ENV}): requests wait that long for their first token"
            )

    def test_concurrent_compiles_give_the_grammars_of_sequential_ones(self, backend: StructuredOutputBackend) -> None:
        """``compile`` may run on several threads at once, for different constraints."""
        constraint_sets = [[f"{word}-{index}" for word in ("alpha", "beta", "gamma")] for index in range(8)]
        params = [self.choice_params(backend, choices) for choices in constraint_sets]
        barrier = threading.Barrier(len(params))

        def compile_together(one: StructuredOutputParams) -> Any:
            barrier.wait()
            return backend.compile(one)

        with ThreadPoolExecutor(max_workers=len(params)) as pool:
            grammars = list(pool.map(compile_together, params))
        tokenizer = bundled_tokenizer()
        for choices, one, grammar in zip(constraint_sets, params, grammars, strict=True):
            concurrent, sequential = backend.matcher(grammar), backend.matcher(backend.compile(one))
            tokens = tokenizer.encode(choices[1], add_special_tokens=False)
            assert concurrent.accept_tokens(tokens) == len(tokens) and concurrent.is_accepting(), (
                f"a grammar compiled concurrently with others does not accept its own choice {choices[1]!r} "
                "(compile is not thread-safe)"
            )
            sequential.accept_tokens(tokens)
            assert np.array_equal(self.fill(backend, concurrent), self.fill(backend, sequential))

    @pytest.mark.parametrize(
        "constraint",
        [{"regex": "(("}, {"grammar": "root ::= ("}, {"json_schema": {"type": "no-such-type"}}],
        ids=["regex", "grammar", "json_schema"],
    )
    def test_invalid_constraints_raise(self, backend: StructuredOutputBackend, constraint: dict[str, Any]) -> None:
        params = StructuredOutputParams(**constraint)
        if params.kind not in backend.capabilities.constraint_kinds:
            skip_not_declared(f"the backend does not declare {params.field_path}")
        with pytest.raises(Exception) as raised:
            backend.compile(params)
        assert str(raised.value).strip(), "the compile error must say what is wrong"
