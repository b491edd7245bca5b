"""Conformance suite for structured-output (grammar) backends, against oracles that know nothing of grammars.

A backend author's test file::

    from patchbay.testing import StructuredOutputSuite

    class TestMyBackend(StructuredOutputSuite):
        plugin_name = "my_backend"

The suite builds the backend over the bundled model's tokenizer (a
byte-level BPE of 49,152 tokens) and walks matchers token by token:

- regexes and choices: at every step, the bitmask must allow exactly the
  tokens whose bytes keep the output a prefix of some match, as the ``regex``
  package's partial matching says (``regex.fullmatch(p, text, partial=True)``),
  and allow the stop token exactly where the output is a full match;
- JSON schemas: valid instances (checked with ``jsonschema``), tokenized,
  must be accepted token by token with the stop token allowed exactly where the
  text so far is itself a valid instance; invalid ones must be refused; random
  walks through the bitmask that end must parse and validate;
- rollback restores the bitmask and the accepting state of every earlier
  step; a rejected token changes nothing; rows are written whole and alone.

Options for ``patchbay check`` come from ``PATCHBAY_TEST_STRUCTURED_OUTPUT_OPTIONS`` (JSON).
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Sequence
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
from patchbay.testing.suite import PluginSuite, _replace

OPTIONS_ENV = "PATCHBAY_TEST_STRUCTURED_OUTPUT_OPTIONS"
SEED = 20241201

REGEXES = (
    r"[0-9]{3}-[a-z]{2,4}",
    r"(yes|no|maybe)!?",
    r"-?[1-9][0-9]{0,3}\.[0-9]{2}",
    r"[A-Z][a-z]{1,6}( [A-Z][a-z]{1,6}){0,2}",
)
CHOICES = (["positive", "negative", "neutral"], ["Paris", "Par", "Lyon", "Lille"])
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


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's reversible byte <-> printable character table (printable bytes map to themselves)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars = {byte: chr(byte) for byte in printable}
    shifted = 0
    for byte in range(256):
        if byte not in chars:
            chars[byte] = chr(256 + shifted)
            shifted += 1
    return {char: byte for byte, char in chars.items()}


@cache
def bundled_tokenizer() -> Any:
    from transformers import AutoTokenizer

    from patchbay.worker.model.model_loader import resolve_model_dir

    return AutoTokenizer.from_pretrained(resolve_model_dir("default"))


@cache
def token_bytes(vocab_size: int) -> tuple[bytes | None, ...]:
    """Each token id's bytes in the bundled tokenizer; ``None`` for special tokens and ids past the tokenizer."""
    tokenizer = bundled_tokenizer()
    alphabet = _byte_level_alphabet()
    special = set(tokenizer.all_special_ids) | {int(i) for i in getattr(tokenizer, "added_tokens_decoder", {})}
    found: list[bytes | None] = []
    for token_id in range(vocab_size):
        token = tokenizer.convert_ids_to_tokens(token_id) if token_id < len(tokenizer) else None
        if token is None or token_id in special:
            found.append(None)
        elif all(char in alphabet for char in token):
            found.append(bytes(alphabet[char] for char in token))
        else:
            found.append(tokenizer.decode([token_id]).encode())
    return tuple(found)


def allowed_tokens(bitmask: np.ndarray, row: int, vocab_size: int) -> np.ndarray:
    """Token ids whose bit is set in ``bitmask[row]``."""
    bits = np.unpackbits(np.ascontiguousarray(bitmask[row]).view(np.uint8), bitorder="little")
    return np.flatnonzero(bits[:vocab_size])


class _PrefixOracle:
    """Which texts are prefixes of a match, and which are matches, of a byte regex (``regex`` partial matching)."""

    def __init__(self, pattern: str) -> None:
        import regex

        self._pattern = regex.compile(pattern.encode())

    def is_prefix(self, text: bytes) -> bool:
        return self._pattern.fullmatch(text, partial=True) is not None

    def is_match(self, text: bytes) -> bool:
        return self._pattern.fullmatch(text) is not None

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
        return json.loads(os.environ.get(OPTIONS_ENV, "{}"))

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
            pytest.skip(f"the backend does not declare {params.field_path}")
        return backend.matcher(backend.compile(params))

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
            allowed = set(allowed_tokens(self.fill(backend, matcher), 0, backend.vocab_size).tolist())
            expected = oracle.allowed(text, vocabulary)
            context = f"after {text!r} (step {step}) for pattern {pattern!r}"
            wrongly_allowed = sorted((allowed - expected) - {stop})[:5]
            assert not wrongly_allowed, (
                f"{context}: allowed tokens that break the match: {[(t, vocabulary[t]) for t in wrongly_allowed]}"
            )
            wrongly_refused = sorted(expected - allowed)[:5]
            if wrongly_refused and backend.capabilities.canonical_forced_tokens:
                self._assert_forced(allowed - {stop}, expected, vocabulary, context)
            else:
                assert not wrongly_refused, (
                    f"{context}: refused tokens that keep a match possible: "
                    f"{[(t, vocabulary[t]) for t in wrongly_refused]}"
                )
            complete = oracle.is_match(text)
            assert (stop in allowed) == complete, (
                f"{context}: stop token allowed={stop in allowed}, full match={complete}"
            )
            assert matcher.is_accepting() == complete, f"{context}: is_accepting() disagrees with the full match"
            choices = sorted(allowed - {stop})
            if not choices or (complete and rng.random() < 0.3):
                assert matcher.accept_tokens([stop]) == 1 and matcher.is_terminated()
                return
            token = rng.choice(choices)
            assert matcher.accept_tokens([token]) == 1, f"{context}: the matcher refused token {token} it allowed"
            assert not matcher.is_terminated()
            text += vocabulary[token] or b""

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

    @pytest.mark.parametrize("choices", CHOICES, ids=["words", "shared-prefixes"])
    def test_choice_bitmask_matches_partial_matching(
        self, backend: StructuredOutputBackend, choices: list[str]
    ) -> None:
        for walk in range(3):
            self._walk_against_oracle(
                backend, self.matcher_for(backend, choice=choices), _choice_pattern(choices), SEED + walk
            )

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
            pytest.skip("the backend declares no rollback")
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

    def test_matchers_of_one_grammar_are_independent(self, backend: StructuredOutputBackend) -> None:
        grammar = backend.compile(StructuredOutputParams(regex=REGEXES[0]))
        first, second = backend.matcher(grammar), backend.matcher(grammar)
        fresh = self.fill(backend, second)
        assert first.accept_tokens(bundled_tokenizer().encode("12", add_special_tokens=False)) >= 1
        assert np.array_equal(self.fill(backend, second), fresh)

    def test_ids_past_the_tokenizer_are_never_allowed(
        self, available: type[StructuredOutputBackend], backend_options: dict[str, Any]
    ) -> None:
        vocab_size = len(bundled_tokenizer()) + 64  # models often pad their logits past the tokenizer
        backend = self.build(available, backend_options, vocab_size)
        assert backend.bitmask_width == -(-vocab_size // 32)
        matcher = backend.matcher(backend.compile(StructuredOutputParams(json_object=True)))
        for text in ("", '{"a": "'):
            matcher.accept_tokens(bundled_tokenizer().encode(text, add_special_tokens=False))
            allowed = allowed_tokens(self.fill(backend, matcher), 0, vocab_size)
            assert len(allowed) and allowed.max() < len(bundled_tokenizer()), (
                f"after {text!r}: ids past the tokenizer allowed"
            )

    @pytest.mark.parametrize(
        "constraint",
        [{"regex": "(("}, {"grammar": "root ::= ("}, {"json_schema": {"type": "no-such-type"}}],
        ids=["regex", "grammar", "json_schema"],
    )
    def test_invalid_constraints_raise(self, backend: StructuredOutputBackend, constraint: dict[str, Any]) -> None:
        params = StructuredOutputParams(**constraint)
        if params.kind not in backend.capabilities.constraint_kinds:
            pytest.skip(f"the backend does not declare {params.field_path}")
        with pytest.raises(Exception) as raised:
            backend.compile(params)
        assert str(raised.value).strip(), "the compile error must say what is wrong"
